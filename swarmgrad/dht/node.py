"""A Kademlia DHT node running on a :class:`~swarmgrad.net.peer.Peer`.

What it does, in the order a reader meets it:

* **Handlers** for ``dht.ping``, ``dht.store`` and ``dht.find`` (none in client mode: a
  client stores nothing for others and is never put in routing tables).
* **Lookups**: an iterative, parallel search over the nearest known nodes (``alpha``
  requests in flight), stopping when the ``k`` nearest candidates have all answered or
  failed. Requests that several concurrent lookups send to the same node in the same
  event-loop tick travel as one ``dht.find`` with several keys.
* **store / get** with replication to the ``num_replicas`` nearest nodes (a store asks
  one of the routing table's nearest whether it knows nearer ones before it looks the
  neighbourhood up; a latest-get may read a quorum of replicas), the later
  expiration winning, dictionary values with per-subkey expiration, local caching, path
  caching to the nearest node that lacked a found value, refresh of hot cached keys before
  they expire, and coalescing of concurrent gets of the same key.
* **Joining**: ping the initial peers, look up our own id, then (``refresh_on_join``) a
  random id in every farther bucket, as the Kademlia paper's join does: our buckets fill,
  the nodes there add us, and a small swarm is connected nearly pairwise before its first
  lookups (which would otherwise each wait for new connections).
* **Admission** (when the peer has an authority): the authority's revocation list is
  read from the DHT and enforced (:mod:`swarmgrad.dht.revocation`); a peer whose token
  role may not store (a monitor) stores nothing, not even path caches.
* **Maintenance**: bucket refresh, hand-off of records to newly joined nodes that are
  nearer to them than we are, a blacklist with exponential backoff for nodes that fail.

Keys, subkeys and values are serialized with msgpack; records are checked by the record
validators on every incoming store and every found value.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarmgrad.dht import protocol
from swarmgrad.dht.protocol import FindAnswer, FoundRecord, StoreItem
from swarmgrad.dht.routing import DHTID, RoutingTable
from swarmgrad.dht.storage import DHTLocalStorage, DictionaryDHTValue, ValueWithExpiration
from swarmgrad.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import RPCContext
from swarmgrad.utils.errors import (
    AccessDenied,
    PeerUnreachable,
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)
from swarmgrad.utils.timeutils import get_dht_time

logger = logging.getLogger(__name__)

_RERANK_INTERVAL = 1.0  # seconds: see DHTNode._add_node
_MAX_TRACKED_PEERS = 65536

NO_SUBKEY = b""  # the DHTRecord subkey of a plain (non-dictionary) value


def serialize(obj: Any) -> bytes:
    """Keys, subkeys and values on the wire: msgpack, bytes kept as bytes."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValidationError(f"DHT keys and values must be msgpack-serializable: {e}") from e


