"""``benchmarks/gpu_training.py`` in its scaled-down CPU form: the JSON line it ends with."""

from __future__ import annotations

import json
import os

from tests.helpers.benchmarks import run_script

REPO_KEYS = {"device", "dtype", "params", "config", "samples_per_s", "ratio_sync",
             "ratio_offload", "peers", "seconds"}  # fmt: skip


def test_small_run_reports_throughput_ratios_and_the_two_peer_losses():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = run_script("gpu_training.py", env, 120, "--small")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert REPO_KEYS <= set(figures)
    assert figures["device"] == "cpu" and figures["dtype"] == "fp32"
    assert figures["config"]["width"] < 256  # the scaled-down model
    rates = figures["samples_per_s"]
    assert all(rates[k] > 0 for k in ("plain", "sync", "offload"))
    assert figures["ratio_sync"] == rates["sync"] / rates["plain"]
    peers = figures["peers"]
    assert len(peers["pair_losses"]) == 2
    # every process trained from the same start on the same task: losses are close
    assert 0.9 < peers["loss_ratio_pair_vs_alone"] < 1.1
    assert peers["pair_samples"] > 0 and peers["alone_samples"] > 0
    assert "samples/s" in done.stdout  # the human table before the JSON
