"""``EpochMachinery``: the swarm's epoch clock as every collaborative optimizer uses it.

:class:`~.optimizer.Optimizer` and :class:`~.diloco.DiLoCoOptimizer` differ in what
they average (gradients and state; pseudo-gradients by fragment) and in how the result
is applied. Everything else is the same job, done here once: following the swarm's
epoch through the :class:`~.progress_tracker.ProgressTracker`, deciding when a peer is
behind and must load the swarm's state (and loading it), moving to the next epoch,
offering the state to joiners, waiting for a round without waiting for nobody, the
metrics record, and leaving. An optimizer's ``step`` asks it a few questions
(:meth:`should_load_state`, :meth:`look_again_if_alone`, :meth:`round_start`) and
tells it a few facts (:meth:`enter_epoch`, :meth:`mark_left_behind`).

Composition rather than a base class: see ``docs/design-notes.md`` ("One epoch
machinery").
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.metrics import MetricsPublisher, is_scalar_loss
from swarmgrad.optim.progress_tracker import ProgressTracker
from swarmgrad.optim.state_averager import TrainingStateAverager
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["EpochMachinery", "must_load_state"]

logger = logging.getLogger(__name__)

#: how often a wait for a round looks at the swarm
_POLL = 0.25


def must_load_state(local_epoch: int, global_epoch: int, *, fresh_read: bool) -> bool:
    """The one rule for a peer's epoch against the swarm's: load the swarm's state when
    this peer is behind it. Once per epoch, on a read of the swarm made in this epoch,
    behind means any epoch behind; otherwise only more than one (the others may have
    just moved and this peer be about to move with them).

    Being *ahead* is never a reason to load: the swarm's epoch is the highest any peer
    that shares its state claims, this peer's own included, so a peer can be ahead only
    of a stale count, and a download would throw away updates that no donor holds
    (others catch up with it instead)."""
    if fresh_read:
        return local_epoch < global_epoch
    return local_epoch < global_epoch - 1


class EpochMachinery:
    """The epoch machinery of one collaborative optimizer (module docstring).

    It shares the optimizer's ``tracker`` and ``state_averager`` (whose ``local_epoch``
    is this peer's epoch and which serves the state to joiners) and owns the decisions
    around them. ``catch_up_without_state``: after a download that brought a state one
    epoch older than the swarm's, move to the swarm's epoch anyway (gradient averaging:
    the next state round brings the one missing update) rather than try again at the
    next check (DiLoCo: a synced copy one outer step old would differ from every other
    peer's, and the donors offer the newer one as soon as their rounds merge)."""

    def __init__(
        self,
        *,
        run_id: str,
        tracker: ProgressTracker,
        state_averager: TrainingStateAverager,
        client_mode: bool,
        matchmaking_time: float,
        averaging_timeout: float,
        load_state_timeout: float,
        catch_up_without_state: bool,
        status_loglevel: int = logging.DEBUG,
    ):
        self.run_id, self.tracker, self.state_averager = run_id, tracker, state_averager
        self.client_mode = client_mode
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.load_state_timeout = load_state_timeout
        self.catch_up_without_state = catch_up_without_state
        self.status_loglevel = status_loglevel
        self.metrics: MetricsPublisher | None = None
        self.closed = False
        self._check_on_fresh_read = True  # the once-per-epoch check is still to come
        self._left_behind = False  # a round showed that the others moved on without us

    # ------------------------------------------------------------------ reading

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch

    def is_synchronized(self) -> bool:
        """At most one epoch behind the swarm."""
        return not must_load_state(self.local_epoch, self.tracker.global_epoch, fresh_read=False)

    def alone(self) -> bool:
        return self.tracker.global_progress.num_peers <= 1

    def look_again_if_alone(self) -> bool:
        """About to average alone: read the swarm's progress once more (one DHT lookup),
        since peers that started with us may not be counted yet, and a lone epoch costs
        the swarm its sync. True if others are counted now."""
        if self.alone():
            try:
                self.tracker.refresh(timeout=self.matchmaking_time)
            except Exception as e:
                logger.debug("%s: refreshing progress failed: %r", self.run_id, e)
        return not self.alone()

    def round_start(
        self, scheduled: StepControl | None, due_time: float, averager: Any
    ) -> float | None:
        """When (DHT time) a new round of ``averager``, for what is due at ``due_time`` (DHT
        time), should begin: then, or after the averager's ``min_matchmaking_time`` if that
        is later. None while ``due_time`` is more than ``matchmaking_time`` away (too early
        to look for a group) or while ``scheduled`` still waits for its group (it is that
        round)."""
        now = get_dht_time()
        eta = due_time - now
        if eta > self.matchmaking_time:
            return None
        if scheduled is not None and not scheduled.triggered and not scheduled.done():
            return None
        return now + max(eta, averager._options["min_matchmaking_time"])

    # ------------------------------------------------------------------ deciding

    def mark_left_behind(self) -> None:
        """A round showed that the others finished this peer's epoch without it: load
        their state at the next check, not an epoch later."""
        self._left_behind = True

    @property
    def left_behind(self) -> bool:
        return self._left_behind

    def should_load_state(self) -> bool:
        """Whether this peer must load the swarm's state now (:func:`must_load_state`,
        checked on a fresh read once per epoch, or after :meth:`mark_left_behind`)."""
        if self._left_behind:
            return True
        fresh = (
            self._check_on_fresh_read and self.tracker.fetched_global_progress_this_epoch.is_set()
        )
        if fresh:
            self._check_on_fresh_read = False
        return must_load_state(self.local_epoch, self.tracker.global_epoch, fresh_read=fresh)

    # ------------------------------------------------------------------ acting

    def enter_epoch(self, epoch: int, *, offer_state: bool = True) -> None:
        """This peer is now at ``epoch`` (call inside ``tracker.pause_updates()``): the
        tracker publishes it, the once-per-epoch check is armed again, and (unless
        ``offer_state=False``) joiners are offered this epoch's state."""
        self.state_averager.local_epoch = epoch
        self.tracker.update_epoch(new_epoch=epoch)
        self._check_on_fresh_read = True
        if offer_state:
            self.offer_state()

    def offer_state(self) -> None:
        """Declare this peer's state, at its epoch, to joiners (client-mode peers cannot
        serve it)."""
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch

    def set_epoch(self, epoch: int) -> None:
        """A state restored by ``load_state_dict``: the tracker publishes its epoch at
        once, so that the swarm counts it (a peer restored ahead of the others is then
        the one they catch up with)."""
        with self.tracker.pause_updates():
            self.enter_epoch(int(epoch))

    def load_state(
        self,
        *,
        after: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """Download the freshest state of the run and continue from it. Retries until
        ``load_state_timeout``; stops early when no peer is ahead any more (those we
        were behind left). If the best donor is older than some peers claim, those
        claims are ignored from now on. ``after`` runs before the tracker is told the
        new epoch (still inside ``pause_updates``)."""
        self._left_behind = False
        deadline = time.monotonic() + self.load_state_timeout
        with self.tracker.pause_updates():
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    loaded = self.state_averager.load_state_from_peers(timeout=remaining, **kwargs)
                except ValidationError:
                    raise  # the run's state does not fit our model: retrying cannot help
                except Exception as e:
                    logger.warning("%s: loading state failed (%r), retrying", self.run_id, e)
                    loaded = None
                else:
                    if loaded is None and not self.tracker.peers_ahead_of(
                        self.local_epoch, timeout=remaining
                    ):
                        logger.log(
                            self.status_loglevel,
                            "%s: no donor answered and no peer is ahead any more; "
                            "continuing from our own state",
                            self.run_id,
                        )
                        break
                if loaded is not None:
                    break
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            else:
                logger.warning(
                    "%s: no state could be loaded within %.0f s; continuing from our own",
                    self.run_id,
                    self.load_state_timeout,
                )
            global_epoch = self.tracker.global_epoch
            if self.local_epoch < global_epoch - 1:
                # the best donor is older than what some peers claim: they cannot back it
                self.tracker.distrust_epochs_above(self.local_epoch)
            elif self.local_epoch < global_epoch and self.catch_up_without_state:
                logger.log(
                    self.status_loglevel, "%s: catching up with epoch %d", self.run_id, global_epoch
                )
                self.state_averager.local_epoch = global_epoch
                self.state_averager._update_scheduler()
            if after is not None:
                after()
            self.enter_epoch(self.local_epoch)

    def wait_for_round(self, control: StepControl, epoch: int, what: str = "round") -> Any:
        """The round's result, within ``averaging_timeout``. A round still looking for
        its group a matchmaking time after it saw peers past ``epoch``, or once every
        other peer has left (:meth:`others_left`), will never find one (rounds are
        tagged with the epoch): it is cancelled and None returned, rather than waited
        for (a peer that pays that wait every epoch never catches up). Not at once: with
        ``delay_grad_averaging`` a peer enters the next epoch while its round for this
        one still looks for its group in the background."""
        return self._wait(control, epoch, what, moved_on_ends_it=True)

    def wait_until_alone(self, control: StepControl, epoch: int, what: str = "round") -> Any:
        """Like :meth:`wait_for_round`, but a round still looking for its group is given
        up only once every other peer has left, not when some moved past ``epoch``: for
        a background state round (local updates), which slower peers of ``epoch`` may
        still join. Without it, the last peer of a swarm whose others all left (stopped
        with SIGTERM, say goodbye) waited out ``averaging_timeout`` before it could
        take its next step, or stop."""
        return self._wait(control, epoch, what, moved_on_ends_it=False)

    def _wait(self, control: StepControl, epoch: int, what: str, *, moved_on_ends_it: bool) -> Any:
        began = time.monotonic()
        deadline, asked = began + self.averaging_timeout, False
        ahead_since: float | None = None  # since when peers past ``epoch`` are seen
        while True:
            remaining = deadline - time.monotonic()
            try:
                return control.result(max(0.0, min(_POLL, remaining)))
            except concurrent.futures.TimeoutError:
                if control.done():
                    raise  # the round's own error
                if remaining <= _POLL:
                    raise TimeoutError(f"the {what} took over {self.averaging_timeout} s") from None
                if control.stage is not AveragingStage.LOOKING_FOR_GROUP:
                    continue
                if not asked and time.monotonic() - began > self.matchmaking_time:
                    # no group within a matchmaking time: read the swarm now (and, while
                    # the epoch ends, every min_refresh_period) to learn who is left
                    self.tracker.request_fetch()
                    asked = True
                # a peer that moved past the epoch may still be looking for this round's
                # group in the background (delay_grad_averaging), and its group forms up
                # to a matchmaking time after it began: it counts as gone only once it has
                # been seen ahead for a matchmaking time without meeting us
                moved_on = moved_on_ends_it and self.tracker.peers_ahead_of(epoch, refresh=False)
                if not moved_on:
                    ahead_since = None
                elif ahead_since is None:
                    ahead_since = time.monotonic()
                if moved_on and time.monotonic() - ahead_since > self.matchmaking_time:
                    control.cancel()
                    logger.log(
                        self.status_loglevel,
                        "%s: %d peer(s) finished epoch %d without us (%s)",
                        self.run_id, moved_on, epoch, what,
                    )  # fmt: skip
                    return None
                if self.others_left():
                    control.cancel()
                    logger.log(
                        self.status_loglevel,
                        "%s: every other peer left during epoch %d: no group to wait for (%s)",
                        self.run_id, epoch, what,
                    )  # fmt: skip
                    return None

    def others_left(self) -> bool:
        """Every other peer left, by the last read, if that read can tell: a read that
        merges only some replicas (DiLoCo's ``read_quorum``) may miss a live peer's
        record, and giving up a round on an absence it cannot vouch for splits the
        swarm."""
        return getattr(self.tracker, "read_quorum", None) is None and self.tracker.others_left()

    # ------------------------------------------------------------------ metrics

    def start_metrics(self, dht: DHT, metrics: bool | dict, collect: Callable[[], dict]) -> None:
        """Publish this peer's metrics record (``metrics``: True, False, or the
        publisher's options)."""
        if metrics:
            options = dict(metrics) if isinstance(metrics, dict) else {}
            self.metrics = MetricsPublisher(dht, self.run_id, collect, **options)

    def report_loss(self, loss: Any) -> None:
        if loss is not None and self.metrics is not None:
            self.metrics.report_loss(loss)

    def run_closure(self, closure: Callable[[], Any] | None) -> Any:
        """``step(closure)``'s first act: call the closure with gradients enabled and
        report its loss when it is a scalar; the loss, or None without a closure."""
        if closure is None:
            return None
        with torch.enable_grad():
            loss = closure()
        if is_scalar_loss(loss):
            self.report_loss(loss)
        return loss

    # ------------------------------------------------------------------ leaving

    def begin_shutdown(self) -> bool:
        """Mark the optimizer closed; False if it was already (shutdown is idempotent)."""
        if self.closed:
            return False
        self.closed = True
        return True

    def say_goodbye(self, timeout: float) -> None:
        """Stop publishing metrics and progress: the swarm stops counting this peer."""
        if self.metrics is not None:
            self.metrics.shutdown(min(2.0, timeout))
        self.tracker.shutdown(timeout)

    def close(self, averagers: Iterable[Any]) -> None:
        """Shut down the averagers, then the state averager."""
        for averager in averagers:
            if averager is not None:
                averager.shutdown()
        self.state_averager.shutdown()
