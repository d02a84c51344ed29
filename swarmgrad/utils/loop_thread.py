"""The process's one event loop, running in a background daemon thread.

Everything networked in a swarmgrad process (the DHT, expert servers, averagers, the
optimizer) shares this loop. Synchronous code hands it coroutines::

    result = run_coroutine(dht_node.get(key), timeout=10)      # waits
    future = run_coroutine_future(averager.step())           # concurrent.futures.Future

The loop starts on first use (:func:`get_loop`) in a thread named ``swarmgrad-loop``. It
is uvloop's when uvloop is installed, unless the environment sets
``SWARMGRAD_NO_UVLOOP=1``. :func:`shutdown_loop` cancels and awaits everything still
running on it, then stops the thread; it runs at interpreter exit and may be called
earlier. After it, or in a child process after ``fork``, the next use starts a fresh loop.

Rule for cancellation: a caller that stops waiting (timeout, ``future.cancel()``,
KeyboardInterrupt) cancels the coroutine on the loop; nothing keeps running unowned.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from swarmgrad.utils.errors import DeadlineExceeded
from swarmgrad.utils.torch_threads import follow_torch_threads

__all__ = [
    "get_loop",
    "is_loop_thread",
    "run_coroutine",
    "run_coroutine_future",
    "shutdown_loop",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
CoroutineOrFunction = Awaitable[T] | Callable[[], Awaitable[T]]

THREAD_NAME = "swarmgrad-loop"
NO_UVLOOP_ENV = "SWARMGRAD_NO_UVLOOP"
# how long run_coroutine waits for a timed-out coroutine to finish cancelling before it
# gives up waiting (the coroutine is then still cancelled, just not awaited by the caller)
_CANCEL_GRACE = 10.0
_START_TIMEOUT = 30.0


class _Call:
    """One coroutine handed to the loop from another thread, and its thread-safe future.

    The future stays PENDING until the coroutine finishes, so ``future.cancel()`` always
    works while the coroutine runs, and then cancels it on the loop.

    The future's done callback holds the call weakly: a ``concurrent.futures.Future``
    keeps its callbacks after running them, so a bound method there made a reference
    cycle (call -> future -> callback -> call) that kept the task and the result (a
    downloaded state, an averaging round's tensors) alive until the cyclic collector's
    next full pass, which a process with torch's hundreds of thousands of long-lived
    objects runs only now and then (issue 32: a keeper's memory grew with every round).
    """

    def __init__(self, runtime: _Runtime, coro_or_fn: CoroutineOrFunction):
        self.runtime = runtime
        self.coro_or_fn: CoroutineOrFunction | None = coro_or_fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.finished = threading.Event()
        self.task: asyncio.Task | None = None
        self.future.add_done_callback(_FutureDone(self))

    @property
    def name(self) -> str:
        target = self.coro_or_fn if self.coro_or_fn is not None else self.task
        return getattr(target, "__qualname__", None) or repr(target)

    def start(self) -> None:
        """Runs on the loop thread."""
        coro_or_fn, self.coro_or_fn = self.coro_or_fn, None
        if self.future.cancelled():
            _discard(coro_or_fn)
            self._finish()
            return
        try:
            awaitable = coro_or_fn() if callable(coro_or_fn) else coro_or_fn
            self.task = asyncio.ensure_future(awaitable)
        except BaseException as e:
            _discard(coro_or_fn)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self.future.set_exception(e)
            self._finish()
            if not isinstance(e, Exception):
                raise
            return
        self.task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Future) -> None:
        try:
            if task.cancelled():
                self.future.cancel()
            elif task.exception() is not None:
                self.future.set_exception(task.exception())
            else:
                self.future.set_result(task.result())
        except concurrent.futures.InvalidStateError:
            pass  # the caller cancelled the future meanwhile
        finally:
            self._finish()

    def _on_future_done(self, future: concurrent.futures.Future) -> None:
        """Runs in whichever thread completed or cancelled the future."""
        if future.cancelled() and not self.finished.is_set():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self.runtime.loop.call_soon_threadsafe(self._cancel_task)

    def _cancel_task(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def _finish(self) -> None:
        with self.runtime.calls_lock:
            self.runtime.calls.discard(self)
        self.finished.set()

    def abandon(self) -> None:
        """The loop is gone: make sure nobody waits on this call forever."""
        self.future.cancel()
        _discard(self.coro_or_fn)
        self.coro_or_fn = None
        self._finish()


class _FutureDone:
    """A :class:`_Call`'s future's done callback, holding the call weakly (see there)."""

    __slots__ = ("call",)

    def __init__(self, call: _Call):
        self.call = weakref.ref(call)

    def __call__(self, future: concurrent.futures.Future) -> None:
        call = self.call()
        if call is not None:  # (gone: it had finished, nothing left to cancel)
            call._on_future_done(future)


class _Runtime:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = _new_event_loop()
        self.calls: set[_Call] = set()  # submitted and not finished yet
        self.calls_lock = threading.Lock()
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._serve, args=(ready,), name=THREAD_NAME, daemon=True
        )
        self.thread.start()
        if not ready.wait(_START_TIMEOUT):
            raise RuntimeError("the swarmgrad event loop thread did not start")

    def _serve(self, ready: threading.Event) -> None:
        follow_torch_threads()  # the robust rule's and codecs' matrix products run here
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        try:
            self.loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    def usable(self) -> bool:
        return self.pid == os.getpid() and self.thread.is_alive() and not self.loop.is_closed()


def _new_event_loop() -> asyncio.AbstractEventLoop:
    if os.environ.get(NO_UVLOOP_ENV, "").strip() not in ("", "0"):
        return asyncio.new_event_loop()
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _discard(coro_or_fn: object) -> None:
    """Close a coroutine that will never run, so Python does not warn it was never
    awaited."""
    if inspect.iscoroutine(coro_or_fn):
        coro_or_fn.close()


_lock = threading.Lock()
_runtime: _Runtime | None = None


def _reset_after_fork() -> None:
    # The child has no loop thread: forget the parent's (its lock may even be held).
    global _lock, _runtime
    _lock = threading.Lock()
    _runtime = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _get_runtime() -> _Runtime:
    global _runtime
    runtime = _runtime
    if runtime is not None and runtime.usable():
        return runtime
    with _lock:
        runtime = _runtime
        if runtime is not None and runtime.usable():
            return runtime
        if runtime is not None and runtime.pid == os.getpid():
            logger.warning("The swarmgrad event loop stopped unexpectedly; starting a new one")
        _runtime = _Runtime()
        logger.debug(f"Started the swarmgrad event loop ({type(_runtime.loop).__module__})")
        return _runtime


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's swarmgrad event loop; starts its thread on first use."""
    return _get_runtime().loop


def is_loop_thread() -> bool:
    """True when called from the swarmgrad loop thread (where blocking is forbidden)."""
    runtime = _runtime
    return (
        runtime is not None
        and runtime.pid == os.getpid()
        and threading.get_ident() == runtime.thread.ident
    )


def _submit(coro_or_fn: CoroutineOrFunction) -> _Call:
    if not (inspect.isawaitable(coro_or_fn) or callable(coro_or_fn)):
        raise TypeError(
            f"expected a coroutine or a function returning one, got {type(coro_or_fn).__name__}"
        )
    runtime = _get_runtime()
    call = _Call(runtime, coro_or_fn)
    with runtime.calls_lock:
        runtime.calls.add(call)
    try:
        runtime.loop.call_soon_threadsafe(call.start)
    except RuntimeError:  # closed between _get_runtime() and here by shutdown_loop()
        call.abandon()
        raise RuntimeError("the swarmgrad event loop is shutting down") from None
    return call


def run_coroutine_future(coro_or_fn: CoroutineOrFunction[T]) -> concurrent.futures.Future:
    """Start a coroutine on the loop; return a thread-safe future of its result.

    ``coro_or_fn`` is a coroutine or a function returning one (called on the loop
    thread). Cancelling the future cancels the coroutine. Safe from any thread.
    """
    return _submit(coro_or_fn).future


def run_coroutine(coro_or_fn: CoroutineOrFunction[T], timeout: float | None = None) -> T:
    """Run a coroutine on the loop from synchronous code and return its result.

    On timeout the coroutine is cancelled and awaited (its cleanup has run when this
    returns), then DeadlineExceeded is raised. Exceptions of the coroutine propagate as
    they are. Calling this from the loop thread would deadlock, so it raises
    RuntimeError there: ``await`` the coroutine instead.
    """
    if is_loop_thread():
        _discard(coro_or_fn)
        raise RuntimeError(
            "run_coroutine() was called from the swarmgrad event loop thread, where it "
            "would deadlock; await the coroutine instead"
        )
    call = _submit(coro_or_fn)
    name = call.name
    try:
        return call.future.result(timeout)
    except concurrent.futures.TimeoutError:
        if call.future.done():
            raise  # the coroutine itself raised TimeoutError
        if not call.future.cancel():  # finished in the meantime after all
            return call.future.result()
        if not call.finished.wait(_CANCEL_GRACE):
            logger.warning(
                f"{name} is still running {_CANCEL_GRACE} s after it was cancelled "
                "(does it swallow CancelledError?)"
            )
        raise DeadlineExceeded(f"{name} did not finish within {timeout} s") from None
    except BaseException:
        call.future.cancel()  # e.g. KeyboardInterrupt while waiting: stop the coroutine
        raise


async def _drain(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    """Cancel and await every other task, then close async generators and the executor,
    giving up at ``deadline`` (a ``time.monotonic()`` value)."""
    current = asyncio.current_task()
    while True:
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        if not tasks:
            break
        for task in tasks:
            task.cancel()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(sorted(task.get_name() for task in tasks))
            logger.warning(
                f"{len(tasks)} tasks ignored cancellation at loop shutdown and are "
                f"abandoned: {names}"
            )
            for task in tasks:  # already reported: asyncio need not log them again
                with contextlib.suppress(AttributeError):
                    task._log_destroy_pending = False
            break
        done, _ = await asyncio.wait(tasks, timeout=remaining)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                logger.debug(f"{task.get_name()} failed while shutting down: {task.exception()!r}")
    try:
        await asyncio.wait_for(loop.shutdown_asyncgens(), max(deadline - time.monotonic(), 0.1))
        await asyncio.wait_for(
            loop.shutdown_default_executor(), max(deadline - time.monotonic(), 0.1)
        )
    except Exception as e:
        logger.warning(f"Could not shut down async generators or the executor: {e!r}")


def shutdown_loop(timeout: float = 10.0) -> None:
    """Stop the loop thread: cancel and await all remaining tasks (up to ``timeout``
    seconds), shut down async generators and the default executor, stop the loop, join
    the thread and close the loop.

    Idempotent; runs at interpreter exit. The next :func:`get_loop` starts a new loop.
    """
    global _runtime
    with _lock:
        runtime = _runtime
        if runtime is None or runtime.pid != os.getpid():
            _runtime = None
            return
        if threading.get_ident() == runtime.thread.ident:
            raise RuntimeError("shutdown_loop() cannot be called from the event loop thread")
        _runtime = None
    loop, thread = runtime.loop, runtime.thread
    if thread.is_alive():
        try:
            drained = asyncio.run_coroutine_threadsafe(
                _drain(loop, time.monotonic() + timeout), loop
            )
            drained.result(timeout + 5.0)
        except Exception as e:
            logger.warning(f"Could not drain the swarmgrad event loop: {e!r}")
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
    if thread.is_alive():
        logger.warning(f"The {THREAD_NAME} thread did not stop within {timeout} s")
    elif not loop.is_closed():
        loop.close()
    with runtime.calls_lock:
        leftover = list(runtime.calls)
    for call in leftover:
        call.abandon()


atexit.register(shutdown_loop)
