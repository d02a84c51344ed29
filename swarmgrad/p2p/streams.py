"""asyncio-style reader and writer over a swarmgrad stream, for hivemind's binary stream
handlers (``P2P.add_binary_stream_handler``), which take ``(info, reader, writer)``."""

from __future__ import annotations

import asyncio

from swarmgrad.net.mux import Stream
from swarmgrad.utils.errors import ConnectionClosed, ValidationError

__all__ = ["StreamReader", "StreamWriter"]


class StreamReader:
    """The reading half with :class:`asyncio.StreamReader`'s main methods."""

    def __init__(self, stream: Stream):
        self._stream = stream
        self._eof = False

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (``-1``: everything until the end of the stream); ``b""`` at
        the end."""
        if n == 0:
            return b""
        if n > 0:
            data = await self._stream.read(n)
            self._eof = not data
            return data
        chunks = []
        while chunk := await self._stream.read():
            chunks.append(chunk)
        self._eof = True
        return b"".join(chunks)

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes; :class:`asyncio.IncompleteReadError` if the stream ends first.

        Memory grows with what arrives, not with ``n``: a length announced by the far end
        (``P2P.receive_raw_data``'s header) costs nothing until the bytes come."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValidationError(f"readexactly needs a byte count >= 0, got {n!r}")
        chunks: list[bytes] = []
        filled = 0
        while filled < n:
            chunk = await self._stream.read(n - filled)
            if not chunk:
                self._eof = True
                raise asyncio.IncompleteReadError(b"".join(chunks), n)
            chunks.append(chunk)
            filled += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def at_eof(self) -> bool:
        return self._eof


class StreamWriter:
    """The writing half with :class:`asyncio.StreamWriter`'s main methods: ``write``
    buffers, ``drain`` sends (with the stream's flow control), ``close`` ends our side."""

    def __init__(self, stream: Stream):
        self._stream = stream
        self._pending: list[bytes] = []
        self._closing = False
        self._closed: asyncio.Task | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            raise ConnectionClosed("write to a stream writer that was closed")
        self._pending.append(bytes(data))

    def writelines(self, lines: list[bytes]) -> None:
        for line in lines:
            self.write(line)

    async def drain(self) -> None:
        while self._pending:
            data = self._pending.pop(0)
            await self._stream.write(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.close()

    def close(self) -> None:
        """End our writing side once what was written is sent (``wait_closed`` waits)."""
        if not self._closing:
            self._closing = True
            self._closed = asyncio.ensure_future(self._finish())

    async def _finish(self) -> None:
        await self.drain()
        await self._stream.close_write()

    def is_closing(self) -> bool:
        return self._closing

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await self._closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peer_id": self._stream.remote_peer_id}.get(name, default)
