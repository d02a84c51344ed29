"""A child process of a benchmark whose stdout speaks JSON lines, read by a thread.

Shared by the benchmarks that start peers as processes (slow_links, dedloc_heterogeneous):
each child runs in a session of its own so that :meth:`kill` takes its whole process
group, imports this checkout of swarmgrad, and prints one JSON object per line (lines
that are not JSON are kept in ``lines`` only).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class JsonLinesProcess:
    """``JsonLinesProcess(argv, log_path, env=None)``: stderr goes to ``log_path`` (or
    nowhere); ``env`` adds variables to this process's environment."""

    def __init__(self, argv: list[str], log_path: Path | None, env: dict | None = None):
        environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), environment.get("PYTHONPATH")])
        )
        self._log = open(log_path, "w") if log_path else None
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log or subprocess.DEVNULL,
            text=True,
            env=environment,
            start_new_session=True,  # killed with its whole process group
        )
        self.lines: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                pass

    def first_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.process.args[-3:]} printed nothing in {timeout} s") from None

    def of_kind(self, kind: str) -> list[dict]:
        """The events printed so far whose ``event`` is ``kind``."""
        return [e for e in list(self.events) if e.get("event") == kind]

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)
        if self._log is not None:
            self._log.close()
