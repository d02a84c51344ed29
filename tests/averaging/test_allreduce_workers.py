"""All-reduce rounds whose records are sealed and opened on worker threads
(swarmgrad.net.workers): a peer that stops reading while workers hold buffers, a record
whose tag fails on a worker, and many parallel rounds on one peer."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy
import pytest
import torch

from swarmgrad.averaging.allreduce import AllReduceRunner
from swarmgrad.averaging.allreduce.buffers import BufferPool
from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.net import records, workers
from swarmgrad.net.peer import Peer

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
    """Track the memory worker jobs touch; slow them down so that a round's end finds
    some of them still running."""
    tracker = _Busy()
    run, open_reserved = records.SealJob.run, records.Opener.open_reserved

    def slow_run(job):
        if not threading.current_thread().name.startswith(workers.THREAD_PREFIX):
            return run(job)
        key = tracker.enter(*[chunk for _, chunk, _, _ in job.items])
        try:
            time.sleep(0.02)  # (releases the GIL, as the cipher does)
            return run(job)
        finally:
            tracker.leave(key)

    def slow_open(opener, number, prefix, sealed, out):
        if not threading.current_thread().name.startswith(workers.THREAD_PREFIX):
            return open_reserved(opener, number, prefix, sealed, out)
        key = tracker.enter(out)
        try:
            time.sleep(0.02)
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


async def make_peers(n: int) -> list[Peer]:
    peers = [await Peer.create() for _ in range(n)]
    for peer in peers:
        for other in peers:
            if other is not peer:
                peer.add_addresses(other.peer_id, other.get_visible_maddrs())
    return peers


def make_group(peers) -> GroupInfo:
    return GroupInfo(os.urandom(16), tuple(p.peer_id for p in peers), tuple(b"" for _ in peers))


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
        conns = list(stalled._connections.values())

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
    assert elapsed < deadline + 2.0, f"the round took {elapsed:.2f} s past its {deadline} s"
    assert any(result.deadline_exceeded for result in results)
    for member, pool in enumerate(pools):
        assert pool.reused_while_busy == [], f"member {member} freed buffers a worker held"
        assert pool.outstanding == 0, f"member {member} kept {pool.outstanding} buffers"
        assert pool.free_bytes == 0  # the memory went back where it came from
    # what was not averaged is exactly what the member had: never half a span
    for member, result in enumerate(results):
        assert_whole_spans(tensors[member][0], originals[member][0], result, spans)
