"""Shared fixtures: run a coroutine on a fresh loop and prove it left nothing behind."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import pytest

from swarmgrad.net.workers import THREAD_PREFIX as DATA_THREAD_PREFIX


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd")) if os.path.isdir("/proc/self/fd") else 0


def run_checked(main, *, timeout: float = 60.0):
    """Run ``main()`` on a new event loop; fail if tasks, threads or sockets leak."""
    threads_before = {t.ident for t in threading.enumerate()}
    fds_before = _open_fds()
    leftovers: list[asyncio.Task] = []

    async def wrapper():
        async with asyncio.timeout(timeout):
            result = await main()
        for _ in range(20):  # let closing transports finish their callbacks
            await asyncio.sleep(0)
        current = asyncio.current_task()
        leftovers.extend(t for t in asyncio.all_tasks() if t is not current and not t.done())
        for task in leftovers:
            task.cancel()
        return result

    result = asyncio.run(wrapper())
    assert not leftovers, f"tasks left running: {leftovers}"
    gc.collect()
    new_threads = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before
        and t.is_alive()
        # the data path's worker threads are one bounded pool per process, kept for
        # the process's life (swarmgrad.net.workers), not one per test
        and not t.name.startswith(DATA_THREAD_PREFIX)
    ]
    assert not new_threads, f"threads left running: {new_threads}"
    assert _open_fds() <= fds_before, f"file descriptors leaked: {fds_before} -> {_open_fds()}"
    return result


def pytest_collection_finish(session):
    """Move everything the collection created (imported modules: torch, hypothesis, the
    test modules) out of the garbage collector's sight: it lives for the whole session,
    and every full collection walked all of it again. ``run_checked`` collects after
    every run (once per hypothesis example), and that walk was most of a fuzz example's
    cost (0.1-0.2 s each). Objects created from here on are collected as before."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test (its fixtures finalized), collect its garbage and move what
    outlives it out of the collector's sight too, as ``pytest_collection_finish`` does
    for the collection. Otherwise whatever earlier tests leave alive for the session
    (tensors, peers of module fixtures, caches, hypothesis' data) is walked by every full
    collection of every later test: by ``run_checked`` after each run (0.05 s each after
    tests/averaging, against 0.002 s alone, which made the fuzz tests of
    tests/net/test_net_hostile.py 3 to 5 times slower in the full suite than alone) and
    by the automatic full collections of the simulated swarms. Only the test's garbage
    is walked here: a few milliseconds. A cycle among frozen objects that dies later is
    not collected (it stays in memory until the session ends); acyclic objects are freed
    as usual."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture
def arun():
    return run_checked


@pytest.fixture(autouse=True)
def restore_logging():
    """Put the ``swarmgrad`` and root loggers back as they were after each test: a test
    that runs a command in-process (``main([...])``) installs the CLI's log handler, which
    stops propagation and would hide later tests' records from ``caplog``."""
    import logging

    saved = [
        (logger, list(logger.handlers), logger.level, logger.propagate)
        for logger in (logging.getLogger("swarmgrad"), logging.getLogger())
    ]
    yield
    for logger, handlers, level, propagate in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
