"""Task pools and the device thread: batching, limits, ordering, errors, shutdown."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import pytest
import torch

from swarmgrad.moe.server.runtime import INLINE_MAX_SAMPLES, Runtime, _cheap
from swarmgrad.moe.server.task_pool import ExpertFailure, ExpertOverloaded, TaskPool
from swarmgrad.utils.errors import ValidationError

DEADLINE = 30.0


class Gate:
    """A process function that blocks on its first call until released, so that the test
    can queue requests behind a busy device thread."""

    def __init__(self, fn=None):
        self.fn = fn or (lambda x: (x * 2,))
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[int] = []

    def __call__(self, x):
        self.calls.append(x.shape[0])
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(DEADLINE), "the test never released the gate"
        return self.fn(x)


async def until(predicate) -> None:
    """Poll state that the device thread changes (no event to await across threads)."""
    async with asyncio.timeout(DEADLINE):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)


def test_concurrent_requests_are_combined_into_one_batch_and_split_back(arun):
    pool = TaskPool(lambda x: (x * 2, x.sum(1, keepdim=True)), 64, "e.0_forward", 8, timeout=30)
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        try:
            inputs = [rows(2, 10 * i) for i in range(4)]
            results = await asyncio.gather(*(pool.submit_task(x) for x in inputs))
        finally:
            runtime.shutdown()
        for x, (doubled, summed) in zip(inputs, results, strict=True):
            assert torch.equal(doubled, x * 2) and torch.equal(summed, x)
        assert pool.stats.batches == 1 == runtime.batches_processed
        assert list(pool.stats.recent_batch_sizes) == [8]
        assert list(pool.stats.recent_batch_requests) == [4]

    arun(main)


def test_batches_never_exceed_max_batch_size_and_keep_arrival_order(arun):
    gate = Gate()
    pool = TaskPool(gate, 4, "e.0_forward")
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        try:
            first = pool.submit_task(rows(1))
            await asyncio.to_thread(gate.entered.wait, DEADLINE)
            sizes = [2, 2, 3, 1, 4, 1]
            futures = [pool.submit_task(rows(n, 100 * i)) for i, n in enumerate(sizes)]
            gate.release.set()
            results = await asyncio.gather(first, *futures)
        finally:
            runtime.shutdown()
        assert gate.calls == [1, 4, 4, 4, 1]  # [2, 2], [3, 1], [4], [1]
        assert max(pool.stats.recent_batch_sizes) <= 4
        for n, i, (out,) in zip(sizes, range(len(sizes)), results[1:], strict=True):
            assert torch.equal(out, rows(n, 100 * i) * 2)

    arun(main)


def test_a_request_larger_than_max_batch_size_is_refused_at_once():
    pool = TaskPool(lambda x: (x,), 4, "e.0_forward")
    with pytest.raises(ValidationError, match=r"e\.0_forward.*5 samples exceeds max_batch_size=4"):
        pool.submit_task(rows(5))


def test_a_full_queue_refuses_new_requests_at_once_and_accepts_them_again_when_drained(arun):
    gate = Gate()
    pool = TaskPool(gate, 4, "e.0_forward", max_queued_samples=8)
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        try:
            first = pool.submit_task(rows(1))  # taken by the device thread, which then waits
            await asyncio.to_thread(gate.entered.wait, DEADLINE)
            queued = [pool.submit_task(rows(n)) for n in (2, 2, 4)]  # 8 samples wait
            with pytest.raises(ExpertOverloaded, match=r"8 samples already wait \(at most 8\)"):
                pool.submit_task(rows(1))
            gate.release.set()
            await asyncio.gather(first, *queued)
            (out,) = await pool.submit_task(rows(1))
        finally:
            runtime.shutdown()
        assert torch.equal(out, rows(1) * 2)

    arun(main)


def test_max_queued_samples_below_a_batch_is_refused():
    with pytest.raises(ValidationError, match="max_queued_samples must be an integer >= max"):
        TaskPool(lambda x: (x,), 4, "e.0_forward", max_queued_samples=3)


def test_the_pool_with_the_oldest_request_runs_first(arun):
    gate = Gate()
    blocker = TaskPool(gate, 8, "a.0_forward")
    order: list[str] = []
    pools = [
        TaskPool(lambda x, n=name: (order.append(n) or x,), 8, f"{name}_forward")
        for name in ("b.0", "c.0", "d.0")
    ]
    runtime = Runtime([blocker, *pools])

    async def main():
        runtime.start()
        try:
            first = blocker.submit_task(rows(1))
            await asyncio.to_thread(gate.entered.wait, DEADLINE)
            futures = [pools[i].submit_task(rows(1)) for i in (2, 0, 1)]
            gate.release.set()
            await asyncio.gather(first, *futures)
        finally:
            runtime.shutdown()
        assert order == ["d.0", "b.0", "c.0"]

    arun(main)


def test_an_error_in_a_batch_reaches_every_request_of_it_and_the_runtime_goes_on(arun):
    def fragile(x):
        if (x > 100).any():
            raise RuntimeError("value too large for this expert")
        return (x + 1,)

    pool = TaskPool(fragile, 16, "e.0_forward", min_batch_size=2, timeout=30)
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        try:
            good, bad = pool.submit_task(rows(1)), pool.submit_task(rows(1, 500))
            for future in (good, bad):
                with pytest.raises(ExpertFailure) as info:
                    await future
                message = str(info.value)
                assert "e.0_forward failed on a batch of 2 requests (2 samples)" in message
                assert "RuntimeError: value too large for this expert" in message
            # the thread survived: the next batch works
            results = await asyncio.gather(pool.submit_task(rows(1)), pool.submit_task(rows(1)))
        finally:
            runtime.shutdown()
        assert all(torch.equal(out, rows(1) + 1) for (out,) in results)
        assert pool.stats.failed_batches == 1 and pool.stats.batches == 2

    arun(main)


def test_min_batch_size_waits_at_most_the_timeout(arun):
    pool = TaskPool(lambda x: (x,), 64, "e.0_forward", min_batch_size=32, timeout=0.05)
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        try:
            (out,) = await asyncio.wait_for(pool.submit_task(rows(3)), DEADLINE)
        finally:
            runtime.shutdown()
        assert torch.equal(out, rows(3))
        assert list(pool.stats.recent_batch_sizes) == [3]

    arun(main)


def test_cancelled_requests_are_skipped(arun):
    gate = Gate()
    pool = TaskPool(gate, 8, "e.0_forward")
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        try:
            first = pool.submit_task(rows(1))
            await asyncio.to_thread(gate.entered.wait, DEADLINE)
            abandoned, kept = pool.submit_task(rows(3)), pool.submit_task(rows(2))
            abandoned.cancel()
            gate.release.set()
            await asyncio.gather(first, kept)
        finally:
            runtime.shutdown()
        assert gate.calls == [1, 2]

    arun(main)


def test_shutdown_fails_queued_requests_and_refuses_new_ones(arun):
    gate = Gate()
    pool = TaskPool(gate, 1, "e.0_forward")
    runtime = Runtime([pool])

    async def main():
        runtime.start()
        first = pool.submit_task(rows(1))
        await asyncio.to_thread(gate.entered.wait, DEADLINE)
        queued = pool.submit_task(rows(1))
        stopping = asyncio.ensure_future(asyncio.to_thread(runtime.shutdown))
        await until(lambda: runtime._stopping)
        gate.release.set()
        await stopping
        (out,) = await first  # the batch in progress completes
        assert torch.equal(out, rows(1) * 2)
        with pytest.raises(ExpertFailure, match=r"e\.0_forward: the server is shutting down"):
            await queued
        with pytest.raises(ExpertFailure, match="not running"):
            pool.submit_task(rows(1))
        assert not runtime.is_alive

    arun(main)


def test_pool_arguments_are_checked():
    with pytest.raises(ValidationError, match="min_batch_size must be in"):
        TaskPool(lambda x: (x,), 4, "p", min_batch_size=5)
    with pytest.raises(ValidationError, match="max_batch_size must be a positive int"):
        TaskPool(lambda x: (x,), 0, "p")
    with pytest.raises(ValidationError, match="unique"):
        Runtime([TaskPool(lambda x: (x,), 4, "p"), TaskPool(lambda x: (x,), 4, "p")])


def test_stats_reports_log_the_work_done_since_the_last_one(arun, caplog):
    pool = TaskPool(lambda x: (x,), 8, "e.0_forward")
    runtime = Runtime([pool], stats_report_interval=0.01)

    async def main():
        runtime.start()
        try:
            await asyncio.gather(pool.submit_task(rows(2)), pool.submit_task(rows(3)))
            await until(lambda: "e.0_forward:" in caplog.text)
        finally:
            runtime.shutdown()

    with caplog.at_level(logging.INFO, logger="swarmgrad.moe.server.runtime"):
        arun(main)
    assert re.search(r"e\.0_forward: \d batches, [235] samples \(mean batch", caplog.text)


# ---------------------------------------------------------------------- batches on the loop


class Recorder:
    """A process function that records the thread and size of every batch it runs."""

    def __init__(self, fn=None):
        self.fn = fn or (lambda x: (x * 2,))
        self.threads: list[threading.Thread] = []
        self.sizes: list[int] = []

    def __call__(self, x):
        self.threads.append(threading.current_thread())
        self.sizes.append(x.shape[0])
        return self.fn(x)


def cpu_pool(fn, name="e.0_forward", **kwargs) -> TaskPool:
    """A pool that allows the loop to run its batches, as a CPU expert's pools do."""
    return TaskPool(fn, 64, name, lock=threading.RLock(), may_run_inline=lambda: True, **kwargs)


