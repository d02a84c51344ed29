"""Which chunk each donor fetches next: the bookkeeping of a multi-donor download.

Donors pull work: each of a donor's fetch slots asks :meth:`ChunkScheduler.take` for a
chunk when it is free, so a fast donor serves more chunks than a slow one without any
rate estimate. A chunk whose fetch fails goes back to the pool for any donor that holds
it (same digest). When nothing is left to hand out, an idle donor may fetch a copy of a
chunk that has been in flight elsewhere for longer than ``steal_after`` seconds (the
"endgame": the first verified copy wins, the other fetch is cancelled), so one slow donor
cannot hold the whole download back.

Pure bookkeeping, no I/O and no clock of its own: the driver passes the time in.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable

__all__ = ["ChunkScheduler"]

Donor = Hashable


class ChunkScheduler:
    def __init__(self, missing: Iterable[int], *, max_copies: int = 2):
        self._missing: set[int] = set(missing)
        self._unassigned: set[int] = set(self._missing)
        self._in_flight: dict[int, dict[Donor, float]] = {}  # chunk -> {donor: start time}
        self._eligible: dict[Donor, frozenset[int] | None] = {}  # None: every chunk
        self._queues: dict[Donor, list[int]] = {}  # per donor, a heap (may hold stale entries)
        self.max_copies = max_copies

    # ------------------------------------------------------------------ donors

    @property
    def donors(self) -> list[Donor]:
        return list(self._eligible)

    def add_donor(self, donor: Donor, eligible: Iterable[int] | None = None) -> None:
        """A donor that can serve ``eligible`` chunks (None: all of them)."""
        chunks = None if eligible is None else frozenset(eligible)
        self._eligible[donor] = chunks
        pool = self._unassigned if chunks is None else self._unassigned & chunks
        queue = list(pool)
        heapq.heapify(queue)
        self._queues[donor] = queue

    def remove_donor(self, donor: Donor) -> list[int]:
        """Forget a donor; its chunks in flight go back to the pool. Returns them."""
        self._eligible.pop(donor, None)
        self._queues.pop(donor, None)
        returned = sorted(c for c, fetchers in self._in_flight.items() if donor in fetchers)
        for chunk in returned:
            self.fail(chunk, donor)
        return returned

    def _can_serve(self, donor: Donor, chunk: int) -> bool:
        eligible = self._eligible.get(donor, frozenset())
        return eligible is None or chunk in eligible

    # ------------------------------------------------------------------ work

    def take(self, donor: Donor, now: float, steal_after: float) -> int | None:
        """The next chunk for ``donor`` to fetch, or None if there is nothing for it now."""
        queue = self._queues.get(donor)
        if queue is None:
            return None
        while queue:
            chunk = heapq.heappop(queue)
            if chunk in self._unassigned:
                self._unassigned.discard(chunk)
                self._in_flight[chunk] = {donor: now}
                return chunk
        oldest: tuple[float, int] | None = None
        for chunk, fetchers in self._in_flight.items():
            if donor in fetchers or len(fetchers) >= self.max_copies:
                continue
            if not self._can_serve(donor, chunk):
                continue
            started = min(fetchers.values())
            if now - started >= steal_after and (oldest is None or started < oldest[0]):
                oldest = (started, chunk)
        if oldest is None:
            return None
        self._in_flight[oldest[1]][donor] = now
        return oldest[1]

    def fetchers(self, chunk: int) -> list[Donor]:
        return list(self._in_flight.get(chunk, ()))

    def finish(self, chunk: int, donor: Donor) -> list[Donor]:
        """``donor`` delivered a verified ``chunk``. Returns the other donors still fetching
        it (their fetches are now useless)."""
        others = [d for d in self._in_flight.pop(chunk, {}) if d != donor]
        self._missing.discard(chunk)
        self._unassigned.discard(chunk)
        return others

    def fail(self, chunk: int, donor: Donor) -> None:
        """``donor`` could not deliver ``chunk``: unless another donor is fetching it, it
        goes back to the pool of every donor that holds it."""
        fetchers = self._in_flight.get(chunk)
        if fetchers is not None:
            fetchers.pop(donor, None)
            if fetchers:
                return
            del self._in_flight[chunk]
        if chunk not in self._missing or chunk in self._unassigned:
            return
        self._unassigned.add(chunk)
        for other, queue in self._queues.items():
            if self._can_serve(other, chunk):
                heapq.heappush(queue, chunk)

    # ------------------------------------------------------------------ state

    @property
    def complete(self) -> bool:
        return not self._missing

    @property
    def num_missing(self) -> int:
        return len(self._missing)

    def has_work(self, donor: Donor) -> bool:
        """Whether ``donor`` holds a missing chunk it does not already fetch (now or once
        an endgame copy becomes allowed)."""
        for chunk in self._missing:
            if self._can_serve(donor, chunk) and donor not in self._in_flight.get(chunk, ()):
                return True
        return False

    def unobtainable(self) -> list[int]:
        """Missing chunks that no remaining donor holds: the download cannot finish with
        the donors it has."""
        return sorted(
            chunk
            for chunk in self._missing
            if not any(self._can_serve(donor, chunk) for donor in self._eligible)
        )
