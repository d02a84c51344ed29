"""A learning-rate scheduler that advances once per global epoch of the swarm.

Frameworks step their scheduler after every optimizer step. With a swarmgrad
``Optimizer`` most local steps only accumulate gradients; the model changes once per
global epoch, and that is the clock a schedule (warm-up, decay) is written for. A peer
that downloads the swarm's state may also jump several epochs at once. Wrapping the
framework's scheduler in :class:`EpochScheduler` makes it follow ``local_epoch``:
however often it is stepped, the wrapped scheduler has been stepped exactly once per
epoch this peer has reached. With no scheduler to wrap it only reports the current
learning rate (for a framework that insists on having a scheduler, while the schedule
itself is the ``scheduler=`` of the swarmgrad Optimizer).
"""

from __future__ import annotations

from typing import Any

from swarmgrad.utils.errors import ValidationError

__all__ = ["EpochScheduler"]


class EpochScheduler:
    """Steps ``scheduler`` (or nothing) to keep pace with ``optimizer.local_epoch``.

    ``optimizer`` is a swarmgrad ``Optimizer`` (anything with ``local_epoch`` and
    ``param_groups``); ``scheduler`` a torch LR scheduler over the optimizer that the
    swarmgrad Optimizer wraps, or None.
    """

    def __init__(self, optimizer: Any, scheduler: Any = None):
        if not isinstance(getattr(optimizer, "local_epoch", None), int):
            raise ValidationError(
                f"EpochScheduler needs a swarmgrad Optimizer (with local_epoch), "
                f"got {type(optimizer).__name__}"
            )
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise ValidationError(
                f"scheduler must be a torch LR scheduler (with step()), "
                f"got {type(scheduler).__name__}"
            )
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.epochs_applied = optimizer.local_epoch

    def step(self, epoch: int | None = None) -> None:
        """Catch up with the optimizer's epoch (called after every optimizer step)."""
        if epoch is not None:
            raise ValidationError(
                "EpochScheduler follows the swarm's epoch: call step() without an epoch"
            )
        target = self.optimizer.local_epoch
        while self.epochs_applied < target:
            if self.scheduler is not None:
                self.scheduler.step()
            self.epochs_applied += 1
        # a restored older checkpoint moves the optimizer back: follow it from there
        self.epochs_applied = min(self.epochs_applied, target)

    def get_last_lr(self) -> list[float]:
        if self.scheduler is not None:
            return list(self.scheduler.get_last_lr())
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        inner = self.scheduler.state_dict() if self.scheduler is not None else None
        return {"epochs_applied": self.epochs_applied, "scheduler": inner}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or "epochs_applied" not in state_dict:
            raise ValidationError(
                "not an EpochScheduler state: expected a dict with 'epochs_applied' and "
                f"'scheduler', got {type(state_dict).__name__}"
            )
        self.epochs_applied = int(state_dict["epochs_applied"])
        if self.scheduler is not None and state_dict.get("scheduler") is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