def test_a_lone_cheap_batch_runs_on_the_loop_once_its_cost_is_measured(arun):
    fn = Recorder()
    pool = cpu_pool(fn)
    runtime = Runtime([pool], inline_max_seconds=1.0)

    async def main():
        runtime.start()
        try:
            results = [await pool.submit_task(rows(1, i)) for i in range(3)]
        finally:
            runtime.shutdown()
        loop_thread = threading.current_thread()
        # the first batch has no measured cost yet: the device thread runs it
        assert fn.threads[0] is not loop_thread
        assert fn.threads[1:] == [loop_thread, loop_thread]
        for i, (out,) in enumerate(results):
            assert torch.equal(out, rows(1, i) * 2)
        # the same statistics as batches on the device thread
        assert pool.stats.batches == 3 == runtime.batches_processed
        assert pool.stats.inline_batches == 2
        assert pool.stats.samples == 3 and pool.stats.requests == 3
        assert list(pool.stats.recent_batch_sizes) == [1, 1, 1]
        assert len(pool.stats.recent_batch_seconds) == 3 and pool.stats.busy_seconds > 0

    arun(main)


def test_pools_without_may_run_inline_and_a_zero_budget_always_use_the_device_thread(arun):
    plain_fn, budgetless_fn = Recorder(), Recorder()
    plain = TaskPool(plain_fn, 64, "plain_forward")
    budgetless = cpu_pool(budgetless_fn, "budgetless_forward")
    runtimes = [Runtime([plain], inline_max_seconds=1.0), Runtime([budgetless])]
    runtimes[1].inline_max_seconds = 0.0

    async def main():
        for runtime in runtimes:
            runtime.start()
        try:
            for _ in range(3):
                await plain.submit_task(rows(1))
                await budgetless.submit_task(rows(1))
        finally:
            for runtime in runtimes:
                runtime.shutdown()
        loop_thread = threading.current_thread()
        assert loop_thread not in plain_fn.threads + budgetless_fn.threads
        assert plain.stats.inline_batches == budgetless.stats.inline_batches == 0

    arun(main)


