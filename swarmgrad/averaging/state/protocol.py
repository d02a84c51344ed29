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
the same way). The donor's RPCs (``<prefix>.state.manifest``, ``.chunk``, ``.release``) are
described in :mod:`swarmgrad.averaging.state.sharing`.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.net.identity import PeerID

__all__ = [
    "DonorRecord",
    "StateRPC",
    "declaration_key",
    "encode_declaration",
    "order_donors",
    "parse_declarations",
]

logger = logging.getLogger(__name__)

DECLARATION_VERSION = 1
MAX_MADDRS = 16

# status of a manifest or chunk answer
OK, BUSY, UNAVAILABLE, EXPIRED = "ok", "busy", "unavailable", "expired"


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
