"""``ProgressTracker``: the epoch clock of a collaborative run.

Each peer tells the swarm how far it got (its epoch, the samples it accumulated towards the
next one, its speed) and reads what the others said, to know when the swarm as a whole has
processed ``target_batch_size`` samples and the epoch should end::

    tracker = ProgressTracker(dht, "my_run", target_batch_size=4096, start=True)
    tracker.report_local_progress(local_epoch, samples_accumulated)
    if tracker.ready_to_update_epoch:
        with tracker.pause_updates():
            ...                                   # average, step
            local_epoch = tracker.update_epoch(local_epoch + 1)

Both loops (publishing and reading) run as tasks on the process's event loop thread: no
thread per tracker. Each record is signed by this peer's own identity (the DHT peer's by
default), so several peers in one process keep separate records; hivemind signs with one
key per process, so two in-process peers overwrite each other's progress.

Reading happens more often as the estimated end of the epoch nears (see
:func:`~.progress.aggregate_progress`). A report is published at once when this peer's
epoch changes, when the others' extrapolation of its last record (samples plus rate times
age) would be off by more than ``report_tolerance`` of the target, and at least every
``metadata_expiration / 2`` seconds; a peer at a steady pace says little more than
"epoch e began, I do r samples/s".

A record's ``time`` is when its samples were counted (the others extrapolate from it);
its DHT expiration is ``metadata_expiration`` after it was *stored*. So the periodic
keepalive of an unchanged record renews its life without making its samples look fresh,
and a peer that reports nothing (a keeper, an idle peer) stays counted while it runs, as
hivemind's reporter does (it stores each report to expire ``metadata_expiration`` after
the store).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.dht import DHT
from swarmgrad.dht.schema import SchemaValidator
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.net.identity import Identity
from swarmgrad.optim.peer_record import PeerRecord
from swarmgrad.optim.performance_ema import PerformanceEMA
from swarmgrad.optim.progress import (
    GlobalTrainingProgress,
    LocalTrainingProgress,
    ProgressRules,
    TrainingProgressSchema,
    aggregate_progress,
)
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import get_loop, run_coroutine
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["ProgressTracker"]

logger = logging.getLogger(__name__)


class ProgressTracker:
    """Publishes this peer's progress under ``f"{prefix}_progress"`` and derives the swarm's.

    Arguments (hivemind's names): ``dht``, ``prefix`` (the run id), ``target_batch_size``
    (samples per global epoch); ``client_mode`` (default: the DHT's); the refresh periods
    and drift expectations of :class:`~.progress.ProgressRules`;
    ``performance_ema_alpha``; ``metadata_expiration`` (how long a record lives);
    ``status_loglevel``; ``private_key``: the :class:`~swarmgrad.net.identity.Identity`
    that owns and signs this peer's record (default: the DHT peer's identity);
    ``start``. ``daemon`` is accepted and ignored (no thread is started).

    ``read_quorum`` (not in hivemind): how many replicas of the progress key a read
    merges (``DHTNode.get``'s ``quorum``; None, the default: all of them, as hivemind
    reads). Every peer stores its record on all replicas and rewrites it while it
    trains, so two copies (this node's own, when it is a replica, and one other at
    random) miss a record only when both stores failed, until the next one. DiLoCo reads
    with 2: a streaming peer reads ~40 times a minute, and reading every replica was most
    of its DHT traffic. The synchronous Optimizer does not: with epochs of one step per
    peer, in the slow-links lab, quorum reads saw 3 of 4 peers in 12 of ~100 reads and
    epochs ran ~16% more samples (fewer, larger rounds: held-out loss +3%).
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool | None = None,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10,
        default_refresh_period: float = 3,
        expected_drift_peers: float = 3,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        status_loglevel: int = logging.DEBUG,
        private_key: Identity | None = None,
        daemon: bool = True,
        start: bool,
        read_quorum: int | None = None,
        **rules: Any,
    ):
        if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int):
            raise ValidationError(f"target_batch_size must be an int, got {target_batch_size!r}")
        if target_batch_size <= 0:
            raise ValidationError(f"target_batch_size must be positive, got {target_batch_size}")
        if not isinstance(prefix, str) or not prefix:
            raise ValidationError(f"prefix (the run id) must be a non-empty str, got {prefix!r}")
        for name, value in (
            ("min_refresh_period", min_refresh_period),
            ("max_refresh_period", max_refresh_period),
            ("default_refresh_period", default_refresh_period),
            ("metadata_expiration", metadata_expiration),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValidationError(f"{name} must be a positive number, got {value!r}")
        for name, value in rules.items():
            if name not in ProgressRules.__dataclass_fields__:
                raise ValidationError(f"unknown ProgressTracker option {name!r}")
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (0 <= value < math.inf)
            ):
                raise ValidationError(f"{name} must be a non-negative number, got {value!r}")
        if read_quorum is not None and (
            isinstance(read_quorum, bool) or not isinstance(read_quorum, int) or read_quorum < 1
        ):
            raise ValidationError(
                f"read_quorum must be a positive int or None, got {read_quorum!r}"
            )
        if min_refresh_period > max_refresh_period:
            raise ValidationError(
                f"min_refresh_period ({min_refresh_period}) exceeds max_refresh_period "
                f"({max_refresh_period})"
            )
        if dht.peer is None:
            raise ValidationError("the DHT is not running: start it before the ProgressTracker")
        self.dht, self.prefix = dht, prefix
        self.client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self._target_batch_size = target_batch_size
        self.training_progress_key = f"{prefix}_progress"
        self.metadata_expiration = float(metadata_expiration)
        self.read_quorum = read_quorum
        self.status_loglevel = status_loglevel
        self.rules = ProgressRules(
            min_refresh_period=float(min_refresh_period),
            max_refresh_period=float(max_refresh_period),
            default_refresh_period=float(default_refresh_period),
            expected_drift_peers=float(expected_drift_peers),
            expected_drift_rate=float(expected_drift_rate),
            **rules,
        )
        self.performance_ema = PerformanceEMA(alpha=performance_ema_alpha)
        identity = private_key if private_key is not None else dht.peer.identity
        signer = Ed25519SignatureValidator(identity)
        self._local_public_key = signer.local_public_key
        dht.add_validators([SchemaValidator(TrainingProgressSchema, prefix=prefix), signer])

        self._lock = threading.Lock()  # guards local and global progress
        self._paused = 0
        self._last_read_failed = True  # nothing read yet
        self._last_increment = 0  # samples of our last step: the grain of others' guesses
        self._distrusted: set[bytes] = set()
        self._last_records: dict[bytes, LocalTrainingProgress] = {}
        self._whole_read_at = -math.inf  # DHT time of the last whole read (_view_after_read)
        # (epoch, DHT time this peer saw it begin): claims of samples are checked against it
        self._epoch_began = (0, get_dht_time())
        self._observing_since = get_dht_time()  # reset when the tracker starts
        self.local_progress = self._make_local_progress(0, 0)
        self.global_progress = GlobalTrainingProgress(
            epoch=0,
            samples_accumulated=0,
            target_batch_size=target_batch_size,
            num_peers=1,
            num_clients=int(self.client_mode),
            eta_next_epoch=math.inf,
            next_fetch_time=get_dht_time(),
            estimated_at=get_dht_time(),
        )
        self.fetched_global_progress_this_epoch = threading.Event()
        # the record the reporter published last (or is publishing): a report that adds
        # nothing to it does not wake the loop thread (see report_local_progress)
        self._published: LocalTrainingProgress | None = None
        self._report_now: asyncio.Event | None = None
        self._fetch_now: asyncio.Event | None = None
        self._record = PeerRecord(
            dht,
            self.training_progress_key,
            self._local_public_key,
            self.metadata_expiration,
            f"the progress record of {prefix}",
        )
        if start:
            self.start()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Begin publishing and reading progress; returns once the first read is done."""
        if self._record.task is not None:
            raise ValidationError("this ProgressTracker is already running")
        ready = threading.Event()
        self._observing_since = get_dht_time()
        task = self._record.start(self._run(ready))
        while not ready.wait(0.1):
            if task.done():
                task.result()  # raises what stopped it
                break

    def is_alive(self) -> bool:
        return self._record.is_alive()

    def run(self) -> None:
        """hivemind's thread body: start (unless running) and block until
        :meth:`shutdown` is called from another thread."""
        if self._record.task is None:
            self.start()
        with contextlib.suppress(concurrent.futures.CancelledError):
            self._record.task.result()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop, and tell the others this peer left (a None record, its goodbye)."""
        self._record.withdraw(timeout if timeout is not None else self.metadata_expiration)

    # ------------------------------------------------------------------ reading

    @property
    def global_epoch(self) -> int:
        return self.global_progress.epoch

    @property
    def target_batch_size(self) -> int:
        """Samples per epoch; may change while training (DiLoCo counts H steps per peer)."""
        return self._target_batch_size

    @target_batch_size.setter
    def target_batch_size(self, value: int) -> None:
        positive_int("target_batch_size", value)
        with self._lock:
            if value == self._target_batch_size:
                return
            self._target_batch_size = value
            # the estimate of the epoch's end was made for the old target: until the next
            # read it could declare the epoch due (benchmarks/slow_links.py: a DiLoCo peer
            # that had just counted 4 peers ran its outer step on the ETA for 1)
            self._aggregate_locked()

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether this peer may move to the next epoch now."""
        progress = self.global_progress
        return (
            progress.epoch > self.local_progress.epoch
            or progress.samples_accumulated >= self.target_batch_size
            or get_dht_time() >= progress.eta_next_epoch
        )

    @property
    def estimated_next_update_time(self) -> float:
        """DHT time at which this peer should move to the next epoch."""
        if self.ready_to_update_epoch:
            return get_dht_time()
        return self.global_progress.eta_next_epoch

    def distrust_epochs_above(self, epoch: int) -> None:
        """No donor could serve a state newer than ``epoch``: peers that claim an epoch
        beyond ``epoch + 1`` made it up (or serve no state). From now on their claims
        count only up to our own epoch, so they cannot keep us downloading state."""
        with self._lock:
            liars = {
                key
                for key, r in self._last_records.items()
                if r.epoch > epoch + 1 and key not in self._distrusted
            }
            if liars:
                logger.warning(
                    "%s: %d peer(s) claim epochs beyond %d that no donor can serve; their "
                    "epoch claims are capped from now on",
                    self.prefix,
                    len(liars),
                    epoch + 1,
                )
            self._distrusted |= liars
            # at once, even inside pause_updates: until the next read the optimizer would
            # otherwise still see the claimed epoch and download state again for it
            self._aggregate_locked()
        self.request_fetch()

    # ------------------------------------------------------------------ writing

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """This peer is at ``local_epoch`` with ``samples_accumulated`` samples towards the
        next one; tell the swarm (soon, from the loop thread)."""
        with self._lock:
            extra = samples_accumulated - self.local_progress.samples_accumulated
            if (
                update_global_samples
                and local_epoch == self.local_progress.epoch == self.global_progress.epoch
            ):
                self.global_progress.samples_accumulated = max(
                    0, self.global_progress.samples_accumulated + extra
                )
            if extra > 0:
                self.performance_ema.update(task_size=extra)
                self._last_increment = extra
            else:
                self.performance_ema.reset_timer()
            self.local_progress = self._make_local_progress(local_epoch, samples_accumulated)
            # the reporter would look at this report, find nothing the others cannot work
            # out from our last record, and go back to sleep: at a steady pace that is
            # most steps, and waking the loop thread for it cost more (a cross-thread
            # wake-up and a GIL hand-off, ~0.7 ms of a step on the 2-core box) than the
            # rest of the step's bookkeeping; the keepalive still runs on its timer
            worth_it = self._worth_publishing(self._published)
        if worth_it:
            self._set_soon("_report_now")

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        """Freeze the global progress (reads are not applied) and the speed estimate
        while the block runs: the epoch transition happens inside it."""
        with self._lock:
            self._paused += 1
        try:
            with self.performance_ema.pause():
                yield
        finally:
            with self._lock:
                self._paused -= 1

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """Move this peer to ``new_epoch`` (default: the next) with no samples yet; call it
        inside :meth:`pause_updates`."""
        if not self._paused:
            raise ValidationError("update_epoch must be called inside pause_updates()")
        with self._lock:
            if new_epoch is None:
                new_epoch = self.local_progress.epoch + 1
            if new_epoch > self.global_progress.epoch:
                self.global_progress.epoch = new_epoch
                self.global_progress.samples_accumulated = 0
                self.global_progress.eta_next_epoch = math.inf
                self.global_progress.samples_estimated = 0.0
                self.global_progress.estimated_at = get_dht_time()
            if new_epoch != self._epoch_began[0]:
                self._epoch_began = (new_epoch, get_dht_time())
        self.report_local_progress(new_epoch, 0)
        self.fetched_global_progress_this_epoch.clear()
        return new_epoch

    def refresh(self, timeout: float | None = None) -> GlobalTrainingProgress:
        """Read the swarm's progress now and wait for it (outside pause_updates)."""
        run_coroutine(self._fetch_once(), timeout=timeout)
        return self.global_progress

    def peers_ahead_of(
        self, epoch: int, timeout: float | None = None, *, refresh: bool = True
    ) -> int:
        """Count the other peers whose live records claim an epoch beyond ``epoch``
        (distrusted peers and records from the future left out), after reading the swarm
        now unless ``refresh=False``. Works inside :meth:`pause_updates`: it is how a peer
        that cannot find a donor learns that the peers it was catching up with have left."""
        if refresh:
            run_coroutine(self._fetch_once(), timeout=timeout)
        with self._lock:
            return sum(
                1
                for key, record in self._others_in_last_read()
                if key not in self._distrusted and record.epoch > epoch
            )

    def others_left(self) -> bool:
        """Whether the last read of the swarm (a successful one, made even inside
        :meth:`pause_updates`, and holding our own record) has no live record of any
        other peer: every peer we counted said goodbye or expired. A peer whose last
        partner left mid-epoch was waiting out ``averaging_timeout`` for a group that
        could no longer form."""
        with self._lock:
            # a read that misses our own record (a lookup that timed out inside the DHT,
            # or returned before reaching the replicas) proves nothing about the others
            if self._last_read_failed or self._local_public_key not in self._last_records:
                return False
            return not self._others_in_last_read()

    def _others_in_last_read(self) -> list[tuple[bytes, LocalTrainingProgress]]:
        """The other peers' records of the last read, those from the future left out
        (hold the lock)."""
        horizon = get_dht_time() + self.rules.max_time_skew
        return [
            (key, record)
            for key, record in self._last_records.items()
            if key != self._local_public_key and record.time <= horizon
        ]

    def _aggregate_locked(self) -> None:
        """Recompute the global progress from the last records read (hold the lock)."""
        self.global_progress = aggregate_progress(
            self._last_records,
            local_key=self._local_public_key,
            local=self.local_progress,
            target_batch_size=self.target_batch_size,
            now=get_dht_time(),
            epoch_started_at=self._epoch_began[1],
            distrusted=frozenset(self._distrusted),
            rules=self.rules,
            observing_since=self._observing_since,
            read_failed=self._last_read_failed,
        )
        if self.global_progress.epoch != self._epoch_began[0]:
            # a new epoch (or the end of a believed lie): samples count from now
            self._epoch_began = (self.global_progress.epoch, get_dht_time())

    def request_fetch(self) -> None:
        """Read the swarm's progress now rather than at the next scheduled time."""
        self._set_soon("_fetch_now")

    # ------------------------------------------------------------------ internals

    def _make_local_progress(self, epoch: int, samples: int) -> LocalTrainingProgress:
        return LocalTrainingProgress(
            peer_id=self.dht.peer_id.to_bytes(),
            epoch=int(epoch),
            samples_accumulated=int(samples),
            samples_per_second=float(self.performance_ema.samples_per_second),
            time=float(get_dht_time()),
            client_mode=self.client_mode,
        )

    def _set_soon(self, name: str) -> None:
        event = getattr(self, name)
        if event is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
                get_loop().call_soon_threadsafe(event.set)

    async def _run(self, ready: threading.Event) -> None:
        self._report_now, self._fetch_now = asyncio.Event(), asyncio.Event()
        try:
            await self._fetch_once()
        finally:
            ready.set()
        stopper = asyncio.ensure_future(self._record.stop.wait())
        try:
            async with asyncio.TaskGroup() as group:
                reporter = group.create_task(self._reporter())
                fetcher = group.create_task(self._fetcher())
                await stopper
                reporter.cancel()
                fetcher.cancel()
        finally:
            stopper.cancel()
            logger.log(self.status_loglevel, "%s: no longer tracking progress", self.prefix)

    def _others_would_guess(self, published: LocalTrainingProgress, now: float) -> float:
        """The samples the others extrapolate for us from our last published record (they
        add its rate times its age, see :func:`~.progress.aggregate_progress`)."""
        age = min(max(0.0, now - published.time), self.rules.max_extrapolation)
        return published.samples_accumulated + published.samples_per_second * age

    def _worth_publishing(self, published: LocalTrainingProgress | None) -> bool:
        """Whether our progress says something the others cannot work out: a new epoch,
        samples when our last record gave no rate to extrapolate from, or samples that
        their extrapolation misses by more than ``report_tolerance`` of the target (and by
        more than one of our steps, the grain of a smooth guess of a stepwise count). A
        peer at a steady pace thus publishes a few times per epoch instead of once per
        step near its end, where a record per step was most of the bytes a DiLoCo peer
        sent (benchmarks/slow_links.py)."""
        progress = self.local_progress
        if published is None or progress.epoch != published.epoch:
            return True
        if published.samples_per_second == 0:
            return progress.samples_accumulated != published.samples_accumulated
        guess = self._others_would_guess(published, progress.time)
        tolerance = max(self._last_increment, self.rules.report_tolerance * self.target_batch_size)
        return abs(progress.samples_accumulated - guess) > tolerance

    async def _reporter(self) -> None:
        assert self._report_now is not None
        loop = asyncio.get_running_loop()
        self._report_now.set()  # say hello at once: joiners are counted from the start
        keepalive = self.metadata_expiration / 2
        published: LocalTrainingProgress | None = None
        published_at = -math.inf
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, published_at + keepalive - loop.time())):
                    await self._report_now.wait()
            self._report_now.clear()
            if loop.time() < published_at + keepalive and not self._worth_publishing(published):
                continue
            progress = self.local_progress
            node = self.dht.node
            if node is None:
                return
            self._published = progress  # reports from now on are measured against it
            try:
                async with asyncio.timeout(keepalive):
                    await node.store(
                        self.training_progress_key,
                        progress.model_dump(),
                        # the record's `time` is when its samples were counted (others
                        # extrapolate from it); its life runs from now: a keepalive of an
                        # unchanged record renews it, so a peer that never steps stays
                        expiration_time=get_dht_time() + self.metadata_expiration,
                        subkey=self._local_public_key,
                    )
            except (Exception, TimeoutError) as e:
                logger.debug("%s: publishing progress failed: %r", self.prefix, e)
            published, published_at = progress, loop.time()

    async def _fetcher(self) -> None:
        assert self._fetch_now is not None
        while True:
            delay = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._fetch_now.wait()
            self._fetch_now.clear()
            await self._fetch_once()

    async def _fetch_once(self) -> None:
        node = self.dht.node
        if node is None:
            return
        failed = False
        try:
            async with asyncio.timeout(max(self.rules.max_refresh_period, 5.0)):
                found = await node.get(
                    self.training_progress_key, latest=True, quorum=self.read_quorum
                )
        except (Exception, TimeoutError) as e:
            logger.debug("%s: reading progress failed: %r", self.prefix, e)
            found, failed = None, True
        records = _parse_records(found)
        with self._lock:
            self._last_records = self._view_after_read(records, failed or node.isolated)
            self._last_read_failed = failed
            if self._paused:
                # the optimizer is moving between epochs: read again right after it
                self.global_progress.next_fetch_time = (
                    get_dht_time() + self.rules.min_refresh_period
                )
                return
            self._aggregate_locked()
        self.fetched_global_progress_this_epoch.set()
        progress = self.global_progress
        logger.log(
            self.status_loglevel,
            "%s: epoch %d, %d/%d samples from %d peers, ETA %.2f s",
            self.prefix,
            progress.epoch,
            progress.samples_accumulated,
            self.target_batch_size,
            progress.num_peers,
            progress.eta_next_epoch - get_dht_time(),
        )

    def _view_after_read(
        self, records: dict[bytes, LocalTrainingProgress], partial: bool
    ) -> dict[bytes, LocalTrainingProgress]:
        """The records to count after a read (hold the lock).

        A read that failed, that missed our own record (it did not reach the replicas),
        or that our isolated DHT node answered from its own storage, says nothing about
        who left: the peer whose links went down is usually the one cut off, not the
        swarm. Taking such a read as the swarm made a peer whose links came back after
        20 s count itself alone, and a lone peer skips the rounds: it ran 27 epochs in
        7 s on its own gradients, and the swarm then took its state (benchmarks/chaos.py).
        So the records of the last whole read stay counted, updated by whatever the
        partial read found, for up to twice ``metadata_expiration`` (the life of a record
        that is not renewed); a peer cut off for longer counts itself alone, as before."""
        now = get_dht_time()
        if not partial and self._local_public_key in records:
            self._whole_read_at = now
            return records
        if now - self._whole_read_at <= 2 * self.metadata_expiration:
            return {**self._last_records, **records}
        return records

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.prefix!r}, local epoch {self.local_progress.epoch}, "
            f"global epoch {self.global_epoch})"
        )


def _parse_records(found: Any) -> dict[bytes, LocalTrainingProgress]:
    """subkey -> record for every well-formed record (goodbyes and junk left out)."""
    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        return {}
    records = {}
    for subkey, entry in found.value.items():
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if not isinstance(subkey, bytes) or not isinstance(value, dict):
            continue
        try:
            records[subkey] = LocalTrainingProgress.model_validate(value, strict=True)
        except Exception:
            continue
    return records
