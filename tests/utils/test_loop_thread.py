import asyncio
import concurrent.futures
import gc
import io
import logging
import os
import signal
import threading
import time
import weakref

import pytest

from swarmgrad.utils import loop_thread
from swarmgrad.utils.errors import DeadlineExceeded
from swarmgrad.utils.logging import get_logger, use_swarmgrad_log_handler
from swarmgrad.utils.loop_thread import (
    get_loop,
    is_loop_thread,
    run_coroutine,
    run_coroutine_future,
    shutdown_loop,
)
from swarmgrad.utils.timeutils import Deadline, get_dht_time

WAIT = 10.0  # generous bound for things that should happen at once


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == loop_thread.THREAD_NAME]


@pytest.fixture(autouse=True)
def fresh_loop():
    shutdown_loop()
    yield
    shutdown_loop()
    assert _loop_threads() == []


def test_get_loop_starts_one_named_daemon_thread_and_reuses_it():
    loop = get_loop()
    assert get_loop() is loop
    threads = _loop_threads()
    assert len(threads) == 1 and threads[0].daemon
    assert loop.is_running()
    assert not is_loop_thread()
    assert run_coroutine(_is_loop_thread_async())


async def _is_loop_thread_async():
    return is_loop_thread() and threading.current_thread().name == loop_thread.THREAD_NAME


def test_uses_uvloop_unless_disabled_by_environment(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv(loop_thread.NO_UVLOOP_ENV, raising=False)
    assert isinstance(get_loop(), uvloop.Loop)
    shutdown_loop()
    monkeypatch.setenv(loop_thread.NO_UVLOOP_ENV, "1")
    loop = get_loop()
    assert not isinstance(loop, uvloop.Loop)
    assert isinstance(loop, asyncio.BaseEventLoop)


def test_run_coroutine_returns_results_and_accepts_functions():
    assert run_coroutine(asyncio.sleep(0, result=1)) == 1
    assert run_coroutine(lambda: asyncio.sleep(0, result=2)) == 2
    assert run_coroutine(asyncio.sleep(0, result=3), timeout=WAIT) == 3


def test_run_coroutine_propagates_exceptions_unchanged():
    async def fails():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        run_coroutine(fails())

    async def own_timeout():
        raise TimeoutError("inner")

    with pytest.raises(TimeoutError, match="inner") as info:
        run_coroutine(own_timeout(), timeout=WAIT)
    assert not isinstance(info.value, DeadlineExceeded)


def test_timeout_cancels_the_coroutine_and_waits_for_its_cleanup():
    events = []

    async def slow():
        try:
            await asyncio.sleep(WAIT * 10)
        except asyncio.CancelledError:
            events.append("cancelled")
            await asyncio.sleep(0.05)  # cleanup that takes a while
            events.append("cleaned up")
            raise

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="slow"):
        run_coroutine(slow(), timeout=0.05)
    assert events == ["cancelled", "cleaned up"]
    assert time.monotonic() - started < WAIT
    assert run_coroutine(_pending_tasks()) == 0


async def _pending_tasks():
    return len(asyncio.all_tasks()) - 1


def test_run_coroutine_from_the_loop_thread_raises_instead_of_deadlocking():
    async def nested():
        with pytest.raises(RuntimeError, match="loop thread"):
            run_coroutine(asyncio.sleep(0))
        return "ok"

    assert run_coroutine(nested(), timeout=WAIT) == "ok"


def test_future_result_and_cancellation_reaches_the_coroutine():
    assert run_coroutine_future(asyncio.sleep(0, result=7)).result(WAIT) == 7
    cancelled = threading.Event()
    started = threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.sleep(WAIT * 10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = run_coroutine_future(forever())
    assert started.wait(WAIT)
    assert future.cancel()
    assert cancelled.wait(WAIT)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(WAIT)


def test_cancelling_before_start_never_runs_the_coroutine():
    ran = []

    async def record():
        ran.append(True)

    blocker = threading.Event()
    get_loop().call_soon_threadsafe(blocker.wait, WAIT)  # keep the loop busy
    future = run_coroutine_future(record())
    future.cancel()
    blocker.set()
    assert run_coroutine(asyncio.sleep(0, result=True))
    assert ran == []


def test_many_threads_share_the_loop():
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_coroutine(asyncio.sleep(0.001, result=i)), range(64)))
    assert results == list(range(64))
    assert len(_loop_threads()) == 1


