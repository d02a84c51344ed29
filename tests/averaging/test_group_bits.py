"""Moshpit group bits: validation, the shift register, distinct coordinates per group."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.matchmaking.group_bits import (
    bits_per_axis_for,
    bits_to_coordinates,
    coordinate_of_rank,
    coordinates_to_bits,
    group_key,
    member_coordinate,
    next_group_bits,
    random_group_bits,
    shift_in,
    validate_group_bits,
)
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ValidationError

PEER_IDS = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(64)]

bit_strings = st.text(alphabet="01", max_size=24)


@pytest.mark.parametrize("bad", ["012", "0b01", " 01", "1 0", 101, None, "1" * 257])
def test_malformed_group_bits_are_refused_with_the_offending_value(bad):
    with pytest.raises(ValidationError, match="group bits"):
        validate_group_bits(bad)


def test_group_key_is_prefix_dot_0b_bits_and_needs_a_prefix():
    assert group_key("run.grad", "0110") == "run.grad.0b0110"
    assert group_key("run", "") == "run.0b"
    with pytest.raises(ValidationError, match="prefix"):
        group_key("", "01")


@pytest.mark.parametrize(
    ("size", "bits"), [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (32, 5), (33, 6)]
)
def test_bits_per_axis_give_at_least_target_group_size_buckets(size, bits):
    assert bits_per_axis_for(size) == bits
    assert 2 ** bits_per_axis_for(size) >= size


@given(bits=bit_strings, coordinate=st.integers(0, 31))
def test_shift_in_keeps_the_length_and_appends_the_new_coordinate(bits, coordinate):
    shifted = shift_in(bits, coordinate, 5)
    assert len(shifted) == len(bits)
    assert set(shifted) <= {"0", "1"}
    new = format(coordinate, "05b")
    if len(bits) >= 5:
        assert shifted == bits[5:] + new  # the oldest coordinate drops out
    else:
        assert shifted == new[len(new) - len(bits) :]


@given(
    group_size=st.integers(1, 32),
    group_id=st.binary(min_size=1, max_size=32),
    rotate=st.booleans(),
    order_seed=st.integers(0, 2**32),
)
def test_members_of_a_group_get_distinct_coordinates_whatever_the_member_order(
    group_size, group_id, rotate, order_seed
):
    members = PEER_IDS[:group_size]
    shuffled = list(members)
    random.Random(order_seed).shuffle(shuffled)
    coordinates = [member_coordinate(group_id, members, p, 32, rotate=rotate) for p in members]
    assert len(set(coordinates)) == group_size
    assert all(0 <= c < 32 for c in coordinates)
    assert coordinates == [
        member_coordinate(group_id, shuffled, p, 32, rotate=rotate) for p in members
    ]


def test_unrotated_coordinates_are_the_ranks_of_sorted_peer_ids():
    members = PEER_IDS[:5]
    ranks = {p: i for i, p in enumerate(sorted(members))}
    for p in members:
        assert member_coordinate(b"g", members, p, 32, rotate=False) == ranks[p]


def test_rotation_spreads_small_groups_over_all_buckets():
    counts = np.zeros(32, int)
    for g in range(400):
        for rank in range(4):
            counts[coordinate_of_rank(rank, g.to_bytes(4, "big"), 32)] += 1
    assert counts.min() > 0.5 * counts.mean()  # without rotation, 28 buckets would stay empty


def test_a_non_member_has_no_coordinate():
    with pytest.raises(ValidationError, match="not a member"):
        member_coordinate(b"g", PEER_IDS[:3], PEER_IDS[10], 32)


@given(bits=bit_strings, group_size=st.integers(2, 16), group_id=st.binary(min_size=1))
def test_next_group_bits_move_every_member_to_a_distinct_key_on_the_new_axis(
    bits, group_size, group_id
):
    members = PEER_IDS[:group_size]
    new = [next_group_bits(bits, group_id, members, p, 4) for p in members]
    assert all(len(b) == len(bits) for b in new)
    if len(bits) >= 4:
        assert len({b[-4:] for b in new}) == group_size  # the axis just averaged along
        assert {b[:-4] for b in new} == {bits[4:]}  # the other axes carried over
    elif not bits:
        assert new == [""] * group_size


@given(coordinates=st.lists(st.integers(0, 15), max_size=6))
def test_coordinates_round_trip_through_bits(coordinates):
    bits = coordinates_to_bits(coordinates, 4)
    assert len(bits) == 4 * len(coordinates)
    assert bits_to_coordinates(bits, 4) == tuple(coordinates)


def test_coordinates_outside_the_grid_are_refused():
    with pytest.raises(ValidationError, match="coordinate 16 on axis 1"):
        coordinates_to_bits([3, 16], 4)
    with pytest.raises(ValidationError, match="do not split"):
        bits_to_coordinates("01101", 4)


@settings(max_examples=25, deadline=None)
@given(dims=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_a_full_grid_reaches_the_exact_mean_in_d_rounds(dims, seed):
    """On a full M^d grid (M=4), grouping by group bits and moving them with
    next_group_bits averages everyone exactly after d rounds: the Moshpit property."""
    rng = random.Random(seed)
    side, bits_per_axis = 4, 2
    cells = [[(c // side**a) % side for a in range(dims)] for c in range(side**dims)]
    peers = PEER_IDS[: len(cells)]
    bits = {
        p: coordinates_to_bits(cell[1:], bits_per_axis)
        for p, cell in zip(peers, cells, strict=True)
    }
    values = {p: rng.gauss(0, 1) for p in peers}
    mean = sum(values.values()) / len(values)
    for _ in range(dims):
        groups: dict[str, list] = {}
        for p in peers:
            groups.setdefault(bits[p], []).append(p)
        assert all(len(g) == side for g in groups.values())
        for members in groups.values():
            group_mean = sum(values[p] for p in members) / len(members)
            group_id = rng.randbytes(8)
            for p in members:
                values[p] = group_mean
                bits[p] = next_group_bits(bits[p], group_id, members, p, bits_per_axis)
    assert max(abs(v - mean) for v in values.values()) < 1e-12


def test_random_group_bits_have_the_requested_length():
    assert len(random_group_bits(7, random.Random(1))) == 7
    assert random_group_bits(0) == ""
    with pytest.raises(ValidationError):
        random_group_bits(-1)
