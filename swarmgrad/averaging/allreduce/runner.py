"""Butterfly all-reduce within one group: reduce-scatter and all-gather, streamed by part.

The members' tensors, seen as one flat vector, are cut into spans, one per reducing member
(its *owner*). Every member that contributes (a *sender*) opens one stream
``averaging.aggregate_part`` to each other owner and streams its parts of that owner's
span; the owner adds each part into a running weighted sum as soon as its bytes are in
and, once every sender still in the round has delivered part ``k``, streams the average
of part ``k`` back on each sender's stream. Sending, reducing and receiving overlap part
by part, and each member moves ``2 (n-1)/n`` of the vector in each direction, the minimum
for an all-reduce.

What travels back is the **averaged values**, not a per-sender delta: the owner encodes
each averaged part once and sends the same bytes to every sender (one compression per
part instead of one per receiver), and with a lossy codec every member, the owner
included, ends up with bit-identical values.

Modes: a ``NODE`` sends and owns a span; a ``CLIENT`` (behind NAT) sends but owns nothing;
an ``AUX`` member owns a span but contributes nothing (weight 0) and its own tensors are
left untouched.

Faults: a sender that fails, stalls past its wait (see :mod:`.deadlines`), or sends bad
data (NaN/Inf, tensors unlike ours, more bytes than its share) is excluded and the owner
averages the others; parts it already delivered stay in. A member whose owner fails or
stalls keeps its local values for that whole span. A peer counts as stalled only when
nothing at all arrives from it for the whole wait: on a slow link a stream's next bytes
may queue behind frames of the connection's other streams (up to a megabyte each), so any
byte on the connection is a sign of life. A span is written into the local
tensors only once all its parts have arrived and passed the checks, so a tensor never
holds half a span's average. Every wait is bounded, and an optional overall ``timeout``
ends the round early, applying only the spans already complete.

The wire format is in :mod:`.protocol`, stream helpers in :mod:`.streams`, the
per-peer router in :mod:`.router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swarmgrad.averaging.allreduce.buffers import DEFAULT_POOL, BufferPool
from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts, ThroughputMeter
from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers
from swarmgrad.averaging.allreduce.owner import OwnerRole
from swarmgrad.averaging.allreduce.pacing import SendPacer
from swarmgrad.averaging.allreduce.partition import (
    DEFAULT_PART_SIZE_BYTES,
    TensorPartContainer,
    TensorPartReducer,
    tensor_schema,
)
from swarmgrad.averaging.allreduce.protocol import (
    AGGREGATE_PART,
    NO_CODEC,
    Hello,
    Refused,
    decode_status,
    encode_message,
    read_framed_part,
    read_message,
)
from swarmgrad.averaging.allreduce.router import AllReduceRouter
from swarmgrad.averaging.allreduce.streams import (
    Progress,
    connection_bytes,
    describe,
    owners_after,
    peer_is_gone,
    reset_on_failure,
    settle,
    while_active,
    within,
)
from swarmgrad.averaging.allreduce.types import (
    AllReduceResult,
    AveragingMode,
    BadReduction,
    GroupMismatch,
    check_weight,
)
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.robust.reducer import PartReducer, RobustPartReducer
from swarmgrad.averaging.robust.rules import AggregationRule
from swarmgrad.compression import CompressionBase, CompressionInfo, CompressionType
from swarmgrad.compression.base import all_finite, tensor_bytes
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.checks import fraction
from swarmgrad.utils.errors import (
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)

__all__ = ["AllReduceRunner"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the runner


class AllReduceRunner(OwnerRole):
    """One round of butterfly all-reduce in one group; averages ``tensors`` in place.

    Arguments:
      peer: this process's :class:`~swarmgrad.net.peer.Peer` (real or simulated); it must
        be able to reach every member by PeerID.
      group: the :class:`GroupInfo` from matchmaking; ``ordered_peer_ids`` (default: the
        group's order) decides which member owns which span.
      tensors: contiguous float CPU tensors, the same shapes and dtypes on every member.
      span_sizes / peer_fractions: elements (or fractions) each member reduces, in member
        order; default: equal spans over the non-client members.
      modes: :class:`AveragingMode` per member (default: all NODE).
      weight: this member's weight in the average (default 1; must be 0 for AUX).
      part_size_bytes, compression: how spans are cut and encoded on the wire.
      sender_timeout, reducer_timeout: explicit waits for progress (see
        :mod:`.deadlines`; ``timeouts`` gives the full adaptive policy).
      timeout: optional deadline for the whole round.
      averaging_alpha: 1 replaces local values by the average; less moves part way.
      buffer_pool: where receive and accumulation buffers come from and go back to.
      aggregation: a robust :class:`~..robust.rules.AggregationRule` the owner applies to its
        span instead of the weighted mean (every member must use the same one).
      send_pacer: a :class:`~.pacing.SendPacer` that spaces this peer's writes (parts
        and averaged replies), for rounds in the background; None: full speed.
    """

    def __init__(
        self,
        peer: Any,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        *,
        ordered_peer_ids: Sequence[PeerID] | None = None,
        span_sizes: Sequence[int] | None = None,
        peer_fractions: Sequence[float] | None = None,
        modes: Sequence[AveragingMode] | None = None,
        weight: float | None = None,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        compression: CompressionType | str | CompressionBase = CompressionType.NONE,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        timeouts: AdaptiveTimeouts | None = None,
        timeout: float | None = None,
        averaging_alpha: float = 1.0,
        buffer_pool: BufferPool | None = None,
        aggregation: AggregationRule | None = None,
        send_pacer: SendPacer | None = None,
        tensor_infos: Sequence[CompressionInfo] | None = None,
    ):
        self.peer = peer
        if send_pacer is not None and not isinstance(send_pacer, SendPacer):
            raise ValidationError(f"send_pacer must be a SendPacer or None, got {send_pacer!r}")
        self._pacer = send_pacer
        self._paced_bytes = 0
        if aggregation is not None and not isinstance(aggregation, AggregationRule):
            raise ValidationError(
                f"aggregation must be an AggregationRule (e.g. CenteredClip()), got {aggregation!r}"
            )
        self.aggregation = aggregation
        self.group = group
        self.group_id = group.group_id
        ids = tuple(group.peer_ids if ordered_peer_ids is None else ordered_peer_ids)
        if len(set(ids)) != len(ids):
            raise ValidationError(f"group {self._gid}: a peer id appears twice in {ids}")
        if set(ids) != set(group.peer_ids):
            raise ValidationError(f"group {self._gid}: ordered_peer_ids are not its members")
        if peer.peer_id not in ids:
            raise ValidationError(f"group {self._gid}: {peer.peer_id} is not a member")
        self.ordered_peer_ids = ids
        self.my_index = ids.index(peer.peer_id)
        self.modes = tuple(AveragingMode.NODE for _ in ids) if modes is None else tuple(modes)
        if len(self.modes) != len(ids) or not all(isinstance(m, AveragingMode) for m in self.modes):
            raise ValidationError(f"group {self._gid}: need one AveragingMode per member")
        self.mode = self.modes[self.my_index]
        self.weight = self._check_weight(weight)
        self.averaging_alpha = fraction("averaging_alpha", averaging_alpha, low_open=True)
        if isinstance(tensors, torch.Tensor):
            raise ValidationError("tensors must be a sequence of tensors, not one tensor")
        total = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
        self.container = TensorPartContainer(
            tensors,
            self._spans(total, span_sizes, peer_fractions),
            part_size_bytes=part_size_bytes,
            compression=compression,
            tensor_infos=tensor_infos,
        )
        self.schema = tensor_schema(self.container.tensors)
        self.span_sizes = self.container.span_sizes
        self.codec_name = self.container.codec.compression_type.value
        self.timeouts = timeouts if timeouts is not None else AdaptiveTimeouts()
        if sender_timeout is not None or reducer_timeout is not None:
            self.timeouts = AdaptiveTimeouts(
                sender_timeout=sender_timeout,
                reducer_timeout=reducer_timeout,
                min_timeout=self.timeouts.min_timeout,
                slack=self.timeouts.slack,
                initial_rate=self.timeouts.initial_rate,
            )
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValidationError(f"timeout must be a positive number, got {timeout!r}")
        self.timeout = timeout
        self.pool = buffer_pool if buffer_pool is not None else DEFAULT_POOL

        self.sender_indices = [i for i, m in enumerate(self.modes) if m is not AveragingMode.AUX]
        self._slot_of = {member: slot for slot, member in enumerate(self.sender_indices)}
        self._router = AllReduceRouter.for_peer(peer)
        self._reducer: PartReducer | None = None
        self._replies: dict[int, tuple[bytes, memoryview] | memoryview] = {}
        self._admitted: set[int] = set()
        self._excluded: dict[PeerID, str] = {}
        self._failed_reducers: dict[PeerID, str] = {}
        self._bad_reducers: set[PeerID] = set()
        self._mismatches: list[str] = []
        self._averaged: set[int] = set()
        self._remote_contributions = 0
        self._handlers: dict[Any, asyncio.Task] = {}  # stream -> its serving task
        self._handlers_idle: asyncio.Event | None = None
        self._deadline: float | None = None
        self._started = False

    # ---------------------------------------------------------------- set-up

    @property
    def _gid(self) -> str:
        return self.group.group_id.hex()[:12]

    def _check_weight(self, weight: float | None) -> float:
        if self.mode is AveragingMode.AUX:
            if weight not in (None, 0, 0.0):
                raise ValidationError("an auxiliary member contributes nothing: weight must be 0")
            return 0.0
        return check_weight(1.0 if weight is None else weight)

    def _spans(
        self, total: int, span_sizes: Sequence[int] | None, fractions: Sequence[float] | None
    ) -> tuple[int, ...]:
        n = len(self.ordered_peer_ids)
        if span_sizes is not None and fractions is not None:
            raise ValidationError("give span_sizes or peer_fractions, not both")
        if span_sizes is not None:
            spans = tuple(span_sizes)
        elif fractions is not None:
            if len(fractions) != n or not all(f >= 0 for f in fractions) or sum(fractions) <= 0:
                raise ValidationError(f"peer_fractions must be {n} non-negative numbers")
            spans = load_balance_peers(total, [float(f) for f in fractions])
        else:
            bandwidths = [0.0 if m is AveragingMode.CLIENT else None for m in self.modes]
            spans = load_balance_peers(total, bandwidths)
        if len(spans) != n:
            raise ValidationError(f"{len(spans)} span sizes for {n} members")
        for i, size in enumerate(spans):
            if self.modes[i] is AveragingMode.CLIENT and size:
                raise ValidationError(
                    f"member {i} ({self.ordered_peer_ids[i]}) is a client and cannot own a span"
                )
        return spans

    def _hello(self, span_index: int) -> Hello:
        return Hello(
            self.group_id,
            span_index,
            self.weight,
            self.codec_name,
            self.schema,
            tuple(self.span_sizes),
            self.container.part_size_bytes,
        )

    # ---------------------------------------------------------------- the round

    async def run(self) -> AllReduceResult:
        """Run the round and return what it did. Raises :class:`GroupMismatch` when this
        member averaged nothing with anyone because its tensors or plan differ."""
        if self._started:
            raise ValidationError("an AllReduceRunner runs once; make a new one per round")
        self._started = True
        loop = asyncio.get_running_loop()
        if self.timeout is not None:
            self._deadline = loop.time() + self.timeout
        self._handlers_idle = asyncio.Event()
        self._handlers_idle.set()
        me = self.my_index
        self._router.register(self.group_id, self)
        acc_buffer = None
        if self.span_sizes[me] > 0:
            specs = [(spec.numel, spec.dtype) for spec in self.container.parts[me]]
            if self.aggregation is not None:
                self._reducer = RobustPartReducer(specs, len(self.sender_indices), self.aggregation)
            else:
                acc_buffer = self.pool.take(TensorPartReducer.accumulator_nbytes(specs))
                self._reducer = TensorPartReducer(
                    specs, len(self.sender_indices), buffer=acc_buffer
                )
        deadline_exceeded = False
        watchdog = None
        try:
            async with asyncio.timeout_at(self._deadline):
                async with asyncio.TaskGroup() as tasks:
                    if self.mode is not AveragingMode.AUX:
                        for j in owners_after(me, self.span_sizes):
                            tasks.create_task(self._exchange(j))
                    if self._reducer is not None:
                        watchdog = loop.call_later(
                            self._first_part_wait(), self._exclude_silent_senders
                        )
                        tasks.create_task(self._reduce_own_span())
        except TimeoutError:
            deadline_exceeded = True
            logger.warning(
                "all-reduce of group %s hit its %.3g s deadline; unfinished spans stay local",
                self._gid,
                self.timeout,
            )
        finally:
            if watchdog is not None:
                watchdog.cancel()
            self._router.unregister(self.group_id)
            if self._reducer is not None:
                self._reducer.cancel()
            await self._stop_handlers()
            self._replies.clear()
            if acc_buffer is not None:
                self.pool.give(acc_buffer)
        return self._result(deadline_exceeded)

    async def _stop_handlers(self) -> None:
        """Reset streams still being served and wait for their tasks to let go of our
        buffers (they stop at once once their stream is reset)."""
        for stream in list(self._handlers):
            stream.reset(f"all-reduce of group {self._gid} is over")
        tasks = [task for task in self._handlers.values() if task is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeouts.min_timeout)

    def _result(self, deadline_exceeded: bool) -> AllReduceResult:
        nonempty = {j for j, size in enumerate(self.span_sizes) if size > 0}
        local = set() if self.mode is AveragingMode.AUX else nonempty - self._averaged
        shared_any = self._remote_contributions or (self._averaged - {self.my_index})
        if self._mismatches and not shared_any:
            raise GroupMismatch(
                f"group {self._gid}: averaged nothing with anyone; {self._mismatches[0]}"
            )
        return AllReduceResult(
            group_id=self.group_id,
            averaged_spans=frozenset(self._averaged),
            local_spans=frozenset(local),
            excluded_senders=dict(self._excluded),
            failed_reducers=dict(self._failed_reducers),
            deadline_exceeded=deadline_exceeded,
            limited_senders=self._limited_senders(),
            bad_reducers=frozenset(self._bad_reducers),
            contributors=self._contributors(),
            paced_bytes=self._paced_bytes,
        )

    def _contributors(self) -> frozenset[PeerID]:
        counts = getattr(self._reducer, "contributions", None)
        if counts is None:
            return frozenset()
        return frozenset(
            self.ordered_peer_ids[member]
            for member, slot in self._slot_of.items()
            if counts[slot] and member != self.my_index
        )

    def _limited_senders(self) -> dict[PeerID, int]:
        counts = getattr(self._reducer, "limited", None)
        if counts is None:
            return {}
        return {
            self.ordered_peer_ids[member]: counts[slot]
            for member, slot in self._slot_of.items()
            if counts[slot] and member != self.my_index
        }

    # ---------------------------------------------------------------- sender side

    async def _exchange(self, span_index: int) -> None:
        """Stream our parts of ``span_index`` to its owner and collect the averages."""
        owner = self.ordered_peer_ids[span_index]
        meter = self.timeouts.new_meter()
        stream = writer = None
        result_buffer = None
        clean = False
        try:
            stream = await within(
                self.peer.open_stream(owner, AGGREGATE_PART),
                self.timeouts.reducer_wait(meter, 0),
                f"connecting to {owner}",
            )
            await stream.write(encode_message(self._hello(span_index).encode()))
            sent = [0]
            if self.codec_name != NO_CODEC:
                # Encoded parts follow the hello at once: the owner reads them through the
                # stream's own buffer anyway, and its answer would reach us behind the
                # bulk data it already sends us (see the module docstring).
                writer = self._start_writer(stream, span_index, sent)
            status = decode_status(
                await within(
                    read_message(stream),
                    self.timeouts.reducer_wait(meter, 0),
                    f"{owner} did not answer",
                )
            )
            if isinstance(status, Refused):
                raise RemoteError(status.error, remote_type=status.type, peer=owner)
            activity = lambda: sent[0] + connection_bytes(stream)  # noqa: E731
            if writer is None:
                writer = self._start_writer(stream, span_index, sent)
            nbytes = self.container.span_nbytes(span_index)
            if status.codec == NO_CODEC:
                result_buffer = self.pool.take(nbytes)
                averaged = await self._receive_raw(
                    stream, span_index, result_buffer, meter, activity
                )
            else:
                averaged = await self._receive_framed(stream, span_index, meter, activity)
            if self.aggregation is not None:
                self._check_robust_result(span_index, averaged)
            for part_index, values in enumerate(averaged):
                self.container.apply_part(span_index, part_index, values, self.averaging_alpha)
            self._averaged.add(span_index)
            # The span is complete and applied; what follows is only a clean goodbye.
            with contextlib.suppress(SwarmgradError, OSError, TimeoutError):
                await within(writer, self.timeouts.min_timeout, "sending our last parts")
                clean = await self._read_end(stream, self.timeouts.min_timeout)
        except (SwarmgradError, OSError, TimeoutError) as e:
            reason = describe(e)
            self._failed_reducers[owner] = reason
            if isinstance(e, BadReduction):
                self._bad_reducers.add(owner)
            if isinstance(e, RemoteError) and e.remote_type == GroupMismatch.__name__:
                self._mismatches.append(e.args[0])
            if peer_is_gone(e) and self._reducer is not None and span_index in self._slot_of:
                # the same connection would carry its parts to us: stop waiting for them
                self._exclude(span_index, f"unreachable: {reason}")
            logger.warning(
                "all-reduce %s: keeping span %d local, its owner %s failed: %s",
                self._gid,
                span_index,
                owner,
                reason,
            )
        finally:
            if stream is not None and not clean:
                stream.reset("sender gave up")
            if writer is not None:
                await settle(writer)
            if result_buffer is not None:
                self.pool.give(result_buffer)

    def _check_robust_result(self, span_index: int, averaged: Sequence[torch.Tensor]) -> None:
        """Robust mode: a span whose result lies farther from our own input than the rule
        allows (:meth:`~..robust.rules.AggregationRule.max_result_distance`, over the whole span)
        is a bad reduction; the span stays local and its owner is named."""
        assert self.aggregation is not None
        squared_distance = squared_norm = 0.0
        for part_index, values in enumerate(averaged):  # float32 is ample for a bound
            own = self.container.local_part(span_index, part_index).reshape(-1)
            squared_distance += float(torch.dist(values.reshape(-1).to(own.dtype), own)) ** 2
            squared_norm += float(torch.linalg.vector_norm(own)) ** 2
        distance = math.sqrt(squared_distance)
        bound = self.aggregation.max_result_distance(math.sqrt(squared_norm))
        if not distance <= bound:
            raise BadReduction(
                f"span {span_index} came back {distance:.4g} away from our input, beyond "
                f"the {bound:.4g} that {self.aggregation.tag} allows"
            )

    def _start_writer(self, stream: Any, span_index: int, sent: list[int]) -> asyncio.Future:
        writer = asyncio.ensure_future(self._send_parts(stream, span_index, sent))
        writer.add_done_callback(functools.partial(reset_on_failure, stream))
        return writer

    async def _send_parts(self, stream: Any, span_index: int, sent: list[int]) -> None:
        """Write our parts of a span; ``sent[0]`` counts bytes (the owner is alive while
        it takes them)."""
        container = self.container
        raw = self.codec_name == NO_CODEC
        for part_index in range(container.num_parts(span_index)):
            if raw:
                data = tensor_bytes(container.local_part(span_index, part_index))
                await self._write(stream, data)
            else:
                serialized = container.serialize(span_index, part_index)
                await stream.write(encode_message(serialized.header()))
                data = memoryview(serialized.buffer)
                await self._write(stream, data)
            sent[0] += data.nbytes
        await stream.close_write()

    async def _write(self, stream: Any, data: bytes | bytearray | memoryview) -> None:
        """Write a part's payload, spaced to ``send_rate`` when the round has one."""
        if self._pacer is None:
            await stream.write(data)
        else:
            await self._pacer.write(stream, data)
            self._paced_bytes += memoryview(data).nbytes

    async def _receive_raw(
        self,
        stream: Any,
        span_index: int,
        buffer: torch.Tensor,
        meter: ThroughputMeter,
        activity: Callable[[], int],
    ) -> list[torch.Tensor]:
        """Receive the averaged span straight into ``buffer``, checking each part as soon
        as it is in."""
        owner = self.ordered_peer_ids[span_index]
        container = self.container
        offsets = container.part_offsets(span_index)
        specs = container.parts[span_index]
        progress = Progress(offsets[1:])
        target = memoryview(buffer[: offsets[-1]].numpy())
        reader = asyncio.ensure_future(stream.readexactly_into(target, progress=progress.callback))
        loop = asyncio.get_running_loop()
        averaged: list[torch.Tensor] = []
        try:
            while len(averaged) < len(specs):
                k = len(averaged)
                started = loop.time()
                complete = await progress.wait_parts(
                    reader,
                    lambda k=k: self.timeouts.reducer_wait(meter, specs[k].nbytes),
                    f"averaged part {k} from {owner}",
                    activity,
                )
                meter.observe(offsets[complete[-1] + 1] - offsets[k], loop.time() - started)
                for part_index in complete:
                    data = buffer[offsets[part_index] : offsets[part_index + 1]]
                    values = container.part_from_bytes(span_index, part_index, data)
                    if not all_finite(values):
                        raise ProtocolViolation(
                            f"{owner} sent NaN or Inf in averaged part {part_index}"
                        )
                    averaged.append(values)
            await reader
        finally:
            await settle(reader)
        return averaged

    async def _receive_framed(
        self,
        stream: Any,
        span_index: int,
        meter: ThroughputMeter,
        activity: Callable[[], int],
    ) -> list[torch.Tensor]:
        owner = self.ordered_peer_ids[span_index]
        specs = self.container.parts[span_index]
        averaged = []
        loop = asyncio.get_running_loop()
        for part_index, spec in enumerate(specs):
            started = loop.time()
            message = await while_active(
                read_framed_part(stream),
                lambda spec=spec: self.timeouts.reducer_wait(meter, spec.nbytes),
                f"{owner} sent no averaged part {part_index}",
                activity,
            )
            meter.observe(spec.nbytes, loop.time() - started)
            values = self.container.decode_part(
                span_index, part_index, message, f"averaged part from {owner}"
            )
            if not all_finite(values):
                raise ProtocolViolation(f"{owner} sent NaN or Inf in averaged part {part_index}")
            averaged.append(values)
        return averaged

    async def _read_end(self, stream: Any, seconds: float) -> bool:
        """Expect the remote's end of stream; True if it came cleanly."""
        try:
            extra = await within(stream.read(1), seconds, "end of stream")
        except (SwarmgradError, OSError):
            return False
        if extra:
            logger.debug("%s sent data past the end of its share", stream.remote_peer_id)
            return False
        return True

    # ---------------------------------------------------------------- owner side

    def _first_part_wait(self) -> float:
        specs = self.container.parts[self.my_index]
        nbytes = specs[0].nbytes if specs else 0
        return self.timeouts.sender_wait(ThroughputMeter(), nbytes)

    def _exclude_silent_senders(self) -> None:
        """Senders that never called us within the first part's wait are dropped."""
        for member in self.sender_indices:
            if member != self.my_index and member not in self._admitted:
                self._exclude(member, "sent nothing before its first part's deadline")

    def _exclude(self, member: int, reason: str) -> None:
        peer_id = self.ordered_peer_ids[member]
        if peer_id not in self._excluded:
            self._excluded[peer_id] = reason
            logger.warning("all-reduce %s: excluded sender %s: %s", self._gid, peer_id, reason)
        if self._reducer is not None:
            self._reducer.on_sender_failed(self._slot_of[member])
