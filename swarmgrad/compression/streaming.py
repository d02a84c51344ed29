"""Moving large tensors in parts.

Two complementary tools:

* :func:`split_for_streaming` / :func:`combine_from_streaming` cut one serialized tensor's
  payload into parts of at most ``part_size_bytes`` (memoryview slices, no copies) and put
  them back together, checking order and sizes. Use them to respect a message size limit.
  Nothing can be decoded before the last part arrives.
* :func:`split_into_parts` cuts a tensor into flat pieces of at most ``max_numel`` elements
  that are compressed *separately* (with ``info.get_part(index, size)``), so each piece can
  be sent, reduced and decoded while the next one is still being compressed or received.
  Averaging uses this; reassemble with ``torch.cat(parts).view(shape)``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmgrad.compression.serialization import deserialize_torch_tensor
from swarmgrad.compression.serialized import (
    Buffer,
    SerializedTensor,
    check_header,
)
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import CodecError

__all__ = [
    "DEFAULT_MAX_NBYTES",
    "TensorPart",
    "TensorPartAssembler",
    "combine_from_streaming",
    "deserialize_tensor_stream",
    "split_for_streaming",
    "split_into_parts",
]

#: Largest payload :class:`TensorPartAssembler` accepts unless told otherwise (16 GiB).
DEFAULT_MAX_NBYTES = 1 << 34


@dataclass(frozen=True)
class TensorPart:
    """One part of a streamed payload.

    Every part carries its ``index`` and the total ``count``; the first part (index 0) also
    carries the tensor's header (:meth:`SerializedTensor.header`) and the ``part_size`` all
    parts but the last have exactly.
    """

    index: int
    count: int
    buffer: Buffer = field(repr=False)
    tensor_header: Mapping[str, Any] | None = None
    part_size: int | None = None

    @property
    def nbytes(self) -> int:
        return memoryview(self.buffer).nbytes

    def header(self) -> dict[str, Any]:
        """Everything but the buffer, msgpack-able."""
        header: dict[str, Any] = {"index": self.index, "count": self.count, "nbytes": self.nbytes}
        if self.tensor_header is not None:
            header["tensor"] = dict(self.tensor_header)
            header["part_size"] = self.part_size
        return header

    @classmethod
    def from_header(cls, header: Mapping[str, Any], buffer: Buffer) -> TensorPart:
        """Rebuild a received part; :class:`CodecError` if the header is malformed or its
        ``nbytes`` disagrees with the buffer. (Order and sizes are checked on assembly.)"""
        if not isinstance(header, Mapping):
            raise CodecError(f"part header must be a mapping, got {type(header).__name__}")
        for key in ("index", "count", "nbytes"):
            if type(header.get(key)) is not int or header[key] < 0:
                raise CodecError(f"part header field {key!r} must be a non-negative integer")
        arrived = memoryview(buffer).nbytes
        if header["nbytes"] != arrived:
            raise CodecError(
                f"part {header['index']} announces {header['nbytes']} bytes, got {arrived}"
            )
        return cls(
            index=header["index"],
            count=header["count"],
            buffer=buffer,
            tensor_header=header.get("tensor"),
            part_size=header.get("part_size"),
        )


def split_for_streaming(serialized: SerializedTensor, part_size_bytes: int) -> Iterator[TensorPart]:
    """Cut ``serialized``'s payload into parts of ``part_size_bytes`` (the last may be
    shorter; an empty payload gives one empty part). Part buffers are memoryview slices of
    the payload: nothing is copied."""
    positive_int("part_size_bytes", part_size_bytes)
    payload = memoryview(serialized.buffer).cast("B")
    count = max(1, -(-payload.nbytes // part_size_bytes))
    header = serialized.header()
    for index in range(count):
        start = index * part_size_bytes
        yield TensorPart(
            index=index,
            count=count,
            buffer=payload[start : start + part_size_bytes],
            tensor_header=header if index == 0 else None,
            part_size=part_size_bytes if index == 0 else None,
        )


class TensorPartAssembler:
    """Reassembles parts arriving one at a time (for instance from an async stream).

    :meth:`add` checks each part as it arrives, so a bad or oversized stream is refused
    before its payload is buffered: the first part's tensor header is validated and its
    announced size checked against ``max_nbytes`` before anything is allocated; parts must
    come in order, exactly once, with the sizes the first part implies.
    """

    def __init__(self, max_nbytes: int = DEFAULT_MAX_NBYTES):
        self.max_nbytes = max_nbytes
        self._header: Mapping[str, Any] | None = None
        self._count = 0
        self._part_size = 0
        self._total = 0
        self._received = 0
        self._payload: bytearray | Buffer | None = None

    @property
    def done(self) -> bool:
        return self._header is not None and self._received == self._count

    def add(self, part: TensorPart) -> SerializedTensor | None:
        """Take the next part; returns the whole tensor once its last part is added."""
        if not isinstance(part, TensorPart):
            raise CodecError(f"expected a TensorPart, got {type(part).__name__}")
        if self._header is None:
            self._start(part)
        else:
            self._check_next(part)
        nbytes = part.nbytes
        expected = min(self._part_size, self._total - part.index * self._part_size)
        if nbytes != expected:
            raise CodecError(
                f"part {part.index} of {self._count} must have {expected} bytes, got {nbytes}"
            )
        if self._count == 1:
            self._payload = part.buffer  # a single part is used as it is, without copying
        else:
            start = part.index * self._part_size
            self._payload[start : start + nbytes] = memoryview(part.buffer).cast("B")
        self._received += 1
        return self.result() if self.done else None

    def result(self) -> SerializedTensor:
        """The reassembled tensor; :class:`CodecError` if parts are still missing."""
        if self._header is None:
            raise CodecError("stream ended before its first part")
        if not self.done:
            raise CodecError(f"stream truncated: received {self._received} of {self._count} parts")
        return SerializedTensor.from_header(self._header, self._payload)

    def _start(self, part: TensorPart) -> None:
        if part.index != 0:
            raise CodecError(f"stream must start with part 0, got part {part.index}")
        if part.tensor_header is None:
            raise CodecError("the first part of a stream lacks the tensor header")
        total = check_header(part.tensor_header)
        if total > self.max_nbytes:
            raise CodecError(
                f"streamed tensor announces {total} bytes, more than the limit of {self.max_nbytes}"
            )
        part_size = part.part_size
        if type(part_size) is not int or part_size < 1:
            raise CodecError(f"the first part must give a positive part_size, got {part_size!r}")
        count = max(1, -(-total // part_size))
        if part.count != count:
            raise CodecError(
                f"{total} bytes in parts of {part_size} make {count} parts, the stream "
                f"announces {part.count}"
            )
        self._header, self._count, self._part_size, self._total = (
            part.tensor_header,
            count,
            part_size,
            total,
        )
        if count > 1:
            self._payload = bytearray(total)

    def _check_next(self, part: TensorPart) -> None:
        if self.done:
            raise CodecError(f"stream has more parts than the {self._count} it announced")
        if part.count != self._count:
            raise CodecError(
                f"part {part.index} announces {part.count} parts, the stream {self._count}"
            )
        if part.index < self._received:
            raise CodecError(f"duplicate part {part.index}")
        if part.index > self._received:
            raise CodecError(f"part {self._received} is missing (got part {part.index} instead)")


def combine_from_streaming(
    parts: Iterable[TensorPart], max_nbytes: int = DEFAULT_MAX_NBYTES
) -> SerializedTensor:
    """Reassemble the parts of one tensor (see :class:`TensorPartAssembler`).

    Copies multi-part payloads once into a writable ``bytearray``, which decoding then
    wraps without copying. Raises :class:`CodecError` for missing, duplicate, out-of-order,
    wrongly sized or surplus parts, and for a truncated stream.
    """
    assembler = TensorPartAssembler(max_nbytes)
    for part in parts:
        assembler.add(part)  # raises on a part after the last one
    return assembler.result()


async def deserialize_tensor_stream(
    stream: AsyncIterable[Iterable[TensorPart]], max_nbytes: int = DEFAULT_MAX_NBYTES
) -> list[torch.Tensor]:
    """Decode the tensors of a stream whose messages each carry a batch of parts.

    The parts of each tensor follow each other in order; a part with index 0 starts the
    next tensor. Raises :class:`CodecError` if the stream ends inside a tensor or breaks
    the rules of :class:`TensorPartAssembler`.
    """
    tensors: list[torch.Tensor] = []
    assembler: TensorPartAssembler | None = None
    async for batch in stream:
        for part in batch:
            if assembler is None:
                assembler = TensorPartAssembler(max_nbytes)
            complete = assembler.add(part)
            if complete is not None:
                tensors.append(deserialize_torch_tensor(complete))
                assembler = None
    if assembler is not None:
        assembler.result()  # raises: the stream ended inside a tensor
    return tensors


def split_into_parts(tensor: torch.Tensor, max_numel: int) -> tuple[torch.Tensor, ...]:
    """Flat pieces of ``tensor`` of at most ``max_numel`` elements each, in order (views
    when the tensor is contiguous). An empty tensor gives one empty piece."""
    positive_int("max_numel", max_numel)
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return (flat,)
    return tuple(flat.split(max_numel))
