"""One stream of a multiplexed :class:`~swarmgrad.net.mux.Connection`: its buffers, its
credit in both directions, and the reader/writer API that protocols use.

A stream's state is driven by its connection (``_on_data``, ``_on_credit``, ``_on_fin``,
``_on_error``: the "driver side") and read or written by the application (:meth:`read`,
:meth:`write`, ...). It lives apart from the connection because that is the line a reader
crosses: protocol code sees only streams; the frame parser, the handshake and the
connection's life cycle stay in :mod:`swarmgrad.net.mux`, which re-exports
:class:`Stream`.

Flow control: a receiver grants each stream ``initial_window`` bytes of credit and
returns credit only as the application *consumes* data, so a slow reader makes the sender
wait instead of buffering without bound, and only that stream waits.
"""

from __future__ import annotations

import asyncio
import collections
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmgrad.net import framing
from swarmgrad.net.framing import FrameType, ResetCode
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import (
    ConnectionClosed,
    ProtocolViolation,
    StreamReset,
    SwarmgradError,
)

if TYPE_CHECKING:
    from swarmgrad.net.mux import Connection


class Stream:
    """A bidirectional byte stream inside a :class:`Connection`.

    Reading: :meth:`read`, :meth:`readexactly`, :meth:`readexactly_into`; a clean end of the
    remote's data reads as ``b""`` / raises ConnectionClosed for exact reads. Writing:
    :meth:`write` (waits for credit), :meth:`close_write` (sends FIN). :meth:`reset` aborts
    both directions and tells the remote side.
    """

    def __init__(self, conn: Connection, stream_id: int, header: bytes, *, initial_credit: int):
        self.conn = conn
        self.stream_id = stream_id
        self.header = header  # the OPEN payload: what the opener asked for
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._buffered = 0
        self._recv_fin = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._target: memoryview | None = None  # readexactly_into destination
        self._target_filled = 0
        self._progress: Callable[[int], None] | None = None  # readexactly_into's callback
        self._target_hold: asyncio.Future | None = None  # a worker still writes into _target
        self._recv_credit = conn._local_window  # bytes the remote may still send
        self._consumed_since_grant = 0
        self._send_credit = initial_credit
        self._credit_waiter: asyncio.Future | None = None
        self._send_fin = False
        self._failure_callbacks: list[Callable[[], None]] = []

    @property
    def remote_peer_id(self) -> PeerID:
        return self.conn.remote_peer_id

    @property
    def closed(self) -> bool:
        return self._error is not None or (self._recv_fin and self._send_fin)

    def __repr__(self) -> str:
        return f"<Stream {self.stream_id} to {self.conn.remote_peer_id}>"

    # ---------------------------------------------------------------- receiving (driver side)

    def _direct_target(self) -> memoryview | None:
        if self._target is None:
            return None
        return self._target[self._target_filled :]

    def _on_direct_bytes(self, n: int) -> None:
        """n bytes were received straight into the waiting reader's buffer."""
        self._count_received(n)
        if self._target is None:  # the reader gave up while a worker filled its buffer
            self._consume(n)
            return
        self._on_direct_progress(n)

    def _hold_target(self, released: asyncio.Future) -> None:
        self._target_hold = released

    def _on_data(self, data: memoryview) -> None:
        """Payload bytes that arrived for this stream (already owned by us)."""
        self._count_received(len(data))
        if self._target is not None:
            n = min(len(data), len(self._target) - self._target_filled)
            self._target[self._target_filled : self._target_filled + n] = data[:n]
            self._on_direct_progress(n)
            data = data[n:]
        if len(data):
            self._chunks.append(data)
            self._buffered += len(data)
            self._wake()

    def _on_direct_progress(self, n: int) -> None:
        self._target_filled += n
        if self._progress is not None:
            self._progress(self._target_filled)
        self._consume(n)
        if self._target_filled == len(self._target):
            self._target = None
            self._wake()

    def _count_received(self, n: int) -> None:
        self._recv_credit -= n
        if self._recv_credit < 0:
            raise ProtocolViolation(
                f"peer {self.conn.remote_peer_id} sent {-self._recv_credit} bytes beyond the "
                f"credit of stream {self.stream_id}"
            )

    def _on_fin(self) -> None:
        self._recv_fin = True
        self._wake()

    def _on_error(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._wake()
        callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            self.conn._loop.call_soon(callback)
        if self._credit_waiter is not None and not self._credit_waiter.done():
            self._credit_waiter.set_result(None)

    def _on_credit(self, n: int) -> None:
        self._send_credit += n
        if self._credit_waiter is not None and not self._credit_waiter.done():
            self._credit_waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _consume(self, n: int) -> None:
        """The application took n bytes: return credit in batches of half a window."""
        self._consumed_since_grant += n
        if self._consumed_since_grant >= self.conn._local_window // 2 and not self._recv_fin:
            grant, self._consumed_since_grant = self._consumed_since_grant, 0
            self._recv_credit += grant
            self.conn._send_control(
                FrameType.WINDOW, self.stream_id, framing.WINDOW_PAYLOAD.pack(grant)
            )

    async def _wait(self) -> None:
        self._waiter = self.conn._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._failure()

    def _failure(self) -> BaseException:
        """The error this stream failed with, to raise: a copy of it each time.

        One error object is shared by every stream of a dead connection and kept by each
        (and by the connection's ``closed``). Raising that object itself gave it a
        traceback whose frames hold the stream (``self``), which holds the error: a
        reference cycle that kept the connection, its buffers (megabytes on a busy one)
        and whatever the callers' frames held (a state snapshot's chunks) alive until the
        cyclic collector's next full pass, which a process with torch's hundreds of
        thousands of long-lived objects runs only now and then (issue 32)."""
        error = self._error
        assert error is not None
        try:
            fresh = copy.copy(error)
        except Exception:  # an exception type that cannot be rebuilt from its args
            return error
        fresh.__traceback__ = None
        fresh.__cause__, fresh.__context__ = error.__cause__, error.__context__
        fresh.__suppress_context__ = error.__suppress_context__
        return fresh

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once if the stream is reset or its connection dies."""
        if self._error is not None:
            self.conn._loop.call_soon(callback)
        else:
            self._failure_callbacks.append(callback)

    # ---------------------------------------------------------------- reading (user side)

    async def read(self, max_bytes: int = -1) -> bytes:
        """Up to max_bytes (all buffered if -1) once any are available; b"" at end of stream."""
        while not self._chunks:
            self._raise_if_failed()
            if self._recv_fin:
                return b""
            await self._wait()
        out = []
        taken = 0
        while self._chunks and (max_bytes < 0 or taken < max_bytes):
            chunk = self._chunks[0]
            if max_bytes >= 0 and taken + len(chunk) > max_bytes:
                part = max_bytes - taken
                out.append(chunk[:part])
                self._chunks[0] = chunk[part:]
                taken += part
                break
            out.append(self._chunks.popleft())
            taken += len(chunk)
        self._buffered -= taken
        self._consume(taken)
        return b"".join(out)

    async def readexactly_into(
        self,
        buffer: memoryview | bytearray,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Fill buffer completely; bytes still in flight are received straight into it.

        ``progress(filled)``, if given, is called whenever more of the buffer is filled, so
        a reader can use the first bytes of a large buffer while the rest still arrive
        straight into it (the all-reduce does). It runs inside the receive path: it must
        be quick and must not raise."""
        view = memoryview(buffer).cast("B")
        filled = 0
        while self._chunks and filled < len(view):
            chunk = self._chunks[0]
            n = min(len(chunk), len(view) - filled)
            view[filled : filled + n] = chunk[:n]
            filled += n
            if n == len(chunk):
                self._chunks.popleft()
            else:
                self._chunks[0] = chunk[n:]
        self._buffered -= filled
        self._consume(filled)
        if progress is not None and filled:
            progress(filled)
        if filled == len(view):
            return
        self._raise_if_failed()
        if self._recv_fin:
            raise ConnectionClosed(
                f"stream {self.stream_id} from {self.conn.remote_peer_id} ended after "
                f"{filled} of {len(view)} expected bytes"
            )
        self._target, self._target_filled = view, filled
        self._progress = progress
        try:
            while self._target is not None:
                if self._error is not None:
                    raise self._failure()
                if self._recv_fin:
                    raise ConnectionClosed(
                        f"stream {self.stream_id} from {self.conn.remote_peer_id} ended after "
                        f"{self._target_filled} of {len(view)} expected bytes"
                    )
                await self._wait()
        finally:
            self._target = None
            self._progress = None
            hold, self._target_hold = self._target_hold, None
            if hold is not None and not hold.done():  # a worker still writes into buffer
                await _until_released([hold])

    async def readexactly(self, n: int) -> bytes | bytearray:
        if self._chunks and len(self._chunks[0]) >= n:  # fast path: already buffered
            chunk = self._chunks[0]
            if len(chunk) == n:
                self._chunks.popleft()
            else:
                self._chunks[0] = chunk[n:]
            self._buffered -= n
            self._consume(n)
            return bytes(chunk[:n])
        buffer = bytearray(n)
        await self.readexactly_into(buffer)
        return buffer

    # ---------------------------------------------------------------- writing

    async def write(self, data: bytes | bytearray | memoryview, *, fin: bool = False) -> None:
        """Send data, waiting for credit and for the transport; the buffer is not copied
        in Python and may be reused once this returns (or raises: a write cancelled
        while a worker thread still seals its bytes waits for that worker first).
        ``fin=True`` closes the writing direction with the last frame (one frame less
        than write + close_write)."""
        view = memoryview(data).cast("B")
        conn = self.conn
        if fin and not len(view):
            await self.close_write()
            return
        sealing: list[asyncio.Future] = []
        try:
            while len(view):
                if self._error is not None:
                    raise self._failure()
                if self._send_fin:
                    raise ConnectionClosed(f"stream {self.stream_id} was closed for writing")
                if self._send_credit <= 0:
                    self._credit_waiter = conn._loop.create_future()
                    try:
                        await self._credit_waiter
                    finally:
                        self._credit_waiter = None
                    continue
                if conn._write_paused or conn._dead:
                    await conn._wait_writable()
                    if self._error is not None:
                        raise self._failure()
                n = min(len(view), self._send_credit, conn._remote_max_frame)
                self._send_credit -= n
                last = fin and n == len(view)
                if last:
                    self._send_fin = True
                released = conn._send_data(self.stream_id, view[:n], fin=last)
                if released is not None:
                    sealing.append(released)
                view = view[n:]
        finally:
            if sealing:
                await _until_released(sealing)
        if fin:
            conn._end_of_message()
            conn._maybe_forget(self)

    async def write_eof(self, data: bytes | bytearray | memoryview = b"") -> None:
        """Write data (if any) and close the writing direction."""
        await self.write(data, fin=True)

    async def close_write(self) -> None:
        if self._send_fin or self._error is not None:
            return
        await self.conn._wait_writable()
        if self._error is None and not self._send_fin:
            self._send_fin = True
            self.conn._send_data(self.stream_id, b"", fin=True)
            self.conn._end_of_message()
            self.conn._maybe_forget(self)

    def reset(self, reason: str = "", code: ResetCode = ResetCode.CANCELLED) -> None:
        """Abort both directions now and tell the remote side (idempotent)."""
        if self._error is not None or (self._send_fin and self._recv_fin):
            self.conn._forget(self)
            return
        self._on_error(StreamReset(f"stream {self.stream_id} was reset locally: {reason}"))
        self.conn._send_control(
            FrameType.RESET, self.stream_id, framing.encode_reset_payload(code, reason)
        )
        self.conn._forget(self)

    async def aclose(self) -> None:
        """Close gracefully if possible, else reset."""
        try:
            await self.close_write()
        except SwarmgradError:
            pass
        if not self._recv_fin and self._error is None:
            self.reset("closed by the application before the remote finished")
        self.conn._maybe_forget(self)


async def _until_released(futures: list[asyncio.Future]) -> None:
    """Wait until worker threads let go of a write's buffers, even when cancelled (the
    caller may free or reuse them as soon as we return); a cancellation is raised after.
    Sealing a record takes about a millisecond, so the wait is short and bounded."""
    cancelled = False
    pending = [f for f in futures if not f.done()]
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [f for f in pending if not f.done()]
    if cancelled:
        raise asyncio.CancelledError


__all__ = ["Stream"]
