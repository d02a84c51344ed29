"""Reusable receive and accumulation buffers for all-reduce rounds.

A round needs buffers about the size of the averaged vector (incoming spans, running
sums, averaged results). Fresh multi-megabyte allocations are not free: the C allocator
maps them from the kernel and unmaps them when freed, so every round would pay a page
fault and a page clear per 4 KiB, which measured as a quarter of an 8-peer round's CPU
time on loopback. Rounds of one averager ask for the same sizes again and again, so
keeping the buffers of the last rounds (up to a byte cap) makes that cost disappear.
"""

from __future__ import annotations

import collections
import threading

import torch

__all__ = ["DEFAULT_POOL", "BufferPool"]


class BufferPool:
    """Free uint8 buffers by exact size, the least recently returned dropped first once
    more than ``max_bytes`` are kept. Buffers come back uninitialized."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._free: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self._free_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            buffers = self._free.get(nbytes)
            if buffers:
                buffer = buffers.pop()
                if not buffers:
                    del self._free[nbytes]
                self._free_bytes -= nbytes
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from :meth:`take`; nothing may use it afterwards."""
        nbytes = buffer.numel()
        if nbytes == 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            self._free.setdefault(nbytes, []).append(buffer)
            self._free.move_to_end(nbytes)
            self._free_bytes += nbytes
            while self._free_bytes > self.max_bytes:
                size, buffers = next(iter(self._free.items()))
                buffers.pop(0)
                self._free_bytes -= size
                if not buffers:
                    del self._free[size]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


DEFAULT_POOL = BufferPool()
