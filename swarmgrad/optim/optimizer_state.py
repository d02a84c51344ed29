"""A torch optimizer's state as (metadata, tensors), and back.

State download sends a peer's whole training state to a joiner as msgpack metadata plus a
list of tensors. A torch optimizer keeps per-parameter state (``exp_avg``, ``step``,
``momentum_buffer``, ...) in a dict keyed by parameter objects, which cannot travel; here
it is flattened in a fixed order (parameter by parameter, keys sorted), tensors into the
list and other values (numbers, None) into the metadata, so that a peer with the same
optimizer can put each value back where it belongs, checking shapes on the way.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Any

import torch

from swarmgrad.utils.errors import ValidationError

__all__ = [
    "dump_optimizer_state",
    "initialize_optimizer_state_",
    "load_optimizer_state_",
    "optimizer_parameters",
    "optimizer_state_tensors",
]

# param_group entries copied to joiners (the scheduler changes lr; the rest is static)
_GROUP_SCALARS = (int, float, bool, str, type(None))


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _state_items(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, str, Any]]:
    for index, param in enumerate(optimizer_parameters(optimizer)):
        state = optimizer.state.get(param, {})
        for key in sorted(state, key=str):
            yield index, str(key), state[key]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the optimizer's state, in the fixed order."""
    return [
        (f"param {index} {key}", value)
        for index, key, value in _state_items(optimizer)
        if isinstance(value, torch.Tensor)
    ]


def dump_optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict, list[torch.Tensor]]:
    """``(metadata, tensors)``: msgpack-able metadata and the state's tensors (``opt``:
    hivemind's parameter name)."""
    optimizer = opt
    layout, scalars, tensors = [], [], []
    for index, key, value in _state_items(optimizer):
        if isinstance(value, torch.Tensor):
            layout.append([index, key, "tensor"])
            tensors.append(value)
        elif value is None or isinstance(value, numbers.Number | str | bool):
            layout.append([index, key, "value"])
            scalars.append(value if not isinstance(value, numbers.Number) else float(value))
        # other objects (rare, optimizer-specific) are not shared
    groups = [
        {k: v for k, v in group.items() if k != "params" and isinstance(v, _GROUP_SCALARS)}
        for group in optimizer.param_groups
    ]
    return {"layout": layout, "values": scalars, "param_groups": groups}, tensors


def load_optimizer_state_(
    optimizer: torch.optim.Optimizer, metadata: Any, tensors: list[torch.Tensor]
) -> None:
    """Copy a peer's dumped state into ``optimizer`` in place. The state must have the
    same layout as ours (same optimizer, same parameters); a difference raises
    ValidationError naming the first mismatching entry, before anything is changed."""
    ours = list(_state_items(optimizer))
    if not isinstance(metadata, dict) or not isinstance(metadata.get("layout"), list):
        raise ValidationError("the optimizer state metadata is malformed (no layout)")
    layout, values = metadata["layout"], metadata.get("values", [])
    if not all(isinstance(entry, list) for entry in layout) or not isinstance(values, list):
        raise ValidationError(
            "the optimizer state metadata is malformed (layout entries and values must be lists)"
        )
    expected = [[i, k, "tensor" if isinstance(v, torch.Tensor) else "value"] for i, k, v in ours]
    shareable = [e for e, (_, _, v) in zip(expected, ours, strict=True) if _shareable(v)]
    if [list(entry) for entry in layout] != shareable:
        raise ValidationError(
            f"the peer's optimizer state has another layout: {len(layout)} entries, ours "
            f"{len(shareable)} (first entries {layout[:2]} vs {shareable[:2]}): is it the "
            "same optimizer over the same parameters?"
        )
    our_tensors = [(i, k, v) for i, k, v in ours if isinstance(v, torch.Tensor)]
    if len(tensors) != len(our_tensors):
        raise ValidationError(
            f"the peer sent {len(tensors)} optimizer state tensors, we have {len(our_tensors)}"
        )
    for (index, key, mine), theirs in zip(our_tensors, tensors, strict=True):
        if mine.shape != theirs.shape:
            raise ValidationError(
                f"optimizer state 'param {index} {key}' has shape {list(theirs.shape)} at the "
                f"peer, {list(mine.shape)} here"
            )
    scalars = [(i, k) for i, k, v in ours if not isinstance(v, torch.Tensor) and _shareable(v)]
    if len(values) != len(scalars):
        raise ValidationError("the optimizer state metadata has the wrong number of values")
    params = optimizer_parameters(optimizer)
    with torch.no_grad():
        for (_, _, mine), theirs in zip(our_tensors, tensors, strict=True):
            mine.copy_(theirs.to(mine.dtype))
        for (index, key), value in zip(scalars, values, strict=True):
            optimizer.state[params[index]][key] = value
    groups = metadata.get("param_groups")
    if isinstance(groups, list) and len(groups) == len(optimizer.param_groups):
        for group, theirs in zip(optimizer.param_groups, groups, strict=True):
            if isinstance(theirs, dict):
                for key, value in theirs.items():
                    if key in group and key != "params" and _same_kind(group[key], value):
                        group[key] = value


def _shareable(value: Any) -> bool:
    return isinstance(value, torch.Tensor | numbers.Number | str | bool) or value is None


def _same_kind(ours: Any, theirs: Any) -> bool:
    """A peer's hyperparameter is taken only where both are plain finite numbers (an lr
    changed by the scheduler), never flags or other types."""
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return False
    if not (isinstance(ours, int | float) and isinstance(theirs, int | float)):
        return False
    return not isinstance(theirs, float) or math.isfinite(theirs)


@torch.no_grad()
def initialize_optimizer_state_(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily made state (``exp_avg`` etc.) without changing any
    parameter: one step on zero gradients whose effect is then undone, and step counters
    set back to zero. Every peer's state then has the same layout from the start, which
    averaging and state download need. (``opt``: hivemind's parameter name.)"""
    optimizer = opt
    params = [p for p in optimizer_parameters(optimizer) if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    # weight decay would turn the zero gradient into wd * p and leave it in the moments
    decays = [group.get("weight_decay") for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    try:
        for group in optimizer.param_groups:
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        optimizer.step()
    finally:
        for group, decay in zip(optimizer.param_groups, decays, strict=True):
            if "weight_decay" in group:
                group["weight_decay"] = decay
        for param, value, grad in saved:
            param.copy_(value)
            param.grad = grad
    for param in params:
        state = optimizer.state.get(param, {})
        if "step" in state:
            step = state["step"]
            if isinstance(step, torch.Tensor):
                step.zero_()
            else:
                state["step"] = 0
