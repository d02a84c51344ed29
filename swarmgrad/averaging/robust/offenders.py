"""Accountability for robust averaging: who was clipped or reduced badly, and local bans.

After each round the averager records, per peer, the evidence its all-reduce produced:
rounds in which the robust rule clipped or trimmed that peer's contribution to our span
(:attr:`~.allreduce.AllReduceResult.limited_senders`) and spans whose result from that
peer, as their owner, failed our check (``bad_reducers``). With ``ban_after=N``, a peer
that offended in N of the last ``ban_window`` rounds it took part in with us (default 2N)
is banned from this averager's groups for ``ban_duration`` seconds: matchmaking neither
leads it nor follows it. The ban is this peer's own decision, logged with the evidence;
nobody else is told (a ban list others trusted would be one more thing a liar could
forge). Counts are kept for the monitor and metrics.

Why a window and not a running total: honest peers stand out now and then (a peer that
missed one gradient round holds parameters a step away from the others', and the state
averager clips it once). Over a long run a total reaches any N; a liar stands out in
nearly every round it joins, an honest straggler in a few scattered ones, and a share of
recent rounds tells them apart (the byzantine benchmark banned 3 honest peers with a
total of 5 and none with 5 of the last 10; docs/security.md).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmgrad.net.identity import PeerID

if TYPE_CHECKING:  # robust/ sits below allreduce/, which applies its rules
    from swarmgrad.averaging.allreduce.types import AllReduceResult

__all__ = ["BAN_OPTIONS", "OffenceCounts", "OffenderLog", "without_bans"]

logger = logging.getLogger(__name__)

BAN_OPTIONS = ("ban_after", "ban_window")


def without_bans(options: dict) -> dict:
    """``options`` without the ban settings, for an averager of parameters that peers
    keep in sync (the collaborative optimizers' state averagers, next to a gradient
    averager that bans). There honest inputs are not alike: a peer whose gradient round
    went otherwise (a missed round, a group that held a liar) holds parameters off the
    others', is rightly clipped, and averaging is what brings it back; a ban would cut it
    off from exactly that, so it stays off and is blamed again: in the byzantine
    benchmark one honest peer was banned so by five others. Blame is still counted."""
    return {key: value for key, value in options.items() if key not in BAN_OPTIONS}


@dataclass
class OffenceCounts:
    clipped_rounds: int = 0  # rounds in which the rule limited its contribution to us
    clipped_parts: int = 0
    bad_reductions: int = 0  # spans it reduced whose result failed our check


class OffenderLog:
    """Per-peer offence counts and bans (module docstring)."""

    def __init__(
        self,
        ban_after: int | None,
        ban_duration: float,
        owner: str,
        ban_window: int | None = None,
    ):
        self.ban_after, self.ban_duration, self.owner = ban_after, ban_duration, owner
        self.ban_window = ban_window or 2 * (ban_after or 0)
        self.counts: dict[PeerID, OffenceCounts] = {}
        # per peer, whether it offended in each of the last ban_window rounds it took
        # part in with us (kept only when bans are on)
        self._recent: dict[PeerID, deque[bool]] = {}
        self._banned_until: dict[PeerID, float] = {}
        self._followed: list[OffenderLog] = []

    def follow(self, other: OffenderLog) -> None:
        """Also leave out of our groups whoever ``other`` bans (its evidence, not ours):
        a state averager follows its optimizer's gradient averager, so that a peer
        banned for lying in gradients does not go on pulling our parameters, while the
        state averager's own blame never bans (:func:`without_bans`)."""
        if other is self:
            raise ValueError("an offender log cannot follow itself")
        self._followed.append(other)

    def record(self, result: AllReduceResult) -> None:
        reasons: dict[PeerID, str] = {}
        for peer_id, parts in result.limited_senders.items():
            counts = self.counts.setdefault(peer_id, OffenceCounts())
            counts.clipped_rounds += 1
            counts.clipped_parts += parts
            reasons[peer_id] = f"its contribution was clipped in {parts} part(s)"
        for peer_id in result.bad_reducers:
            counts = self.counts.setdefault(peer_id, OffenceCounts())
            counts.bad_reductions += 1
            reasons[peer_id] = result.failed_reducers.get(peer_id, "its reduction failed the check")
        if self.ban_after is None:
            return
        for peer_id in result.contributors | reasons.keys():
            recent = self._recent.get(peer_id)
            if recent is None:
                recent = self._recent[peer_id] = deque(maxlen=self.ban_window)
            recent.append(peer_id in reasons)
            if peer_id in reasons:
                self._maybe_ban(peer_id, reasons[peer_id])

    def is_banned(self, peer_id: PeerID) -> bool:
        """Banned by us (until the ban expires) or by a log we follow."""
        until = self._banned_until.get(peer_id)
        if until is not None:
            if time.monotonic() < until:
                return True
            del self._banned_until[peer_id]
        return any(other.is_banned(peer_id) for other in self._followed)

    @property
    def banned(self) -> frozenset[PeerID]:
        """Peers banned by our own evidence (not those of logs we follow)."""
        now = time.monotonic()
        return frozenset(p for p, until in list(self._banned_until.items()) if now < until)

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
        recent = self._recent[peer_id]
        offences = sum(recent)
        if self.ban_after is None or offences < self.ban_after or self.is_banned(peer_id):
            return
        self._banned_until[peer_id] = time.monotonic() + self.ban_duration
        counts = self.counts[peer_id]
        logger.warning(
            "%s: banning %s from our groups for %.0f s: it offended in %d of its last %d "
            "round(s) with us; in all %d round(s) clipped (%d parts), %d bad reduction(s); "
            "latest: %s",
            self.owner,
            peer_id,
            self.ban_duration,
            offences,
            len(recent),
            counts.clipped_rounds,
            counts.clipped_parts,
            counts.bad_reductions,
            latest,
        )
