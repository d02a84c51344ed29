"""FragmentSchedule: when each streaming fragment is due, as a pure object (no swarm)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.optim.fragment_schedule import (
    FragmentSchedule,
    fragment_send_rate,
    split_into_fragments,
)
from swarmgrad.utils.errors import ValidationError

counts = st.integers(min_value=1, max_value=12)
offsets = st.floats(min_value=0.01, max_value=1.0)


def run_epochs(schedule: FragmentSchedule, progress_steps: list[list[float]]) -> list[list[int]]:
    """Drive the schedule as DiLoCoOptimizer does: launch what is due at each step's
    progress, then the rest at the outer step; the launches of each epoch, in order."""
    launched = [-1] * schedule.num_fragments
    per_epoch = []
    for epoch, steps in enumerate(progress_steps):
        order = []
        for progress in steps:
            for index in schedule.due_now(epoch, progress, launched):
                launched[index] = epoch
                order.append(index)
        for index in schedule.left_for_outer_step(epoch, launched):
            launched[index] = epoch
            order.append(index)
        per_epoch.append(order)
    return per_epoch


progress_runs = st.lists(
    st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=30).map(sorted),
    min_size=1,
    max_size=5,
)


@given(count=counts, offset=offsets, epochs=progress_runs)
def test_every_fragment_syncs_exactly_once_per_epoch_in_index_order(count, offset, epochs):
    schedule = FragmentSchedule(count, offset)
    for order in run_epochs(schedule, epochs):
        assert order == list(range(count))


@given(count=st.integers(min_value=2, max_value=12), offset=offsets)
def test_due_fractions_are_evenly_spaced_inside_the_epoch(count, offset):
    schedule = FragmentSchedule(count, offset)
    fractions = [schedule.due_fraction(i) for i in range(count)]
    assert all(0 < f <= 1 for f in fractions)
    gaps = [b - a for a, b in itertools.pairwise(fractions)]
    assert all(gap == pytest.approx(1 / count) for gap in gaps)
    assert fractions[0] == pytest.approx(offset / count)


@given(count=counts, offset=offsets, progress=st.floats(min_value=0.0, max_value=1.0))
def test_a_fragment_is_due_once_its_share_is_done_and_never_twice_in_an_epoch(
    count, offset, progress
):
    schedule = FragmentSchedule(count, offset)
    fresh = [-1] * count
    due = schedule.due_now(3, progress, fresh)
    fractions = [schedule.due_fraction(i) for i in range(count)]
    # a fragment due at the epoch's very end is the outer step's
    assert due == [i for i, f in enumerate(fractions) if f <= progress and f < 1.0]
    done = [3 if i in due else -1 for i in range(count)]
    assert schedule.due_now(3, progress, done) == []
    assert [i for i, _ in schedule.upcoming(3, done)] == [i for i in range(count) if i not in due]


def test_plain_diloco_syncs_its_one_fragment_at_the_outer_step():
    schedule = FragmentSchedule(1)
    assert not schedule.streaming and schedule.due_fraction(0) == 1.0
    assert schedule.due_now(0, 1.0, [-1]) == []
    assert schedule.upcoming(0, [-1]) == [(0, 1.0)]
    assert schedule.left_for_outer_step(0, [-1]) == [0]
    assert schedule.leader_sources(4, 0) == []


def test_four_fragments_are_due_at_an_eighth_three_eighths_and_so_on():
    schedule = FragmentSchedule(4)
    assert [schedule.due_fraction(i) for i in range(4)] == [0.125, 0.375, 0.625, 0.875]
    assert schedule.due_now(2, 0.4, [1, 1, 1, 1]) == [0, 1]
    assert schedule.due_now(2, 0.4, [2, 1, 1, 1]) == [1]
    assert schedule.pacing_window(epoch_length=8.0, pace=0.5) == 1.0


def test_round_tags_and_leaders_follow_the_latest_group():
    schedule = FragmentSchedule(3)
    assert schedule.round_tag(5, 2) == "outer5f2"
    assert schedule.leader_sources(5, 1) == [(0, 5)]
    assert schedule.leader_sources(5, 2) == [(0, 5)]
    assert schedule.leader_sources(5, 0) == [(2, 4), (0, 4)]
    assert schedule.after_download(5) == 4
    # after a download of epoch 5's state every fragment of epoch 5 is still to come
    launched = [schedule.after_download(5)] * 3
    assert schedule.left_for_outer_step(5, launched) == [0, 1, 2]


def test_bad_arguments_are_refused_by_name():
    for args, reason in (
        ((0,), "num_fragments must be a positive int"),
        ((2, 0.0), r"offset must be a number in \(0, 1\]"),
        ((2, 1.5), "offset must be"),
    ):
        with pytest.raises(ValidationError, match=reason):
            FragmentSchedule(*args)
    schedule = FragmentSchedule(2)
    with pytest.raises(ValidationError, match="no fragment 2"):
        schedule.due_fraction(2)
    with pytest.raises(ValidationError, match="launched has 3 entries"):
        schedule.due_now(0, 0.5, [-1, -1, -1])


@given(sizes=st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=40))
def test_fragments_cover_every_tensor_once_in_model_order(sizes):
    for count in range(1, len(sizes) + 1):
        fragments = split_into_fragments(sizes, count)
        assert len(fragments) == count and all(fragments)
        assert [i for fragment in fragments for i in fragment] == list(range(len(sizes)))


def test_send_rate_spreads_a_round_over_its_window_within_a_share_of_the_timeout():
    common = {"payload_bytes": 40_000.0, "measured_bytes": None, "timeout": 60.0}
    # 4 peers: each writes 2 * 3/4 of the payload, 60 kB over a 10-s window
    assert fragment_send_rate(num_peers=4, window=10.0, **common) == pytest.approx(6_000.0)
    # a long window is capped by a quarter of the timeout: 60 kB within 15 s
    assert fragment_send_rate(num_peers=4, window=1e6, **common) == pytest.approx(4_000.0)
    # what rounds really wrote wins, with a margin, but not below 0.6 of the estimate
    measured = dict(common, measured_bytes=10_000.0)
    assert fragment_send_rate(num_peers=4, window=10.0, **measured) == pytest.approx(3_600.0)
    measured["measured_bytes"] = 50_000.0
    assert fragment_send_rate(num_peers=4, window=10.0, **measured) == pytest.approx(5_250.0)
    assert fragment_send_rate(num_peers=1, window=10.0, **common) is None
    assert fragment_send_rate(num_peers=4, window=0.0, **common) is None
    tiny = dict(common, payload_bytes=10.0)
    assert fragment_send_rate(num_peers=2, window=10.0, **tiny) == 1024.0  # the floor
