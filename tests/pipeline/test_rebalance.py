"""Rebalancing decisions: who moves where, never emptying a stage, hysteresis, interval."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.pipeline.rebalance import (
    Move,
    RebalanceOptions,
    Rebalancer,
    pipeline_throughput,
    plan_move,
)
from swarmgrad.utils.errors import ValidationError


def test_the_slowest_peer_of_the_best_served_stage_moves_to_the_bottleneck():
    # 3/2/2/1 peers per stage, equal speeds: the last stage is the bottleneck
    stages = [{"a": 10.0, "b": 10.0, "c": 9.0}, {"d": 10.0, "e": 10.0}, {"f": 10.0, "g": 10.0},
              {"h": 10.0}]  # fmt: skip
    move = plan_move(stages, hysteresis=0.2, tie_tolerance=0.0)
    # c's estimated speed on stage 3: 9 x (stage 3's mean 10 / stage 0's mean 29 / 3)
    assert move == Move("c", 0, 3, throughput_before=10.0, throughput_after=10.0 + 270 / 29)


def test_a_heavier_stage_gets_a_proportionally_slower_estimate():
    # stage 1 is 4x heavier: its peers do 2.5 samples/s where stage 0's do 10
    stages = [{"a": 10.0, "b": 10.0, "c": 10.0}, {"d": 2.5}]
    move = plan_move(stages, hysteresis=0.0)
    assert (move.peer, move.to_stage) in {("a", 1), ("b", 1), ("c", 1)}
    assert move.throughput_after == pytest.approx(5.0)


def test_no_move_below_the_hysteresis_or_from_single_peer_stages():
    assert plan_move([{"a": 10.0, "b": 10.0}, {"c": 18.0}], hysteresis=0.2) is None  # 10 -> 10
    assert plan_move([{"a": 10.0, "b": 2.0}, {"c": 9.0}], hysteresis=0.2) is None  # 9 -> 10.x
    assert plan_move([{"a": 100.0}, {"b": 1.0}], hysteresis=0.0) is None  # would empty stage 0
    assert plan_move([{"a": 1.0}], hysteresis=0.0) is None


def test_an_empty_stage_is_filled_and_unmeasured_peers_never_move():
    move = plan_move([{"a": 5.0, "b": 0.0}, {}], hysteresis=0.5)
    assert (move.peer, move.from_stage, move.to_stage) == ("a", 0, 1)
    assert (move.throughput_before, move.throughput_after) == (0.0, 5.0)  # b counts as 5
    # a stage whose speed is unknown: wait for measurements
    assert plan_move([{"a": 0.0, "b": 0.0}, {}], hysteresis=0.0) is None
    assert plan_move([{"a": 5.0, "b": 5.0}, {"c": 0.0}], hysteresis=0.0) is None


@pytest.mark.parametrize(
    "stages, named",
    [
        ([{"a": -1.0}, {"b": 1.0}], "throughput"),
        ([{"a": float("nan")}, {"b": 1.0}], "throughput"),
        ([{"a": 1.0}, {"a": 1.0}], "stages 0 and 1"),
    ],
)
def test_bad_loads_are_refused_naming_them(stages, named):
    with pytest.raises(ValidationError, match=named):
        plan_move(stages)
    with pytest.raises(ValidationError, match="hysteresis"):
        RebalanceOptions(hysteresis=-0.1)


def swarms(low: float):
    return st.lists(
        st.lists(st.floats(low, 100, allow_nan=False), min_size=0, max_size=5),
        min_size=2,
        max_size=6,
    ).map(lambda stages: [{f"p{i}.{j}": r for j, r in enumerate(s)} for i, s in enumerate(stages)])


@settings(max_examples=300, deadline=None)
@given(swarms(0.0), st.floats(0, 1, allow_nan=False))
def test_with_unmeasured_peers_only_measured_ones_move_and_no_stage_empties(stages, h):
    move = plan_move(stages, h)
    if move is not None:
        assert stages[move.from_stage][move.peer] > 0
        assert len(stages[move.from_stage]) >= 2


@settings(max_examples=300, deadline=None)
@given(swarms(0.01), st.floats(0, 1, allow_nan=False), st.randoms())
def test_moves_never_empty_a_stage_target_the_bottleneck_and_ignore_order(stages, h, rnd):
    move = plan_move(stages, h)
    shuffled = []
    for peers in stages:
        items = list(peers.items())
        rnd.shuffle(items)
        shuffled.append(dict(items))
    assert plan_move(shuffled, h) == move  # every peer computes the same decision
    if move is None:
        return
    totals = [sum(p.values()) for p in stages]
    assert stages[move.from_stage][move.peer] > 0  # measured peers only
    assert move.peer in stages[move.from_stage] and move.from_stage != move.to_stage
    assert len(stages[move.from_stage]) >= 2
    assert totals[move.to_stage] == min(totals)
    assert move.throughput_before == pipeline_throughput(stages)
    assert move.throughput_after > move.throughput_before * (1 + h) or move.throughput_before == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0.25, 4.0), min_size=2, max_size=5),  # stage costs
    st.lists(st.floats(0.5, 2.0), min_size=2, max_size=12),  # peer speeds
    st.floats(0.05, 0.5),
    st.randoms(),
)
def test_repeated_rebalancing_settles_without_emptying_stages(costs, speeds, h, rnd):
    """Peers with a speed, stages with a cost (a peer serves speed / cost samples/s):
    applying the planned moves one by one stops after finitely many, every stage
    keeps a peer, and the pipeline never gets slower."""
    if len(speeds) < len(costs):
        return
    where = {f"p{i}": i % len(costs) for i in range(len(speeds))}
    rnd.shuffle(speeds)
    speed = {f"p{i}": s for i, s in enumerate(speeds)}

    def loads():
        stages = [{} for _ in costs]
        for peer, stage in where.items():
            stages[stage][peer] = speed[peer] / costs[stage]
        return stages

    last = pipeline_throughput(loads())
    for _ in range(200):
        move = plan_move(loads(), h)
        if move is None:
            break
        where[move.peer] = move.to_stage
        assert all(loads()), "a stage was left empty"
        now = pipeline_throughput(loads())
        assert now >= last * (1 - 1e-9) or now > 0
        last = now
    else:
        pytest.fail("rebalancing did not settle")


def test_rebalancer_checks_once_per_interval_and_only_the_chosen_peer_moves():
    stages = [{"a": 10.0, "b": 10.0, "c": 9.0}, {"h": 10.0}]
    others = [Rebalancer(p, RebalanceOptions(interval=30.0)) for p in ("a", "b", "h")]
    chosen = Rebalancer("c", RebalanceOptions(interval=30.0))
    assert all(r.decide(0.0, stages) is None for r in others)
    move = chosen.decide(0.0, stages)
    assert move is not None and move.peer == "c"
    assert chosen.decide(10.0, stages) is None  # not due yet
    assert chosen.decide(30.0, stages) == move
    chosen.moved(31.0)
    assert not chosen.due(60.0) and chosen.due(61.0)


def test_a_stage_that_lost_a_peer_is_checked_at_once_not_after_the_interval():
    options = RebalanceOptions(interval=60.0, hysteresis=0.1)
    before = [{"a": 10.0, "b": 10.0, "g": 10.0}, {"c": 10.0, "d": 10.0}, {"e": 10.0, "f": 10.0}]
    mover = Rebalancer("a", options)
    assert mover.decide(0.0, before) is None  # no move gains 10 %
    assert mover.decide(5.0, before) is None and not mover.due(5.0)
    # d died and its record lapsed: stage 1 is the bottleneck now, checked at 6 s
    after = [{"a": 10.0, "b": 10.0, "g": 10.0}, {"c": 10.0}, {"e": 10.0, "f": 10.0}]
    move = mover.decide(6.0, after)
    assert move is not None and (move.peer, move.from_stage, move.to_stage) == ("a", 0, 1)
    # the same counts again are no new loss: back to the interval
    assert mover.decide(7.0, after) is None
    # a peer that moved does not count the stage it left as a loss
    mover.moved(8.0)
    moved = [{"b": 10.0, "g": 10.0}, {"c": 10.0, "a": 0.0}, {"e": 10.0, "f": 10.0}]
    assert mover.decide(9.0, moved) is None and mover.decide(10.0, moved) is None
    with pytest.raises(ValidationError, match="look_period"):
        RebalanceOptions(look_period=0)


def test_plan_is_the_same_for_every_random_peer_order():
    rng = random.Random(1)
    stages = [{f"s{i}p{j}": rng.uniform(1, 5) for j in range(rng.randint(1, 4))} for i in range(4)]
    moves = {plan_move([dict(reversed(list(p.items()))) for p in stages]), plan_move(stages)}
    assert len(moves) == 1


def test_peers_within_the_tie_tolerance_of_the_slowest_tie_and_the_smallest_id_moves():
    stages = [{"b": 10.0, "a": 10.5, "c": 12.0}, {"d": 5.0}]
    assert plan_move(stages, 0.2, tie_tolerance=0.1).peer == "a"  # a and b tie
    assert plan_move(stages, 0.2, tie_tolerance=0.0).peer == "b"  # b is strictly slowest
    with pytest.raises(ValidationError, match="tie_tolerance"):
        RebalanceOptions(tie_tolerance=-1)
