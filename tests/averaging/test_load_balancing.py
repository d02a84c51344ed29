"""Span sizes from bandwidth: properties of the linear program and its rounding."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers, optimize_parts_lp
from swarmgrad.utils.errors import ValidationError

bandwidth = st.one_of(
    st.none(),
    st.just(0.0),
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False),
)
bandwidth_lists = st.lists(bandwidth, min_size=1, max_size=12).filter(
    lambda bws: any(b is None or b > 0 for b in bws)
)


@settings(max_examples=150, deadline=None)
@given(
    vector_size=st.integers(min_value=0, max_value=10**9),
    bandwidths=bandwidth_lists,
    min_size=st.integers(min_value=0, max_value=10**6),
)
def test_shares_are_whole_non_negative_and_sum_to_the_vector(vector_size, bandwidths, min_size):
    sizes = load_balance_peers(vector_size, bandwidths, min_size)
    assert len(sizes) == len(bandwidths)
    assert all(type(s) is int and s >= 0 for s in sizes)
    assert sum(sizes) == vector_size


@settings(max_examples=150, deadline=None)
@given(vector_size=st.integers(min_value=0, max_value=10**8), bandwidths=bandwidth_lists)
def test_client_mode_members_own_nothing(vector_size, bandwidths):
    sizes = load_balance_peers(vector_size, bandwidths)
    for size, bw in zip(sizes, bandwidths, strict=True):
        if bw == 0:
            assert size == 0


@settings(max_examples=100, deadline=None)
@given(
    vector_size=st.integers(min_value=1, max_value=10**8),
    bandwidths=bandwidth_lists,
    min_size=st.integers(min_value=1, max_value=10**5),
)
def test_no_share_is_below_min_size_unless_one_member_takes_everything(
    vector_size, bandwidths, min_size
):
    sizes = load_balance_peers(vector_size, bandwidths, min_size)
    owners = [s for s in sizes if s > 0]
    assert len(owners) == 1 or all(s >= min_size for s in owners)


@settings(max_examples=100, deadline=None)
@given(
    bandwidths=st.lists(
        st.floats(min_value=1.0, max_value=1000.0, allow_nan=False), min_size=3, max_size=10
    )
)
def test_faster_members_never_get_smaller_shares(bandwidths):
    """The LP's optimum (ties broken toward proportional shares) is monotone in bandwidth."""
    sizes = load_balance_peers(10**7, bandwidths)
    order = sorted(range(len(bandwidths)), key=lambda i: bandwidths[i])
    for slower, faster in itertools.pairwise(order):
        if bandwidths[faster] > bandwidths[slower] * (1 + 1e-9):
            assert sizes[faster] + 1 >= sizes[slower]


@settings(max_examples=100, deadline=None)
@given(bandwidths=bandwidth_lists)
def test_the_plan_is_no_slower_than_proportional_shares(bandwidths):
    known = [b for b in bandwidths if b is not None and b > 0]
    mean = sum(known) / len(known) if known else 1.0
    filled = [mean if b is None else b for b in bandwidths]
    senders = [True] * len(filled)
    num_senders = len(filled)

    def slowest(fractions):
        return max(
            (1 - x + x * (num_senders - 1)) / b
            for x, b in zip(fractions, filled, strict=True)
            if b > 0
        )

    total = sum(b for b in filled if b > 0)
    proportional = [b / total if b > 0 else 0.0 for b in filled]
    assert slowest(optimize_parts_lp(filled, senders)) <= slowest(proportional) * (1 + 1e-6)


def test_equal_bandwidths_give_equal_shares():
    assert load_balance_peers(100, [None] * 4) == (25, 25, 25, 25)
    assert load_balance_peers(16_000_000, [2.5] * 8) == (2_000_000,) * 8


def test_two_members_split_in_proportion_to_bandwidth():
    """With two senders every split takes the same time; the tie goes to proportional."""
    assert load_balance_peers(300, [1.0, 2.0]) == (100, 200)


def test_unknown_bandwidth_counts_as_the_mean_of_the_known():
    assert (
        load_balance_peers(300, [None, 0, 2.0, 4.0])[0]
        == load_balance_peers(300, [3.0, 0, 2.0, 4.0])[0]
    )


def test_tiny_shares_are_dropped_and_redistributed():
    assert load_balance_peers(100, [1, 1, 1, 1], min_size=30) == (34, 33, 33, 0)
    assert load_balance_peers(3, [1, 1, 1, 1], min_size=5) == (3, 0, 0, 0)


def test_auxiliary_members_that_send_nothing_may_reduce_more():
    with_aux = load_balance_peers(9000, [1, 1, 1], senders=[True, True, False])
    assert sum(with_aux) == 9000
    assert with_aux[2] >= with_aux[0]  # it carries no outgoing data of its own


@pytest.mark.parametrize(
    "bandwidths, match",
    [
        ([], "at least one member"),
        ([0, 0], "every bandwidth is 0"),
        ([1, -1], "member 1 must be finite and >= 0"),
        ([1, math.nan], "member 1 must be finite"),
        ([1, "fast"], "member 1 must be a number"),
    ],
)
def test_bad_bandwidths_are_refused_naming_the_member(bandwidths, match):
    with pytest.raises(ValidationError, match=match):
        load_balance_peers(10, bandwidths)


def test_bad_sizes_are_refused():
    with pytest.raises(ValidationError, match="vector_size"):
        load_balance_peers(-1, [1])
    with pytest.raises(ValidationError, match="min_size"):
        load_balance_peers(10, [1], min_size=-2)
    with pytest.raises(ValidationError, match="2 sender flags for 1"):
        load_balance_peers(10, [1], senders=[True, True])
