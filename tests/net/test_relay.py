"""Relays on loopback: a client-mode peer with no listener is reachable through a relay,
with end-to-end TLS; refusal and relay loss are clear errors."""

from __future__ import annotations

import asyncio

import pytest

from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import Blob
from swarmgrad.utils.errors import ConnectionClosed, PeerUnreachable


async def echo(request, context):
    return {"echo": request, "caller": context.remote_id.to_base58()}


def test_client_mode_peer_is_called_through_a_relay(arun):
    async def main():
        relay = await Peer.create()
        home = await Peer.create(client_mode=True, relays=relay.get_visible_maddrs())
        home.add_handler("echo", echo)
        assert home._listen_maddrs == [], "client mode opens no listener"
        served = sorted(h.name for h in relay.relay_service.rpc_handlers())
        assert served == ["relay.connect", "relay.reserve"]  # raw-stream wire names
        assert [h.name for h in home.relay_client.rpc_handlers()] == ["relay.incoming"]
        (relayed,) = home.get_visible_maddrs()
        assert relayed.is_relayed and relayed.peer_id == home.peer_id
        assert relayed.relay.peer_id == relay.peer_id

        caller = await Peer.create()
        reply = await caller.call(relayed, "echo", "hi", timeout=10)
        assert reply == {"echo": "hi", "caller": caller.peer_id.to_base58()}
        payload = bytes(range(256)) * 16384  # 4 MiB through the relay
        reply = await caller.call(home.peer_id, "echo", Blob(payload), timeout=30)
        assert reply["echo"] == payload
        # the relay only forwarded ciphertext: the connection it made to home carries the
        # caller's stream, but home sees the caller's own identity, proven end to end
        assert caller.is_connected(home.peer_id)
        # and home can call the caller back over the same relayed connection
        caller.add_handler("echo", echo)
        assert (await home.call(caller.peer_id, "echo", 1, timeout=10))["echo"] == 1
        for p in (caller, home, relay):
            await p.shutdown()

    arun(main)


def test_relay_that_refuses_is_a_clear_error(arun):
    async def main():
        relay = await Peer.create(allow_relay=False)
        with pytest.raises(PeerUnreachable, match=r"no relay accepted a reservation.*--no-relay"):
            await Peer.create(
                client_mode=True, relays=relay.get_visible_maddrs(), relay_wait_timeout=1.0
            )
        await relay.shutdown()

    arun(main)


def test_calling_a_peer_without_reservation_names_the_problem(arun):
    async def main():
        relay = await Peer.create()
        caller = await Peer.create()
        home = await Peer.create(client_mode=True, relays=relay.get_visible_maddrs())
        served = sorted(h.name for h in relay.relay_service.rpc_handlers())
        assert served == ["relay.connect", "relay.reserve"]  # raw-stream wire names
        assert [h.name for h in home.relay_client.rpc_handlers()] == ["relay.incoming"]
        (relayed,) = home.get_visible_maddrs()
        await home.shutdown()
        await asyncio.sleep(0.2)
        with pytest.raises(PeerUnreachable, match="no reservation"):
            await caller.call(relayed, "echo", 1, timeout=10)
        await caller.shutdown()
        await relay.shutdown()

    arun(main)


def test_relay_death_fails_relayed_calls_cleanly(arun):
    async def main():
        relay = await Peer.create()
        home = await Peer.create(client_mode=True, relays=relay.get_visible_maddrs())
        release = asyncio.Event()

        async def wait(request, context):
            await release.wait()

        home.add_handler("wait", wait)
        caller = await Peer.create()
        call = asyncio.ensure_future(caller.call(home.get_visible_maddrs()[0], "wait", None))
        await asyncio.sleep(0.3)
        await relay.shutdown()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(call, 10)
        for p in (caller, home):
            await p.shutdown()

    arun(main)
