"""``swarmgrad authority``: the admission authority of a swarm (keys, tokens, revocations).

Typical use, by whoever runs the collaboration::

    swarmgrad authority init                      # writes authority.key and authority.pub
    swarmgrad authority whoami --identity-path me.id     # (on a volunteer's machine)
    swarmgrad authority issue --peer-id 12D3KooW... --role trainer --expires 7d \\
                              --output volunteer.token
    swarmgrad authority revoke --peer-id 12D3KooW... --initial-peers ADDR

Peers then start with ``--authority-key authority.pub --access-token volunteer.token``
(and ``--identity-path me.id``, the identity the token was issued for). A token file is
re-read before the token expires: renewing a peer is writing a new token into its file.

``revoke`` keeps every revocation in a state file next to the key
(``authority.key.revoked.json``), signs the whole list with the next serial number and,
with ``--initial-peers``, publishes it in the swarm's DHT, where peers read it every 20 s.
A list lives 6 days in the DHT (``--lifetime``, at most the DHT's 7 days): run ``revoke
--initial-peers ADDR`` without new entries to publish it again before then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from swarmgrad.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, add_command


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands,
        "authority",
        help="admission authority: keys, access tokens, revocations",
        doc=__doc__,
    )
    actions = parser.add_subparsers(dest="action", required=True)

    def key_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--key", default="authority.key", help="authority key file (default authority.key)"
        )

    init = actions.add_parser("init", help="create the authority key")
    key_option(init)
    init.add_argument("--force", action="store_true", help="overwrite an existing key file")
    init.set_defaults(run=run_init)

    issue = actions.add_parser("issue", help="issue an access token to a peer")
    key_option(issue)
    issue.add_argument("--peer-id", "--peer_id", required=True, help="the peer's PeerID")
    issue.add_argument(
        "--role", default="trainer", choices=["trainer", "server", "monitor"], help="its role"
    )
    issue.add_argument("--expires", default="7d", help="lifetime: 3600, 90m, 12h, 7d, 2w")
    issue.add_argument("--output", "-o", default=None, help="write the token to this file")
    issue.set_defaults(run=run_issue)

    whoami = actions.add_parser("whoami", help="print the PeerID of an identity file")
    whoami.add_argument(
        "--identity-path", "--identity_path", required=True, help="created if missing"
    )
    whoami.set_defaults(run=run_whoami)

    revoke = actions.add_parser("revoke", help="revoke peers or tokens; publish the list")
    key_option(revoke)
    revoke.add_argument("--peer-id", "--peer_id", nargs="*", default=[], help="PeerIDs")
    revoke.add_argument("--token-id", "--token_id", nargs="*", default=[], help="token ids (hex)")
    revoke.add_argument("--token", nargs="*", default=[], help="token files to revoke")
    revoke.add_argument("--state", default=None, help="revocation state file")
    revoke.add_argument("--lifetime", default="6d", help="how long the list lives in the DHT")
    revoke.add_argument(
        "--initial-peers", "--initial_peers", nargs="*", default=[], help="publish via these"
    )
    revoke.add_argument("--output", "-o", default=None, help="also write the signed list here")
    revoke.set_defaults(run=run_revoke)


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"swarmgrad authority: error: {message}", file=sys.stderr, flush=True)
    return code


def _public_key_path(key_path: str) -> Path:
    path = Path(key_path)
    return path.with_suffix(".pub") if path.suffix == ".key" else Path(key_path + ".pub")


def run_init(args: argparse.Namespace) -> int:
    from swarmgrad.net.admission import Authority

    path = Path(args.key)
    if path.exists() and not args.force:
        return _fail(f"{path} exists; pass --force to replace it (every token it issued dies)")
    authority = Authority.generate()
    authority.save(path)
    pub = _public_key_path(args.key)
    pub.write_text(f"{authority.public_key}\n")
    print(f"Authority key written to {path} (keep it secret); public key in {pub}:")
    print(f"  {authority.public_key}")
    print(f"Start peers with --authority-key {pub} (or the key above) and their token.")
    return EXIT_OK


def _load_authority(path: str):
    from swarmgrad.net.admission import Authority

    return Authority.load(path)


def run_issue(args: argparse.Namespace) -> int:
    from swarmgrad.utils.errors import SwarmgradError

    try:
        authority = _load_authority(args.key)
        token = authority.issue(args.peer_id, args.role, args.expires)
    except (SwarmgradError, OSError) as e:
        return _fail(str(e), EXIT_USAGE if isinstance(e, ValueError) else EXIT_FAILED)
    text = token.to_text()
    if args.output:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        print(f"Issued {token.describe()} (token id {token.token_id_hex}) -> {args.output}",
              file=sys.stderr)  # fmt: skip
    print(text, flush=True)
    return EXIT_OK


def run_whoami(args: argparse.Namespace) -> int:
    from swarmgrad.net.identity import Identity
    from swarmgrad.utils.errors import SwarmgradError

    try:
        print(Identity.load_or_create(args.identity_path).peer_id)
    except (SwarmgradError, OSError) as e:
        return _fail(str(e))
    return EXIT_OK


def run_revoke(args: argparse.Namespace) -> int:
    from swarmgrad.net.admission import AccessToken
    from swarmgrad.net.identity import PeerID
    from swarmgrad.utils.errors import SwarmgradError

    state_path = Path(args.state or args.key + ".revoked.json")
    try:
        authority = _load_authority(args.key)
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        peers = set(state.get("peers", []))
        tokens = set(state.get("tokens", []))
        serial = int(state.get("serial", 0)) + 1
        for text in args.peer_id:
            peers.add(str(PeerID.from_base58(text)))
        for text in args.token_id:
            if len(bytes.fromhex(text)) != 16:
                raise ValueError(f"a token id is 32 hex digits, got {text!r}")
            tokens.add(text.lower())
        for path in args.token:
            tokens.add(AccessToken.load(path).token_id_hex)
        revocations = authority.revocation_list(
            peers=[PeerID.from_base58(p) for p in sorted(peers)],
            token_ids=[bytes.fromhex(t) for t in sorted(tokens)],
            serial=serial,
            lifetime=args.lifetime,
        )
    except (SwarmgradError, OSError, ValueError) as e:
        return _fail(str(e), EXIT_USAGE)
    state_path.write_text(
        json.dumps({"serial": serial, "peers": sorted(peers), "tokens": sorted(tokens)}, indent=1)
    )
    if args.output:
        Path(args.output).write_bytes(revocations.encode())
    print(
        f"Revocation list {serial}: {len(peers)} peers, {len(tokens)} tokens (state in "
        f"{state_path})",
        flush=True,
    )
    if not args.initial_peers:
        print("Not published: pass --initial-peers ADDR to publish it in the swarm's DHT.")
        return EXIT_OK
    try:
        stored = publish(authority, revocations, args.initial_peers)
    except (SwarmgradError, OSError) as e:
        return _fail(f"could not publish the list: {e}")
    if not stored:
        return _fail("no DHT peer accepted the list")
    print("Published in the DHT; peers honour it within about 20 s.", flush=True)
    return EXIT_OK


def publish(authority, revocations, initial_peers: list[str]) -> bool:
    """Join the swarm for a moment as a client with a short self-issued server token,
    store the list, leave."""
    from swarmgrad.dht import DHT
    from swarmgrad.dht.revocation import publish_revocations
    from swarmgrad.net.identity import Identity

    identity = Identity.generate()
    token = authority.issue(identity.peer_id, "server", "10m")
    dht = DHT(
        initial_peers=initial_peers,
        client_mode=True,
        use_relay=False,
        identity=identity,
        authority=authority.public_key,
        access_token=token,
        start=True,
    )
    try:
        return dht.run_coroutine(lambda _dht, node: publish_revocations(node, revocations))
    finally:
        dht.shutdown()
