"""Wire frames of a swarmgrad connection: a fixed 10-byte header and a payload.

Layout (big-endian): ``length: u32 | stream_id: u32 | type: u8 | flags: u8`` followed by
``length`` payload bytes. The header is fixed-size so the receiver always knows how many
bytes belong to the current frame and can hand a DATA payload straight to the buffer that
waits for it (zero-copy receive). This module is pure: no I/O, only encoding and checks.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from swarmgrad.utils.errors import FrameTooLarge, ProtocolViolation

HEADER = struct.Struct(">IIBB")
HEADER_SIZE = HEADER.size  # 10
MAX_STREAM_ID = 2**32 - 1


class FrameType(enum.IntEnum):
    HELLO = 0  # handshake: versions, features, identity, nonce (stream 0)
    AUTH = 1  # handshake: signature over the nonces or the TLS channel binding (stream 0)
    OPEN = 2  # open a stream; payload is the opener's header (e.g. RPC handler name)
    DATA = 3  # stream bytes; FLAG_FIN marks the sender's last frame
    WINDOW = 4  # grant the other side more credit on a stream (u32 payload)
    RESET = 5  # abort a stream; payload is an error code (u8) and a UTF-8 reason
    PING = 6  # liveness probe, 8 opaque bytes echoed back in PONG
    PONG = 7
    GOAWAY = 8  # the connection is closing; payload is a UTF-8 reason


class ResetCode(enum.IntEnum):
    CANCELLED = 0  # the opener or the handler gave up (cancellation, deadline)
    REFUSED = 1  # too many streams, or the stream was not accepted
    PROTOCOL_ERROR = 2  # the stream carried something that breaks its protocol
    INTERNAL = 3  # a local failure unrelated to the peer's input


FLAG_FIN = 0x01

# Frames whose payload is a control message and must stay small whatever the data limit.
CONTROL_PAYLOAD_LIMIT = 64 * 1024
WINDOW_PAYLOAD = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class FrameHeader:
    length: int
    stream_id: int
    type: FrameType
    flags: int

    @property
    def fin(self) -> bool:
        return bool(self.flags & FLAG_FIN)


def encode_header(frame_type: FrameType, stream_id: int, length: int, flags: int = 0) -> bytes:
    return HEADER.pack(length, stream_id, frame_type, flags)


def decode_header(data: bytes | bytearray | memoryview, max_payload: int) -> FrameHeader:
    """Parse and check one header; raise ProtocolViolation naming what was wrong."""
    if len(data) < HEADER_SIZE:
        raise ProtocolViolation(f"truncated frame header: {len(data)} of {HEADER_SIZE} bytes")
    length, stream_id, raw_type, flags = HEADER.unpack_from(data)
    try:
        frame_type = FrameType(raw_type)
    except ValueError:
        raise ProtocolViolation(f"unknown frame type {raw_type} on stream {stream_id}") from None
    limit = max_payload if frame_type == FrameType.DATA else CONTROL_PAYLOAD_LIMIT
    if length > limit:
        raise FrameTooLarge(
            f"{frame_type.name} frame of {length} bytes on stream {stream_id} exceeds the "
            f"limit of {limit} bytes"
        )
    if flags & ~FLAG_FIN:
        raise ProtocolViolation(f"unknown flags {flags:#x} on {frame_type.name} frame")
    if frame_type == FrameType.WINDOW and length != WINDOW_PAYLOAD.size:
        raise ProtocolViolation(f"WINDOW frame must carry 4 bytes, got {length}")
    return FrameHeader(length, stream_id, frame_type, flags)


def encode_reset_payload(code: ResetCode, reason: str) -> bytes:
    return bytes([code]) + reason.encode("utf-8", "replace")[: CONTROL_PAYLOAD_LIMIT - 1]


def decode_reset_payload(payload: bytes) -> tuple[ResetCode, str]:
    if not payload:
        return ResetCode.CANCELLED, ""
    try:
        code = ResetCode(payload[0])
    except ValueError:
        code = ResetCode.INTERNAL
    return code, bytes(payload[1:]).decode("utf-8", "replace")
