"""The data path's worker threads: how many, and records sealed and opened on them
arrive whole and in order while small messages stay on the loop thread."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from swarmgrad.net import records, workers
from swarmgrad.net.peer import Peer


@pytest.fixture
def threads():
    workers.set_threads(2)
    yield 2
    workers.set_threads(None)


@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_a_bad_thread_count_in_the_environment_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(workers.ENV, raw)
    with pytest.raises(ValueError, match=workers.ENV):
        workers.configured_threads()


def test_the_thread_count_comes_from_the_environment_or_the_processors(monkeypatch):
    monkeypatch.setenv(workers.ENV, "3")
    assert workers.configured_threads() == 3
    monkeypatch.delenv(workers.ENV)
    monkeypatch.setattr(workers, "_available_processors", lambda: 2)
    assert workers.configured_threads() == 0  # two cores: everything on the loop thread
    monkeypatch.setattr(workers, "_available_processors", lambda: 16)
    assert workers.configured_threads() == workers.MAX_DEFAULT_THREADS
    with pytest.raises(ValueError, match="threads"):
        workers.set_threads(-1)


def test_no_threads_means_no_pool():
    workers.set_threads(0)
    try:
        assert workers.pool() is None
    finally:
        workers.set_threads(None)


def test_streams_of_large_writes_arrive_whole_and_in_order_while_small_calls_stay_inline(
    arun, threads, monkeypatch
):
    on_workers = {"seal": 0, "open": 0, "small_on_worker": 0}
    run, open_reserved = records.SealJob.run, records.Opener.open_reserved

    def on_worker() -> bool:
        return threading.current_thread().name.startswith(workers.THREAD_PREFIX)

    def counting_run(job):
        if on_worker():
            on_workers["seal"] += 1
            if job.nbytes < workers.OFFLOAD_MIN:
                on_workers["small_on_worker"] += 1
        return run(job)

    def counting_open(opener, number, prefix, sealed, out):
        if on_worker():
            on_workers["open"] += 1
            if len(out) < workers.OFFLOAD_MIN:
                on_workers["small_on_worker"] += 1
        return open_reserved(opener, number, prefix, sealed, out)

    monkeypatch.setattr(records.SealJob, "run", counting_run)
    monkeypatch.setattr(records.Opener, "open_reserved", counting_open)
    payloads = [os.urandom(3 * 1024 * 1024 + 17 * i) for i in range(4)]

    async def main():
        a, b = await Peer.create(), await Peer.create()
        received: dict[int, bytes] = {}

        async def sink(stream):
            index = int((await stream.readexactly(1))[0])
            buffer = bytearray(len(payloads[index]))
            await stream.readexactly_into(buffer)  # straight into the reader's memory
            received[index] = bytes(buffer)
            await stream.write(b"ok", fin=True)

        b.add_protocol_handler("sink", sink)
        a.add_addresses(b.peer_id, b.get_visible_maddrs())

        async def send(index):
            stream = await a.open_stream(b.peer_id, "sink")
            await stream.write(bytes([index]))
            await stream.write(payloads[index], fin=True)
            assert await stream.read() == b"ok"

        await asyncio.gather(*(send(i) for i in range(len(payloads))))
        await a.shutdown()
        await b.shutdown()
        return received

    received = arun(main)
    assert [received[i] for i in range(len(payloads))] == payloads
    assert on_workers["seal"] > 0 and on_workers["open"] > 0
    assert on_workers["small_on_worker"] == 0  # small writes never leave the loop thread
