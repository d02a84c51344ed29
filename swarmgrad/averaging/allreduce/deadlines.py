"""How long an all-reduce waits for the next part before giving up on a peer.

A fixed timeout is wrong in both directions: a few seconds excludes every peer on a slow
link, and minutes make a stalled peer hold up the whole group. So each wait is sized from
the part it waits for and the throughput observed so far::

    wait = max(min_timeout, slack * part_bytes / rate)

where ``rate`` is what this stream has delivered so far, or, before its first part, the
slower of the initial guess and what the other streams of the round have delivered. A
peer that is merely slower than the guess gets longer waits after its first part; a peer
that stops sending trips the timer after ``slack`` times its usual pace.

An owner may itself wait up to a sender's timeout before excluding a stalled sender, so
a sender waits for the owner's averaged parts twice as long as the owner would wait for
a part from it. Explicit ``sender_timeout`` / ``reducer_timeout`` override the rule.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from swarmgrad.utils.checks import positive_number

__all__ = ["AdaptiveTimeouts", "ThroughputMeter"]


@dataclass
class ThroughputMeter:
    """Bytes delivered and seconds waited for them on one stream."""

    nbytes: int = 0
    seconds: float = 0.0
    samples: int = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        self.nbytes += nbytes
        self.seconds += max(seconds, 0.0)
        self.samples += 1

    @property
    def rate(self) -> float | None:
        """Bytes per second so far, or None before the first observation."""
        if self.samples == 0 or self.nbytes == 0:
            return None
        return self.nbytes / max(self.seconds, 1e-6)


@dataclass
class AdaptiveTimeouts:
    """Wait sizes for one all-reduce round (see the module docstring)."""

    sender_timeout: float | None = None
    reducer_timeout: float | None = None
    min_timeout: float = 5.0
    slack: float = 4.0
    initial_rate: float = 1e6  # bytes/s guessed before anything is observed
    _meters: list[ThroughputMeter] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for name in ("sender_timeout", "reducer_timeout"):
            if getattr(self, name) is not None:
                positive_number(name, getattr(self, name))
        for name in ("min_timeout", "slack", "initial_rate"):
            positive_number(name, getattr(self, name))

    def new_meter(self) -> ThroughputMeter:
        meter = ThroughputMeter()
        self._meters.append(meter)
        return meter

    def observed_rate(self) -> float | None:
        """Median throughput over the round's streams that delivered something."""
        rates = [rate for meter in self._meters if (rate := meter.rate) is not None]
        return statistics.median(rates) if rates else None

    def _adaptive(self, meter: ThroughputMeter, nbytes: int) -> float:
        rate = meter.rate
        if rate is None:
            rate = self.initial_rate
            observed = self.observed_rate()
            if observed is not None:
                rate = min(rate, observed)
        return max(self.min_timeout, self.slack * nbytes / rate)

    def sender_wait(self, meter: ThroughputMeter, nbytes: int) -> float:
        """How long an owner waits for a sender's next part of ``nbytes``."""
        if self.sender_timeout is not None:
            return self.sender_timeout
        return self._adaptive(meter, nbytes)

    def reducer_wait(self, meter: ThroughputMeter, nbytes: int) -> float:
        """How long a sender waits for an owner's next averaged part of ``nbytes``."""
        if self.reducer_timeout is not None:
            return self.reducer_timeout
        if self.sender_timeout is not None:
            return 2 * self.sender_timeout + self._adaptive(meter, nbytes)
        return 2 * self._adaptive(meter, nbytes)
