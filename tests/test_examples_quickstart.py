"""examples/quickstart.py runs as written against a real ``swarmgrad server`` process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.py")


@pytest.mark.slow
def test_quickstart_trains_through_remote_experts_and_a_moe_layer():
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--start-server"], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [
        float(line.split("loss ")[1]) for line in result.stdout.splitlines() if "loss " in line
    ]
    assert len(losses) == 6 and losses[-1] < losses[0], result.stdout
    assert "mixture-of-experts output (3, 512)" in result.stdout
