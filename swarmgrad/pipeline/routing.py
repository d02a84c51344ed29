"""Choosing a server for each hop of a micro-batch: stochastic wiring, bans, deadlines.

A pure object, no I/O: the pipeline client tells a :class:`StageRouter` what the DHT says
about a stage's servers and what happened to each hop, and asks it which server to try
next and how long to wait for it. The client keeps one router per stage.

- **Stochastic wiring** (SWARM): a server is chosen at random with probability
  proportional to its expected service rate, ``throughput / (queue + batch)`` (samples
  per second it can give to one more request). A server that has not measured its
  throughput yet counts with the stage's median (or ``initial_throughput``), so a new
  server gets traffic and thus a measurement. Spreading micro-batches this way keeps
  every server busy in proportion to its speed instead of piling onto the fastest.
- **Bans**: a server that failed (unreachable, refused, too slow) is left out for
  ``ban_seconds``, doubling with each consecutive failure up to ``max_ban_seconds``; one
  that was *blamed* (its answer was malformed: wrong shape or dtype) starts at
  ``blame_ban_seconds``. A success clears the strikes. When every server is banned the
  one whose ban ends first is tried: a stage is never given up for bans alone.
- **Hop deadline**, adaptive like the averaging deadlines: ``slack`` times a high
  quantile of recent successful hop times, within ``[min_deadline, max_deadline]``;
  ``initial_deadline`` before any hop was measured. A stalled server trips it after a
  few times the usual pace; a merely slow swarm raises it. Each try of one hop that
  missed its deadline doubles the next try's (a stage that lost servers queues longer).
"""

from __future__ import annotations

import collections
import math
import random
import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from swarmgrad.utils.checks import positive_int, positive_number, positive_seconds
from swarmgrad.utils.errors import ValidationError

__all__ = ["RoutingOptions", "ServerLoad", "StageRouter"]


@dataclass(frozen=True)
class RoutingOptions:
    """Options of the stage routers (one validated object, shared by every stage)."""

    ban_seconds: float = 5.0
    max_ban_seconds: float = 60.0
    blame_ban_seconds: float = 30.0
    initial_deadline: float = 30.0
    min_deadline: float = 1.0
    max_deadline: float = 120.0
    slack: float = 3.0
    quantile: float = 0.9
    window: int = 64
    initial_throughput: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "ban_seconds", "max_ban_seconds", "blame_ban_seconds", "initial_deadline",
            "min_deadline", "max_deadline",
        ):  # fmt: skip
            positive_seconds(name, getattr(self, name))
        positive_number("slack", self.slack)
        positive_number("initial_throughput", self.initial_throughput)
        positive_int("window", self.window)
        if not 0 < self.quantile <= 1:
            raise ValidationError(f"quantile must be in (0, 1], got {self.quantile!r}")
        if self.min_deadline > self.max_deadline:
            raise ValidationError(
                f"min_deadline={self.min_deadline} exceeds max_deadline={self.max_deadline}"
            )
        if self.ban_seconds > self.max_ban_seconds:
            raise ValidationError(
                f"ban_seconds={self.ban_seconds} exceeds max_ban_seconds={self.max_ban_seconds}"
            )


@dataclass(frozen=True)
class ServerLoad:
    """What a stage server announced: its id, samples/s (0: not measured) and queue."""

    server: Hashable
    throughput: float
    queue: int = 0


@dataclass
class _Strikes:
    count: int = 0
    banned_until: float = -math.inf


