"""Which expert servers failed recently, so calls go to the others first.

A server that refused a connection or died mid-call is likely to fail the next call too;
trying it first would cost every caller a connection timeout. Failures are remembered for
a short, growing time (a server that keeps failing is avoided longer); one success clears
the record. The registry is process-wide because a process is one peer: what one expert
call learned about a server holds for every other call through the same peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from swarmgrad.net.identity import PeerID

__all__ = ["SERVER_HEALTH", "ServerHealth"]


class ServerHealth:
    """Servers to avoid for now, with exponential backoff per consecutive failure."""

    def __init__(
        self,
        base_ban: float = 2.0,
        max_ban: float = 60.0,
        max_entries: int = 10_000,
        time_fn: Callable[[], float] = time.monotonic,
    ):
        self.base_ban, self.max_ban, self.max_entries = base_ban, max_ban, max_entries
        self.time_fn = time_fn
        self._failures: dict[PeerID, tuple[int, float]] = {}  # peer -> (count, banned until)

    def is_healthy(self, peer_id: PeerID) -> bool:
        entry = self._failures.get(peer_id)
        return entry is None or entry[1] <= self.time_fn()

    def mark_failed(self, peer_id: PeerID) -> None:
        now = self.time_fn()
        if len(self._failures) >= self.max_entries:  # bounded whatever the churn
            for stale in [p for p, (_, until) in self._failures.items() if until <= now]:
                del self._failures[stale]
            if len(self._failures) >= self.max_entries:
                self._failures.pop(next(iter(self._failures)))
        count = self._failures.get(peer_id, (0, 0.0))[0] + 1
        ban = min(self.base_ban * 2 ** (count - 1), self.max_ban)
        self._failures[peer_id] = (count, now + ban)

    def mark_ok(self, peer_id: PeerID) -> None:
        if self._failures:  # the common case (nothing ever failed) costs one truth test
            self._failures.pop(peer_id, None)

    def clear(self) -> None:
        self._failures.clear()


#: The process's registry, shared by every expert call.
SERVER_HEALTH = ServerHealth()
