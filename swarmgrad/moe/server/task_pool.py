"""Queues of expert requests that the runtime turns into batches.

Every expert has two pools, one for forward and one for backward requests. A request
(a *task*) is submitted on the event loop and gets an asyncio future; the runtime's
device thread takes whole batches out of a pool, runs them, and resolves the futures back
on their loop. The pool itself does no computation and never blocks the loop: submitting
takes the runtime's lock only long enough to append to a deque.

Batching rules (see :meth:`TaskPool.take_batch`): tasks leave a pool in arrival order,
a batch never holds more than ``max_batch_size`` samples, and a pool is ready when it
holds ``min_batch_size`` samples or its oldest task has waited ``timeout`` seconds. At most
``max_queued_samples`` (default: 16 full batches) wait in a pool; a request beyond that is
refused at once with :class:`ExpertOverloaded`, so clients move on to other experts.

A pool may let the runtime run a lone cheap batch on the event loop itself (see
:class:`~swarmgrad.moe.server.runtime.Runtime`): its owner gives it the expert's ``lock``
and ``may_run_inline``, which says whether the expert may run there now (a CPU expert).
Pools without ``may_run_inline`` always go through the device thread.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import SwarmgradError, ValidationError

if TYPE_CHECKING:
    from swarmgrad.moe.server.runtime import Runtime

__all__ = ["ExpertFailure", "ExpertOverloaded", "PoolStats", "Task", "TaskPool"]

#: how many recent batch sizes a pool remembers for statistics and tests
RECENT_BATCHES = 1024
#: default bound on waiting samples, in full batches: a queue longer than this only adds
#: latency for its callers, and without a bound many callers (or many identities of one)
#: could make a server hold any amount of request memory
QUEUED_BATCHES = 16
#: how many recent batch times a pool keeps to decide whether a batch may run on the loop
RECENT_TIMES = 5


class ExpertFailure(SwarmgradError):
    """An expert could not compute a batch (its module raised, or the server is stopping).
    Every request of the batch receives it; the server keeps running."""


class ExpertOverloaded(ExpertFailure):
    """An expert's queue is full: the request was refused before it was queued."""


@dataclass(eq=False)
class Task:
    """One request: its tensors, its sample count and the future that gets its result."""

    future: asyncio.Future
    args: tuple[torch.Tensor, ...]
    size: int
    created: float = field(default_factory=time.monotonic)


@dataclass
class PoolStats:
    """Counters of one pool (read by stats reports and tests; written by the runtime)."""

    batches: int = 0
    samples: int = 0
    requests: int = 0
    failed_batches: int = 0
    largest_batch: int = 0
    busy_seconds: float = 0.0
    recent_batch_sizes: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_BATCHES)
    )
    recent_batch_requests: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_BATCHES)
    )
    #: batches run on the event loop rather than the device thread (counted in ``batches``)
    inline_batches: int = 0
    #: seconds the last few batches took (wall time), newest last
    recent_batch_seconds: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_TIMES)
    )


