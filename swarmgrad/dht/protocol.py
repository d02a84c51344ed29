"""The DHT's wire protocol: three RPCs on the peer's RPC layer, and their messages.

* ``dht.ping``  — "I am here": the caller's visible addresses and whether it is a client;
  the answer carries the callee's clock (to warn about skew) and mode.
* ``dht.store`` — store a batch of records; the answer says, per record, whether it was
  stored and, if refused, why.
* ``dht.find``  — for a batch of keys, the stored record (if any) and the nearest nodes the
  callee knows, with their addresses. An asker that already holds versions of a
  dictionary's entries lists them (``known``: 8-byte subkey digests and expirations) and
  gets only the entries newer than those: a training run's progress dictionary, read
  every few seconds by every peer from every replica, came back whole each time although
  one entry in four had changed, most of the bytes a DiLoCo peer sent. Likewise it names
  the nodes it already knows as candidates (``known_nodes``: 8-byte node-id prefixes),
  which the answer's nearest nodes leave out: their addresses were the rest.

Node ids are never sent: a node's id is ``DHTID.for_peer(peer_id)`` of the PeerID that the
connection authenticated, so nobody can claim a position in the id space. Keys, subkeys and
values travel serialized (msgpack bytes); this module only checks shapes and sizes of
messages and leaves the meaning to :mod:`swarmgrad.dht.node`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from swarmgrad.dht.routing import DHTID
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ProtocolViolation

PING, STORE, FIND = "dht.ping", "dht.store", "dht.find"
MAX_BATCH = 1024  # keys per store/find request
MAX_NEAREST = 64  # nodes per find answer
MAX_ADDRS = 8  # addresses per node in a find answer
MAX_KNOWN = 4096  # known entry versions per key in a find request
DIGEST_BYTES = 8  # a subkey's digest in ``known``
NODE_PREFIX_BYTES = 8  # a node id's prefix in ``known_nodes``
MAX_KNOWN_NODES = 256  # per key in a find request
# Record bytes per find answer: the whole answer must stay under the RPC layer's 16 MiB
# metadata limit, however much is stored under the keys asked for.
MAX_ANSWER_RECORD_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class StoreItem:
    """One record to store. The serialized key travels (not only its id) because record
    validators judge the key itself, e.g. an ``[owner:...]`` marker in it."""

    key: bytes  # serialized key; its id is DHTID.generate(key)
    subkey: bytes | None  # serialized subkey, or None for a plain value
    value: bytes | None  # serialized value, or None to delete
    expiration_time: float
    in_cache: bool = False

    @functools.cached_property
    def key_id(self) -> DHTID:
        return DHTID.generate(self.key)


@dataclass(frozen=True)
class FoundRecord:
    """What a node holds under a key: a plain value or a dictionary, never both."""

    value: bytes | None = None
    expiration_time: float | None = None
    dictionary: tuple[tuple[bytes, bytes, float], ...] | None = None  # (subkey, value, exp)


@dataclass(frozen=True)
class FindAnswer:
    record: FoundRecord | None
    nearest: tuple[tuple[PeerID, tuple[str, ...]], ...]


def _fail(what: str, error: Exception | str) -> ProtocolViolation:
    return ProtocolViolation(f"malformed {what}: {error}")


def _key_id(raw: Any) -> DHTID:
    if not isinstance(raw, bytes) or len(raw) != 20:
        raise ValueError(f"a key id must be 20 bytes, got {raw!r:.40}")
    return DHTID.from_bytes(raw)


def _float(raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"expected a number, got {type(raw).__name__}")
    return float(raw)


def _optional_bytes(raw: Any) -> bytes | None:
    if raw is not None and not isinstance(raw, bytes):
        raise ValueError(f"expected bytes or nil, got {type(raw).__name__}")
    return raw


# ---------------------------------------------------------------------------- ping


def encode_ping(maddrs: list[str], client_mode: bool) -> dict:
    return {"maddrs": maddrs[:MAX_ADDRS], "client": client_mode}


def decode_ping(message: Any) -> tuple[list[str], bool]:
    try:
        maddrs, client = message["maddrs"], message["client"]
        if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
            raise ValueError("maddrs must be a list of strings")
        return maddrs[:MAX_ADDRS], bool(client)
    except (KeyError, TypeError, ValueError) as e:
        raise _fail("ping", e) from None


def encode_pong(dht_time: float, client_mode: bool) -> dict:
    return {"time": dht_time, "client": client_mode}


def decode_pong(message: Any) -> tuple[float, bool]:
    try:
        return _float(message["time"]), bool(message["client"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail("ping answer", e) from None


# ---------------------------------------------------------------------------- store


def encode_store(items: list[StoreItem]) -> dict:
    return {"items": [[i.key, i.subkey, i.value, i.expiration_time, i.in_cache] for i in items]}


def decode_store(message: Any) -> list[StoreItem]:
    try:
        raw_items = message["items"]
        if not isinstance(raw_items, list) or len(raw_items) > MAX_BATCH:
            raise ValueError(f"items must be a list of at most {MAX_BATCH}")
        items = []
        for key, subkey, value, expiration, in_cache in raw_items:
            if not isinstance(key, bytes):
                raise ValueError("a key must be bytes")
            items.append(
                StoreItem(
                    key,
                    _optional_bytes(subkey),
                    _optional_bytes(value),
                    _float(expiration),
                    bool(in_cache),
                )
            )
        return items
    except (KeyError, TypeError, ValueError) as e:
        raise _fail("store request", e) from None


def encode_store_result(results: list[str | None]) -> dict:
    """Per item: None if stored, else the reason it was not."""
    return {"results": results}


def decode_store_result(message: Any, expected: int) -> list[str | None]:
    try:
        results = message["results"]
        if not isinstance(results, list) or len(results) != expected:
            raise ValueError(f"expected {expected} results")
        return [None if r is None else str(r) for r in results]
    except (KeyError, TypeError, ValueError) as e:
        raise _fail("store answer", e) from None


# ---------------------------------------------------------------------------- find


def subkey_digest(subkey: bytes) -> bytes:
    """What ``known`` names a dictionary entry by. To hide someone else's entry from an
    asker, an attacker needs an entry of its own under a subkey with the same digest (a
    second preimage: 2**64 work) held by that asker with a later expiration; a collision
    between two subkeys of its own (2**32) hides only its own entries."""
    return hashlib.blake2b(subkey, digest_size=DIGEST_BYTES).digest()


def encode_find(
    key_ids: list[DHTID],
    k: int | None = None,
    skip_records: list[int] | None = None,
    known: dict[int, list[tuple[bytes, float]]] | None = None,
    known_nodes: dict[int, list[bytes]] | None = None,
) -> dict:
    """``k``: how many nearest nodes the asker wants per key (the callee's bucket size if
    omitted); a narrow lookup asks for fewer and gets smaller answers. ``skip_records``:
    positions of keys whose record the asker does not want, only their nearest nodes (a
    store's lookup: a run's progress dictionary came back with every one of its
    lookups, which was most of what a DiLoCo peer sent). ``known``: per position, the
    (subkey digest, expiration) of dictionary entries the asker holds; the answer leaves
    out entries no newer than those. ``known_nodes``: per position, node-id prefixes
    (:func:`node_prefix`) the answer's nearest nodes leave out. Older nodes ignore the
    optional fields."""
    message: dict = {"keys": [key.to_bytes() for key in key_ids]}
    if k is not None:
        message["k"] = k
    if skip_records:
        message["skip_records"] = list(skip_records)
    if known:
        message["known"] = [
            [index, [[digest, float(exp)] for digest, exp in versions]]
            for index, versions in known.items()
        ]
    if known_nodes:
        message["known_nodes"] = [[index, list(nodes)] for index, nodes in known_nodes.items()]
    return message


def node_prefix(node_id: DHTID) -> bytes:
    """What ``known_nodes`` names a node by. Hiding an honest node from someone's answers
    this way would take an id whose prefix matches that node's: 2**64 work."""
    return node_id.to_bytes()[:NODE_PREFIX_BYTES]


