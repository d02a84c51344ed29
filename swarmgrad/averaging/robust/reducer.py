"""Owner side of a robust all-reduce: keep every sender's copy of a part, then apply an
:class:`~.rules.AggregationRule` once all senders delivered it (or were excluded).

The same interface as :class:`~..allreduce.partition.TensorPartReducer`, which keeps only a running
sum: a robust rule needs all inputs at once, so this reducer holds ``senders x part``
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
from collections.abc import Sequence

import torch

from swarmgrad.averaging.robust.rules import AggregationRule
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

__all__ = ["RobustPartReducer"]

logger = logging.getLogger(__name__)


class RobustPartReducer:
    """``RobustPartReducer(part_specs, num_senders, rule)``; see the module docstring."""

    def __init__(
        self, part_specs: Sequence[tuple[int, torch.dtype]], num_senders: int, rule: AggregationRule
    ):
        if num_senders < 0:
            raise ValidationError(f"num_senders must be >= 0, got {num_senders}")
        self.part_specs = [(int(numel), dtype) for numel, dtype in part_specs]
        self.num_senders = num_senders
        self.rule = rule
        loop = asyncio.get_running_loop()
        self._futures = [loop.create_future() for _ in self.part_specs]
        self._inputs: list[dict[int, tuple[torch.Tensor, float]]] = [{} for _ in self.part_specs]
        self._failed: set[int] = set()
        self._pending = len(self.part_specs)
        self._all_done = loop.create_future()
        self.contributions = [0] * num_senders
        self.limited = [0] * num_senders  # parts in which the rule clipped or trimmed them
        self.short_parts = 0  # parts left unaggregated: fewer inputs than rule.min_inputs
        for index in range(len(self.part_specs)):
            self._maybe_finish(index)

    @property
    def min_inputs(self) -> int:
        return self.rule.min_inputs

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
    ) -> None:
        """Keep ``part`` from a sender (``reuse=True``: its memory may be kept as is)."""
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
                f"sender {sender_index}: part {part_index} must be {numel} {dtype} values, "
                f"got {part.numel()} {part.dtype}"
            )
        if not weight >= 0 or weight == float("inf"):
            raise ValidationError(f"sender {sender_index}: weight must be finite and >= 0")
        inputs = self._inputs[part_index]
        if sender_index in inputs:
            raise ProtocolViolation(f"sender {sender_index} sent part {part_index} twice")
        if self._futures[part_index].done():
            raise ProtocolViolation(f"part {part_index} is already finished")
        work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        values = part.reshape(-1)
        if not reuse or values.dtype != work_dtype:
            values = values.to(work_dtype, copy=True)
        inputs[sender_index] = (values, float(weight))
        self.contributions[sender_index] += 1
        self._maybe_finish(part_index)

    def on_sender_failed(self, sender_index: int) -> None:
        """Stop waiting for this sender; parts it already delivered stay in."""
        if sender_index in self._failed or not 0 <= sender_index < self.num_senders:
            return
        self._failed.add(sender_index)
        for index in range(len(self.part_specs)):
            self._maybe_finish(index)

    def part_future(self, part_index: int) -> asyncio.Future:
        return self._futures[part_index]

    async def wait_part(self, part_index: int) -> torch.Tensor | None:
        return await asyncio.shield(self._futures[part_index])

    async def wait_all(self) -> None:
        await asyncio.shield(self._all_done)

    def cancel(self) -> None:
        for future in self._futures:
            if not future.done():
                future.cancel()
        if not self._all_done.done():
            self._all_done.cancel()

    def _maybe_finish(self, part_index: int) -> None:
        future = self._futures[part_index]
        inputs = self._inputs[part_index]
        if future.done() or len(set(inputs) | self._failed) < self.num_senders:
            return
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
        self._inputs[part_index] = {}
        future.set_result(result)
        self._pending -= 1
        if self._pending == 0 and not self._all_done.done():
            self._all_done.set_result(None)
