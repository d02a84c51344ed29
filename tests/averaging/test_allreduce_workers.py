"""All-reduce rounds whose records are sealed and opened on worker threads
(swarmgrad.net.workers): a peer that stops reading while workers hold buffers, a record
whose tag fails on a worker, and many parallel rounds on one peer."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy
import pytest
import torch

from swarmgrad.averaging.allreduce import AllReduceRunner
from swarmgrad.averaging.allreduce.buffers import BufferPool
from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.net import records, workers
from tests.helpers.peers import make_group, make_peers

THREADS = 2
PART = 512 * 1024  # records of a part are >= workers.OFFLOAD_MIN: they go to the workers


@pytest.fixture(autouse=True)
def data_threads():
    workers.set_threads(THREADS)
    yield
    workers.set_threads(None)


class _Busy:
    """Address ranges worker threads read or write right now, and the jobs they ran."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ranges: dict[int, tuple[int, int]] = {}
        self.jobs = 0
        self.hold_until = 0.0  # time.monotonic() until which every job keeps its memory

    def pause(self) -> None:
        time.sleep(max(0.02, self.hold_until - time.monotonic()))  # releases the GIL

    def enter(self, *views) -> int:
        key = threading.get_ident()
        spans = [_span(v) for v in views]
        with self.lock:
            self.ranges[key] = spans
            self.jobs += 1
        return key

    def leave(self, key: int) -> None:
        with self.lock:
            self.ranges.pop(key, None)

    def overlaps(self, start: int, end: int) -> bool:
        with self.lock:
            return any(a < end and start < b for spans in self.ranges.values() for a, b in spans)


def _span(view) -> tuple[int, int]:
    start = numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0]
    return start, start + len(view)


@pytest.fixture
def busy(monkeypatch):
    """Track the memory worker jobs touch, and slow them down (``hold_until``) so that
    a round's end finds some of them still running."""
    tracker = _Busy()
    run, open_reserved = records.SealJob.run, records.Opener.open_reserved

    def slow_run(job):
        if not threading.current_thread().name.startswith(workers.THREAD_PREFIX):
            return run(job)
        key = tracker.enter(*[chunk for _, chunk, _, _ in job.items])
        try:
            tracker.pause()
            return run(job)
        finally:
            tracker.leave(key)

    def slow_open(opener, number, prefix, sealed, out):
        if not threading.current_thread().name.startswith(workers.THREAD_PREFIX):
            return open_reserved(opener, number, prefix, sealed, out)
        key = tracker.enter(out)
        try:
            tracker.pause()
            return open_reserved(opener, number, prefix, sealed, out)
        finally:
            tracker.leave(key)

    monkeypatch.setattr(records.SealJob, "run", slow_run)
    monkeypatch.setattr(records.Opener, "open_reserved", slow_open)
    return tracker


class CheckingPool(BufferPool):
    """A pool that fails the test when a buffer comes back while a worker thread still
    reads or writes it, and counts the buffers not yet returned."""

    def __init__(self, tracker: _Busy):
        super().__init__(max_bytes=0)  # never reuse: every round takes fresh memory
        self.tracker = tracker
        self.outstanding = 0
        self.reused_while_busy: list[int] = []

    def take(self, nbytes):
        self.outstanding += 1
        return super().take(nbytes)

    def give(self, buffer):
        self.outstanding -= 1
        start = buffer.data_ptr()
        if self.tracker.overlaps(start, start + buffer.numel()):
            self.reused_while_busy.append(buffer.numel())
        super().give(buffer)


async def shutdown(peers):
    for peer in peers:
        await peer.shutdown()


def _data_threads() -> int:
    return sum(t.name.startswith(workers.THREAD_PREFIX) for t in threading.enumerate())


def assert_whole_spans(got, original, result, span_sizes, expected=None):
    """Spans left local hold exactly the member's own values; averaged ones (when
    ``expected`` is given) the average."""
    offset = 0
    for span, size in enumerate(span_sizes):
        part = slice(offset, offset + size)
        if span not in result.averaged_spans:
            assert torch.equal(got[part], original[part]), f"half of span {span} was written"
        elif expected is not None:
            torch.testing.assert_close(got[part], expected[part])
        offset += size


