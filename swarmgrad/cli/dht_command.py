"""``swarmgrad dht``: a long-running DHT peer that others bootstrap from and relay through.

It prints the multiaddrs others should pass as ``--initial-peers``, logs the routing table
and storage sizes periodically, and shuts down cleanly on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging

from swarmgrad.cli.common import add_command, stop_on_signals
from swarmgrad.utils.logging import use_swarmgrad_log_handler

logger = logging.getLogger("swarmgrad.cli.dht")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = add_command(commands, "dht", help="run a bootstrap / relay DHT peer", doc=__doc__)
    parser.add_argument(
        "--initial-peers",
        "--initial_peers",
        nargs="*",
        default=[],
        help="multiaddrs of peers already in the swarm (none: start a new swarm)",
    )
    parser.add_argument(
        "--host-maddrs",
        "--host_maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/31337"],
        help="addresses to listen on (default /ip4/0.0.0.0/tcp/31337; tcp/0 picks a port)",
    )
    parser.add_argument(
        "--announce-maddrs",
        "--announce_maddrs",
        nargs="*",
        default=[],
        help="public addresses to advertise instead of the listening ones (e.g. behind NAT)",
    )
    parser.add_argument(
        "--identity-path",
        "--identity_path",
        default=None,
        help="file with this peer's ed25519 key (created if missing) so its PeerID persists",
    )
    parser.add_argument(
        "--no-relay",
        "--no_relay",
        action="store_true",
        help="refuse to relay for client-mode peers",
    )
    parser.add_argument(
        "--refresh-period",
        "--refresh_period",
        type=float,
        default=30.0,
        help="seconds between status log lines",
    )
    add_admission_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    parser.set_defaults(run=run)


def add_admission_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--authority-key`` and ``--access-token``, shared by the commands that start a peer."""
    parser.add_argument(
        "--authority-key",
        "--authority_key",
        default=None,
        help="admit only peers with tokens from this authority (its public key 12D3KooW..., "
        "or a file holding it, e.g. authority.pub); none: an open swarm",
    )
    parser.add_argument(
        "--access-token",
        "--access_token",
        default=None,
        help="this peer's token file (from swarmgrad authority issue), re-read to renew",
    )


def admission_kwargs(authority_key: str | None, access_token: str | None) -> dict:
    """DHT keyword arguments for the admission flags (none for an open swarm)."""
    if authority_key is None:
        if access_token is not None:
            raise ValueError("--access-token needs --authority-key")
        return {}
    return {"authority": authority_key, "access_token": access_token}


def run(args: argparse.Namespace) -> int:
    from swarmgrad.dht import DHT
    from swarmgrad.utils.errors import SwarmgradError

    use_swarmgrad_log_handler(args.log_level.upper())
    stop = stop_on_signals()
    try:
        dht = DHT(
            initial_peers=args.initial_peers,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            identity_path=args.identity_path,
            allow_relay=not args.no_relay,
            start=True,
            **admission_kwargs(args.authority_key, args.access_token),
        )
    except (SwarmgradError, OSError, ValueError) as e:
        print(f"swarmgrad dht: could not start: {e}", flush=True)
        return 1
    try:
        addresses = " ".join(str(m) for m in dht.get_visible_maddrs())
        print(f"Running a DHT peer. To join, use --initial-peers {addresses}", flush=True)
        for maddr in dht.get_visible_maddrs():
            print(f"  {maddr}", flush=True)
        while not stop.wait(args.refresh_period):
            node = dht.node
            logger.info(
                "routing table: %d peers, storage: %d keys, cache: %d keys, connections: %d",
                len(node.routing),
                len(node.storage),
                len(node.cache),
                len(dht.peer.connected_peers),
            )
    finally:
        print("Shutting down", flush=True)
        dht.shutdown()
    return 0
