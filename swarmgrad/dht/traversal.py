"""How a DHT node reaches other nodes: calls with a blacklist, batched finds, and the
iterative parallel lookup of the nodes nearest to a key.

:class:`DHTTraversal` is one part of :class:`~swarmgrad.dht.node.DHTNode` (a mixin: the
lookup reads and updates the node's routing table, blacklist and address book on every
answer, so it shares the node's state rather than owning a copy). The node module holds
the state and the life cycle; this one only the outgoing side of the protocol.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.dht import protocol
from swarmgrad.dht.protocol import FindAnswer, FoundRecord
from swarmgrad.dht.routing import DHTID, RoutingTable
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import ProtocolViolation, RemoteError, SwarmgradError

logger = logging.getLogger("swarmgrad.dht.node")  # the node's log, as before the split


class Blacklist:
    """Nodes that failed recently, banned for ``base_time * backoff_rate ** (failures-1)``."""

    def __init__(self, base_time: float, backoff_rate: float, time_fn: Callable[[], float]):
        self.base_time, self.backoff_rate, self.time_fn = base_time, backoff_rate, time_fn
        self._failures: dict[PeerID, int] = {}
        self._banned_until: dict[PeerID, float] = {}

    def register_failure(self, peer_id: PeerID) -> None:
        if len(self._failures) > 10_000:  # bounded memory whatever the churn
            now = self.time_fn()
            for stale in [p for p, until in self._banned_until.items() if until <= now]:
                self._failures.pop(stale, None)
                del self._banned_until[stale]
        failures = self._failures.get(peer_id, 0) + 1
        self._failures[peer_id] = failures
        ban = self.base_time * self.backoff_rate ** (failures - 1)
        self._banned_until[peer_id] = self.time_fn() + min(ban, 3600.0)

    def clear(self) -> None:
        self._failures.clear()
        self._banned_until.clear()

    def register_success(self, peer_id: PeerID) -> None:
        self._failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)

    def __contains__(self, peer_id: PeerID) -> bool:
        until = self._banned_until.get(peer_id)
        if until is None:
            return False
        if until <= self.time_fn():
            del self._banned_until[peer_id]
            return False
        return True


@dataclass
class LookupResult:
    nearest: list[tuple[DHTID, PeerID]]  # nearest nodes that answered, closest first
    records: list[tuple[PeerID, FoundRecord]] = field(default_factory=list)
    lacking: list[PeerID] = field(default_factory=list)  # answered without the record
    hops: int = 0  # lookup rounds until the value (or the nearest node) was reached


class DHTTraversal:
    """Outgoing calls and lookups of a :class:`~swarmgrad.dht.node.DHTNode`."""

    # node state this part uses (set by DHTNode.__init__)
    peer: Peer
    peer_id: PeerID
    node_id: DHTID
    routing: RoutingTable
    blacklist: Blacklist
    bucket_size: int
    parallel_rpc: int
    wait_timeout: float
    clock_skew_warning: float
    time_fn: Callable[[], float]
    lookup_hops: collections.deque[int]
    _loop: asyncio.AbstractEventLoop
    _closed: bool
    _pending_finds: dict[PeerID, list[tuple]]
    _bootstrap_failures: dict[PeerID, BaseException] | None
    _warned_skew: set[PeerID]

    async def _call(self, peer_id: PeerID, name: str, request: dict) -> Any | None:
        """One RPC with the node's timeout; None (and a blacklist entry) on failure."""
        if peer_id in self.blacklist or self._closed:
            return None
        request["sender"] = self._sender_info()
        try:
            response = await self.peer.call(peer_id, name, request, timeout=self.wait_timeout)
        except RemoteError as e:  # it answered, but not as a DHT node (e.g. a client)
            logger.debug("%s refused %s: %s", peer_id, name, e)
            if self._bootstrap_failures is not None:
                self._bootstrap_failures[peer_id] = e
            self._forget(peer_id)
            return None
        except (SwarmgradError, OSError, TimeoutError) as e:
            logger.debug("%s to %s failed: %s", name, peer_id, e)
            if self._bootstrap_failures is not None:  # joining: say why an initial peer failed
                self._bootstrap_failures[peer_id] = e
            self.blacklist.register_failure(peer_id)
            self._forget(peer_id)
            return None
        self.blacklist.register_success(peer_id)
        self._add_node(peer_id)
        return response

    async def ping(self, peer_id: PeerID) -> bool:
        response = await self._call(peer_id, protocol.PING, dict(self._sender_info()))
        if response is None:
            return False
        try:
            their_time, client = protocol.decode_pong(response)
        except ProtocolViolation as e:
            logger.debug("bad ping answer from %s: %s", peer_id, e)
            return False
        if client:
            self._forget(peer_id)
        skew = their_time - self.time_fn()
        if abs(skew) > self.clock_skew_warning and peer_id not in self._warned_skew:
            self._warned_skew.add(peer_id)
            logger.warning(
                "clock of %s differs from ours by %.0f s; DHT records may expire early or late",
                peer_id,
                skew,
            )
        return True

    def _find(
        self,
        peer_id: PeerID,
        key_id: DHTID,
        k: int,
        want_record: bool = True,
        known: tuple[tuple[bytes, float], ...] | None = None,
        known_nodes: AbstractSet[bytes] = frozenset(),
    ) -> asyncio.Future:
        """Ask a node about a key (its record unless ``want_record`` is False, only the
        dictionary entries newer than ``known`` if given, and its k nearest nodes but
        those in ``known_nodes``); requests to one node in one loop tick share an RPC."""
        future = self._loop.create_future()
        pending = self._pending_finds.get(peer_id)
        if pending is None:
            pending = self._pending_finds[peer_id] = []
            self._loop.call_soon(self._flush_finds, peer_id)
        pending.append((key_id, future, k, want_record, known, known_nodes))
        return future

    def _flush_finds(self, peer_id: PeerID) -> None:
        batch = self._pending_finds.pop(peer_id, [])
        if batch:
            self._spawn(self._send_finds(peer_id, batch))

    async def _send_finds(
        self,
        peer_id: PeerID,
        batch: list[tuple[DHTID, asyncio.Future, int, bool, tuple | None, AbstractSet[bytes]]],
    ) -> None:
        key_ids = list(dict.fromkeys(item[0] for item in batch))[: protocol.MAX_BATCH]
        k = max(item[2] for item in batch)
        wanted = {item[0] for item in batch if item[3]}
        # a key asked twice in one tick with different known versions is asked in full,
        # and leaves out only the nodes every one of its lookups knows
        known_of: dict[DHTID, tuple | None] = {}
        nodes_of: dict[DHTID, AbstractSet[bytes]] = {}
        for key_id, _, _, _, known, known_nodes in batch:
            known_of[key_id] = known if known_of.get(key_id, known) == known else None
            nodes_of[key_id] = nodes_of.get(key_id, known_nodes) & known_nodes
        answers_by_key: dict[DHTID, FindAnswer] = {}
        try:
            skip = [i for i, key_id in enumerate(key_ids) if key_id not in wanted]
            known_by_index = {
                i: list(known_of[key_id])
                for i, key_id in enumerate(key_ids)
                if key_id in wanted and known_of.get(key_id)
            }
            nodes_by_index = {
                i: sorted(nodes_of[key_id])[: protocol.MAX_KNOWN_NODES]
                for i, key_id in enumerate(key_ids)
                if nodes_of.get(key_id)
            }
            request = protocol.encode_find(
                key_ids, k, skip_records=skip, known=known_by_index, known_nodes=nodes_by_index
            )
            response = await self._call(peer_id, protocol.FIND, request)
            if response is not None:
                answers = protocol.decode_find_result(response, len(key_ids))
                answers_by_key = dict(zip(key_ids, answers, strict=True))
        except ProtocolViolation as e:
            logger.debug("bad find answer from %s: %s", peer_id, e)
            self.blacklist.register_failure(peer_id)
        finally:
            for key_id, future, *_ in batch:
                if not future.done():
                    future.set_result(answers_by_key.get(key_id))

    # ------------------------------------------------------------------ lookups

    async def _lookup(
        self,
        key_id: DHTID,
        *,
        find_value: bool,
        latest: bool = False,
        k: int | None = None,
        alpha: int | None = None,
        known_versions: tuple[tuple[bytes, float], ...] | None = None,
    ) -> LookupResult:
        """Iterative parallel lookup of the ``k`` nearest nodes to key_id (and its record,
        only entries newer than ``known_versions`` if given), with ``alpha`` (default
        parallel_rpc) requests in flight."""
        k = k or self.bucket_size
        alpha = alpha or self.parallel_rpc
        hop_of: dict[PeerID, int] = {}
        candidates: list[tuple[int, PeerID]] = []  # heap by distance
        for node_id, peer_id in self.routing.get_nearest_neighbors(key_id, k):
            heapq.heappush(candidates, (node_id ^ key_id, peer_id))
            hop_of[peer_id] = 1
        seen = {peer_id for _, peer_id in candidates}
        answered: list[tuple[int, PeerID]] = []
        failed: set[PeerID] = set()
        result = LookupResult(nearest=[])
        in_flight: dict[asyncio.Future, PeerID] = {}

        def unqueried_nearest() -> list[PeerID]:
            """Unqueried candidates among the k nearest not-failed nodes known so far."""
            chosen, counted = [], 0
            for _, peer_id in heapq.nsmallest(k + len(failed), candidates):
                if peer_id in failed:
                    continue
                counted += 1
                if counted > k:
                    break
                if peer_id not in queried:
                    chosen.append(peer_id)
            return chosen

        # every node seen is a candidate already: answers need not list it (a live set,
        # grown with ``seen``; requests read it when they leave)
        seen_prefixes = {protocol.node_prefix(DHTID.for_peer(p)) for p in seen}

        queried: set[PeerID] = set()
        done = False
        while not done:
            for peer_id in unqueried_nearest():
                if len(in_flight) >= alpha:
                    break
                queried.add(peer_id)
                in_flight[
                    self._find(peer_id, key_id, k, find_value, known_versions, seen_prefixes)
                ] = peer_id
            if not in_flight:
                break
            finished, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for future in finished:
                peer_id = in_flight.pop(future)
                answer: FindAnswer | None = future.result()
                if answer is None:
                    failed.add(peer_id)
                    continue
                hop = hop_of.get(peer_id, 1)
                answered.append((DHTID.for_peer(peer_id) ^ key_id, peer_id))
                if answer.record is not None and find_value:
                    result.records.append((peer_id, answer.record))
                    result.hops = result.hops or hop
                    if not latest:
                        done = True
                elif find_value:
                    result.lacking.append(peer_id)
                for found_peer, addrs in answer.nearest:
                    if found_peer == self.peer_id or found_peer in seen:
                        continue
                    seen.add(found_peer)
                    seen_prefixes.add(protocol.node_prefix(DHTID.for_peer(found_peer)))
                    hop_of[found_peer] = hop + 1
                    known = self._learn_addresses(found_peer, addrs)
                    if found_peer not in self.blacklist and (
                        known or self.peer.is_connected(found_peer)
                    ):
                        heapq.heappush(
                            candidates, (DHTID.for_peer(found_peer) ^ key_id, found_peer)
                        )
        for future in in_flight:
            future.cancel()
        answered.sort()
        result.nearest = [(DHTID.for_peer(p), p) for _, p in answered[:k]]
        if not result.hops and answered:
            result.hops = hop_of.get(answered[0][1], 1)
        if find_value:
            self.lookup_hops.append(result.hops)
        return result

    async def find_nearest_nodes(
        self, key_id: DHTID, k: int | None = None
    ) -> list[tuple[DHTID, PeerID]]:
        return (await self._lookup(key_id, find_value=False, k=k)).nearest


__all__ = ["Blacklist", "DHTTraversal", "LookupResult"]
