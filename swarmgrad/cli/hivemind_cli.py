"""``hivemind-dht`` and ``hivemind-server``: hivemind's command names and flags.

Launch scripts written for hivemind run unchanged against swarmgrad:

- ``hivemind-dht`` takes ``hivemind_cli/run_dht.py``'s flags (``--initial_peers``,
  ``--host_maddrs``, ``--announce_maddrs``, ``--identity_path``, ``--use_ipfs``,
  ``--no_relay``, ``--use_auto_relay``, ``--refresh_period``) and logs, as hivemind does,
  ``--initial_peers <multiaddrs>`` for others to join with;
- ``hivemind-server`` is ``swarmgrad server``, which takes every ``run_server.py`` flag in
  hivemind's spelling (``--expert_cls``, ``--num_experts``, ...; see
  :mod:`swarmgrad.cli.server_command`), ``--no_relay`` and ``--use_auto_relay`` included.

The relay flags map to swarmgrad's relays and ``--use_ipfs`` (libp2p only) is accepted
with one warning saying what swarmgrad does instead (:mod:`swarmgrad.net.libp2p_options`).
Installed as console scripts by ``pip install swarmgrad``; also runnable as
``python -m swarmgrad.cli.hivemind_cli dht|server [flags]``. (A real hivemind installed
in the same environment installs scripts with these names too: the last install wins.)
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

logger = logging.getLogger("swarmgrad.cli.hivemind_dht")


def dht_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hivemind-dht",
        description="Run a DHT peer that others join through (hivemind's run_dht flags).",
    )
    parser.add_argument(
        "--initial_peers", nargs="*", help="multiaddrs of peers already in the swarm"
    )
    parser.add_argument(
        "--host_maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        help="multiaddrs to listen on (default: all IPv4 interfaces, a free TCP port)",
    )
    parser.add_argument(
        "--announce_maddrs", nargs="*", help="multiaddrs to announce instead (behind NAT)"
    )
    parser.add_argument(
        "--use_ipfs", action="store_true", help="libp2p only: accepted, with a warning"
    )
    parser.add_argument(
        "--identity_path", help="ed25519 key file (created if missing): a stable PeerID"
    )
    parser.add_argument(
        "--no_relay",
        action="store_false",
        dest="use_relay",
        help="do not use relays (a client-mode peer then cannot be called by others)",
    )
    parser.add_argument(
        "--use_auto_relay",
        action="store_true",
        help="reach others through relays among the initial peers when behind NAT",
    )
    parser.add_argument(
        "--refresh_period", type=int, default=30, help="seconds between status log lines"
    )
    return parser


def dht_main(argv: list[str] | None = None) -> int:
    """The ``hivemind-dht`` command."""
    args = dht_parser().parse_args(argv)
    from swarmgrad.dht import DHT
    from swarmgrad.utils.errors import SwarmgradError
    from swarmgrad.utils.logging import use_hivemind_log_handler
    from swarmgrad.utils.networking import log_visible_maddrs

    use_hivemind_log_handler("in_root_logger")
    try:
        dht = DHT(
            start=True,
            initial_peers=args.initial_peers,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            use_ipfs=args.use_ipfs,
            identity_path=args.identity_path,
            use_relay=args.use_relay,
            use_auto_relay=args.use_auto_relay,
        )
    except (SwarmgradError, OSError, ValueError) as e:
        print(f"hivemind-dht: could not start: {e}", file=sys.stderr, flush=True)
        return 1
    log_visible_maddrs(dht.get_visible_maddrs(), only_p2p=args.use_ipfs)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("caught signal %d (%s), shutting down", signum, signal.strsignal(signum))
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        while not stop.wait(args.refresh_period):
            node = dht.node
            logger.info(
                "%d DHT nodes (including this one) are in the local routing table",
                len(node.routing) + 1,
            )
            logger.info("Local storage contains %d keys", len(node.storage))
    finally:
        dht.shutdown()
    return 0


def server_main(argv: list[str] | None = None) -> int:
    """The ``hivemind-server`` command: ``swarmgrad server`` with hivemind's flags."""
    from swarmgrad.cli.main import main

    return main(["server", *(sys.argv[1:] if argv is None else argv)])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("dht", "server"):
        print("usage: python -m swarmgrad.cli.hivemind_cli {dht|server} [flags]", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    return dht_main(rest) if command == "dht" else server_main(rest)


if __name__ == "__main__":
    sys.exit(main())
