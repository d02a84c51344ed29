"""The all-reduce's wire protocol: ``averaging.aggregate_part``, one raw stream per
sender and owner, and its messages.

Wire protocol (one raw stream per sender and owner; why not RPC messages: a message's
tensor payload is received into a freshly allocated buffer, and on loopback those
allocations and page faults cost a quarter of a round; here each span is received
straight into a reused buffer, see :mod:`.buffers`)::

    sender -> owner:  message(Hello) | span data
    owner -> sender:  message(Admitted) | averaged span data
                      or message(Refused) and a reset

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
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmgrad.compression import CompressionType, check_header
from swarmgrad.utils.errors import CodecError, ProtocolViolation, SwarmgradError, ValidationError

__all__ = [
    "AGGREGATE_PART",
    "PROTOCOL_VERSION",
    "Admitted",
    "Hello",
    "Refused",
    "decode_hello",
    "decode_hello_route",
    "decode_status",
]

AGGREGATE_PART = "averaging.aggregate_part"  # the raw stream protocol, one per sender and owner
PROTOCOL_VERSION = 1  # sent as "v" in the hello; an owner refuses any other
HELLO_TIMEOUT = 30.0  # a caller must name its group this fast
MAX_MESSAGE_SIZE = 16 * 1024 * 1024  # hello (with the tensor schema), status, part headers
RECEIVE_WINDOW_BYTES = 64 * 1024 * 1024  # an owner receives at most this much per sender
LENGTH = struct.Struct(">I")  # the length prefix of every message
NO_CODEC = CompressionType.NONE.value  # the codec name of raw (uncompressed) span data


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


@dataclass(frozen=True)
class Hello:
    """A sender's first message on a stream to the owner of span ``span``: which group,
    with what weight and codec, and what it believes the round is (tensor schema, span
    sizes, part size), which the owner compares with its own before it admits it.
    Keys are one letter where they were so from the start (``g``, ``w``, ``v``)."""

    group_id: bytes  # "g": routes the stream to the group's runner
    span: int  # "span": the index of the owner (member) whose span this stream carries
    weight: float  # "w": the sender's weight in the average (0 for nobody's)
    codec: str  # "codec": how the sender's parts are encoded (NO_CODEC: raw bytes)
    schema: list  # "schema": [[dtype name, [shape...]], ...] of the averaged tensors
    spans: tuple[int, ...]  # "spans": elements each member reduces, in member order
    part_size: int  # "part": bytes per part
    version: int = PROTOCOL_VERSION  # "v"

    def encode(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "g": self.group_id,
            "span": self.span,
            "w": self.weight,
            "codec": self.codec,
            "schema": self.schema,
            "spans": list(self.spans),
            "part": self.part_size,
        }


def decode_hello_route(message: Any, remote: Any) -> bytes:
    """The group id a hello names, checked before the stream goes to that group's runner:
    ProtocolViolation if there is none; ValidationError for another protocol version."""
    if not isinstance(message, dict) or not isinstance(message.get("g"), bytes):
        raise ProtocolViolation(f"{remote} opened an all-reduce without a group id")
    if message.get("v") != PROTOCOL_VERSION:
        raise ValidationError(
            f"all-reduce protocol version {message.get('v')!r} from {remote} is not "
            f"supported (this peer speaks {PROTOCOL_VERSION})"
        )
    return message["g"]


def decode_hello(message: Any, remote: Any) -> Hello:
    """The whole hello; ProtocolViolation naming the field (and ``remote``, the sender)
    if a field is missing or of the wrong type. Whether its values fit the round is the
    owner's to judge (:meth:`~.owner.OwnerRole._admit`)."""
    group_id = decode_hello_route(message, remote)

    def bad(field: str, problem: str) -> ProtocolViolation:
        return ProtocolViolation(f"malformed all-reduce hello from {remote}: {field} {problem}")

    span, weight, codec = message.get("span"), message.get("w"), message.get("codec")
    schema, spans, part = message.get("schema"), message.get("spans"), message.get("part")
    if not _int(span):
        raise bad("span", f"{span!r} is not a member index")
    if not _number(weight):
        raise bad("w", f"(weight) {weight!r} is not a number")
    if not isinstance(codec, str):
        raise bad("codec", f"{codec!r} does not say how its parts are encoded")
    if not isinstance(schema, list):
        raise bad("schema", f"{schema!r:.60} is not a list of tensor descriptions")
    if not isinstance(spans, list) or not all(_int(s) for s in spans):
        raise bad("spans", f"{spans!r:.60} is not a list of span sizes")
    if not _int(part):
        raise bad("part", f"{part!r} is not a part size in bytes")
    return Hello(group_id, span, weight, codec, schema, tuple(spans), part, message["v"])


@dataclass(frozen=True)
class Admitted:
    """The owner's answer to an admitted hello: averaged parts follow, in ``codec``."""

    codec: str

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "codec": self.codec}


@dataclass(frozen=True)
class Refused:
    """The owner's answer to a refused hello (the stream is reset after it): why, and the
    name of the error type (``GroupMismatch``, ``UnknownGroup``, ...)."""

    error: str
    type: str = "Exception"

    def encode(self) -> dict[str, Any]:
        return {"error": self.error, "type": self.type}

    @classmethod
    def of(cls, error: BaseException) -> Refused:
        return cls(str(error), type(error).__name__)


def decode_status(message: Any) -> Admitted | Refused:
    """The owner's answer. Anything but a well-formed admission counts as a refusal
    (with its text), as peers always read it."""
    if isinstance(message, dict) and "error" not in message and message.get("ok"):
        codec = message.get("codec", NO_CODEC)
        if not isinstance(codec, str):
            raise ProtocolViolation(
                f"malformed all-reduce answer: codec {codec!r:.40} is not a name"
            )
        return Admitted(codec)
    if isinstance(message, dict):
        return Refused(str(message.get("error")), str(message.get("type", "Exception")))
    return Refused(str(message), "")


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
        await stream.write(encode_message(Refused.of(error).encode()))
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