class TaskPool:
    """Requests for one function (an expert's forward or backward), batched on demand.

    ``process_func(*batched_args)`` returns a tuple of tensors whose first dimension is the
    batch; the runtime splits them back per request. ``name`` appears in logs and errors
    (``"ffn.0.3_forward"``).
    """

    def __init__(
        self,
        process_func: Callable[..., Sequence[torch.Tensor]],
        max_batch_size: int,
        name: str,
        min_batch_size: int = 1,
        timeout: float = 0.05,
        max_queued_samples: int | None = None,
        *,
        lock: threading.RLock | None = None,
        may_run_inline: Callable[[], bool] | None = None,
    ):
        positive_int(f"pool {name}: max_batch_size", max_batch_size)
        if not isinstance(min_batch_size, int) or not 1 <= min_batch_size <= max_batch_size:
            raise ValidationError(
                f"pool {name}: min_batch_size must be in [1, max_batch_size={max_batch_size}], "
                f"got {min_batch_size}"
            )
        if timeout < 0:
            raise ValidationError(f"pool {name}: timeout must be >= 0, got {timeout}")
        if max_queued_samples is None:
            max_queued_samples = QUEUED_BATCHES * max_batch_size
        if not isinstance(max_queued_samples, int) or max_queued_samples < max_batch_size:
            raise ValidationError(
                f"pool {name}: max_queued_samples must be an integer >= max_batch_size="
                f"{max_batch_size}, got {max_queued_samples!r}"
            )
        self.max_queued_samples = max_queued_samples
        self.process_func = process_func
        self.name = name
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.timeout = timeout
        self.stats = PoolStats()
        self.lock = lock  # what the computation holds; the loop only ever try-acquires it
        self.may_run_inline = may_run_inline
        # guarded by the runtime's lock
        self.tasks: collections.deque[Task] = collections.deque()
        self.queued_samples = 0
        self.runtime: Runtime | None = None
        self.inline_pending = False  # a run on the loop is scheduled for this pool

    def __repr__(self) -> str:
        return f"TaskPool({self.name!r}, pending={len(self.tasks)})"

    # ------------------------------------------------------------------ event loop side

    def submit_task(self, *args: torch.Tensor, size: int | None = None) -> asyncio.Future:
        """Queue one request (call on the event loop); the future resolves to the tuple of
        this request's output tensors, or to the error its batch raised."""
        if size is None:
            size = args[0].shape[0] if args and args[0].ndim else 1
        if size > self.max_batch_size:
            raise ValidationError(
                f"{self.name}: a request of {size} samples exceeds max_batch_size="
                f"{self.max_batch_size}; split it into smaller requests"
            )
        if self.queued_samples + size > self.max_queued_samples:
            raise ExpertOverloaded(
                f"{self.name}: {self.queued_samples} samples already wait (at most "
                f"{self.max_queued_samples}); try another expert or later"
            )
        runtime = self.runtime
        if runtime is None:
            raise ExpertFailure(f"{self.name}: the server's runtime is not running")
        future = asyncio.get_running_loop().create_future()
        runtime.enqueue(self, Task(future, args, size))
        return future

    @property
    def num_pending(self) -> int:
        """Requests waiting for a batch (approximate when read outside the runtime)."""
        return len(self.tasks)

    # ------------------------------------------------------------------ runtime side
    # (the runtime holds its lock while calling these)

    def oldest(self) -> float | None:
        return self.tasks[0].created if self.tasks else None

    def ready_at(self) -> float:
        """When this non-empty pool may form a batch (monotonic time; <= now: ready)."""
        if self.queued_samples >= self.min_batch_size:
            return 0.0
        return self.tasks[0].created + self.timeout

    def take_batch(self) -> list[Task]:
        """Remove the oldest tasks that fit in one batch; cancelled ones are dropped."""
        batch: list[Task] = []
        total = 0
        while self.tasks:
            task = self.tasks[0]
            if task.future.done():  # the caller gave up (cancelled) meanwhile
                self.tasks.popleft()
                self.queued_samples -= task.size
                continue
            if batch and total + task.size > self.max_batch_size:
                break
            self.tasks.popleft()
            self.queued_samples -= task.size
            batch.append(task)
            total += task.size
        return batch

    def drain(self) -> list[Task]:
        tasks = list(self.tasks)
        self.tasks.clear()
        self.queued_samples = 0
        return tasks

    def record(
        self,
        batch_size: int,
        num_requests: int,
        seconds: float,
        failed: bool,
        inline: bool = False,
    ) -> None:
        stats = self.stats
        stats.recent_batch_seconds.append(seconds)
        stats.inline_batches += inline
        stats.batches += 1
        stats.samples += batch_size
        stats.requests += num_requests
        stats.failed_batches += failed
        stats.largest_batch = max(stats.largest_batch, batch_size)
        stats.busy_seconds += seconds
        stats.recent_batch_sizes.append(batch_size)
        stats.recent_batch_requests.append(num_requests)


def concat_args(tasks: Sequence[Task]) -> tuple[Any, ...]:
    """The batch's arguments: a single request's tensors as they are (no copy), several
    requests' tensors concatenated along the batch dimension."""
    if len(tasks) == 1:
        return tasks[0].args
    return tuple(torch.cat(parts) for parts in zip(*(t.args for t in tasks), strict=True))


def split_outputs(
    outputs: Sequence[torch.Tensor], tasks: Sequence[Task]
) -> list[tuple[torch.Tensor, ...]]:
    """Each request's slice of the batch outputs (views, no copies)."""
    if len(tasks) == 1:
        return [tuple(outputs)]
    sizes = [t.size for t in tasks]
    pieces = [torch.split(output, sizes) for output in outputs]
    return [tuple(piece[i] for piece in pieces) for i in range(len(tasks))]
