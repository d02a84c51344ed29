"""StageRouter: weighted stochastic wiring, bans and blame, adaptive hop deadlines."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.pipeline.routing import RoutingOptions, ServerLoad, StageRouter
from swarmgrad.utils.errors import ValidationError

loads = st.lists(
    st.builds(
        ServerLoad,
        server=st.integers(0, 20),
        throughput=st.floats(0, 1e4, allow_nan=False),
        queue=st.integers(0, 1000),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda s: s.server,
)


def router(seed: int = 0, **options) -> StageRouter:
    return StageRouter(RoutingOptions(**options), random.Random(seed))


def test_choices_follow_throughput():
    r = router()
    servers = [ServerLoad("a", 1.0), ServerLoad("b", 2.0), ServerLoad("c", 7.0)]
    counts = Counter(r.choose(servers, now=0.0) for _ in range(20000))
    for name, share in (("a", 0.1), ("b", 0.2), ("c", 0.7)):
        assert abs(counts[name] / 20000 - share) < 0.02, counts


def test_a_long_queue_lowers_a_servers_share():
    r = router()
    servers = [ServerLoad("fast_but_busy", 10.0, queue=39), ServerLoad("idle", 1.0, queue=0)]
    # expected service rates: 10 / 40 and 1 / 1, so the idle server gets 80%
    counts = Counter(r.choose(servers, now=0.0) for _ in range(10000))
    assert abs(counts["idle"] / 10000 - 0.8) < 0.03, counts


def test_unmeasured_servers_count_with_the_median_throughput():
    r = router()
    weights = r.weights([ServerLoad("a", 2.0), ServerLoad("b", 4.0), ServerLoad("new", 0.0)])
    assert weights["new"] == pytest.approx(3.0)
    assert router().weights([ServerLoad("x", 0.0)])["x"] == pytest.approx(1.0)


@settings(max_examples=200, deadline=None)
@given(loads, st.data())
def test_choose_never_returns_excluded_or_banned_servers_while_others_remain(servers, data):
    r = router(data.draw(st.integers(0, 100)))
    ids = [s.server for s in servers]
    banned = data.draw(st.sets(st.sampled_from(ids)))
    excluded = data.draw(st.sets(st.sampled_from(ids)))
    for server in banned:
        r.report_failure(server, now=0.0)
    choice = r.choose(servers, now=1.0, exclude=excluded)
    allowed = [i for i in ids if i not in excluded]
    if not allowed:
        assert choice is None
        return
    assert choice in allowed
    if any(i not in banned for i in allowed):
        assert choice not in banned


def test_when_every_server_is_banned_the_earliest_ban_to_end_is_tried():
    r = router(ban_seconds=5.0)
    r.report_failure("a", now=0.0)
    r.report_failure("b", now=2.0)
    r.blame("c", now=0.0)
    servers = [ServerLoad("a", 1.0), ServerLoad("b", 100.0), ServerLoad("c", 100.0)]
    assert r.choose(servers, now=3.0) == "a"
    assert r.choose(servers, now=5.5) in {"a"}  # a is free again, b and c still banned


def test_bans_double_up_to_the_limit_and_a_success_clears_them():
    r = router(ban_seconds=1.0, max_ban_seconds=4.0, blame_ban_seconds=30.0)
    ends = [r.report_failure("a", now=100.0) for _ in range(4)]
    assert ends == [101.0, 102.0, 104.0, 104.0]
    assert r.is_banned("a", 103.9) and not r.is_banned("a", 104.0)
    r.report_success("a", 0.1, now=105.0)
    assert r.report_failure("a", now=200.0) == 201.0
    assert r.blame("b", now=0.0) == 30.0  # blame starts with the long ban


def test_forget_drops_servers_that_left():
    r = router()
    r.report_failure("gone", 0.0)
    r.report_failure("here", 0.0)
    r.forget(["here"])
    assert not r.is_banned("gone", 0.5) and r.is_banned("here", 0.5)


def test_hop_deadline_starts_at_the_initial_value_then_follows_measured_hops():
    r = router(initial_deadline=20.0, min_deadline=0.5, max_deadline=60.0, slack=3.0, quantile=0.9)
    assert r.hop_deadline() == 20.0
    for seconds in [1.0] * 9 + [2.0]:
        r.report_success("a", seconds, now=0.0)
    assert r.hop_deadline() == pytest.approx(3.0)  # 3 x the 90th percentile (1.0)
    for _ in range(10):
        r.report_success("a", 2.0, now=0.0)
    assert r.hop_deadline() == pytest.approx(6.0)


def test_each_late_try_of_a_hop_doubles_its_next_deadline_up_to_the_limit():
    r = router(initial_deadline=2.0, min_deadline=0.5, max_deadline=10.0, slack=2.0)
    assert [r.hop_deadline(late) for late in range(4)] == [2.0, 4.0, 8.0, 10.0]
    for _ in range(10):
        r.report_success("a", 1.0, now=0.0)
    assert [r.hop_deadline(late) for late in range(3)] == [2.0, 4.0, 8.0]
    assert r.hop_deadline(10_000) == 10.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), max_size=100))
def test_hop_deadline_stays_within_its_bounds(times):
    r = router(min_deadline=0.5, max_deadline=30.0)
    for t in times:
        r.report_success("s", t, now=0.0)
    assert 0.5 <= r.hop_deadline() <= 30.0


@pytest.mark.parametrize(
    "options, named",
    [
        ({"ban_seconds": 0}, "ban_seconds"),
        ({"min_deadline": 10.0, "max_deadline": 1.0}, "min_deadline"),
        ({"quantile": 1.5}, "quantile"),
        ({"slack": -1}, "slack"),
        ({"window": 0}, "window"),
        ({"ban_seconds": 100.0, "max_ban_seconds": 10.0}, "ban_seconds"),
    ],
)
def test_bad_options_are_refused_naming_them(options, named):
    with pytest.raises(ValidationError, match=named):
        RoutingOptions(**options)
