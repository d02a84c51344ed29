"""Where a DHT node's records go and come from: store with replication, get with
caching, quorum reads, hand-off to new neighbours and refresh of hot cached keys.

:class:`DHTReplication` is one part of :class:`~swarmgrad.dht.node.DHTNode` (a mixin over
the node's storage, cache and lookups; see :mod:`swarmgrad.dht.traversal`). The rules
that merge and trim records are pure functions in :mod:`swarmgrad.dht.records`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from swarmgrad.dht import protocol
from swarmgrad.dht.protocol import FindAnswer, FoundRecord, StoreItem
from swarmgrad.dht.records import (
    NO_SUBKEY,
    deserialize,
    merge_records,
    record_from_storage,
    serialize,
)
from swarmgrad.dht.routing import DHTID
from swarmgrad.dht.storage import DHTLocalStorage, ValueWithExpiration
from swarmgrad.dht.traversal import DHTTraversal, LookupResult
from swarmgrad.dht.validation import CompositeValidator, DHTRecord
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import AccessDenied, ProtocolViolation, ValidationError

logger = logging.getLogger("swarmgrad.dht.node")  # the node's log, as before the split

#: what _store_remote reports for a node that did not answer
UNREACHABLE = "unreachable"


class DHTReplication(DHTTraversal):
    """Store, get, caching and replication of a :class:`~swarmgrad.dht.node.DHTNode`."""

    # node state this part uses (set by DHTNode.__init__)
    storage: DHTLocalStorage
    cache: DHTLocalStorage
    protocol_validator: CompositeValidator
    num_replicas: int
    client_mode: bool
    cache_locally: bool
    cache_nearest: int
    cache_on_store: bool
    cache_refresh_before_expiry: float
    reuse_get_requests: bool
    max_key_bytes: int
    max_value_bytes: int
    max_expiration_ahead: float
    time_fn: Callable[[], float]
    _may_store: bool
    _pending_gets: dict[tuple, asyncio.Future]
    _hot_cache_keys: dict[DHTID, bytes]
    _serialized_keys: dict[DHTID, bytes]

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
            if self.cache_on_store:  # only what some replica accepted: a refused
                for index in indices:  # record must not be served from our cache
                    if stored[index]:
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
            positive_int("quorum", quorum)
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
        merged = merge_records(valid)
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
            record_from_storage(entry)
            for entry in (self.storage.get(key_id), self.cache.get(key_id))
            if entry is not None
        ]
        found = [r for r in found if r is not None]
        return merge_records(found) if found else None

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
        record = merge_records(records)
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
            record = record_from_storage(entry)
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


__all__ = ["UNREACHABLE", "DHTReplication"]
