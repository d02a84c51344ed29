"""The state-transfer protocol: DHT declarations of donors and the names of their RPCs.

Declarations (one per donor, refreshed every ``declare_state_period``)::

    key    "<prefix>.all_averagers"
    subkey the donor's PeerID (base58)
    value  {"v": 1, "priority": float, "maddrs": [str], "digest": bytes | None,
            "size": int | None, "bw": float | None}

``priority`` ranks donors (higher first: e.g. the donor's epoch or step); ``digest`` is
the root digest of the donor's latest snapshot, if it has made one, and ``size`` its
byte count: donors advertising the same digest hold the same state and can share one
download. ``bw`` is the bandwidth the donor announced to its averager (any unit, the
same across the run; absent in declarations of older peers): among donors of equal
priority, joiners ask those with faster links first, so a slow volunteer's uplink is not
spent serving whole models while a fast one idles (DeDLOC sizes the all-reduce's spans
the same way).

The donor's RPCs, served by :class:`~.sharing.StateSharing` under ``<prefix>.state``:

* ``.manifest`` — :class:`ManifestRequest` in; a :class:`ManifestOffer` (a download
  session: its id, the donor's priority, the snapshot's manifest and metadata) or a
  :class:`StateRefusal` (``busy``, ``unavailable``) out.
* ``.chunk`` — :class:`ChunkRequest` (session, chunk index) in; :class:`ChunkParts` or a
  :class:`StateRefusal` (``expired``: no such session) out.
* ``.release`` — :class:`ReleaseRequest` in (the downloader is done); ``{"status": "ok"}``.

``decode_*`` check shapes and types and raise ProtocolViolation naming the field; the
manifest itself is checked by :meth:`~.chunks.StateManifest.from_wire`.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ProtocolViolation

__all__ = [
    "ChunkParts",
    "ChunkRequest",
    "DonorRecord",
    "ManifestOffer",
    "ManifestRequest",
    "ReleaseRequest",
    "StateRefusal",
    "Status",
    "StateRPC",
    "declaration_key",
    "encode_declaration",
    "order_donors",
    "decode_chunk_answer",
    "decode_chunk_request",
    "decode_manifest_answer",
    "decode_release_request",
    "parse_declarations",
]

logger = logging.getLogger(__name__)

DECLARATION_VERSION = 1
MAX_MADDRS = 16

MAX_SESSION_ID_BYTES = 64


class Status(enum.StrEnum):
    """The ``status`` of a manifest or chunk answer."""

    OK = "ok"  # here it is
    BUSY = "busy"  # the donor serves max_concurrent_downloads already: try another
    UNAVAILABLE = "unavailable"  # not sharing now (not allowed, shutting down, no snapshot)
    EXPIRED = "expired"  # no such download session (idle too long, or released)


OK, BUSY, UNAVAILABLE, EXPIRED = Status.OK, Status.BUSY, Status.UNAVAILABLE, Status.EXPIRED


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


@dataclass(frozen=True)
class StateRefusal:
    """A donor's "not now": why, for the logs and for choosing other donors."""

    status: Status | str  # a Status other than OK; an unknown one from a newer peer: text
    reason: str = ""

    def encode(self) -> dict[str, Any]:
        return {"status": str(self.status), "reason": self.reason}


@dataclass(frozen=True)
class ManifestRequest:
    """A downloader asks a donor to open a download session."""

    version: int = 1

    def encode(self) -> dict[str, Any]:
        return {"v": self.version}


@dataclass(frozen=True)
class ManifestOffer:
    """An open session: chunks of the snapshot described by ``manifest`` (its wire form)
    can be fetched under ``session`` until it stays idle for ``idle_timeout`` seconds."""

    session: bytes
    priority: float
    manifest: Any  # StateManifest.to_wire(); checked by StateManifest.from_wire
    metadata: Any  # the snapshot's metadata bytes (a Blob when sent)
    idle_timeout: float

    def encode(self) -> dict[str, Any]:
        return {
            "status": str(Status.OK),
            "session": self.session,
            "priority": self.priority,
            "manifest": self.manifest,
            "metadata": self.metadata,
            "idle_timeout": self.idle_timeout,
        }


def _refusal(message: dict) -> StateRefusal:
    status = message.get("status")
    try:
        status = Status(status)
    except ValueError:
        status = str(status)
    return StateRefusal(status, str(message.get("reason", "")))


def decode_manifest_answer(message: Any, donor: Any) -> ManifestOffer | StateRefusal:
    """A donor's manifest answer; ProtocolViolation naming the field if malformed."""
    if not isinstance(message, dict):
        raise ProtocolViolation(f"a manifest answer must be a dict, got {message!r:.60}")
    if message.get("status") != Status.OK:
        return _refusal(message)
    session, priority = message.get("session"), message.get("priority")
    idle_timeout = message.get("idle_timeout")
    if not isinstance(session, bytes) or not 0 < len(session) <= MAX_SESSION_ID_BYTES:
        raise ProtocolViolation(f"manifest answer from {donor}: session must be 1 to 64 bytes")
    if not _number(priority) or not math.isfinite(priority):
        raise ProtocolViolation(
            f"manifest answer from {donor}: priority {priority!r} is not a finite number"
        )
    if idle_timeout is not None and not _number(idle_timeout):
        raise ProtocolViolation(
            f"manifest answer from {donor}: idle_timeout {idle_timeout!r} is not a number"
        )
    return ManifestOffer(
        session,
        float(priority),
        message.get("manifest"),
        message.get("metadata"),
        float(idle_timeout) if idle_timeout is not None else math.inf,
    )


