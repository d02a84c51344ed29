"""hivemind keywords that only configure libp2p: accepted, warned about, ignored.

``P2P.create`` and ``DHT(...)`` take every keyword hivemind's do. Those with a swarmgrad
meaning are honoured where they are taken; the ones below only tune libp2p (its NAT
traversal, transports, daemon), which swarmgrad does not run. A value other than
hivemind's default gets one warning naming the option and what swarmgrad does instead.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["LIBP2P_ONLY_OPTIONS", "warn_libp2p_only_options"]

# Options of hivemind's P2P.create that only configure libp2p, with what swarmgrad does
# instead; a non-default value is accepted with one warning per option.
LIBP2P_ONLY_OPTIONS: dict[str, tuple[Any, str]] = {
    "auto_nat": (
        True,
        "no_listen says whether we are reachable; relays serve peers behind NAT",
    ),
    "conn_manager": (True, "the peer keeps one connection per peer and closes idle ones itself"),
    "dht_mode": ("server", "swarmgrad's DHT takes client_mode= on DHT/DHTNode"),
    "force_reachability": (None, "pass no_listen=True for a peer that cannot be reached"),
    "idle_timeout": (30, "there is no daemon to stop; connections close after their own idle time"),
    "nat_port_map": (True, "no UPnP/NAT-PMP; use announce_maddrs or relays"),
    "relay_hop_limit": (0, "relayed streams always take one hop"),
    "tls": (True, "connections always use TLS 1.3 authenticated by the peer's ed25519 key"),
    "use_auto_relay": (False, "pass the relays as trusted_relays="),
    "use_ipfs": (False, "no IPFS bootstrap: pass initial_peers"),
    "quic": (None, "TCP only"),
    "use_relay_discovery": (None, "pass the relays as trusted_relays="),
    "check_if_identity_free": (True, "not checked: run one peer per identity file"),
}


def warn_libp2p_only_options(options: dict[str, Any], *, where: str = "P2P.create") -> None:
    """One warning for each libp2p-only option given a value other than hivemind's
    default, naming it and what swarmgrad does instead."""
    for name, value in options.items():
        default, instead = LIBP2P_ONLY_OPTIONS[name]
        if value != default:
            warnings.warn(
                f"{where}: {name}={value!r} only configures libp2p and is ignored by "
                f"swarmgrad ({instead})",
                UserWarning,
                stacklevel=3,
            )
