"""state/protocol.py: the donor RPCs' messages round-trip, junk is refused by name, and
the keys stay those of version 1."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.state.protocol import (
    ChunkParts,
    ChunkRequest,
    ManifestOffer,
    ManifestRequest,
    ReleaseRequest,
    StateRefusal,
    Status,
    decode_chunk_answer,
    decode_chunk_request,
    decode_manifest_answer,
    decode_release_request,
)
from swarmgrad.utils.errors import ProtocolViolation


def wire(message):
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


sessions = st.binary(min_size=1, max_size=64)
refusals = st.builds(
    StateRefusal,
    status=st.sampled_from([Status.BUSY, Status.UNAVAILABLE, Status.EXPIRED]),
    reason=st.text(max_size=30),
)


@given(
    sessions,
    st.floats(allow_nan=False, allow_infinity=False),
    st.binary(max_size=30),
    st.floats(min_value=0, allow_nan=False, allow_infinity=False),
)
def test_manifest_offers_round_trip(session, priority, metadata, idle):
    offer = ManifestOffer(session, priority, {"chunks": [1, 2]}, metadata, idle)
    assert decode_manifest_answer(wire(offer.encode()), "donor") == offer


@given(refusals)
def test_refusals_round_trip_for_both_answers(refusal):
    assert decode_manifest_answer(wire(refusal.encode()), "donor") == refusal
    assert decode_chunk_answer(wire(refusal.encode()), "donor", 3) == refusal


@given(sessions | st.none(), st.integers(-(2**63), 2**63 - 1))
def test_chunk_and_release_requests_round_trip(session, index):
    assert decode_chunk_request(wire(ChunkRequest(session, index).encode())) == ChunkRequest(
        session, index
    )
    assert decode_release_request(wire(ReleaseRequest(session).encode())) == ReleaseRequest(session)


@given(st.lists(st.binary(max_size=20), max_size=4))
def test_chunk_parts_round_trip(parts):
    assert decode_chunk_answer(wire(ChunkParts(parts).encode()), "donor", 0) == ChunkParts(parts)


def test_the_keys_are_those_of_version_1():
    assert ManifestRequest().encode() == {"v": 1}
    assert ManifestOffer(b"s", 2.0, [], b"m", 30.0).encode() == {
        "status": "ok", "session": b"s", "priority": 2.0, "manifest": [], "metadata": b"m",
        "idle_timeout": 30.0,
    }  # fmt: skip
    assert StateRefusal(Status.BUSY, "full").encode() == {"status": "busy", "reason": "full"}
    assert ChunkRequest(b"s", 4).encode() == {"session": b"s", "index": 4}
    assert ChunkParts([b"a"]).encode() == {"status": "ok", "parts": [b"a"]}
    assert ReleaseRequest(b"s").encode() == {"session": b"s"}


@pytest.mark.parametrize(
    "message, match",
    [
        ([1], "must be a dict"),
        ({"status": "ok", "session": b"", "priority": 1}, "session must be 1 to 64 bytes"),
        ({"status": "ok", "session": b"x" * 65, "priority": 1}, "session must be 1 to 64"),
        ({"status": "ok", "session": b"s", "priority": math.nan}, "priority nan"),
        ({"status": "ok", "session": b"s", "priority": "1"}, "priority '1'"),
        ({"status": "ok", "session": b"s", "priority": 1, "idle_timeout": "x"}, "idle_timeout"),
    ],
)
def test_a_bad_manifest_answer_is_refused_naming_the_field(message, match):
    with pytest.raises(ProtocolViolation, match=match):
        decode_manifest_answer(message, "donor")


def test_a_bad_chunk_request_is_refused_naming_the_field_and_a_bad_session_is_unknown():
    with pytest.raises(ProtocolViolation, match="must be a dict"):
        decode_chunk_request("x")
    for index in ("1", 1.0, True, None):
        with pytest.raises(ProtocolViolation, match="index"):
            decode_chunk_request({"session": b"s", "index": index})
    assert decode_chunk_request({"session": "text", "index": 1}).session is None


def test_an_unknown_status_from_a_newer_peer_is_a_refusal_with_its_text():
    assert decode_chunk_answer({"status": "resting"}, "d", 0) == StateRefusal("resting", "")


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.binary(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)))  # fmt: skip
def test_junk_is_refused_with_protocol_violation_only(junk):
    for decode in (
        lambda m: decode_manifest_answer(m, "d"),
        lambda m: decode_chunk_answer(m, "d", 0),
        decode_chunk_request,
        decode_release_request,
    ):
        try:
            decode(junk)
        except ProtocolViolation:
            pass
