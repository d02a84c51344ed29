"""The :class:`~.diloco.DiLoCoOptimizer`'s arguments, checked, and the pieces it is built
from (inner optimizer, scheduler, the outer optimizer's default), plus the error
feedback's residuals: what does not depend on the swarm, apart from the optimizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmgrad.compression import CompressionBase
from swarmgrad.compression.base import CompressionInfo
from swarmgrad.dht.dht import DHT
from swarmgrad.utils.checks import fraction, positive_int, positive_seconds
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "check_diloco_arguments",
    "compression_residuals",
    "default_outer_optimizer",
    "make_inner_optimizer",
    "make_scheduler",
]


def default_outer_optimizer(params: Any) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def check_diloco_arguments(
    *,
    dht: DHT,
    run_id: Any,
    batch_size: Any,
    num_inner_steps: Any,
    outer_optimizer: Any,
    target_batch_size: Any,
    num_fragments: Any,
    fragment_merge_alpha: Any,
    fragment_pace: Any,
    timeouts: Mapping[str, Any],
) -> None:
    """Each argument, by name."""
    positive_int("batch_size", batch_size)
    positive_int("num_inner_steps", num_inner_steps)
    positive_int("num_fragments", num_fragments)
    if target_batch_size is not None:
        positive_int("target_batch_size", target_batch_size)
    if num_fragments > 1 and num_inner_steps < num_fragments:
        raise ValidationError(
            f"num_inner_steps={num_inner_steps} is fewer than num_fragments="
            f"{num_fragments}: each fragment must sync at most once per inner step"
        )
    if fragment_pace is not None:
        fraction("fragment_pace", fragment_pace, low_open=True)
    fraction("fragment_merge_alpha", fragment_merge_alpha, high_open=True)
    for name, value in timeouts.items():
        positive_seconds(name, value)
    if not isinstance(run_id, str) or not run_id:
        raise ValidationError(f"run_id must be a non-empty str, got {run_id!r}")
    if not dht.is_alive():
        raise ValidationError("the DHT is not running: start it before the optimizer")
    if not callable(outer_optimizer) or hasattr(outer_optimizer, "param_groups"):
        raise ValidationError(
            "outer_optimizer must be a factory, e.g. lambda params: torch.optim.SGD(params, "
            "lr=0.7, momentum=0.9, nesterov=True): it works on the synced copy"
        )


def make_inner_optimizer(inner_optimizer: Any, params: Any) -> torch.optim.Optimizer:
    """A ready optimizer as it is, or a factory called on ``params``."""
    if hasattr(inner_optimizer, "param_groups") and hasattr(inner_optimizer, "step"):
        if params is not None:
            raise ValidationError("params were given with a ready inner_optimizer: pass only one")
        return inner_optimizer
    if not callable(inner_optimizer):
        raise ValidationError(
            "inner_optimizer must be a factory (lambda params: torch.optim.AdamW(params)) "
            f"with params=..., or a torch optimizer; got {type(inner_optimizer).__name__}"
        )
    if params is None:
        raise ValidationError("inner_optimizer is a factory: pass params=model.parameters() too")
    try:
        made = inner_optimizer(list(params))
    except Exception as e:
        raise ValidationError(f"the inner_optimizer factory raised {type(e).__name__}: {e}") from e
    if not hasattr(made, "param_groups"):
        raise ValidationError(
            f"the inner_optimizer factory returned a {type(made).__name__}, not an optimizer"
        )
    return made


def compression_residuals(
    codec: CompressionBase, deltas: list[torch.Tensor], keys: Sequence[int]
) -> list[torch.Tensor]:
    """What the codec loses of each tensor, to be sent next time. The all-reduce encodes
    parts of concatenated tensors (and the reducer encodes the average again), so this
    is the bulk of the loss rather than its exact value."""
    residuals = []
    for delta, key in zip(deltas, keys, strict=True):
        info = CompressionInfo.from_tensor(delta, key=key)
        restored = codec.extract(codec.compress(delta, info))
        residuals.append(delta - restored.to(delta.dtype).reshape(delta.shape))
    return residuals


def make_scheduler(scheduler: Any, inner_optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler factory called on the inner optimizer (None: no scheduler)."""
    if scheduler is None:
        return None
    try:
        return scheduler(inner_optimizer)
    except Exception as e:
        raise ValidationError(f"the scheduler factory raised {type(e).__name__}: {e}") from e
