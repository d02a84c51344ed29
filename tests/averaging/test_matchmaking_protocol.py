"""matchmaking/protocol.py: messages round-trip through msgpack, junk is refused by name,
and the wire keys stay those that peers of earlier versions send and read."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.matchmaking.protocol import (
    Accepted,
    Begin,
    Disbanded,
    JoinRequest,
    Rejected,
    Rejection,
    decode_answer,
    decode_join_request,
)
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ProtocolViolation

PEERS = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(6)]
peer_ids = st.sampled_from(PEERS)
texts = st.text(max_size=50)
times = st.floats(allow_nan=False, allow_infinity=False, width=64)
maddrs = st.lists(st.text(max_size=30), max_size=4).map(tuple)


def wire(message: dict) -> dict:
    """What the other side receives: the RPC layer's msgpack."""
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


requests = st.builds(
    JoinRequest,
    prefix=texts,
    group_key=texts,
    ready_by=times,
    client_mode=st.booleans(),
    gather=st.binary(max_size=200),
    hold=st.none() | st.floats(min_value=0.001, max_value=1e6),
)
answers = st.one_of(
    st.builds(
        Rejected,
        reason=st.sampled_from(list(Rejection)),
        message=texts,
        suggested_leader=st.none() | peer_ids,
        suggested_maddrs=maddrs,
    ),
    st.builds(Accepted, ready_by=times),
    st.lists(st.tuples(peer_ids, st.binary(max_size=100)), min_size=1, max_size=6).map(
        lambda members: Begin(
            b"g" * 20,
            tuple(dict(members)),
            tuple(dict(members).values()),
        )
    ),
    st.builds(
        Disbanded, message=texts, suggested_leader=st.none() | peer_ids, suggested_maddrs=maddrs
    ),
)


@given(requests)
def test_join_requests_round_trip(request):
    assert decode_join_request(wire(request.encode())) == request


@given(answers)
def test_answers_round_trip_coded_or_not(answer):
    assert decode_answer(wire(answer.encode()), max_gather_bytes=1000) == answer


def test_wire_keys_are_those_of_version_1():
    request = JoinRequest("avg", "avg.0b1", 12.5, False, b"x", hold=3.0).encode()
    assert request == {
        "v": 1, "prefix": "avg", "group_key": "avg.0b1", "ready_by": 12.5,
        "client_mode": False, "gather": b"x", "hold": 3.0,
    }  # fmt: skip
    assert "hold" not in JoinRequest("avg", "k", 1.0, True, b"").encode()
    assert Accepted(5.0).encode() == {"code": "accepted", "ready_by": 5.0}
    assert Rejected(Rejection.GROUP_FULL, "full").encode() == {
        "code": "rejected", "reason": "group_full", "message": "full",
        "suggested_leader": None, "suggested_maddrs": [],
    }  # fmt: skip
    assert Disbanded("gone", PEERS[0], ("/ip4/1.2.3.4/tcp/1",)).encode() == {
        "code": "disbanded", "message": "gone", "suggested_leader": PEERS[0].to_bytes(),
        "suggested_maddrs": ["/ip4/1.2.3.4/tcp/1"],
    }  # fmt: skip
    begin = Begin(b"g" * 20, (PEERS[0],), (b"a",)).encode()
    assert begin == {
        "code": "begin", "group_id": b"g" * 20, "peer_ids": [PEERS[0].to_bytes()],
        "gathered": [b"a"],
    }  # fmt: skip


GOOD_REQUEST = JoinRequest("avg", "avg.0b1", 12.5, False, b"x").encode()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"prefix": 3}, "prefix"),
        ({"group_key": None}, "group_key"),
        ({"ready_by": "later"}, "ready_by"),
        ({"ready_by": True}, "ready_by"),
        ({"gather": "text"}, "gather"),
        ({"client_mode": 1}, "client_mode"),
    ],
)
def test_a_join_request_with_a_bad_field_is_refused_naming_it(change, field):
    with pytest.raises(ProtocolViolation, match=f"join request: {field} "):
        decode_join_request({**GOOD_REQUEST, **change})


@pytest.mark.parametrize("hold", ["soon", -1.0, float("nan"), True, 0])
def test_a_malformed_hold_is_no_hold(hold):
    assert decode_join_request({**GOOD_REQUEST, "hold": hold}).hold is None


@pytest.mark.parametrize(
    "message, field",
    [
        ({"code": "accepted", "ready_by": "x"}, "ready_by"),
        ({"code": "rejected", "suggested_leader": "me"}, "suggested_leader"),
        ({"code": "disbanded", "suggested_leader": b"not a multihash"}, "suggested_leader"),
        ({"code": "begin", "group_id": b"", "peer_ids": []}, "group_id"),
        ({"code": "begin", "group_id": b"g" * 65, "peer_ids": []}, "group_id"),
        ({"code": "begin", "group_id": b"g", "peer_ids": "x", "gathered": []}, "peer_ids"),
        ({"code": "begin", "group_id": b"g", "peer_ids": [b"1"], "gathered": [b""]}, "peer_ids"),
        (
            {"code": "begin", "group_id": b"g", "peer_ids": [PEERS[0].to_bytes()], "gathered": []},
            "gathered",
        ),
        ({"code": "welcome"}, "code"),
    ],
)
def test_an_answer_with_a_bad_field_is_refused_naming_it(message, field):
    with pytest.raises(ProtocolViolation, match=f": {field} "):
        decode_answer(message, max_gather_bytes=100)


def test_an_unknown_rejection_reason_from_a_newer_peer_is_kept_as_text():
    answer = decode_answer({"code": "rejected", "reason": "too_tired"}, max_gather_bytes=1)
    assert answer == Rejected("too_tired", "None")


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.binary() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)))  # fmt: skip
def test_junk_is_refused_with_protocol_violation_only(junk):
    for decode in (decode_join_request, lambda m: decode_answer(m, max_gather_bytes=100)):
        try:
            decode(junk)
        except ProtocolViolation:
            pass
