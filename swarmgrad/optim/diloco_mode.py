"""DiLoCo as a mode of :class:`~.optimizer.Optimizer`: ``Optimizer(..., outer_optimizer=...)``.

A hivemind script becomes a DiLoCo one by adding an outer optimizer, with no other change:
the ``optimizer`` it already passes becomes the inner optimizer (it steps every local
step), and ``target_batch_size`` becomes the number of samples the swarm processes
between two outer steps (so ``target_batch_size / (batch_size_per_step x peers)`` is H).
The object built is a :class:`DiLoCoMode`: a :class:`~.diloco.DiLoCoOptimizer` (and so
an :class:`~.optimizer.Optimizer`) whose constructor takes the ``Optimizer`` arguments.
This module maps them onto the DiLoCo ones and refuses, by name, those that mean
nothing without gradient averaging, rather than silently ignoring them.
"""

from __future__ import annotations

from typing import Any

from swarmgrad.compression import NoCompression
from swarmgrad.optim.diloco import DiLoCoOptimizer
from swarmgrad.utils.errors import ValidationError

__all__ = ["DiLoCoMode", "diloco_from_optimizer_arguments"]

# Optimizer arguments passed on under the same name.
_SAME_NAME = (
    "dht",
    "run_id",
    "target_batch_size",
    "params",
    "load_state_timeout",
    "grad_compression",
    "load_state_compression",
    "client_mode",
    "averager_opts",
    "tracker_opts",
    "verbose",
    "metrics",
)
# Optimizer arguments that only make sense with gradient or state averaging, with their
# defaults: a value other than the default is refused.
_GRADIENT_MODE_ONLY = {
    "allreduce_timeout": None,
    "next_chunk_timeout": None,
    "reuse_grad_buffers": False,
    "offload_optimizer": None,
    "delay_optimizer_step": None,
    "delay_grad_averaging": False,
    "delay_state_averaging": True,
    "average_state_every": 1,
    "auxiliary": False,
    "grad_averager_factory": None,
    "state_averaging_compression": NoCompression(),
    "average_opt_statistics": (),
    "extra_tensors": (),
}
# The DiLoCo options that ``diloco_opts`` may carry.
_DILOCO_OPTS = ("num_inner_steps", "num_fragments", "fragment_merge_alpha", "error_feedback")


class DiLoCoMode(DiLoCoOptimizer):
    """What ``Optimizer(..., outer_optimizer=...)`` returns: a DiLoCoOptimizer built from
    the ``Optimizer`` arguments (see :func:`diloco_arguments`)."""

    def __init__(self, *, outer_optimizer: Any, diloco_opts: dict | None = None, **arguments: Any):
        super().__init__(**diloco_arguments(outer_optimizer, diloco_opts, arguments))


def diloco_from_optimizer_arguments(
    *, outer_optimizer: Any, diloco_opts: dict | None = None, **arguments: Any
) -> DiLoCoOptimizer:
    """Build the :class:`DiLoCoOptimizer` that ``Optimizer(**arguments,
    outer_optimizer=...)`` stands for (module docstring)."""
    return DiLoCoMode(outer_optimizer=outer_optimizer, diloco_opts=diloco_opts, **arguments)


def diloco_arguments(outer_optimizer: Any, diloco_opts: dict | None, arguments: dict) -> dict:
    """The :class:`DiLoCoOptimizer` arguments for these ``Optimizer`` ``arguments``.
    ``diloco_opts`` may set ``num_fragments``, ``fragment_merge_alpha``,
    ``error_feedback`` and ``num_inner_steps`` (default: ``target_batch_size //
    batch_size_per_step``, the H of a peer training alone; used to check the fragment
    count)."""
    arguments = dict(arguments)
    for name, default in _GRADIENT_MODE_ONLY.items():
        value = arguments.pop(name, default)
        if not _is_default(value, default):
            raise ValidationError(
                f"{name}={value!r} has no meaning with outer_optimizer (DiLoCo mode): the "
                "swarm averages pseudo-gradients every target_batch_size samples, not "
                "gradients or optimizer state"
            )
    arguments.pop("use_local_updates", None)  # DiLoCo's inner steps are local updates
    arguments.pop("performance_ema_alpha", None)
    arguments.pop("shutdown_timeout", None)
    batch_size = arguments.pop("batch_size_per_step", None)
    if batch_size is None:
        raise ValidationError(
            "outer_optimizer (DiLoCo mode) needs batch_size_per_step: the outer step comes "
            "after target_batch_size samples, counted per step"
        )
    options = dict(diloco_opts or {})
    unknown = sorted(set(options) - set(_DILOCO_OPTS))
    if unknown:
        raise ValidationError(
            f"diloco_opts has unknown keys {unknown}; known: {list(_DILOCO_OPTS)}"
        )
    target = arguments["target_batch_size"]
    if isinstance(target, int) and isinstance(batch_size, int) and batch_size > 0:
        options.setdefault("num_inner_steps", max(1, target // batch_size))
    passed = {name: arguments.pop(name) for name in _SAME_NAME if name in arguments}
    inner = arguments.pop("optimizer")
    scheduler = arguments.pop("scheduler", None)
    timing = {
        name: float(value)
        for name in ("matchmaking_time", "averaging_timeout")
        if (value := arguments.pop(name, None)) is not None
    }
    if arguments:
        raise ValidationError(f"unexpected arguments for DiLoCo mode: {sorted(arguments)}")
    return dict(
        batch_size=batch_size,
        inner_optimizer=inner,
        outer_optimizer=outer_optimizer,
        scheduler=scheduler,
        **timing,
        **passed,
        **options,
    )


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(default, NoCompression):
        return isinstance(value, NoCompression)
    if isinstance(default, tuple):
        return len(tuple(value)) == 0
    return value is default or value == default
