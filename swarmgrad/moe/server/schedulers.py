"""Learning-rate schedules a server can give each expert by name (``--scheduler``)."""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from swarmgrad.utils.errors import ValidationError

__all__ = [
    "SCHEDULER_NAMES",
    "LinearWarmupDecay",
    "get_linear_schedule_with_warmup",
    "make_scheduler",
]

SCHEDULER_NAMES = ("linear", "none")


class LinearWarmupDecay:
    """LR multiplier: rises linearly from 0 to 1 over ``num_warmup_steps`` optimizer
    steps, then falls linearly to 0 at ``num_training_steps`` and stays there.

    A class rather than a closure so that ``LambdaLR.state_dict()`` records it and a
    checkpoint restores the schedule exactly."""

    def __init__(self, num_warmup_steps: int, num_training_steps: int):
        self.num_warmup_steps = num_warmup_steps
        self.num_training_steps = num_training_steps

    def __call__(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return step / max(1, self.num_warmup_steps)
        remaining = self.num_training_steps - step
        return max(0.0, remaining / max(1, self.num_training_steps - self.num_warmup_steps))


def get_linear_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> LambdaLR:
    """Linear warmup then linear decay to zero (the ``"linear"`` scheduler)."""
    if num_warmup_steps < 0 or num_training_steps < 1 or num_warmup_steps > num_training_steps:
        raise ValidationError(
            "the linear scheduler needs 0 <= num_warmup_steps <= num_training_steps and "
            f"num_training_steps >= 1, got {num_warmup_steps} and {num_training_steps}"
        )
    return LambdaLR(optimizer, LinearWarmupDecay(num_warmup_steps, num_training_steps))


def make_scheduler(
    name: str | None,
    optimizer: torch.optim.Optimizer | None,
    num_warmup_steps: int | None = None,
    num_training_steps: int | None = None,
) -> LambdaLR | None:
    """The scheduler called ``name`` for ``optimizer`` (None for ``"none"``/None)."""
    if name is None or str(name).lower() == "none":
        return None
    if str(name).lower() != "linear":
        raise ValidationError(f"unknown scheduler {name!r}; expected one of {SCHEDULER_NAMES}")
    if optimizer is None:
        raise ValidationError("a scheduler needs an optimizer, but the expert has none")
    if num_training_steps is None:
        raise ValidationError("the linear scheduler needs num_training_steps")
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps or 0, num_training_steps)
