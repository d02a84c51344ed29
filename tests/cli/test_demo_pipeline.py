"""``swarmgrad demo pipeline`` end to end, shortened: real stage-peer processes, the
starved stage rebalanced, a SIGKILLed peer routed around, everything stopped after."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmgrad.cli import demo_pipeline
from swarmgrad.cli.main import main


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "1"], "--stages must be at least 2"),
        (["--peers", "7"], "--peers must be at least twice --stages (8"),
        (["--duration", "0"], "--duration must be positive"),
        (["--kill-at", "1"], "--kill-at must be in [0, 1)"),
        (["--width", "30"], "--width must be a multiple of 4"),
        (["--slowdown", "-1"], "--slowdown must be 0 or more"),
    ],
)
def test_bad_options_are_refused_by_name_before_starting_anything(capsys, argv, message):
    assert main(["demo", "pipeline", *argv]) == 2
    assert message in capsys.readouterr().out


def test_the_last_stage_starts_starved_and_every_stage_served():
    assert demo_pipeline.starved_layout(4, 8) == [3, 2, 2, 1]
    assert demo_pipeline.starved_layout(2, 4) == [3, 1]
    assert demo_pipeline.starved_layout(3, 7) == [4, 2, 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_pipeline_rebalances_the_starved_stage_and_survives_a_killed_peer(tmp_path):
    plot = tmp_path / "pipeline.png"
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "demo", "pipeline", "--stages", "2",
         "--peers", "4", "--duration", "24", "--kill-at", "0.65", "--rebalance-interval", "3",
         "--no-progress", "--no-monitor", "--plot", str(plot)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert "starting 3/1: the last stage starved" in output
    # the starved stage got a second peer, and a peer of a two-peer stage was killed
    assert re.search(r"stages served by peers \d+(,\d+)? \| \d+,\d+", output), output
    assert summary["killed_peer"] is not None, output
    assert "SIGKILLed; its micro-batches are retried" in output
    assert summary["dropped"] == 0 and summary["micro_batches"] > 20, summary
    assert summary["perplexity_trained"] < summary["perplexity_untrained"], summary
    assert plot.exists() or summary["plot"] == ""
    # nothing left behind: every process it started is gone, its files removed
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]
    assert len(pids) == 5 and not [pid for pid in pids if _alive(pid)], pids
    workdir = re.search(r"files in (\S+)", output).group(1)
    assert not Path(workdir).exists()
