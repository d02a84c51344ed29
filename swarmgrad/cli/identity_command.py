"""``swarmgrad identity``: peer identity files.

``swarmgrad identity import HIVEMIND_FILE NEW_FILE`` converts a hivemind identity file
(an RSA key) into a swarmgrad identity (ed25519) that stays the same on every import, and
writes ``NEW_FILE.hivemind-alias.json``, which proves that the new PeerID belongs to the
peer hivemind knew by the old one (see :mod:`swarmgrad.net.hivemind_identity`).
``swarmgrad identity show FILE`` prints the PeerID of an identity file.
"""

from __future__ import annotations

import argparse
import sys

from swarmgrad.cli.common import EXIT_FAILED, EXIT_OK, add_command


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands, "identity", help="peer identity files (import a hivemind identity)", doc=__doc__
    )
    actions = parser.add_subparsers(dest="action", required=True)
    imp = actions.add_parser("import", help="convert a hivemind identity file")
    imp.add_argument("source", help="the hivemind identity file (its identity_path)")
    imp.add_argument("destination", help="the swarmgrad identity file to write")
    imp.add_argument("--force", action="store_true", help="replace another identity there")
    imp.set_defaults(run=run_import)
    show = actions.add_parser("show", help="print the PeerID of an identity file")
    show.add_argument("path")
    show.set_defaults(run=run_show)


def run_import(args: argparse.Namespace) -> int:
    from swarmgrad.net.hivemind_identity import ALIAS_SUFFIX, import_hivemind_identity
    from swarmgrad.utils.errors import SwarmgradError

    try:
        identity, alias = import_hivemind_identity(args.source, args.destination, force=args.force)
    except SwarmgradError as e:
        print(f"swarmgrad identity import: {e}", file=sys.stderr)
        return EXIT_FAILED
    if alias is None:
        print(f"imported the Ed25519 identity {identity.peer_id} into {args.destination}")
    else:
        print(
            f"imported hivemind identity {alias.hivemind_peer_id} as {identity.peer_id} "
            f"into {args.destination} (alias proof: {args.destination}{ALIAS_SUFFIX})"
        )
    return EXIT_OK


def run_show(args: argparse.Namespace) -> int:
    from swarmgrad.net.identity import Identity
    from swarmgrad.utils.errors import SwarmgradError

    try:
        print(Identity.load(args.path).peer_id)
    except SwarmgradError as e:
        print(f"swarmgrad identity show: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
