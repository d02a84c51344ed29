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
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.allreduce.pacing import SendPacer
from swarmgrad.averaging.allreduce.partition import check_tensor_infos, tensor_schema
from swarmgrad.averaging.allreduce.round_plan import (
    RoundPlan,
    RoundSkipped,
    encode_member_info,
    plan_round,
)
from swarmgrad.averaging.allreduce.router import AllReduceRouter
from swarmgrad.averaging.allreduce.runner import AllReduceRunner
from swarmgrad.averaging.allreduce.types import AllReduceResult, AveragingMode, GroupMismatch
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.driver import Matchmaking
from swarmgrad.averaging.options import AveragerOptions
from swarmgrad.averaging.robust.offenders import OffenderLog
from swarmgrad.averaging.rounds import AveragingRound, PhaseResult, check_averaged_tensors
from swarmgrad.averaging.state.download import load_state_from_peers
from swarmgrad.averaging.state.sharing import StateSharing
from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.averaging.tensor_lock import LoopLockHolder
from swarmgrad.compression import CompressionInfo
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.utils.checks import optional_positive_seconds
from swarmgrad.utils.errors import SwarmgradError, ValidationError

__all__ = ["AsyncDecentralizedAverager", "AveragingRound", "PhaseResult", "check_averaged_tensors"]

logger = logging.getLogger(__name__)

_MIN_SEARCH_WINDOW = 30.0  # seconds one matchmaking attempt lasts when a step has no timeout


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
        options: AveragerOptions | None = None,
        get_state: Callable[[], Any] | None = None,
        state_priority: float = 0.0,
        lock: Any = None,
        **option_kwargs: Any,
    ):
        if options is None:
            options = AveragerOptions.from_kwargs(**option_kwargs)
        elif option_kwargs:
            raise ValidationError(
                f"pass the averager's options either as options= or by name, not both "
                f"(got both options= and {sorted(option_kwargs)})"
            )
        elif not isinstance(options, AveragerOptions):
            raise ValidationError(f"options must be an AveragerOptions, got {options!r:.80}")
        self.options = o = options
        self.tensors = check_averaged_tensors(averaged_tensors)
        self._detached = [t.detach() for t in self.tensors]
        self.schema = tensor_schema(self._detached)
        self.total_size = sum(t.numel() for t in self._detached)
        self.tensor_infos = check_tensor_infos(o.tensor_infos, len(self.tensors))
        self._aggregate = o.aggregate
        self.aggregation = o.aggregation
        self.aggregate_tag = o.combined_tag
        self.peer, self.dht_node, self.prefix = peer, dht_node, o.prefix
        self.mode = o.mode
        self.target_group_size = o.max_group_size
        self.min_matchmaking_time = o.min_matchmaking_time
        self.request_timeout = o.request_timeout
        self.averaging_alpha = o.averaging_alpha
        self.part_size_bytes = o.part_size_bytes
        self.allreduce_timeout = o.allreduce_timeout
        self.next_chunk_timeout = o.next_chunk_timeout
        self.sender_timeout = o.effective_sender_timeout
        self.reducer_timeout = o.reducer_timeout
        self.compression = o.compression
        # the codec of the snapshots this peer shares (None: exact); joiners decode any
        self.state_compression = o.state_compression
        self.bandwidth = o.bandwidth
        self.min_vector_size = o.min_vector_size
        self.lock = lock if lock is not None else threading.RLock()
        self._timeouts = o.timeouts if o.timeouts is not None else AdaptiveTimeouts()
        self._timeouts_for_round()  # validates the explicit timeouts now, not in a round
        self.state_sharing: StateSharing | None = None
        if not o.client_mode:
            self.state_sharing = StateSharing(
                peer,
                dht_node,
                prefix=o.prefix,
                get_state=get_state or self.get_current_state,
                priority=state_priority,
                allow_state_sharing=o.allow_state_sharing,
                declare_state_period=o.declare_state_period,
                state_lock=self.lock,
                bandwidth=self.bandwidth,
                **{"state_compression": self.state_compression, **(o.state_sharing_options or {})},
            )
        self._download_options = dict(o.state_download_options or {})
        if self.next_chunk_timeout is not None:
            self._download_options.setdefault("chunk_timeout", self.next_chunk_timeout)
        # last: it registers this prefix's join handler on the peer
        self.matchmaking = Matchmaking(
            peer,
            dht_node,
            prefix=o.prefix,
            target_group_size=o.max_group_size,
            min_group_size=o.min_group_size,
            min_matchmaking_time=o.min_matchmaking_time,
            request_timeout=o.request_timeout,
            client_mode=o.client_mode,
            initial_group_bits=o.initial_group_bits,
            max_gather_bytes=o.max_gather_bytes,
            rotate_group_bits=o.rotate_group_bits,
            rng=o.rng,
        )
        self.last_result: AllReduceResult | None = None
        # steps that averaged with someone / that ended without a round (or with an
        # error), for the peer's metrics; a cancelled step counts as neither
        self.rounds_succeeded = 0
        self.rounds_failed = 0
        self.offenders = OffenderLog(o.ban_after, o.ban_duration, o.prefix, o.ban_window)
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
        timeout = optional_positive_seconds("timeout", timeout)
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
        timeout = optional_positive_seconds("timeout", timeout)
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
            control._unbind()
            del task  # (this frame is in the traceback the task keeps if it failed)
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
        control._expected_size_hook = _ExpectedSizeHook(
            asyncio.get_running_loop(), control, self.matchmaking
        )
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
                    plan,
                    plan.group,
                    self._detached,
                    plan.span_sizes,
                    weight,
                    budget,
                    send_pacer,
                    tensor_infos=self.tensor_infos,
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
        tensor_infos: Sequence[CompressionInfo] | None = None,
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
            tensor_infos=tensor_infos,
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


class _ExpectedSizeHook:
    """Passes a new expected group size from the caller's thread to this search's
    matchmaking, on the loop, while the search is the control's current one.

    An object, not two closures that name each other: those made a reference cycle that
    kept the control, its result and the round's tensors alive until the cyclic
    collector's next full pass (issue 32)."""

    __slots__ = ("_control", "_loop", "_matchmaking")

    def __init__(self, loop: asyncio.AbstractEventLoop, control: StepControl, matchmaking: Any):
        self._loop, self._control, self._matchmaking = loop, control, matchmaking

    def __call__(self, size: int | None) -> None:
        self._loop.call_soon_threadsafe(self._apply, size)

    def _apply(self, size: int | None) -> None:  # on the loop, if still this search's
        if self._control._expected_size_hook is self:
            self._matchmaking.set_expected_size(size)
