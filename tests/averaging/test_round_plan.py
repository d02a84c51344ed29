"""Member announcements and the round plan every member derives from the same GroupInfo:
who takes part, modes, spans, and what happens with malformed or mismatched members."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.allreduce import AveragingMode, GroupMismatch
from swarmgrad.averaging.allreduce.round_plan import (
    MAX_SCHEMA_BYTES,
    RoundSkipped,
    decode_member_info,
    encode_member_info,
    plan_round,
    schema_digest,
)
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
IDS = [Identity.generate().peer_id for _ in range(5)]
SCHEMA_A = [["float32", [6, 5]], ["float64", [17]]]
SCHEMA_B = [["float32", [6, 4]], ["float64", [17]]]


def info(mode=NODE, schema=SCHEMA_A, bandwidth=None, gather=None, maddrs=(), weight=1.0, tag=""):
    numel = sum(_numel(shape) for _, shape in schema)
    return encode_member_info(
        mode=mode,
        bandwidth=bandwidth,
        weight=weight,
        schema=schema,
        numel=numel,
        maddrs=maddrs,
        gather=gather,
        aggregate_tag=tag,
    )


def _numel(shape):
    total = 1
    for size in shape:
        total *= size
    return total


def group(*gathered, group_id=b"g" * 20):
    return GroupInfo(group_id, tuple(IDS[: len(gathered)]), tuple(gathered))


def test_an_announcement_round_trips_and_keeps_only_usable_addresses():
    good = f"/ip4/127.0.0.1/tcp/4001/p2p/{IDS[0]}"
    other = f"/ip4/127.0.0.1/tcp/4002/p2p/{IDS[1]}"  # names another peer: dropped
    data = info(bandwidth=2.5, gather={"epoch": 3, "x": [1, b"y"]}, maddrs=[good, other, "junk"])
    decoded = decode_member_info(IDS[0], data)
    assert decoded.mode is NODE and decoded.bandwidth == 2.5 and decoded.weight == 1.0
    assert decoded.gather == {"epoch": 3, "x": [1, b"y"]}
    assert decoded.schema == SCHEMA_A and decoded.num_tensors == 2 and decoded.numel == 47
    assert [str(m) for m in decoded.maddrs] == [good]
    with pytest.raises(ValidationError, match="msgpack-serializable"):
        info(gather=object())


def test_a_large_schema_travels_as_its_digest_only():
    big = [["float32", [i + 1]] for i in range(MAX_SCHEMA_BYTES // 8)]
    decoded = decode_member_info(IDS[0], info(schema=big))
    assert decoded.schema is None and len(decoded.schema_digest) == 32
    other = [["float32", [i + 2]] for i in range(MAX_SCHEMA_BYTES // 8)]
    mismatch = group(info(schema=big), info(schema=other), info(schema=other))
    with pytest.raises(GroupMismatch, match="the dtypes or shapes differ"):
        plan_round(mismatch, IDS[0])


@pytest.mark.parametrize(
    "body, complaint",
    [
        ({"v": 2}, "unknown version"),
        ({"v": 1, "mode": 7}, "unknown mode"),
        ({"v": 1, "mode": 0, "bw": "fast", "w": 1.0}, "bandwidth 'fast'"),
        ({"v": 1, "mode": 0, "bw": None, "w": -1.0}, "negative weight"),
        ({"v": 1, "mode": 0, "bw": None, "w": float("nan")}, "weight nan"),
        ({"v": 1, "mode": 0, "bw": None, "w": 1, "sd": b"short"}, "schema digest"),
        ({"v": 1, "mode": 0, "bw": None, "w": 1, "sd": b"d" * 32, "nt": -1}, "tensor count"),
        (
            {"v": 1, "mode": 0, "bw": None, "w": 1, "sd": b"d" * 32, "nt": 1, "ne": 1, "agg": 3},
            "aggregate tag",
        ),
        (
            {"v": 1, "mode": 0, "bw": None, "w": 1, "sd": b"d" * 32, "nt": 1, "ne": 1}
            | {"agg": "x" * 201},
            "aggregate tag",
        ),
    ],
)
def test_malformed_announcements_are_refused_naming_the_member_and_field(body, complaint):
    with pytest.raises(ProtocolViolation, match=complaint) as error:
        decode_member_info(IDS[1], msgpack.packb(body))
    assert str(IDS[1]) in str(error.value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_protocol_violation(data):
    try:
        decode_member_info(IDS[0], data)
    except ProtocolViolation:
        pass


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=8,
    )
)
def test_any_msgpack_value_in_a_field_decodes_or_raises_protocol_violation(value):
    for field in ("v", "mode", "bw", "w", "sd", "nt", "ne", "schema", "maddrs", "agg"):
        body = msgpack.unpackb(info())
        body[field] = value
        try:
            decode_member_info(IDS[0], msgpack.packb(body))
        except ProtocolViolation:
            pass


def test_every_member_derives_the_same_plan_clients_own_nothing_aux_send_nothing():
    gathered = [info(gather=0), info(mode=CLIENT, gather=1), info(mode=AUX), info(gather=3)]
    plans = [plan_round(group(*gathered), peer_id) for peer_id in IDS[:4]]
    assert all(plan == plans[0] for plan in plans)
    plan = plans[0]
    assert plan.modes == (NODE, CLIENT, AUX, NODE)
    assert plan.span_sizes[1] == 0 and sum(plan.span_sizes) == 47
    assert all(size > 0 for i, size in enumerate(plan.span_sizes) if i != 1)
    assert plan.gathered == {IDS[0]: 0, IDS[1]: 1, IDS[2]: None, IDS[3]: 3}
    assert plan.group.group_id == b"g" * 20 and not plan.left_out


def test_spans_follow_announced_bandwidth():
    plan = plan_round(group(info(bandwidth=1.0), info(bandwidth=3.0)), IDS[0])
    assert plan.span_sizes[1] > plan.span_sizes[0] and sum(plan.span_sizes) == 47


def test_members_with_other_tensors_form_their_own_sub_group():
    gathered = [info(), info(schema=SCHEMA_B), info(), info(schema=SCHEMA_B)]
    whole = group(*gathered)
    plans = [plan_round(whole, peer_id) for peer_id in IDS[:4]]
    assert plans[0] == plans[2] and plans[1] == plans[3]
    assert plans[0].group.peer_ids == (IDS[0], IDS[2])
    assert plans[1].group.peer_ids == (IDS[1], IDS[3])
    ids = {plan.group.group_id for plan in plans}
    assert len(ids) == 2 and whole.group_id not in ids
    assert "tensor 0 is float32[6, 5] here but float32[6, 4]" in plans[0].left_out[IDS[1]]


def test_the_odd_one_out_gets_a_mismatch_error_and_a_tie_only_skips_the_round():
    odd = group(info(schema=SCHEMA_B), info(), info())
    with pytest.raises(GroupMismatch) as error:
        plan_round(odd, IDS[0])
    assert f"tensor 0 is float32[6, 4] here but float32[6, 5] at {IDS[1]}" in str(error.value)
    assert plan_round(odd, IDS[1]).group.peer_ids == (IDS[1], IDS[2])
    tie = group(info(schema=SCHEMA_B), info())
    for peer_id in IDS[:2]:
        with pytest.raises(RoundSkipped, match="nobody in the group shares our tensors"):
            plan_round(tie, peer_id)
    doubles = [["float64", [6, 5]], ["float64", [17]]]
    with pytest.raises(GroupMismatch, match=r"tensor 0 is float64\[6, 5\] here but float32"):
        plan_round(group(info(schema=doubles), info(), info()), IDS[0])
    fewer = group(info(schema=SCHEMA_A[:1]), info(), info())
    with pytest.raises(GroupMismatch, match="1 tensors here, 2 at"):
        plan_round(fewer, IDS[0])


def test_members_that_combine_tensors_differently_never_average_together():
    """A custom aggregation (e.g. PowerSGD) is announced as a tag that enters the
    digest: the same tensors averaged another way are as incompatible as other tensors,
    and the error says how they differ."""
    plain = decode_member_info(IDS[0], info())
    assert plain.aggregate_tag == "" and plain.schema_digest == schema_digest(SCHEMA_A)
    tagged = decode_member_info(IDS[0], info(tag="PowerSGD rank 2"))
    assert tagged.aggregate_tag == "PowerSGD rank 2" and tagged.schema == SCHEMA_A
    assert tagged.schema_digest == schema_digest(SCHEMA_A, "PowerSGD rank 2") != plain.schema_digest

    mixed = group(info(tag="PowerSGD rank 2"), info(), info(tag="PowerSGD rank 2"), info())
    plans = [plan_round(mixed, peer_id) for peer_id in IDS[:4]]
    assert plans[0].group.peer_ids == (IDS[0], IDS[2])
    assert plans[1].group.peer_ids == (IDS[1], IDS[3])
    assert plans[0].left_out[IDS[1]] == (
        f"its tensors differ from ours: this peer averages with 'PowerSGD rank 2', {IDS[1]} "
        "with plain averaging"
    )
    rank4, rank2 = info(tag="PowerSGD rank 4"), info(tag="PowerSGD rank 2")
    with pytest.raises(GroupMismatch) as error:
        plan_round(group(rank4, rank2, rank2), IDS[0])
    assert f"averages with 'PowerSGD rank 4', {IDS[1]} with 'PowerSGD rank 2'" in str(error.value)
    for bad in ("x" * 201, "tab\there", 3):
        with pytest.raises(ValidationError, match="aggregate_tag must be printable text"):
            info(tag=bad)


def test_malformed_members_are_left_out_and_nothing_to_do_skips_the_round():
    plan = plan_round(group(info(), b"\xc1junk", info()), IDS[0])
    assert plan.group.peer_ids == (IDS[0], IDS[2])
    assert "malformed" in plan.left_out[IDS[1]]
    with pytest.raises(RoundSkipped, match="nobody else in the group announced usable data"):
        plan_round(group(info(), b"\xc1junk"), IDS[0])
    with pytest.raises(RoundSkipped, match="every member is auxiliary"):
        plan_round(group(info(mode=AUX), info(mode=AUX)), IDS[0])
    with pytest.raises(RoundSkipped, match="every member is in client mode"):
        plan_round(group(info(mode=CLIENT), info(mode=CLIENT)), IDS[0])
