"""Owner side of a robust all-reduce: keep every sender's copy of a part, then apply an
:class:`~.rules.AggregationRule` once all senders delivered it (or were excluded).

Both this and :class:`~..allreduce.partition.TensorPartReducer` (which keeps only a
running sum) build on :class:`PartReducer`, the bookkeeping every owner-side reducer
shares; it lives here, not beside the plain reducer, because ``allreduce`` imports
``robust``. A robust rule needs all inputs at once, so this reducer holds ``senders x part``
values per part until the part is finished (memory: the span times the group size, for
the duration of a part). It also counts, per sender, the parts in which the rule limited
that sender's influence while most senders were not limited (``limited``): the evidence
for accountability. When most inputs are clipped, ``tau`` is simply small for this
data and nobody stands out, so nobody is blamed.

A part that fewer than ``rule.min_inputs`` senders delivered (the others excluded as
stalled or dead) is not aggregated: its future resolves to None and every member keeps
its own values for the span, since what is left may no longer hold an honest majority.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

import torch

from swarmgrad.averaging.robust.rules import AggregationRule
from swarmgrad.compression.serialized import dtype_name
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

__all__ = ["PartReducer", "RobustPartReducer"]

logger = logging.getLogger(__name__)


class PartReducer:
    """Owner side of one span: what every part reducer shares. ``part_specs`` lists
    ``(numel, dtype)`` per part; senders are numbered ``0..num_senders-1``. Each sender
    contributes each part once; part ``k`` is finished when every sender has contributed
    it or has been excluded (:meth:`on_sender_failed`), and its future then resolves with
    :meth:`_reduce`'s result. Subclasses keep the inputs (:meth:`_add`) and reduce them;
    a subclass's ``__init__`` ends with :meth:`_finish_ready` (no senders: all finished)."""

    min_inputs = 1  # fewer delivered inputs leave a part unreduced

    def __init__(self, part_specs: Sequence[tuple[int, torch.dtype]], num_senders: int):
        if num_senders < 0:
            raise ValidationError(f"num_senders must be >= 0, got {num_senders}")
        self.part_specs = [(int(numel), dtype) for numel, dtype in part_specs]
        self.num_senders = num_senders
        loop = asyncio.get_running_loop()
        self._futures = [loop.create_future() for _ in self.part_specs]
        self._contributed: list[set[int]] = [set() for _ in self.part_specs]
        self._failed: set[int] = set()
        self._pending = len(self.part_specs)
        self._all_done = loop.create_future()
        self.contributions = [0] * num_senders  # parts delivered per sender

    @property
    def num_parts(self) -> int:
        return len(self.part_specs)

    @property
    def failed_senders(self) -> frozenset[int]:
        return frozenset(self._failed)

    @property
    def finished(self) -> bool:
        return self._pending == 0

    def accumulate_part(
        self,
        sender_index: int,
        part_index: int,
        part: torch.Tensor,
        weight: float = 1.0,
        *,
        reuse: bool = False,
        borrow: bool = False,
    ) -> None:
        """Take ``part`` from a sender with its weight. ``reuse=True`` lets the reducer keep
        and overwrite ``part``'s memory (a freshly received buffer), saving a copy.
        ``borrow=True`` promises that ``part``'s memory stays unchanged until this part is
        finished (the owner's own values, written only after the round): the reducer may
        read it then instead of copying it now, and never writes to it."""
        if not 0 <= sender_index < self.num_senders:
            raise ValidationError(f"sender index {sender_index} not in [0, {self.num_senders})")
        if sender_index in self._failed:
            raise ProtocolViolation(f"sender {sender_index} was excluded from this round")
        if not 0 <= part_index < len(self.part_specs):
            raise ProtocolViolation(
                f"sender {sender_index} sent part {part_index}, but this span has only "
                f"{len(self.part_specs)} parts (more data than its share)"
            )
        numel, dtype = self.part_specs[part_index]
        if part.numel() != numel or part.dtype != dtype:
            raise ProtocolViolation(
                f"sender {sender_index}: part {part_index} must be {numel} {dtype_name(dtype)} "
                f"values, got {part.numel()} {dtype_name(part.dtype)}"
            )
        if not (math.isfinite(weight) and weight >= 0):
            raise ValidationError(f"sender {sender_index}: weight must be finite and >= 0")
        if self._futures[part_index].done():
            raise ProtocolViolation(f"part {part_index} is already finished")
        if sender_index in self._contributed[part_index]:
            raise ProtocolViolation(f"sender {sender_index} sent part {part_index} twice")
        if reuse and borrow:
            raise ValidationError("a part is either reused (ours to overwrite) or borrowed")
        self._add(sender_index, part_index, part, float(weight), reuse, borrow)
        self._contributed[part_index].add(sender_index)
        self.contributions[sender_index] += 1
        self._maybe_finish(part_index)

    def on_sender_failed(self, sender_index: int) -> None:
        """Stop waiting for this sender; parts it already delivered stay in."""
        if sender_index in self._failed or not 0 <= sender_index < self.num_senders:
            return
        self._failed.add(sender_index)
        self._finish_ready()

    def part_future(self, part_index: int) -> asyncio.Future:
        """Resolves with the reduced part (or None); cancelled by :meth:`cancel`."""
        return self._futures[part_index]

    async def wait_part(self, part_index: int) -> torch.Tensor | None:
        return await asyncio.shield(self._futures[part_index])

    async def wait_all(self) -> None:
        await asyncio.shield(self._all_done)

    def cancel(self) -> None:
        """Give up: unfinished parts are cancelled (waiters see CancelledError)."""
        for future in self._futures:
            if not future.done():
                future.cancel()
        if not self._all_done.done():
            self._all_done.cancel()

    def _add(
        self,
        sender_index: int,
        part_index: int,
        part: torch.Tensor,
        weight: float,
        reuse: bool,
        borrow: bool = False,
    ) -> None:
        """Keep a validated input (a subclass's job; see :meth:`accumulate_part` for
        ``reuse`` and ``borrow``)."""
        raise NotImplementedError

    def _reduce(self, part_index: int) -> torch.Tensor | None:
        """The result of a part all senders delivered or were excluded from; None if
        nobody delivered it (a subclass's job)."""
        raise NotImplementedError

    def _finish_ready(self) -> None:
        for index in range(len(self.part_specs)):
            self._maybe_finish(index)

    def _maybe_finish(self, part_index: int) -> None:
        future = self._futures[part_index]
        if future.done() or len(self._contributed[part_index] | self._failed) < self.num_senders:
            return
        future.set_result(self._reduce(part_index))
        self._pending -= 1
        if self._pending == 0 and not self._all_done.done():
            self._all_done.set_result(None)


