"""Holding the user's tensor lock across an all-reduce without blocking the event loop.

The averaged tensors are guarded by a ``threading.RLock`` that user threads take through
``averager.get_tensors()``. An all-reduce writes into the tensors from the event loop,
so the lock must be held for the whole round, but the loop must never block waiting for
it (a user thread may hold it for a while), and an ``RLock`` may only be released by the
thread that took it.

:class:`LoopLockHolder` therefore takes and releases the lock in one dedicated worker
thread, in order: the loop awaits the acquisition and queues the release, and other
threads see an ordinary lock. Why reentrant: state sharing takes the same lock (in a
worker thread) around ``get_current_state()``, which itself calls ``get_tensors()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from typing import Any

__all__ = ["LoopLockHolder"]

logger = logging.getLogger(__name__)

_SLICE = 0.1  # seconds a worker waits for the lock before checking for close()


class LoopLockHolder:
    """Acquire ``lock`` for coroutines on the loop; see the module docstring."""

    def __init__(self, lock: Any, name: str = "averager"):
        self.lock = lock
        self._name = name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: set[asyncio.Future] = set()  # acquisitions still running
        self._closed = False

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            if self._closed:
                raise RuntimeError("the lock holder is closed")
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"swarmgrad-{self._name}-lock"
            )
        return self._executor

    async def acquire(self, timeout: float | None = None) -> bool:
        """Take the lock within ``timeout`` seconds (None: wait as long as it takes);
        True if taken. A caller cancelled meanwhile abandons the attempt: it stops within
        a fraction of a second, and a late acquisition is released at once."""
        if self._closed:
            raise RuntimeError("the lock holder is closed")
        deadline = math.inf if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        abandoned = threading.Event()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._worker(), self._acquire, deadline, abandoned)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            abandoned.set()
            future.add_done_callback(self._release_if_taken)
            raise

    def _acquire(self, deadline: float, abandoned: threading.Event) -> bool:
        """Wait in short slices, so that an abandoned attempt or close() frees the
        thread quickly (attempts queue behind each other in it)."""
        while not (self._closed or abandoned.is_set()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self.lock.acquire(True, min(remaining, _SLICE)):
                if self._closed or abandoned.is_set():
                    self.lock.release()
                    return False
                return True
        return False

    def _release_if_taken(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None and future.result():
            self.release()

    def release(self) -> None:
        """Queue the release in the lock's thread (after any pending acquisition)."""
        done = self._worker().submit(self.lock.release)
        done.add_done_callback(_log_failure)

    async def close(self) -> None:
        """Stop taking the lock, let the worker thread finish its queue (releases of
        acquisitions that were abandoned) and exit."""
        self._closed = True
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
            await asyncio.sleep(0)  # their release callbacks run before we shut down
        executor = self._executor
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)


def _log_failure(done: concurrent.futures.Future) -> None:
    if done.exception() is not None:  # a bug: releasing a lock we do not hold
        logger.error("could not release the averaged tensors' lock: %r", done.exception())