def _per_key(message: Any, field: str, num_keys: int) -> list[tuple[int, Any]]:
    """The (position, payload) pairs of a find request's per-key ``field`` (``known``,
    ``known_nodes``), positions checked; [] when absent."""
    raw = message.get(field) if isinstance(message, dict) else None
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > num_keys:
        raise ProtocolViolation(f"find request: {field} must list at most {num_keys} keys")
    pairs = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            raise _fail("find request", f"{field} holds {_short(item)}, not [position, list]")
        index, payload = item
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_keys:
            raise _fail("find request", f"{field} names position {index!r}, not one < {num_keys}")
        pairs.append((index, payload))
    return pairs


def known_node_prefixes(message: Any, num_keys: int) -> dict[int, frozenset[bytes]]:
    """The ``known_nodes`` of a find request: position -> node-id prefixes."""
    known: dict[int, frozenset[bytes]] = {}
    for index, prefixes in _per_key(message, "known_nodes", num_keys):
        if (
            not isinstance(prefixes, list)
            or len(prefixes) > MAX_KNOWN_NODES
            or not all(isinstance(p, bytes) and len(p) == NODE_PREFIX_BYTES for p in prefixes)
        ):
            raise _fail(
                "find request",
                f"known_nodes of key {index} must be a list of at most {MAX_KNOWN_NODES} "
                f"{NODE_PREFIX_BYTES}-byte prefixes",
            )
        known[index] = known.get(index, frozenset()) | frozenset(prefixes)
    return known


