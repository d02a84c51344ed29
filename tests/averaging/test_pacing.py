"""SendPacer: a round's writes spaced to a rate, shared by the streams that use it."""

from __future__ import annotations

import asyncio

import pytest

from swarmgrad.averaging.allreduce.pacing import SendPacer, check_send_rate
from swarmgrad.averaging.step_control import StepControl
from swarmgrad.utils.errors import ValidationError


class RecordingStream:
    def __init__(self) -> None:
        self.writes: list[tuple[float, int]] = []

    async def write(self, data: memoryview) -> None:
        self.writes.append((asyncio.get_running_loop().time(), len(data)))


def test_writes_are_spread_at_the_rate_in_small_chunks():
    async def main() -> tuple[float, RecordingStream]:
        pacer, stream = SendPacer(200_000), RecordingStream()
        began = asyncio.get_running_loop().time()
        await pacer.write(stream, bytes(100_000))
        return asyncio.get_running_loop().time() - began, stream

    elapsed, stream = asyncio.run(main())
    assert sum(n for _, n in stream.writes) == 100_000
    assert max(n for _, n in stream.writes) <= 200_000 // 20
    # chunks fill whole 1448-byte TCP segments with their 30 bytes of framing
    assert all((n + 30) % 1448 == 0 for _, n in stream.writes[:-1])
    assert SendPacer(15_000).chunk == 2 * 1448 - 30  # slow rates: two segments
    # the last chunk may go at once when its turn comes: (100 kB - one chunk) / rate
    assert elapsed >= (100_000 - 10_000) / 200_000 * 0.95, elapsed
    assert elapsed < 2.0, elapsed


def test_streams_sharing_a_pacer_share_its_rate():
    """Two rounds in flight at once (two fragments) must not send twice as fast."""

    async def main() -> float:
        pacer = SendPacer(200_000)
        began = asyncio.get_running_loop().time()
        await asyncio.gather(
            pacer.write(RecordingStream(), bytes(50_000)),
            pacer.write(RecordingStream(), bytes(50_000)),
        )
        return asyncio.get_running_loop().time() - began

    assert asyncio.run(main()) >= (100_000 - 20_000) / 200_000 * 0.95


def test_a_changed_rate_applies_to_the_next_chunks():
    async def main() -> float:
        pacer = SendPacer(50_000)
        pacer.rate = 1_000_000
        began = asyncio.get_running_loop().time()
        await pacer.write(RecordingStream(), bytes(100_000))
        return asyncio.get_running_loop().time() - began

    assert asyncio.run(main()) < 0.5


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), True, "fast"])
def test_bad_rates_are_refused_by_name(bad):
    with pytest.raises(ValidationError, match="send_rate"):
        check_send_rate(bad)
    with pytest.raises(ValidationError, match="send_rate"):
        SendPacer(bad)


def test_a_step_takes_only_a_pacer_and_only_before_its_all_reduce():
    control = StepControl(scheduled_time=0.0, weight=1.0)
    control.send_pacer = SendPacer(1e6)
    control.send_pacer = None
    with pytest.raises(ValidationError, match="send_pacer"):
        control.send_pacer = 1e6
