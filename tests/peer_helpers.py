"""Two loopback peers with an ``echo`` handler, for transport tests."""

from __future__ import annotations

from swarmgrad.net.peer import Peer


async def echo(request, context):
    return request


async def two_peers(**server_kwargs):
    """``(server, client, server address)``: the server answers ``echo``."""
    server = await Peer.create(**server_kwargs)
    client = await Peer.create()
    server.add_handler("echo", echo)
    return server, client, server.get_visible_maddrs()[0]


async def shutdown(*peers):
    for p in peers:
        await p.shutdown()
