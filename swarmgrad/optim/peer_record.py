"""A peer's own record in the DHT (its training progress, its metrics): kept there by a
background task on the loop, and withdrawn when the peer leaves, so the others stop
counting it at once instead of when the record expires."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from swarmgrad.dht.dht import DHT
from swarmgrad.utils.loop_thread import get_loop, run_coroutine_future
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["PeerRecord"]

logger = logging.getLogger(__name__)


class PeerRecord:
    """This peer's record under ``key``/``subkey``, stored to live ``expiration`` seconds
    by the task given to :meth:`start` (which ends when :attr:`stop` is set), and withdrawn
    once by :meth:`withdraw`. ``what`` names the record in the logs."""

    def __init__(self, dht: DHT, key: Any, subkey: Any, expiration: float, what: str):
        self.dht, self.key, self.subkey = dht, key, subkey
        self.expiration, self.what = expiration, what
        self.stop = asyncio.Event()  # not bound to a loop until used; set on the loop
        self.task: concurrent.futures.Future | None = None
        self._withdrawn = False

    def start(self, publishing: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        self.task = run_coroutine_future(publishing)
        return self.task

    def is_alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def withdraw(self, timeout: float | None) -> None:
        """Stop the task (set :attr:`stop`, wait at most ``timeout`` seconds, then cancel
        it) and store None over the record, its goodbye, waiting at most ``timeout`` for
        that. Once; nothing before :meth:`start`. Without a DHT node, or when the goodbye
        fails (logged at debug level), the record simply expires."""
        task = self.task
        if task is None or self._withdrawn:
            return
        self._withdrawn = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs
            get_loop().call_soon_threadsafe(self.stop.set)
        with contextlib.suppress(Exception):  # the task's errors were its own to report
            task.result(timeout)
        if not task.done():
            task.cancel()
        if self.dht.node is None:
            return
        goodbye = self.dht.store(
            self.key,
            subkey=self.subkey,
            value=None,
            expiration_time=get_dht_time() + self.expiration,
            return_future=True,
        )
        try:
            goodbye.result(timeout)
        except Exception as e:
            logger.debug("could not withdraw %s: %r", self.what, e)
            goodbye.cancel()
