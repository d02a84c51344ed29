"""Expert uid patterns: parsing, sampling distinct uids, clear errors for bad ones."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.moe.expert_uid import is_valid_uid
from swarmgrad.moe.server.expert_pattern import (
    ExpertPattern,
    generate_uids_from_pattern,
    parse_expert_pattern,
    pattern_text,
)
from swarmgrad.utils.errors import ValidationError

names = st.text(alphabet="abcxyz_-0123", min_size=1, max_size=6)
dims = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 50), st.integers(1, 20)).map(lambda t: range(t[0], t[0] + t[1])),
        st.integers(0, 999).map(lambda c: range(c, c + 1)),
    ),
    min_size=1,
    max_size=3,
)


def test_hivemind_patterns_parse():
    pattern = parse_expert_pattern("ffn.[0:32].[0:256]")
    assert pattern.name == "ffn" and pattern.dims == (range(0, 32), range(0, 256))
    assert pattern.grid_size == 32 * 256
    assert parse_expert_pattern("expert.[0:5]").dims == (range(5),)
    assert parse_expert_pattern("e.3.[2:4]").dims == (range(3, 4), range(2, 4))


@given(names, dims)
def test_written_patterns_parse_back(name, dimensions):
    pattern = parse_expert_pattern(pattern_text(ExpertPattern(name, tuple(dimensions))))
    assert pattern.name == name and pattern.dims == tuple(dimensions)


@given(names, dims, st.integers(0, 40), st.integers(0, 2**32))
def test_generated_uids_are_distinct_valid_and_inside_the_grid(name, dimensions, n, seed):
    text = pattern_text(ExpertPattern(name, tuple(dimensions)))
    pattern = parse_expert_pattern(text)
    n = min(n, pattern.grid_size)
    uids = generate_uids_from_pattern(n, text, rng=random.Random(seed))
    assert len(uids) == len(set(uids)) == n
    assert all(is_valid_uid(uid) and uid in pattern for uid in uids)


def test_generation_avoids_excluded_uids_and_refuses_an_impossible_count():
    uids = generate_uids_from_pattern(3, "e.[0:5]", exclude={"e.0", "e.1", "other.2"})
    assert sorted(uids) == ["e.2", "e.3", "e.4"]
    with pytest.raises(ValidationError, match=r"has 5 uids \(2 of them taken\); cannot choose 4"):
        generate_uids_from_pattern(4, "e.[0:5]", exclude={"e.0", "e.1"})


def test_sampling_a_huge_grid_does_not_enumerate_it():
    uids = generate_uids_from_pattern(100, "big.[0:1000000].[0:1000000]", rng=random.Random(0))
    assert len(set(uids)) == 100


@pytest.mark.parametrize(
    ("pattern", "complaint"),
    [
        ("", "is empty"),
        ("expert", "no grid dimensions"),
        ("expert.", "dimension 0 is ''"),
        (".[0:4]", "the name '' must be non-empty"),
        ("ex pert.[0:4]", "the name 'ex pert'"),
        ("expert.[0:4", r"dimension 0 is '\[0:4'"),
        ("expert.[4:4]", r"range '\[4:4\]' is empty"),
        ("expert.[5:2]", "is empty"),
        ("expert.[0:4].x", "dimension 1 is 'x'"),
        ("expert.[-1:4]", "dimension 0"),
        ("expert.07", "dimension 0 is '07'"),
        ("expert.[0:4]..[0:2]", "dimension 1 is ''"),
    ],
)
def test_malformed_patterns_are_refused_saying_what_is_wrong(pattern, complaint):
    with pytest.raises(ValidationError, match=complaint):
        parse_expert_pattern(pattern)


@given(st.text(max_size=30))
def test_any_text_either_parses_or_raises_validation_error(text):
    try:
        pattern = parse_expert_pattern(text)
    except ValidationError:
        return
    assert pattern.grid_size >= 1
    assert parse_expert_pattern(pattern_text(pattern)) == pattern
