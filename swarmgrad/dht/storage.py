"""Local record storage of a DHT node: records with expiration times. Pure logic, no I/O.

A record is a value stored under a key until its expiration time (``time_fn`` seconds,
:func:`~swarmgrad.utils.timeutils.get_dht_time` by default). Keys are :class:`DHTID`\\ s;
values and subkeys are opaque ``bytes`` (the protocol serializes them). The rules, applied
the same way by every node so that replicas converge whatever order stores arrive in:

* **The later expiration wins.** A record replaces the one in its place only if it
  expires later. On a tie the stored record stays (storing the very same record again
  is harmless and reports success). Records already expired are refused.
* **Dictionary values.** A key holds either a plain value or a dictionary of subkeys,
  each subkey being a record of its own with its own expiration. Between the two kinds
  the later expiration wins too: a subkey record newer than the plain value turns the key
  into a dictionary; a plain record at least as new as every subkey replaces the whole
  dictionary (on a tie the plain record wins, so the outcome does not depend on arrival
  order). A plain record older than the dictionary's newest subkey is not stored but
  still supersedes the subkeys it is newer than: they are dropped, and later subkey
  records no newer than it are refused. With these rules any permutation of a set of
  stores (with distinct expirations per place) gives the same final state.
* **Deletes are tombstones.** Storing ``None`` deletes: the tombstone is a record like
  any other (it wins and loses by expiration), so an older store arriving later cannot
  resurrect the value. Reads hide tombstones, and a dictionary whose subkeys are all
  tombstones reads as absent; ``include_tombstones=True`` shows them (to replicate
  deletes).
* **Limits** (each a :class:`~swarmgrad.utils.errors.StorageLimitExceeded`): value size,
  subkey size, how far ahead an expiration may be, and how many live records one source
  peer may hold here. Reaching ``maxsize`` is not an error: the record that expires
  soonest makes room (a cache keeps what stays useful longest).

Expired records vanish lazily: every operation first pops expired records from a heap
ordered by expiration, so each costs O(log n) amortized. The heap is lazy (replaced
entries stay until they surface) and is rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from swarmgrad.dht.routing import DHTID
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import StorageLimitExceeded, ValidationError
from swarmgrad.utils.timed_storage import ValueWithExpiration  # hivemind.utils' too
from swarmgrad.utils.timeutils import DHTExpiration, get_dht_time

__all__ = [
    "DEFAULT_MAX_EXPIRATION_AHEAD",
    "DEFAULT_MAX_KEY_BYTES",
    "DEFAULT_MAX_VALUE_BYTES",
    "DHTLocalStorage",
    "DictionaryDHTValue",
    "ValueWithExpiration",
]

DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
"""Larger payloads belong in averaging or state transfer, not in DHT records."""
DEFAULT_MAX_KEY_BYTES = 4096
"""Serialized subkeys: expert uids, PeerIDs, ownership markers with a public key."""
DEFAULT_MAX_EXPIRATION_AHEAD = 7 * 24 * 3600.0
"""A week: generous for any TTL plus clock skew, short enough that junk goes away."""

ValueType = TypeVar("ValueType")

_INF = math.inf
# Heap entries are (expiration, sequence number, key). Sequence numbers are unique, so
# tuples never compare keys, and a record remembers the number of its current entry:
# an entry whose number differs is stale and skipped.
_sequence = itertools.count()


def _against_existing(
    previous: ValueWithExpiration, value: Any, expiration_time: float
) -> bool | None:
    """The one rule for a record arriving where another is stored: None if it replaces the
    stored one (it expires later); otherwise the answer to give (an older record: False;
    the same expiration: True only if it is the very same record, kept as it is)."""
    if expiration_time > previous.expiration_time:
        return None
    if expiration_time < previous.expiration_time:
        return False
    return value == previous.value


# A subkey's record inside a dictionary: (value and expiration, source peer, heap sequence)
_SubRecord = tuple[ValueWithExpiration, PeerID | None, int]


class DictionaryDHTValue:
    """A dictionary value: subkey -> ValueWithExpiration, each subkey expiring on its own.

    ``store`` keeps, per subkey, the record with the later expiration; expired subkeys
    vanish (``time_fn`` is the clock). A value of ``None`` is a tombstone (a deleted
    subkey); :class:`DHTLocalStorage` hands out dictionaries without tombstones unless
    asked for them. ``latest_expiration_time`` is the expiration of the whole dictionary
    (``-inf`` when empty).
    """

    __slots__ = ("_data", "_heap", "_latest", "_num_tombstones", "_time_fn")

    def __init__(self, time_fn: Callable[[], float] = get_dht_time):
        self._data: dict[Hashable, _SubRecord] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._latest = -_INF
        self._num_tombstones = 0
        self._time_fn = time_fn

    # --- public, self-expiring ---

    def store(self, subkey: Hashable, value: Any, expiration_time: DHTExpiration) -> bool:
        """Store ``value`` under ``subkey`` until ``expiration_time``. True if it is now
        the stored record (a later expiration than the previous one, or the very same
        record); False if it is already expired or an equal or later record is stored."""
        now = self._time_fn()
        self._drop_through(now)
        if not expiration_time > now:  # also refuses NaN
            return False
        old = self._data.get(subkey)
        if old is not None:
            previous = old[0]
            verdict = _against_existing(previous, value, expiration_time)
            if verdict is not None:
                return verdict
        self._put(subkey, ValueWithExpiration(value, expiration_time), None)
        return True

    def get(self, subkey: Hashable) -> ValueWithExpiration | None:
        self._drop_through(self._time_fn())
        record = self._data.get(subkey)
        return None if record is None else record[0]

    def items(self) -> list[tuple[Hashable, ValueWithExpiration]]:
        self._drop_through(self._time_fn())
        return [(subkey, record[0]) for subkey, record in self._data.items()]

    def keys(self) -> list[Hashable]:
        self._drop_through(self._time_fn())
        return list(self._data)

    @property
    def latest_expiration_time(self) -> DHTExpiration:
        self._drop_through(self._time_fn())
        return self._latest

    def __len__(self) -> int:
        self._drop_through(self._time_fn())
        return len(self._data)

    def __contains__(self, subkey: object) -> bool:
        self._drop_through(self._time_fn())
        return subkey in self._data

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DictionaryDHTValue):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"DictionaryDHTValue({dict(self.items())!r})"

    # --- internal, driven by DHTLocalStorage with explicit times ---

    def _put(self, subkey: Hashable, record: ValueWithExpiration, source: PeerID | None) -> None:
        """Store unconditionally (the caller decided)."""
        sequence = next(_sequence)
        data = self._data
        old = data.get(subkey)
        data[subkey] = (record, source, sequence)
        if old is not None and old[0].value is None:
            self._num_tombstones -= 1
        if record.value is None:
            self._num_tombstones += 1
        expiration_time = record.expiration_time
        if expiration_time > self._latest:
            self._latest = expiration_time
        heap = self._heap
        heapq.heappush(heap, (expiration_time, sequence, subkey))
        if len(heap) > 2 * len(data) + 16:
            heap[:] = [(r[0].expiration_time, r[2], k) for k, r in data.items()]
            heapq.heapify(heap)

    def _earliest(self) -> float:
        """Expiration of the record that expires first (inf if empty)."""
        heap, data = self._heap, self._data
        while heap:
            expiration_time, sequence, subkey = heap[0]
            record = data.get(subkey)
            if record is not None and record[2] == sequence:
                return expiration_time
            heapq.heappop(heap)
        return _INF

    def _pop_earliest(self) -> tuple[Hashable, _SubRecord]:
        """Remove the record that expires first (the dictionary must not be empty)."""
        self._earliest()
        _, _, subkey = heapq.heappop(self._heap)
        record = self._data.pop(subkey)
        if record[0].value is None:
            self._num_tombstones -= 1
        if not self._data:
            self._latest = -_INF
        return subkey, record

    def _drop_through(self, time: float) -> list[_SubRecord] | tuple[()]:
        """Remove every record expiring at or before ``time``; return them.

        Records leave in expiration order, so the latest expiration only changes when
        the dictionary becomes empty.
        """
        heap = self._heap
        if not heap or heap[0][0] > time:
            return ()
        data = self._data
        removed = []
        while heap and heap[0][0] <= time:
            _, sequence, subkey = heapq.heappop(heap)
            record = data.get(subkey)
            if record is None or record[2] != sequence:
                continue
            del data[subkey]
            if record[0].value is None:
                self._num_tombstones -= 1
            removed.append(record)
        if not data:
            self._latest = -_INF
        return removed

    def _has_live_value(self) -> bool:
        return len(self._data) > self._num_tombstones

    def _copy(self, include_tombstones: bool) -> DictionaryDHTValue:
        """An independent copy, with or without tombstones."""
        clone = DictionaryDHTValue(self._time_fn)
        if include_tombstones or not self._num_tombstones:
            clone._data = dict(self._data)
            clone._heap = list(self._heap)  # stale entries stay recognizably stale
            clone._latest = self._latest
            clone._num_tombstones = self._num_tombstones
        else:
            data = clone._data = {k: r for k, r in self._data.items() if r[0].value is not None}
            clone._heap = [(r[0].expiration_time, r[2], k) for k, r in data.items()]
            heapq.heapify(clone._heap)
            clone._latest = max((r[0].expiration_time for r in data.values()), default=-_INF)
        return clone


class _Slot:
    """What a storage key holds: a plain record, or a dictionary with a floor.

    ``floor`` is the expiration of the newest plain record the dictionary superseded or
    was superseded by in part: subkey records no newer than it are refused. ``seq`` and
    ``bound`` describe the key's live heap entry: ``bound`` never exceeds the expiration
    of the key's first-expiring record (for a dictionary it may be lower; the entry is
    corrected when it surfaces).
    """

    __slots__ = ("bound", "floor", "record", "seq", "source", "subkeys", "visible")

    def __init__(self) -> None:
        self.record: ValueWithExpiration[bytes | None] | None = None  # a plain record
        self.source: PeerID | None = None  # who stored the plain record
        self.subkeys: DictionaryDHTValue | None = None  # a dictionary value
        self.floor = -_INF
        self.seq = -1
        self.bound = _INF
        self.visible = False  # would get() return something


class DHTLocalStorage:
    """The records a DHT node stores for the swarm (or caches for itself).

    ``store`` applies the rules in this module's docstring. ``maxsize`` bounds the number
    of records held (plain records and subkeys, tombstones included); when it is reached
    the record that expires soonest is evicted. ``max_records_per_source`` bounds the
    live records stored with the same ``source`` peer. ``max_value_bytes`` and
    ``max_key_bytes`` (serialized subkeys) bound sizes; ``max_expiration_ahead`` bounds
    how far in the future an expiration may be. ``None`` disables a limit. ``time_fn``
    is the clock (tests pass a fake one).
    """

    def __init__(
        self,
        maxsize: int | None = None,
        *,
        max_records_per_source: int | None = None,
        max_value_bytes: int | None = DEFAULT_MAX_VALUE_BYTES,
        max_key_bytes: int | None = DEFAULT_MAX_KEY_BYTES,
        max_expiration_ahead: float | None = DEFAULT_MAX_EXPIRATION_AHEAD,
        time_fn: Callable[[], float] = get_dht_time,
    ):
        for name, limit in (
            ("maxsize", maxsize),
            ("max_records_per_source", max_records_per_source),
            ("max_value_bytes", max_value_bytes),
            ("max_key_bytes", max_key_bytes),
            ("max_expiration_ahead", max_expiration_ahead),
        ):
            if limit is not None and not limit >= 0:
                raise ValidationError(f"{name} must be None or non-negative, got {limit!r}")
        self.maxsize = maxsize
        self.max_records_per_source = max_records_per_source
        self.max_value_bytes = max_value_bytes
        self.max_key_bytes = max_key_bytes
        self.max_expiration_ahead = max_expiration_ahead
        self._time_fn = time_fn
        self._frozen = 0  # nesting depth of freeze(); clear() inside a block keeps it
        self._frozen_at = -_INF  # the time expiry stopped at, while frozen
        self.clear()

    def clear(self) -> None:
        """Forget every record."""
        self._slots: dict[DHTID, _Slot] = {}
        self._heap: list[tuple[float, int, DHTID]] = []
        self._num_records = 0  # plain records + subkey records, tombstones included
        self._num_visible = 0  # keys whose slot is visible
        self._records_by_source: dict[PeerID, int] = {}

    # --- writing ---

    def store(
        self,
        key_id: DHTID,
        value: bytes | None,
        expiration_time: DHTExpiration,
        subkey: bytes | None = None,
        source: PeerID | None = None,
    ) -> bool:
        """Store ``value`` (``None`` deletes) under ``key_id`` (and ``subkey``) until
        ``expiration_time``, on behalf of ``source`` (counted per peer; None for records
        the node itself wrote or caches).

        True if this is now the record in that place (including when the very same
        record was already there); False if it is already expired, if an equal or later
        record holds the place, or if the storage is full of records that outlive it.
        Raises StorageLimitExceeded for a record breaking a limit, ValidationError for
        arguments of the wrong type.
        """
        if not isinstance(key_id, DHTID):
            raise ValidationError(f"storage keys are DHTIDs, got {type(key_id).__name__}")
        _check_bytes(value, "a stored value", "max_value_bytes", self.max_value_bytes, key_id)
        _check_bytes(subkey, "a subkey", "max_key_bytes", self.max_key_bytes, key_id)
        if source is not None and not isinstance(source, PeerID):
            raise ValidationError(f"a record's source is a PeerID, got {type(source).__name__}")
        now = self._time_fn()
        if not expiration_time > now:
            if expiration_time != expiration_time:
                raise ValidationError(f"the expiration time for key {key_id!r} is NaN")
            return False
        ahead = self.max_expiration_ahead
        if ahead is not None and expiration_time - now > ahead:
            raise StorageLimitExceeded(
                f"the record for key {key_id!r} expires {expiration_time - now:.0f} s from "
                f"now, later than max_expiration_ahead={ahead:.0f} s"
            )
        if not self._frozen:
            self._remove_outdated(now)
        record = ValueWithExpiration(value, float(expiration_time))
        slot = self._slots.get(key_id)
        if slot is None:
            return self._store_new(key_id, subkey, record, source)
        if subkey is None:
            return self._store_plain(key_id, slot, record, source)
        return self._store_subkey(key_id, slot, subkey, record, source)

    def _store_new(
        self,
        key_id: DHTID,
        subkey: bytes | None,
        record: ValueWithExpiration,
        source: PeerID | None,
    ) -> bool:
        """A key not stored yet: a slot with the plain record, or with a one-subkey dictionary."""
        expiration_time = record.expiration_time
        self._check_source(source, 0, key_id)
        if not self._has_room_for(expiration_time):
            return False
        slot = self._slots[key_id] = _Slot()
        if subkey is None:
            slot.record, slot.source = record, source
        else:
            slot.subkeys = DictionaryDHTValue(self._view_time)
            slot.subkeys._put(subkey, record, source)
        self._added(source)
        self._push(key_id, slot, expiration_time)
        self._update_visibility(slot)
        self._shrink()
        return True

    def _replace_source(self, key_id: DHTID, old: PeerID | None, new: PeerID | None) -> None:
        """Account for a record of ``old`` that one of ``new`` replaces (raise if over limit)."""
        self._check_source(new, int(old == new), key_id)
        self._count(old, -1)
        self._count(new, 1)

    def _store_plain(
        self, key_id: DHTID, slot: _Slot, record: ValueWithExpiration, source: PeerID | None
    ) -> bool:
        expiration_time = record.expiration_time
        subkeys = slot.subkeys
        if subkeys is None:
            old = slot.record
            assert old is not None
            verdict = _against_existing(old, record.value, expiration_time)
            if verdict is not None:
                return verdict
            self._replace_source(key_id, slot.source, source)
            slot.record, slot.source = record, source
            self._push(key_id, slot, expiration_time)
            self._update_visibility(slot)
            return True
        if expiration_time >= subkeys._latest:  # the plain record replaces the dictionary
            if source is not None and self.max_records_per_source is not None:
                freed = sum(1 for r in subkeys._data.values() if r[1] == source)
                self._check_source(source, freed, key_id)
            self._release(list(subkeys._data.values()))
            slot.subkeys, slot.floor = None, -_INF
            slot.record, slot.source = record, source
            self._added(source)
            self._push(key_id, slot, expiration_time)
            self._update_visibility(slot)
            return True
        # The dictionary is newer: the plain record only supersedes the older subkeys.
        self._release(subkeys._drop_through(expiration_time))
        if expiration_time > slot.floor:
            slot.floor = expiration_time
        self._update_visibility(slot)
        return False

    def _store_subkey(
        self,
        key_id: DHTID,
        slot: _Slot,
        subkey: bytes,
        record: ValueWithExpiration,
        source: PeerID | None,
    ) -> bool:
        expiration_time = record.expiration_time
        subkeys = slot.subkeys
        if subkeys is None:  # a plain record: replaced by a dictionary if older
            old = slot.record
            assert old is not None
            if expiration_time <= old.expiration_time:  # the plain record wins ties
                return False
            self._replace_source(key_id, slot.source, source)
            slot.subkeys = DictionaryDHTValue(self._view_time)
            slot.subkeys._put(subkey, record, source)
            slot.floor = old.expiration_time
            slot.record = slot.source = None
            self._push(key_id, slot, expiration_time)
            self._update_visibility(slot)
            return True
        if expiration_time <= slot.floor:
            return False
        old_subrecord = subkeys._data.get(subkey)
        if old_subrecord is not None:
            previous = old_subrecord[0]
            verdict = _against_existing(previous, record.value, expiration_time)
            if verdict is not None:
                return verdict
            self._replace_source(key_id, old_subrecord[1], source)
            subkeys._put(subkey, record, source)
            self._update_visibility(slot)  # the heap entry stays a lower bound
            return True
        self._check_source(source, 0, key_id)
        if not self._has_room_for(expiration_time):
            return False
        subkeys._put(subkey, record, source)
        self._added(source)
        if expiration_time < slot.bound:
            self._push(key_id, slot, expiration_time)
        self._update_visibility(slot)
        self._shrink()
        return True

    # --- reading ---

    def get(
        self, key_id: DHTID, *, include_tombstones: bool = False
    ) -> ValueWithExpiration[bytes | DictionaryDHTValue | None] | None:
        """The record under ``key_id``: ``(bytes, expiration)`` for a plain value,
        ``(DictionaryDHTValue, latest subkey expiration)`` for a dictionary (a copy:
        changing it does not change the storage), None if absent, expired or deleted.

        ``include_tombstones=True`` also returns deletes: ``(None, expiration)`` for a
        deleted key, dictionaries with their deleted subkeys (value None).
        """
        self._purge()
        slot = self._slots.get(key_id)
        if slot is None:
            return None
        return self._read(slot, include_tombstones)

    def _read(self, slot: _Slot, include_tombstones: bool) -> ValueWithExpiration | None:
        if not (slot.visible or include_tombstones):
            return None
        subkeys = slot.subkeys
        if subkeys is None:
            return slot.record
        copy = subkeys._copy(include_tombstones)
        return ValueWithExpiration(copy, copy._latest)

    def items(
        self, *, include_tombstones: bool = False
    ) -> list[tuple[DHTID, ValueWithExpiration[bytes | DictionaryDHTValue | None]]]:
        """Every ``(key_id, record)`` that ``get`` would return (a snapshot list)."""
        self._purge()
        read = self._read
        return [
            (key_id, read(slot, include_tombstones))  # type: ignore[misc]
            for key_id, slot in self._slots.items()
            if slot.visible or include_tombstones
        ]

    def keys(self, *, include_tombstones: bool = False) -> list[DHTID]:
        """Every key ``get`` would find (a snapshot list)."""
        self._purge()
        return [k for k, slot in self._slots.items() if slot.visible or include_tombstones]

    def __iter__(self) -> Iterator[DHTID]:
        return iter(self.keys())

    def __contains__(self, key_id: object) -> bool:
        self._purge()
        slot = self._slots.get(key_id)  # type: ignore[call-overload]
        return slot is not None and slot.visible

    def __len__(self) -> int:
        """The number of keys ``get`` would find (tombstoned keys are not counted; see
        ``num_records`` for what ``maxsize`` bounds)."""
        self._purge()
        return self._num_visible

    @property
    def num_records(self) -> int:
        """Records held: plain records and subkeys, tombstones included."""
        self._purge()
        return self._num_records

    def records_by(self, source: PeerID) -> int:
        """Live records held here that ``source`` stored (tombstones included)."""
        self._purge()
        return self._records_by_source.get(source, 0)

    def top(self) -> tuple[DHTID, ValueWithExpiration] | None:
        """The record that expires soonest (the next to be evicted), tombstones included:
        ``(key_id, (value, expiration))``, where a subkey comes as a one-entry
        DictionaryDHTValue. None if the storage is empty."""
        self._purge()
        soonest = self._peek_soonest()
        if soonest is None:
            return None
        _, key_id, slot = soonest
        subkeys = slot.subkeys
        if subkeys is None:
            assert slot.record is not None
            return key_id, slot.record
        subkeys._earliest()
        subkey = subkeys._heap[0][2]
        record, source, _ = subkeys._data[subkey]
        single = DictionaryDHTValue(self._view_time)
        single._put(subkey, record, source)
        return key_id, ValueWithExpiration(single, record.expiration_time)

    # --- expiry ---

    def remove_outdated(self) -> None:
        """Drop every expired record now (every other method does it first anyway)."""
        self._purge()

    @contextmanager
    def freeze(self) -> Iterator[DHTLocalStorage]:
        """Pause expiry inside the block: records that expire meanwhile stay readable
        until it ends (a consistent view while iterating). Eviction for ``maxsize`` and
        the refusal of already-expired stores still apply.

        Records already expired when the block begins are dropped first, and
        dictionaries read inside the block (their clock is :meth:`_view_time`) keep the
        subkeys the storage keeps: expiry stands still at the moment the block began.
        """
        if not self._frozen:
            now = self._time_fn()
            self._remove_outdated(now)
            self._frozen_at = now
        self._frozen += 1
        try:
            yield self
        finally:
            self._frozen -= 1

    def _purge(self) -> None:
        if not self._frozen:
            self._remove_outdated(self._time_fn())

    def _view_time(self) -> float:
        """The clock of the dictionaries this storage hands out: stopped while frozen."""
        return self._frozen_at if self._frozen else self._time_fn()

    def _remove_outdated(self, now: float) -> None:
        heap, slots = self._heap, self._slots
        while heap and heap[0][0] <= now:
            _, sequence, key_id = heapq.heappop(heap)
            slot = slots.get(key_id)
            if slot is None or slot.seq != sequence:
                continue
            subkeys = slot.subkeys
            if subkeys is None:
                self._drop_plain(key_id, slot)
                continue
            self._release(subkeys._drop_through(now))
            self._requeue_or_delete(key_id, slot, subkeys)

    def _drop_plain(self, key_id: DHTID, slot: _Slot) -> None:
        """Remove a slot that holds a plain record, and account for the record."""
        self._count(slot.source, -1)
        self._num_records -= 1
        self._delete(key_id, slot)

    def _requeue_or_delete(self, key_id: DHTID, slot: _Slot, subkeys: DictionaryDHTValue) -> None:
        """After subkeys left a dictionary: queue it by its earliest left, or remove it if empty."""
        if subkeys._data:
            self._push(key_id, slot, subkeys._earliest())
            self._update_visibility(slot)
        else:
            self._delete(key_id, slot)

    # --- room ---

    def _has_room_for(self, expiration_time: float) -> bool:
        """Can a new record be added? When full, only by evicting one that expires sooner."""
        maxsize = self.maxsize
        if maxsize is None or self._num_records < maxsize:
            return True
        soonest = self._peek_soonest()
        return soonest is not None and expiration_time > soonest[0]

    def _shrink(self) -> None:
        maxsize = self.maxsize
        while maxsize is not None and self._num_records > maxsize:
            soonest = self._peek_soonest()
            assert soonest is not None
            _, key_id, slot = soonest
            subkeys = slot.subkeys
            if subkeys is None:
                self._drop_plain(key_id, slot)
                continue
            _, subrecord = subkeys._pop_earliest()
            self._release((subrecord,))
            self._requeue_or_delete(key_id, slot, subkeys)

    def _peek_soonest(self) -> tuple[float, DHTID, _Slot] | None:
        """The live heap entry of the record that expires first, made exact."""
        heap, slots = self._heap, self._slots
        while heap:
            expiration_time, sequence, key_id = heap[0]
            slot = slots.get(key_id)
            if slot is None or slot.seq != sequence:
                heapq.heappop(heap)
                continue
            if slot.subkeys is not None:
                exact = slot.subkeys._earliest()
                if exact > expiration_time:  # a lower bound: correct it and look again
                    slot.seq = next(_sequence)
                    slot.bound = exact
                    heapq.heapreplace(heap, (exact, slot.seq, key_id))
                    continue
            return expiration_time, key_id, slot
        return None

    # --- bookkeeping ---

    def _push(self, key_id: DHTID, slot: _Slot, expiration_time: float) -> None:
        sequence = slot.seq = next(_sequence)
        slot.bound = expiration_time
        heap = self._heap
        heapq.heappush(heap, (expiration_time, sequence, key_id))
        if len(heap) > 2 * len(self._slots) + 16:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        entries = []
        for key_id, slot in self._slots.items():
            subkeys = slot.subkeys
            if subkeys is None:
                assert slot.record is not None
                expiration_time = slot.record.expiration_time
            else:
                expiration_time = subkeys._earliest()
            slot.seq, slot.bound = next(_sequence), expiration_time
            entries.append((expiration_time, slot.seq, key_id))
        heap = self._heap
        heap[:] = entries  # in place: loops above hold a reference to the list
        heapq.heapify(heap)

    def _update_visibility(self, slot: _Slot) -> None:
        subkeys = slot.subkeys
        if subkeys is None:
            assert slot.record is not None
            visible = slot.record.value is not None
        else:
            visible = subkeys._has_live_value()
        if visible != slot.visible:
            slot.visible = visible
            self._num_visible += 1 if visible else -1

    def _delete(self, key_id: DHTID, slot: _Slot) -> None:
        del self._slots[key_id]
        if slot.visible:
            self._num_visible -= 1

    def _added(self, source: PeerID | None) -> None:
        self._num_records += 1
        self._count(source, 1)

    def _release(self, subrecords: list[_SubRecord] | tuple) -> None:
        """Account for subkey records that left the storage."""
        for _, source, _ in subrecords:
            self._count(source, -1)
        self._num_records -= len(subrecords)

    def _count(self, source: PeerID | None, delta: int) -> None:
        if source is not None:
            counts = self._records_by_source
            remaining = counts.get(source, 0) + delta
            if remaining > 0:
                counts[source] = remaining
            else:
                counts.pop(source, None)

    def _check_source(self, source: PeerID | None, freed: int, key_id: DHTID) -> None:
        """Raise if storing one more record from ``source`` (after ``freed`` of its
        records leave) would exceed max_records_per_source."""
        limit = self.max_records_per_source
        if limit is None or source is None:
            return
        held = self._records_by_source.get(source, 0)
        if held - freed >= limit:
            raise StorageLimitExceeded(
                f"peer {source} already stores {held} records here "
                f"(max_records_per_source={limit}); the record for key {key_id!r} is refused"
            )

    def __repr__(self) -> str:
        return (
            f"DHTLocalStorage({self._num_visible} keys, {self._num_records} records, "
            f"maxsize={self.maxsize})"
        )


def _check_bytes(
    data: bytes | None, what: str, limit_name: str, limit: int | None, key_id: DHTID
) -> None:
    """``data`` is None or bytes within ``limit``; else an error naming the key."""
    if data is None:
        return
    if not isinstance(data, bytes):
        raise ValidationError(
            f"{what} is bytes or None, got {type(data).__name__} for key {key_id!r}"
        )
    if limit is not None and len(data) > limit:
        raise StorageLimitExceeded(
            f"{what} of key {key_id!r} is {len(data)} bytes, more than {limit_name}={limit}"
        )