def test_a_peer_that_stops_reading_mid_round_lets_go_of_every_buffer_by_the_deadline(arun, busy):
    numel = 3 * 1024 * 1024  # 12 MiB per member: many records per span
    deadline = 3.0
    hold = 0.5  # workers keep their memory until this long past the deadline

    async def main():
        peers = await make_peers(3)
        # connections up before the round, so that the stall starts mid-round
        warm_group = make_group(peers)
        await asyncio.gather(
            *(AllReduceRunner(p, warm_group, [torch.ones(8)]).run() for p in peers)
        )
        tensors = [
            [torch.randn(numel, generator=torch.Generator().manual_seed(i))] for i in range(3)
        ]
        originals = [[t.clone() for t in ts] for ts in tensors]
        pools = [CheckingPool(busy) for _ in peers]
        group = make_group(peers)
        timeouts = AdaptiveTimeouts(min_timeout=30.0)  # only the deadline ends the round
        runners = [
            AllReduceRunner(
                p,
                group,
                ts,
                part_size_bytes=PART,
                timeout=deadline,
                timeouts=timeouts,
                buffer_pool=pool,
            )
            for p, ts, pool in zip(peers, tensors, pools, strict=True)
        ]
        stalled = peers[2]
        conns = list(stalled._all_connections)

        async def stop_reading_mid_round():
            before = sum(c.bytes_received for c in conns)
            for _ in range(5000):  # a few seconds at most
                if sum(c.bytes_received for c in conns) >= before + PART:
                    break
                await asyncio.sleep(0.002)
            for conn in conns:  # the socket stays open, it is just never read again
                lower = conn.transport._lower
                lower.pause_reading()
                lower.resume_reading = lambda: None
            # from now on the workers keep what they hold until past the deadline
            busy.hold_until = started + deadline + hold
            return loop.time()

        jobs_before = busy.jobs
        loop = asyncio.get_running_loop()
        stopper = asyncio.ensure_future(stop_reading_mid_round())
        started = loop.time()
        results = await asyncio.gather(*(r.run() for r in runners))
        elapsed = loop.time() - started
        assert await stopper - started < deadline, "the stall did not start mid-round"
        threads = _data_threads()
        await shutdown(peers)
        spans = runners[0].span_sizes
        return tensors, originals, pools, results, elapsed, busy.jobs - jobs_before, threads, spans

    tensors, originals, pools, results, elapsed, jobs, threads, spans = arun(main)
    assert jobs > 0, "no record went through a worker thread"
    assert threads <= THREADS
    # it ends at its deadline, plus what the last worker job still took
    assert elapsed < deadline + hold + 1.5, f"the round took {elapsed:.2f} s ({deadline} s)"
    assert any(result.deadline_exceeded for result in results)
    for member, pool in enumerate(pools):
        assert pool.reused_while_busy == [], f"member {member} freed buffers a worker held"
        assert pool.outstanding == 0, f"member {member} kept {pool.outstanding} buffers"
        assert pool.free_bytes == 0  # the memory went back where it came from
    # what was not averaged is exactly what the member had: never half a span
    for member, result in enumerate(results):
        assert_whole_spans(tensors[member][0], originals[member][0], result, spans)


def test_a_record_whose_tag_fails_on_a_worker_closes_the_connection_and_writes_nothing(
    arun, monkeypatch
):
    numel = 1024 * 1024
    open_reserved = records.Opener.open_reserved
    forged = []

    def forge_first_on_a_worker(opener, number, prefix, sealed, out):
        if not forged and threading.current_thread().name.startswith(workers.THREAD_PREFIX):
            altered = bytearray(sealed)
            altered[len(altered) // 2] ^= 0x01  # one bit flipped in flight
            forged.append(number)
            sealed = altered
        return open_reserved(opener, number, prefix, sealed, out)

    async def main():
        peers = await make_peers(2)
        warm = make_group(peers)
        await asyncio.gather(*(AllReduceRunner(p, warm, [torch.ones(8)]).run() for p in peers))
        conns = [conn for peer in peers for conn in peer._all_connections]
        monkeypatch.setattr(records.Opener, "open_reserved", forge_first_on_a_worker)
        tensors = [
            [torch.randn(numel, generator=torch.Generator().manual_seed(i))] for i in range(2)
        ]
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        runners = [
            AllReduceRunner(
                p, group, ts, part_size_bytes=PART, timeouts=AdaptiveTimeouts(min_timeout=30.0)
            )
            for p, ts in zip(peers, tensors, strict=True)
        ]
        results = await asyncio.wait_for(asyncio.gather(*(r.run() for r in runners)), 60)
        reasons = [conn.closed.result() for conn in conns if conn.closed.done()]
        await shutdown(peers)
        return tensors, originals, results, reasons, runners[0].span_sizes

    tensors, originals, results, reasons, spans = arun(main)
    assert forged, "no record was opened on a worker thread"
    assert any("failed authentication" in str(reason) for reason in reasons), reasons
    failures = [
        reason
        for result in results
        for reason in [*result.failed_reducers.values(), *result.excluded_senders.values()]
    ]
    assert any("failed authentication" in reason for reason in failures), failures
    for member, result in enumerate(results):
        assert not result.fully_averaged
        # a span is averaged over whoever delivered it, or left exactly as it was
        assert_whole_spans(tensors[member][0], originals[member][0], result, spans)
        for span in set(range(2)) - set(result.averaged_spans):
            assert span != member or result.excluded_senders  # its own span: alone


def test_64_parallel_rounds_on_one_peer_keep_the_threads_bounded_and_all_finish(arun):
    rounds, numel = 64, 256 * 1024  # 1 MiB per member and round: records of 512 KiB

    async def main():
        peers = await make_peers(2)
        warm = make_group(peers)
        await asyncio.gather(*(AllReduceRunner(p, warm, [torch.ones(8)]).run() for p in peers))
        tensors = [
            [
                [torch.randn(numel, generator=torch.Generator().manual_seed(100 * r + i))]
                for i in range(2)
            ]
            for r in range(rounds)
        ]
        expected = [(ts[0][0] + ts[1][0]) / 2 for ts in tensors]
        timeouts = AdaptiveTimeouts(min_timeout=60.0)
        runners = []
        for r in range(rounds):
            group = make_group(peers)
            runners += [
                AllReduceRunner(p, group, ts, part_size_bytes=PART, timeouts=timeouts)
                for p, ts in zip(peers, tensors[r], strict=True)
            ]
        most_threads = 0
        done = asyncio.Event()

        async def count_threads():
            nonlocal most_threads
            while not done.is_set():
                most_threads = max(most_threads, _data_threads())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.01)

        counter = asyncio.ensure_future(count_threads())
        try:
            results = await asyncio.wait_for(asyncio.gather(*(r.run() for r in runners)), 120)
        finally:
            done.set()
            await counter
        await shutdown(peers)
        return tensors, expected, results, most_threads

    tensors, expected, results, most_threads = arun(main, timeout=180)
    assert 0 < most_threads <= THREADS
    assert all(result.fully_averaged for result in results)
    for r in range(rounds):
        for member in range(2):
            torch.testing.assert_close(tensors[r][member][0], expected[r])
