"""The owner's half of an all-reduce round: admit each sender's stream, reduce the span
part by part as the bytes come in, and stream each averaged part back.

:class:`OwnerRole` is mixed into :class:`~.runner.AllReduceRunner` and shares its state
(one round, one object); it lives apart so that each half reads on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from typing import Any

import msgpack
import torch

from swarmgrad.averaging.allreduce.deadlines import ThroughputMeter
from swarmgrad.averaging.allreduce.protocol import (
    LENGTH,
    NO_CODEC,
    RECEIVE_WINDOW_BYTES,
    Admitted,
    Hello,
    decode_hello,
    encode_message,
    read_framed_part,
    refuse,
    schema_difference,
)
from swarmgrad.averaging.allreduce.streams import (
    Progress,
    connection_bytes,
    describe,
    part_windows,
    settle,
    while_active,
)
from swarmgrad.averaging.allreduce.types import (
    MAX_WEIGHT,
    AveragingMode,
    GroupMismatch,
)
from swarmgrad.compression import (
    CompressionInfo,
    TensorDescriptor,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from swarmgrad.compression.base import all_finite, tensor_bytes
from swarmgrad.compression.serialized import SerializedTensor
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import (
    DeadlineExceeded,
    ProtocolViolation,
    SwarmgradError,
    ValidationError,
)

logger = logging.getLogger(__name__)


class OwnerRole:
    """Owner-side methods of :class:`~.runner.AllReduceRunner` (see the module docstring)."""

    async def _reduce_own_span(self) -> None:
        me, reducer = self.my_index, self._reducer
        assert reducer is not None
        if self.mode is not AveragingMode.AUX:
            slot = self._slot_of[me]
            local = [self.container.local_part(me, k) for k in range(reducer.num_parts)]
            if all(all_finite(part) for part in local):
                # borrowed: our span of the tensors is written only after the round, so the
                # first sender's part is added to it in one pass instead of copying it first
                for part_index, part in enumerate(local):
                    reducer.accumulate_part(slot, part_index, part, self.weight, borrow=True)
            else:  # the others' average is still worth having
                logger.warning(
                    "all-reduce %s: local tensors hold NaN or Inf; averaging span %d without them",
                    self._gid,
                    me,
                )
                reducer.on_sender_failed(slot)
        await reducer.wait_all()
        if self.mode is not AveragingMode.AUX:
            results = []
            lossy = self.codec_name != NO_CODEC
            for part_index in range(reducer.num_parts):
                values = reducer.part_future(part_index).result()
                if values is None:
                    break
                if lossy:  # apply what the senders get: every member holds the same values
                    head, payload = self._reply(part_index)
                    values = deserialize_torch_tensor(
                        SerializedTensor.from_header(
                            msgpack.unpackb(head[LENGTH.size :], raw=False), payload
                        )
                    )
                if not all_finite(values):  # finite inputs can still overflow in the sum
                    logger.warning(
                        "all-reduce %s: the average of part %d of span %d is not finite; "
                        "keeping the span local",
                        self._gid,
                        part_index,
                        me,
                    )
                    break
                results.append(values)
            else:
                for part_index, values in enumerate(results):
                    self.container.apply_part(me, part_index, values, self.averaging_alpha)
                self._averaged.add(me)
        # Senders may still be receiving our last parts: wait for that, within a bound.
        wait = self.timeouts.reducer_wait(ThroughputMeter(), self.container.span_nbytes(me))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._handlers_idle.wait()

    def _reply(self, part_index: int) -> Any:
        """The averaged part as sent: raw bytes, or (header message, payload) with a
        codec. Encoded once and sent to every sender."""
        reply = self._replies.get(part_index)
        if reply is None:
            values = self._reducer.part_future(part_index).result()
            if values is None:
                short = self._reducer.min_inputs
                why = f"fewer than the {short} inputs the rule needs" if short > 1 else "no data"
                raise ValidationError(f"part {part_index} could not be averaged: {why}")
            if self.codec_name == NO_CODEC:
                reply = tensor_bytes(values)
            else:
                spec = self.container.parts[self.my_index][part_index]
                first = spec.pieces[0].tensor_index
                info = CompressionInfo(
                    key=first,
                    descriptor=TensorDescriptor.from_tensor(self.container.tensors[first]),
                    part_index=part_index,
                    part_size=spec.numel,
                )
                serialized = serialize_torch_tensor(values, self.container.codec, info)
                reply = (encode_message(serialized.header()), memoryview(serialized.buffer))
            self._replies[part_index] = reply
        return reply

    def _admit(self, remote: PeerID, hello: Hello) -> int:
        """Check a caller's hello; return its member index or raise the reason to refuse."""
        me = self.my_index
        try:
            member = self.ordered_peer_ids.index(remote)
        except ValueError:
            raise ValidationError(f"{remote} is not a member of group {self._gid}") from None
        if self.modes[member] is AveragingMode.AUX:
            raise ValidationError(f"{remote} is an auxiliary member and sends no tensors")
        if hello.span != me or self._reducer is None:
            raise ValidationError(
                f"{remote} sent parts of span {hello.span!r} to member {me} "
                f"({self.peer.peer_id}), which reduces {self.span_sizes[me]} elements"
            )
        if hello.schema != self.schema:
            raise GroupMismatch(f"{remote}: {schema_difference(hello.schema, self.schema)}")
        if (
            hello.spans != tuple(self.span_sizes)
            or hello.part_size != self.container.part_size_bytes
        ):
            raise GroupMismatch(
                f"{remote} plans spans {list(hello.spans)} with parts of {hello.part_size} "
                f"bytes; this member plans {list(self.span_sizes)} with "
                f"{self.container.part_size_bytes}"
            )
        weight = hello.weight
        if not math.isfinite(weight) or not 0 <= weight <= MAX_WEIGHT:
            raise ValidationError(
                f"{remote} sent weight {weight!r}; must be finite, >= 0 and at most {MAX_WEIGHT:g}"
            )
        if member in self._admitted:
            raise ValidationError(f"{remote} opened a second stream for group {self._gid}")
        if remote in self._excluded:
            raise ValidationError(
                f"{remote} was excluded from group {self._gid}: {self._excluded[remote]}"
            )
        if self._reducer.finished:
            raise ValidationError(f"span {me} of group {self._gid} is already averaged")
        self._admitted.add(member)
        return member

    async def _serve_sender(self, stream: Any, message: dict[str, Any]) -> None:
        """One sender's stream (``message``: its hello): accumulate its parts, stream the
        averaged parts back. Never raises (errors reset the stream)."""
        remote = stream.remote_peer_id
        try:
            hello = decode_hello(message, remote)
            member = self._admit(remote, hello)
        except (ValidationError, ProtocolViolation) as e:
            if isinstance(e, GroupMismatch):  # it cannot come back with the right tensors
                self._mismatches.append(str(e))
                self._exclude(self.ordered_peer_ids.index(remote), str(e))
            logger.debug("all-reduce %s: refused %s: %s", self._gid, remote, e)
            await refuse(stream, e)
            return
        reducer = self._reducer
        self._handlers[stream] = asyncio.current_task()
        self._handlers_idle.clear()
        consumer = asyncio.ensure_future(
            self._consume(member, float(hello.weight), hello.codec, stream)
        )
        try:
            await asyncio.sleep(0)  # let the consumer post its receive buffer first
            await stream.write(encode_message(Admitted(self.codec_name).encode()))
            for part_index in range(reducer.num_parts):
                future = reducer.part_future(part_index)
                while not future.done() and not consumer.done():
                    await asyncio.wait((future, consumer), return_when=asyncio.FIRST_COMPLETED)
                if consumer.done():
                    consumer.result()  # an excluded sender gets its reason, not averages
                if not future.done():
                    await asyncio.shield(future)  # it delivered everything: wait for others
                if future.cancelled():
                    raise DeadlineExceeded(f"all-reduce of group {self._gid} ended early")
                reply = self._reply(part_index)
                if isinstance(reply, tuple):
                    await stream.write(reply[0])
                    await self._write(stream, reply[1])
                else:
                    await self._write(stream, reply)
            await stream.close_write()
            await consumer
        except (SwarmgradError, OSError, TimeoutError, asyncio.CancelledError) as e:
            stream.reset(describe(e)[:500] if not isinstance(e, asyncio.CancelledError) else "")
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            await settle(consumer)
            self._handlers.pop(stream, None)
            if not self._handlers:
                self._handlers_idle.set()

    async def _consume(self, member: int, weight: float, codec: str, stream: Any) -> None:
        """Read one sender's parts into the reducer; any failure excludes the sender."""
        remote = self.ordered_peer_ids[member]
        reducer = self._reducer
        slot = self._slot_of[member]
        meter = self.timeouts.new_meter()
        try:
            if codec == NO_CODEC:
                await self._consume_raw(slot, weight, stream, meter)
            else:
                await self._consume_framed(slot, weight, stream, meter)
            if not await self._read_end(stream, self.timeouts.sender_wait(meter, 0)):
                raise ProtocolViolation(f"{remote} sent more than the data of its share")
        except BaseException as e:
            cancelled = isinstance(e, asyncio.CancelledError)
            if not cancelled or reducer.contributions[slot] < reducer.num_parts:
                self._exclude(member, "cancelled" if cancelled else describe(e))
            raise

    async def _consume_raw(
        self, slot: int, weight: float, stream: Any, meter: ThroughputMeter
    ) -> None:
        """Receive a sender's span into a pooled buffer, window by window, and add each
        part into the running sums as soon as its bytes are in."""
        me, container = self.my_index, self.container
        offsets = container.part_offsets(me)
        specs = container.parts[me]
        windows = part_windows(offsets, RECEIVE_WINDOW_BYTES)
        buffer = self.pool.take(max(offsets[end] - offsets[start] for start, end in windows))
        loop = asyncio.get_running_loop()
        try:
            for start, end in windows:
                base = offsets[start]
                progress = Progress([offsets[k + 1] - base for k in range(start, end)])
                target = memoryview(buffer[: offsets[end] - base].numpy())
                reader = asyncio.ensure_future(
                    stream.readexactly_into(target, progress=progress.callback)
                )
                try:
                    done = start
                    while done < end:
                        started = loop.time()
                        complete = await progress.wait_parts(
                            reader,
                            lambda k=done: self.timeouts.sender_wait(meter, specs[k].nbytes),
                            f"no part {done}",
                            functools.partial(connection_bytes, stream),
                        )
                        last = start + complete[-1]
                        meter.observe(offsets[last + 1] - offsets[done], loop.time() - started)
                        for k in range(done, last + 1):
                            data = buffer[offsets[k] - base : offsets[k + 1] - base]
                            self._accumulate(
                                slot, k, container.part_from_bytes(me, k, data), weight
                            )
                        done = last + 1
                    await reader
                finally:
                    await settle(reader)
        finally:
            self.pool.give(buffer)

    async def _consume_framed(
        self, slot: int, weight: float, stream: Any, meter: ThroughputMeter
    ) -> None:
        me, container = self.my_index, self.container
        remote = stream.remote_peer_id
        loop = asyncio.get_running_loop()
        for k, spec in enumerate(container.parts[me]):
            wait = self.timeouts.sender_wait(meter, spec.nbytes)
            started = loop.time()
            message = await while_active(
                read_framed_part(stream),
                lambda wait=wait: wait,
                f"no part {k}",
                functools.partial(connection_bytes, stream),
            )
            meter.observe(spec.nbytes, loop.time() - started)
            part = container.decode_part(me, k, message, str(remote))
            self._accumulate(slot, k, part, weight, reuse=True)

    def _accumulate(
        self, slot: int, k: int, part: torch.Tensor, weight: float, reuse: bool = False
    ) -> None:
        if not all_finite(part):
            raise ProtocolViolation(
                f"{self.ordered_peer_ids[self.sender_indices[slot]]} sent NaN or Inf in part {k}"
            )
        self._reducer.accumulate_part(slot, k, part, weight, reuse=reuse)
        self._remote_contributions += 1
