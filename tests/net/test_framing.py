import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.net import framing
from swarmgrad.net.framing import FrameType
from swarmgrad.utils.errors import FrameTooLarge, ProtocolViolation


@given(
    frame_type=st.sampled_from([t for t in FrameType if t != FrameType.WINDOW]),
    stream_id=st.integers(0, framing.MAX_STREAM_ID),
    length=st.integers(0, framing.CONTROL_PAYLOAD_LIMIT),
    fin=st.booleans(),
)
def test_header_round_trips(frame_type, stream_id, length, fin):
    raw = framing.encode_header(frame_type, stream_id, length, framing.FLAG_FIN * fin)
    assert len(raw) == framing.HEADER_SIZE
    header = framing.decode_header(raw, max_payload=framing.CONTROL_PAYLOAD_LIMIT)
    assert (header.type, header.stream_id, header.length, header.fin) == (
        frame_type,
        stream_id,
        length,
        fin,
    )


@given(st.binary(max_size=framing.HEADER_SIZE - 1))
def test_truncated_header_is_refused(data):
    with pytest.raises(ProtocolViolation, match="truncated"):
        framing.decode_header(data, max_payload=1024)


@given(st.binary(min_size=framing.HEADER_SIZE, max_size=framing.HEADER_SIZE))
def test_arbitrary_header_bytes_parse_or_raise_protocol_violation(data):
    try:
        header = framing.decode_header(data, max_payload=1 << 20)
    except ProtocolViolation:
        return
    assert header.length <= 1 << 20


def test_unknown_type_and_flags_are_named():
    raw = framing.HEADER.pack(0, 7, 99, 0)
    with pytest.raises(ProtocolViolation, match="unknown frame type 99 on stream 7"):
        framing.decode_header(raw, max_payload=10)
    raw = framing.HEADER.pack(0, 7, FrameType.DATA, 0x80)
    with pytest.raises(ProtocolViolation, match="unknown flags"):
        framing.decode_header(raw, max_payload=10)


def test_frame_larger_than_limit_is_refused():
    raw = framing.encode_header(FrameType.DATA, 3, 1025)
    with pytest.raises(FrameTooLarge, match="1025 bytes on stream 3 exceeds the limit of 1024"):
        framing.decode_header(raw, max_payload=1024)
    raw = framing.encode_header(FrameType.OPEN, 3, framing.CONTROL_PAYLOAD_LIMIT + 1)
    with pytest.raises(FrameTooLarge):
        framing.decode_header(raw, max_payload=1 << 30)


def test_window_frame_must_carry_four_bytes():
    raw = framing.encode_header(FrameType.WINDOW, 1, 3)
    with pytest.raises(ProtocolViolation, match="4 bytes"):
        framing.decode_header(raw, max_payload=1024)


@given(st.sampled_from(list(framing.ResetCode)), st.text(max_size=200))
def test_reset_payload_round_trips(code, reason):
    assert framing.decode_reset_payload(framing.encode_reset_payload(code, reason)) == (
        code,
        reason,
    )
