"""Picking and printing this peer's addresses (``hivemind.utils.networking``).

Works on multiaddrs as :class:`swarmgrad.net.Multiaddr` objects or their strings
(``/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...``), so it needs nothing from the net layer.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from typing import Any

from swarmgrad.utils.logging import TextStyle

__all__ = ["LOCALHOST", "choose_ip_address", "log_visible_maddrs"]

LOCALHOST = "127.0.0.1"

logger = logging.getLogger(__name__)


def _components(maddr: Any) -> dict[str, str]:
    parts = str(maddr).strip("/").split("/")
    return {parts[i]: parts[i + 1] for i in range(0, len(parts) - 1, 2)}


def choose_ip_address(
    maddrs: Sequence[Any],
    prefer_global: bool = True,
    protocol_priority: Sequence[str] = ("ip4", "ip6"),
) -> str:
    """The IP address to announce among ``maddrs``: a global one first (unless
    ``prefer_global=False``), IPv4 before IPv6 (``protocol_priority``).
    ``ValueError`` naming the multiaddrs when none has an IP address."""
    for need_global in (prefer_global, not prefer_global):
        for protocol in protocol_priority:
            for maddr in maddrs:
                address = _components(maddr).get(protocol)
                if address is not None and ipaddress.ip_address(address).is_global == need_global:
                    return address
    raise ValueError(f"no IP address among the multiaddrs {[str(m) for m in maddrs]}")


def log_visible_maddrs(visible_maddrs: Sequence[Any], only_p2p: bool) -> None:
    """Log the ``--initial_peers`` others should use to join through this peer: its
    multiaddrs on the preferred IP address (or, with ``only_p2p``, ``/p2p/<PeerID>``)."""
    if only_p2p:
        peer_ids = dict.fromkeys(_components(m).get("p2p") for m in visible_maddrs)
        initial_peers = " ".join(f"/p2p/{p}" for p in peer_ids if p)
    else:
        with_ip = [m for m in visible_maddrs if {"ip4", "ip6"} & set(_components(m))]
        if with_ip:
            preferred = choose_ip_address(with_ip)
            selected = [m for m in visible_maddrs if preferred in str(m)]
        else:
            selected = list(visible_maddrs)
        initial_peers = " ".join(str(m) for m in selected)
    logger.info(
        "Running a DHT instance. To connect other peers to this one, use "
        f"{TextStyle.BOLD}{TextStyle.BLUE}--initial_peers {initial_peers}{TextStyle.RESET}"
    )
    logger.info("Full list of visible multiaddresses: %s", " ".join(map(str, visible_maddrs)))
