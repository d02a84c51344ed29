"""allreduce/protocol.py: hello and answers round-trip through msgpack, junk is refused by
name, and the keys stay those of version 1."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.allreduce.protocol import (
    PROTOCOL_VERSION,
    Admitted,
    Hello,
    Refused,
    decode_hello,
    decode_hello_route,
    decode_status,
    encode_message,
)
from swarmgrad.utils.errors import ProtocolViolation, ValidationError


def wire(message):
    packed = encode_message(message)
    return msgpack.unpackb(packed[4:], raw=False, strict_map_key=False)


schemas = st.lists(
    st.tuples(st.sampled_from(["float32", "float16", "bfloat16"]), st.lists(st.integers(0, 9)))
    .map(lambda t: [t[0], t[1]]),
    max_size=4,
)  # fmt: skip
hellos = st.builds(
    Hello,
    group_id=st.binary(min_size=1, max_size=32),
    span=st.integers(0, 100),
    weight=st.floats(allow_nan=False, allow_infinity=False),
    codec=st.text(max_size=20),
    schema=schemas,
    spans=st.lists(st.integers(0, 10**9), max_size=8).map(tuple),
    part_size=st.integers(1, 1 << 24),
)


@given(hellos)
def test_a_hello_round_trips(hello):
    assert decode_hello(wire(hello.encode()), "peer") == hello


@given(st.text(max_size=20))
def test_answers_round_trip(codec):
    assert decode_status(wire(Admitted(codec).encode())) == Admitted(codec)
    refused = Refused(f"no: {codec}", "GroupMismatch")
    assert decode_status(wire(refused.encode())) == refused


def test_the_keys_are_those_of_version_1():
    hello = Hello(b"g", 1, 2.0, "none", [["float32", [4]]], (4, 4), 16)
    assert hello.encode() == {
        "v": 1, "g": b"g", "span": 1, "w": 2.0, "codec": "none",
        "schema": [["float32", [4]]], "spans": [4, 4], "part": 16,
    }  # fmt: skip
    assert Admitted("none").encode() == {"ok": True, "codec": "none"}
    assert Refused.of(ValidationError("bad")).encode() == {
        "error": "bad",
        "type": "ValidationError",
    }
    # an answer without a codec (what it always meant): raw parts
    assert decode_status({"ok": True}) == Admitted("none")


GOOD = Hello(b"g", 0, 1.0, "none", [], (4,), 16).encode()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"span": "0"}, "span"),
        ({"span": True}, "span"),
        ({"w": "heavy"}, "w"),
        ({"w": None}, "w"),
        ({"codec": 5}, "codec"),
        ({"schema": "x"}, "schema"),
        ({"spans": [1, "2"]}, "spans"),
        ({"spans": 3}, "spans"),
        ({"part": 1.5}, "part"),
    ],
)
def test_a_hello_with_a_bad_field_is_refused_naming_it_and_the_sender(change, field):
    with pytest.raises(ProtocolViolation, match=f"hello from peer-7: {field} "):
        decode_hello({**GOOD, **change}, "peer-7")


def test_a_hello_without_a_group_or_of_another_version_is_refused_before_routing():
    with pytest.raises(ProtocolViolation, match="without a group id"):
        decode_hello_route({"v": 1}, "p")
    with pytest.raises(ValidationError, match="protocol version 2 from p is not supported"):
        decode_hello_route({"v": PROTOCOL_VERSION + 1, "g": b"g"}, "p")


@pytest.mark.parametrize("answer", [None, "ok", {"ok": False}, {"ok": True, "error": "x"}])
def test_anything_but_an_admission_is_a_refusal(answer):
    assert isinstance(decode_status(answer), Refused)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.binary() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)))  # fmt: skip
def test_junk_is_refused_with_our_errors_only(junk):
    try:
        decode_hello(junk, "p")
    except (ProtocolViolation, ValidationError):
        pass
    try:
        decode_status(junk)
    except ProtocolViolation:
        pass