def deserialize(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


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


#: what _store_remote reports for a node that did not answer
UNREACHABLE = "unreachable"


@dataclass
class LookupResult:
    nearest: list[tuple[DHTID, PeerID]]  # nearest nodes that answered, closest first
    records: list[tuple[PeerID, FoundRecord]] = field(default_factory=list)
    lacking: list[PeerID] = field(default_factory=list)  # answered without the record
    hops: int = 0  # lookup rounds until the value (or the nearest node) was reached


class DHTNode:
    """Create with :meth:`create`; see the module docstring for what it does."""

    def __init__(
        self,
        peer: Peer,
        *,
        bucket_size: int = 20,
        num_replicas: int = 5,
        depth_modulo: int = 5,
        parallel_rpc: int = 3,
        wait_timeout: float = 3.0,
        refresh_period: float = 600.0,
        refresh_on_join: bool = True,
        cache_locally: bool = True,
        cache_nearest: int = 1,
        cache_size: int | None = None,
        cache_refresh_before_expiry: float = 5.0,
        cache_on_store: bool = True,
        reuse_get_requests: bool = True,
        blacklist_time: float = 5.0,
        backoff_rate: float = 2.0,
        client_mode: bool = False,
        record_validator: RecordValidatorBase | None = None,
        max_value_bytes: int = 1024 * 1024,
        max_key_bytes: int = 4096,
        max_expiration_ahead: float = 7 * 24 * 3600.0,
        max_records_per_peer: int = 100_000,
        clock_skew_warning: float = 30.0,
        time_fn: Callable[[], float] = get_dht_time,
    ):
        self.peer = peer
        self.peer_id = peer.peer_id
        self.node_id = DHTID.for_peer(peer.peer_id)
        self.bucket_size, self.num_replicas = bucket_size, num_replicas
        self.parallel_rpc, self.wait_timeout = parallel_rpc, wait_timeout
        self.refresh_period, self.refresh_on_join = refresh_period, refresh_on_join
        self.cache_locally, self.cache_nearest = cache_locally, cache_nearest
        self.cache_refresh_before_expiry = cache_refresh_before_expiry
        self.cache_on_store, self.reuse_get_requests = cache_on_store, reuse_get_requests
        self.client_mode = client_mode
        self.clock_skew_warning = clock_skew_warning
        self.time_fn = time_fn
        self.protocol_validator = CompositeValidator([record_validator] if record_validator else [])
        admission = peer.admission
        self._revocations: Any = None  # a RevocationWatcher, with an admission authority
        self._may_store = admission is None or admission.allows(admission.role, protocol.STORE)
        if admission is not None:
            from swarmgrad.dht.revocation import RevocationListValidator

            self.protocol_validator.extend([RevocationListValidator(admission)])
        self.routing = RoutingTable(self.node_id, bucket_size, depth_modulo)
        limits = dict(
            max_value_bytes=max_value_bytes,
            max_key_bytes=max_key_bytes,
            max_expiration_ahead=max_expiration_ahead,
            time_fn=time_fn,
        )
        self.storage = DHTLocalStorage(max_records_per_source=max_records_per_peer, **limits)
        self.cache = DHTLocalStorage(maxsize=cache_size, **limits)
        self.max_key_bytes, self.max_value_bytes = max_key_bytes, max_value_bytes
        self.max_expiration_ahead = max_expiration_ahead
        self.blacklist = Blacklist(blacklist_time, backoff_rate, time_fn)
        self._loop = asyncio.get_running_loop()
        # peer -> [(key id, future, k, want record, known versions, known node prefixes)]
        # to send this tick
        self._pending_finds: dict[PeerID, list[tuple]] = {}
        self._pending_gets: dict[tuple[DHTID, bool], asyncio.Future] = {}
        self._hot_cache_keys: dict[DHTID, bytes] = {}  # key id -> serialized key
        self._serialized_keys: dict[DHTID, bytes] = {}  # stored key ids -> serialized keys
        # per peer: its find-answer entry, valid while the peer's address book is unchanged
        self._answer_entries: dict[PeerID, tuple[PeerID, tuple[str, ...]]] = {}
        self._answer_entries_version = -1
        self._last_added: dict[PeerID, float] = {}  # loop time each node was last re-ranked
        self._learned_texts: dict[PeerID, tuple[str, ...]] = {}  # addresses already parsed
        self._sender: dict | None = None  # our sender info, rebuilt every maintenance tick
        self._warned_skew: set[PeerID] = set()
        self._tasks: set[asyncio.Task] = set()
        self._background: list[asyncio.Task] = []
        self._handoff_queue: set[PeerID] = set()
        self._bootstrap_failures: dict[PeerID, BaseException] | None = None
        self._closed = False
        self.lookup_hops: list[int] = []  # statistics for benchmarks and tests
        # refresh targets: drawn per node (seeded by its id), so a seeded simulation repeats
        self._rng = random.Random(self.node_id)

    # ------------------------------------------------------------------ life cycle

    @classmethod
    async def create(
        cls,
        peer: Peer | None = None,
        initial_peers: Iterable[str | Multiaddr] = (),
        *,
        p2p: Any = None,
        bootstrap_timeout: float = 30.0,
        **kwargs: Any,
    ) -> DHTNode:
        """Start a node on ``peer`` and join the swarm through ``initial_peers``
        (PeerUnreachable naming them all if none answers).

        As in hivemind, the peer may come as ``p2p=`` (a Peer, or a ``swarmgrad.p2p.P2P``
        around one); with neither, a new peer is started on loopback and the node shuts it
        down with itself."""
        owns_peer = False
        if peer is not None and p2p is not None:
            raise ValidationError("give the node's peer once: peer or p2p=, not both")
        if peer is None and p2p is not None:
            peer = p2p if isinstance(p2p, Peer) else getattr(p2p, "peer", None)
            if not isinstance(peer, Peer):
                raise TypeError(f"p2p must be a swarmgrad Peer or P2P, got {type(p2p).__name__}")
        if peer is None:
            peer, owns_peer = await Peer.create(), True
        try:
            node = cls(peer, **kwargs)
        except BaseException:
            if owns_peer:
                await peer.shutdown()
            raise
        node._owns_peer = owns_peer
        node._register_handlers()
        try:
            await node._bootstrap(list(initial_peers or ()), bootstrap_timeout)
        except BaseException:
            await node.shutdown()
            raise
        node._background.append(node._loop.create_task(node._maintain()))
        if peer.admission is not None:
            from swarmgrad.dht.revocation import RevocationWatcher

            node._revocations = RevocationWatcher(node, peer.admission)
            node._revocations.start()
        return node

    def _register_handlers(self) -> None:
        if self.client_mode:
            return  # a client stores nothing for others and answers no lookups
        self.peer.add_handler(protocol.PING, self._rpc_ping)
        self.peer.add_handler(protocol.STORE, self._rpc_store)
        self.peer.add_handler(protocol.FIND, self._rpc_find)

    async def _bootstrap(self, initial_peers: list[str | Multiaddr], timeout: float) -> None:
        if not initial_peers:
            return
        errors: list[str] = []

        async def join(address: str | Multiaddr) -> bool:
            try:
                async with asyncio.timeout(timeout):
                    peer_id = await self.peer.connect(address)
                    if await self.ping(peer_id):
                        return True
                    why = self._bootstrap_failures.pop(peer_id, None) or "no answer to ping"
                    errors.append(f"{address} ({why})")
                    return False
            except (SwarmgradError, OSError, TimeoutError, ValueError) as e:
                errors.append(f"{address} ({e or type(e).__name__})")
                return False

        self._bootstrap_failures = {}

        try:
            joined = await asyncio.gather(*(join(a) for a in initial_peers))
        finally:
            self._bootstrap_failures = None
        if not any(joined):
            raise PeerUnreachable(
                "could not reach any initial peer: " + "; ".join(errors or map(str, initial_peers))
            )
        await self._lookup(self.node_id, find_value=False)  # fill the routing table
        if self.refresh_on_join:
            # Kademlia's join: a random id in every farther distance range, so our buckets
            # fill and the nodes there hear of us (and are connected before first use).
            own = self.routing.get_bucket_index(self.node_id)
            probes = [
                bucket.random_id(self._rng)
                for index, bucket in enumerate(self.routing.buckets)
                if index != own
            ]
            await asyncio.gather(*(self._lookup(p, find_value=False) for p in probes))

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._revocations is not None:
            await self._revocations.close()
        for name in (protocol.PING, protocol.STORE, protocol.FIND):
            self.peer.remove_handler(name)
        for task in [*self._background, *self._tasks]:
            task.cancel()
        await asyncio.gather(*self._background, *self._tasks, return_exceptions=True)
        for waiters in self._pending_finds.values():
            for _, future, *_ in waiters:
                future.cancel()
        self._pending_finds.clear()
        if getattr(self, "_owns_peer", False):  # started by create() without a peer
            await self.peer.shutdown()

    def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        """The multiaddrs others can reach this node's peer at (hivemind's name)."""
        return self.peer.get_visible_maddrs()

    async def get_many_by_id(self, key_ids: Any, *args: Any, **kwargs: Any) -> Any:
        """hivemind looks records up by bare DHTID; swarmgrad's lookups need the key itself
        (records are validated against it), so this asks for ``get_many``."""
        raise NotImplementedError(
            "DHTNode.get_many_by_id: swarmgrad looks records up by key, not by bare DHTID; "
            "use await node.get_many(keys, latest=...)"
        )

    def _spawn(self, coro: Any) -> None:
        if self._closed:
            coro.close()
            return
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ knowing peers

    def _sender_info(self) -> dict:
        """Our addresses as sent with every request (shared: do not modify). Rebuilt each
        maintenance tick, so an address gained through a relay is announced within ~1 s."""
        if self._sender is None:
            maddrs = [str(m) for m in self.peer.get_visible_maddrs()]
            self._sender = protocol.encode_ping(maddrs, self.client_mode)
        return self._sender

    def _heard_from(self, peer_id: PeerID, sender: Any) -> None:
        """A node talked to us or answered us: learn its addresses and (if it serves the
        DHT) put it in the routing table."""
        if sender is None:
            return
        try:
            maddrs, client = protocol.decode_ping(sender)
        except ProtocolViolation:
            return
        if client or peer_id == self.peer_id:
            return
        self._learn_addresses(peer_id, maddrs)
        self._add_node(peer_id)

    def _learn_addresses(self, peer_id: PeerID, texts: Sequence[str]) -> bool:
        """Add the well-formed addresses to the peer's address book; True if any was.
        Each is pinned to peer_id, so a lying node can only send us to a failed dial.
        The same texts as last time for this peer are not parsed again (every request and
        most find answers repeat them)."""
        texts = tuple(texts)
        if texts and self._learned_texts.get(peer_id) == texts:
            return True
        addresses = []
        for text in texts:
            try:
                addresses.append(Multiaddr.parse(text).with_peer_id(peer_id))
            except ValidationError:
                continue
        if addresses:
            self.peer.add_addresses(peer_id, addresses)
            if len(addresses) == len(texts):
                if len(self._learned_texts) > _MAX_TRACKED_PEERS:
                    self._learned_texts.clear()
                self._learned_texts[peer_id] = texts
        return bool(addresses)

    def _add_node(self, peer_id: PeerID) -> None:
        """We heard from a DHT node: add it to the routing table or rank it most recently
        seen there. A node heard from again within ``_RERANK_INTERVAL`` keeps its rank:
        every request and answer lands here, and the order only decides which node a full
        bucket asks to prove it is alive, which a second's difference does not change."""
        now = self._loop.time()
        last_added = self._last_added
        if now - last_added.get(peer_id, -math.inf) < _RERANK_INTERVAL:
            return
        if len(last_added) > _MAX_TRACKED_PEERS:
            last_added.clear()
        last_added[peer_id] = now
        node_id = DHTID.for_peer(peer_id)
        is_new = node_id not in self.routing
        stale = self.routing.add_or_update_node(node_id, peer_id)
        if stale is not None:
            self._spawn(self._check_stale(*stale, replacement=peer_id))
        elif is_new and node_id in self.routing and len(self.storage):
            self._handoff_queue.add(peer_id)

    async def _check_stale(self, node_id: DHTID, peer_id: PeerID, replacement: PeerID) -> None:
        """A bucket is full: keep its least recently seen node if it still answers."""
        if await self.ping(peer_id):
            if node_id in self.routing:  # it answered: rank it fresh (not throttled)
                self.routing.add_or_update_node(node_id, peer_id)
            return
        if node_id in self.routing:
            del self.routing[node_id]
        self.routing.add_or_update_node(DHTID.for_peer(replacement), replacement)

    def _answer_entries_now(self) -> dict[PeerID, tuple[PeerID, tuple[str, ...]]]:
        """Find-answer entries made so far (forgotten whenever an address book changes)."""
        version = self.peer.address_book_version
        if version != self._answer_entries_version:
            self._answer_entries.clear()
            self._answer_entries_version = version
        return self._answer_entries

    def _answer_entry(self, peer_id: PeerID) -> tuple[PeerID, tuple[str, ...]]:
        """A peer as listed in find answers: (peer id, address texts)."""
        texts = tuple(str(m) for m in self.peer.addresses_of(peer_id)[: protocol.MAX_ADDRS])
        entry = self._answer_entries[peer_id] = (peer_id, texts)
        return entry

    def _forget(self, peer_id: PeerID) -> None:
        node_id = DHTID.for_peer(peer_id)
        if node_id in self.routing:
            del self.routing[node_id]
        self._answer_entries.pop(peer_id, None)
        self._learned_texts.pop(peer_id, None)
        self._last_added.pop(peer_id, None)

    # ------------------------------------------------------------------ outgoing calls

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

    # ------------------------------------------------------------------ store

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store on the ``num_replicas`` nearest nodes; True if at least one accepted.
        ``value=None`` deletes: a record whose later expiration hides the older value
        (or subkey) until it expires itself."""
        return (await self.store_many([key], [value], expiration_time, subkeys=[subkey]))[key]

    async def store_many(
        self,
        keys: Sequence[Any],
        values: Sequence[Any],
        expiration_time: float | Sequence[float],
        subkeys: Sequence[Any] | None = None,
        exclude_self: bool = False,
    ) -> dict[Any, bool]:
        if not self._may_store:
            raise AccessDenied(
                f"this peer's access token has the role {self.peer.admission.role.value}, "
                "which may not store in the DHT",
                remote_type="AccessDenied",
                peer=self.peer_id,
            )
        if isinstance(expiration_time, int | float):
            expiration_time = [expiration_time] * len(keys)
        subkeys = subkeys or [None] * len(keys)
        if not (len(keys) == len(values) == len(expiration_time) == len(subkeys)):
            raise ValidationError("keys, values, expiration times and subkeys differ in length")
        items = [
            self._make_item(key, value, exp, subkey)
            for key, value, exp, subkey in zip(keys, values, expiration_time, subkeys, strict=True)
        ]
        by_key_id: dict[DHTID, list[int]] = {}
        for index, item in enumerate(items):
            by_key_id.setdefault(item.key_id, []).append(index)
        stored = [False] * len(items)

        async def replicate(key_id: DHTID, indices: list[int]) -> None:
            # search as wide as a latest-get reads (num_replicas + 2), all at once, then
            # store on the nearest num_replicas: a search for only num_replicas nodes stops
            # early at a local minimum of a sparse routing table; the margin and the tables
            # the join refresh fills make concurrent writers agree on the replicas
            width = min(self.bucket_size, self.num_replicas + 2)
            nearest = await self._probed_replicas(key_id)
            probed = nearest is not None
            if nearest is None:
                lookup = await self._lookup(key_id, find_value=False, k=width, alpha=width)
                nearest = lookup.nearest[: self.num_replicas]
            targets = [peer_id for _, peer_id in nearest]
            we_are_near = (
                not self.client_mode
                and not exclude_self
                and (
                    len(nearest) < self.num_replicas
                    or self.node_id ^ key_id <= nearest[-1][0] ^ key_id
                )
            )
            if we_are_near:
                for index in indices:
                    stored[index] |= self._store_locally(items[index], self.peer_id) is None
            results = await asyncio.gather(
                *(self._store_remote(peer_id, [items[i] for i in indices]) for peer_id in targets)
            )
            unreachable = [t for t, r in zip(targets, results, strict=True) if r[0] == UNREACHABLE]
            if probed and unreachable:
                # a replica of the routing table is gone: the lookup finds who replaces it
                lookup = await self._lookup(key_id, find_value=False, k=width, alpha=width)
                spares = [p for _, p in lookup.nearest[: self.num_replicas] if p not in targets]
                results += await asyncio.gather(
                    *(self._store_remote(p, [items[i] for i in indices]) for p in spares)
                )
            for remote in results:
                for index, error in zip(indices, remote, strict=True):
                    stored[index] |= error is None
            if self.cache_on_store:
                for index in indices:
                    self._store_in_cache(items[index])

        await asyncio.gather(*(replicate(key_id, ix) for key_id, ix in by_key_id.items()))
        outcome: dict[Any, bool] = {}
        for key, ok in zip(keys, stored, strict=True):
            outcome[key] = outcome.get(key, True) and ok
        return outcome

    def _make_item(self, key: Any, value: Any, expiration_time: float, subkey: Any) -> StoreItem:
        key_bytes = serialize(key)
        if len(key_bytes) > self.max_key_bytes:
            raise ValidationError(
                f"key {key!r:.60} is {len(key_bytes)} bytes serialized, over {self.max_key_bytes}"
            )
        subkey_bytes = None if subkey is None else serialize(subkey)
        # A delete is the value None (msgpack nil) with a later expiration: an ordinary
        # record, so validators judge (and owners sign) deletes like any other write.
        value_bytes = serialize(value)
        if len(value_bytes) > self.max_value_bytes:
            raise ValidationError(
                f"the value for key {key!r:.60} is {len(value_bytes)} bytes serialized, over "
                f"the limit of {self.max_value_bytes} (large data belongs in averaging or "
                f"state transfer, not in DHT records)"
            )
        ahead = expiration_time - self.time_fn()
        if ahead > self.max_expiration_ahead:
            raise ValidationError(
                f"the record for key {key!r:.60} would expire in {ahead:.0f} s, more than the "
                f"{self.max_expiration_ahead:.0f} s peers accept"
            )
        record = DHTRecord(key_bytes, subkey_bytes or NO_SUBKEY, value_bytes, expiration_time)
        signed = self.protocol_validator.sign_value(record)
        return StoreItem(key_bytes, subkey_bytes, signed, float(expiration_time))

    async def _store_remote(self, peer_id: PeerID, items: list[StoreItem]) -> list[str | None]:
        if not self._may_store:  # path caching and hand-off of a monitor: not allowed
            return ["this peer's role may not store"] * len(items)
        response = await self._call(peer_id, protocol.STORE, protocol.encode_store(items))
        if response is None:
            return [UNREACHABLE] * len(items)
        try:
            results = protocol.decode_store_result(response, len(items))
        except ProtocolViolation as e:
            logger.debug("bad store answer from %s: %s", peer_id, e)
            return ["malformed answer"] * len(items)
        for item, error in zip(items, results, strict=True):
            if error is not None and not error.startswith("a record with a later"):
                logger.warning("%s refused to store key %r: %s", peer_id, item.key[:40], error)
        return results

    def _store_locally(self, item: StoreItem, source: PeerID) -> str | None:
        """Validate and store a record; None if stored, else why not."""
        if len(item.key) > self.max_key_bytes:  # storage sees only the key's id: check here
            return (
                f"the key is {len(item.key)} bytes serialized, over max_key_bytes="
                f"{self.max_key_bytes}"
            )
        if item.value is not None:
            record = DHTRecord(item.key, item.subkey or NO_SUBKEY, item.value, item.expiration_time)
            if not self.protocol_validator.validate(record):
                return "the record failed validation"
        storage = self.cache if item.in_cache else self.storage
        try:
            ok = storage.store(
                item.key_id,
                item.value,
                item.expiration_time,
                subkey=item.subkey,
                source=None if item.in_cache else source,
            )
        except ValidationError as e:
            return str(e)
        if item.value is not None and not item.in_cache:
            self._serialized_keys[item.key_id] = item.key
        return None if ok else "a record with a later expiration is already stored"

    def _store_in_cache(self, item: StoreItem) -> None:
        try:
            self.cache.store(item.key_id, item.value, item.expiration_time, subkey=item.subkey)
        except ValidationError:
            pass

    # ------------------------------------------------------------------ get

    async def get(
        self, key: Any, latest: bool = False, quorum: int | None = None
    ) -> ValueWithExpiration | None:
        """The value under key: ``ValueWithExpiration(value, expiration_time)`` where a
        dictionary value is ``{subkey: ValueWithExpiration}``; None if absent or expired.
        ``latest=True`` keeps searching the nearest nodes for the freshest record.

        ``quorum`` (latest-gets only): merge what ``quorum`` replicas hold, this node
        counting as one when it is a replica, instead of asking every one of them. The
        replicas are picked at random among the ``num_replicas`` nearest known nodes; the
        read falls back to a full one when fewer answer or when an answer names a nearer
        node (this node does not know the key's neighbourhood). A record is then missed
        only if its writer's stores failed on all of the replicas read: for soft state
        that is written again (training progress), a read of 1 remote node instead of
        ``num_replicas + 2``."""
        return (await self.get_many([key], latest=latest, quorum=quorum))[key]

    async def get_many(
        self, keys: Sequence[Any], latest: bool = False, quorum: int | None = None
    ) -> dict[Any, ValueWithExpiration | None]:
        if quorum is not None:
            if not latest:
                raise ValidationError("a read quorum applies to latest-gets only")
            if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 1:
                raise ValidationError(f"quorum must be a positive integer, got {quorum!r}")
        serialized = {key: serialize(key) for key in keys}
        results = await asyncio.gather(
            *(self._get_serialized(serialized[key], latest, quorum) for key in keys)
        )
        return dict(zip(keys, results, strict=True))

    async def _get_serialized(
        self, key_bytes: bytes, latest: bool, quorum: int | None = None
    ) -> ValueWithExpiration | None:
        key_id = DHTID.generate(key_bytes)
        if not latest:
            local = self._local_record(key_id)
            if local is not None:
                self._hot_cache_keys[key_id] = key_bytes
                return self._to_user_value(key_bytes, [local])
        pending_key = (key_id, latest, quorum)
        if self.reuse_get_requests and pending_key in self._pending_gets:
            return await asyncio.shield(self._pending_gets[pending_key])
        future = self._loop.create_future()
        if self.reuse_get_requests:
            self._pending_gets[pending_key] = future
        try:
            value = await self._search(key_bytes, key_id, latest, quorum)
            if not latest and value is not None and self.cache_locally:
                # kept fresh while it is read from the cache (see _refresh_hot_cache)
                self._hot_cache_keys[key_id] = key_bytes
            future.set_result(value)
            return value
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: concurrent getters re-raise it themselves
            raise
        finally:
            self._pending_gets.pop(pending_key, None)

    async def _search(
        self, key_bytes: bytes, key_id: DHTID, latest: bool, quorum: int | None = None
    ):
        # Records live on the num_replicas nearest nodes; a latest-get reads two more
        # (margin for writers that saw a slightly different neighbourhood; a node that
        # fails to answer is replaced by the next one anyway). It will ask every one of
        # them, so it asks them all at once.
        width = min(self.bucket_size, self.num_replicas + 2) if latest else None
        # A latest-get names the dictionary entries it already holds (validated when they
        # came in) and hears only of newer ones; what it holds is merged in below.
        local = self._local_record(key_id)
        known = None
        if latest and local is not None and local.dictionary:
            known = tuple((protocol.subkey_digest(s), e) for s, _, e in local.dictionary)
        lookup = None
        if latest and quorum is not None:
            lookup = await self._read_quorum(key_id, quorum, known)
        if lookup is None:
            lookup = await self._lookup(
                key_id, find_value=True, latest=latest, k=width, alpha=width, known_versions=known
            )
        records = [record for _, record in lookup.records]
        local = self._local_record(key_id)  # it may have changed during the lookup
        if local is not None:
            records.append(local)
        valid = [v for v in (self._valid_part(key_bytes, r) for r in records) if v is not None]
        if not valid:
            return None
        merged = _merge_records(valid)
        if merged.dictionary == ():  # "nothing newer", and what we held has expired since
            return None
        if self.cache_locally:
            self._cache_record(key_id, merged)
        if self.cache_nearest and lookup.lacking:
            self._spawn(
                self._cache_on_path(key_bytes, merged, lookup.lacking[: self.cache_nearest])
            )
        return self._to_user_value(key_bytes, [merged])

    async def _read_quorum(
        self, key_id: DHTID, quorum: int, known: tuple[tuple[bytes, float], ...] | None
    ) -> LookupResult | None:
        """What ``quorum`` replicas of key_id hold (see :meth:`get`), this node counting
        as one if it is a replica (its record is merged in by the caller); None when a
        full read is needed."""
        replicas, known_nodes = self._known_replicas(key_id)
        farthest = replicas[-1][0] ^ key_id if len(replicas) == self.num_replicas else None
        we_are_replica = not self.client_mode and (
            farthest is None or self.node_id ^ key_id <= farthest
        )
        needed = quorum - we_are_replica
        result = LookupResult(nearest=[], hops=1)
        candidates = [peer_id for _, peer_id in replicas]
        self._rng.shuffle(candidates)  # readers spread over the replicas
        while len(result.nearest) < needed:
            batch = candidates[: needed - len(result.nearest)]
            del candidates[: len(batch)]
            if not batch:
                return None  # too few replicas answered
            answers = await asyncio.gather(
                *(
                    self._find(peer_id, key_id, self.num_replicas, True, known, known_nodes)
                    for peer_id in batch
                )
            )
            for peer_id, answer in zip(batch, answers, strict=True):
                if answer is None:
                    continue
                if self._names_a_replica_we_lack(answer, key_id, replicas):
                    return None  # we do not know the neighbourhood: read it whole
                result.nearest.append((DHTID.for_peer(peer_id), peer_id))
                if answer.record is not None:
                    result.records.append((peer_id, answer.record))
                else:
                    result.lacking.append(peer_id)
        return result

    def _known_replicas(self, key_id: DHTID) -> tuple[list[tuple[DHTID, PeerID]], set[bytes]]:
        """The routing table's num_replicas nearest nodes to key_id, and the prefixes that
        ask a find answer to leave them out (so that it names only nodes we lack)."""
        replicas = self.routing.get_nearest_neighbors(key_id, self.num_replicas)
        return replicas, {protocol.node_prefix(node_id) for node_id, _ in replicas}

    def _names_a_replica_we_lack(
        self, answer: FindAnswer, key_id: DHTID, replicas: list[tuple[DHTID, PeerID]]
    ) -> bool:
        """Whether a find answer (asked to leave out ``replicas``, our nearest nodes to
        key_id) names a node that belongs among them: one nearer than the farthest of
        them, or any node when we know fewer than num_replicas."""
        full = len(replicas) == self.num_replicas
        farthest = replicas[-1][0] ^ key_id if full else None
        return any(
            found != self.peer_id
            and (farthest is None or DHTID.for_peer(found) ^ key_id < farthest)
            for found, _ in answer.nearest
        )

    async def _probed_replicas(self, key_id: DHTID) -> list[tuple[DHTID, PeerID]] | None:
        """The routing table's ``num_replicas`` nearest nodes to key_id, if one of them
        (at random) knows no node that belongs among them; None when it does, does not
        answer, or there are none: look the neighbourhood up.

        A store used to look up its key's neighbourhood by asking the num_replicas + 2
        nearest known nodes, every time, though in a settled swarm every answer only
        confirms the routing table: a streaming DiLoCo peer's 36 stores a minute made
        144 of its requests. Asking one of them checks the same thing: a node that knew
        a nearer one would name it."""
        replicas, known_nodes = self._known_replicas(key_id)
        if not replicas:
            return None
        probe = self._rng.choice(replicas)[1]
        answer = await self._find(probe, key_id, self.num_replicas, False, None, known_nodes)
        if answer is None or self._names_a_replica_we_lack(answer, key_id, replicas):
            return None
        return replicas

    def _local_record(self, key_id: DHTID) -> FoundRecord | None:
        found = [
            _record_from_storage(entry)
            for entry in (self.storage.get(key_id), self.cache.get(key_id))
            if entry is not None
        ]
        found = [r for r in found if r is not None]
        return _merge_records(found) if found else None

    def _valid_part(self, key_bytes: bytes, record: FoundRecord) -> FoundRecord | None:
        """The record without what fails validation: a dictionary keeps its valid entries
        (one forged subkey, stored by a node that does not check it, must not hide every
        honest entry of the key), a plain value is kept or dropped whole."""
        validate = self.protocol_validator.validate
        if record.dictionary is not None:
            entries = tuple(
                (sub, value, exp)
                for sub, value, exp in record.dictionary
                if validate(DHTRecord(key_bytes, sub, value, exp))
            )
            if not entries and record.dictionary:
                return None
            if len(entries) == len(record.dictionary):
                return record
            return FoundRecord(dictionary=entries)
        if validate(DHTRecord(key_bytes, NO_SUBKEY, record.value, record.expiration_time)):
            return record
        return None

    def _cache_record(self, key_id: DHTID, record: FoundRecord) -> None:
        try:
            if record.dictionary is not None:
                for sub, value, exp in record.dictionary:
                    self.cache.store(key_id, value, exp, subkey=sub)
            else:
                self.cache.store(key_id, record.value, record.expiration_time)
        except ValidationError:
            pass

    async def _cache_on_path(self, key_bytes: bytes, record: FoundRecord, peers: list[PeerID]):
        if record.dictionary is not None:
            items = [StoreItem(key_bytes, s, v, e, in_cache=True) for s, v, e in record.dictionary]
        else:
            items = [StoreItem(key_bytes, None, record.value, record.expiration_time, True)]
        await asyncio.gather(*(self._store_remote(p, items) for p in peers))

    def _to_user_value(self, key_bytes: bytes, records: list[FoundRecord]):
        record = _merge_records(records)
        strip = self.protocol_validator.strip_value
        now = self.time_fn()
        try:
            if record.dictionary is not None:
                entries = {}
                for sub, value, exp in record.dictionary:
                    if exp <= now:
                        continue
                    plain = deserialize(strip(DHTRecord(key_bytes, sub, value, exp)))
                    if plain is not None:  # None marks a deleted subkey
                        entries[deserialize(sub)] = ValueWithExpiration(plain, exp)
                if not entries:
                    return None
                return ValueWithExpiration(
                    entries, max(e.expiration_time for e in entries.values())
                )
            if record.expiration_time <= now:
                return None
            plain = strip(DHTRecord(key_bytes, NO_SUBKEY, record.value, record.expiration_time))
            value = deserialize(plain)
            if value is None:  # deleted
                return None
            return ValueWithExpiration(value, record.expiration_time)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            logger.debug("dropping an undecodable value under %r: %s", key_bytes[:40], e)
            return None

    # ------------------------------------------------------------------ handlers

    async def _rpc_ping(self, request: Any, context: RPCContext) -> dict:
        self._heard_from(context.remote_id, request)
        return protocol.encode_pong(self.time_fn(), self.client_mode)

    async def _rpc_store(self, request: Any, context: RPCContext) -> dict:
        items = protocol.decode_store(request)
        self._heard_from(context.remote_id, request.get("sender"))
        results = [self._store_locally(item, context.remote_id) for item in items]
        return protocol.encode_store_result(results)

    async def _rpc_find(self, request: Any, context: RPCContext) -> dict:
        key_ids = protocol.decode_find(request)
        k = protocol.requested_neighbors(request, self.bucket_size)
        skipped = protocol.skipped_records(request, len(key_ids))
        known = protocol.known_versions(request, len(key_ids))
        known_nodes = protocol.known_node_prefixes(request, len(key_ids))
        self._heard_from(context.remote_id, request.get("sender"))
        requester = DHTID.for_peer(context.remote_id)
        entries = self._answer_entries_now()
        answers = []
        budget = protocol.MAX_ANSWER_RECORD_BYTES
        for index, key_id in enumerate(key_ids):
            nearest = self.routing.get_nearest_neighbors(key_id, k, exclude=requester)
            if index in known_nodes:
                skip_nodes = known_nodes[index]
                prefix = protocol.node_prefix
                nearest = [(n, p) for n, p in nearest if prefix(n) not in skip_nodes]
            record = None
            if index not in skipped:
                record = _newer_than(self._local_record(key_id), known.get(index))
                record = _fit_record(record, budget)
            budget -= _record_size(record)
            listed = [entries.get(p) or self._answer_entry(p) for _, p in nearest]
            answers.append(FindAnswer(record, tuple(listed)))
        return protocol.encode_find_result(answers)

    # ------------------------------------------------------------------ maintenance

    async def _maintain(self) -> None:
        """Hand-off to new nodes, cache refresh and bucket refresh, forever."""
        tick = min(1.0, self.cache_refresh_before_expiry / 2)
        last_bucket_refresh = self.time_fn()
        while True:
            await asyncio.sleep(tick)
            self._sender = None
            if self._handoff_queue:
                newcomers, self._handoff_queue = self._handoff_queue, set()
                await self._hand_off(newcomers)
            await self._refresh_hot_cache()
            if len(self._serialized_keys) > 2 * len(self.storage) + 1000:
                stored = set(self.storage.keys())
                self._serialized_keys = {
                    k: v for k, v in self._serialized_keys.items() if k in stored
                }
            if self.time_fn() - last_bucket_refresh >= self.refresh_period:
                last_bucket_refresh = self.time_fn()
                for bucket in self.routing.buckets_to_refresh(self.refresh_period):
                    probe = bucket.random_id(self._rng)
                    await self._lookup(probe, find_value=False)

    async def _hand_off(self, newcomers: set[PeerID]) -> None:
        """Give newly joined nodes the records they are now among the nearest to."""
        batches: dict[PeerID, list[StoreItem]] = {p: [] for p in newcomers}
        for key_id, entry in list(self.storage.items())[:10_000]:
            key_bytes = self._serialized_keys.get(key_id)
            if key_bytes is None:
                continue
            nearest = {
                pid for _, pid in self.routing.get_nearest_neighbors(key_id, self.num_replicas)
            }
            targets = nearest & newcomers
            if not targets:
                continue
            record = _record_from_storage(entry)
            if record is None:
                continue
            if record.dictionary is not None:
                items = [StoreItem(key_bytes, s, v, e) for s, v, e in record.dictionary]
            else:
                items = [StoreItem(key_bytes, None, record.value, record.expiration_time)]
            for target in targets:
                batches[target].extend(items)
        await asyncio.gather(
            *(
                self._store_remote(peer_id, items[: protocol.MAX_BATCH])
                for peer_id, items in batches.items()
                if items
            )
        )

    async def _refresh_hot_cache(self) -> None:
        """Fetch again, shortly before they expire, cached keys that were read.

        Only reads that the cache can answer count (plain gets, as hivemind's
        ``cache_refresh_before_expiry``): a latest-get asks the network every time anyway,
        and a refresh is not a read. When both counted, a streaming DiLoCo peer refreshed
        its progress key about once a second (as many searches as its own progress reads),
        and a key read once was refreshed for as long as it existed."""
        now = self.time_fn()
        due = []
        for key_id, key_bytes in list(self._hot_cache_keys.items()):
            entry = self.cache.get(key_id)
            if entry is None:
                del self._hot_cache_keys[key_id]
            elif entry.expiration_time - now <= self.cache_refresh_before_expiry:
                del self._hot_cache_keys[key_id]
                due.append(key_bytes)
        if due:
            await asyncio.gather(*(self._search(k, DHTID.generate(k), False) for k in due))


def _record_from_storage(entry: ValueWithExpiration) -> FoundRecord | None:
    value = entry.value
    if isinstance(value, DictionaryDHTValue):
        items = tuple(
            (sub, item.value, item.expiration_time)
            for sub, item in value.items()
            if item.value is not None
        )
        return FoundRecord(dictionary=items) if items else None
    if value is None:
        return None
    return FoundRecord(value=value, expiration_time=entry.expiration_time)


def _newer_than(record: FoundRecord | None, known: dict[bytes, float] | None) -> FoundRecord | None:
    """A dictionary record without the entries the asker holds in that version or a
    later one; an empty dictionary (not None) says "I have the key, nothing newer", so
    the asker does not take this node for one that lacks the record."""
    if record is None or known is None or record.dictionary is None:
        return record
    digest = protocol.subkey_digest
    entries = tuple(
        entry for entry in record.dictionary if known.get(digest(entry[0]), -math.inf) < entry[2]
    )
    return record if len(entries) == len(record.dictionary) else FoundRecord(dictionary=entries)


def _entry_size(subkey: bytes, value: bytes) -> int:
    return len(subkey) + len(value) + 16  # + msgpack framing and the expiration


def _record_size(record: FoundRecord | None) -> int:
    if record is None:
        return 0
    if record.dictionary is not None:
        return sum(_entry_size(sub, value) for sub, value, _ in record.dictionary)
    return _entry_size(b"", record.value)


def _fit_record(record: FoundRecord | None, budget: int) -> FoundRecord | None:
    """The record, or as much of it as fits in ``budget`` bytes of a find answer (for a
    dictionary: its freshest entries). Without this, enough subkeys under one key (anyone
    may add them) made every find including that key fail with FrameTooLarge."""
    if record is None or _record_size(record) <= budget:
        return record
    if record.dictionary is None:
        return None
    kept = []
    for entry in sorted(record.dictionary, key=lambda entry: entry[2], reverse=True):
        budget -= _entry_size(entry[0], entry[1])
        if budget < 0:
            break
        kept.append(entry)
    return FoundRecord(dictionary=tuple(kept)) if kept else None


def _merge_records(records: list[FoundRecord]) -> FoundRecord:
    """The freshest view: per subkey the latest expiration; between a plain value and a
    dictionary, whichever was written with the later expiration."""
    plain = [r for r in records if r.dictionary is None]
    dictionaries = [r for r in records if r.dictionary is not None]
    best_plain = max(plain, key=lambda r: r.expiration_time) if plain else None
    merged: dict[bytes, tuple[bytes, float]] = {}
    for record in dictionaries:
        for sub, value, exp in record.dictionary:
            if sub not in merged or exp > merged[sub][1]:
                merged[sub] = (value, exp)
    if merged:
        latest_dict = max(exp for _, exp in merged.values())
        if best_plain is None or latest_dict > best_plain.expiration_time:
            return FoundRecord(dictionary=tuple((s, v, e) for s, (v, e) in merged.items()))
    if best_plain is None:
        return FoundRecord(dictionary=())
    return best_plain


__all__ = ["DHTNode", "LookupResult", "ValueWithExpiration", "deserialize", "serialize"]
