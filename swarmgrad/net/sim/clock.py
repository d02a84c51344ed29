"""An asyncio event loop on a virtual clock, for deterministic simulations.

:class:`VirtualClockEventLoop` is an ordinary selector event loop except for its clock:
``loop.time()`` returns a virtual time that only moves when the loop has nothing else to
do. Whenever no callback is ready and the loop would block until its next timer, it
jumps the clock straight to that timer instead of sleeping. ``asyncio.sleep(3600)``,
``asyncio.timeout``, ``wait_for`` and ``call_later`` therefore behave exactly as on a real
loop, fire at the exact virtual instant they were scheduled for, and cost no wall time.

Rules for code that runs on this loop:

* No real I/O and no blocking sleeps (``time.sleep``, real sockets, subprocesses): they
  take wall time the virtual clock does not see, and the clock may jump past a deadline
  while a real socket is still on its way. Use :class:`~swarmgrad.net.sim.SimNetwork`
  for networking and ``asyncio.sleep`` for waiting.
* Measure time with ``loop.time()`` (or ``loop.virtual_time``), never ``time.time()``
  or ``time.monotonic()``.
* Work handed to threads with ``loop.run_in_executor`` / ``asyncio.to_thread`` takes
  zero virtual time: while such a job runs, the clock is frozen and the loop waits for
  it for real. Other threads may still wake the loop with ``call_soon_threadsafe``; when
  no timer is pending and nothing is ready the loop blocks for real, like any loop.

Use :func:`run_simulation` to run a whole simulation, or :func:`virtual_loop` to get a
loop inside a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from swarmgrad.utils.errors import SwarmgradError

if TYPE_CHECKING:
    from swarmgrad.net.sim.network import SimNetwork

__all__ = ["SimulationStalled", "VirtualClockEventLoop", "run_simulation", "virtual_loop"]

T = TypeVar("T")


class SimulationStalled(SwarmgradError, RuntimeError):
    """The loop had nothing to do (no timer, nothing ready, no thread at work) and no
    other thread woke it within ``stall_timeout`` wall seconds: the simulation is
    deadlocked, e.g. awaiting a future nobody will ever complete."""


class _VirtualTimeSelector(selectors.DefaultSelector):
    """The loop's selector: where a real loop would sleep until its next timer, this one
    only polls for real events (thread-safe wakeups) and then moves the virtual clock."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockEventLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        if loop is None or loop._thread_jobs:
            # threads at work: keep the clock frozen and wait for real until they report
            # back (or, as on any loop, until the next timer is due in real time)
            return super().select(timeout)
        if timeout is None:  # no timer and nothing ready: only another thread can wake us
            stall_timeout = loop._stall_timeout
            events = super().select(stall_timeout)
            if not events and stall_timeout is not None:
                raise SimulationStalled(
                    f"the simulation stalled at virtual time {loop.time()}: no timer is "
                    f"pending, nothing is ready and no thread woke the loop for "
                    f"{stall_timeout} s of wall time (a deadlock?)"
                )
            return events
        if timeout <= 0:
            return super().select(timeout)
        events = super().select(0)
        if not events:
            loop._jump_to_next_timer()
        return events


class VirtualClockEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual and jumps over idle waits.

    ``start_time`` is the virtual time when the loop is created (seconds). With
    ``stall_timeout`` (wall seconds), a loop left with nothing to do and not woken by any
    thread for that long raises :class:`SimulationStalled` instead of blocking forever;
    the default ``None`` blocks, like any loop. Everything else is the standard asyncio
    loop: tasks, futures, timers, ``call_soon_threadsafe`` and executors work unchanged.
    See the module documentation for what simulated code must not do.
    """

    def __init__(self, *, start_time: float = 0.0, stall_timeout: float | None = None) -> None:
        self._virtual_now = float(start_time)
        self._stall_timeout = stall_timeout
        self._thread_jobs = 0
        selector = _VirtualTimeSelector()
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        """The current virtual time in seconds."""
        return self._virtual_now

    @property
    def virtual_time(self) -> float:
        """The current virtual time in seconds (same as ``time()``)."""
        return self._virtual_now

    def _jump_to_next_timer(self) -> None:
        # BaseEventLoop._run_once has just dropped cancelled timers from the head of its
        # heap and asked the selector to wait until the head is due: move the clock to
        # exactly that instant, so the timer fires at the time it was scheduled for.
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            self._virtual_now = max(self._virtual_now, scheduled[0].when())

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> Any:
        future = super().run_in_executor(executor, func, *args)
        self._thread_jobs += 1
        future.add_done_callback(self._thread_job_done)
        return future

    def _thread_job_done(self, _future: object) -> None:
        self._thread_jobs -= 1

    async def shutdown_default_executor(self, *args: Any, **kwargs: Any) -> None:
        # The executor is joined by a helper thread: hold the clock while it runs, or a
        # shutdown timeout (Python >= 3.12) would expire in zero wall time.
        self._thread_jobs += 1
        try:
            await super().shutdown_default_executor(*args, **kwargs)
        finally:
            self._thread_jobs -= 1


#: Allocations between two young-generation collections while a simulation runs
#: (CPython's default is 700). See :func:`_fewer_collections`.
SIMULATION_GC_THRESHOLD = 200_000


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run the young-generation collector every ``SIMULATION_GC_THRESHOLD`` allocations
    instead of every 700, for the duration of the block; the previous thresholds come
    back on exit. Nothing else about collection changes: cycles are still collected.

    Why: a simulated swarm keeps hundreds of thousands of live objects (every peer's
    connections, routing tables, pending timers), and messages in flight live for many
    loop iterations. With the default threshold, young collections run every few
    hundred allocations, promote in-flight messages to the old generation, and the old
    generation's growth triggers full collections that walk the whole heap again and
    again: in the 1000-peer DHT test they took about half of the CPU time (measured with
    ``gc.callbacks``; 4772 collections, 30 of them full, for 300 peers; 28 in all with
    a threshold of 50 000). From 50 000 to 200 000, more messages die before a young
    collection sees them: the collector's CPU time while building a 300-peer swarm fell
    from 1.7 s to 0.73 s (of about 16 s); beyond 200 000 it stays at 0.7 s (the middle
    and old generations' share).
    """
    previous = gc.get_threshold()
    if previous[0] != 0:  # 0: automatic collection is off; leave it so
        gc.set_threshold(max(previous[0], SIMULATION_GC_THRESHOLD), *previous[1:])
    try:
        yield
    finally:
        gc.set_threshold(*previous)


@contextlib.contextmanager
def _virtual_runner(
    *, start_time: float, stall_timeout: float | None, debug: bool | None
) -> Iterator[asyncio.Runner]:
    def make_loop() -> VirtualClockEventLoop:
        return VirtualClockEventLoop(start_time=start_time, stall_timeout=stall_timeout)

    with _fewer_collections(), asyncio.Runner(debug=debug, loop_factory=make_loop) as runner:
        yield runner


@contextlib.contextmanager
def virtual_loop(
    *, start_time: float = 0.0, stall_timeout: float | None = None, debug: bool | None = None
) -> Iterator[VirtualClockEventLoop]:
    """A fresh :class:`VirtualClockEventLoop` for the duration of a ``with`` block.

    On exit, tasks still pending are cancelled, async generators and the default
    executor are shut down and the loop is closed (the same cleanup as ``asyncio.run``)::

        def test_something():
            with virtual_loop() as loop:
                loop.run_until_complete(scenario())
    """
    with _virtual_runner(start_time=start_time, stall_timeout=stall_timeout, debug=debug) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, VirtualClockEventLoop)
        yield loop


def _pending_tasks() -> list[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return [task for task in asyncio.all_tasks() if task is not current and not task.done()]


def run_simulation(
    main: Callable[[SimNetwork], Awaitable[T]],
    *,
    seed: int = 0,
    start_time: float = 0.0,
    check_leftover_tasks: bool = False,
    stall_timeout: float | None = None,
    debug: bool | None = None,
    **network_options: Any,
) -> T:
    """Run ``main(network)`` on a new virtual-clock loop and return its result.

    ``network`` is a fresh :class:`~swarmgrad.net.sim.SimNetwork` built from ``seed`` and
    ``network_options`` (``latency``, ``bandwidth``, ``trace``, ...). When ``main``
    returns or raises, the network is closed (connections still open get
    ``connection_lost``), then tasks still pending are cancelled and the loop is closed.

    With ``check_leftover_tasks=True``, tasks that ``main`` left running when it returned
    are an error: they are cancelled and a ``RuntimeError`` naming them is raised. Tests
    use it to check that a scenario cleans up after itself. ``stall_timeout`` is passed
    to :class:`VirtualClockEventLoop` (turns a deadlock into :class:`SimulationStalled`).
    """
    from swarmgrad.net.sim.network import SimNetwork

    network = SimNetwork(seed, **network_options)

    async def scenario() -> T:
        try:
            result = await main(network)
            if check_leftover_tasks:
                leftover = _pending_tasks()
                if leftover:
                    for task in leftover:
                        task.cancel()
                    await asyncio.gather(*leftover, return_exceptions=True)
                    names = ", ".join(sorted(repr(task.get_coro()) for task in leftover))
                    raise RuntimeError(f"the simulation left {len(leftover)} task(s): {names}")
            return result
        finally:
            network.close()
            await asyncio.sleep(0)  # let protocols see connection_lost before cleanup

    with _virtual_runner(start_time=start_time, stall_timeout=stall_timeout, debug=debug) as runner:
        return runner.run(scenario())
