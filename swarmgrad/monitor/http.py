"""A very small HTTP/1.1 server for the monitor, on asyncio streams (no dependency).

It answers GET (and HEAD) for a fixed set of paths, one request per connection
(``Connection: close``), with bounded request lines and headers and a deadline per
request, so a slow or hostile client costs one short-lived task. That is all a dashboard
page, its JSON and a Prometheus scraper need.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable

from swarmgrad.utils.errors import SwarmgradError

__all__ = ["HTTPServer", "PortInUse", "Response"]

logger = logging.getLogger(__name__)

_MAX_LINE = 8 * 1024
_MAX_HEADERS = 64
_REQUEST_TIMEOUT = 10.0

Response = tuple[int, str, bytes]  # status, content type, body
Handler = Callable[[], Awaitable[Response] | Response]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    500: "Internal Server Error",
}


class PortInUse(SwarmgradError):
    """The address the monitor should listen on is taken."""


class HTTPServer:
    """Serves ``routes`` (path -> handler returning a :data:`Response`) on host:port."""

    def __init__(self, routes: dict[str, Handler]):
        self.routes = routes
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self.requests = 0

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0). Raises :class:`PortInUse`."""
        try:
            self._server = await asyncio.start_server(
                self._serve, host, port, reuse_address=True, limit=_MAX_LINE
            )
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(
                    f"port {port} on {host} is already in use; pick another with --port"
                ) from None
            raise
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            try:
                async with asyncio.timeout(_REQUEST_TIMEOUT):
                    method, path = await _read_request(reader)
                status, content_type, body = await self._respond(method, path)
            except TimeoutError:
                status, content_type, body = 408, "text/plain", b"request timeout\n"
                method = "GET"
            except (ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
                status, content_type, body = 400, "text/plain", b"bad request\n"
                method = "GET"
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\n"
                "Connection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(head if method == "HEAD" else head + body)
            async with asyncio.timeout(_REQUEST_TIMEOUT):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _respond(self, method: str, path: str) -> Response:
        self.requests += 1
        handler = self.routes.get(path.split("?", 1)[0])
        if handler is None:
            return 404, "text/plain", f"no page at {path}\n".encode()
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        try:
            result = handler()
            if isinstance(result, Awaitable):
                result = await result
            return result
        except Exception as e:
            logger.exception("monitor: the page %s failed", path)
            return 500, "text/plain", f"internal error: {e!r}\n".encode()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    line = await reader.readuntil(b"\r\n")
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"not an HTTP request line: {line[:80]!r}")
    for _ in range(_MAX_HEADERS + 1):
        if await reader.readuntil(b"\r\n") == b"\r\n":
            return parts[0], parts[1]
    raise ValueError("too many headers")
