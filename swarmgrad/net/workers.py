"""A small bounded pool of worker threads for the data path's CPU-heavy steps.

Why: a peer's one event-loop thread seals and opens every AES-GCM record of every
connection, so on a fast link a peer tops out near what one core can encrypt and copy
(issue 33: about 3 Gbit/s of tensor data however many cores it has). OpenSSL's AES-GCM
(through ``cryptography``) releases the GIL, so records of a megabyte sealed or opened on
worker threads run on other cores while the loop thread does the sockets.

What goes to the pool: only records of at least :data:`OFFLOAD_MIN` bytes; below that the
hand-over (a queue, a thread wake-up, a callback back to the loop) costs more than the
work, and RPC-sized messages stay inline on the loop thread, as fast as before.

How many threads: ``SWARMGRAD_DATA_THREADS`` (an int >= 0; 0 keeps everything on the
loop thread), else one per two processors this process may run on beyond the first two,
at most :data:`MAX_DEFAULT_THREADS`. On a 2-processor machine that is none: there every
core is already busy with the peers' loop threads and the kernel's socket copies, and
handing work over would only add to it. Threads, not processes: notebooks, spawn and
fork keep working (a forked child starts a pool of its own on first use).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["ENV", "OFFLOAD_MIN", "THREAD_PREFIX", "configured_threads", "pool", "set_threads"]

ENV = "SWARMGRAD_DATA_THREADS"
THREAD_PREFIX = "swarmgrad-data"
OFFLOAD_MIN = 256 * 1024
MAX_DEFAULT_THREADS = 4

_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_threads: int | None = None  # None: not decided yet


def _available_processors() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def configured_threads() -> int:
    """Worker threads this process uses (0: none, everything on the loop thread)."""
    raw = os.environ.get(ENV)
    if raw is not None and raw.strip():
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be an integer >= 0, got {raw!r}") from None
        if value < 0:
            raise ValueError(f"{ENV} must be an integer >= 0, got {raw!r}")
        return value
    return min(MAX_DEFAULT_THREADS, max(0, (_available_processors() - 2) // 2))


def set_threads(threads: int | None) -> None:
    """Use ``threads`` worker threads from now on (None: decide again from the
    environment). Work already handed to the old pool finishes there."""
    global _pool, _threads
    if threads is not None and (not isinstance(threads, int) or threads < 0):
        raise ValueError(f"threads must be an integer >= 0 or None, got {threads!r}")
    with _lock:
        old, _pool, _threads = _pool, None, threads
    if old is not None:
        old.shutdown(wait=False)


def pool() -> concurrent.futures.ThreadPoolExecutor | None:
    """The process's data-path pool, or None when it has no worker threads."""
    global _pool, _threads
    if _pool is not None:
        return _pool
    with _lock:
        if _threads is None:
            _threads = configured_threads()
        if _threads and _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=_threads, thread_name_prefix=THREAD_PREFIX
            )
        return _pool


def _after_fork_in_child() -> None:
    global _pool, _lock
    _pool = None  # the parent's threads do not exist here
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
