"""A formed group's round as a custom ``aggregate`` hook sees it (:class:`AveragingRound`,
one all-reduce per named phase), and the check every averaged tensor passes."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from swarmgrad.averaging.allreduce.partition import check_tensors
from swarmgrad.averaging.allreduce.round_plan import RoundPlan
from swarmgrad.averaging.allreduce.types import AllReduceResult, AveragingMode
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.utils.errors import ValidationError

if TYPE_CHECKING:
    from swarmgrad.averaging.averager_core import AsyncDecentralizedAverager

__all__ = ["AveragingRound", "PhaseResult", "check_averaged_tensors"]

_PHASE_TAG = b"swarmgrad.averaging.phase:"
_PHASE_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def check_averaged_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as given, after checking that they can be averaged in place (see
    :func:`~.allreduce.partition.check_tensors`) and are leaves with elements."""
    checked = check_tensors(tensors, "averaged_tensors")
    for i, tensor in enumerate(checked):
        if tensor.grad_fn is not None:
            raise ValidationError(
                f"averaged tensor {i} is the result of an operation (it has a grad_fn); "
                "pass parameters or other leaf tensors"
            )
    # With nothing to average every round "averages nothing with anyone", so each step
    # would search and fail until its timeout: refuse it here, where the mistake is.
    if sum(tensor.numel() for tensor in checked) == 0:
        raise ValidationError(
            f"averaged_tensors hold no elements ({len(checked)} tensors): nothing to average"
        )
    return checked


@dataclass(frozen=True)
class PhaseResult:
    """One all-reduce of an :class:`AveragingRound`: what the runner did, and for each
    tensor of the phase whether it now holds the group's average in full (every span it
    overlaps was averaged; always False on an auxiliary peer, whose tensors never
    change). Members that hold a tensor in full hold the same values."""

    result: AllReduceResult
    averaged: tuple[bool, ...]


class AveragingRound:
    """A formed group, handed to a custom ``aggregate`` coroutine (see
    :class:`AsyncDecentralizedAverager`) while the averaged tensors' lock is held.

    ``tensors`` are the averager's tensors; ``weight`` is the step's weight;
    ``contributes`` is False on an auxiliary peer. :meth:`allreduce` averages any
    tensors (the same shapes and dtypes on every member) in this group; each call is a
    *phase* with a name unique within the round, which every member must run in the
    same order with the same tensor shapes. Phases share the round's deadline and use
    the averager's part size, codec and ``averaging_alpha``.

    A member that has not yet started a phase when another member's parts for it
    arrive is waited for (the router's grace, a few seconds); one that never starts it
    is dropped from that phase like a failed member, so a member that skips a phase
    costs the others only its spans of that phase.
    """

    def __init__(
        self,
        core: AsyncDecentralizedAverager,
        plan: RoundPlan,
        weight: float,
        deadline: float | None,
    ):
        self._core = core
        self.plan = plan
        self.weight = float(weight)
        self.contributes = core.mode is not AveragingMode.AUX
        self.tensors: Sequence[torch.Tensor] = tuple(core._detached)
        self._deadline = deadline
        self._phases: dict[str, PhaseResult | None] = {}

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, phase: str, weight: float | None = None
    ) -> PhaseResult:
        """Average ``tensors`` in place in this group with ``weight`` (default: the
        round's). Spans that could not be averaged keep their local values."""
        if not isinstance(phase, str) or not _PHASE_NAME.fullmatch(phase):
            raise ValidationError(f"phase must be 1-32 letters, digits, '_' or '-', got {phase!r}")
        if phase in self._phases:
            raise ValidationError(f"phase {phase!r} already ran in this round")
        self._phases[phase] = None
        tensors = check_averaged_tensors(tensors)
        plan, group = self.plan, self.plan.group
        digest = hashlib.sha256(_PHASE_TAG + group.group_id + phase.encode()).digest()
        phase_group = GroupInfo(digest[: len(group.group_id)], group.peer_ids, group.gathered)
        spans = plan.span_sizes_for(sum(t.numel() for t in tensors), self._core.min_vector_size)
        budget = None
        if self._deadline is not None:
            budget = self._deadline - asyncio.get_running_loop().time()
        if budget is not None and budget <= 0:
            result = AllReduceResult(
                group_id=phase_group.group_id,
                averaged_spans=frozenset(),
                local_spans=frozenset(
                    j for j, size in enumerate(spans) if size and self.contributes
                ),
                deadline_exceeded=True,
            )
        else:
            weight = self.weight if weight is None else weight
            runner = self._core._runner(plan, phase_group, tensors, spans, weight, budget)
            result = await runner.run()
        averaged = (
            tensors_averaged(tensors, spans, result.averaged_spans)
            if self.contributes
            else (False,) * len(tensors)
        )
        outcome = PhaseResult(result, averaged)
        self._phases[phase] = outcome
        return outcome

    def merged_result(self) -> AllReduceResult | None:
        """The round as one result: a span counts as averaged if no phase kept it local
        and one averaged it. None if no phase ran."""
        results = [p.result for p in self._phases.values() if p is not None]
        if not results:
            return None
        local = frozenset().union(*(r.local_spans for r in results))
        averaged = frozenset().union(*(r.averaged_spans for r in results)) - local
        excluded: dict[Any, str] = {}
        failed: dict[Any, str] = {}
        for r in results:
            for peer_id, why in r.excluded_senders.items():
                excluded.setdefault(peer_id, why)
            for peer_id, why in r.failed_reducers.items():
                failed.setdefault(peer_id, why)
        return AllReduceResult(
            group_id=self.plan.group.group_id,
            averaged_spans=averaged,
            local_spans=local,
            excluded_senders=excluded,
            failed_reducers=failed,
            deadline_exceeded=any(r.deadline_exceeded for r in results),
            paced_bytes=sum(r.paced_bytes for r in results),
        )


def tensors_averaged(
    tensors: Sequence[torch.Tensor], spans: Sequence[int], averaged_spans: frozenset[int]
) -> tuple[bool, ...]:
    """For each tensor of a flat vector cut into ``spans``: do all the spans it overlaps
    hold the average?"""
    bounds, start = [], 0
    for j, size in enumerate(spans):
        bounds.append((start, start + size, j))
        start += size
    flags, offset = [], 0
    for tensor in tensors:
        end = offset + tensor.numel()
        flags.append(
            all(j in averaged_spans for lo, hi, j in bounds if hi > lo and lo < end and hi > offset)
        )
        offset = end
    return tuple(flags)
