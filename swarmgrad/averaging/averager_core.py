"""The averager on the event loop: matchmaking, then all-reduce, round after round.

:class:`AsyncDecentralizedAverager` is what :class:`~swarmgrad.averaging.averager.
DecentralizedAverager` runs on the process's loop thread; use it directly from async code
that owns a peer and a DHT node (e.g. on the simulated network).

One step, as long as its deadline and ``allow_retries`` allow:

1. **Matchmaking** (:mod:`.matchmaking.driver`) under the current group key, announcing a
   :class:`~.allreduce.round_plan.MemberInfo`: mode, bandwidth, weight, tensor schema, addresses and
   the user's ``gather`` data. Matchmaking moves the group bits to the next Moshpit axis
   as soon as a group is formed.
2. **Plan** (:func:`~.allreduce.round_plan.plan_round`): every member derives the same plan from the
   same GroupInfo: who takes part, their modes and their spans.
3. **Trigger**: with ``require_trigger``, wait for ``control.allow_allreduce()``.
4. **All-reduce** (:class:`~.allreduce.runner.AllReduceRunner`) in place on the tensors, holding
   their lock for the whole round (taken in a worker thread, see :mod:`.tensor_lock`).
   The runner applies ``averaging_alpha`` and only ever writes whole, checked spans.
   With ``aggregate`` (a coroutine function), step 4 is that coroutine instead: it gets
   an :class:`AveragingRound` and may run several all-reduces ("phases") over tensors
   of its choosing in the same group, one after the other, under the same lock and
   deadline (PowerSGD averages its two factors this way, see
   :mod:`swarmgrad.optim.power_sgd_averager`).

A step returns the members' ``gather`` data when the round averaged something with
someone (spans of failed owners stay local, excluded senders are left out: see
:class:`~.allreduce.types.AllReduceResult`, kept in :attr:`last_result`); otherwise it retries
with a new group, or returns None. A failed round leaves the tensors as they were, or
partly averaged span by span; never half a span.

Steps of one averager run one at a time (a second one waits for the first, within its
own deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import torch

from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.allreduce.pacing import SendPacer
from swarmgrad.averaging.allreduce.partition import DEFAULT_PART_SIZE_BYTES, tensor_schema
from swarmgrad.averaging.allreduce.round_plan import (
    RoundPlan,
    RoundSkipped,
    check_aggregate_tag,
    encode_member_info,
    plan_round,
)
from swarmgrad.averaging.allreduce.router import AllReduceRouter
from swarmgrad.averaging.allreduce.runner import AllReduceRunner
from swarmgrad.averaging.allreduce.types import AllReduceResult, AveragingMode, GroupMismatch
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.driver import Matchmaking
from swarmgrad.averaging.robust.offenders import OffenderLog
from swarmgrad.averaging.robust.rules import AggregationRule
from swarmgrad.averaging.rounds import AveragingRound, PhaseResult, check_averaged_tensors
from swarmgrad.averaging.state.chunks import resolve_state_compression
from swarmgrad.averaging.state.download import load_state_from_peers
from swarmgrad.averaging.state.sharing import StateSharing
from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.averaging.tensor_lock import LoopLockHolder
from swarmgrad.compression import CompressionBase, CompressionType, get_codec
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import SwarmgradError, ValidationError

__all__ = ["AsyncDecentralizedAverager", "AveragingRound", "PhaseResult", "check_averaged_tensors"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_GROUP_SIZE = 256  # target_group_size=None: as many as matchmaking gathers
_MIN_SEARCH_WINDOW = 30.0  # seconds one matchmaking attempt lasts when a step has no timeout


def _optional_positive(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValidationError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def _positive_seconds(name: str, value: Any) -> float:
    """A finite positive duration, checked before any use (``float(None)`` would raise a
    TypeError that does not name the option; NaN would pass ``value <= 0``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValidationError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class AsyncDecentralizedAverager:
    """Moshpit averaging of ``averaged_tensors`` with the peers under ``prefix`` (see the
    module docstring and :class:`~swarmgrad.averaging.averager.DecentralizedAverager`
    for the parameters).

    Extra arguments: ``get_state`` (returns ``(metadata, tensors)`` for state sharing;
    default :meth:`get_current_state`), ``aggregate`` (``async def aggregate(round:
    AveragingRound) -> None``, run in each formed group instead of the one all-reduce of
    ``averaged_tensors``) with ``aggregate_tag`` (short text naming what it computes and
    with which settings, e.g. ``"PowerSGD rank 4 ..."``: announced in matchmaking, so
    that only members with the same tag average together, see
    :mod:`~.allreduce.round_plan`), ``lock`` (the tensors' reentrant lock),
    ``timeouts`` (an :class:`~.allreduce.deadlines.AdaptiveTimeouts` template),
    ``max_gather_bytes``,
    ``rotate_group_bits``, ``state_sharing_options`` and ``state_download_options``
    (keyword arguments of :class:`~.state.sharing.StateSharing` and
    :class:`~.state.download.StateDownloader`), ``rng``.

    Call :meth:`start` on the loop; ``await step(...)``; ``await shutdown()``.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        peer: Peer,
        dht_node: DHTNode,
        *,
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
        compression: CompressionBase | CompressionType | str = CompressionType.NONE,
        state_compression: CompressionBase | CompressionType | str | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        allow_state_sharing: bool | None = None,
        declare_state_period: float = 30.0,
        client_mode: bool = False,
        get_state: Callable[[], Any] | None = None,
        aggregate: Callable[[AveragingRound], Awaitable[None]] | None = None,
        aggregate_tag: str | None = None,
        aggregation: AggregationRule | None = None,
        ban_after: int | None = None,
        ban_window: int | None = None,
        ban_duration: float = 600.0,
        state_priority: float = 0.0,
        lock: Any = None,
        timeouts: AdaptiveTimeouts | None = None,
        max_gather_bytes: int = 1 << 20,
        rotate_group_bits: bool = True,
        state_sharing_options: dict[str, Any] | None = None,
        state_download_options: dict[str, Any] | None = None,
        rng: random.Random | None = None,
    ):
        self.tensors = check_averaged_tensors(averaged_tensors)
        self._detached = [t.detach() for t in self.tensors]
        self.schema = tensor_schema(self._detached)
        self.total_size = sum(t.numel() for t in self._detached)
        if aggregate is not None and not callable(aggregate):
            raise ValidationError(f"aggregate must be a coroutine function, got {aggregate!r}")
        if (aggregate is None) != (aggregate_tag is None):
            # a hook without a tag would average with peers that run another one (or none)
            raise ValidationError(
                "aggregate and aggregate_tag go together: the tag tells peers how this one "
                f"combines its tensors (got aggregate={aggregate!r}, aggregate_tag="
                f"{aggregate_tag!r})"
            )
        if aggregate_tag is not None and not check_aggregate_tag(aggregate_tag):
            raise ValidationError("aggregate_tag must not be empty")
        if aggregation is not None and not isinstance(aggregation, AggregationRule):
            raise ValidationError(
                f"aggregation must be an AggregationRule (CenteredClip(...), TrimmedMean(...)), "
                f"got {aggregation!r}"
            )
        if ban_after is not None and (
            isinstance(ban_after, bool) or not isinstance(ban_after, int) or ban_after < 1
        ):
            raise ValidationError(f"ban_after must be a positive int or None, got {ban_after!r}")
        if ban_window is not None and (
            isinstance(ban_window, bool)
            or not isinstance(ban_window, int)
            or ban_window < (ban_after or 1)
        ):
            raise ValidationError(
                f"ban_window must be an int >= ban_after ({ban_after}) or None, got {ban_window!r}"
            )
        if not isinstance(ban_duration, int | float) or not 0 < ban_duration < math.inf:
            raise ValidationError(f"ban_duration must be positive seconds, got {ban_duration!r}")
        self._aggregate = aggregate
        self.aggregation = aggregation
        # what members compare before averaging: the custom hook's tag and the robust rule
        self.aggregate_tag = "+".join(
            t for t in (aggregate_tag, aggregation.tag if aggregation else None) if t
        )
        if not isinstance(averaging_alpha, int | float) or not 0 < averaging_alpha <= 1:
            raise ValidationError(f"averaging_alpha must be in (0, 1], got {averaging_alpha!r}")
        if type(part_size_bytes) is not int or part_size_bytes <= 0:
            raise ValidationError(f"part_size_bytes must be a positive int, got {part_size_bytes}")
        if type(min_vector_size) is not int or min_vector_size < 0:
            raise ValidationError(f"min_vector_size must be an int >= 0, got {min_vector_size!r}")
        if bandwidth is not None and (
            isinstance(bandwidth, bool)
            or not isinstance(bandwidth, int | float)
            or not 0 < bandwidth < math.inf
        ):
            raise ValidationError(f"bandwidth must be a positive number or None, got {bandwidth!r}")
        if auxiliary and client_mode:
            raise ValidationError(
                "an auxiliary peer reduces others' parts, so it must accept connections: "
                "auxiliary=True needs client_mode=False"
            )
        if allow_state_sharing is None:
            allow_state_sharing = not client_mode and not auxiliary
        if allow_state_sharing and client_mode:
            raise ValidationError("a client-mode peer cannot share its state (nobody can call it)")
        self.peer, self.dht_node, self.prefix = peer, dht_node, prefix
        self.mode = (
            AveragingMode.CLIENT
            if client_mode
            else AveragingMode.AUX
            if auxiliary
            else AveragingMode.NODE
        )
        self.target_group_size = (
            DEFAULT_MAX_GROUP_SIZE if target_group_size is None else target_group_size
        )
        self.min_matchmaking_time = _positive_seconds("min_matchmaking_time", min_matchmaking_time)
        self.request_timeout = _positive_seconds("request_timeout", request_timeout)
        declare_state_period = _positive_seconds("declare_state_period", declare_state_period)
        if type(max_gather_bytes) is not int or max_gather_bytes <= 0:
            raise ValidationError(
                f"max_gather_bytes must be a positive int, got {max_gather_bytes!r}"
            )
        get_codec(compression)  # an unknown codec fails here, not in every round
        self.averaging_alpha = float(averaging_alpha)
        self.part_size_bytes = part_size_bytes
        self.allreduce_timeout = _optional_positive("allreduce_timeout", allreduce_timeout)
        self.next_chunk_timeout = _optional_positive("next_chunk_timeout", next_chunk_timeout)
        sender_timeout = _optional_positive("sender_timeout", sender_timeout)
        self.sender_timeout = sender_timeout if sender_timeout is not None else next_chunk_timeout
        self.reducer_timeout = _optional_positive("reducer_timeout", reducer_timeout)
        self.compression = compression
        # the codec of the snapshots this peer shares (None: exact); joiners decode any
        self.state_compression = resolve_state_compression(state_compression)
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self.min_vector_size = min_vector_size
        self.lock = lock if lock is not None else threading.RLock()
        self._timeouts = timeouts if timeouts is not None else AdaptiveTimeouts()
        self._timeouts_for_round()  # validates the explicit timeouts now, not in a round
        self.state_sharing: StateSharing | None = None
        if not client_mode:
            self.state_sharing = StateSharing(
                peer,
                dht_node,
                prefix=prefix,
                get_state=get_state or self.get_current_state,
                priority=state_priority,
                allow_state_sharing=allow_state_sharing,
                declare_state_period=declare_state_period,
                state_lock=self.lock,
                bandwidth=self.bandwidth,
                **{"state_compression": self.state_compression, **(state_sharing_options or {})},
            )
        self._download_options = dict(state_download_options or {})
        if self.next_chunk_timeout is not None:
            self._download_options.setdefault("chunk_timeout", self.next_chunk_timeout)
        # last: it registers this prefix's join handler on the peer
        self.matchmaking = Matchmaking(
            peer,
            dht_node,
            prefix=prefix,
            target_group_size=self.target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            client_mode=client_mode,
            initial_group_bits=initial_group_bits,
            max_gather_bytes=max_gather_bytes,
            rotate_group_bits=rotate_group_bits,
            rng=rng,
        )
        self.last_result: AllReduceResult | None = None
        # steps that averaged with someone / that ended without a round (or with an
        # error), for the peer's metrics; a cancelled step counts as neither
        self.rounds_succeeded = 0
        self.rounds_failed = 0
        self.offenders = OffenderLog(ban_after, float(ban_duration), prefix, ban_window)
        self.matchmaking.is_banned = self.offenders.is_banned
        self._lock_holder = LoopLockHolder(self.lock)
        self._step_lock = asyncio.Lock()
        self._steps: set[asyncio.Task] = set()
        self._started = self._closed = False

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Begin declaring and serving the state (if shared); call on the event loop."""
        if self._started:
            raise ValidationError("this averager has already been started")
        self._started = True
        # Serve all-reduce streams from now on: a member that starts its round before us
        # then waits briefly for our runner instead of finding no such protocol here.
        AllReduceRouter.for_peer(self.peer)
        if self.state_sharing is not None:
            self.state_sharing.start()

    @property
    def is_running(self) -> bool:
        return self._started and not self._closed

    async def shutdown(self, withdraw_timeout: float = 2.0) -> None:
        """Cancel running steps, stop matchmaking and state sharing (idempotent).

        ``withdraw_timeout`` bounds the withdrawal of the state declaration: it is a DHT
        store, which cannot succeed once the DHT is shut down underneath us and would
        otherwise use up the caller's whole shutdown budget."""
        if self._closed:
            return
        self._closed = True
        current = asyncio.current_task()
        steps = [task for task in self._steps if task is not current]
        for task in steps:
            task.cancel()
        if steps:
            await asyncio.wait(steps)
        await self.matchmaking.shutdown()
        if self.state_sharing is not None and self._started:
            await self.state_sharing.shutdown(withdraw_timeout=withdraw_timeout)
        await self._lock_holder.close()

    # ------------------------------------------------------------------ tensors and state

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked against rounds and state snapshots in the block."""
        with self.lock:
            yield self.tensors

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        """What state sharing serves by default: the group bits and the tensors."""
        with self.get_tensors() as tensors:
            return {"group_bits": self.get_group_bits()}, list(tensors)

    def get_group_bits(self) -> str:
        return self.matchmaking.get_group_bits()

    def set_group_bits(self, group_bits: str) -> None:
        self.matchmaking.set_group_bits(group_bits)

    @property
    def allow_state_sharing(self) -> bool:
        return self.state_sharing is not None and self.state_sharing.allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if self.state_sharing is None:
            if value:
                raise ValidationError(
                    "a client-mode peer cannot share its state (nobody can call it)"
                )
            return
        self.state_sharing.allow_state_sharing = bool(value)

    @property
    def state_sharing_priority(self) -> float:
        return self.state_sharing.priority if self.state_sharing is not None else 0.0

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ValidationError(f"state_sharing_priority must be a number, got {value!r}")
        if self.state_sharing is not None:
            self.state_sharing.priority = float(value)

    async def load_state_from_peers(self, timeout: float | None = None) -> Any:
        """Download the best state shared under this prefix: ``(metadata, tensors)``, or
        None if no donor could provide it within ``timeout`` seconds."""
        self._check_running()
        timeout = _optional_positive("timeout", timeout)
        return await load_state_from_peers(
            self.peer, self.dht_node, prefix=self.prefix, timeout=timeout, **self._download_options
        )

    # ------------------------------------------------------------------ stepping

    def new_control(
        self,
        scheduled_time: float | None = None,
        weight: float | None = None,
        require_trigger: bool = False,
        round_tag: str = "",
        expected_group_size: int | None = None,
        leader_hint: PeerID | None = None,
    ) -> StepControl:
        """A StepControl with this averager's defaults (safe from any thread)."""
        if scheduled_time is None:
            scheduled_time = self.dht_node.time_fn() + self.min_matchmaking_time
        if weight is None:
            weight = 0.0 if self.mode is AveragingMode.AUX else 1.0
        elif self.mode is AveragingMode.AUX and weight != 0:
            raise ValidationError(
                f"an auxiliary peer contributes nothing: weight must be 0, not {weight}"
            )
        return StepControl(
            scheduled_time=scheduled_time,
            weight=weight,
            require_trigger=require_trigger,
            round_tag=round_tag,
            expected_group_size=expected_group_size,
            leader_hint=leader_hint,
        )

    async def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        *,
        control: StepControl | None = None,
    ) -> dict[Any, Any] | None:
        """Average once with a group: ``{peer_id: gather}`` of the members that averaged
        with us, or None if no round succeeded within ``timeout`` (see the module
        docstring). ``control`` (from :meth:`new_control`) replaces ``scheduled_time``,
        ``weight`` and ``require_trigger`` and lets another task trigger or cancel."""
        self._check_running()
        timeout = _optional_positive("timeout", timeout)
        if control is None:
            control = self.new_control(scheduled_time, weight, require_trigger)
        task = asyncio.current_task()
        assert task is not None
        control._bind(task)
        self._steps.add(task)
        try:
            result = await self._step(control, gather, timeout, allow_retries)
        except asyncio.CancelledError:
            if self._closed:  # say why, rather than a bare CancelledError
                control._finish(
                    error=SwarmgradError(f"{self} was shut down while this step was running")
                )
            control._mark_cancelled()
            raise
        except BaseException as e:
            self.rounds_failed += 1
            control._finish(error=e)
            raise
        finally:
            self._steps.discard(task)
        if result is None:
            self.rounds_failed += 1
        else:
            self.rounds_succeeded += 1
        control._finish(result)
        return result

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise ValidationError("the averager is not running: start it first")

    async def _step(
        self, control: StepControl, gather: Any, timeout: float | None, allow_retries: bool
    ) -> dict[Any, Any] | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                await self._step_lock.acquire()
        except TimeoutError:
            logger.warning("%s: the previous step did not end within this one's timeout", self)
            return None
        try:
            attempt = 0
            while not self._closed:
                attempt += 1
                gathered = await self._attempt(control, gather, deadline)
                if gathered is not None:
                    return gathered
                if not allow_retries:
                    return None
                pause = min(self.request_timeout, 0.1 * attempt)
                if deadline is not None:
                    if loop.time() + pause >= deadline:
                        return None
                await asyncio.sleep(pause)  # a round that fails at once must not spin
            return None
        finally:
            self._step_lock.release()

    def _search_window(self, control: StepControl, deadline: float | None) -> float:
        loop = asyncio.get_running_loop()
        if deadline is not None:
            return deadline - loop.time()
        lead = max(0.0, control.scheduled_time - self.dht_node.time_fn())
        return lead + max(3 * self.min_matchmaking_time, _MIN_SEARCH_WINDOW)

    async def _attempt(
        self, control: StepControl, gather: Any, deadline: float | None
    ) -> dict[Any, Any] | None:
        """One group: matchmaking, plan, trigger, all-reduce. The gathered data if the
        round averaged something with someone, else None."""
        control._set_stage(AveragingStage.LOOKING_FOR_GROUP)
        window = self._search_window(control, deadline)
        if window <= 0:
            return None
        maddrs = () if self.mode is AveragingMode.CLIENT else self.peer.get_visible_maddrs()
        data = encode_member_info(
            mode=self.mode,
            bandwidth=self.bandwidth,
            weight=control.weight,
            schema=self.schema,
            numel=self.total_size,
            maddrs=maddrs,
            gather=gather,
            aggregate_tag=self.aggregate_tag,
        )
        loop = asyncio.get_running_loop()

        def apply(size: int | None) -> None:  # on the loop, if still this search's
            if control._expected_size_hook is hook:
                self.matchmaking.set_expected_size(size)

        def hook(size: int | None) -> None:
            loop.call_soon_threadsafe(apply, size)

        control._expected_size_hook = hook
        try:
            group = await self.matchmaking.look_for_group(
                data_for_gather=data,
                timeout=window,
                scheduled_time=control.scheduled_time,
                round_tag=control.round_tag,
                expected_size=control.expected_group_size,
                leader_hint=control.leader_hint,
            )
        finally:
            control._expected_size_hook = None
        if group is None:
            logger.debug("%s: no group found under %s", self, self.prefix)
            return None
        me = self.peer.peer_id
        try:
            plan = plan_round(group, me, min_vector_size=self.min_vector_size)
        except GroupMismatch:
            raise
        except (RoundSkipped, ValidationError) as e:
            logger.warning("%s: skipping group %s: %s", self, group.group_id.hex()[:12], e)
            return None
        for peer_id, why in plan.left_out.items():
            logger.warning("%s: %s is left out of this round: %s", self, peer_id, why)
        for info in plan.members:
            if info.peer_id != me and info.maddrs:
                self.peer.add_addresses(info.peer_id, info.maddrs)
        if control.require_trigger and not control.triggered:
            control._set_stage(AveragingStage.AWAITING_TRIGGER)
            try:
                async with asyncio.timeout_at(deadline):
                    await control._wait_for_trigger()
            except TimeoutError:
                logger.warning("%s: the step was not triggered before its deadline", self)
                return None
        control._set_stage(AveragingStage.RUNNING_ALLREDUCE)
        result = await self._run_allreduce(plan, control.weight, deadline, control.send_pacer)
        if result is None:
            return None
        self.last_result = result
        self.offenders.record(result)
        if not _averaged_with_someone(plan, me, result):
            logger.warning("%s: round %s averaged nothing with anyone", self, _summary(result))
            return None
        if not result.fully_averaged or result.deadline_exceeded:
            logger.info("%s: round finished partly: %s", self, _summary(result))
        return plan.gathered

    def _timeouts_for_round(self) -> AdaptiveTimeouts:
        base = self._timeouts
        return AdaptiveTimeouts(
            sender_timeout=self.sender_timeout if self.sender_timeout else base.sender_timeout,
            reducer_timeout=self.reducer_timeout if self.reducer_timeout else base.reducer_timeout,
            min_timeout=base.min_timeout,
            slack=base.slack,
            initial_rate=base.initial_rate,
        )

    async def _run_allreduce(
        self, plan: RoundPlan, weight: float, deadline: float | None, send_pacer: SendPacer | None
    ) -> AllReduceResult | None:
        loop = asyncio.get_running_loop()
        limits = [t for t in (self.allreduce_timeout,) if t is not None]
        if deadline is not None:
            limits.append(deadline - loop.time())
        budget = min(limits) if limits else None
        if budget is not None and budget <= 0:
            return None
        started = loop.time()
        if not await self._lock_holder.acquire(budget):
            logger.warning(
                "%s: the averaged tensors stayed locked for %.3g s; skipping the round",
                self,
                budget,
            )
            return None
        try:
            if budget is not None:
                budget -= loop.time() - started
                if budget <= 0:
                    return None
            if self._aggregate is None:
                runner = self._runner(
                    plan, plan.group, self._detached, plan.span_sizes, weight, budget, send_pacer
                )
                return await runner.run()
            deadline = None if budget is None else loop.time() + budget
            current = AveragingRound(self, plan, weight, deadline)
            await self._aggregate(current)
            return current.merged_result()
        except (SwarmgradError, OSError) as e:
            # GroupMismatch here means a member announced our schema but sent other
            # tensors: its fault, not ours; the step may try another group.
            logger.warning("%s: all-reduce in group %s failed: %s", self, _gid(plan), e)
            return None
        finally:
            self._lock_holder.release()

    def _runner(
        self,
        plan: RoundPlan,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        span_sizes: Sequence[int],
        weight: float,
        budget: float | None,
        send_pacer: SendPacer | None = None,
    ) -> AllReduceRunner:
        return AllReduceRunner(
            self.peer,
            group,
            tensors,
            span_sizes=span_sizes,
            modes=plan.modes,
            weight=None if self.mode is AveragingMode.AUX else weight,
            part_size_bytes=self.part_size_bytes,
            compression=self.compression,
            timeouts=self._timeouts_for_round(),
            timeout=budget,
            averaging_alpha=self.averaging_alpha,
            aggregation=self.aggregation,
            send_pacer=send_pacer,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.peer.peer_id}, prefix={self.prefix!r})"