def test_an_expensive_expert_never_runs_on_the_loop(arun):
    def slow(x):
        time.sleep(0.003)  # 3 ms per batch, over the 1 ms budget
        return (x + 1,)

    fn = Recorder(slow)
    pool = cpu_pool(fn)
    runtime = Runtime([pool], inline_max_seconds=1e-3)

    async def main():
        runtime.start()
        try:
            for _ in range(4):
                await pool.submit_task(rows(1))
        finally:
            runtime.shutdown()
        assert threading.current_thread() not in fn.threads
        assert pool.stats.inline_batches == 0
        assert min(pool.stats.recent_batch_seconds) > 1e-3

    arun(main)


def test_no_batch_runs_on_the_loop_while_the_device_thread_is_busy(arun):
    gate = Gate()
    busy = TaskPool(gate, 64, "slow.0_forward")
    fn = Recorder()
    cheap = cpu_pool(fn, "cheap.0_forward")
    runtime = Runtime([busy, cheap], inline_max_seconds=1.0)

    async def main():
        runtime.start()
        try:
            await cheap.submit_task(rows(1))  # measured: cheap from now on
            blocking = busy.submit_task(rows(1))
            await asyncio.to_thread(gate.entered.wait, DEADLINE)
            queued = cheap.submit_task(rows(1, 5))
            await asyncio.sleep(0.05)
            assert not queued.done() and cheap.num_pending == 1  # waits its turn
            gate.release.set()
            (out,) = await queued
            await blocking
        finally:
            gate.release.set()
            runtime.shutdown()
        assert torch.equal(out, rows(1, 5) * 2)
        assert threading.current_thread() not in fn.threads
        assert cheap.stats.inline_batches == 0

    arun(main)


