"""Relays across a real NAT: a client-mode peer in namespace ``home`` (behind a masquerading
router ``r``) cannot be dialed from ``pub`` at all, yet a peer in ``pub`` calls it through a
relay in ``pub``: small requests and a 4 MiB blob, over a link shaped to 100 Mbit/s.
A relay started with ``allow_relay=False`` refuses reservations and circuits by name.

Each peer is a separate process inside its namespace (``ip netns exec``), running the
script below; it reports on stdout with lines ``TAG {json}`` and shuts down cleanly when
its stdin closes. Needs root, iproute2 and nftables; skips cleanly elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmgrad.net.identity import Identity
from tests.helpers.netlab import HOME_ADDR, PUB_ADDR, ROUTER_WAN_ADDR, nat_lab

pytestmark = [pytest.mark.netlab, pytest.mark.timeout(60)]

BLOB_SIZE = 4 * 1024 * 1024
SMALL_REQUEST = {"hello": "from pub", "n": [1, 2.5, "x", None]}
READY_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0

PEER_SCRIPT = r'''
"""One peer of the relay network lab, written out and run by tests/netlab/test_relay.py."""
import argparse
import asyncio
import faulthandler
import hashlib
import json
import logging
import os
import signal
import sys
import time

from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import Blob
from swarmgrad.utils.errors import SwarmgradError


def say(tag, **payload):
    print(tag, json.dumps(payload), flush=True)


async def until_stdin_closes():
    """The test closes our stdin to tell us to shut down."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    try:
        await reader.read()
    finally:
        transport.close()


async def attempt(coro):
    start = time.monotonic()
    try:
        value = await coro
    except SwarmgradError as e:
        return {"error": type(e).__name__, "message": str(e),
                "seconds": time.monotonic() - start}
    return {"error": None, "value": value, "seconds": time.monotonic() - start}


async def relay(args):
    peer = await Peer.create(
        host_maddrs=[f"/ip4/{args.host}/tcp/0"], allow_relay=args.allow_relay
    )

    async def whoami(request, context):  # the caller's address as this relay sees it
        return list(context.stream.conn.remote_address)[:2]

    peer.add_handler("whoami", whoami)
    say("READY", peer_id=str(peer.peer_id), maddrs=[str(m) for m in peer.get_visible_maddrs()])
    await until_stdin_closes()
    await peer.shutdown()
    say("BYE")


async def home(args):
    try:
        peer = await Peer.create(
            client_mode=True, relays=[args.relay], relay_wait_timeout=args.relay_wait
        )
    except SwarmgradError as e:
        say("REFUSED", error=type(e).__name__, message=str(e))
        return

    async def echo(request, context):
        return request

    async def peername(request, context):  # how the call reached us
        return str(context.stream.conn.remote_address)

    peer.add_handler("echo", echo)
    peer.add_handler("peername", peername)
    seen_by_relay = await peer.call(args.relay, "whoami", None, timeout=10)
    say(
        "READY",
        peer_id=str(peer.peer_id),
        maddrs=[str(m) for m in peer.get_visible_maddrs()],
        seen_by_relay=seen_by_relay,
    )
    await until_stdin_closes()
    await peer.shutdown()
    say("BYE")


async def call(args):
    peer = await Peer.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    result = {}
    result["direct"] = await attempt(peer.call(args.direct, "echo", "direct", timeout=5))
    small = json.loads(args.small)
    result["small"] = await attempt(peer.call(args.relayed, "echo", small, timeout=10))
    result["peername"] = await attempt(peer.call(args.relayed, "peername", None, timeout=10))
    big = os.urandom(args.blob_size)  # random, so that any corruption or reordering shows
    reply = await attempt(peer.call(args.relayed, "echo", {"blob": Blob(big)}, timeout=30))
    if reply["error"] is None:
        got = bytes(reply.pop("value")["blob"])
        reply.update(
            size=len(got),
            intact=got == big,
            sha256_sent=hashlib.sha256(big).hexdigest(),
            sha256_received=hashlib.sha256(got).hexdigest(),
        )
    result["blob"] = reply
    home_id = PeerID.from_base58(args.home_id)
    result["by_peer_id"] = await attempt(peer.call(home_id, "echo", "again", timeout=10))
    say("RESULT", **result)
    await peer.shutdown()
    say("BYE")


