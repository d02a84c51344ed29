"""Splitting a model into stages: the stage-module convention and the chain check.

A *stage module* is a Python file that ``swarmgrad serve-stage`` (and your own scripts)
load to know what a pipeline computes. It defines:

``make_stages() -> list[torch.nn.Module]``
    The model, split into consecutive stages. Called after ``torch.manual_seed(0)``, so
    every peer builds the same initial weights for every stage.
``sample_input(batch_size) -> Tensor | tuple[Tensor, ...]``
    A batch for stage 0 (its shapes and dtypes are what the pipeline accepts).
``make_optimizer(params) -> torch.optim.Optimizer``  (optional)
    Each stage server's optimizer; Adam with lr 1e-3 when absent.

Every stage takes tensors with the batch first, positionally, and returns a tensor or a
tuple of tensors, which are the next stage's arguments. :func:`split_stages` runs the
sample through the stages once and refuses, at start, a split whose stages don't chain,
naming the boundary: better than every trainer's first micro-batch failing remotely.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.user_module import import_user_file

__all__ = [
    "StageModule",
    "StageModuleError",
    "StageSpec",
    "load_stage_module",
    "make_stage_backend",
    "split_stages",
]

_SAMPLE_BATCH = 2


@dataclass(frozen=True)
class StageSpec:
    """One stage: its module and what it takes and returns (batch dimension implicit)."""

    module: nn.Module
    args_schema: tuple[BatchTensorDescriptor, ...]
    outputs_schema: tuple[BatchTensorDescriptor, ...]


def _as_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        value = (value,)
    if not isinstance(value, tuple | list) or not value:
        raise ValidationError(f"{what} must be a tensor or a non-empty tuple of tensors")
    for i, tensor in enumerate(value):
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"{what}[{i}] is a {type(tensor).__name__}, not a tensor")
        if tensor.ndim == 0 or tensor.shape[0] != value[0].shape[0]:
            raise ValidationError(
                f"{what}[{i}] has shape {list(tensor.shape)}: every tensor needs the batch "
                f"({value[0].shape[0]}) as its first dimension"
            )
    return tuple(value)


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)


def split_stages(stages: Sequence[nn.Module], sample: Any) -> list[StageSpec]:
    """Check that ``stages`` chain on ``sample`` (a batch for stage 0) and describe each.

    Raises :class:`ValidationError` naming the boundary ``stage i -> stage i+1`` whose
    tensors don't fit, or the stage that fails on its sample."""
    if not isinstance(stages, Sequence) or not stages:
        raise ValidationError("make_stages() must return a non-empty list of modules")
    for i, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise ValidationError(f"stage {i} is a {type(stage).__name__}, not a torch module")
    inputs = _as_tuple(sample, "sample_input()")
    specs = []
    for i, stage in enumerate(stages):
        where = "sample_input()" if i == 0 else f"the outputs of stage {i - 1}"
        try:
            with torch.no_grad():
                outputs = stage(*inputs)
        except Exception as e:
            boundary = "" if i == 0 else f"stages {i - 1} and {i} do not chain: "
            raise ValidationError(
                f"{boundary}stage {i} failed on {where} ({_describe(inputs)}): "
                f"{type(e).__name__}: {e}"
            ) from e
        outputs = _as_tuple(outputs, f"the output of stage {i}")
        if outputs[0].shape[0] != inputs[0].shape[0]:
            raise ValidationError(
                f"stage {i} turned a batch of {inputs[0].shape[0]} into one of "
                f"{outputs[0].shape[0]}: stages must keep the batch dimension"
            )
        specs.append(
            StageSpec(
                stage,
                tuple(BatchTensorDescriptor.from_tensor(x) for x in inputs),
                tuple(
                    BatchTensorDescriptor(
                        *y.shape[1:], dtype=y.dtype, requires_grad=y.is_floating_point()
                    )
                    for y in outputs
                ),
            )
        )
        inputs = outputs
    return specs


def make_stage_backend(
    name: str,
    spec: StageSpec,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    **backend_kwargs: Any,
) -> ModuleBackend:
    """A :class:`ModuleBackend` for one stage (``backend_kwargs``: ``max_batch_size``,
    ``timeout`` of the batching pools, ``clip_grad_norm``...)."""
    params = [p for p in spec.module.parameters() if p.requires_grad]
    make_optimizer = make_optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-3))
    return ModuleBackend(
        name,
        spec.module,
        optimizer=make_optimizer(params) if params else None,
        args_schema=spec.args_schema,
        outputs_schema=spec.outputs_schema,
        **backend_kwargs,
    )


class StageModuleError(ValidationError):
    """A stage module is missing, broken or incomplete."""


@dataclass(frozen=True)
class StageModule:
    path: str
    make_stages: Callable[[], Sequence[nn.Module]]
    sample_input: Callable[[int], Any]
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None

    def build(self) -> list[StageSpec]:
        """Fresh stages (seeded: every peer gets the same initial weights), checked."""
        torch.manual_seed(0)
        stages = list(self.make_stages())
        return split_stages(stages, self.sample_input(_SAMPLE_BATCH))


def load_stage_module(path: str | Path) -> StageModule:
    """Import a stage module and check its names."""
    where = f"stage module {str(path)!r}"
    module = import_user_file(path, "stage module", "swarmgrad_stage_module", StageModuleError)
    functions = {}
    for attr, required in (
        ("make_stages", True),
        ("sample_input", True),
        ("make_optimizer", False),
    ):
        value = getattr(module, attr, None)
        if value is None and required:
            raise StageModuleError(
                f"{where} defines no {attr}(); a stage module needs make_stages() and "
                "sample_input(batch_size), optionally make_optimizer(params)"
            )
        if value is not None and not callable(value):
            raise StageModuleError(f"{where}: {attr} must be a function")
        functions[attr] = value
    return StageModule(str(path), **functions)
