"""What the monitor knows about the swarm: records parsed, merged per peer, and history.

Pure state, no I/O: :class:`SwarmView` is fed what one poll of the DHT found for each run
(:func:`parse_metrics` and :func:`parse_progress` turn the raw DHT values into records,
counting what they refuse) and answers :meth:`SwarmView.snapshot`, the JSON document
behind the dashboard, ``/api/snapshot`` and ``/metrics``.

A peer appears in a run when it has a live progress record (``{run}_progress``, from its
:class:`~swarmgrad.optim.progress_tracker.ProgressTracker`) or a live metrics record
(``{run}_peer_metrics``, :class:`~swarmgrad.optim.metrics.PeerMetrics`); both are keyed by the
peer's owner marker, so the two are joined on it. Each run keeps a bounded history of
aggregate points (one per poll) and of each peer's loss.

Records from the swarm are untrusted: a value that is not a well-formed record, or whose
serialized size exceeds :data:`~swarmgrad.optim.metrics.MAX_METRICS_BYTES`, is ignored
and counted once (``rejected`` in the snapshot: distinct records, not reads of them); a
record is never trusted to be small enough to render as is.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.dht.crypto import OWNER_MARKER_PREFIX
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.dht.validation import serialize
from swarmgrad.net.identity import PeerID
from swarmgrad.optim.metrics import MAX_METRICS_BYTES, PeerMetrics
from swarmgrad.optim.progress import LocalTrainingProgress

__all__ = [
    "MAX_RUNS",
    "ParsedRecords",
    "SwarmView",
    "parse_metrics",
    "parse_progress",
    "parse_run_directory",
]

MAX_RUNS = 32  # runs followed at once (the run directory is unsigned: anyone may add to it)
MAX_PEERS_PER_RUN = 1024
MAX_LOSS_CURVES = 10  # per-peer loss curves in a snapshot (the run's mean is always there)
MAX_PROGRESS_BYTES = 4 * 1024
_MAX_RUN_ID = 128
_MAX_REMEMBERED_REFUSALS = 100_000


@dataclass
class ParsedRecords:
    """The well-formed records under one key (subkey -> record), the subkeys that said
    goodbye (a None value), and what was refused: ``(reason, fingerprint)`` pairs, so
    that a record read again at the next poll is not counted again."""

    records: dict[bytes, Any] = field(default_factory=dict)
    goodbyes: set[bytes] = field(default_factory=set)
    refused: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def rejected(self) -> Counter:
        """Refused records by reason (malformed, oversized)."""
        return Counter(reason for reason, _ in self.refused)


def _fingerprint(*parts: Any) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        try:
            data = serialize(part)
        except Exception:
            data = repr(part)[:1024].encode("utf-8", "replace")
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.digest()


def _entries(found: Any, refused: list[tuple[str, bytes]]) -> list[tuple[Any, Any, Any]]:
    """(subkey, value, expiration) of each entry of a dictionary value."""
    if found is None:
        return []
    value = found.value if isinstance(found, ValueWithExpiration) else found
    if not isinstance(value, dict):  # a plain value where a dictionary of records belongs
        refused.append(("malformed", _fingerprint(value)))
        return []
    return [
        (subkey, *(entry if isinstance(entry, ValueWithExpiration) else (entry, None)))
        for subkey, entry in value.items()
    ]


def _parse(found: Any, model: type, max_bytes: int) -> ParsedRecords:
    parsed = ParsedRecords()
    for subkey, value, expiration in _entries(found, parsed.refused):
        if isinstance(subkey, bytes) and value is None:
            parsed.goodbyes.add(subkey)
            continue
        try:
            size = len(serialize(value))
        except Exception:
            size = 0
        reason = None
        if size > max_bytes:
            reason = "oversized"
        elif not isinstance(subkey, bytes) or not isinstance(value, dict) or not size:
            reason = "malformed"
        else:
            try:
                parsed.records[subkey] = model.model_validate(value, strict=True)
            except Exception:
                reason = "malformed"
        if reason is not None:
            fingerprint = _fingerprint(subkey, expiration, size, value if size < 4096 else None)
            parsed.refused.append((reason, fingerprint))
    return parsed


def parse_metrics(found: Any) -> ParsedRecords:
    """The :class:`PeerMetrics` records in what ``get(metrics_key(run))`` returned (the
    key ``{run}_peer_metrics``)."""
    return _parse(found, PeerMetrics, MAX_METRICS_BYTES)


def parse_progress(found: Any) -> ParsedRecords:
    """The progress records in what ``get(f"{run}_progress")`` returned."""
    return _parse(found, LocalTrainingProgress, MAX_PROGRESS_BYTES)


def parse_run_directory(found: Any) -> tuple[list[str], list[tuple[str, bytes]]]:
    """Run ids announced under the run directory key, freshest first (at most MAX_RUNS),
    and the entries refused (as in :class:`ParsedRecords`)."""
    refused: list[tuple[str, bytes]] = []
    runs = []
    for subkey, value, expiration in _entries(found, refused):
        if (
            not isinstance(subkey, str)
            or not 0 < len(subkey) <= _MAX_RUN_ID
            or not subkey.isprintable()
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            refused.append(("malformed", _fingerprint(subkey, value, expiration)))
            continue
        runs.append((float(value), subkey))
    runs.sort(reverse=True)
    return [run for _, run in runs[:MAX_RUNS]], refused


def _peer_name(subkey: bytes, claimed: bytes) -> str:
    """The PeerID of the key that signed the record (its subkey's owner marker), which
    cannot be forged, rather than the one the record claims."""
    if subkey.startswith(OWNER_MARKER_PREFIX) and subkey.endswith(b"]"):
        with contextlib.suppress(Exception):
            raw = base64.b64decode(subkey[len(OWNER_MARKER_PREFIX) : -1], validate=True)
            return str(PeerID.from_public_key(raw))
    with contextlib.suppress(Exception):
        return str(PeerID(claimed))
    return claimed.hex()[:52]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@dataclass
class _Peer:
    peer_id: str
    progress: LocalTrainingProgress | None = None
    metrics: PeerMetrics | None = None
    seen_at: float = 0.0
    loss_history: deque = field(default_factory=deque)  # (time, loss)
    absent: dict[str, int] = field(default_factory=lambda: {"progress": 0, "metrics": 0})


class _Run:
    def __init__(self, run_id: str, history: int):
        self.run_id = run_id
        self.absent = 0  # polls in a row whose run directory did not list it
        self.peers: dict[bytes, _Peer] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.history_length = history


class SwarmView:
    """Runs, their peers and their history, as the monitor saw them (module docstring).

    ``history``: points kept per run and per peer (one per poll); ``absent_polls``: a
    record missing from this many polls in a row is dropped (a peer's goodbye, or its
    record expired; the DHT hides both, and one missed read is not a departure).
    """

    def __init__(self, *, history: int = 720, absent_polls: int = 2):
        if history < 2:
            raise ValueError(f"history must keep at least 2 points, got {history}")
        self.history = history
        self.absent_polls = absent_polls
        self.runs: dict[str, _Run] = {}
        self.rejected: Counter = Counter()
        self._refused_seen: set[bytes] = set()
        self.polls = 0
        self.poll_errors = 0
        self.last_poll_error: str | None = None
        self.last_poll_time: float | None = None

    def count_rejected(self, refused: list[tuple[str, bytes]]) -> None:
        """Count each refused record once, however many polls read it again."""
        for reason, fingerprint in refused:
            if fingerprint in self._refused_seen:
                continue
            if len(self._refused_seen) >= _MAX_REMEMBERED_REFUSALS:
                self._refused_seen.clear()  # a flood: some may be counted twice, never lost
            self._refused_seen.add(fingerprint)
            self.rejected[reason] += 1

    def retain_runs(self, run_ids: list[str]) -> None:
        """The run directory listed ``run_ids``: a run it left out of ``absent_polls``
        reads in a row is dropped (its last peer left, or its announcement expired)."""
        for run_id, run in list(self.runs.items()):
            if run_id in run_ids:
                run.absent = 0
                continue
            run.absent += 1
            if run.absent >= self.absent_polls:
                del self.runs[run_id]

    def update_run(
        self, run_id: str, progress: ParsedRecords, metrics: ParsedRecords, now: float
    ) -> None:
        """Apply what one poll found for ``run_id`` and add a point to its history."""
        self.count_rejected(progress.refused)
        self.count_rejected(metrics.refused)
        run = self.runs.get(run_id)
        if run is None:
            if len(self.runs) >= MAX_RUNS:
                return
            run = self.runs[run_id] = _Run(run_id, self.history)
        for parsed, attribute in ((progress, "progress"), (metrics, "metrics")):
            for subkey, peer in run.peers.items():
                if subkey in parsed.goodbyes:
                    setattr(peer, attribute, None)
                elif subkey not in parsed.records and getattr(peer, attribute) is not None:
                    peer.absent[attribute] += 1
                    if peer.absent[attribute] >= self.absent_polls:
                        setattr(peer, attribute, None)
            for subkey, record in parsed.records.items():
                peer = run.peers.get(subkey)
                if peer is None:
                    if len(run.peers) >= MAX_PEERS_PER_RUN:
                        continue
                    peer = run.peers[subkey] = _Peer(
                        _peer_name(subkey, record.peer_id),
                        loss_history=deque(maxlen=self.history),
                    )
                previous = getattr(peer, attribute)
                setattr(peer, attribute, record)
                peer.absent[attribute] = 0
                if previous is None or record.time != previous.time:
                    peer.seen_at = now
                if attribute == "metrics" and record.loss is not None:
                    if not peer.loss_history or peer.loss_history[-1][0] != record.time:
                        peer.loss_history.append((record.time, record.loss))
        for subkey, peer in list(run.peers.items()):
            if peer.progress is None and peer.metrics is None:
                del run.peers[subkey]
        run.history.append(self._aggregate(run, now))

    def _aggregate(self, run: _Run, now: float) -> dict[str, Any]:
        peers = list(run.peers.values())
        losses = [p.metrics.loss for p in peers if p.metrics and p.metrics.loss is not None]
        epochs = [p.progress.epoch for p in peers if p.progress is not None]
        epochs += [p.metrics.epoch for p in peers if p.metrics is not None]
        return {
            "time": now,
            "epoch": max(epochs, default=0),
            "num_peers": len(peers),
            "loss": sum(losses) / len(losses) if losses else None,
            "samples_per_second": sum(_rate(p) for p in peers),
            "rounds_ok": sum(p.metrics.rounds_ok for p in peers if p.metrics),
            "rounds_failed": sum(p.metrics.rounds_failed for p in peers if p.metrics),
            "bytes_sent": sum(p.metrics.bytes_sent for p in peers if p.metrics),
            "bytes_received": sum(p.metrics.bytes_received for p in peers if p.metrics),
        }

    def snapshot(self, now: float) -> dict[str, Any]:
        """The JSON-ready view of everything (the shape is documented in docs/monitor.md)."""
        runs = [self._run_snapshot(run, now) for run in self.runs.values()]
        servers = [
            {"run_id": r["run_id"], **p} for r in runs for p in r["peers"] if p["num_experts"] > 0
        ]
        return {
            "time": now,
            "polls": self.polls,
            "poll_errors": self.poll_errors,
            "last_poll_error": self.last_poll_error,
            "last_poll_time": self.last_poll_time,
            "rejected": {
                "malformed": self.rejected.get("malformed", 0),
                "oversized": self.rejected.get("oversized", 0),
            },
            "runs": runs,
            "expert_servers": servers,
        }

    def _run_snapshot(self, run: _Run, now: float) -> dict[str, Any]:
        peers = [_peer_snapshot(p, now) for p in run.peers.values()]
        peers.sort(key=lambda p: (p["role"], p["peer_id"]))
        latest = run.history[-1] if run.history else self._aggregate(run, now)
        history: dict[str, list] = {name: [] for name in latest}
        for point in run.history:
            for name in history:
                history[name].append(point.get(name))
        offenders: dict[str, dict[str, Any]] = {}
        for peer in peers:
            for offender, counts in peer["offenders"].items():
                entry = offenders.setdefault(
                    offender,
                    {
                        "peer_id": offender,
                        "reported_by": 0,
                        "banned_by": 0,
                        "clipped_rounds": 0,
                        "clipped_parts": 0,
                        "bad_reductions": 0,
                    },
                )
                entry["reported_by"] += 1
                entry["banned_by"] += int(counts["banned"])
                for name in ("clipped_rounds", "clipped_parts", "bad_reductions"):
                    entry[name] += counts[name]
        return {
            "run_id": run.run_id,
            **{k: v for k, v in latest.items() if k != "time"},
            "num_clients": sum(1 for p in peers if p["client_mode"]),
            "peers": peers,
            "history": history,
            "loss_by_peer": {
                p.peer_id: [[t, loss] for t, loss in p.loss_history]
                for p in _chart_peers(run.peers.values())
            },
            "offenders": sorted(
                offenders.values(), key=lambda o: -(o["clipped_rounds"] + o["bad_reductions"])
            ),
        }


def _chart_peers(peers: Any) -> list[_Peer]:
    """The peers whose loss curves the snapshot carries: the MAX_LOSS_CURVES that
    reported a loss most recently (a swarm of a thousand would make every poll of the page
    megabytes, and a chart of a thousand lines says nothing)."""
    with_loss = [p for p in peers if p.loss_history]
    with_loss.sort(key=lambda p: p.loss_history[-1][0], reverse=True)
    return sorted(with_loss[:MAX_LOSS_CURVES], key=lambda p: p.peer_id)


def _rate(peer: _Peer) -> float:
    if peer.metrics is not None and peer.metrics.samples_per_second:
        return float(peer.metrics.samples_per_second)
    if peer.progress is not None:
        return float(peer.progress.samples_per_second)
    return 0.0


def _peer_snapshot(peer: _Peer, now: float) -> dict[str, Any]:
    m, p = peer.metrics, peer.progress
    return {
        "peer_id": peer.peer_id,
        "role": m.role if m is not None else ("client" if p and p.client_mode else "trainer"),
        "client_mode": bool(m.client_mode if m is not None else p and p.client_mode),
        "epoch": max(m.epoch if m else 0, p.epoch if p else 0),
        "samples_accumulated": p.samples_accumulated if p is not None else None,
        "samples_per_second": _rate(peer),
        "loss": _finite(m.loss) if m is not None else None,
        "rounds_ok": m.rounds_ok if m else 0,
        "rounds_failed": m.rounds_failed if m else 0,
        "bytes_sent": m.bytes_sent if m else 0,
        "bytes_received": m.bytes_received if m else 0,
        "num_experts": m.num_experts if m else 0,
        "experts": list(m.experts) if m else [],
        "expert_batches": m.expert_batches if m else 0,
        "offenders": {k: v.model_dump() for k, v in m.offenders.items()} if m else {},
        "has_metrics": m is not None,
        "has_progress": p is not None,
        "last_seen_s": max(0.0, now - peer.seen_at),
    }
