"""Adaptive rebalancing: which peer should move to the bottleneck stage, if any (pure).

A pipeline runs at the pace of its slowest stage, the one whose servers together process
the fewest samples per second. SWARM moves peers from over-served stages to that
bottleneck. Every peer reads the same DHT records and runs the same deterministic
:func:`plan_move`, so all agree on who moves, and only that peer acts:

- the *bottleneck* is the stage with the least total throughput (an empty stage has 0);
- the *donor* is the stage with the most total throughput among those with at least two
  peers (a stage is never left empty), the bottleneck excluded;
- the donor's *least needed* peer, the slowest one, moves; peers within
  ``tie_tolerance`` (a fraction) of the slowest count as tied and the smallest id among
  them is chosen, so that measurement noise between two similar peers does not make
  peers that read the records at different moments name different movers;
- only if the pipeline's estimated throughput, the minimum over stages, grows by more
  than ``hysteresis`` (a fraction): moves cost a state download and some lost work, so
  marginal gains and measurement noise must not make peers oscillate.

A peer's speed on the new stage is estimated from the two stages' mean per-peer speeds
(a stage twice as heavy halves it); with no measured peer there, its current speed.
Peers that have not measured their throughput yet (0) count with their stage's mean
measured speed and are never chosen to move; while some stage has peers but no
measurement at all, nothing is planned (its total is unknown).

:class:`Rebalancer` adds the interval (one check per ``interval`` seconds, and none for
``interval`` after this peer moved) and tells a peer whether the move is its own. A
stage that has fewer peers than at the previous look (one left, or died and its record
lapsed) is checked at once, whatever the interval: a failure should not wait a whole
interval for its repair. Peers look every ``look_period`` seconds.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from swarmgrad.utils.checks import non_negative_number, positive_seconds
from swarmgrad.utils.errors import ValidationError

__all__ = ["Move", "RebalanceOptions", "Rebalancer", "pipeline_throughput", "plan_move"]

StageLoads = Sequence[Mapping[Hashable, float]]  # per stage: {peer: samples per second}


@dataclass(frozen=True)
class RebalanceOptions:
    """``interval``: seconds between checks; ``hysteresis``: the least relative gain of
    the pipeline's throughput that justifies a move (0.2: 20 %); ``look_period``: seconds
    between looks at the records, to notice a stage that lost a peer (capped by
    ``interval``)."""

    interval: float = 60.0
    hysteresis: float = 0.2
    tie_tolerance: float = 0.1
    look_period: float = 2.0

    def __post_init__(self) -> None:
        positive_seconds("interval", self.interval)
        positive_seconds("look_period", self.look_period)
        non_negative_number("hysteresis", self.hysteresis)
        non_negative_number("tie_tolerance", self.tie_tolerance)


@dataclass(frozen=True)
class Move:
    peer: Hashable
    from_stage: int
    to_stage: int
    throughput_before: float  # the pipeline's (its bottleneck's) samples/s now
    throughput_after: float  # estimated after the move


def _totals(stages: StageLoads) -> list[float]:
    """Each stage's samples/s, unmeasured peers counted with the stage's mean (NaN when
    the stage has peers but none measured). Sums are exact (``fsum``): every peer must
    reach the same decision whatever order its DHT read listed the peers in."""
    totals = []
    for peers in stages:
        mean = _mean_rate(peers)
        if mean is None:
            totals.append(math.nan if peers else 0.0)
        else:
            totals.append(math.fsum(r if r > 0 else mean for r in peers.values()))
    return totals


def pipeline_throughput(stages: StageLoads) -> float:
    """Samples per second the whole pipeline can sustain: its slowest stage's total
    (NaN while some stage's speed is unknown)."""
    totals = _totals(stages)
    if any(math.isnan(t) for t in totals):
        return math.nan
    return min(totals) if totals else 0.0


def _check(stages: StageLoads) -> None:
    seen: dict[Hashable, int] = {}
    for index, peers in enumerate(stages):
        for peer, rate in peers.items():
            if (
                isinstance(rate, bool)
                or not isinstance(rate, int | float)
                or not (0 <= rate < math.inf)
            ):
                raise ValidationError(
                    f"stage {index}: peer {peer!r}'s throughput must be finite and >= 0, "
                    f"got {rate!r}"
                )
            if peer in seen:
                raise ValidationError(f"peer {peer!r} is listed in stages {seen[peer]} and {index}")
            seen[peer] = index


def _mean_rate(peers: Mapping[Hashable, float]) -> float | None:
    measured = [r for r in peers.values() if r > 0]
    return math.fsum(measured) / len(measured) if measured else None


def plan_move(
    stages: StageLoads, hysteresis: float = 0.2, tie_tolerance: float = 0.1
) -> Move | None:
    """The one move that most helps the pipeline, or None (see the module docstring)."""
    _check(stages)
    if len(stages) < 2:
        return None
    totals = _totals(stages)
    if any(math.isnan(t) for t in totals):
        return None  # some stage has not measured its speed yet
    bottleneck = min(range(len(stages)), key=lambda i: (totals[i], i))
    donors = [i for i in range(len(stages)) if i != bottleneck and len(stages[i]) >= 2]
    if not donors:
        return None
    donor = max(donors, key=lambda i: (totals[i], -i))
    measured = [(rate, str(peer), peer) for peer, rate in stages[donor].items() if rate > 0]
    slowest = min(rate for rate, _, _ in measured)
    tied = [item for item in measured if item[0] <= slowest * (1 + tie_tolerance)]
    rate, _, peer = min(tied, key=lambda item: item[1])
    donor_mean, target_mean = _mean_rate(stages[donor]), _mean_rate(stages[bottleneck])
    estimate = rate if target_mean is None else rate * target_mean / donor_mean
    after = list(totals)
    after[donor] -= rate
    after[bottleneck] += estimate
    before, new = min(totals), min(after)
    improves = new > before * (1 + hysteresis) if before > 0 else new > 0
    if not improves:
        return None
    return Move(peer, donor, bottleneck, before, new)


class Rebalancer:
    """One peer's view: when to check, and whether the planned move is this peer's."""

    def __init__(self, me: Hashable, options: RebalanceOptions | None = None):
        self.me = me
        self.options = options or RebalanceOptions()
        if not isinstance(self.options, RebalanceOptions):
            raise ValidationError("options must be RebalanceOptions")
        self.next_check = -math.inf
        self._seen: list[int] | None = None  # peers per stage at the previous look

    def due(self, now: float) -> bool:
        return now >= self.next_check

    def lost_peers(self, stages: StageLoads) -> bool:
        """Whether some stage has fewer peers than at the previous look (remembers this
        look's counts for the next)."""
        counts = [len(peers) for peers in stages]
        seen, self._seen = self._seen, counts
        return (
            seen is not None
            and len(seen) == len(counts)
            and any(now < before for now, before in zip(counts, seen, strict=True))
        )

    def decide(self, now: float, stages: StageLoads) -> Move | None:
        """At a due check, or at once when a stage lost a peer: the move if this peer is
        the one to move, else None."""
        lost = self.lost_peers(stages)
        if not self.due(now) and not lost:
            return None
        self.next_check = now + self.options.interval
        move = plan_move(stages, self.options.hysteresis, self.options.tie_tolerance)
        if move is None or move.peer != self.me:
            return None
        return move

    def moved(self, now: float) -> None:
        """This peer moved: its new stage's records need time to show its speed (and
        the stage it left has one peer fewer: that is no loss to react to)."""
        self.next_check = now + self.options.interval
        self._seen = None
