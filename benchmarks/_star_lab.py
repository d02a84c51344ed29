"""A star of network namespaces for benchmarks: N hosts, each behind its own shaped link
to a hub namespace that bridges them (see /work/shared/NETLAB.md).

::

    host0 10.79.0.10 --tbf--+
    host1 10.79.0.11 --tbf--+-- hub (bridge, 10.79.0.1)
    ...                     |

Each host's veth is shaped with ``tc tbf`` in both directions (its upload on the host
side, its download on the hub side), so a host's link is what a home or cloud uplink of
that rate would be. The hub runs unshaped services (a bootstrap peer). Bytes a host sent
are read from its veth's counters. Names are unique to this process (and to ``prefix``);
:meth:`close` deletes every namespace it made (and with them the veths), even after a
partial setup. ``subnet`` (the first three octets) keeps a user's addresses apart from
other labs'; rates can be changed (:meth:`set_rate`) and links taken down
(:meth:`set_link`) while processes run.

TCP congestion control: every namespace of the lab uses ``congestion_control``
(``LAB_CC`` in the environment, default ``cubic``, Linux's default). A new namespace
otherwise inherits the machine's choice, and this machine's image chose ``bbr``: a lab
would then measure an image's tuning, not the Linux a user most likely runs. The choice
matters: on 100 Mbit/s tbf links, our all-reduce (three connections per uplink at four
peers) took 10.25 s under bbr and 8.23 s under cubic in the same minute, gloo's ring (one
connection per direction) 8.25 and 8.20 s; see ``docs/reproductions.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

HUB_ADDR = "10.79.0.1"
_TIMEOUT = 10.0


def default_congestion_control() -> str:
    """The lab's TCP congestion control: ``LAB_CC`` if set, else cubic (see above)."""
    return os.environ.get("LAB_CC", "cubic")


_SYSCTL = "/proc/sys/net/ipv4/"


def _allow_congestion_control(algorithm: str) -> None:
    """Add ``algorithm`` to the machine's allowed list when the kernel has it: a network
    namespace may only pick an allowed one, and some images allow only theirs (one
    allowed "reno bbr" while cubic was available: the lab failed with EPERM)."""
    with open(_SYSCTL + "tcp_allowed_congestion_control") as f:
        allowed = f.read().split()
    with open(_SYSCTL + "tcp_available_congestion_control") as f:
        available = f.read().split()
    if algorithm in allowed:
        return
    if algorithm not in available:
        raise RuntimeError(
            f"TCP congestion control {algorithm!r} is not in this kernel "
            f"(available: {' '.join(available)}); set LAB_CC to one of them"
        )
    with open(_SYSCTL + "tcp_allowed_congestion_control", "w") as f:
        f.write(" ".join([*allowed, algorithm]))


def set_congestion_control(namespace: str, algorithm: str) -> None:
    """Make ``algorithm`` the TCP congestion control of new sockets in ``namespace``."""
    _allow_congestion_control(algorithm)
    _run(f"ip netns exec {namespace} sysctl -qw net.ipv4.tcp_congestion_control={algorithm}")


