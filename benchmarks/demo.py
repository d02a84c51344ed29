"""``swarmgrad demo`` with its defaults, timed from outside, against the issue's targets.

    python benchmarks/demo.py        # three runs, about 6 minutes here

Each run starts ``swarmgrad demo --no-progress`` (a bootstrap peer, three trainers of
which one in client mode, one more joining late, one SIGKILLed midway; 100 s of
training) as a fresh process and reads the JSON line it prints last. The reference is
the untrained model: the demo evaluates both on the same held-out standard-library
windows, and the ratio of their perplexities is the figure. Reported (medians over the
runs, ``DEMO_RUNS`` to change their number): ``wall_s`` (from starting the command to
its exit, everything included), ``perplexity_untrained``, ``perplexity_trained``,
``perplexity_ratio``, ``peers_trained`` (trainers that reported samples). Targets:
wall time under 180 s, perplexity at least 3 x lower than untrained, every trainer
(four) trained. The monitor's page load is not measured: ``swarmgrad monitor`` is not
part of the demo yet. Last line: one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def one_run() -> dict:
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "demo", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - began
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"the demo failed (code {result.returncode}):\n{result.stdout}")
    figures = json.loads(lines[-1])
    if figures.get("plot"):  # the demo keeps its plot; a benchmark leaves nothing behind
        shutil.rmtree(os.path.dirname(figures["plot"]), ignore_errors=True)
    figures["wall_s"] = wall
    figures["perplexity_ratio"] = figures["perplexity_untrained"] / figures["perplexity_trained"]
    return figures


def main() -> None:
    runs = int(os.environ.get("DEMO_RUNS", "3"))
    results = []
    print(f"{'run':>4} {'wall s':>8} {'ppl untrained':>14} {'ppl trained':>12} "
          f"{'ratio':>7} {'peers':>6} {'epochs':>7}")  # fmt: skip
    for index in range(runs):
        r = one_run()
        results.append(r)
        print(f"{index + 1:>4} {r['wall_s']:>8.1f} {r['perplexity_untrained']:>14.2f} "
              f"{r['perplexity_trained']:>12.2f} {r['perplexity_ratio']:>7.1f} "
              f"{r['peers_trained']:>6} {r['global_epoch']:>7}", flush=True)  # fmt: skip
    keys = ("wall_s", "perplexity_untrained", "perplexity_trained", "perplexity_ratio",
            "peers_trained", "global_epoch")  # fmt: skip
    summary = {key: statistics.median(r[key] for r in results) for key in keys}
    summary["runs"] = runs
    summary["wall_under_180_s"] = summary["wall_s"] < 180
    summary["perplexity_3x_lower"] = summary["perplexity_ratio"] >= 3
    summary["all_four_trained"] = summary["peers_trained"] == 4
    summary["monitor_page_load_s"] = None  # no monitor in the demo yet
    print(
        f"median of {runs}: {summary['wall_s']:.0f} s wall, perplexity "
        f"{summary['perplexity_trained']:.2f} vs {summary['perplexity_untrained']:.2f} "
        f"untrained ({summary['perplexity_ratio']:.1f}x lower), "
        f"{summary['peers_trained']} trainers trained"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