async def dial(args):
    peer = await Peer.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    result = await attempt(peer.call(args.address, "echo", "hello", timeout=10))
    say("RESULT", **result)
    await peer.shutdown()
    say("BYE")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("relay")
    p.add_argument("--host", required=True)
    p.add_argument("--no-relay", dest="allow_relay", action="store_false")
    p = sub.add_parser("home")
    p.add_argument("--relay", required=True)
    p.add_argument("--relay-wait", type=float, required=True)
    p = sub.add_parser("call")
    p.add_argument("--host", required=True)
    p.add_argument("--direct", required=True)
    p.add_argument("--relayed", required=True)
    p.add_argument("--home-id", required=True)
    p.add_argument("--small", required=True)
    p.add_argument("--blob-size", type=int, required=True)
    p = sub.add_parser("dial")
    p.add_argument("--host", required=True)
    p.add_argument("--address", required=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks on a failure
    logging.basicConfig(
        level=logging.DEBUG, stream=sys.stderr,
        format="%(asctime)s " + args.mode + " %(name)s %(levelname)s %(message)s",
    )
    asyncio.run({"relay": relay, "home": home, "call": call, "dial": dial}[args.mode](args))


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def peer_script(tmp_path: Path) -> str:
    path = tmp_path / "lab_peer.py"
    path.write_text(PEER_SCRIPT)
    return str(path)


def test_peer_behind_nat_is_called_only_through_the_relay(tmp_path: Path, peer_script: str):
    with nat_lab(tmp_path, shape_pub="100mbit") as lab:
        relay = lab.spawn(lab.pub, "relay", [peer_script, "relay", "--host", PUB_ADDR])
        relay_info = relay.expect("READY", READY_TIMEOUT)
        relay_addr = relay_info["maddrs"][0]
        assert relay_addr.startswith(f"/ip4/{PUB_ADDR}/tcp/")

        home = lab.spawn(
            lab.home, "home", [peer_script, "home", "--relay", relay_addr, "--relay-wait", "10"]
        )
        home_info = home.expect("READY", READY_TIMEOUT)
        home_id = home_info["peer_id"]
        # No listener: the only addresses are relayed ones, through our relay.
        relayed = f"{relay_addr}/p2p-circuit/p2p/{home_id}"
        assert home_info["maddrs"] == [relayed]
        # The home peer's connection crossed the NAT: the relay sees the router's address.
        assert home_info["seen_by_relay"][0] == ROUTER_WAN_ADDR

        caller = lab.spawn(
            lab.pub,
            "caller",
            [
                peer_script, "call",
                "--host", PUB_ADDR,
                "--direct", f"/ip4/{HOME_ADDR}/tcp/4242/p2p/{home_id}",
                "--relayed", relayed,
                "--home-id", home_id,
                "--small", json.dumps(SMALL_REQUEST),
                "--blob-size", str(BLOB_SIZE),
            ],
        )  # fmt: skip
        result = caller.expect("RESULT", 30)

        direct = result["direct"]
        assert direct["error"] == "PeerUnreachable", direct
        assert "unreachable" in direct["message"].lower(), direct
        assert direct["seconds"] < 5, f"a direct dial must fail at once, not time out: {direct}"

        assert result["small"]["error"] is None, result["small"]
        assert result["small"]["value"] == SMALL_REQUEST
        relay_id = relay_info["peer_id"]
        assert result["peername"]["error"] is None, result["peername"]
        assert result["peername"]["value"] == f"relayed:{relay_id}"  # came through the relay

        blob = result["blob"]
        assert blob["error"] is None, blob
        assert blob["size"] == BLOB_SIZE
        assert blob["intact"], blob
        assert blob["sha256_sent"] == blob["sha256_received"]
        # The blob crossed pub's 100 Mbit/s tbf at least once (relay -> home): at least
        # 4 MiB * 8 / 1e8 = 0.34 s. A faster transfer would mean it bypassed the shaped link.
        assert blob["seconds"] >= 0.3, blob

        # Later calls by PeerID alone reuse the relayed connection.
        assert result["by_peer_id"]["error"] is None, result["by_peer_id"]
        assert result["by_peer_id"]["value"] == "again"

        for process in (caller, home, relay):
            assert process.stop(STOP_TIMEOUT) == 0, process.stderr_tail()


def test_relay_with_relaying_disabled_refuses_reservations_and_circuits(
    tmp_path: Path, peer_script: str
):
    with nat_lab(tmp_path, shape_pub=None) as lab:
        relay = lab.spawn(
            lab.pub, "norelay", [peer_script, "relay", "--host", PUB_ADDR, "--no-relay"]
        )
        relay_addr = relay.expect("READY", READY_TIMEOUT)["maddrs"][0]

        home = lab.spawn(
            lab.home, "home", [peer_script, "home", "--relay", relay_addr, "--relay-wait", "2"]
        )
        refused = home.expect("REFUSED", READY_TIMEOUT)
        assert refused["error"] == "PeerUnreachable", refused
        assert relay_addr in refused["message"], refused
        assert home.stop(STOP_TIMEOUT) == 0, home.stderr_tail()

        target = Identity.generate().peer_id
        caller = lab.spawn(
            lab.pub,
            "caller",
            [peer_script, "dial", "--host", PUB_ADDR,
             "--address", f"{relay_addr}/p2p-circuit/p2p/{target}"],
        )  # fmt: skip
        circuit = caller.expect("RESULT", 20)
        assert circuit["error"] == "PeerUnreachable", circuit
        assert "relaying is disabled" in circuit["message"], circuit
        assert str(target) in circuit["message"], circuit

        for process in (caller, relay):
            assert process.stop(STOP_TIMEOUT) == 0, process.stderr_tail()


def test_peer_script_is_valid_python():
    """The lab script compiles even where the lab itself is skipped."""
    compile(PEER_SCRIPT, "lab_peer.py", "exec")
