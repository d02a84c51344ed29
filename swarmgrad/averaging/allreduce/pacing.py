"""Spacing a round's writes to a rate: background averaging that leaves the link usable.

A blocking all-reduce should use the whole link: everyone waits for it. A round that runs
in the background while training goes on (Streaming DiLoCo's fragments) has until its
result is needed, and sending it at full speed only makes a burst that a shared home
uplink feels (a video call stutters, the peer's other streams queue behind it) and that
makes the peak the link must carry as high as if nothing were streamed. A
:class:`SendPacer` spreads the bytes one peer writes in a round (its parts to the owners
and its averaged span back to the senders) evenly at ``rate`` bytes per second.

One pacer serves all the round's streams of a peer: their writes take turns on one
schedule, so the peer's total stays at ``rate`` however many owners it sends to.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from swarmgrad.utils.errors import ValidationError

__all__ = ["SendPacer", "check_send_rate"]

#: writes per second a pacer aims at: small enough steps that the rate is smooth at a
#: one-second scale, few enough that sleeping costs nothing at fast rates
_STEPS_PER_SECOND = 20
#: A chunk fills whole TCP segments: a paced write leaves alone, so its last segment is
#: not topped up by the next write. On a 1500-byte MTU with TCP timestamps a segment
#: carries 1448 bytes, and a chunk's frame and record add 30 (mux header 10, record
#: length 4, AES-GCM tag 16). 2048-byte chunks took two segments each, the second
#: 40% full: with the ACK each drew, 11% of a paced round's bytes on the wire were
#: headers; chunks of two full segments make it 8%.
_SEGMENT_PAYLOAD = 1448
_CHUNK_FRAMING = 30
_MIN_SEGMENTS = 2


def check_send_rate(rate: Any) -> float | None:
    """``rate`` as a float of bytes per second (None: no limit), or ValidationError."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
        raise ValidationError(
            f"send_rate must be a positive number of bytes/s or None, got {rate!r}"
        )
    return float(rate)


class SendPacer:
    """Writes to streams no faster than ``rate`` bytes per second in total."""

    def __init__(self, rate: float):
        self.rate = rate
        self._free_at = -math.inf  # loop time from which the next chunk may go

    @property
    def rate(self) -> float:
        """Bytes per second; may change between (and during) rounds."""
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        rate = check_send_rate(value)
        if rate is None:
            raise ValidationError("a SendPacer needs a rate")
        self._rate = rate
        segments = max(_MIN_SEGMENTS, int(rate / _STEPS_PER_SECOND / _SEGMENT_PAYLOAD))
        self.chunk = segments * _SEGMENT_PAYLOAD - _CHUNK_FRAMING

    async def write(self, stream: Any, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` to ``stream`` in chunks, each when the schedule allows it."""
        view = memoryview(data).cast("B")
        loop = asyncio.get_running_loop()
        for start in range(0, max(1, view.nbytes), self.chunk):
            chunk = view[start : start + self.chunk]
            now = loop.time()
            at = max(self._free_at, now)
            self._free_at = at + chunk.nbytes / self.rate  # reserved before sleeping
            if at > now:
                await asyncio.sleep(at - now)
            await stream.write(chunk)
