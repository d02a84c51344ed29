"""Accountability for robust averaging: who was clipped or reduced badly, and local bans.

After each round the averager records, per peer, the evidence its all-reduce produced:
rounds in which the robust rule clipped or trimmed that peer's contribution to our span
(:attr:`~.allreduce.AllReduceResult.limited_senders`) and spans whose result from that
peer, as their owner, failed our check (``bad_reducers``). With ``ban_after=N``, a peer
with N such rounds is banned from this averager's groups for ``ban_duration`` seconds:
matchmaking neither leads it nor follows it. The ban is this peer's own decision, logged
with the evidence; nobody else is told (a ban list others trusted would be one more thing
a liar could forge). Counts are kept for the monitor and metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from swarmgrad.averaging.allreduce import AllReduceResult
from swarmgrad.net.identity import PeerID

__all__ = ["OffenceCounts", "OffenderLog"]

logger = logging.getLogger(__name__)


@dataclass
class OffenceCounts:
    clipped_rounds: int = 0  # rounds in which the rule limited its contribution to us
    clipped_parts: int = 0
    bad_reductions: int = 0  # spans it reduced whose result failed our check

    @property
    def total(self) -> int:
        return self.clipped_rounds + self.bad_reductions


class OffenderLog:
    """Per-peer offence counts and bans (module docstring)."""

    def __init__(self, ban_after: int | None, ban_duration: float, owner: str):
        self.ban_after, self.ban_duration, self.owner = ban_after, ban_duration, owner
        self.counts: dict[PeerID, OffenceCounts] = {}
        self._banned_until: dict[PeerID, float] = {}

    def record(self, result: AllReduceResult) -> None:
        for peer_id, parts in result.limited_senders.items():
            counts = self.counts.setdefault(peer_id, OffenceCounts())
            counts.clipped_rounds += 1
            counts.clipped_parts += parts
            self._maybe_ban(peer_id, f"its contribution was clipped in {parts} part(s)")
        for peer_id in result.bad_reducers:
            counts = self.counts.setdefault(peer_id, OffenceCounts())
            counts.bad_reductions += 1
            reason = result.failed_reducers.get(peer_id, "its reduction failed the check")
            self._maybe_ban(peer_id, reason)

    def is_banned(self, peer_id: PeerID) -> bool:
        until = self._banned_until.get(peer_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._banned_until[peer_id]
            return False
        return True

    @property
    def banned(self) -> frozenset[PeerID]:
        return frozenset(p for p in list(self._banned_until) if self.is_banned(p))

    def as_metrics(self) -> dict[str, dict[str, int | bool]]:
        """Counts per peer (as text), for the monitor: {peer: {clipped_rounds, ...}}."""
        return {
            str(peer_id): {
                "clipped_rounds": c.clipped_rounds,
                "clipped_parts": c.clipped_parts,
                "bad_reductions": c.bad_reductions,
                "banned": self.is_banned(peer_id),
            }
            for peer_id, c in self.counts.items()
        }

    def _maybe_ban(self, peer_id: PeerID, latest: str) -> None:
        counts = self.counts[peer_id]
        if self.ban_after is None or counts.total < self.ban_after or self.is_banned(peer_id):
            return
        self._banned_until[peer_id] = time.monotonic() + self.ban_duration
        logger.warning(
            "%s: banning %s from our groups for %.0f s: %d round(s) clipped (%d parts), "
            "%d bad reduction(s); latest: %s",
            self.owner,
            peer_id,
            self.ban_duration,
            counts.clipped_rounds,
            counts.clipped_parts,
            counts.bad_reductions,
            latest,
        )
