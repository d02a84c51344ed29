"""A Kademlia DHT node running on a :class:`~swarmgrad.net.peer.Peer`.

What it does (see the end of this docstring for which module holds what):

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

Where the code is: the node is one object (every part reads and updates the same routing
table, storage and address book), written in parts that build on each other, each its
own module: :mod:`~swarmgrad.dht.traversal` (calls, batched finds, lookups) <
:mod:`~swarmgrad.dht.replication` (store, get, caching, hand-off) <
:mod:`~swarmgrad.dht.servicer` (the ``dht.*`` handlers) < this module (the node's state,
joining, knowing peers, maintenance). The rules for records are pure functions in
:mod:`~swarmgrad.dht.records`; the messages are in :mod:`~swarmgrad.dht.protocol`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from swarmgrad.dht import protocol
from swarmgrad.dht.records import NO_SUBKEY, deserialize, serialize
from swarmgrad.dht.replication import UNREACHABLE
from swarmgrad.dht.routing import DHTID, RoutingTable
from swarmgrad.dht.servicer import DHTServicer
from swarmgrad.dht.storage import DHTLocalStorage, ValueWithExpiration
from swarmgrad.dht.traversal import Blacklist, LookupResult
from swarmgrad.dht.validation import CompositeValidator, RecordValidatorBase
from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import (
    PeerUnreachable,
    ProtocolViolation,
    SwarmgradError,
    ValidationError,
)
from swarmgrad.utils.timeutils import get_dht_time

logger = logging.getLogger(__name__)

_RERANK_INTERVAL = 1.0  # seconds: see DHTNode._add_node
_MAX_TRACKED_PEERS = 65536
_LOOKUP_HOPS_KEPT = 100_000


class DHTNode(DHTServicer):
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
        self._initial_peers: list[str | Multiaddr] = []  # set by create(), to rejoin
        self._next_rejoin = -math.inf
        self._closed = False
        # statistics for benchmarks and tests: the hops of the latest lookups (bounded: a
        # peer that runs for days looks up several keys a second)
        self.lookup_hops: collections.deque[int] = collections.deque(maxlen=_LOOKUP_HOPS_KEPT)
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
        node._initial_peers = list(initial_peers or ())
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
        self.peer.add_servicer(self)

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
        self.peer.remove_servicer(self)
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
        # it reached us: whatever failed before (our own links, most often) works now
        self.blacklist.register_success(peer_id)
        self._learn_addresses(peer_id, maddrs)
        self._add_node(peer_id)

    @property
    def isolated(self) -> bool:
        """Whether every node this one knows is forgotten or banned: its lookups reach
        nobody, and what it reads is its own storage only. A node whose links went down
        gets here, as every node it called failed (see :meth:`_rejoin_if_isolated`)."""
        return not any(p not in self.blacklist for p in self.routing.peer_id_to_uid)

    async def _rejoin_if_isolated(self) -> None:
        """An isolated node joins again through its initial peers. Its failures were most
        likely its own links', not the others': the bans go (a node banned after four
        failures stays banned for 40 s), and the initial peers are dialed afresh, since
        nothing else would make it call anyone again."""
        if not self._initial_peers or not self.isolated:
            return
        now = self.time_fn()
        if now < self._next_rejoin:
            return
        self._next_rejoin = now + self.wait_timeout
        self.blacklist.clear()
        with contextlib.suppress(PeerUnreachable):
            await self._bootstrap(self._initial_peers, self.wait_timeout)
            logger.info("%s: rejoined the DHT through its initial peers", self.peer_id)

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

    # ------------------------------------------------------------------ maintenance

    async def _maintain(self) -> None:
        """Hand-off to new nodes, cache refresh and bucket refresh, forever."""
        tick = min(1.0, self.cache_refresh_before_expiry / 2)
        last_bucket_refresh = self.time_fn()
        while True:
            await asyncio.sleep(tick)
            self._sender = None
            await self._rejoin_if_isolated()
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


__all__ = [
    "NO_SUBKEY",
    "UNREACHABLE",
    "Blacklist",
    "DHTNode",
    "LookupResult",
    "ValueWithExpiration",
    "deserialize",
    "serialize",
]