@dataclass
class StageRouter:
    """Routing decisions for one stage. ``rng`` makes the choices reproducible in tests."""

    options: RoutingOptions = field(default_factory=RoutingOptions)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not isinstance(self.options, RoutingOptions):
            raise ValidationError(f"options must be RoutingOptions, got {self.options!r:.80}")
        self._strikes: dict[Hashable, _Strikes] = {}
        self._hop_times: collections.deque[float] = collections.deque(maxlen=self.options.window)

    # ------------------------------------------------------------------ choice

    def weights(self, servers: Sequence[ServerLoad], batch_size: int = 1) -> dict[Hashable, float]:
        """Each server's expected service rate for one more request of ``batch_size``."""
        measured = [s.throughput for s in servers if s.throughput > 0]
        default = statistics.median(measured) if measured else self.options.initial_throughput
        return {
            s.server: (s.throughput if s.throughput > 0 else default)
            / (max(s.queue, 0) + batch_size)
            for s in servers
        }

    def choose(
        self,
        servers: Sequence[ServerLoad],
        now: float,
        *,
        batch_size: int = 1,
        exclude: Iterable[Hashable] = (),
    ) -> Hashable | None:
        """A server for the next try, or None when ``servers`` minus ``exclude`` is empty.

        Servers not banned at ``now`` are drawn weighted by :meth:`weights`; if all are
        banned, the one whose ban ends first."""
        excluded = set(exclude)
        candidates = [s for s in servers if s.server not in excluded]
        if not candidates:
            return None
        free = [s for s in candidates if not self.is_banned(s.server, now)]
        if not free:
            return min(candidates, key=lambda s: self._strikes[s.server].banned_until).server
        weights = self.weights(free, batch_size)
        drawn = [weights[s.server] for s in free]
        if not 0 < math.fsum(drawn) < math.inf:  # rates so small (or large) they vanish
            drawn = None  # in floating point: every free server equally likely
        return self.rng.choices([s.server for s in free], weights=drawn)[0]

    # ------------------------------------------------------------------ outcomes

    def is_banned(self, server: Hashable, now: float) -> bool:
        strikes = self._strikes.get(server)
        return strikes is not None and now < strikes.banned_until

    def banned_until(self, server: Hashable) -> float:
        strikes = self._strikes.get(server)
        return -math.inf if strikes is None else strikes.banned_until

    def report_success(self, server: Hashable, hop_seconds: float, now: float) -> None:
        """A hop answered correctly in ``hop_seconds``: clear its strikes, learn the time."""
        self._strikes.pop(server, None)
        if hop_seconds >= 0 and math.isfinite(hop_seconds):
            self._hop_times.append(hop_seconds)

    def report_failure(self, server: Hashable, now: float) -> float:
        """The server failed or missed its deadline: ban it (doubling); returns the end."""
        return self._ban(server, now, self.options.ban_seconds)

    def blame(self, server: Hashable, now: float) -> float:
        """The server answered wrongly (malformed activations): a long ban."""
        return self._ban(server, now, self.options.blame_ban_seconds)

    def _ban(self, server: Hashable, now: float, base: float) -> float:
        strikes = self._strikes.setdefault(server, _Strikes())
        strikes.count += 1
        length = min(base * 2 ** (strikes.count - 1), max(self.options.max_ban_seconds, base))
        strikes.banned_until = max(strikes.banned_until, now + length)
        return strikes.banned_until

    def forget(self, keep: Iterable[Hashable]) -> None:
        """Drop the strikes of servers not in ``keep`` (they left the DHT)."""
        kept = set(keep)
        for server in [s for s in self._strikes if s not in kept]:
            del self._strikes[server]

    # ------------------------------------------------------------------ deadline

    def hop_deadline(self, late_tries: int = 0) -> float:
        """Seconds to wait for the next hop's answer; ``late_tries``: how many tries of
        this hop already missed their deadline. Each doubles it (up to ``max_deadline``):
        when a stage lost servers, the queue of those left grows beyond what recent hops
        took, and a deadline that never grew would drop every micro-batch there."""
        options = self.options
        if not self._hop_times:
            base = options.initial_deadline
        else:
            ordered = sorted(self._hop_times)
            index = min(len(ordered) - 1, math.ceil(options.quantile * len(ordered)) - 1)
            base = min(
                options.max_deadline, max(options.min_deadline, options.slack * ordered[index])
            )
        if late_tries <= 0:
            return base
        return min(max(options.max_deadline, base), base * 2 ** min(late_tries, 32))