class RobustPartReducer(PartReducer):
    """``RobustPartReducer(part_specs, num_senders, rule)``; see the module docstring."""

    def __init__(
        self, part_specs: Sequence[tuple[int, torch.dtype]], num_senders: int, rule: AggregationRule
    ):
        super().__init__(part_specs, num_senders)
        self.rule = rule
        self._inputs: list[dict[int, tuple[torch.Tensor, float]]] = [{} for _ in self.part_specs]
        self.limited = [0] * num_senders  # parts in which the rule clipped or trimmed them
        self.short_parts = 0  # parts left unaggregated: fewer inputs than rule.min_inputs
        self._finish_ready()

    @property
    def min_inputs(self) -> int:  # type: ignore[override]
        return self.rule.min_inputs

    def _add(
        self,
        sender_index: int,
        part_index: int,
        part: torch.Tensor,
        weight: float,
        reuse: bool,
        borrow: bool = False,
    ) -> None:
        dtype = self.part_specs[part_index][1]
        work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        values = part.reshape(-1)
        # a borrowed part is only read (stacked when the part is finished): no copy
        if not (reuse or borrow) or values.dtype != work_dtype:
            values = values.to(work_dtype, copy=True)
        self._inputs[part_index][sender_index] = (values, weight)

    def _reduce(self, part_index: int) -> torch.Tensor | None:
        inputs = self._inputs[part_index]
        self._inputs[part_index] = {}
        result = None
        if 0 < len(inputs) < self.rule.min_inputs:
            self.short_parts += 1
            logger.info(
                "robust reducer: part %d not aggregated: %d of %d senders delivered it, the "
                "rule needs %d (%s); the span stays local",
                part_index, len(inputs), self.num_senders, self.rule.min_inputs, self.rule.tag,
            )  # fmt: skip
        elif inputs:
            senders = sorted(inputs)
            stack = torch.stack([inputs[s][0] for s in senders])
            weights = torch.tensor([inputs[s][1] for s in senders], dtype=stack.dtype)
            aggregated, limited = self.rule.aggregate(stack, weights)
            if sum(limited) * 2 <= len(senders):  # at most half stood out: evidence
                for sender, was_limited in zip(senders, limited, strict=True):
                    self.limited[sender] += int(was_limited)
            result = aggregated.to(self.part_specs[part_index][1])
        return result
