"""``hivemind.utils.networking``'s helper that programs call after starting a DHT.

Minimal here (the hivemind-compatibility branch brings the full module: take that one
when both exist)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["log_visible_maddrs"]

logger = logging.getLogger(__name__)


def log_visible_maddrs(visible_maddrs: Sequence[Any], only_p2p: bool) -> None:
    """Log the ``--initial_peers`` others should pass to join through this peer (with
    ``only_p2p``, only ``/p2p/<PeerID>``, as hivemind prints for IPFS-discovered peers)."""
    if only_p2p:
        peer_ids = dict.fromkeys(str(m).rsplit("/p2p/", 1)[-1] for m in visible_maddrs)
        initial_peers = " ".join(f"/p2p/{p}" for p in peer_ids)
    else:
        initial_peers = " ".join(str(m) for m in visible_maddrs)
    logger.info(
        f"Running a DHT instance. To connect other peers to this one, use "
        f"--initial_peers {initial_peers}"
    )
