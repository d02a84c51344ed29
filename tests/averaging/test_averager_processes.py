"""DecentralizedAverager across real processes: one of four is SIGKILLed mid-round; the
survivors return within their deadline with correct partial averages, and the next
round succeeds without it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from swarmgrad.dht import DHT

pytestmark = pytest.mark.slow

NUMEL = 1 << 20
STEP_TIMEOUT = 40.0

CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, json, sys, time
    import torch
    from swarmgrad.averaging import DecentralizedAverager
    from swarmgrad.averaging.allreduce import AllReduceRunner
    from swarmgrad.dht import DHT

    maddr, label, stall = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "stall"
    torch.set_num_threads(1)

    def say(**fields):
        print(json.dumps(fields), flush=True)

    if stall:  # send the first part of each span, then hang until the parent kills us
        class Stalling:
            def __init__(self, stream):
                self._stream, self._writes = stream, 0
            def __getattr__(self, name):
                return getattr(self._stream, name)
            async def write(self, data):
                if self._writes >= 1:
                    say(event="midround")
                    await asyncio.Event().wait()
                self._writes += 1
                await self._stream.write(data)

        original = AllReduceRunner._send_parts
        async def stalling(self, stream, span_index, sent):
            return await original(self, Stalling(stream), span_index, sent)
        AllReduceRunner._send_parts = stalling

    dht = DHT(initial_peers=[maddr], start=True)
    tensors = [torch.full((NUMEL,), float(label))]
    averager = DecentralizedAverager(
        tensors, dht, start=True, prefix="procs", target_group_size=4,
        min_matchmaking_time=2.0, request_timeout=5.0, allreduce_timeout=20.0,
        part_size_bytes=256 * 1024,
    )
    say(event="ready")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        started = time.monotonic()
        result = averager.step(gather=label, timeout=command["timeout"])
        took = time.monotonic() - started
        with averager.get_tensors() as (values,):
            distinct = sorted(set(values[:: 1024].tolist()) | set(values[-16:].tolist()))
            say(event="stepped", took=took, members=None if result is None else
                sorted(result.values()), sum=float(values.double().sum()),
                first=float(values[0]), distinct=distinct[:16],
                identical=hashlib.sha256(values.numpy().tobytes()).hexdigest())
    averager.shutdown()
    dht.shutdown()
    """
).replace("NUMEL", str(NUMEL))


class Child:
    def __init__(self, maddr: str, label: int, stall: bool):
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, maddr, str(label), "stall" if stall else "normal"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def expect(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                message = self.lines.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"child {self.label}: no {event!r} within {timeout} s:\n{''.join(self.log)}"
                ) from None
            if message["event"] == event:
                return message

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def test_sigkill_of_a_member_mid_round_the_survivors_finish_in_time_and_go_on():
    bootstrap = DHT(start=True)
    maddr = str(bootstrap.get_visible_maddrs()[0])
    victim = 3
    children = [Child(maddr, label, stall=label == victim) for label in range(4)]
    try:
        for child in children:
            child.expect("ready", 120)
        for child in children:
            child.send(op="step", timeout=STEP_TIMEOUT)
        children[victim].expect("midround", 60)
        killed_at = time.monotonic()
        os.kill(children[victim].proc.pid, signal.SIGKILL)
        survivors = [c for c in children if c.label != victim]
        first = [c.expect("stepped", STEP_TIMEOUT + 30) for c in survivors]
        noticed = time.monotonic() - killed_at
        for child, report in zip(survivors, first, strict=True):
            assert report["took"] < STEP_TIMEOUT, report
            # every value: the full mean, the survivors' mean, or (the victim's span) its own
            allowed = (1.5, 1.0, float(child.label))
            assert all(min(abs(v - a) for a in allowed) < 1e-6 for v in report["distinct"])
        assert noticed < 20 + 10  # well within allreduce_timeout of the kill

        for child in survivors:
            child.send(op="step", timeout=STEP_TIMEOUT)
        second = [c.expect("stepped", STEP_TIMEOUT + 30) for c in survivors]
        assert all(r["members"] == [0, 1, 2] for r in second), second
        assert all(r["took"] < STEP_TIMEOUT for r in second)
        assert len({r["identical"] for r in second}) == 1  # bit-identical everywhere
        mean_of_sums = sum(r["sum"] for r in first) / 3
        assert all(abs(r["sum"] - mean_of_sums) < 1e-4 * NUMEL for r in second)
    finally:
        for child in children:
            child.stop()
        bootstrap.shutdown()
