"""How expert servers announce their experts in the DHT, and how clients read them.

Records (every server writes its own subkeys, so several servers can host one uid):

- key ``uid`` (``"expert.3.17"``), subkey = server PeerID (base58),
  value = the server's multiaddrs (list of str);
- for each prefix along the uid (``"expert."`` then ``"expert.3."``), subkey =
  ``"<next coordinate>:<server PeerID>"``, value = ``[uid, multiaddrs]``.

A client therefore learns from one prefix key which next coordinates are alive, and at
the last level, which servers host each uid and how to dial them. Records expire on
their own; a server also deletes them (later-expiring tombstones) when it shuts down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.moe.expert_uid import (
    Coordinate,
    ExpertInfo,
    ExpertPrefix,
    ExpertUID,
    ServerInfo,
    check_uid,
    is_valid_uid,
    uid_prefixes,
)
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = [
    "declare_experts",
    "declare_experts_on_node",
    "get_experts_info",
    "get_experts_info_on_node",
    "parse_prefix_entries",
    "withdraw_experts_on_node",
]

logger = logging.getLogger(__name__)

_SUBKEY_SEPARATOR = ":"


def _records(
    uids: Iterable[ExpertUID], peer_id: PeerID, maddrs: Sequence[str], deleting: bool
) -> tuple[list, list, list]:
    me, addresses = peer_id.to_base58(), [str(m) for m in maddrs]
    keys, subkeys, values = [], [], []
    for uid in uids:
        keys.append(uid)
        subkeys.append(me)
        values.append(None if deleting else addresses)
        for prefix, coord in uid_prefixes(uid):
            keys.append(prefix)
            subkeys.append(f"{coord}{_SUBKEY_SEPARATOR}{me}")
            values.append(None if deleting else [uid, addresses])
    return keys, subkeys, values


async def declare_experts_on_node(
    node: DHTNode,
    uids: Sequence[ExpertUID],
    expiration_time: float,
    maddrs: Sequence[str] | None = None,
) -> dict[ExpertUID, bool]:
    """Announce that this node's peer hosts ``uids`` until ``expiration_time``; returns,
    per uid, whether its own record was stored on at least one DHT node."""
    for uid in uids:
        check_uid(uid)
    peer = node.peer
    if maddrs is None:
        maddrs = [str(m) for m in peer.get_visible_maddrs()]
    keys, subkeys, values = _records(uids, peer.peer_id, maddrs, deleting=False)
    stored = await node.store_many(keys, values, expiration_time, subkeys=subkeys)
    return {uid: bool(stored.get(uid)) for uid in uids}


async def withdraw_experts_on_node(
    node: DHTNode, uids: Sequence[ExpertUID], expiration_time: float
) -> None:
    """Delete this peer's records for ``uids`` (tombstones expiring at ``expiration_time``,
    which must be later than the declarations')."""
    keys, subkeys, values = _records(uids, node.peer.peer_id, (), deleting=True)
    await node.store_many(keys, values, expiration_time, subkeys=subkeys)


def _servers_from_uid_record(
    uid: ExpertUID, record: ValueWithExpiration | None, expiration_time: float | None = None
):
    if record is None or not isinstance(record.value, Mapping):
        return None
    servers = []
    for subkey, entry in record.value.items():
        if expiration_time is not None and entry.expiration_time < expiration_time:
            continue
        server = _server_info(subkey, entry.value)
        if server is not None:
            servers.append(server)
    return ExpertInfo(uid, tuple(servers)) if servers else None


def _server_info(peer_text: Any, maddrs: Any) -> ServerInfo | None:
    try:
        peer_id = PeerID.from_base58(peer_text)
    except Exception:  # a record from a buggy or hostile peer: skip it
        logger.debug("skipping an expert record with a malformed PeerID %r", peer_text)
        return None
    if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
        return None
    return ServerInfo(peer_id, tuple(maddrs))


async def get_experts_info_on_node(
    node: DHTNode,
    uids: Sequence[ExpertUID],
    latest: bool = False,
    *,
    expiration_time: float | None = None,
) -> list[ExpertInfo | None]:
    """For each uid, every live server hosting it (None when no server declared it).
    ``latest=True`` skips cached records (slower, sees withdrawals at once). With
    ``expiration_time``, servers whose declaration expires before it are left out.
    Servers' addresses are added to the peer's address book."""
    for uid in uids:
        check_uid(uid)
    found = await node.get_many(list(dict.fromkeys(uids)), latest=latest)
    infos = [_servers_from_uid_record(uid, found.get(uid), expiration_time) for uid in uids]
    remember_addresses(node, (info for info in infos if info is not None))
    return infos


def parse_prefix_entries(
    prefix: ExpertPrefix, record: ValueWithExpiration | None
) -> dict[Coordinate, list[tuple[ExpertUID, ServerInfo]]]:
    """The live next coordinates under ``prefix`` from its dictionary record: for each,
    the (uid, server) pairs announced through it. Malformed entries are skipped."""
    result: dict[Coordinate, list[tuple[ExpertUID, ServerInfo]]] = {}
    if record is None or not isinstance(record.value, Mapping):
        return result
    for subkey, entry in record.value.items():
        if not isinstance(subkey, str) or not isinstance(entry.value, list):
            continue
        coord_text, sep, peer_text = subkey.partition(_SUBKEY_SEPARATOR)
        # (str.isdigit accepts '²' and other Unicode digits that int() refuses)
        if not sep or not (coord_text.isascii() and coord_text.isdigit()):
            logger.debug("skipping a prefix entry of %r with subkey %r", prefix, subkey[:80])
            continue
        if len(entry.value) != 2:
            continue
        uid, maddrs = entry.value
        if not is_valid_uid(uid) or not uid.startswith(prefix):
            continue
        server = _server_info(peer_text, maddrs)
        if server is not None:
            result.setdefault(int(coord_text), []).append((uid, server))
    return result


def remember_addresses(node: DHTNode, infos: Iterable[ExpertInfo]) -> None:
    """Let the peer dial expert servers it has not met through the DHT."""
    for info in infos:
        for server in info.servers:
            if server.peer_id == node.peer.peer_id:
                continue
            for maddr in server.maddrs:
                try:
                    node.peer.add_addresses(server.peer_id, [maddr])
                except ValidationError:
                    logger.debug("skipping a malformed address %r of %s", maddr, server.peer_id)


# ---------------------------------------------------------------------- facade helpers


def declare_experts(
    dht: Any, uids: Sequence[ExpertUID], expiration_time: float | None = None, wait: bool = True
) -> Any:
    """hivemind's ``declare_experts(dht, uids, expiration_time)``: announce that this
    DHT's peer hosts ``uids`` (default expiration: 5 minutes from now). Returns
    ``{uid: stored}``, or a future of it when ``wait=False``."""
    if expiration_time is None:
        expiration_time = get_dht_time() + 300.0

    async def declare(_dht: Any, node: DHTNode) -> dict[ExpertUID, bool]:
        return await declare_experts_on_node(node, list(uids), expiration_time)

    return dht.run_coroutine(declare, return_future=not wait)


def get_experts_info(dht: Any, uids: Sequence[ExpertUID], return_future: bool = False) -> Any:
    """For each uid, an :class:`ExpertInfo` naming every live server, or None."""

    async def get(_dht: Any, node: DHTNode) -> list[ExpertInfo | None]:
        return await get_experts_info_on_node(node, list(uids))

    return dht.run_coroutine(get, return_future=return_future)
