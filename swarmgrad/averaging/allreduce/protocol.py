"""The all-reduce's wire protocol: ``averaging.aggregate_part``, one raw stream per
sender and owner, and its messages.

Wire protocol (one raw stream per sender and owner; why not RPC messages: a message's
tensor payload is received into a freshly allocated buffer, and on loopback those
allocations and page faults cost a quarter of a round; here each span is received
straight into a reused buffer, see :mod:`.buffers`)::

    sender -> owner:  message(hello) | span data
    owner -> sender:  message({"ok": True, "codec": ...}) | averaged span data
                      or message({"error": ..., "type": ...}) and a reset

``message`` is ``u32 length | msgpack``. Span data without compression is the parts'
raw bytes back to back (sizes are known to both sides), sent only after the owner's
``ok`` (one round trip per round): the owner's receive buffer is then in place, so the
data lands in it without a copy, and a refused stream costs no bandwidth. With a codec
each part is ``message(tensor header) | payload``, read through the stream's own buffer,
and it follows the hello at once: on a busy link the ``ok`` comes back behind the data
the owner already streams to us on the same connection and the queues it crosses (8
peers at 100 Mbit/s: the last ``ok`` arrived up to 0.6 s into a 2.9-s round), which the
raw path pays for its copy-free receive. A refused stream then wastes at most the
stream's flow-control window. A failure after the first message resets the stream with
the reason.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgpack

from swarmgrad.compression import CompressionType, check_header
from swarmgrad.utils.errors import CodecError, ProtocolViolation, SwarmgradError

AGGREGATE_PART = "averaging.aggregate_part"
PROTOCOL_VERSION = 1
HELLO_TIMEOUT = 30.0  # a caller must name its group this fast
MAX_MESSAGE_SIZE = 16 * 1024 * 1024  # hello (with the tensor schema), status, part headers
RECEIVE_WINDOW_BYTES = 64 * 1024 * 1024  # an owner receives at most this much per sender
LENGTH = struct.Struct(">I")  # the length prefix of every message
NO_CODEC = CompressionType.NONE.value  # the codec name of raw (uncompressed) span data


def encode_message(body: Any) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    return LENGTH.pack(len(packed)) + packed


async def read_message(stream: Any) -> Any:
    """One ``u32 length | msgpack`` message; ProtocolViolation if malformed or huge."""
    (length,) = LENGTH.unpack(await stream.readexactly(LENGTH.size))
    if length > MAX_MESSAGE_SIZE:
        raise ProtocolViolation(
            f"{stream.remote_peer_id} sent an all-reduce message of {length} bytes "
            f"(limit {MAX_MESSAGE_SIZE})"
        )
    data = await stream.readexactly(length)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolViolation(
            f"malformed all-reduce message from {stream.remote_peer_id}: {e}"
        ) from None


async def refuse(stream: Any, error: BaseException) -> None:
    """Tell the caller why, then drop the stream (the message arrives before the reset)."""
    with contextlib.suppress(SwarmgradError, OSError):
        await stream.write(encode_message({"error": str(error), "type": type(error).__name__}))
    stream.reset(str(error)[:500])


async def read_framed_part(stream: Any) -> dict[str, Any]:
    """A compressed part: header message, then exactly the payload it announces."""
    header = await read_message(stream)
    try:
        nbytes = check_header(header)
    except CodecError as e:
        raise ProtocolViolation(f"{stream.remote_peer_id} sent a bad part header: {e}") from None
    payload = bytearray(nbytes)
    if nbytes:
        await stream.readexactly_into(payload)
    return {"h": header, "b": payload}


def schema_difference(theirs: Any, ours: list[list[Any]]) -> str:
    """Name the first tensor whose dtype or shape differs, for a clear refusal."""
    if not isinstance(theirs, list):
        return "sent no tensor schema"
    if len(theirs) != len(ours):
        return f"averages {len(theirs)} tensors, this member averages {len(ours)}"
    for index, (their, our) in enumerate(zip(theirs, ours, strict=True)):
        if their != our:
            return f"tensor {index} is {their!r} (dtype, shape) there but {our!r} here"
    return "tensor schemas differ"
