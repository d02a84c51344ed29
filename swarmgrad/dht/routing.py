"""Kademlia routing: node ids, k-buckets and the routing table. Pure logic, no I/O.

Every DHT node and every key has a 160-bit :class:`DHTID`; the distance between two ids
is their XOR. A node keeps the peers it knows in a :class:`RoutingTable`: a list of
:class:`KBucket` objects that partition the id space into aligned ranges (the leaves of a
binary trie). Each bucket holds at most ``bucket_size`` nodes, least recently seen first,
plus a small cache of replacements heard from while the bucket was full.

Two decisions from the Kademlia paper shape the table:

* a full bucket is split in two only if it covers our own id, or if its depth is not a
  multiple of ``depth_modulo`` (section 4.2): we know the ids near us in detail, and far
  away ranges coarsely, so the table holds O(k log n) nodes;
* a full bucket that cannot split never evicts a live node for a new one: long-lived
  nodes are the ones most likely to stay, and an attacker cannot flush the table by
  flooding it with new ids. The table tells the caller which old node to ping; if that
  node is dead, the caller removes it and the freshest replacement takes its place.

Node ids are derived from PeerIDs (:meth:`DHTID.for_peer`) so a peer cannot choose where
it sits in the id space; the table itself accepts any (node id, PeerID) pair and leaves
that check to the protocol.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import random
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable
from typing import overload

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["DHTID", "KBucket", "RoutingTable"]

_ID_BITS = 160
_ID_BYTES = _ID_BITS // 8
_ID_LIMIT = 1 << _ID_BITS


class DHTID(int):
    """A 160-bit Kademlia id: of a node (``DHTID.for_peer``) or of a key (``generate``).

    An ``int`` subclass, so ids compare, hash and XOR like numbers; arithmetic on them
    returns plain ints (a distance is not an id).
    """

    __slots__ = ()

    HASH_NBYTES = _ID_BYTES
    MIN = 0
    MAX = _ID_LIMIT
    RANGE = (MIN, MAX)

    def __new__(cls, value: int) -> DHTID:
        if not 0 <= value < _ID_LIMIT:
            raise ValidationError(f"a DHTID is an integer in [0, 2**160), got {value!r:.60}")
        return super().__new__(cls, value)

    @classmethod
    def generate(cls, source: bytes | str | None = None) -> DHTID:
        """The SHA-1 of ``source`` (a str is UTF-8 encoded); a random id if None.

        Random ids come from the ``random`` module, not ``os.urandom``: they are only used
        for lookups (refreshing a bucket, tests), never for identity, and a seeded
        simulation must replay the same run.
        """
        if source is None:
            return super().__new__(cls, random.getrandbits(_ID_BITS))
        if isinstance(source, str):
            source = source.encode("utf-8")
        elif not isinstance(source, bytes | bytearray | memoryview):
            raise ValidationError(
                f"DHTID.generate expects bytes, str or None, got {type(source).__name__}"
            )
        digest = hashlib.sha1(source, usedforsecurity=False).digest()
        return super().__new__(cls, int.from_bytes(digest, "big"))

    @classmethod
    def for_peer(cls, peer_id: PeerID) -> DHTID:
        """The node id of a peer: the hash of its PeerID, so nobody picks their place."""
        return _node_id_of(cls, peer_id)

    def to_bytes(self) -> bytes:  # type: ignore[override]
        """20 bytes, big-endian."""
        return int.to_bytes(self, _ID_BYTES, "big")

    @classmethod
    def from_bytes(cls, raw: bytes) -> DHTID:  # type: ignore[override]
        """Parse the 20-byte big-endian form; ValidationError on any other length."""
        if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) != _ID_BYTES:
            shown = len(raw) if isinstance(raw, bytes | bytearray | memoryview) else type(raw)
            raise ValidationError(f"a DHTID is {_ID_BYTES} bytes, got {shown!r}")
        return super().__new__(cls, int.from_bytes(raw, "big"))

    @overload
    def xor_distance(self, other: int) -> int: ...
    @overload
    def xor_distance(self, other: Iterable[int]) -> list[int]: ...

    def xor_distance(self, other: int | Iterable[int]) -> int | list[int]:
        """Kademlia distance to one id, or to each id of a sequence."""
        if isinstance(other, int):
            return int(self) ^ other
        me = int(self)
        return [me ^ item for item in other]

    def __repr__(self) -> str:
        return f"DHTID(0x{int(self):040x}"[:18] + "...)"


@functools.lru_cache(maxsize=65536)  # lookups hash the same few hundred peers over and over
def _node_id_of(cls: type[DHTID], peer_id: PeerID) -> DHTID:
    return cls.generate(peer_id.to_bytes())


class KBucket:
    """The nodes whose ids fall in ``[lower, upper)``: at most ``size`` of them, least
    recently seen first, plus up to ``max_replacements`` nodes heard from while the bucket
    was full (freshest last), ready to take the place of a node that dies.

    ``last_updated`` is the time (``time_fn``) we last heard from a node in this range;
    removing a node does not count, since losing a node is a reason to look for others.
    """

    __slots__ = (
        "_time_fn",
        "depth",
        "last_updated",
        "lower",
        "max_replacements",
        "nodes_requested_for_ping",
        "nodes_to_peer_id",
        "prefix_mask",
        "replacement_nodes",
        "size",
        "upper",
    )

    def __init__(
        self,
        lower: int,
        upper: int,
        size: int,
        depth: int = 0,
        *,
        max_replacements: int | None = None,
        time_fn: Callable[[], float] = get_dht_time,
    ):
        width = upper - lower
        if not (0 <= lower < upper <= _ID_LIMIT) or width & (width - 1) or lower % width:
            raise ValidationError(
                f"a k-bucket covers an aligned power-of-two range of ids, got [{lower}, {upper})"
            )
        if size < 1:
            raise ValidationError(f"a k-bucket holds at least one node, got size={size}")
        self.lower, self.upper, self.size, self.depth = lower, upper, size, depth
        self.max_replacements = size if max_replacements is None else max_replacements
        # Ids in this bucket share their top bits with ``lower``; ``(q ^ lower) & mask`` is
        # the smallest XOR distance from ``q`` to any id of the bucket.
        self.prefix_mask = -width
        self.nodes_to_peer_id: dict[DHTID, PeerID] = {}  # least recently seen first
        self.replacement_nodes: dict[DHTID, PeerID] = {}  # freshest last
        self.nodes_requested_for_ping: set[DHTID] = set()
        self._time_fn = time_fn
        self.last_updated = time_fn()

    def has_in_range(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def add_or_update_node(self, node_id: DHTID, peer_id: PeerID) -> bool:
        """We heard from this node. True if it is (now) in the bucket, as its most recently
        seen node; False if the bucket is full, in which case the node goes to the
        replacement cache (the oldest replacement is forgotten if the cache is full)."""
        if not self.lower <= node_id < self.upper:
            raise ValidationError(f"{node_id!r} is outside the bucket [{self.lower}, {self.upper})")
        self.last_updated = self._time_fn()
        nodes = self.nodes_to_peer_id
        if node_id in nodes:
            del nodes[node_id]  # re-insert at the end: most recently seen
            nodes[node_id] = peer_id
            self.nodes_requested_for_ping.discard(node_id)
            return True
        if len(nodes) < self.size:
            nodes[node_id] = peer_id
            self.replacement_nodes.pop(node_id, None)
            return True
        replacements = self.replacement_nodes
        replacements.pop(node_id, None)
        if self.max_replacements > 0:
            replacements[node_id] = peer_id
            if len(replacements) > self.max_replacements:
                del replacements[next(iter(replacements))]
        return False

    def request_ping_node(self) -> tuple[DHTID, PeerID] | None:
        """The least recently seen node that nobody was asked to ping yet, or None.

        Used when the bucket is full: the caller pings this node, then either reports it
        alive (``add_or_update_node``) or removes it (``del bucket[node_id]``).
        """
        requested = self.nodes_requested_for_ping
        for node_id, peer_id in self.nodes_to_peer_id.items():
            if node_id not in requested:
                requested.add(node_id)
                return node_id, peer_id
        return None

    def remove(self, node_id: DHTID) -> None:
        """Forget a node (from the bucket or the replacement cache), promoting nobody.
        KeyError if the bucket does not know it."""
        if node_id in self.nodes_to_peer_id:
            del self.nodes_to_peer_id[node_id]
            self.nodes_requested_for_ping.discard(node_id)
        else:
            del self.replacement_nodes[node_id]

    def promote_replacement(self) -> tuple[DHTID, PeerID] | None:
        """Move the freshest replacement into the bucket if there is room; return it."""
        if len(self.nodes_to_peer_id) >= self.size or not self.replacement_nodes:
            return None
        node_id, peer_id = self.replacement_nodes.popitem()
        self.nodes_to_peer_id[node_id] = peer_id
        return node_id, peer_id

    def __delitem__(self, node_id: DHTID) -> None:
        """Forget a node; if it was in the bucket, the freshest replacement takes its place."""
        in_bucket = node_id in self.nodes_to_peer_id
        self.remove(node_id)
        if in_bucket:
            self.promote_replacement()

    def __getitem__(self, node_id: DHTID) -> PeerID:
        return self.nodes_to_peer_id[node_id]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.nodes_to_peer_id

    def __len__(self) -> int:
        return len(self.nodes_to_peer_id)

    def split(self) -> tuple[KBucket, KBucket]:
        """Two buckets covering the lower and upper halves of this one, each with the
        nodes, replacements and ping requests that fall in it (order preserved)."""
        if self.upper - self.lower < 2:
            raise ValidationError(f"cannot split the single-id bucket [{self.lower}, {self.upper})")
        midpoint = (self.lower + self.upper) // 2
        halves = tuple(
            KBucket(
                lower,
                upper,
                self.size,
                self.depth + 1,
                max_replacements=self.max_replacements,
                time_fn=self._time_fn,
            )
            for lower, upper in ((self.lower, midpoint), (midpoint, self.upper))
        )
        left, right = halves
        for node_id, peer_id in self.nodes_to_peer_id.items():
            (left if node_id < midpoint else right).nodes_to_peer_id[node_id] = peer_id
        for node_id, peer_id in self.replacement_nodes.items():
            (left if node_id < midpoint else right).replacement_nodes[node_id] = peer_id
        for node_id in self.nodes_requested_for_ping:
            (left if node_id < midpoint else right).nodes_requested_for_ping.add(node_id)
        left.last_updated = right.last_updated = self.last_updated
        return left, right

    def random_id(self, rng: random.Random | None = None) -> DHTID:
        """A random id in this bucket's range (from ``rng`` if given): the target of a
        refresh lookup."""
        return DHTID((rng or random).randrange(self.lower, self.upper))

    def __repr__(self) -> str:
        return (
            f"KBucket([{self.lower:#x}, {self.upper:#x}), depth={self.depth}, "
            f"{len(self.nodes_to_peer_id)}/{self.size} nodes, "
            f"{len(self.replacement_nodes)} replacements)"
        )


class RoutingTable:
    """The nodes a DHT node knows, in k-buckets covering ``[0, 2**160)``.

    ``uid_to_peer_id`` and ``peer_id_to_uid`` map the nodes in the buckets (not the
    replacement caches) both ways; a PeerID is known under one node id at a time (a peer
    that shows up with another id replaces its old entry). Our own id is never stored.
    """

    def __init__(
        self,
        node_id: DHTID,
        bucket_size: int = 20,
        depth_modulo: int = 5,
        *,
        time_fn: Callable[[], float] = get_dht_time,
    ):
        if depth_modulo < 1:
            raise ValidationError(f"depth_modulo must be at least 1, got {depth_modulo}")
        self.node_id = node_id
        self.bucket_size = bucket_size
        self.depth_modulo = depth_modulo
        self._time_fn = time_fn
        self.buckets: list[KBucket] = [KBucket(0, _ID_LIMIT, bucket_size, time_fn=time_fn)]
        self._bucket_lowers: list[int] = [0]  # buckets[i].lower, for bisection
        self.uid_to_peer_id: dict[DHTID, PeerID] = {}
        self.peer_id_to_uid: dict[PeerID, DHTID] = {}

    def get_bucket_index(self, node_id: int) -> int:
        """Index in ``buckets`` of the bucket whose range holds ``node_id``."""
        return bisect_right(self._bucket_lowers, node_id) - 1

    def add_or_update_node(self, node_id: DHTID, peer_id: PeerID) -> tuple[DHTID, PeerID] | None:
        """We heard from ``peer_id`` (whose node id is ``node_id``): add it or mark it
        most recently seen.

        Returns None when the node is stored (or is ourselves, which is never stored).
        When its bucket is full and may not split, the node waits in the bucket's
        replacement cache and this returns the least recently seen ``(node_id, peer_id)``
        of that bucket: the caller should ping it, then call ``add_or_update_node`` for it
        if it answers or ``del table[node_id]`` if not (its freshest replacement then takes
        its place). None is also returned if every node of that full bucket already awaits
        a ping.
        """
        if node_id == self.node_id:
            return None
        previous_uid = self.peer_id_to_uid.get(peer_id)
        if previous_uid is not None and previous_uid != node_id:
            # The peer now shows up under another id. Its old bucket must not promote a
            # replacement that carries this same peer: the peer would then be in the
            # table twice, under the promoted id and under ``node_id``.
            self._remove_node(previous_uid, arriving=peer_id)
        index = self.get_bucket_index(node_id)
        bucket = self.buckets[index]
        while (
            len(bucket.nodes_to_peer_id) >= bucket.size
            and node_id not in bucket.nodes_to_peer_id
            and (bucket.has_in_range(self.node_id) or bucket.depth % self.depth_modulo != 0)
            and bucket.upper - bucket.lower > 1
        ):
            self.split_bucket(index)
            index = self.get_bucket_index(node_id)
            bucket = self.buckets[index]
        previous_peer = bucket.nodes_to_peer_id.get(node_id)
        if bucket.add_or_update_node(node_id, peer_id):
            if previous_peer is not None and previous_peer != peer_id:
                del self.peer_id_to_uid[previous_peer]
            self.uid_to_peer_id[node_id] = peer_id
            self.peer_id_to_uid[peer_id] = node_id
            return None
        return bucket.request_ping_node()

    def split_bucket(self, index: int) -> None:
        """Replace ``buckets[index]`` by its two halves (replacements fill any room)."""
        left, right = self.buckets[index].split()
        self.buckets[index : index + 1] = [left, right]
        self._bucket_lowers[index : index + 1] = [left.lower, right.lower]
        self._fill_from_replacements(left)
        self._fill_from_replacements(right)

    def _fill_from_replacements(self, bucket: KBucket, arriving: PeerID | None = None) -> None:
        """Promote replacements while the bucket has room, skipping (and forgetting) any
        whose peer is meanwhile in the table under another id, or is ``arriving``: the
        peer being added under a new id."""
        while (promoted := bucket.promote_replacement()) is not None:
            node_id, peer_id = promoted
            if peer_id in self.peer_id_to_uid or peer_id == arriving:
                bucket.remove(node_id)
                continue
            self.uid_to_peer_id[node_id] = peer_id
            self.peer_id_to_uid[peer_id] = node_id

    def _remove_node(self, node_id: DHTID, arriving: PeerID | None = None) -> None:
        bucket = self.buckets[self.get_bucket_index(node_id)]
        if node_id in bucket.nodes_to_peer_id:
            bucket.remove(node_id)
            peer_id = self.uid_to_peer_id.pop(node_id)
            del self.peer_id_to_uid[peer_id]
            self._fill_from_replacements(bucket, arriving)
        else:
            bucket.remove(node_id)  # a replacement, or KeyError

    def __delitem__(self, node_id: DHTID) -> None:
        """Forget a node (dead, or misbehaving); a replacement takes its place. Also
        forgets a node waiting in a replacement cache. KeyError if unknown."""
        self._remove_node(node_id)

    def get_nearest_neighbors(
        self,
        query_id: int,
        k: int,
        exclude: int | Collection[int] | None = None,
    ) -> list[tuple[DHTID, PeerID]]:
        """Up to ``k`` known nodes nearest to ``query_id`` by XOR distance, nearest first
        (exact). ``exclude`` is a node id, or a collection of them, to leave out (e.g. the
        requester, which does not need to learn about itself).

        Buckets are aligned ranges, so the distances from ``query_id`` to the ids of
        different buckets fall in disjoint intervals: visiting buckets by the lower end of
        their interval and sorting each bucket's nodes gives the exact order while looking
        only at the few buckets needed.
        """
        if k <= 0:
            return []
        if exclude is None:
            excluded: Collection[int] = ()
        elif isinstance(exclude, int):
            excluded = (exclude,)
        elif isinstance(exclude, set | frozenset | dict):
            excluded = exclude
        else:
            excluded = set(exclude)
        order = [
            ((query_id ^ bucket.lower) & bucket.prefix_mask, index)
            for index, bucket in enumerate(self.buckets)
            if bucket.nodes_to_peer_id
        ]
        heapq.heapify(order)
        result: list[tuple[DHTID, PeerID]] = []
        while order and len(result) < k:
            _, index = heapq.heappop(order)
            candidates = sorted(
                (query_id ^ node_id, node_id, peer_id)
                for node_id, peer_id in self.buckets[index].nodes_to_peer_id.items()
                if node_id not in excluded
            )
            for _, node_id, peer_id in candidates[: k - len(result)]:
                result.append((node_id, peer_id))
        return result

    def buckets_to_refresh(self, refresh_period: float) -> list[KBucket]:
        """Buckets we have not heard from for ``refresh_period`` seconds or more; the
        caller looks up a random id in each (``bucket.random_id()``) to find nodes there."""
        threshold = self._time_fn() - refresh_period
        return [bucket for bucket in self.buckets if bucket.last_updated <= threshold]

    def __contains__(self, item: object) -> bool:
        """Is this node (a DHTID) or peer (a PeerID) in the buckets?"""
        if isinstance(item, PeerID):
            return item in self.peer_id_to_uid
        return item in self.uid_to_peer_id

    @overload
    def __getitem__(self, item: DHTID) -> PeerID: ...
    @overload
    def __getitem__(self, item: PeerID) -> DHTID: ...

    def __getitem__(self, item: DHTID | PeerID) -> PeerID | DHTID:
        """The PeerID of a node id, or the node id of a PeerID; KeyError if unknown."""
        if isinstance(item, PeerID):
            return self.peer_id_to_uid[item]
        return self.uid_to_peer_id[item]

    def get(
        self,
        *,
        node_id: DHTID | None = None,
        peer_id: PeerID | None = None,
        default: object = None,
    ):
        """The PeerID of ``node_id``, or the node id of ``peer_id`` (exactly one)."""
        if (node_id is None) == (peer_id is None):
            raise ValidationError("RoutingTable.get takes exactly one of node_id or peer_id")
        if node_id is not None:
            return self.uid_to_peer_id.get(node_id, default)
        return self.peer_id_to_uid.get(peer_id, default)

    @property
    def peer_ids(self) -> list[PeerID]:
        """The PeerIDs of all nodes in the buckets."""
        return list(self.peer_id_to_uid)

    def __len__(self) -> int:
        return len(self.uid_to_peer_id)

    def __repr__(self) -> str:
        return f"RoutingTable({self.node_id!r}, {len(self)} nodes in {len(self.buckets)} buckets)"