def lab_unavailable_reason() -> str | None:
    """Why a lab cannot be built here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"sgprobe{os.getpid()}"
    try:
        _run(f"ip netns add {name}")
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    _run(f"ip netns delete {name}", check=False)
    return None


def _bits_per_second(rate: str) -> int:
    """``"100mbit"`` -> 100_000_000 (tc's decimal units)."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate {rate!r}: expected a number followed by gbit, mbit or kbit")


def _run(command: str, check: bool = True) -> str:
    done = subprocess.run(
        command.split(), capture_output=True, text=True, timeout=_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"`{command}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class StarLab:
    """``StarLab(hosts=4, rate="20mbit")``; use as a context manager."""

    def __init__(
        self,
        hosts: int,
        rate: str | Sequence[str] | None,
        *,
        prefix: str = "sg",
        subnet: str = "10.79.0",
        congestion_control: str | None = None,
    ):
        self.tag = str(os.getpid())
        self.congestion_control = congestion_control or default_congestion_control()
        self.hub = f"{prefix}hub{self.tag}"
        self.hosts = [f"{prefix}h{i}x{self.tag}" for i in range(hosts)]
        self.hub_addr = f"{subnet}.1"
        self.addresses = [f"{subnet}.{10 + i}" for i in range(hosts)]
        rates = [rate] * hosts if rate is None or isinstance(rate, str) else list(rate)
        if len(rates) != hosts:
            raise ValueError(f"{len(rates)} rates for {hosts} hosts")
        self.rates = rates
        self._made: list[str] = []

    def __enter__(self) -> StarLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _namespace(self, name: str) -> None:
        _run(f"ip netns add {name}")
        self._made.append(name)
        _run(f"ip -n {name} link set lo up")
        set_congestion_control(name, self.congestion_control)

    def _build(self) -> None:
        self._namespace(self.hub)
        _run(f"ip -n {self.hub} link add br0 type bridge")
        _run(f"ip -n {self.hub} addr add {self.hub_addr}/24 dev br0")
        _run(f"ip -n {self.hub} link set br0 up")
        for i, (ns, address, rate) in enumerate(
            zip(self.hosts, self.addresses, self.rates, strict=True)
        ):
            self._namespace(ns)
            _run(f"ip -n {ns} link add eth0 type veth peer name p{i} netns {self.hub}")
            _run(f"ip -n {ns} addr add {address}/24 dev eth0")
            _run(f"ip -n {ns} link set eth0 up")
            _run(f"ip -n {self.hub} link set p{i} master br0")
            _run(f"ip -n {self.hub} link set p{i} up")
            if rate is not None:
                self.set_rate(i, rate, replace=False)

    def set_rate(self, host: int, rate: str | None, *, replace: bool = True) -> None:
        """Shape host ``host``'s link to ``rate`` (tc syntax, e.g. ``"100mbit"``) both ways;
        None removes the shaping."""
        for where, dev in ((self.hosts[host], "eth0"), (self.hub, f"p{host}")):
            if rate is None:
                _run(f"tc -n {where} qdisc del dev {dev} root", check=False)
                continue
            # burst: at least one 64 KB TSO segment, and 1 ms of the rate so that a fast
            # link is not held back by the timer's granularity
            burst = max(64 * 1024, _bits_per_second(rate) // 8 // 1000)
            verb = "replace" if replace else "add"
            _run(
                f"tc -n {where} qdisc {verb} dev {dev} root tbf rate {rate} "
                f"burst {burst} latency 100ms"
            )
        self.rates[host] = rate

    def set_link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link down (its hub end: the host sees nothing, packets to
        and from it vanish) or bring it back up."""
        _run(f"ip -n {self.hub} link set p{host} {'up' if up else 'down'}")

    def exec_prefix(self, host: int | None) -> list[str]:
        """The command prefix that runs a process inside host ``host`` (None: the hub)."""
        ns = self.hub if host is None else self.hosts[host]
        return ["ip", "netns", "exec", ns]

    def tx_bytes(self, host: int) -> int:
        """Bytes host ``host`` has sent on its link so far."""
        out = _run(f"ip -n {self.hosts[host]} -j -s link show eth0")
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def tx_bytes_all(self) -> list[int]:
        """Bytes every host has sent so far, read in one snapshot: what the hub's end of
        each veth received. For rates over short windows: reading the hosts one after
        another (one ``ip`` each) took up to a few hundred milliseconds on a busy
        machine, so a window's two readings were further apart than their timestamps
        said and a steady stream looked faster than it was."""
        out = json.loads(_run(f"ip -n {self.hub} -j -s link show"))
        received = {link["ifname"]: int(link["stats64"]["rx"]["bytes"]) for link in out}
        return [received[f"p{i}"] for i in range(len(self.hosts))]

    def close(self) -> None:
        for ns in reversed(self._made):
            _run(f"ip netns delete {ns}", check=False)
        self._made.clear()
