"""The policy of pair-wise gossip: how much of a peer's parameters to take, and which
peer to ask. Pure functions and bookkeeping, no I/O (the protocol is in :mod:`.averager`).

Mixing: after pulling a peer's parameters, ``local = (1 - a) * local + a * remote`` with

``constant``
    ``a = mixing_constant``.
``clock``
    ``a = remote_samples / (local_samples + remote_samples)``: a peer that has trained on
    more samples weighs more (``a = 0.5`` while neither has seen any).
``loss``
    ``a = local_loss / (local_loss + remote_loss)``: the peer with the lower loss weighs
    more (a peer whose loss is three times ours gets ``a = 0.25``). Losses must be
    finite and non-negative; when either is unknown, negative or both are zero the rule
    falls back to ``mixing_constant``.

After mixing, the local sample clock moves the same way: ``(1 - a) * local + a * remote``.

Peer choice (flow control): every peer has a score, ``1 / latency`` (an exponential
moving average of its answer times) times ``failure_penalty ** consecutive_failures``;
a peer is drawn with probability proportional to its score. A fast peer is asked more
often than a slow one, a failing peer's score collapses after a few failures (a timeout
also counts as a slow answer), and since the score never reaches zero a recovered peer is
still found again.
"""

from __future__ import annotations

import enum
import math
import random
import statistics
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from swarmgrad.utils.errors import ValidationError

__all__ = ["MixingRule", "PeerScoreboard", "mixing_factor"]


class MixingRule(enum.StrEnum):
    CONSTANT = "constant"
    CLOCK = "clock"
    LOSS = "loss"

    @classmethod
    def parse(cls, value: str | MixingRule) -> MixingRule:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ValidationError(
                f"unknown mixing rule {value!r}; expected one of {names}"
            ) from None


def _usable_loss(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value >= 0


def mixing_factor(
    rule: MixingRule | str,
    *,
    mixing_constant: float = 0.5,
    local_samples: float = 0.0,
    remote_samples: float = 0.0,
    local_loss: float | None = None,
    remote_loss: float | None = None,
) -> float:
    """The weight ``a`` of the remote parameters (see the module docstring)."""
    rule = MixingRule.parse(rule)
    if rule is MixingRule.CLOCK:
        total = local_samples + remote_samples
        return 0.5 if total <= 0 else remote_samples / total
    if rule is MixingRule.LOSS:
        if _usable_loss(local_loss) and _usable_loss(remote_loss):
            total = local_loss + remote_loss  # type: ignore[operator]
            if total > 0:
                return local_loss / total  # type: ignore[operator]
        return mixing_constant
    return mixing_constant


@dataclass
class _PeerStats:
    latency: float | None = None  # EMA of answer times (s)
    failures: int = 0  # consecutive
    successes: int = 0
    total_failures: int = 0


class PeerScoreboard:
    """Flow-control scores of the peers we pull from (see the module docstring)."""

    def __init__(
        self,
        *,
        smoothing: float = 0.3,
        failure_penalty: float = 0.05,
        default_latency: float = 0.1,
        min_latency: float = 1e-3,
        rng: random.Random | None = None,
    ):
        if not 0 < smoothing <= 1 or not 0 < failure_penalty < 1:
            raise ValidationError("smoothing must be in (0, 1] and failure_penalty in (0, 1)")
        self.smoothing, self.failure_penalty = smoothing, failure_penalty
        self.default_latency, self.min_latency = default_latency, min_latency
        self.rng = rng or random.Random()
        self._stats: dict[Hashable, _PeerStats] = {}

    def _update_latency(self, stats: _PeerStats, latency: float) -> None:
        latency = max(latency, self.min_latency)
        if stats.latency is None:
            stats.latency = latency
        else:
            stats.latency += self.smoothing * (latency - stats.latency)

    def record_success(self, peer: Hashable, latency: float) -> None:
        stats = self._stats.setdefault(peer, _PeerStats())
        self._update_latency(stats, latency)
        stats.failures = 0
        stats.successes += 1

    def record_failure(self, peer: Hashable, latency: float) -> None:
        """A failed pull that took ``latency`` seconds (the timeout, if it timed out)."""
        stats = self._stats.setdefault(peer, _PeerStats())
        self._update_latency(stats, latency)
        stats.failures += 1
        stats.total_failures += 1

    def forget(self, peer: Hashable) -> None:
        self._stats.pop(peer, None)

    def _typical_latency(self) -> float:
        known = [s.latency for s in self._stats.values() if s.latency is not None]
        return statistics.median(known) if known else self.default_latency

    def score(self, peer: Hashable) -> float:
        """Higher is better; a peer never heard from scores like a typical one."""
        stats = self._stats.get(peer)
        if stats is None or stats.latency is None:
            latency, failures = self._typical_latency(), stats.failures if stats else 0
        else:
            latency, failures = stats.latency, stats.failures
        return self.failure_penalty ** min(failures, 20) / latency

    def choose(self, peers: Iterable[Hashable]) -> Hashable | None:
        """Draw one of ``peers`` with probability proportional to its score."""
        candidates = list(peers)
        if not candidates:
            return None
        weights = [self.score(p) for p in candidates]
        return self.rng.choices(candidates, weights=weights, k=1)[0]

    def stats(self, peer: Hashable) -> _PeerStats | None:
        return self._stats.get(peer)
