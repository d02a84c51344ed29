"""Keeping a forward pass's autograd graph until its backward arrives.

The protocol makes a client send the inputs again with ``moe.backward``, and the plain
way to answer is to recompute the forward pass with autograd (hivemind does). For the
usual pattern, forward then backward of the same batch before any other update of the
expert, that costs a whole extra forward pass. This cache keeps the graph built while
answering ``moe.forward`` and lets ``moe.backward`` reuse it when

- the backward batch's inputs are exactly (``torch.equal``) the forward batch's, and
- the expert's weights have not been updated in between,

which is when recomputing would build the very same graph. Anything else recomputes, so
results never depend on whether the cache hit. The memory a graph keeps alive (the
tensors autograd saves, counted as they are recorded with ``saved_tensors_hooks``, plus
the inputs and outputs) is bounded by ``max_bytes`` over all graphs, their number by
``max_entries``, and their age by ``max_age`` seconds; the oldest graphs go first.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ActivationCache", "CachedForward"]


@dataclass(eq=False)
class CachedForward:
    """One forward batch: its inputs, the graph's leaves and outputs, and its cost."""

    owner: object
    version: int
    inputs: tuple[torch.Tensor, ...]
    args: tuple[torch.Tensor, ...]  # the leaves the graph starts from
    outputs: tuple[torch.Tensor, ...]
    nbytes: int
    created: float = field(default_factory=time.monotonic)


class _Meter:
    def __init__(self, exclude: set[int]):
        self.exclude = exclude  # storages not to count (the parameters)
        self.seen: set[int] = set()
        self.nbytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.count(tensor)
        return tensor

    def count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen.add(ptr)
            self.nbytes += storage.nbytes()

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class ActivationCache:
    """Forward graphs awaiting their backward, shared by several experts. Thread-safe."""

    def __init__(self, max_bytes: int, max_entries: int = 4096, max_age: float = 120.0):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_age = max_age
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: collections.OrderedDict[int, CachedForward] = collections.OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def measure(self, module: torch.nn.Module) -> Iterator[_Meter]:
        """Count the bytes autograd saves during the block (parameters excluded); call
        ``meter.count(t)`` for other tensors the entry will keep (inputs, outputs)."""
        exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
        meter = _Meter(exclude)
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            yield meter

    def put(self, entry: CachedForward) -> None:
        if entry.nbytes > self.max_bytes or self.max_entries < 1:
            return
        with self._lock:
            self._entries[next(self._ids)] = entry
            self.nbytes += entry.nbytes
            too_old = entry.created - self.max_age
            while self._entries and (
                self.nbytes > self.max_bytes
                or len(self._entries) > self.max_entries
                or next(iter(self._entries.values())).created < too_old
            ):
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
                self.evictions += 1

    def take(
        self, owner: object, version: int, inputs: Sequence[torch.Tensor]
    ) -> CachedForward | None:
        """Remove and return the graph of a forward with exactly these inputs at this
        weights version, or None."""
        with self._lock:
            candidates = [
                (key, e)
                for key, e in self._entries.items()
                if e.owner is owner and e.version == version and _same_layout(e.inputs, inputs)
            ]
        for key, entry in reversed(candidates):  # newest first
            if all(torch.equal(a, b) for a, b in zip(entry.inputs, inputs, strict=True)):
                with self._lock:
                    if self._entries.pop(key, None) is None:
                        continue  # taken by someone else meanwhile
                    self.nbytes -= entry.nbytes
                    self.hits += 1
                return entry
        with self._lock:
            self.misses += 1
        return None

    def discard(self, owner: object, keep_version: int | None = None) -> None:
        """Drop ``owner``'s graphs (except those of ``keep_version``): its weights moved
        on, so they can never be used."""
        with self._lock:
            for key in [
                k
                for k, e in self._entries.items()
                if e.owner is owner and e.version != keep_version
            ]:
                self.nbytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


def _same_layout(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b, strict=True)
    )