def test_the_loop_never_waits_for_a_held_expert_lock(arun):
    fn = Recorder()
    pool = cpu_pool(fn)
    runtime = Runtime([pool], inline_max_seconds=1.0)
    held, release = threading.Event(), threading.Event()

    def checkpoint():  # holds the expert's lock, as a checkpoint does
        with pool.lock:
            held.set()
            assert release.wait(DEADLINE)

    async def main():
        runtime.start()
        holder = threading.Thread(target=checkpoint)
        try:
            await pool.submit_task(rows(1))
            holder.start()
            assert await asyncio.to_thread(held.wait, DEADLINE)
            future = pool.submit_task(rows(1, 7))
            for _ in range(5):  # the loop keeps running while the lock is held
                await asyncio.sleep(0.01)
            assert not future.done()
            release.set()
            (out,) = await future
        finally:
            release.set()
            runtime.shutdown()
            holder.join(DEADLINE)
        assert torch.equal(out, rows(1, 7) * 2)
        assert threading.current_thread() not in fn.threads  # the device thread ran both
        assert pool.stats.inline_batches == 0 and pool.stats.batches == 2

    def locked_forward(x):
        with pool.lock:  # what ModuleBackend.forward does
            return (x * 2,)

    fn.fn = locked_forward
    arun(main)


def test_requests_that_arrive_together_still_merge_into_one_batch(arun):
    fn = Recorder()
    pool = cpu_pool(fn)
    runtime = Runtime([pool], inline_max_seconds=1.0)

    async def main():
        runtime.start()
        try:
            await pool.submit_task(rows(1))
            inputs = [rows(n, 10 * i) for i, n in enumerate([1, 2, 3])]
            results = await asyncio.gather(*(pool.submit_task(x) for x in inputs))
        finally:
            runtime.shutdown()
        assert fn.sizes == [1, 6]  # one batch of the three requests, run on the loop
        assert fn.threads[1] is threading.current_thread()
        assert list(pool.stats.recent_batch_requests) == [1, 3]
        for x, (out,) in zip(inputs, results, strict=True):
            assert torch.equal(out, x * 2)

    arun(main)


