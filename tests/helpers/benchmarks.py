"""Running a script of ``benchmarks/`` as its own process, as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(
    name: str, env: dict[str, str], timeout: float, *args: str
) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<name>`` with ``args`` under ``env``; it must exit 0 (else its
    stderr's tail is the failure message)."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
