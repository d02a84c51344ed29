"""The registry of expert classes a server can host by name (``--expert-cls ffn``).

A class is registered together with a *sample input* function ``(batch_size, hidden_dim)
-> tensor or tuple of tensors``. The server runs the module once on that sample to learn
the argument and output schemas it announces to clients, so the sample must have the
shapes and dtypes real requests will have. Floating-point sample inputs should have
``requires_grad=True``: the schema then tells clients those arguments receive gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.user_module import import_user_file

__all__ = [
    "SampleInputFn",
    "load_custom_module",
    "name_to_block",
    "name_to_input",
    "register_expert_class",
]

logger = logging.getLogger(__name__)

SampleInputFn = Callable[[int, int], torch.Tensor | tuple[torch.Tensor, ...]]

#: expert class name -> module class (called as ``cls(hidden_dim)``)
name_to_block: dict[str, Callable[..., nn.Module]] = {}
#: expert class name -> sample input function ``(batch_size, hidden_dim)``
name_to_input: dict[str, SampleInputFn] = {}


def register_expert_class(name: str, sample_input: SampleInputFn) -> Callable[[Any], Any]:
    """Class decorator: make ``name`` usable as ``expert_cls`` in :meth:`Server.create`.

    ``sample_input(batch_size, hidden_dim)`` returns one tensor or a tuple of tensors in
    the layout requests will use. Registering a name twice replaces the earlier class
    (with a warning), so a custom module may override a built-in one deliberately."""
    if not isinstance(name, str) or not name:
        raise ValidationError(f"an expert class name must be a non-empty string, got {name!r}")
    if not callable(sample_input):
        raise ValidationError(f"sample_input of expert class {name!r} must be callable")

    def register(cls: Any) -> Any:
        if name in name_to_block and name_to_block[name] is not cls:
            logger.warning("expert class %r is registered again; the new one replaces it", name)
        name_to_block[name] = cls
        name_to_input[name] = sample_input
        return cls

    return register


def load_custom_module(path: str | Path) -> None:
    """Execute the Python file at ``path`` so its ``@register_expert_class`` calls add
    classes to the registry (``--custom-module-path``)."""
    import_user_file(path, "custom module", "swarmgrad_custom_experts")
