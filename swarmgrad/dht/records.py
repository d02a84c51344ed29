"""DHT records as they are stored and travel: serialization and the rules that merge,
trim and filter them.

Pure functions, no I/O: the lookup, the store/get paths and the ``dht.find`` handler all
apply the same rules (the freshest expiration wins, a dictionary merges per subkey, a find
answer carries only what the asker lacks and what fits), so they live in one place.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from swarmgrad.dht import protocol
from swarmgrad.dht.protocol import FoundRecord
from swarmgrad.dht.storage import DictionaryDHTValue, ValueWithExpiration
from swarmgrad.utils.errors import ValidationError

NO_SUBKEY = b""  # the DHTRecord subkey of a plain (non-dictionary) value


def serialize(obj: Any) -> bytes:
    """Keys, subkeys and values on the wire: msgpack, bytes kept as bytes."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValidationError(f"DHT keys and values must be msgpack-serializable: {e}") from e


def deserialize(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def record_from_storage(entry: ValueWithExpiration) -> FoundRecord | None:
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


def newer_than(record: FoundRecord | None, known: dict[bytes, float] | None) -> FoundRecord | None:
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


def record_size(record: FoundRecord | None) -> int:
    if record is None:
        return 0
    if record.dictionary is not None:
        return sum(_entry_size(sub, value) for sub, value, _ in record.dictionary)
    return _entry_size(b"", record.value)


def fit_record(record: FoundRecord | None, budget: int) -> FoundRecord | None:
    """The record, or as much of it as fits in ``budget`` bytes of a find answer (for a
    dictionary: its freshest entries). Without this, enough subkeys under one key (anyone
    may add them) made every find including that key fail with FrameTooLarge."""
    if record is None or record_size(record) <= budget:
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


def merge_records(records: list[FoundRecord]) -> FoundRecord:
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


__all__ = [
    "NO_SUBKEY",
    "deserialize",
    "fit_record",
    "merge_records",
    "newer_than",
    "record_from_storage",
    "record_size",
    "serialize",
]
