"""Stopping a command-line peer the way a user does, for the end-to-end tests."""

from __future__ import annotations

import signal
import subprocess
import sys


def stop_with_sigterm(
    proc: subprocess.Popen, timeout: float = 60.0, expect_code: int | None = 0
) -> str:
    """SIGTERM ``proc``, wait for it, and return what it still had to say on its pipes.

    A clean shutdown on SIGTERM is part of every command's contract, so the exit code is
    checked (``expect_code=None`` skips that); a process that outlives ``timeout`` is killed
    rather than leaked, and the test fails on the timeout.
    """
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if expect_code is not None:
        assert proc.returncode == expect_code, f"exit code {proc.returncode}, output:\n{output}"
    return output or ""


def last_line_of_python(script: str, timeout: float = 120.0) -> str:
    """Run ``script`` in a fresh interpreter (what a new process imports, nothing this
    test run already has) and return the last line it printed; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]
