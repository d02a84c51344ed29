"""Two loopback peers with an ``echo`` handler, for transport tests; numbered PeerIDs."""

from __future__ import annotations

import hashlib
import os

from swarmgrad.averaging.group_info import GroupInfo
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


async def make_peers(n: int) -> list[Peer]:
    """``n`` loopback peers, each knowing every other's address."""
    peers = [await Peer.create() for _ in range(n)]
    for peer in peers:
        for other in peers:
            if other is not peer:
                peer.add_addresses(other.peer_id, other.get_visible_maddrs())
    return peers


def make_group(peers) -> GroupInfo:
    """An averaging group of ``peers`` (random group id, no gathered data)."""
    return GroupInfo(os.urandom(16), tuple(p.peer_id for p in peers), tuple(b"" for _ in peers))