def test_a_batch_too_large_for_the_loop_goes_to_the_device_thread(arun):
    fn = Recorder()
    pool = TaskPool(fn, 256, "e.0_forward", lock=threading.RLock(), may_run_inline=lambda: True)
    runtime = Runtime([pool], inline_max_seconds=1.0)

    async def main():
        runtime.start()
        try:
            await pool.submit_task(rows(1))
            await pool.submit_task(rows(INLINE_MAX_SAMPLES + 1))
            # requests that join a scheduled run on the loop and make it too large
            await asyncio.gather(*(pool.submit_task(rows(INLINE_MAX_SAMPLES)) for _ in range(2)))
        finally:
            runtime.shutdown()
        assert threading.current_thread() not in fn.threads
        assert fn.sizes == [1, INLINE_MAX_SAMPLES + 1, 2 * INLINE_MAX_SAMPLES]

    arun(main)


def test_an_expert_that_raises_on_the_loop_gives_the_device_threads_error(arun, caplog):
    def fails_after_the_first(x):
        if fails_after_the_first.calls:
            raise RuntimeError(f"boom on {x.shape[0]}")
        fails_after_the_first.calls += 1
        return (x,)

    fails_after_the_first.calls = 0
    errors = {}

    async def run(budget: float) -> None:
        fn = Recorder(fails_after_the_first)
        pool = cpu_pool(fn)
        runtime = Runtime([pool], inline_max_seconds=budget)
        fails_after_the_first.calls = 0
        runtime.start()
        try:
            await pool.submit_task(rows(1))
            with pytest.raises(ExpertFailure) as failure:
                await pool.submit_task(rows(2))
            # the runtime keeps serving
            fn.fn = lambda x: (x * 3,)
            (out,) = await pool.submit_task(rows(1, 4))
            assert torch.equal(out, rows(1, 4) * 3)
        finally:
            runtime.shutdown()
        errors[budget] = str(failure.value)
        assert pool.stats.failed_batches == 1 and pool.stats.batches == 3
        assert (fn.threads[1] is threading.current_thread()) == (budget > 0)

    async def main():
        await run(1.0)  # on the loop
        await run(0.0)  # on the device thread

    with caplog.at_level(logging.WARNING, logger="swarmgrad.moe.server.runtime"):
        arun(main)
    assert errors[1.0] == errors[0.0]
    assert errors[1.0] == (
        "e.0_forward failed on a batch of 1 requests (2 samples): RuntimeError: boom on 2"
    )
    assert caplog.text.count("e.0_forward failed on a batch of 1 requests") == 2


def test_the_runtime_checks_its_loop_budget():
    with pytest.raises(ValidationError, match="inline_max_seconds must be a number >= 0"):
        Runtime([], inline_max_seconds=-1)


def test_the_loops_budget_looks_at_the_median_of_recent_batches_and_the_last_one():
    cheap, slow = 1e-5, 1e-2
    assert not _cheap([], 1e-3)  # nothing measured yet
    assert _cheap([cheap] * 5, 1e-3)
    assert _cheap([cheap, cheap, slow, cheap, cheap], 1e-3)  # one descheduled batch
    assert not _cheap([cheap] * 4 + [slow], 1e-3)  # the newest batch turned slow
    assert not _cheap([slow, slow, slow, cheap, cheap], 1e-3)  # mostly slow
    assert _cheap([cheap] * 4 + [3e-3], 1e-3)  # within four budgets: still cheap


def test_an_expert_that_turns_slow_on_the_loop_leaves_it_after_one_batch(arun):
    def turns_slow(x):
        if len(fn.sizes) >= 4:
            time.sleep(0.1)  # over four budgets
        return (x,)

    fn = Recorder(turns_slow)
    pool = cpu_pool(fn)
    runtime = Runtime([pool], inline_max_seconds=0.02)

    async def main():
        runtime.start()
        try:
            for i in range(6):
                await pool.submit_task(rows(1, i))
        finally:
            runtime.shutdown()
        loop_thread = threading.current_thread()
        ran_on_loop = [thread is loop_thread for thread in fn.threads]
        # measured on the device thread, then cheap on the loop; the first slow batch runs
        # on the loop (nothing foretold it), the next ones go to the device thread
        assert ran_on_loop == [False, True, True, True, False, False]

    arun(main)
