"""Moshpit averaging: the numpy model, its baselines, and the real protocol agreeing with it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from swarmgrad.net.sim import run_simulation
from swarmgrad.utils.errors import ValidationError

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from moshpit_sim import (
    initial_group_bits,
    model_allreduce,
    model_gossip,
    model_moshpit,
    run_protocol,
)


def test_initial_positions_are_distinct_cells_of_the_grid():
    bits = initial_group_bits(64, 8, 2, random.Random(0))
    assert sorted(bits) == sorted(format(c, "03b") for c in range(8) for _ in range(8))
    assert len(initial_group_bits(100, 8, 3, random.Random(0))[0]) == 6
    with pytest.raises(ValidationError, match="do not fit"):
        initial_group_bits(65, 8, 2, random.Random(0))
    with pytest.raises(ValidationError, match="power of two"):
        initial_group_bits(10, 6, 2, random.Random(0))


def test_model_a_full_grid_averages_exactly_in_as_many_rounds_as_dimensions():
    assert model_moshpit(1024, 0.0, seed=1) == 2
    assert model_moshpit(512, 0.0, grid_side=8, grid_dims=3, seed=1) == 3


def test_model_a_partial_grid_converges_geometrically_and_tolerates_failures():
    rounds = [model_moshpit(512, 0.01, seed=s) for s in range(5)]
    assert all(r is not None and 5 <= r <= 10 for r in rounds)
    # the paper's rule (rank without rotation) is slower on a half-empty grid
    paper = [model_moshpit(512, 0.0, seed=s, rotate=False) for s in range(5)]
    ours = [model_moshpit(512, 0.0, seed=s) for s in range(5)]
    assert sum(ours) < sum(paper)


def test_model_baselines_allreduce_fails_with_any_peer_and_gossip_is_slow():
    assert model_allreduce(900, 0.0) == 1
    assert model_allreduce(900, 1.0) is None
    assert sum(model_allreduce(900, 0.005, seed=s) is None for s in range(10)) >= 7
    gossip = model_gossip(512, 0.0, seed=0)
    assert gossip is not None and 25 <= gossip <= 40
    assert model_gossip(512, 0.0, max_rounds=10) is None


def test_protocol_on_a_full_grid_forms_exactly_the_grid_groups_and_averages_in_two_rounds():
    async def main(network):
        return await run_protocol(network, 64, 0.0, grid_side=8, seed=0)

    run = run_simulation(main, seed=0, latency=0.02)
    assert run.rounds == 2
    assert run.group_sizes == [[8] * 8, [8] * 8]
    assert run.extra_splits == 0 and run.lonely == 0
    assert run.mse[-1] < 1e-20


def test_protocol_on_a_partial_grid_with_failures_counts_the_rounds_the_model_counts():
    peers, side, p = 48, 8, 0.02
    model = [model_moshpit(peers, p, grid_side=side, seed=s) for s in range(100)]
    assert None not in model

    async def main(network):
        return await run_protocol(network, peers, p, grid_side=side, seed=3)

    run = run_simulation(main, seed=3, latency=0.02)
    assert run.rounds is not None and min(model) <= run.rounds <= max(model)
    assert all(later < earlier for earlier, later in zip(run.mse, run.mse[1:], strict=False))
    assert run.extra_splits == 0 and run.lonely == 0