def _averaged_with_someone(plan: RoundPlan, me: Any, result: AllReduceResult) -> bool:
    """Did the round mix in anything from another member (or, for an auxiliary member,
    reduce anything for them)?"""
    my_index = plan.group.peer_ids.index(me)
    if result.averaged_spans - {my_index}:
        return True  # an owner sent us the group's average of its span
    other_senders = [
        peer_id
        for peer_id, mode in zip(plan.group.peer_ids, plan.modes, strict=True)
        if peer_id != me and mode is not AveragingMode.AUX
    ]
    reduced_for_others = any(p not in result.excluded_senders for p in other_senders)
    if plan.modes[my_index] is AveragingMode.AUX:
        return reduced_for_others and not result.deadline_exceeded
    return my_index in result.averaged_spans and reduced_for_others


def _gid(plan: RoundPlan) -> str:
    return plan.group.group_id.hex()[:12]


def _summary(result: AllReduceResult) -> str:
    parts = [
        f"group {result.group_id.hex()[:12]}",
        f"averaged spans {sorted(result.averaged_spans)}",
    ]
    if result.local_spans:
        parts.append(f"kept local {sorted(result.local_spans)}")
    for peer_id, why in result.excluded_senders.items():
        parts.append(f"excluded sender {peer_id} ({why})")
    for peer_id, why in result.failed_reducers.items():
        parts.append(f"failed owner {peer_id} ({why})")
    if result.deadline_exceeded:
        parts.append("deadline exceeded")
    return "; ".join(parts)
