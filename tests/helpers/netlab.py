"""Network-lab helpers: namespaces joined by veth pairs, a NAT router, and peer processes
that run inside a namespace and report over stdout lines.

Layout of :func:`nat_lab` (see /work/shared/NETLAB.md)::

    pub 10.77.1.2 --- r (wan 10.77.1.1 | lan 10.77.2.1, masquerade out of wan) --- home 10.77.2.2

``home`` can dial ``pub`` (its connections arrive from 10.77.1.1); ``pub`` has no route to
``home`` at all. Every name is unique to the calling process, so parallel runs don't clash,
and :meth:`NetLab.close` deletes whatever was created even after a partial setup.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import pytest

PUB_ADDR, ROUTER_WAN_ADDR, ROUTER_LAN_ADDR, HOME_ADDR = (
    "10.77.1.2",
    "10.77.1.1",
    "10.77.2.1",
    "10.77.2.2",
)
COMMAND_TIMEOUT = 10.0
_counter = itertools.count()


def skip_unless_netlab_possible() -> None:
    """Skip (with the reason) where namespaces or NAT cannot be built."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network lab needs Linux network namespaces")
    if os.geteuid() != 0:
        pytest.skip("network lab needs root (ip netns add)")
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            pytest.skip(f"network lab needs `{tool}` (nftables / iproute2), not installed")


def run(command: str, stdin: str | None = None) -> str:
    """Run one setup command (split on spaces); raise with its stderr if it fails."""
    done = subprocess.run(
        command.split(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{command}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class NetLab:
    """Namespaces created by a test; :meth:`close` kills their processes and deletes them."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.tag = f"{os.getpid()}x{next(_counter)}"
        self.namespaces: list[str] = []
        self.processes: list[LabProcess] = []
        self.pub = self.router = self.home = ""  # set by nat_lab

    def add_namespace(self, role: str) -> str:
        name = f"sg{role}{self.tag}"
        try:
            run(f"ip netns add {name}")
        except RuntimeError as e:
            pytest.skip(f"cannot create network namespaces here: {e}")
        self.namespaces.append(name)
        run(f"ip -n {name} link set lo up")
        return name

    def veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        """A veth pair from ``ns_a/if_a`` to ``ns_b/if_b``, created inside the namespaces
        (never in the root one, where fixed names would clash between parallel runs)."""
        run(f"ip -n {ns_a} link add {if_a} type veth peer name {if_b} netns {ns_b}")

    def address(self, ns: str, interface: str, cidr: str) -> None:
        run(f"ip -n {ns} addr add {cidr} dev {interface}")
        run(f"ip -n {ns} link set {interface} up")

    def spawn(self, ns: str, name: str, argv: Sequence[str]) -> LabProcess:
        """Start ``python argv...`` inside ``ns``, importing this checkout of swarmgrad."""
        repo = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        process = LabProcess(
            name,
            ["ip", "netns", "exec", ns, sys.executable, *argv],
            self.workdir / f"{name}-{self.tag}.stderr",
            env,
        )
        self.processes.append(process)
        return process

    def report(self) -> None:
        """Print every process's stack (processes that ``faulthandler.register(SIGUSR1)``)
        and stderr tail; pytest shows it with the failure."""
        for process in self.processes:
            process.dump_stacks(timeout=2.0)
        for process in self.processes:
            print(f"----- {process.name} (exit code {process.proc.poll()}) stderr tail -----")
            print(process.stderr_tail())

    def close(self) -> None:
        for process in self.processes:
            process.kill()
        for ns in reversed(self.namespaces):
            # Deleting a namespace also deletes the veth ends inside it (and their peers).
            subprocess.run(
                ["ip", "netns", "delete", ns],
                capture_output=True,
                timeout=COMMAND_TIMEOUT,
                check=False,
            )
        self.namespaces.clear()


@contextlib.contextmanager
def nat_lab(workdir: Path, *, shape_pub: str | None = "100mbit"):
    """Build the pub / r / home layout (optionally a ``tbf`` qdisc on pub's link) and tear it
    down on exit, whatever happened inside."""
    skip_unless_netlab_possible()
    lab = NetLab(workdir)
    try:
        pub, router, home = (lab.add_namespace(role) for role in ("pub", "r", "home"))
        lab.pub, lab.router, lab.home = pub, router, home
        lab.veth(pub, "eth0", router, "wan")
        lab.veth(home, "eth0", router, "lan")
        lab.address(pub, "eth0", f"{PUB_ADDR}/24")
        lab.address(router, "wan", f"{ROUTER_WAN_ADDR}/24")
        lab.address(router, "lan", f"{ROUTER_LAN_ADDR}/24")
        lab.address(home, "eth0", f"{HOME_ADDR}/24")
        run(f"ip -n {home} route add default via {ROUTER_LAN_ADDR}")
        run(f"ip netns exec {router} sysctl -qw net.ipv4.ip_forward=1")
        ruleset = (
            "table ip nat {\n"
            "  chain post {\n"
            "    type nat hook postrouting priority 100;\n"
            '    oifname "wan" masquerade;\n'
            "  }\n"
            "}\n"
        )
        run(f"ip netns exec {router} nft -f -", stdin=ruleset)
        if shape_pub:
            run(
                f"ip netns exec {pub} tc qdisc add dev eth0 root tbf"
                f" rate {shape_pub} burst 256kbit latency 50ms"
            )
        yield lab
    except BaseException:
        lab.report()
        raise
    finally:
        lab.close()


class LabProcess:
    """A process whose stdout speaks in lines ``TAG {json}``; stderr goes to a file that
    failure messages quote."""

    def __init__(self, name: str, argv: list[str], stderr_path: Path, env: dict[str, str]):
        self.name = name
        self.stderr_path = stderr_path
        self._stderr: IO[bytes] = open(stderr_path, "wb")  # closed in kill()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def stderr_tail(self, limit: int = 4000) -> str:
        self._stderr.flush()
        text = self.stderr_path.read_text(errors="replace")
        return text[-limit:]

    def expect(self, tag: str, timeout: float) -> Any:
        """Wait up to ``timeout`` s for a ``TAG {json}`` line; return the decoded payload.
        Other lines are kept for the failure message."""
        deadline = time.monotonic() + timeout
        other: list[str] = []
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                self._lines.put(None)  # later expects see the end too
                code = self.proc.wait(timeout=COMMAND_TIMEOUT)
                raise AssertionError(
                    f"{self.name} exited with code {code} before printing {tag}; "
                    f"stdout {other}; stderr:\n{self.stderr_tail()}"
                )
            head, _, payload = line.partition(" ")
            if head == tag:
                return json.loads(payload) if payload else None
            other.append(line)
        raise AssertionError(
            f"{self.name} printed no {tag} line within {timeout} s; stdout {other}; "
            f"stderr:\n{self.stderr_tail()}"
        )

    def dump_stacks(self, timeout: float) -> None:
        """Ask a live process for a faulthandler dump; wait (bounded) until it is written."""
        if self.proc.poll() is not None:
            return
        before = self.stderr_path.stat().st_size
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with open(self.stderr_path, "rb") as f:
                f.seek(before)
                if b"most recent call first" in f.read():
                    return
            time.sleep(0.05)  # polling a file another process writes: no event to wait on

    def stop(self, timeout: float) -> int:
        """Close stdin (the processes' signal to shut down) and wait for the exit code."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout} s of being told to stop; "
                f"stderr:\n{self.stderr_tail()}"
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=COMMAND_TIMEOUT)
        self._reader.join(timeout=COMMAND_TIMEOUT)  # the pipe ends with the process
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        self._stderr.close()
