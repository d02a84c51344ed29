"""A peer's own record in the DHT (its training progress, its metrics): published by a
background task on the loop, and withdrawn when the peer leaves, so the others stop
counting it at once instead of when the record expires."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

from swarmgrad.dht.dht import DHT
from swarmgrad.utils.loop_thread import get_loop
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["stop_publishing", "withdraw_record"]


def stop_publishing(
    task: concurrent.futures.Future, stop: asyncio.Event | None, timeout: float | None
) -> None:
    """Set ``stop`` on the loop, wait at most ``timeout`` seconds for the publishing
    ``task`` to end (its errors were its own to report), then cancel it if it has not."""
    if stop is not None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs
            get_loop().call_soon_threadsafe(stop.set)
    with contextlib.suppress(Exception):
        task.result(timeout)
    if not task.done():
        task.cancel()


def withdraw_record(
    dht: DHT, key: Any, subkey: Any, expiration: float, timeout: float | None
) -> None:
    """Store None over this peer's record (its goodbye), valid ``expiration`` seconds, and
    wait at most ``timeout`` for it; what went wrong is raised, the store cancelled."""
    goodbye = dht.store(
        key,
        subkey=subkey,
        value=None,
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )
    try:
        goodbye.result(timeout)
    except Exception:
        goodbye.cancel()
        raise
