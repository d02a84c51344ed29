"""Values that expire: ``ValueWithExpiration`` and hivemind's ``TimedStorage``.

``get_dht_time`` is the clock of expiration times (wall-clock seconds, compared across
peers, which are assumed to agree within ``MAX_DHT_TIME_DISCREPANCY_SECONDS``). The DHT's
own storage (:mod:`swarmgrad.dht.storage`) is built for its records; ``TimedStorage`` is
the small generic one that hivemind programs use for their own caches.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from swarmgrad.utils.timeutils import DHTExpiration, get_dht_time

__all__ = [
    "DHTExpiration",
    "HeapEntry",
    "MAX_DHT_TIME_DISCREPANCY_SECONDS",
    "ROOT",
    "TimedStorage",
    "ValueWithExpiration",
    "get_dht_time",
]

KeyType = TypeVar("KeyType")
ValueType = TypeVar("ValueType")
MAX_DHT_TIME_DISCREPANCY_SECONDS = 3
ROOT = 0  # the index of a heap's top


class ValueWithExpiration(NamedTuple, Generic[ValueType]):
    """A value and the time it expires; unpacks as ``value, expiration_time``."""

    value: ValueType
    expiration_time: DHTExpiration


@dataclass(order=True, frozen=True)
class HeapEntry(Generic[KeyType]):
    """A key in the expiration heap, ordered by its expiration time."""

    expiration_time: DHTExpiration
    key: KeyType


class TimedStorage(Generic[KeyType, ValueType]):
    """A dict of values that expire; at most ``maxsize`` keys (the soonest to expire go
    first). ``store`` keeps the later-expiring value of a key; ``freeze()`` stops expiry
    while you read several keys."""

    frozen = False

    def __init__(self, maxsize: int | None = None):
        if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 1):
            raise ValueError(f"maxsize must be a positive int or None, got {maxsize!r}")
        self.maxsize = maxsize if maxsize is not None else float("inf")
        self.data: dict[KeyType, ValueWithExpiration[ValueType]] = {}
        self.expiration_heap: list[HeapEntry[KeyType]] = []
        self.key_to_heap: dict[KeyType, HeapEntry[KeyType]] = {}

    def _remove_outdated(self) -> None:
        now = get_dht_time()
        while (
            not self.frozen
            and self.expiration_heap
            and (self.expiration_heap[ROOT].expiration_time < now or len(self.data) > self.maxsize)
        ):
            entry = heapq.heappop(self.expiration_heap)
            if self.key_to_heap.get(entry.key) == entry:
                del self.data[entry.key], self.key_to_heap[entry.key]

    def store(self, key: KeyType, value: ValueType, expiration_time: DHTExpiration) -> bool:
        """Store unless expired or older than the stored value; True if stored."""
        if expiration_time < get_dht_time() and not self.frozen:
            return False
        current = self.data.get(key)
        if current is not None and current.expiration_time >= expiration_time:
            return False
        entry = HeapEntry(expiration_time, key)
        self.key_to_heap[key] = entry
        heapq.heappush(self.expiration_heap, entry)
        self.data[key] = ValueWithExpiration(value, expiration_time)
        self._remove_outdated()
        return key in self.data

    def get(self, key: KeyType) -> ValueWithExpiration[ValueType] | None:
        """The value and its expiration, or None if absent or expired."""
        self._remove_outdated()
        return self.data.get(key)

    def items(self) -> Iterator[tuple[KeyType, ValueWithExpiration[ValueType]]]:
        self._remove_outdated()
        return ((key, value) for key, value in self.data.items())

    def top(self) -> tuple[KeyType | None, ValueWithExpiration[ValueType] | None]:
        """The key that expires first and its value, or (None, None) when empty."""
        self._remove_outdated()
        while self.expiration_heap:
            entry = self.expiration_heap[ROOT]
            if self.key_to_heap.get(entry.key) == entry:
                return entry.key, self.data[entry.key]
            heapq.heappop(self.expiration_heap)
        return None, None

    def discard(self, key: KeyType) -> None:
        self.data.pop(key, None)
        self.key_to_heap.pop(key, None)

    def clear(self) -> None:
        self.data.clear()
        self.key_to_heap.clear()
        self.expiration_heap.clear()

    def __contains__(self, key: KeyType) -> bool:
        self._remove_outdated()
        return key in self.data

    def __len__(self) -> int:
        self._remove_outdated()
        return len(self.data)

    def __delitem__(self, key: KeyType) -> None:
        if key not in self:
            raise KeyError(key)
        self.discard(key)

    def __getitem__(self, key: KeyType) -> ValueWithExpiration[ValueType]:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.data})"

    @contextmanager
    def freeze(self) -> Iterator[TimedStorage]:
        """Nothing expires inside the block (nested blocks are fine)."""
        previous, self.frozen = self.frozen, True
        try:
            yield self
        finally:
            self.frozen = previous
