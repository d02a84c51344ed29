"""The device thread: one thread runs every expert's batches, oldest request first.

A single thread owns the device, so experts never compete for it and an expert's weights
are only touched by one thread (checkpoints take the expert's own lock). The event loop
only appends tasks to pools; this thread picks, among the pools that are ready, the one
whose oldest task is oldest, runs the batch in torch (which releases the GIL for the
heavy work), splits the outputs back per request and resolves the requests' futures on
their loop with one ``call_soon_threadsafe`` per batch.

**A lone cheap batch runs on the event loop.** Handing a batch of one to the device
thread and back costs two thread wake-ups (about half of a batch-1 round trip through a
trivial expert on a small VM), while the batch itself may take tens of microseconds. So
:meth:`Runtime.enqueue` lets the loop run a batch itself when all of these hold:

- the pool allows it (``may_run_inline``: the expert lives on the CPU; a GPU expert's
  batch would wait for its kernels on the loop);
- the pool's recent batches were cheap: the median wall time of its last five batches
  (measured on either path, so a first batch always goes to the device thread) is at
  most ``inline_max_seconds`` and the last one took at most four times that (a batch
  that suddenly turns slow stops the fast path at once, while a batch that was only
  descheduled on a crowded machine does not keep it off for long), and the batch holds
  at most ``INLINE_MAX_SAMPLES`` samples;
- the device thread is idle and nothing was queued for this pool before the request.

The run is not immediate: it is scheduled with ``call_soon``, so requests that reached the
loop in the same iteration join the same batch, as they would on the device thread (too
many samples by then, or the device thread started a batch meanwhile: the device thread
takes it after all). The loop never waits on the expert's lock (a checkpoint holds it):
it try-acquires it and falls back to the device thread. Errors, statistics and delivery
are the device thread's own (:meth:`Runtime._run_batch`), for forward and backward alike:
a backward batch is an optimizer step, and the rule only admits it when its measured
cost (step included) is within the same budget.

An exception inside a batch goes to every request of that batch as an
:class:`~swarmgrad.moe.server.task_pool.ExpertFailure`; the thread keeps serving.
On shutdown the requests still queued receive an ExpertFailure saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence

from swarmgrad.moe.server.task_pool import (
    ExpertFailure,
    Task,
    TaskPool,
    concat_args,
    split_outputs,
)
from swarmgrad.utils.errors import ValidationError

__all__ = ["INLINE_MAX_SAMPLES", "INLINE_MAX_SECONDS", "Runtime"]

logger = logging.getLogger(__name__)

#: default budget for running a batch on the event loop: the median time of the pool's
#: recent batches must be at most this (a nop expert's batch of one takes 50-70 us here)
INLINE_MAX_SECONDS = 250e-6
#: larger batches never run on the loop (the budget was measured on the pool's recent,
#: usually small, batches)
INLINE_MAX_SAMPLES = 64


class Runtime:
    """Runs the batches of ``pools`` on one background thread.

    ``stats_report_interval`` (seconds) logs, per pool that did work, how many batches and
    samples it processed and its mean batch size since the previous report.
    ``inline_max_seconds`` is the budget of a batch run on the event loop (see the module's
    docstring); 0 sends every batch to the device thread.
    """

    def __init__(
        self,
        pools: Iterable[TaskPool],
        *,
        stats_report_interval: float | None = None,
        name: str = "swarmgrad-runtime",
        inline_max_seconds: float = INLINE_MAX_SECONDS,
    ):
        if not isinstance(inline_max_seconds, (int, float)) or not inline_max_seconds >= 0:
            raise ValidationError(
                f"inline_max_seconds must be a number >= 0, got {inline_max_seconds!r}"
            )
        self.pools: list[TaskPool] = list(pools)
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValidationError(f"task pool names must be unique, got {names}")
        self.stats_report_interval = stats_report_interval
        self.name = name
        self.inline_max_seconds = float(inline_max_seconds)
        self._device_batches = 0
        self._inline_batches = 0
        self._busy = False  # the device thread runs a batch (guarded by _cond)
        self._reported: dict[str, tuple[int, int, float]] = {}  # pool stats at the last report
        self._cond = threading.Condition(threading.Lock())
        self._nonempty: dict[TaskPool, None] = {}  # pools with queued tasks, insertion order
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start the device thread and attach the pools to it."""
        if self._thread is not None:
            raise ValidationError("this runtime was already started")
        for pool in self.pools:
            if pool.runtime is not None:
                raise ValidationError(f"pool {pool.name} already belongs to a runtime")
            pool.runtime = self
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()
        self.ready.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the batch in progress; queued requests get an ExpertFailure."""
        for pool in self.pools:
            if pool.runtime is self:
                pool.runtime = None  # new submissions are refused from now on
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("runtime thread %s did not stop within %s s", self.name, timeout)
        self.ready.clear()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def batches_processed(self) -> int:
        """Batches run so far, on the device thread or on the event loop."""
        return self._device_batches + self._inline_batches

    # ------------------------------------------------------------------ event loop side

    def enqueue(self, pool: TaskPool, task: Task) -> None:
        with self._cond:
            if self._stopping:
                raise ExpertFailure(f"{pool.name}: the server is shutting down")
            pool.tasks.append(task)
            pool.queued_samples += task.size
            if pool not in self._nonempty:
                self._nonempty[pool] = None
            if pool.inline_pending:
                return  # joins the batch the loop is about to run (or hand over)
            if self._may_run_inline(pool):
                pool.inline_pending = True
                task.future.get_loop().call_soon(self._run_inline, pool)
                return
            self._cond.notify()

    def _may_run_inline(self, pool: TaskPool) -> bool:
        """Whether the loop may run this pool's only request itself (under ``_cond``)."""
        if pool.may_run_inline is None or self._busy or len(pool.tasks) != 1:
            return False
        return (
            pool.queued_samples <= INLINE_MAX_SAMPLES
            and _cheap(pool.stats.recent_batch_seconds, self.inline_max_seconds)
            and pool.ready_at() <= time.monotonic()
            and pool.may_run_inline()
        )

    def _run_inline(self, pool: TaskPool) -> None:
        """The loop's side of the fast path: run the pool's batch here, or hand it to the
        device thread when things changed since it was scheduled."""
        lock = pool.lock
        locked = lock is None or lock.acquire(blocking=False)  # a checkpoint may hold it
        try:
            with self._cond:
                pool.inline_pending = False
                if not pool.tasks:
                    return  # the device thread took them meanwhile
                if (
                    not locked
                    or self._busy
                    or self._stopping
                    or pool.queued_samples > INLINE_MAX_SAMPLES
                ):
                    self._cond.notify()
                    return
                tasks = pool.take_batch()
                if not pool.tasks:
                    self._nonempty.pop(pool, None)
            if tasks:
                self._run_batch(pool, tasks, inline=True)
        finally:
            if locked and lock is not None:
                lock.release()

    # ------------------------------------------------------------------ device thread

    def _serve(self) -> None:
        next_report = self._next_report(time.monotonic())
        try:
            while True:
                picked = self._wait_for_batch(next_report)
                if picked is None:
                    return
                pool, tasks = picked
                if pool is not None and tasks:
                    self._run_batch(pool, tasks)
                now = time.monotonic()
                if next_report is not None and now >= next_report:
                    self._report_stats()
                    next_report = self._next_report(now)
        except BaseException:
            logger.exception("the runtime thread %s crashed", self.name)
            raise
        finally:
            self._fail_queued()

    def _wait_for_batch(
        self, next_report: float | None
    ) -> tuple[TaskPool | None, list[Task]] | None:
        """Block until some pool is ready, then take its batch. Returns None when stopping
        and ``(None, [])`` when a stats report is due first."""
        with self._cond:
            self._busy = False
            while not self._stopping:
                now = time.monotonic()
                best: TaskPool | None = None
                wake_at = next_report
                for pool in list(self._nonempty):
                    if not pool.tasks:
                        del self._nonempty[pool]
                        continue
                    ready_at = pool.ready_at()
                    if ready_at <= now:
                        if best is None or pool.tasks[0].created < best.tasks[0].created:
                            best = pool
                    elif wake_at is None or ready_at < wake_at:
                        wake_at = ready_at
                if best is not None:
                    tasks = best.take_batch()
                    if not best.tasks:
                        self._nonempty.pop(best, None)
                    self._busy = bool(tasks)
                    return best, tasks
                if next_report is not None and now >= next_report:
                    return None, []
                self._cond.wait(None if wake_at is None else max(wake_at - now, 0.0))
            return None

    def _run_batch(self, pool: TaskPool, tasks: Sequence[Task], inline: bool = False) -> None:
        """Run one batch and answer its requests (on the device thread, or on the loop
        when ``inline``: then this loop's futures are resolved at once)."""
        started = time.perf_counter()
        batch_size = sum(t.size for t in tasks)
        try:
            outputs = tuple(pool.process_func(*concat_args(tasks)))
            results = split_outputs(outputs, tasks)
            error = None
        except Exception as e:
            logger.warning(
                "%s failed on a batch of %d requests (%d samples): %r",
                pool.name, len(tasks), batch_size, e,
            )  # fmt: skip
            results = None
            error = (
                f"{pool.name} failed on a batch of {len(tasks)} requests ({batch_size} samples): "
                f"{type(e).__name__}: {e}"
            )
        seconds = time.perf_counter() - started
        pool.record(batch_size, len(tasks), seconds, error is not None, inline)
        if inline:
            self._inline_batches += 1
            _deliver_threadsafe(tasks, results, error, asyncio.get_running_loop())
        else:
            self._device_batches += 1
            # idle before the callers hear back: a caller's next request may run on the loop
            self._busy = False
            _deliver_threadsafe(tasks, results, error)

    def _fail_queued(self) -> None:
        with self._cond:
            self._stopping = True
            leftovers = [(pool, pool.drain()) for pool in self.pools]
            self._nonempty.clear()
        for pool, tasks in leftovers:
            if tasks:
                _deliver_threadsafe(tasks, None, f"{pool.name}: the server is shutting down")

    def _next_report(self, now: float) -> float | None:
        interval = self.stats_report_interval
        return None if not interval else now + interval

    def _report_stats(self) -> None:
        previous, current = self._reported, {}
        for pool in self.pools:
            stats = pool.stats
            current[pool.name] = (stats.batches, stats.samples, stats.busy_seconds)
            batches, samples, busy = previous.get(pool.name, (0, 0, 0.0))
            if stats.batches > batches:
                new_batches, new_samples = stats.batches - batches, stats.samples - samples
                logger.info(
                    "%s: %d batches, %d samples (mean batch %.1f), %.2f s busy",
                    pool.name, new_batches, new_samples, new_samples / new_batches,
                    stats.busy_seconds - busy,
                )  # fmt: skip
        self._reported = current


