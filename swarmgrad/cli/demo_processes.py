"""Child processes of the demos: each a ``swarmgrad`` command whose stdout is read line by
line on a thread, stopped politely (SIGTERM), then firmly (SIGKILL) if it lingers."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO

__all__ = ["ChildProcess", "spawn", "stop_all"]

_MADDR = re.compile(r"(/ip4/\S+/p2p/\S+)")


@dataclass
class ChildProcess:
    """A child swarmgrad process; ``lines`` receives its stdout lines, then None at EOF."""

    name: str
    popen: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    tail: list[str] = field(default_factory=list)
    log: IO | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def start_reader(self) -> None:
        def read() -> None:
            for line in self.popen.stdout:
                self.lines.put(line)
                self.tail = [*self.tail[-19:], line]
            self.lines.put(None)

        threading.Thread(target=read, name=f"demo-{self.name}-stdout", daemon=True).start()

    def wait_for_maddr(self, timeout: float) -> str:
        """The first /ip4/.../p2p/... address the process prints."""
        return self.wait_for(_MADDR, timeout, "no address")

    def wait_for(self, pattern: re.Pattern, timeout: float, what: str) -> str:
        """The first group of the first line of output that matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.popen.wait()} before it was ready; "
                    f"its last output:\n" + "".join(self.tail)
                )
            found = pattern.search(line)
            if found:
                return found.group(1)
        raise RuntimeError(f"{self.name} printed {what} within {timeout:.0f} s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        stop_all([self], sig, timeout)


def spawn(
    name: str, *args: str, log_path: str | None = None, prefix: Sequence[str] = ()
) -> ChildProcess:
    """Start ``swarmgrad ARGS`` with this interpreter; stderr to ``log_path`` if given;
    ``prefix`` runs it through another command (``ip netns exec NS``, which execs it, so
    the process is still ours to signal)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = open(log_path, "w") if log_path else None  # closed by stop_all
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", "swarmgrad.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=log if log is not None else subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # a terminal's Ctrl-C reaches them through us, once
    )
    process = ChildProcess(name, popen, log=log)
    process.start_reader()
    return process


def stop_all(
    processes: Iterable[ChildProcess], sig: int = signal.SIGTERM, timeout: float = 15.0
) -> None:
    """Signal every live process at once, wait up to ``timeout`` for all of them, then
    SIGKILL the rest; every process is reaped before this returns."""
    processes = list(processes)
    for process in processes:
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                process.popen.send_signal(sig)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.popen.kill()
            process.popen.wait()
        if process.log is not None:
            process.log.close()
