"""``benchmarks/lah_convergence.py`` in its small configuration, and the failure model it
relies on: a DMoE layer whose expert calls fail at random keeps answering every sample,
forward and backward, through swarmgrad's expert server on the simulated network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from _lah_swarm import SimSwarm  # noqa: E402

from swarmgrad.moe import RemoteMixtureOfExperts, protocol  # noqa: E402
from swarmgrad.moe.protocol import BatchTensorDescriptor  # noqa: E402
from swarmgrad.moe.server import ModuleBackend  # noqa: E402

CONDITION_KEYS = {
    "final_accuracy_median", "final_accuracy_min", "final_accuracy_max", "staleness_median",
    "lost_batches", "median_curve", "in_flight",
}  # fmt: skip


def test_small_run_ends_with_accuracy_curves_per_condition(tmp_path):
    pytest.importorskip("sklearn")
    env = dict(os.environ, LAH_SMALL="1", LAH_PLOT=str(tmp_path / "plot.png"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "lah_convergence.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"conditions", "parameters", "config", "seconds"} <= set(figures)
    conditions = figures["conditions"]
    assert set(conditions) == {"dmoe_0ms", "dmoe_100ms_fail10", "dense"}
    for name, summary in conditions.items():
        assert CONDITION_KEYS <= set(summary), name
        assert 0.0 <= summary["final_accuracy_min"] <= summary["final_accuracy_max"] <= 1.0
        steps = [step for step, _ in summary["median_curve"]]
        assert steps == [10, 20], name
    # a batch is lost only when every expert of a sample, or of a layer's backward, failed
    assert conditions["dmoe_0ms"]["lost_batches"] == 0
    assert conditions["dmoe_100ms_fail10"]["lost_batches"] <= 4  # of 40
    assert conditions["dense"]["final_accuracy_median"] > 0.3  # 20 steps learn something
    assert conditions["dense"]["staleness_median"] == 0
    dmoe, dense = figures["parameters"]["dmoe"], figures["parameters"]["dense"]
    assert abs(dmoe - dense) / dense < 0.02  # equal parameter counts, up to the gates


def test_a_dmoe_layer_tolerates_a_tenth_of_its_expert_calls_failing():
    torch.manual_seed(0)
    hidden, grid = 8, (2, 2)
    with SimSwarm(seed=0) as swarm:
        node = swarm.node()
        backends = {}
        for i in range(grid[0]):
            for j in range(grid[1]):
                uid = f"flaky.{i}.{j}"
                module = torch.nn.Linear(hidden, hidden)
                backends[uid] = ModuleBackend(
                    uid,
                    module,
                    optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
                    args_schema=(BatchTensorDescriptor(hidden),),
                )
        swarm.server(backends, failure_rate=0.1)
        moe = RemoteMixtureOfExperts(
            in_features=hidden, grid_size=grid, dht=node, uid_prefix="flaky.", k_best=2
        )
        for _ in range(30):
            x = torch.randn(16, hidden, requires_grad=True)
            out = moe(x)  # raises if any sample got no answer at all
            assert out.shape == (16, hidden) and torch.isfinite(out).all()
            out.sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
        failed = dict(swarm.failed_calls)
        updates = sum(b.update_count for b in backends.values())
    # 30 batches to up to 4 experts, forward and backward: some calls of each kind failed
    # (never reaching an expert), every sample was still answered, the experts learned
    assert failed.get(protocol.FORWARD, 0) > 0 and failed.get(protocol.BACKWARD, 0) > 0
    assert updates > 0