def known_versions(message: Any, num_keys: int) -> dict[int, dict[bytes, float]]:
    """The ``known`` of a find request: position -> {subkey digest: expiration}."""
    known: dict[int, dict[bytes, float]] = {}
    for index, versions in _per_key(message, "known", num_keys):
        if not isinstance(versions, list) or len(versions) > MAX_KNOWN:
            raise _fail(
                "find request", f"known versions of key {index} must be a list of <= {MAX_KNOWN}"
            )
        table = known.setdefault(index, {})
        for version in versions:
            if (
                not isinstance(version, list)
                or len(version) != 2
                or not isinstance(version[0], bytes)
                or len(version[0]) != DIGEST_BYTES
                or isinstance(version[1], bool)
                or not isinstance(version[1], int | float)
                or not math.isfinite(version[1])
            ):
                raise _fail(
                    "find request",
                    f"a known version of key {index} is {_short(version)}, not "
                    f"[{DIGEST_BYTES}-byte digest, finite expiration]",
                )
            digest, exp = version
            table[digest] = max(float(exp), table.get(digest, -math.inf))
    return known


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def skipped_records(message: Any, num_keys: int) -> frozenset[int]:
    """The ``skip_records`` of a find request: positions in [0, num_keys)."""
    raw = message.get("skip_records") if isinstance(message, dict) else None
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or len(raw) > num_keys:
        raise ProtocolViolation(
            f"find request: skip_records must list at most {num_keys} positions"
        )
    for index in raw:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_keys:
            raise _fail(
                "find request", f"skip_records holds {index!r}, not a position < {num_keys}"
            )
    return frozenset(raw)


def requested_neighbors(message: Any, default: int) -> int:
    """The ``k`` of a find request, clamped to [1, default]."""
    k = message.get("k") if isinstance(message, dict) else None
    if isinstance(k, bool) or not isinstance(k, int):
        return default
    return max(1, min(k, default))


def decode_find(message: Any) -> list[DHTID]:
    try:
        keys = message["keys"]
        if not isinstance(keys, list) or len(keys) > MAX_BATCH:
            raise ValueError(f"keys must be a list of at most {MAX_BATCH}")
        return [_key_id(k) for k in keys]
    except (KeyError, TypeError, ValueError) as e:
        raise _fail("find request", e) from None


def encode_find_result(answers: list[FindAnswer]) -> dict:
    out = []
    for answer in answers:
        record = answer.record
        if record is None:
            encoded_record = None
        elif record.dictionary is not None:
            encoded_record = {"dict": [list(entry) for entry in record.dictionary]}
        else:
            encoded_record = {"value": record.value, "exp": record.expiration_time}
        # tuples pack as msgpack arrays: no list copies
        nearest = [(pid.to_bytes(), addrs) for pid, addrs in answer.nearest]
        out.append({"record": encoded_record, "nearest": nearest})
    return {"answers": out}


def decode_find_result(message: Any, expected: int) -> list[FindAnswer]:
    try:
        raw_answers = message["answers"]
        if not isinstance(raw_answers, list) or len(raw_answers) != expected:
            raise ValueError(f"expected {expected} answers")
        answers = []
        for raw in raw_answers:
            raw_record, raw_nearest = raw["record"], raw["nearest"]
            record = None
            if raw_record is not None:
                if "dict" in raw_record:
                    entries = tuple(
                        (bytes(s), bytes(v), _float(e)) for s, v, e in raw_record["dict"]
                    )
                    record = FoundRecord(dictionary=entries)
                else:
                    value = raw_record["value"]
                    if not isinstance(value, bytes):
                        raise ValueError("a record value must be bytes")
                    record = FoundRecord(value=value, expiration_time=_float(raw_record["exp"]))
            if not isinstance(raw_nearest, list) or len(raw_nearest) > MAX_NEAREST:
                raise ValueError(f"at most {MAX_NEAREST} nearest nodes")
            nearest = []
            for raw_pid, addrs in raw_nearest:
                if addrs.__class__ is not list and addrs.__class__ is not tuple:
                    raise ValueError("addresses must be a list of strings")
                addrs = tuple(addrs[:MAX_ADDRS])
                "".join(addrs)  # TypeError unless every address is a string (checked in C)
                nearest.append((PeerID.intern(raw_pid), addrs))
            answers.append(FindAnswer(record, tuple(nearest)))
        return answers
    except (KeyError, TypeError, ValueError) as e:
        raise _fail("find answer", e) from None