def test_shutdown_cancels_tasks_closes_generators_and_leaves_nothing_behind():
    finalized = []

    async def background():
        try:
            await asyncio.sleep(WAIT * 10)
        finally:
            finalized.append("task")

    async def agen():
        try:
            yield 1
            yield 2
        finally:
            finalized.append("agen")

    async def start_agen():
        generator = agen()
        await generator.__anext__()
        return generator

    async def use_executor():
        return await asyncio.get_running_loop().run_in_executor(None, lambda: 5)

    threads_before = set(threading.enumerate())
    loop = get_loop()
    future = run_coroutine_future(background())
    kept = run_coroutine(start_agen())
    assert run_coroutine(use_executor()) == 5
    shutdown_loop(timeout=WAIT)

    assert sorted(finalized) == ["agen", "task"]
    assert future.cancelled()
    assert loop.is_closed()
    assert _loop_threads() == []
    assert set(threading.enumerate()) <= threads_before  # loop and executor threads gone
    assert not asyncio.all_tasks(loop)
    del kept


def test_shutdown_is_idempotent_and_a_new_loop_starts_after_it():
    first = get_loop()
    shutdown_loop()
    shutdown_loop()
    second = get_loop()
    assert second is not first and first.is_closed()
    assert run_coroutine(asyncio.sleep(0, result="again")) == "again"


def test_shutdown_releases_a_thread_blocked_in_run_coroutine():
    outcome = []
    started = threading.Event()

    async def forever():
        started.set()
        await asyncio.sleep(WAIT * 10)

    def waiter():
        try:
            run_coroutine(forever())
        except BaseException as e:
            outcome.append(type(e))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert started.wait(WAIT)
    shutdown_loop(timeout=WAIT)
    thread.join(WAIT)
    assert outcome == [concurrent.futures.CancelledError]


def test_shutdown_gives_up_on_tasks_that_ignore_cancellation():
    async def stubborn():
        for _ in range(3):
            try:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                pass

    run_coroutine_future(stubborn())
    started = time.monotonic()
    shutdown_loop(timeout=0.2)
    assert time.monotonic() - started < WAIT


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_fresh_loop():
    parent_loop = get_loop()
    assert run_coroutine(asyncio.sleep(0, result=1)) == 1
    pid = os.fork()
    if pid == 0:  # child: report through the exit code only
        code = 1
        try:
            signal.alarm(int(WAIT))
            child_loop = get_loop()
            ok = child_loop is not parent_loop and run_coroutine(
                asyncio.sleep(0, result=42), timeout=WAIT
            )
            shutdown_loop(timeout=WAIT)
            code = 0 if ok == 42 and not _loop_threads() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT * 2
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child process hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
    assert get_loop() is parent_loop  # the parent's loop is untouched


def test_bad_argument_is_a_type_error():
    with pytest.raises(TypeError):
        run_coroutine(42)


# --- timeutils and logging (small helpers of the same layer) ---------------------------


def test_dht_time_is_wall_clock():
    assert abs(get_dht_time() - time.time()) < 1.0


def test_deadline_counts_down_and_expires():
    deadline = Deadline.after(WAIT)
    assert 0 < deadline.remaining() <= WAIT
    assert not deadline.expired
    deadline.check("test")
    past = Deadline.after(-1)
    assert past.expired and past.remaining() == 0.0
    with pytest.raises(DeadlineExceeded, match="lookup"):
        past.check("lookup")
    assert deadline.earliest(past) is past and deadline.earliest(None) is deadline


def test_get_logger_places_loggers_under_swarmgrad():
    assert get_logger("swarmgrad.dht.node").name == "swarmgrad.dht.node"
    assert get_logger("my_script").name == "swarmgrad.my_script"
    assert get_logger().name == "swarmgrad"


def test_log_handler_is_installed_once_and_prints_readable_lines():
    root = logging.getLogger("swarmgrad")
    saved = (list(root.handlers), root.level, root.propagate)
    try:
        use_swarmgrad_log_handler("INFO", stream=io.StringIO())
        stream = io.StringIO()
        use_swarmgrad_log_handler(logging.INFO, stream=stream)
        get_logger("swarmgrad.test").info("hello %s", "world")
        get_logger("swarmgrad.test").debug("hidden")
        assert len(root.handlers) == len(saved[0]) + 1
        line = stream.getvalue()
        assert "[INFO] [swarmgrad.test] hello world" in line and "hidden" not in line
        with pytest.raises(ValueError):
            use_swarmgrad_log_handler("LOUD")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]


class _Result:
    """A coroutine's result that can be watched with a weak reference."""


def test_a_finished_calls_result_is_freed_without_the_cyclic_collector():
    """(issue 32) Once the caller drops the future, nothing of the call keeps its result:
    a reference cycle through the future's done callback kept it (a downloaded state, a
    round's tensors) until the collector's next full pass, rare in a process with torch's
    many long-lived objects."""

    async def make() -> _Result:
        return _Result()

    gc.disable()
    try:
        for submit in (run_coroutine_future, lambda coro: run_coroutine_future(lambda: coro)):
            future = submit(make())
            result = weakref.ref(future.result(timeout=10))
            del future
            deadline = time.monotonic() + 10
            while result() is not None and time.monotonic() < deadline:
                time.sleep(0.01)  # the call leaves the runtime's set just after resolving
            assert result() is None, "the result outlived its future: a reference cycle"
    finally:
        gc.enable()