@dataclass(frozen=True)
class ChunkRequest:
    """Chunk ``index`` of the snapshot of a session."""

    session: bytes | None  # None: a malformed session id, answered as an unknown session
    index: int

    def encode(self) -> dict[str, Any]:
        return {"session": self.session, "index": self.index}


def decode_chunk_request(message: Any) -> ChunkRequest:
    if not isinstance(message, dict):
        raise ProtocolViolation("malformed chunk request: must be a dict {'session', 'index'}")
    session, index = message.get("session"), message.get("index")
    if type(index) is not int:
        raise ProtocolViolation(f"malformed chunk request: index {index!r:.40} is not an int")
    return ChunkRequest(session if isinstance(session, bytes) else None, index)


@dataclass(frozen=True)
class ChunkParts:
    """One chunk's bytes, in parts (Blobs when sent)."""

    parts: list

    def encode(self) -> dict[str, Any]:
        return {"status": str(Status.OK), "parts": self.parts}


def decode_chunk_answer(message: Any, donor: Any, chunk: int) -> ChunkParts | StateRefusal:
    """ProtocolViolation if malformed; a list of parts that is not a list is the caller's
    to treat as a corrupt chunk (the parts are checked against the manifest's digests)."""
    if not isinstance(message, dict):
        raise ProtocolViolation(f"chunk {chunk} answer from {donor} is not a dict")
    if message.get("status") != Status.OK:
        return _refusal(message)
    return ChunkParts(message.get("parts"))


@dataclass(frozen=True)
class ReleaseRequest:
    """The downloader is done with ``session``: the donor may free its slot."""

    session: bytes | None

    def encode(self) -> dict[str, Any]:
        return {"session": self.session}


def decode_release_request(message: Any) -> ReleaseRequest:
    """Lenient: a malformed release releases nothing (it is only a courtesy)."""
    session = message.get("session") if isinstance(message, dict) else None
    return ReleaseRequest(session if isinstance(session, bytes) else None)


def declaration_key(prefix: str) -> str:
    return f"{prefix}.all_averagers"


@dataclass(frozen=True)
class StateRPC:
    """Handler names of one averager's state sharing (several averagers, several prefixes)."""

    manifest: str
    chunk: str
    release: str

    @classmethod
    def for_prefix(cls, prefix: str) -> StateRPC:
        return cls(f"{prefix}.state.manifest", f"{prefix}.state.chunk", f"{prefix}.state.release")


@dataclass(frozen=True)
class DonorRecord:
    peer_id: PeerID
    priority: float
    maddrs: tuple[str, ...]
    digest: bytes | None = None
    size: int | None = None
    bandwidth: float | None = None


def encode_declaration(
    priority: float,
    maddrs: Sequence[str],
    digest: bytes | None,
    size: int | None,
    bandwidth: float | None = None,
) -> dict[str, Any]:
    return {
        "v": DECLARATION_VERSION,
        "priority": float(priority),
        "maddrs": [str(m) for m in maddrs][:MAX_MADDRS],
        "digest": digest,
        "size": size,
        "bw": None if bandwidth is None else float(bandwidth),
    }


def _parse_one(subkey: Any, value: Any) -> DonorRecord | None:
    try:
        peer_id = PeerID.from_base58(subkey)
    except Exception:
        return None
    if not isinstance(value, dict) or value.get("v") != DECLARATION_VERSION:
        return None
    priority, maddrs = value.get("priority"), value.get("maddrs")
    digest, size = value.get("digest"), value.get("size")
    if type(priority) not in (int, float) or not math.isfinite(priority):
        return None
    if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
        return None
    if digest is not None and not (isinstance(digest, bytes) and len(digest) == 32):
        digest = None
    if size is not None and not (type(size) is int and size >= 0):
        size = None
    bandwidth = value.get("bw")
    if type(bandwidth) not in (int, float) or not 0 < bandwidth < math.inf:
        bandwidth = None
    return DonorRecord(
        peer_id,
        float(priority),
        tuple(maddrs[:MAX_MADDRS]),
        digest,
        size,
        None if bandwidth is None else float(bandwidth),
    )


def parse_declarations(
    found: ValueWithExpiration | None, exclude: PeerID | None = None
) -> list[DonorRecord]:
    """The donors in a DHT answer; malformed entries (a buggy or hostile peer's) are
    skipped."""
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, entry in found.value.items():
        value = entry.value if isinstance(entry, ValueWithExpiration) else entry
        record = _parse_one(subkey, value)
        if record is None:
            logger.debug("skipping a malformed state declaration under subkey %r", subkey)
        elif record.peer_id != exclude:
            records.append(record)
    return records


def order_donors(records: Sequence[DonorRecord], rng: random.Random) -> list[DonorRecord]:
    """Best first: higher priority; among equals, those whose advertised state more
    donors share (more of them can serve the same chunks); then the faster announced
    links (a donor that announced none counts as the median of those that did); then
    random."""
    popularity = Counter(r.digest for r in records if r.digest is not None)
    announced = sorted(r.bandwidth for r in records if r.bandwidth is not None)
    typical = announced[len(announced) // 2] if announced else 0.0
    keyed = [
        (
            -r.priority,
            -popularity.get(r.digest, 0) if r.digest else 0,
            -(r.bandwidth if r.bandwidth is not None else typical),
            rng.random(),
            i,
        )
        for i, r in enumerate(records)
    ]
    return [records[key[-1]] for key in sorted(keyed)]