def _cheap(recent_seconds: Sequence[float], budget: float) -> bool:
    """Whether batches that took ``recent_seconds`` (newest last) fit the loop's budget."""
    if not recent_seconds or recent_seconds[-1] > 4 * budget:
        return False
    ordered = sorted(recent_seconds)
    return ordered[len(ordered) // 2] <= budget


def _deliver_threadsafe(
    tasks: Sequence[Task],
    results: list[tuple] | None,
    error: str | None,
    current_loop: asyncio.AbstractEventLoop | None = None,
) -> None:
    """Resolve the tasks' futures on their loops (one wake-up per loop; at once for
    ``current_loop``, the loop this runs on); ``error`` is the message of the
    ExpertFailure every task receives instead of a result."""
    by_loop: dict[asyncio.AbstractEventLoop, list[int]] = {}
    for index, task in enumerate(tasks):
        by_loop.setdefault(task.future.get_loop(), []).append(index)
    for loop, indices in by_loop.items():
        subset = [tasks[i] for i in indices]
        subset_results = None if results is None else [results[i] for i in indices]
        if loop is current_loop:
            _deliver(subset, subset_results, error)
            continue
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(_deliver, subset, subset_results, error)


def _deliver(tasks: Sequence[Task], results: list[tuple] | None, error: str | None) -> None:
    for index, task in enumerate(tasks):
        if task.future.done():
            continue
        if error is not None:
            task.future.set_exception(ExpertFailure(error))
        else:
            task.future.set_result(results[index])
