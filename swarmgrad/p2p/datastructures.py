"""hivemind's small p2p value types on swarmgrad's identities and addresses."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.utils.errors import (
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)

__all__ = [
    "InvalidMessageMarker",
    "P2PContext",
    "P2PDaemonError",
    "P2PHandlerError",
    "PeerID",
    "PeerInfo",
    "RPCError",
    "StreamInfo",
]


class InvalidMessageMarker(ProtocolViolation, TypeError):
    """:meth:`P2P.receive_protobuf` read a marker byte that is neither ``P2P.MESSAGE_MARKER``
    nor ``P2P.ERROR_MARKER`` (a ``TypeError``, as in hivemind, and a ProtocolViolation)."""


class P2PDaemonError(SwarmgradError, RuntimeError):
    """The peer could not start (hivemind: the p2pd daemon failed); the message says why."""


class P2PHandlerError(RemoteError):
    """A remote handler failed, or refused the request (hivemind's name for a RemoteError
    raised through :class:`~swarmgrad.p2p.P2P`); the message names the handler and peer.

    Built as hivemind builds it, like any exception (``P2PHandlerError("why")``, several
    arguments, or none), plus the keywords of :class:`RemoteError` (``remote_type``,
    ``peer``); another keyword is a ``TypeError`` naming it, as ``Exception`` gives."""

    def __init__(self, *args: object, **kwargs: object):
        unknown = sorted(set(kwargs) - {"remote_type", "peer"})
        if unknown:
            raise TypeError(
                f"P2PHandlerError() got unexpected keyword argument(s) {', '.join(unknown)} "
                f"(it takes messages and remote_type=, peer=)"
            )
        Exception.__init__(self, *args)
        self.remote_type = str(kwargs.get("remote_type", "Exception"))
        self.peer = kwargs.get("peer")

    def __str__(self) -> str:
        where = f" on {self.peer}" if self.peer is not None else ""
        text = Exception.__str__(self)  # "" without arguments, the tuple with several
        return f"{self.remote_type}{where}: {text}"


class RPCError:
    """hivemind's ``RPCError`` message (``message RPCError { optional string message = 1; }``
    in its ``p2pd.proto``), without protobuf: what :meth:`P2P.send_protobuf` frames after
    ``P2P.ERROR_MARKER``. ``P2P.END_OF_STREAM`` is the empty one. The bytes are the
    protobuf encoding, so they read the same whether or not protobuf is installed."""

    __slots__ = ("message",)

    def __init__(self, message: str = ""):
        if not isinstance(message, str):
            raise ValidationError(f"RPCError.message must be a str, got a {type(message).__name__}")
        self.message = message  # "" when unset, as protobuf reads an absent string field

    def HasField(self, name: str) -> bool:
        if name != "message":
            raise ValueError(f'RPCError has no field "{name}"')
        return self.message != ""

    def SerializeToString(self) -> bytes:
        if not self.message:
            return b""
        data = self.message.encode()
        return b"\x0a" + _varint(len(data)) + data  # field 1, length-delimited

    def ParseFromString(self, data: bytes) -> int:
        self.message = _parse_rpc_error(bytes(data))
        return len(data)

    @classmethod
    def FromString(cls, data: bytes) -> RPCError:
        error = cls()
        error.ParseFromString(data)
        return error

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RPCError) and other.message == self.message

    def __hash__(self) -> int:
        return hash(self.message)

    def __repr__(self) -> str:
        return f"RPCError(message={self.message!r})" if self.message else "RPCError()"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _parse_rpc_error(data: bytes) -> str:
    """The ``message`` field of an encoded RPCError; other fields are skipped (unknown
    fields are ignored, as protobuf does), malformed bytes are a ProtocolViolation."""
    message, pos = "", 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise ProtocolViolation("RPCError: truncated or overlong varint")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(data):
        key = varint()
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            varint()
        elif wire_type == 1 or wire_type == 5:
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length = varint()
            if pos + length > len(data):
                raise ProtocolViolation(
                    f"RPCError: field {field} announces {length} bytes, {len(data) - pos} left"
                )
            if field == 1:
                try:
                    message = data[pos : pos + length].decode()
                except UnicodeDecodeError as e:
                    raise ProtocolViolation(f"RPCError: message is not UTF-8 ({e})") from None
            pos += length
        else:
            raise ProtocolViolation(f"RPCError: unsupported wire type {wire_type} (field {field})")
        if pos > len(data):
            raise ProtocolViolation("RPCError: truncated field")
    return message


@dataclass(frozen=True)
class P2PContext:
    """What a handler registered through :class:`~swarmgrad.p2p.P2P` knows about a call
    (hivemind's shape: the handler's name, our PeerID, the caller's PeerID)."""

    handle_name: str
    local_id: PeerID
    remote_id: PeerID | None = None


@dataclass(frozen=True)
class PeerInfo:
    """A peer this one is connected to and the addresses it is known by."""

    peer_id: PeerID
    addrs: tuple[Multiaddr, ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.peer_id} {','.join(str(a) for a in self.addrs)}"


@dataclass(frozen=True)
class StreamInfo:
    """The far end of a binary stream (hivemind's ``StreamInfo``)."""

    peer_id: PeerID
    addr: Multiaddr | None
    proto: str
