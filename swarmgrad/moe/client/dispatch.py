"""Sending a batch to the experts its samples chose, and collecting what comes back.

This is where the mixture-of-experts layers beat one-request-per-sample designs: the
samples that chose the same expert travel to it as **one** sub-batch, and the requests to
all chosen experts run concurrently. Waiting follows hivemind's rules:

- ``k_min``: wait until every sample has at least ``k_min`` answers (or nothing left in
  flight for it), then up to ``timeout_after_k_min`` more for the stragglers;
- the overall deadline cuts everything still running; what did not answer is dropped;
- ``detect_anomalies`` drops answers with NaN or infinite values, row by row;
- a sample whose chosen experts *all* failed falls back on the next best experts of its
  beam (a bounded number of attempts), sent together with the other samples that fell
  back in the same moment.

Backward calls follow the same rules, without the fallback (a gradient must come from the
expert that computed the output); a failed one contributes no gradient.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmgrad.moe.expert_uid import ExpertInfo, ExpertUID
from swarmgrad.utils.errors import SwarmgradError

from .caller import ExpertCaller, ExpertSchema
from .health import SERVER_HEALTH, ServerHealth

__all__ = [
    "Answer",
    "CallerPool",
    "ForwardOutcome",
    "NoExpertsAnswered",
    "backward_from_experts",
    "forward_to_experts",
]


class NoExpertsAnswered(SwarmgradError, RuntimeError):
    """Some samples got no usable answer from any expert they chose or fell back on."""


class CallerPool:
    """An :class:`ExpertCaller` per uid, kept across batches (their cached connections,
    server rotation and addresses), refreshed when the DHT lists other servers."""

    def __init__(self, peer_source: Any, timeout: float, maxsize: int = 4096):
        self.peer_source, self.timeout, self.maxsize = peer_source, timeout, maxsize
        self._callers: collections.OrderedDict[ExpertUID, ExpertCaller] = collections.OrderedDict()

    def get(self, info: ExpertInfo) -> ExpertCaller:
        caller = self._callers.get(info.uid)
        if caller is None:
            caller = ExpertCaller(info, self.peer_source, timeout=self.timeout)
            self._callers[info.uid] = caller
            if len(self._callers) > self.maxsize:
                self._callers.popitem(last=False)
        elif caller.expert_info is not info:
            caller.update(info)
        return caller


@dataclass
class Answer:
    """Outputs of one expert for some samples (rows aligned with ``samples``)."""

    caller: ExpertCaller
    samples: list[int]
    tensors: list[torch.Tensor]


@dataclass
class ForwardOutcome:
    answers: list[Answer]
    answered: list[int]  # per sample: how many experts answered it
    failures: list[list[str]] = field(default_factory=list)  # per sample: what went wrong

    def unanswered(self) -> list[int]:
        return [s for s, count in enumerate(self.answered) if count == 0]

    def describe_failures(self, samples: Sequence[int], limit: int = 4) -> str:
        """A short account of why ``samples`` got no answer, most frequent reasons first."""
        reasons = collections.Counter(r for s in samples for r in self.failures[s])
        if not reasons:
            return "no live expert was found for them"
        shown = [f"{reason} (x{count})" for reason, count in reasons.most_common(limit)]
        more = len(reasons) - limit
        return "; ".join(shown) + (f"; and {more} other reasons" if more > 0 else "")


class _Quorum:
    """Per-sample answer and in-flight counts, and how many samples still wait for
    ``k_min`` answers with calls in flight (kept incrementally: the check runs on every
    completed call)."""

    def __init__(self, num_samples: int, k_min: int):
        self.k_min = k_min
        self.successes = [0] * num_samples
        self.pending = [0] * num_samples
        self.unsatisfied = 0

    def _waits(self, s: int) -> bool:
        return self.successes[s] < self.k_min and self.pending[s] > 0

    def change(self, s: int, successes: int, pending: int) -> None:
        before = self._waits(s)
        self.successes[s] += successes
        self.pending[s] += pending
        self.unsatisfied += self._waits(s) - before


@dataclass(frozen=True)
class _WaitRules:
    """The rules of the module docstring that forward and backward calls share."""

    k_min: int
    deadline: float | None
    timeout_after_k_min: float | None
    detect_anomalies: bool


class _Collector:
    """Runs tasks until the quorum rules say stop; subclasses say what a result means."""

    def __init__(self, num_samples: int, rules: _WaitRules):
        self.loop = asyncio.get_running_loop()
        self.quorum = _Quorum(num_samples, rules.k_min)
        self.deadline, self.timeout_after_k_min = rules.deadline, rules.timeout_after_k_min
        self.detect_anomalies = rules.detect_anomalies
        self.tasks: dict[asyncio.Task, tuple[ExpertCaller, list[int]]] = {}

    def call_timeout(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - self.loop.time(), 0.0)

    def start(self, caller: ExpertCaller, samples: list[int], coro: Any) -> None:
        self.tasks[self.loop.create_task(coro)] = (caller, samples)
        for s in samples:
            self.quorum.change(s, 0, 1)

    def on_result(self, caller: ExpertCaller, samples: list[int], task: asyncio.Task) -> None:
        raise NotImplementedError

    def on_round_end(self) -> None:
        """After each wake-up's results: a chance to send fallback calls together."""

    def on_timeout(self, caller: ExpertCaller, samples: list[int]) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        stop_after: float | None = None
        try:
            while self.tasks:
                wake = self.deadline
                if stop_after is not None:
                    wake = stop_after if wake is None else min(wake, stop_after)
                timeout = None if wake is None or math.isinf(wake) else wake - self.loop.time()
                if timeout is not None and timeout <= 0:
                    break
                done, _ = await asyncio.wait(
                    self.tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break
                for task in done:
                    caller, samples = self.tasks.pop(task)
                    for s in samples:
                        self.quorum.change(s, 0, -1)
                    self.on_result(caller, samples, task)
                self.on_round_end()
                if stop_after is None and self.quorum.unsatisfied == 0:
                    after = self.timeout_after_k_min
                    stop_after = math.inf if after is None else self.loop.time() + after
        finally:
            leftover = list(self.tasks.items())
            self.tasks.clear()
            for task, _ in leftover:
                task.cancel()
            if leftover:
                await asyncio.gather(*(task for task, _ in leftover), return_exceptions=True)
            for _, (caller, samples) in leftover:
                for s in samples:
                    self.quorum.change(s, 0, -1)
                self.on_timeout(caller, samples)


def _rows(tensors: Sequence[torch.Tensor], samples: list[int], batch_size: int):
    if len(samples) == batch_size:  # samples are in increasing order: all of them
        return list(tensors)
    index = torch.tensor(samples, dtype=torch.long)
    return [t.index_select(0, index) for t in tensors]


def _finite_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A bool mask of rows finite in every tensor, or None when all are."""
    mask = None
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            rows = torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
            mask = rows if mask is None else mask & rows
    return None if mask is None or bool(mask.all()) else mask


def _error(task: asyncio.Task) -> BaseException | None:
    return asyncio.CancelledError("cancelled") if task.cancelled() else task.exception()


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _ForwardCollector(_Collector):
    def __init__(
        self,
        candidates: list[list[ExpertInfo]],
        inputs: list[torch.Tensor],
        pool: CallerPool,
        schema: ExpertSchema,
        rules: _WaitRules,
        *,
        k_best: int,
        max_attempts: int,
        health: ServerHealth,
    ):
        super().__init__(len(candidates), rules)
        self.candidates, self.inputs, self.pool, self.schema = candidates, inputs, pool, schema
        self.k_best, self.max_attempts, self.health = k_best, max_attempts, health
        self.positions = [0] * len(candidates)
        self.attempts = [0] * len(candidates)
        self.answers: list[Answer] = []
        self.failures: list[list[str]] = [[] for _ in candidates]
        self.falling_back: list[int] = []

    def choose(self, s: int) -> list[ExpertInfo]:
        """The next up to ``k_best`` experts for sample ``s``, skipping those whose every
        server failed recently (unless that would leave a first attempt with none)."""
        candidates, pos = self.candidates[s], self.positions[s]
        chosen, skipped = [], []
        while len(chosen) < self.k_best and pos < len(candidates):
            info = candidates[pos]
            pos += 1
            if any(self.health.is_healthy(server.peer_id) for server in info.servers):
                chosen.append(info)
            else:
                skipped.append(info)
        if not chosen and self.attempts[s] == 0:
            chosen = skipped[: self.k_best]
        elif skipped:
            self.failures[s].extend(f"{i.uid}: its servers failed recently" for i in skipped)
        self.positions[s] = pos
        self.attempts[s] += 1
        return chosen

    def send(self, samples: list[int]) -> None:
        groups: dict[ExpertUID, tuple[ExpertInfo, list[int]]] = {}
        for s in samples:
            for info in self.choose(s):
                groups.setdefault(info.uid, (info, []))[1].append(s)
        batch_size = len(self.candidates)
        for info, members in groups.values():
            caller = self.pool.get(info)
            sub_inputs = _rows(self.inputs, members, batch_size)
            call = caller.forward(sub_inputs, timeout=self.call_timeout(), schema=self.schema)
            self.start(caller, members, call)

    def on_result(self, caller: ExpertCaller, samples: list[int], task: asyncio.Task) -> None:
        error = _error(task)
        if error is not None:
            reason = f"{caller.uid}: {_reason(error)}"
            for s in samples:
                self.failures[s].append(reason)
        else:
            kept, outputs = samples, task.result()
            finite = _finite_rows(outputs) if self.detect_anomalies else None
            if finite is not None:
                for s, ok in zip(samples, finite.tolist(), strict=True):
                    if not ok:
                        self.failures[s].append(f"{caller.uid}: NaN or infinite outputs")
                keep = finite.nonzero().flatten()
                kept = [samples[i] for i in keep.tolist()]
                outputs = [t.index_select(0, keep) for t in outputs]
            if kept:
                self.answers.append(Answer(caller, kept, outputs))
                for s in kept:
                    self.quorum.change(s, 1, 0)
        quorum = self.quorum
        for s in samples:  # all of this sample's experts failed: fall back on the next ones
            if quorum.successes[s] == 0 and quorum.pending[s] == 0:
                if self.attempts[s] < self.max_attempts:
                    self.falling_back.append(s)

    def on_round_end(self) -> None:
        if self.falling_back:
            samples = sorted(set(self.falling_back))
            self.falling_back.clear()
            self.send(samples)

    def on_timeout(self, caller: ExpertCaller, samples: list[int]) -> None:
        for s in samples:
            self.failures[s].append(f"{caller.uid}: no answer in time")


async def forward_to_experts(
    candidates: list[list[ExpertInfo]],
    inputs: list[torch.Tensor],
    pool: CallerPool,
    schema: ExpertSchema,
    *,
    k_best: int,
    k_min: int,
    deadline: float | None,
    timeout_after_k_min: float | None,
    detect_anomalies: bool,
    max_attempts: int = 3,
    health: ServerHealth = SERVER_HEALTH,
) -> ForwardOutcome:
    """Send each sample to its first ``k_best`` candidates (best first), one request per
    expert, and collect the answers under the rules of the module docstring.

    ``candidates[s]`` is sample ``s``'s ranked experts; ``max_attempts`` bounds how many
    rounds of ``k_best`` experts a sample may try (the first one included) when all the
    experts of its previous round failed."""
    rules = _WaitRules(k_min, deadline, timeout_after_k_min, detect_anomalies)
    collector = _ForwardCollector(
        candidates,
        inputs,
        pool,
        schema,
        rules,
        k_best=k_best,
        max_attempts=max(max_attempts, 1),
        health=health,
    )
    collector.send([s for s, c in enumerate(candidates) if c])
    await collector.run()
    return ForwardOutcome(collector.answers, collector.quorum.successes, collector.failures)


class _BackwardCollector(_Collector):
    def __init__(self, num_samples: int, rules: _WaitRules):
        super().__init__(num_samples, rules)
        self.results: list[tuple[list[int], list[torch.Tensor]]] = []
        self.failures: list[str] = []

    def on_result(self, caller: ExpertCaller, samples: list[int], task: asyncio.Task) -> None:
        error = _error(task)
        if error is not None:
            self.failures.append(f"{caller.uid}: {_reason(error)}")
            return
        grads = task.result()
        finite = _finite_rows(grads) if self.detect_anomalies else None
        if finite is not None:
            self.failures.append(f"{caller.uid}: NaN or infinite gradients")
            keep = finite.nonzero().flatten()
            samples = [samples[i] for i in keep.tolist()]
            grads = [g.index_select(0, keep) for g in grads]
        if samples:
            self.results.append((samples, grads))
            for s in samples:
                self.quorum.change(s, 1, 0)

    def on_timeout(self, caller: ExpertCaller, samples: list[int]) -> None:
        self.failures.append(f"{caller.uid}: no answer in time")


async def backward_from_experts(
    jobs: Sequence[tuple[ExpertCaller, list[int], list[torch.Tensor], list[torch.Tensor]]],
    num_samples: int,
    schema: ExpertSchema,
    *,
    k_min: int,
    deadline: float | None,
    timeout_after_k_min: float | None,
    detect_anomalies: bool,
) -> tuple[list[tuple[list[int], list[torch.Tensor]]], list[str]]:
    """Send each ``(caller, samples, inputs, grad_outputs)`` job as one backward request;
    return the (samples, input gradients) that came back and what failed."""
    rules = _WaitRules(k_min, deadline, timeout_after_k_min, detect_anomalies)
    collector = _BackwardCollector(num_samples, rules)
    for caller, samples, inputs, grad_outputs in jobs:
        call = caller.backward(
            inputs, grad_outputs, timeout=collector.call_timeout(), schema=schema
        )
        collector.start(caller, samples, call)
    await collector.run()
    return collector.results, collector.failures
