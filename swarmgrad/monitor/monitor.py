"""``Monitor``: reads the swarm's progress and metrics records and serves them over HTTP.

::

    dht = swarmgrad.DHT(initial_peers=[...], client_mode=True, start=True)
    monitor = Monitor(dht, run_ids=None, host="127.0.0.1", port=8080, start=True)
    print(monitor.url)          # the dashboard; /metrics for Prometheus; /api/snapshot
    ...
    monitor.shutdown()

Every ``poll_interval`` seconds it reads the run directory (unless ``run_ids`` are
given), then each run's ``{run}_progress`` and ``{run}_metrics`` keys, and hands what
it found to a :class:`~.collector.SwarmView`. The poll task and the HTTP server run on
the process's event loop thread, like every other swarmgrad component; nothing in the
swarm depends on the monitor, and it writes nothing to the DHT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Any

from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.dht import DHT
from swarmgrad.monitor.collector import (
    SwarmView,
    parse_metrics,
    parse_progress,
    parse_run_directory,
)
from swarmgrad.monitor.http import HTTPServer, PortInUse
from swarmgrad.monitor.page import render_page
from swarmgrad.monitor.prometheus import CONTENT_TYPE, render_metrics
from swarmgrad.optim.metrics import RUNS_KEY, metrics_key
from swarmgrad.utils.checks import positive_seconds
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import run_coroutine
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["Monitor", "PortInUse"]

logger = logging.getLogger(__name__)


class Monitor:
    """The swarm's dashboard (module docstring).

    ``run_ids``: the runs to follow (None: every run in the run directory, at most
    :data:`~.collector.MAX_RUNS`); ``host``/``port``: where to serve (``port=None``: no
    HTTP server, only :meth:`snapshot`; 0: any free port); ``poll_interval`` (seconds);
    ``history``: points kept per run; ``start``.
    """

    def __init__(
        self,
        dht: DHT,
        run_ids: list[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = 8080,
        poll_interval: float = 2.0,
        history: int = 720,
        start: bool = True,
    ):
        if dht.peer is None:
            raise ValidationError("the DHT is not running: start it before the Monitor")
        positive_seconds("poll_interval", poll_interval)
        if port is not None and not 0 <= port <= 65535:
            raise ValidationError(f"port must be between 0 and 65535, got {port}")
        for run_id in run_ids or ():
            if not isinstance(run_id, str) or not 0 < len(run_id) <= 128:
                raise ValidationError(f"a run id is a str of 1 to 128 characters: {run_id!r}")
        self.dht, self.run_ids = dht, list(run_ids) if run_ids else None
        self.host, self.port, self.poll_interval = host, port, float(poll_interval)
        # verifies the owners' signatures of what we read (and strips them off); no
        # schema validator, so malformed records reach the collector and are counted
        dht.add_validators([Ed25519SignatureValidator(dht.peer.identity)])
        self.view = SwarmView(history=history)
        self._lock = threading.Lock()  # guards view between the loop and snapshot()
        self._http = HTTPServer(
            {
                "/": self._page,
                "/index.html": self._page,
                "/metrics": self._prometheus,
                "/api/snapshot": self._json,
            }
        )
        self._poller: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._first_poll: asyncio.Event | None = None
        self._started = self._closed = False
        if start:
            self.start()

    @property
    def url(self) -> str | None:
        """The dashboard's address (None without an HTTP server)."""
        if self.port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self, timeout: float = 30.0) -> None:
        """Listen (raises :class:`PortInUse` if the port is taken) and start polling."""
        if self._started:
            raise ValidationError("this Monitor is already running")
        self._started = True
        run_coroutine(self._start(), timeout=timeout)

    async def _start(self) -> None:
        if self.port is not None:
            self.port = await self._http.start(self.host, self.port)
        self._stop, self._first_poll = asyncio.Event(), asyncio.Event()
        self._poller = asyncio.ensure_future(self._poll_forever())

    def wait_for_first_poll(self, timeout: float = 30.0) -> None:
        async def wait() -> None:
            assert self._first_poll is not None
            await self._first_poll.wait()

        run_coroutine(wait(), timeout=timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop polling and serving (idempotent)."""
        if not self._started or self._closed:
            return
        self._closed = True
        run_coroutine(self._shutdown(), timeout=timeout)

    async def _shutdown(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        await self._http.close()

    def snapshot(self) -> dict[str, Any]:
        """The current view (see docs/monitor.md for its fields), JSON-ready."""
        with self._lock:
            return self.view.snapshot(get_dht_time())

    async def poll_once(self) -> None:
        """Read the DHT once and update the view."""
        node = self.dht.node
        if node is None:
            return
        timeout = max(5.0, 2 * self.poll_interval)
        try:
            async with asyncio.timeout(timeout):
                run_ids = self.run_ids
                if run_ids is None:
                    found = await node.get(RUNS_KEY, latest=True)
                    run_ids, refused = parse_run_directory(found)
                    with self._lock:
                        self.view.count_rejected(refused)
                keys = [f"{run}_progress" for run in run_ids]
                keys += [metrics_key(run) for run in run_ids]
                found = await node.get_many(keys, latest=True) if keys else {}
        except (Exception, TimeoutError) as e:
            with self._lock:
                self.view.poll_errors += 1
                self.view.last_poll_error = repr(e) if str(e) else type(e).__name__
            logger.debug("monitor: reading the swarm failed: %r", e)
            return
        now = get_dht_time()
        with self._lock:
            if self.run_ids is None:
                self.view.retain_runs(run_ids)
            for run in run_ids:
                self.view.update_run(
                    run,
                    parse_progress(found.get(f"{run}_progress")),
                    parse_metrics(found.get(metrics_key(run))),
                    now,
                )
            self.view.polls += 1
            self.view.last_poll_time = now
            self.view.last_poll_error = None

    async def _poll_forever(self) -> None:
        assert self._first_poll is not None
        while True:
            await self.poll_once()
            self._first_poll.set()
            await asyncio.sleep(self.poll_interval)

    # ------------------------------------------------------------------ pages

    def _page(self) -> tuple[int, str, bytes]:
        return 200, "text/html; charset=utf-8", render_page(self.snapshot()).encode()

    def _json(self) -> tuple[int, str, bytes]:
        body = json.dumps(self.snapshot(), allow_nan=False, default=str).encode()
        return 200, "application/json", body

    def _prometheus(self) -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE, render_metrics(self.snapshot()).encode()

    def __enter__(self) -> Monitor:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, polls={self.view.polls})"
