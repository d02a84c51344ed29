"""Stream helpers of the all-reduce: bounded waits that count any byte on a connection as
a sign of life, receive progress by part, and the order and windows in which parts go."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from swarmgrad.utils.errors import (
    ConnectionClosed,
    DeadlineExceeded,
    HandshakeError,
    PeerUnreachable,
    ProtocolViolation,
    RemoteError,
    StreamReset,
)


async def within(awaitable: Any, seconds: float, what: str) -> Any:
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        raise DeadlineExceeded(f"{what} within {seconds:.3g} s") from None


def describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


class Progress:
    """Tracks how much of a receive buffer is filled; wakes the reader at part ends.

    ``callback`` goes to :meth:`Stream.readexactly_into`; it runs inside the receive
    path, so it only compares numbers and sets an event."""

    def __init__(self, part_ends: Sequence[int]):
        self.part_ends = part_ends  # byte offset where each part of the window ends
        self.filled = 0
        self.next_part = 0  # first part not yet handed to the reader
        self.event = asyncio.Event()

    def callback(self, filled: int) -> None:
        self.filled = filled
        if self.next_part < len(self.part_ends) and filled >= self.part_ends[self.next_part]:
            self.event.set()

    async def wait_parts(
        self,
        reader: asyncio.Task,
        wait: Callable[[], float],
        what: str,
        activity: Callable[[], int] = lambda: 0,
    ) -> list[int]:
        """Wait until at least one more part is complete; returns their indices (within
        the window). Raises DeadlineExceeded if for ``wait()`` seconds no byte arrives
        and ``activity()`` (other signs of life, e.g. bytes we sent) does not change;
        raises the reader's error if it fails."""
        while True:
            complete = []
            while self.next_part < len(self.part_ends) and (
                self.filled >= self.part_ends[self.next_part]
            ):
                complete.append(self.next_part)
                self.next_part += 1
            if complete:
                return complete
            if reader.done():
                reader.result()  # its error, if any
                raise ProtocolViolation(f"{what}: stream ended early")
            self.event.clear()
            seen = (self.filled, activity())
            waiter = asyncio.ensure_future(self.event.wait())
            try:
                done, _ = await asyncio.wait(
                    (waiter, reader), timeout=wait(), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                waiter.cancel()
            if not done and (self.filled, activity()) == seen:
                raise DeadlineExceeded(f"{what}: no progress for {wait():.3g} s")


def connection_bytes(stream: Any) -> int:
    """Bytes the stream's connection has received so far, on any stream (0 where the
    transport does not count them). On a slow link one stream's bytes may wait a while
    behind the frames of the others; the remote is alive as long as these grow."""
    return getattr(getattr(stream, "conn", None), "bytes_received", 0)


def peer_is_gone(error: BaseException) -> bool:
    """The connection itself failed or could not be made (not a refusal, not the reset
    of one stream)."""
    if isinstance(error, StreamReset | RemoteError | DeadlineExceeded):
        return False
    return isinstance(error, PeerUnreachable | HandshakeError | ConnectionClosed | OSError)


async def settle(task: asyncio.Future) -> None:
    """Cancel a helper task if it still runs and wait for it, consuming its outcome."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task


def reset_on_failure(stream: Any, task: asyncio.Task) -> None:
    """A writer that failed resets its stream, so both sides stop waiting at once."""
    if not task.cancelled() and task.exception() is not None:
        stream.reset(f"sender failed: {describe(task.exception())}"[:500])


async def while_active(
    awaitable: Any, wait: Callable[[], float], what: str, activity: Callable[[], int]
) -> Any:
    """Await; DeadlineExceeded once ``wait()`` seconds pass with ``activity()`` unchanged."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            seen = activity()
            done, _ = await asyncio.wait((task,), timeout=wait())
            if done:
                return task.result()
            if activity() == seen:
                raise DeadlineExceeded(f"{what}: no progress for {wait():.3g} s")
    finally:
        await settle(task)


def owners_after(me: int, span_sizes: Sequence[int]) -> list[int]:
    """The other owners of a group in the order member ``me`` sends to them: from the
    next member on, wrapping around. Each member starts on a different owner, so at the
    start of a round every owner's link takes one sender's data first; in member order,
    everyone would start on owner 0, whose flows would fill the links' queues before
    anyone sent to the last owner (measured: 8 peers, 100 Mbit/s, the last owner's link
    idle for the first 0.4 s of a 2.9-s round)."""
    n = len(span_sizes)
    return [j for j in ((me + k) % n for k in range(1, n)) if span_sizes[j] > 0]


def part_windows(offsets: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive runs of parts ``[start, end)`` of at most ``limit`` bytes each (a part
    larger than the limit gets a window of its own)."""
    windows, start = [], 0
    num_parts = len(offsets) - 1
    while start < num_parts:
        end = start + 1
        while end < num_parts and offsets[end + 1] - offsets[start] <= limit:
            end += 1
        windows.append((start, end))
        start = end
    return windows or [(0, 0)]
