"""gossip/protocol.py: declarations and pulls round-trip, junk is refused by name or
skipped, and the keys stay those of version 1."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.gossip.protocol import (
    MAX_MADDRS,
    GossipDeclaration,
    PullAnswer,
    PullRequest,
    decode_declaration,
    decode_pull_answer,
    decode_pull_request,
    pull_rpc_name,
)
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ProtocolViolation

PEER = Identity.from_seed(b"\1" * 32).peer_id


def wire(message):
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


@given(st.lists(st.text(max_size=40), max_size=MAX_MADDRS).map(tuple))
def test_declarations_round_trip(maddrs):
    decoded = decode_declaration(PEER.to_base58(), wire(GossipDeclaration(maddrs).encode()))
    assert decoded == (PEER, GossipDeclaration(maddrs))


schemas = st.lists(
    st.tuples(st.sampled_from(["float32", "bfloat16"]), st.lists(st.integers(0, 2**31), max_size=3))
    .map(list),
    max_size=4,
)  # fmt: skip


@given(schemas)
def test_pull_requests_round_trip(schema):
    decoded = decode_pull_request(wire(PullRequest(schema).encode()))
    assert decoded == PullRequest(wire(schema))  # tuples come back as lists


@given(
    st.floats(min_value=0, allow_infinity=False),
    st.none() | st.floats(allow_nan=False, allow_infinity=False),
)
def test_pull_answers_round_trip(samples, loss):
    answer = PullAnswer([{"some": "tensor"}], samples, loss)
    assert decode_pull_answer(wire(answer.encode()), PEER) == answer


def test_the_names_and_keys_are_those_of_version_1():
    assert pull_rpc_name("run") == "run.gossip.pull"
    assert GossipDeclaration(("/ip4/1.2.3.4/tcp/1",)).encode() == {
        "v": 1,
        "maddrs": ["/ip4/1.2.3.4/tcp/1"],
    }
    assert PullRequest([["float32", [2]]]).encode() == {"v": 1, "schema": [["float32", [2]]]}
    assert PullAnswer([], 3.0, None).encode() == {"tensors": [], "samples": 3.0, "loss": None}


@pytest.mark.parametrize(
    "subkey, value",
    [
        ("not base58 !", {"v": 1, "maddrs": []}),
        (PEER.to_base58(), {"v": 2, "maddrs": []}),
        (PEER.to_base58(), {"v": 1, "maddrs": "x"}),
        (PEER.to_base58(), {"v": 1, "maddrs": [1]}),
        (PEER.to_base58(), [1]),
    ],
)
def test_other_peers_bad_declarations_are_skipped(subkey, value):
    assert decode_declaration(subkey, value) is None


def test_a_declaration_keeps_at_most_max_maddrs():
    many = [f"/ip4/1.2.3.4/tcp/{i}" for i in range(MAX_MADDRS + 5)]
    _, declaration = decode_declaration(PEER.to_base58(), {"v": 1, "maddrs": many})
    assert len(declaration.maddrs) == MAX_MADDRS


@pytest.mark.parametrize(
    "message, field",
    [([], "is not a map"), ({"schema": []}, "v None"), ({"v": 1, "schema": "x"}, "schema")],
)
def test_a_bad_pull_is_refused_naming_the_field(message, field):
    with pytest.raises(ProtocolViolation, match=f"malformed gossip pull: .*{field}"):
        decode_pull_request(message)


@pytest.mark.parametrize(
    "message, match",
    [
        ("x", "not a dict"),
        ({"tensors": {}, "samples": 1}, "tensors is not a list"),
        ({"tensors": [], "samples": -1}, "invalid sample clock -1"),
        ({"tensors": [], "samples": True}, "invalid sample clock True"),
        ({"tensors": [], "samples": math.inf}, "invalid sample clock inf"),
        ({"tensors": [], "samples": 1, "loss": math.nan}, "invalid loss nan"),
        ({"tensors": [], "samples": 1, "loss": "low"}, "invalid loss 'low'"),
    ],
)
def test_a_bad_answer_is_refused_naming_the_field(message, match):
    with pytest.raises(ProtocolViolation, match=match):
        decode_pull_answer(message, PEER)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)))  # fmt: skip
def test_junk_is_refused_with_protocol_violation_only(junk):
    for decode in (decode_pull_request, lambda m: decode_pull_answer(m, PEER)):
        try:
            decode(junk)
        except ProtocolViolation:
            pass
    decode_declaration(PEER.to_base58(), junk)  # skipped or used, never raised
