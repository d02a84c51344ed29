"""Roles at the RPC dispatch, on real loopback sockets: a monitor only reads the DHT, a
server uses the DHT but joins no averaging and calls no experts, a trainer does it all."""

from __future__ import annotations

import logging

import pytest

from swarmgrad.dht import protocol
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.admission import Admission, Authority
from swarmgrad.net.identity import Identity
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import AccessDenied, StreamReset
from swarmgrad.utils.timeutils import get_dht_time

AUTHORITY = Authority.generate()


def soon() -> float:
    return get_dht_time() + 600


TRAINER_ONLY = ("averaging.join_group", "averaging.state.manifest", "moe.forward", "moe.info")


async def member(role: str, **node_kwargs) -> tuple[Peer, list[str]]:
    """A peer with a token of ``role`` and handlers recording what they served."""
    identity = Identity.generate()
    admission = Admission(AUTHORITY.public_key, AUTHORITY.issue(identity.peer_id, role))
    peer = await Peer.create(identity=identity, admission=admission)
    served: list[str] = []
    for name in TRAINER_ONLY:

        async def handler(request, context, name=name):
            served.append(name)
            return "ok"

        peer.add_handler(name, handler)
    return peer, served


async def refused_call(caller: Peer, callee: Peer, name: str, caplog) -> None:
    caplog.clear()
    with pytest.raises(AccessDenied) as info:
        await caller.call(callee.peer_id, name, {}, timeout=10)
    role = caller.admission.role.value
    assert f"the {role} token of {caller.peer_id} does not allow calling {name!r}" in str(
        info.value
    )
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(name in m and f"role {role}" in m for m in logged), logged


def test_each_role_calls_only_what_it_may(arun, caplog):
    async def main():
        trainer, trainer_served = await member("trainer")
        server, _ = await member("server")
        monitor, _ = await member("monitor")
        peers = [trainer, server, monitor]
        try:
            address = trainer.get_visible_maddrs()[0]
            for peer in (server, monitor):
                await peer.connect(address)
            for name in TRAINER_ONLY:
                await refused_call(monitor, trainer, name, caplog)
                await refused_call(server, trainer, name, caplog)
            assert trainer_served == []
            # the refusals closed nothing: the same connections carry allowed calls
            for name in TRAINER_ONLY:
                assert await trainer.call(server.peer_id, name, {}, timeout=10) == "ok"
            assert all(p.is_connected(trainer.peer_id) for p in (server, monitor))
        finally:
            for peer in peers:
                await peer.shutdown()

    arun(main)


def test_raw_protocols_are_checked_too(arun, caplog):
    async def main():
        trainer, _ = await member("trainer")
        monitor, _ = await member("monitor")
        reached = []

        async def raw(stream):
            reached.append(stream)
            await stream.write(b"hi", fin=True)

        trainer.add_protocol_handler("averaging.aggregate_part", raw)
        try:
            await monitor.connect(trainer.get_visible_maddrs()[0])
            stream = await monitor.open_stream(trainer.peer_id, "averaging.aggregate_part")
            await stream.close_write()
            with pytest.raises(StreamReset, match="access denied: the monitor token"):
                await stream.readexactly(2)
            assert reached == []
        finally:
            await monitor.shutdown()
            await trainer.shutdown()

    arun(main)


def test_monitor_reads_the_dht_but_cannot_store(arun, caplog):
    async def main():
        trainer, _ = await member("trainer")
        monitor, _ = await member("monitor")
        nodes = []
        try:
            first = await DHTNode.create(trainer)
            nodes.append(first)
            address = trainer.get_visible_maddrs()[0]
            reader = await DHTNode.create(monitor, [address])
            nodes.append(reader)
            assert await first.store("news", "fresh", soon())
            found = await reader.get("news", latest=True)
            assert found is not None and found.value == "fresh"
            with pytest.raises(AccessDenied, match="role monitor, which may not store"):
                await reader.store("graffiti", "x", soon())
            # a hand-made store is refused at the trainer's dispatch, and stores nothing
            await refused_call(monitor, trainer, protocol.STORE, caplog)
            assert await first.get("graffiti") is None
            # a server stores
            server, _ = await member("server")
            writer = await DHTNode.create(server, [address])
            nodes.append(writer)
            assert await writer.store("experts", "declared", soon())
            assert (await reader.get("experts", latest=True)).value == "declared"
        finally:
            for node in nodes:
                await node.shutdown()
                await node.peer.shutdown()

    arun(main)
