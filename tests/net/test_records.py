"""AES-GCM bulk records: round trips, and forged, altered, replayed, reordered or
oversized records are refused."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.net import records
from swarmgrad.utils.errors import FrameTooLarge, ProtocolViolation


def _pair():
    key = records.direction_key(os.urandom(32), from_dialer=True)
    return records.Sealer(key), records.Opener(key)


def _open_all(opener, buffers):
    data = b"".join(buffers)
    out, pos = [], 0
    while pos < len(data):
        prefix = data[pos : pos + 4]
        length = opener.record_length(prefix)
        body = data[pos + 4 : pos + 4 + length]
        plain = bytearray(length - records.TAG_SIZE)
        opener.open_into(prefix, body, memoryview(plain))
        out.append(bytes(plain))
        pos += 4 + length
    return b"".join(out)


@given(st.lists(st.binary(min_size=1, max_size=5000), max_size=8))
def test_sealed_messages_open_in_order(messages):
    sealer, opener = _pair()
    buffers = [part for m in messages for part in sealer.seal(m)]
    assert _open_all(opener, buffers) == b"".join(messages)


def test_large_plaintext_is_split_into_bounded_records():
    sealer, opener = _pair()
    data = os.urandom(records.MAX_RECORD_PLAINTEXT + 1000)
    buffers = sealer.seal(data)
    assert _open_all(opener, buffers) == data


def test_keys_differ_per_direction_and_per_share():
    share = os.urandom(32)
    to_listener = records.direction_key(share, from_dialer=True)
    assert to_listener == records.direction_key(share, from_dialer=True)
    assert to_listener != records.direction_key(share, from_dialer=False)
    assert to_listener != records.direction_key(os.urandom(32), from_dialer=True)
    with pytest.raises(ProtocolViolation, match="32 bytes"):
        records.direction_key(b"short", from_dialer=True)


def test_a_record_reflected_back_to_its_sender_fails_authentication():
    share = os.urandom(32)  # even if both sides drew the same share
    sealed = records.Sealer(records.direction_key(share, from_dialer=True)).seal(b"hello")
    opener = records.Opener(records.direction_key(share, from_dialer=False))
    with pytest.raises(ProtocolViolation, match="failed authentication"):
        _open_all(opener, sealed)


@given(st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=255))
def test_any_altered_byte_fails_authentication(position, flip):
    sealer, opener = _pair()
    (record,) = sealer.seal(b"attack at dawn, bring tensors")
    tampered = bytearray(record)
    position = 4 + position % (len(record) - 4)
    tampered[position] ^= flip
    with pytest.raises(ProtocolViolation, match="failed authentication"):
        _open_all(opener, [bytes(tampered)])


def test_replayed_or_reordered_records_fail():
    sealer, opener = _pair()
    first = sealer.seal(b"one")[0]
    second = sealer.seal(b"two")[0]
    with pytest.raises(ProtocolViolation):
        _open_all(opener, [second])  # reordered: opener expects record 0
    sealer, opener = _pair()
    first = sealer.seal(b"one")[0]
    assert _open_all(opener, [first]) == b"one"
    with pytest.raises(ProtocolViolation):
        _open_all(opener, [first])  # replayed


def test_record_from_another_key_fails():
    sealer, _ = _pair()
    _, opener = _pair()
    with pytest.raises(ProtocolViolation):
        _open_all(opener, sealer.seal(b"x"))


def test_oversized_or_tiny_record_lengths_are_refused():
    with pytest.raises(FrameTooLarge):
        records.Opener.record_length(records.LENGTH.pack(records.MAX_RECORD + 1))
    with pytest.raises(ProtocolViolation, match="shorter than its tag"):
        records.Opener.record_length(records.LENGTH.pack(records.TAG_SIZE))


def test_large_record_buffers_are_reused_only_after_the_transport_wrote_them():
    sealer, opener = _pair()
    size = records.POOLED_RECORD_MIN
    (first,) = sealer.seal(os.urandom(size))
    snapshot = bytes(first)
    (second,) = sealer.seal(os.urandom(size))  # nothing released yet: a new buffer
    assert bytes(first) == snapshot
    sealer.release(still_buffered=len(second))  # the first record has left the transport
    (third,) = sealer.seal(os.urandom(size))
    assert third.obj is first.obj  # reused
    assert bytes(second) != bytes(third)
    sealer.release(still_buffered=len(third))  # the second left; the third is still held
    (fourth,) = sealer.seal(os.urandom(size))
    assert fourth.obj is second.obj and fourth.obj is not third.obj


def test_reused_buffers_still_open_correctly():
    sealer, opener = _pair()
    messages = [os.urandom(records.POOLED_RECORD_MIN + i) for i in range(6)]
    opened = []
    for message in messages:
        sealer.release(still_buffered=0)
        opened.append(_open_all(opener, [bytes(b) for b in sealer.seal(message)]))
    assert opened == messages
