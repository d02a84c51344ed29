"""``swarmgrad demo moe`` end to end: real processes, a SIGKILLed expert server, accuracy."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_trains_through_remote_experts_and_survives_a_killed_server():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmgrad.cli.main",
            "demo",
            "moe",
            "--epochs",
            "3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "killed expert server 3 (SIGKILL)" in output
    assert "training went on with 2 servers" in output
    accuracy = float(re.search(r"Test accuracy: ([\d.]+)%", output).group(1))
    assert accuracy > 80.0, output
