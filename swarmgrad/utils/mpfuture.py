"""``MPFuture``: hivemind's future type, as a plain thread-safe future.

hivemind's ``MPFuture`` can be fulfilled from another process through pipes and shared
memory, because hivemind runs its DHT and averagers in forked processes. swarmgrad runs
them on one event-loop thread in the caller's process, so the futures its facades return
(``DHT.get(..., return_future=True)``, ``averager.step(wait=False)``) are
``concurrent.futures.Future`` objects. ``MPFuture`` is that, plus ``await`` support, so
code that creates, awaits, fulfils or type-checks an ``MPFuture`` runs unchanged; it does
not cross process boundaries (pickling one raises, saying so).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures._base as _base
import enum
import multiprocessing.connection
from typing import Any

__all__ = [
    "ALL_STATES",
    "MPFuture",
    "PID",
    "PipeEnd",
    "SharedBytes",
    "State",
    "TERMINAL_STATES",
    "UID",
    "UpdateType",
]

PID, UID, State, PipeEnd = int, int, str, multiprocessing.connection.Connection
ALL_STATES = (_base.PENDING, _base.RUNNING, _base.FINISHED, _base.CANCELLED)
ALL_STATES += (_base.CANCELLED_AND_NOTIFIED,)
TERMINAL_STATES = {_base.FINISHED, _base.CANCELLED, _base.CANCELLED_AND_NOTIFIED}


class UpdateType(enum.Enum):
    """The kinds of update hivemind sends between processes (kept for type checks)."""

    RESULT = enum.auto()
    EXCEPTION = enum.auto()
    CANCEL = enum.auto()


class MPFuture(concurrent.futures.Future):
    """A thread-safe future that can also be awaited from any event loop."""

    def __init__(self, *, use_lock: bool = True):
        super().__init__()  # concurrent.futures.Future always locks; use_lock is accepted

    @staticmethod
    def reset_backend() -> None:
        """hivemind resets its inter-process pipes after a fork; there are none here."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()

    def __reduce__(self):
        raise TypeError(
            "swarmgrad's MPFuture does not cross processes (everything runs in the caller's "
            "process); send the result instead"
        )


class SharedBytes:
    """hivemind's shared-memory byte allocator for cross-process futures. swarmgrad has no
    cross-process futures, so there is nothing to allocate."""

    @classmethod
    def next(cls) -> Any:
        raise NotImplementedError(
            "SharedBytes backs hivemind's cross-process futures; swarmgrad's futures live in "
            "one process: use MPFuture (a concurrent.futures.Future) directly"
        )
