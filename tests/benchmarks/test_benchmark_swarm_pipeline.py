"""``benchmarks/swarm_pipeline.py`` scaled down (2 stages, 3 stage peers, 1 trainer, on
loopback, windows of seconds): the JSON it ends with has every figure, each sane. The
targets are for the full run (docs/benchmarks.md), not this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--stages", "2", "--speeds", "1,0.6,0.6", "--start", "0,1/2", "--fixed", "0,1",
    "--kill-stage", "0", "--trainers", "1", "--in-flight", "3", "--no-lab",
    "--no-convergence", "--warmup", "1", "--start-window", "4", "--settle-budget", "6",
    "--measure", "3", "--fault-window", "4", "--window", "1", "--rebalance-interval", "2",
    "--update-period", "1", "--average-period", "0", "--base-slowdown", "0.03",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_small_run_reports_every_figure_beside_its_target(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "swarm_pipeline.py"), *SMALL,
         "--plot", str(tmp_path / "plot.png")],
        capture_output=True, text=True, env=env, timeout=280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("throughput_ratio", "fault_recovery_s", "fault_dropped", "rebalance_ratio",
                 "min_servers_per_stage"):  # fmt: skip
        assert f"{name}_target" in figures, name
    assert figures["network"].startswith("loopback")
    assert figures["stages"] == 2 and figures["peers"] == 3 and figures["trainers"] == 1
    assert figures["fixed_samples_per_s"] > 0 and figures["swarm_samples_per_s"] > 0
    assert figures["throughput_ratio"] == pytest.approx(
        figures["swarm_samples_per_s"] / figures["fixed_samples_per_s"], rel=0.02
    )
    assert figures["killed_peer"] == 0
    recovery = figures["fault_recovery_s"]
    assert recovery is None or 1 <= recovery <= 4  # one window at least, the horizon at most
    assert figures["fault_dropped"] >= 0 and figures["fixed_fault_dropped"] >= 0
    # the fixed pipeline lost its only stage-0 server: nothing finished after the kill
    assert figures["fixed_fault_after_ratio"] == 0.0 and figures["fixed_fault_recovery_s"] is None
    assert figures["rebalance_start_layout"] == "2/1"
    assert figures["rebalance_start_samples_per_s"] > 0
    assert figures["min_servers_per_stage"] >= 0 and figures["stage_samples"] > 0
    assert "pipeline_convergence.py" in figures["convergence"]
    if figures["plot"]:
        assert Path(figures["plot"]).stat().st_size > 0
