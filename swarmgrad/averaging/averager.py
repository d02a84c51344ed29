"""``DecentralizedAverager``: hivemind's averaging API for synchronous code.

::

    averager = DecentralizedAverager([param1, param2], dht, prefix="my_run.params",
                                     target_group_size=16, start=True)
    ...
    gathered = averager.step(timeout=60)        # {peer_id: gather} or None
    with averager.get_tensors() as tensors:     # read or change them safely
        ...

The averager runs on the process's event loop thread (:mod:`swarmgrad.utils.loop_thread`)
and shares the DHT's peer (``dht.peer``, ``dht.node``): no process is forked and no
tensor is moved to shared memory. The work itself is done by
:class:`~swarmgrad.averaging.averager_core.AsyncDecentralizedAverager`; this class hands
it coroutines and keeps hivemind's override points (:meth:`get_current_state`,
:meth:`load_state_from_peers`) and names.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from swarmgrad.averaging.allreduce.partition import DEFAULT_PART_SIZE_BYTES, check_tensor_infos
from swarmgrad.averaging.allreduce.types import AllReduceResult
from swarmgrad.averaging.averager_core import AsyncDecentralizedAverager
from swarmgrad.averaging.options import AveragerOptions
from swarmgrad.averaging.rounds import check_averaged_tensors
from swarmgrad.averaging.step_control import StepControl
from swarmgrad.compression import CompressionBase, CompressionInfo, CompressionType, NoCompression
from swarmgrad.dht.dht import DHT
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.checks import positive_seconds
from swarmgrad.utils.compat import unsupported
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import run_coroutine, run_coroutine_future
from swarmgrad.utils.serializer import MSGPackSerializer
from swarmgrad.utils.torch_threads import follow_torch_threads

__all__ = ["DecentralizedAverager"]

logger = logging.getLogger(__name__)

# keyword arguments passed through to AsyncDecentralizedAverager
_EXTRA_OPTIONS = {
    "timeouts",
    "max_gather_bytes",
    "rotate_group_bits",
    "state_sharing_options",
    "state_download_options",
    "rng",
    "aggregate",
    "aggregate_tag",
    "aggregation",
    "ban_after",
    "ban_window",
    "ban_duration",
}
_IGNORED_OPTIONS = {"daemon"}  # hivemind forks a process; nothing is forked here


class DecentralizedAverager:
    """Average ``averaged_tensors`` with other peers, in groups found through ``dht``.

    Arguments (hivemind 1.1's names):
      averaged_tensors: floating-point CPU tensors, averaged in place (same shapes and
        dtypes on every peer of the run; a peer with other tensors is refused with an
        error naming the first difference).
      dht: a running :class:`~swarmgrad.dht.DHT`; the averager uses its peer.
      start: start at once (else call :meth:`run_in_background`).
      prefix: the run's name in the DHT; only averagers with the same prefix meet.
      target_group_size: the largest group (None: up to 256); groups start as soon as
        they are full. min_group_size: smaller groups disband and search again.
      initial_group_bits: this peer's cell of the Moshpit grid, a string of 0/1 (""
        puts everyone in one key: plain group all-reduce). After each round the bits
        move so that the next round mixes along another axis.
      min_matchmaking_time: how long a leader waits for its group to fill.
      request_timeout: bound on each answer during matchmaking.
      averaging_alpha: local += alpha * (average - local); 1 replaces by the average.
      part_size_bytes: tensors travel in parts of about this size (sending, reducing
        and receiving overlap part by part).
      allreduce_timeout: bound on one all-reduce round (after the group is formed).
      next_chunk_timeout: default for sender_timeout, and the wait for each chunk when
        downloading state.
      sender_timeout / reducer_timeout: fixed waits for the next part from a sender or
        an owner; default: adaptive to the throughput seen (see :mod:`.allreduce.deadlines`).
      compression: codec for parts on the wire (both directions).
      state_compression: codec applied to the floating-point tensors of the state this
        peer shares (e.g. ``Float16Compression()``: joiners download half the bytes and
        get float16-rounded values back in the original dtype); integer and other
        tensors are sent exact. Joiners decode whatever codec the donor used.
      tensor_infos: one :class:`~swarmgrad.compression.CompressionInfo` per averaged
        tensor, in order, telling ``compression`` what each tensor is (its ``key`` and
        ``role``: e.g. a :class:`~swarmgrad.compression.PerTensorCompression` or
        role-adaptive codec picks by them; hivemind's meaning). Default: keys are the
        tensors' indices, roles unspecified.
      bandwidth: this peer's bandwidth (any unit, the same for the whole run): spans are
        sized to it. None: unknown (counts as the group's mean).
      min_vector_size: a member never reduces fewer elements than this (its share goes
        to the others).
      auxiliary: reduce others' parts, contribute nothing (weight 0), never change the
        local tensors. client_mode: send, never reduce (for peers behind NAT); default:
        the DHT's mode.
      allow_state_sharing: serve :meth:`get_current_state` to joining peers (default:
        unless client or auxiliary). declare_state_period: how often that is refreshed
        in the DHT.
      shutdown_timeout: bound on :meth:`shutdown`.
      kwargs: ``timeouts``, ``max_gather_bytes``, ``rotate_group_bits``,
        ``state_sharing_options``, ``state_download_options``, ``rng``, ``aggregate``
        and ``aggregate_tag`` (a coroutine function run in each formed group instead of
        the plain all-reduce, for averaging in several phases, and the text that keeps
        peers with another one apart; see
        :class:`~.averager_core.AsyncDecentralizedAverager`); ``aggregation`` (a robust
        rule, :class:`~.robust.rules.CenteredClip` or
        :class:`~.robust.rules.TrimmedMean`, applied by each span's owner; members must
        use the same), ``ban_after``,
        ``ban_window`` and ``ban_duration`` (exclude a peer from our groups for
        ``ban_duration`` s once it offended in ``ban_after`` of the last ``ban_window``
        rounds it took part in with us, :mod:`.robust.offenders`); ``daemon`` is accepted
        and ignored.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: DHT,
        *,
        start: bool,
        prefix: str,
        target_group_size: int | None = None,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        compression: CompressionBase | CompressionType | str = NoCompression(),
        state_compression: CompressionBase | CompressionType | str = NoCompression(),
        tensor_infos: Sequence[CompressionInfo] | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        allow_state_sharing: bool | None = None,
        declare_state_period: float = 30,
        client_mode: bool | None = None,
        daemon: bool = True,  # hivemind forks a process; nothing is forked here
        shutdown_timeout: float = 5,
        **kwargs: Any,
    ):
        unknown = set(kwargs) - _EXTRA_OPTIONS - _IGNORED_OPTIONS
        if unknown:
            raise ValidationError(f"DecentralizedAverager got unknown options {sorted(unknown)}")
        self.dht = dht
        self._averaged_tensors = tuple(check_averaged_tensors(averaged_tensors))
        self.lock_averaged_tensors = threading.RLock()
        # else shutdown() would give up at once and leave the averager half stopped
        self.shutdown_timeout = positive_seconds("shutdown_timeout", shutdown_timeout)
        self.options = AveragerOptions(
            prefix=prefix,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            initial_group_bits=initial_group_bits,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            averaging_alpha=averaging_alpha,
            part_size_bytes=part_size_bytes,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            sender_timeout=sender_timeout,
            reducer_timeout=reducer_timeout,
            compression=compression,
            state_compression=state_compression,
            tensor_infos=check_tensor_infos(tensor_infos, len(self._averaged_tensors)),
            bandwidth=bandwidth,
            min_vector_size=min_vector_size,
            auxiliary=auxiliary,
            allow_state_sharing=allow_state_sharing,
            declare_state_period=declare_state_period,
            client_mode=dht.client_mode if client_mode is None else bool(client_mode),
            **{k: v for k, v in kwargs.items() if k in _EXTRA_OPTIONS},
        )
        self.client_mode = self.options.client_mode
        self.mode = self.options.mode
        self._state_priority = 0.0
        self._core: AsyncDecentralizedAverager | None = None
        self._start_lock = threading.Lock()
        self._starting: concurrent.futures.Future | None = None
        if start:
            self.run_in_background(await_ready=True)

    @property
    def _options(self) -> Mapping[str, Any]:
        """The options by name, read-only (the collaborative optimizers read
        ``_options["min_matchmaking_time"]``; new code reads :attr:`options`)."""
        return MappingProxyType(self.options.as_dict())

    # ------------------------------------------------------------------ life cycle

    def run_in_background(
        self, await_ready: bool = True, timeout: float | None = None
    ) -> concurrent.futures.Future | None:
        """Start the averager on the loop thread (the DHT must be running). With
        ``await_ready=False``, returns a future that resolves once it runs."""
        with self._start_lock:
            if self._core is not None or (self._starting is not None and not self._starting.done()):
                raise ValidationError("this averager is already running")
            peer, node = self.dht.peer, self.dht.node
            if peer is None or node is None:
                raise ValidationError("the DHT is not running: start it before the averager")

            async def create() -> AsyncDecentralizedAverager:
                follow_torch_threads()  # the loop may have started before torch was imported
                core = AsyncDecentralizedAverager(
                    self._averaged_tensors,
                    peer,
                    node,
                    options=self.options,
                    get_state=self.get_current_state,
                    state_priority=self._state_priority,
                    lock=self.lock_averaged_tensors,
                )
                core.start()
                self._core = core
                return core

            self._starting = run_coroutine_future(create())
        if not await_ready:
            return self._starting
        self._starting.result(timeout)
        return None

    def _running(self) -> AsyncDecentralizedAverager:
        core = self._core
        if core is None or not core.is_running:
            raise ValidationError("the averager is not running: call run_in_background()")
        return core

    def is_alive(self) -> bool:
        core = self._core
        return core is not None and core.is_running

    def shutdown(self) -> None:
        """Cancel running steps and leave (idempotent)."""
        core, self._core = self._core, None
        if core is not None:
            # half the budget at most for withdrawing the state declaration from the DHT
            # (it cannot succeed if the DHT was shut down first), the rest for stopping
            withdraw = min(2.0, self.shutdown_timeout / 2)
            run_coroutine(core.shutdown(withdraw_timeout=withdraw), timeout=self.shutdown_timeout)

    def __enter__(self) -> DecentralizedAverager:
        if self._core is None:
            self.run_in_background()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ identity and settings

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    @property
    def prefix(self) -> str:
        return self.options.prefix

    @property
    def total_size(self) -> int:
        return sum(t.numel() for t in self._averaged_tensors)

    @property
    def last_result(self) -> AllReduceResult | None:
        """What the latest all-reduce round did (spans averaged or kept, peers dropped)."""
        return self._core.last_result if self._core is not None else None

    @property
    def last_group(self) -> tuple[str, PeerID] | None:
        """``(round_tag, leader)`` of the last group this peer averaged in (None: none yet);
        a round that should meet the same peers can pass the leader as ``leader_hint``."""
        return self._core.matchmaking.last_group if self._core is not None else None

    @property
    def rounds_succeeded(self) -> int:
        """Steps that averaged with at least one other peer."""
        return self._core.rounds_succeeded if self._core is not None else 0

    @property
    def rounds_failed(self) -> int:
        """Steps that ended without averaging (no group, every round failed, an error)."""
        return self._core.rounds_failed if self._core is not None else 0

    @property
    def offenders(self) -> dict[str, dict[str, int | bool]]:
        """Robust averaging's evidence per peer: rounds clipped, bad reductions, banned."""
        return self._core.offenders.as_metrics() if self._core is not None else {}

    def follow_bans_of(self, other: DecentralizedAverager) -> None:
        """Leave out of our groups whoever ``other`` has banned, as well as our own bans
        (both averagers running): see :meth:`.robust.offenders.OffenderLog.follow`."""
        self._running().offenders.follow(other._running().offenders)

    # hivemind's names around the averager's process and servicer: see docs/hivemind.md

    serializer = MSGPackSerializer

    @property
    def request_timeout(self) -> float:
        return self.options.request_timeout

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until the averager started by ``run_in_background(await_ready=False)``
        runs (raises what its start raised)."""
        if self._starting is None:
            raise ValidationError("the averager was not started: call run_in_background()")
        self._starting.result(timeout)

    def run(self) -> None:
        """hivemind's averager process body. Nothing is forked here: this starts the
        averager (unless started) and returns; it runs on the loop thread."""
        if self._core is None and (self._starting is None or self._starting.done()):
            self.run_in_background(await_ready=True)

    _SERVICER = (
        "the averager registers its handlers on the DHT's peer when it starts "
        "(swarmgrad.averaging protocols); a custom protocol is a ServicerBase added with "
        "dht.peer.add_servicer(...)"
    )
    add_p2p_handlers = unsupported(
        "DecentralizedAverager.add_p2p_handlers", _SERVICER, is_async=True
    )
    remove_p2p_handlers = unsupported(
        "DecentralizedAverager.remove_p2p_handlers", _SERVICER, is_async=True
    )
    get_stub = unsupported(
        "DecentralizedAverager.get_stub",
        "averager RPCs are internal; call peers with dht.peer.call(peer_id, name, request)",
    )
    rpc_join_group = unsupported("DecentralizedAverager.rpc_join_group", _SERVICER, is_async=True)
    rpc_aggregate_part = unsupported(
        "DecentralizedAverager.rpc_aggregate_part", _SERVICER, is_async=True
    )
    rpc_download_state = unsupported(
        "DecentralizedAverager.rpc_download_state",
        "state is served by StateSharing on the peer; load it with load_state_from_peers()",
        is_async=True,
    )

    def get_group_bits(self, wait: bool = True) -> str | concurrent.futures.Future:
        """This peer's current Moshpit cell (its group bits). ``wait=False`` returns a
        future that already holds them (hivemind's signature; nothing here is remote)."""
        core = self._core
        bits = self.options.initial_group_bits if core is None else core.get_group_bits()
        if wait:
            return bits
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(bits)
        return future

    def set_group_bits(self, group_bits: str, wait: bool = True) -> None:
        """Move this peer to another Moshpit cell (takes effect at the next search).
        ``wait`` is accepted for hivemind compatibility."""
        core = self._core
        if core is None:
            from swarmgrad.averaging.matchmaking.group_bits import validate_group_bits

            bits = validate_group_bits(group_bits)
            self.options = dataclasses.replace(self.options, initial_group_bits=bits)
        else:
            core.set_group_bits(group_bits)

    @property
    def allow_state_sharing(self) -> bool:
        core = self._core
        if core is None:
            return bool(self.options.allow_state_sharing)
        return core.allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and self.client_mode:
            raise ValidationError("a client-mode peer cannot share its state (nobody can call it)")
        core = self._core
        if core is None:
            self.options = dataclasses.replace(self.options, allow_state_sharing=bool(value))
        else:
            core.allow_state_sharing = bool(value)

    @property
    def state_sharing_priority(self) -> float:
        """Joining peers download from the donors of highest priority first (e.g. an epoch
        or step number)."""
        core = self._core
        return core.state_sharing_priority if core is not None else self._state_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise ValidationError(f"state_sharing_priority must be a number, got {value!r}")
        core = self._core
        if core is not None:
            core.state_sharing_priority = value
        self._state_priority = float(value)

    # ------------------------------------------------------------------ tensors and state

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """``with averager.get_tensors() as tensors:`` the averaged tensors, locked against
        averaging rounds and state snapshots inside the block. Do not hold the lock for
        long while a step runs: the round waits for it."""
        with self.lock_averaged_tensors:
            yield self._averaged_tensors

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        """What this peer shares with joining peers: ``(metadata, tensors)``, metadata any
        msgpack-able object. Override it to share more (an optimizer's state, the epoch).
        It runs in a worker thread with the tensors' lock held; the tensors are copied
        before the lock is released."""
        with self.get_tensors() as tensors:
            return {"group_bits": self.get_group_bits()}, list(tensors)

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]] | concurrent.futures.Future | None:
        """Download the state of the best donors under this prefix: ``(metadata,
        tensors)``, or None if nobody could provide it within ``timeout``. The state is
        returned, not applied. ``wait=False`` returns a future."""
        core = self._running()
        if not wait:
            return run_coroutine_future(core.load_state_from_peers(timeout))
        return run_coroutine(core.load_state_from_peers(timeout))

    # ------------------------------------------------------------------ averaging

    def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
        round_tag: str = "",
        expected_group_size: int | None = None,
        leader_hint: PeerID | None = None,
    ) -> dict[PeerID, Any] | StepControl | None:
        """Average once with a group of peers.

        Returns ``{peer_id: gather}`` of the members this peer averaged with, or None if
        no round succeeded within ``timeout`` seconds (None: keep trying while
        ``allow_retries``). ``gather`` is any msgpack-able object shared with the group.
        ``scheduled_time`` (DHT time, see :func:`~swarmgrad.get_dht_time`) is when this
        peer's group starts at the latest if it leads; default: ``min_matchmaking_time``
        from now. ``weight`` (default 1, 0 for auxiliary peers) weighs this peer's
        tensors in the average.

        ``wait=False`` returns a :class:`~.step_control.StepControl` future at once; with
        ``require_trigger=True`` the all-reduce then waits for
        ``control.allow_allreduce()`` once the group is formed. ``round_tag`` (letters,
        digits, '_', '-'; not in hivemind) makes this step meet only peers whose step has
        the same tag: the collaborative optimizer tags gradient rounds with the epoch, so
        a peer that finishes an epoch late never mixes its gradients into the next one.
        ``expected_group_size`` (not in hivemind): when the caller knows how many peers
        will come, a group this peer leads begins once it has that many instead of at
        ``scheduled_time`` (short epochs would otherwise wait out every window).
        ``leader_hint`` (not in hivemind): the peer expected to lead, e.g. the leader of
        :attr:`last_group`; followers then join it directly instead of through the DHT.
        A ``GroupMismatch`` error means this peer's tensors differ from its group's.
        """
        if require_trigger and wait:
            raise ValidationError(
                "require_trigger=True needs wait=False: nobody could trigger a step "
                "that this thread waits for"
            )
        core = self._running()
        control = core.new_control(
            scheduled_time, weight, require_trigger, round_tag, expected_group_size, leader_hint
        )
        inner = run_coroutine_future(
            core.step(gather, timeout=timeout, allow_retries=allow_retries, control=control)
        )
        control._follow(inner)
        if not wait:
            return control
        try:
            return control.result()
        except BaseException:
            control.cancel()  # e.g. KeyboardInterrupt: stop the step on the loop
            raise

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"{type(self).__name__}(prefix={self.prefix!r}, {state})"
