"""Two loopback peers with an ``echo`` handler, for transport tests; numbered PeerIDs."""

from __future__ import annotations

import hashlib

from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer


def numbered_peer_id(i: int) -> PeerID:
    """A distinct, valid (sha2-256 multihash) PeerID for each integer, no key needed."""
    return PeerID(b"\x12\x20" + hashlib.sha256(i.to_bytes(8, "big")).digest())


async def echo(request, context):
    return request


async def two_peers(**server_kwargs):
    """``(server, client, server address)``: the server answers ``echo``."""
    server = await Peer.create(**server_kwargs)
    client = await Peer.create()
    server.add_handler("echo", echo)
    return server, client, server.get_visible_maddrs()[0]


async def shutdown(*items):
    """Shut down, in the order given, each object (or each object of a list or tuple):
    averagers before the DHT nodes they use, a node before its peer, which goes down
    with it."""
    for item in items:
        for obj in (item,) if hasattr(item, "shutdown") else item:
            await obj.shutdown()
            if isinstance(obj, DHTNode):
                await obj.peer.shutdown()
