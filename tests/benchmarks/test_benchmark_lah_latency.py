"""``benchmarks/lah_latency.py`` in its small configuration: the JSON it ends with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "latency_ms", "dmoe_samples_per_s", "naive_mp_samples_per_s", "gpipe_samples_per_s",
    "dmoe_retained", "naive_mp_retained", "gpipe_retained", "dmoe_over_naive_mp_at_max",
    "cores_used", "passes", "config", "seconds",
}  # fmt: skip


def test_small_run_ends_with_throughputs_for_every_latency_and_method(tmp_path):
    env = dict(os.environ, LAH_SMALL="1", LAH_PLOT=str(tmp_path / "plot.png"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "lah_latency.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS <= set(figures)
    assert figures["latency_ms"] == [0.0, 20.0]
    for method in ("dmoe", "naive_mp", "gpipe"):
        values = figures[f"{method}_samples_per_s"]
        assert len(values) == 2 and all(v > 0 for v in values), (method, values)
        assert 0 < figures[f"{method}_retained"] < 5
        assert all(0 <= c <= (os.cpu_count() or 1) + 0.5 for c in figures["cores_used"][method])
    # a 2-stage pipeline pays 4 hops of 20 ms per batch of 8: at most 100 samples/s
    assert figures["naive_mp_samples_per_s"][1] <= 110
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "plot.png").stat().st_size > 0
