"""Expert uid patterns such as ``"ffn.[0:32].[0:256]"`` and sampling uids from them.

A pattern is an expert name followed by one block per grid dimension, joined by ``.``;
a block is either a fixed coordinate (``"3"``) or a half-open range ``"[start:end]"``.
``"expert.[0:5]"`` means the uids ``expert.0`` ... ``expert.4``; ``"ffn.3.[0:8]"`` means
``ffn.3.0`` ... ``ffn.3.7``.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from swarmgrad.moe.expert_uid import UID_DELIMITER, ExpertUID, is_valid_uid
from swarmgrad.utils.errors import ValidationError

__all__ = ["ExpertPattern", "generate_uids_from_pattern", "parse_expert_pattern", "pattern_text"]

_RANGE = re.compile(r"^\[\s*(\d+)\s*:\s*(\d+)\s*\]$")
_COORD = re.compile(r"^(?:0|[1-9][0-9]*)$")
_NAME = re.compile(r"^[^.\s\[\]:]+$")
# grids at most this large are enumerated and shuffled instead of sampled coordinate-wise
_ENUMERATE_LIMIT = 1 << 16


@dataclass(frozen=True)
class ExpertPattern:
    """A parsed pattern: the name and, per grid dimension, the allowed coordinates."""

    name: str
    dims: tuple[range, ...]

    @property
    def grid_size(self) -> int:
        return math.prod(len(dim) for dim in self.dims)

    def uid(self, coords: Sequence[int]) -> ExpertUID:
        return UID_DELIMITER.join([self.name, *map(str, coords)])

    def __contains__(self, uid: object) -> bool:
        if not isinstance(uid, str) or not is_valid_uid(uid):
            return False
        name, *coords = uid.split(UID_DELIMITER)
        return (
            name == self.name
            and len(coords) == len(self.dims)
            and all(int(c) in dim for c, dim in zip(coords, self.dims, strict=True))
        )


def parse_expert_pattern(pattern: str) -> ExpertPattern:
    """Parse ``"name.[a:b].c..."``; a malformed pattern raises ValidationError saying
    which part is wrong and what a valid one looks like."""
    example = "for example 'expert.[0:32].[0:256]' or 'ffn.3.[0:8]'"
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValidationError(f"expert pattern {pattern!r} is empty; expected {example}")
    name, *blocks = pattern.strip().split(UID_DELIMITER)
    if not _NAME.fullmatch(name):
        raise ValidationError(
            f"expert pattern {pattern!r}: the name {name!r} must be non-empty and contain no "
            f"'.', ':', brackets or whitespace; expected {example}"
        )
    if not blocks:
        raise ValidationError(
            f"expert pattern {pattern!r} has no grid dimensions after the name; expected {example}"
        )
    dims = []
    for index, block in enumerate(blocks):
        match = _RANGE.fullmatch(block)
        if match:
            start, end = int(match.group(1)), int(match.group(2))
            if start >= end:
                raise ValidationError(
                    f"expert pattern {pattern!r}: dimension {index} range {block!r} is empty "
                    "(expected [start:end] with start < end)"
                )
            dims.append(range(start, end))
        elif _COORD.fullmatch(block):
            dims.append(range(int(block), int(block) + 1))
        else:
            raise ValidationError(
                f"expert pattern {pattern!r}: dimension {index} is {block!r}, expected an "
                f"integer coordinate or a range [start:end]; {example}"
            )
    return ExpertPattern(name, tuple(dims))


def generate_uids_from_pattern(
    num_experts: int,
    expert_pattern: str | ExpertPattern,
    *,
    exclude: Collection[ExpertUID] = (),
    rng: random.Random | None = None,
) -> list[ExpertUID]:
    """``num_experts`` distinct uids drawn uniformly from the pattern's grid, none of
    them in ``exclude``. Raises ValidationError when the grid has too few free uids."""
    pattern = (
        expert_pattern
        if isinstance(expert_pattern, ExpertPattern)
        else parse_expert_pattern(expert_pattern)
    )
    if not isinstance(num_experts, int) or num_experts < 0:
        raise ValidationError(f"num_experts must be a non-negative int, got {num_experts!r}")
    rng = rng or random.Random()
    excluded = {uid for uid in exclude if uid in pattern}
    free = pattern.grid_size - len(excluded)
    if num_experts > free:
        raise ValidationError(
            f"expert pattern {pattern_text(pattern)!r} has {pattern.grid_size} uids "
            f"({len(excluded)} of them taken); cannot choose {num_experts} distinct experts"
        )
    if pattern.grid_size <= _ENUMERATE_LIMIT or num_experts * 2 > free:
        every = [pattern.uid(c) for c in itertools.product(*pattern.dims)]
        return rng.sample([u for u in every if u not in excluded], num_experts)
    chosen: dict[ExpertUID, None] = {}
    while len(chosen) < num_experts:  # free >= 2 * num_experts: each draw succeeds >= 1/2
        uid = pattern.uid([rng.choice(dim) for dim in pattern.dims])
        if uid not in excluded:
            chosen[uid] = None
    return list(chosen)


def pattern_text(pattern: ExpertPattern) -> str:
    """Write a parsed pattern back as text (``len(dim) == 1`` becomes a fixed coordinate)."""
    blocks = [
        str(dim.start) if len(dim) == 1 else f"[{dim.start}:{dim.stop}]" for dim in pattern.dims
    ]
    return UID_DELIMITER.join([pattern.name, *blocks])
