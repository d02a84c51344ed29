"""Types shared by the all-reduce and those who plan, run and account for it: modes,
results and the errors a round can end with. Kept apart from the runner so that small
modules (round plans, step control, offender logs) need not import it."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

__all__ = [
    "MAX_WEIGHT",
    "AllReduceResult",
    "AveragingMode",
    "BadReduction",
    "GroupMismatch",
    "UnknownGroup",
    "check_weight",
]

# Weights are relative, so a bound costs nothing. Owners sum weight * part in float32 for
# float16/bfloat16/float32 tensors: a weight beyond float32's range (3.4e38) makes torch
# raise mid-round, and one near it turns the sum into Inf and the average into NaN. 1e30
# leaves eight orders of magnitude for the values themselves.
MAX_WEIGHT = 1e30


def check_weight(weight: Any) -> float:
    """A member's weight as a float: a finite number in ``[0, MAX_WEIGHT]`` (bools refused)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValidationError(f"weight must be a number, got {weight!r}")
    if not math.isfinite(weight) or not 0 <= weight <= MAX_WEIGHT:
        raise ValidationError(
            f"weight must be finite and >= 0, at most {MAX_WEIGHT:g}; got {weight!r}"
        )
    return float(weight)


class AveragingMode(enum.Enum):
    NODE = 0
    CLIENT = 1
    AUX = 2


class GroupMismatch(ValidationError):
    """Members disagree on what they average: tensor shapes or dtypes, spans, part size."""


class BadReduction(ProtocolViolation):
    """A span's owner returned a result that fails the robust rule's check."""


class UnknownGroup(ValidationError):
    """Parts arrived for a group this peer does not average in (or no longer does)."""


@dataclass(frozen=True)
class AllReduceResult:
    """What one round did to the local tensors, and who was dropped and why."""

    group_id: bytes
    averaged_spans: frozenset[int]  # spans now holding the group's average
    local_spans: frozenset[int]  # non-empty spans that kept their local values
    excluded_senders: dict[PeerID, str] = field(default_factory=dict)  # from our span
    failed_reducers: dict[PeerID, str] = field(default_factory=dict)  # spans kept local
    deadline_exceeded: bool = False
    # robust aggregation: per sender, the parts of our span in which the rule clipped or
    # trimmed its input (evidence for accountability; empty with the plain mean)
    limited_senders: dict[PeerID, int] = field(default_factory=dict)
    bad_reducers: frozenset[PeerID] = frozenset()  # spans whose result failed the check
    # other members whose inputs our span's reduction used (the rounds that count as
    # "seen" for accountability's window, see offenders.py)
    contributors: frozenset[PeerID] = frozenset()
    paced_bytes: int = 0  # what this peer wrote through the round's send pacer

    @property
    def fully_averaged(self) -> bool:
        return not self.local_spans and not self.excluded_senders
