"""Small asyncio helpers under hivemind's names (``hivemind.utils.asyncio``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

__all__ = ["amap_in_executor", "as_aiter", "enter_asynchronously", "switch_to_uvloop"]


async def as_aiter(*args: Any) -> AsyncIterator[Any]:
    """An async iterator over ``args``."""
    for arg in args:
        yield arg


async def _aiter_of(iterable: Any) -> AsyncIterator[Any]:
    if isinstance(iterable, AsyncIterable):
        async for item in iterable:
            yield item
    else:
        for item in iterable:
            yield item


async def amap_in_executor(
    func: Callable,
    *iterables: Any,
    max_prefetch: int = 1,
    executor: concurrent.futures.Executor | None = None,
) -> AsyncIterator[Any]:
    """``func`` over the (async or plain) iterables, run in ``executor`` (the loop's default
    when None), at most ``max_prefetch`` calls ahead of the consumer; stops with the
    shortest iterable. A failing call raises here, and pending calls are cancelled."""
    if not isinstance(max_prefetch, int) or max_prefetch < 1:
        raise ValueError(f"max_prefetch must be a positive int, got {max_prefetch!r}")
    loop = asyncio.get_running_loop()
    iterators = [_aiter_of(it) for it in iterables]
    pending: list[asyncio.Future] = []
    try:
        exhausted = False
        while True:
            while not exhausted and len(pending) < max_prefetch:
                try:
                    args = [await anext(it) for it in iterators]
                except StopAsyncIteration:
                    exhausted = True
                    break
                pending.append(loop.run_in_executor(executor, func, *args))
            if not pending:
                return
            yield await pending.pop(0)
    finally:
        for future in pending:
            future.cancel()


@contextlib.asynccontextmanager
async def enter_asynchronously(context: Any) -> AsyncIterator[Any]:
    """``async with enter_asynchronously(lock):`` enters a blocking context manager (a
    ``threading.Lock``, say) in a thread, so the event loop is not blocked meanwhile."""
    loop = asyncio.get_running_loop()
    value = await loop.run_in_executor(None, context.__enter__)
    try:
        yield value
    except BaseException as e:
        if not context.__exit__(type(e), e, e.__traceback__):
            raise
    else:
        context.__exit__(None, None, None)


def switch_to_uvloop() -> asyncio.AbstractEventLoop:
    """A new event loop, uvloop's when installed, set as this thread's loop."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop
