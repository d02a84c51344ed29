"""Time: the shared wall clock of DHT records, and deadlines for local waits.

:func:`get_dht_time` is wall-clock time (seconds since the epoch), as in hivemind: DHT
expiration times are compared across peers, so they need a clock all peers roughly agree
on. Local waits use :class:`Deadline`, on the monotonic clock, which never jumps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from swarmgrad.utils.errors import DeadlineExceeded

__all__ = ["Deadline", "DHTExpiration", "get_dht_time"]

DHTExpiration = float
"""An expiration time in :func:`get_dht_time` seconds."""


def get_dht_time() -> float:
    """Wall-clock time in seconds since the epoch: the clock of DHT expiration times."""
    return time.time()


@dataclass(frozen=True)
class Deadline:
    """A point in time (on the monotonic clock) by which something must be done.

    ``Deadline.after(5.0)`` is five seconds from now; pass ``deadline.remaining()`` to
    each wait along the way, e.g. ``async with asyncio.timeout(deadline.remaining())``.
    """

    at: float
    """``time.monotonic()`` value of the deadline."""

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, what: str = "operation") -> None:
        """Raise DeadlineExceeded naming ``what`` if the deadline has passed."""
        if self.expired:
            raise DeadlineExceeded(f"{what} ran past its deadline")

    def earliest(self, other: Deadline | None) -> Deadline:
        """The earlier of two deadlines (``None`` means no other deadline)."""
        return self if other is None or self.at <= other.at else other
