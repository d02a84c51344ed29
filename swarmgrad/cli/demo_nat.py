"""A real NAT for the training demo's client-mode trainer (Linux, root, iproute2, nftables).

Layout, built fresh for each demo run and deleted at its end::

    this machine (root namespace)         router namespace                home namespace
    10.78.K.1 --------- veth --------- 10.78.K.2 (wan)  |  (lan) 10.78.K+1.1 --- 10.78.K+1.2

The router forwards and masquerades out of its WAN side, so the trainer in ``home`` can
dial the peers listening on 10.78.K.1 (its connections arrive from 10.78.K.2), while
nothing on this machine can dial it: the situation client mode exists for. ``K`` comes
from the demo's process id, so that demos running at once use different subnets and
interface names. Where the lab cannot be built, :func:`unavailable_reason` says why and
the demo runs its client plainly (``--client-mode`` on loopback).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

__all__ = ["DemoNat", "unavailable_reason"]

_COMMAND_TIMEOUT = 10.0


def unavailable_reason() -> str | None:
    """Why this machine cannot host the demo's NAT, or None if it can (a build can still
    fail; :meth:`DemoNat.create` then gives that reason)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "not root (ip netns needs it)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _run(*command: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


class DemoNat:
    """The namespaces of one demo run; :meth:`close` deletes them (and so the veths)."""

    def __init__(self, tag: int):
        third = 2 * (tag % 120)  # WAN 10.78.third.0/24, LAN the next /24
        self.host_addr = f"10.78.{third}.1"
        self.router_wan_addr = f"10.78.{third}.2"
        self.home_addr = f"10.78.{third + 1}.2"
        self._router_lan_addr = f"10.78.{third + 1}.1"
        self.router, self.home = f"sgdemo{tag}r", f"sgdemo{tag}h"
        self._host_veth = f"sgdemo{tag % 100000}"[:15]
        self._namespaces: list[str] = []

    @classmethod
    def create(cls) -> tuple[DemoNat | None, str]:
        """The lab, or None and the reason it could not be built."""
        reason = unavailable_reason()
        if reason is not None:
            return None, reason
        nat = cls(os.getpid())
        try:
            nat._build()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            nat.close()
            return None, str(e)
        return nat, ""

    def _build(self) -> None:
        for ns in (self.router, self.home):
            _run("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        host, router, home = self._host_veth, self.router, self.home
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", "wan", "netns", router)
        _run("ip", "addr", "add", f"{self.host_addr}/24", "dev", host)
        _run("ip", "link", "set", host, "up")
        _run("ip", "-n", router, "addr", "add", f"{self.router_wan_addr}/24", "dev", "wan")
        _run("ip", "-n", router, "link", "set", "wan", "up")
        _run("ip", "-n", home, "link", "add", "eth0", "type", "veth", "peer", "name", "lan",
             "netns", router)  # fmt: skip
        _run("ip", "-n", router, "addr", "add", f"{self._router_lan_addr}/24", "dev", "lan")
        _run("ip", "-n", router, "link", "set", "lan", "up")
        _run("ip", "-n", home, "addr", "add", f"{self.home_addr}/24", "dev", "eth0")
        _run("ip", "-n", home, "link", "set", "eth0", "up")
        _run("ip", "-n", home, "route", "add", "default", "via", self._router_lan_addr)
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        ruleset = (
            "table ip nat {\n  chain post {\n    type nat hook postrouting priority 100;\n"
            '    oifname "wan" masquerade;\n  }\n}\n'
        )
        _run("ip", "netns", "exec", router, "nft", "-f", "-", stdin=ruleset)

    def command_prefix(self) -> list[str]:
        """What runs a command inside the home namespace."""
        return ["ip", "netns", "exec", self.home]

    def describe(self) -> str:
        return f"behind a NAT ({self.home_addr} -> {self.router_wan_addr})"

    def close(self) -> None:
        """Delete the namespaces (their veths go with them); safe to call twice."""
        for ns in reversed(self._namespaces):
            subprocess.run(
                ["ip", "netns", "delete", ns],
                capture_output=True,
                timeout=_COMMAND_TIMEOUT,
                check=False,
            )
        self._namespaces.clear()
