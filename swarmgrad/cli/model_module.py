"""The user's model module of ``swarmgrad train``: loading it and checking what it defines.

A model module is a Python file that tells the trainer what to train, so that users need
not write the training loop. It defines:

``make_model() -> torch.nn.Module``
    Called after ``torch.manual_seed(0)``, so every peer builds the same initial weights.
``loss_fn(model, batch) -> torch.Tensor``
    The scalar loss of one batch (the trainer calls ``backward`` on it).
``batches(batch_size, seed) -> Iterable``  *or*  ``make_dataset() -> torch.utils.data.Dataset``
    The data: either an iterable of batches (each peer gets its own ``seed``; when it
    ends, it is called again), or a map-style dataset that the trainer shuffles and
    batches with a ``DataLoader``. Exactly one of the two.
``make_optimizer(params) -> torch.optim.Optimizer``  (optional)
    The local optimizer; Adam with lr 1e-3 when absent.
``make_scheduler(optimizer) -> LR scheduler``  (optional)
    A learning-rate schedule over the local optimizer; it steps once per global epoch
    (``--mode sync``/``local``) or per inner step (``diloco``/``streaming``).
``configure(options: dict[str, str])``  (optional)
    Receives ``--module-options KEY=VALUE`` pairs before anything else is called.

Every way this can go wrong (no such file, an exception while importing, a missing or
non-callable name) is a :class:`ModelModuleError` that names the file and the name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.user_module import import_user_file

__all__ = ["ModelModule", "ModelModuleError", "load_model_module", "EXPECTED_NAMES"]

EXPECTED_NAMES = (
    "make_model(), loss_fn(model, batch), and batches(batch_size, seed) or make_dataset(); "
    "optionally make_optimizer(params), make_scheduler(optimizer) and configure(options)"
)


class ModelModuleError(ValidationError):
    """The model module of ``swarmgrad train`` is missing, broken or incomplete."""


@dataclass(frozen=True)
class ModelModule:
    """The functions a model module defines (``None`` for optional ones it does not)."""

    path: str
    make_model: Callable[[], Any]
    loss_fn: Callable[[Any, Any], Any]
    batches: Callable[[int, int], Any] | None
    make_dataset: Callable[[], Any] | None
    make_optimizer: Callable[[Any], Any] | None
    configure: Callable[[dict[str, str]], None] | None
    make_scheduler: Callable[[Any], Any] | None = None


def load_model_module(path: str | Path, options: dict[str, str] | None = None) -> ModelModule:
    """Import the file at ``path``, check its names, and pass it ``options``."""
    where = f"model module {str(path)!r}"
    module = import_user_file(path, "model module", "swarmgrad_model_module", ModelModuleError)

    def function(attr: str, required: bool) -> Callable | None:
        value = getattr(module, attr, None)
        if value is None:
            if required:
                raise ModelModuleError(f"{where} defines no {attr}; expected {EXPECTED_NAMES}")
            return None
        if not callable(value):
            raise ModelModuleError(
                f"{where}: {attr} must be a function, got {type(value).__name__}"
            )
        return value

    make_model = function("make_model", True)
    loss_fn = function("loss_fn", True)
    batches = function("batches", False)
    make_dataset = function("make_dataset", False)
    if batches is None and make_dataset is None:
        raise ModelModuleError(
            f"{where} defines neither batches nor make_dataset; expected {EXPECTED_NAMES}"
        )
    if batches is not None and make_dataset is not None:
        raise ModelModuleError(f"{where} defines both batches and make_dataset: keep one")
    loaded = ModelModule(
        path=str(path),
        make_model=make_model,
        loss_fn=loss_fn,
        batches=batches,
        make_dataset=make_dataset,
        make_optimizer=function("make_optimizer", False),
        configure=function("configure", False),
        make_scheduler=function("make_scheduler", False),
    )
    if options:
        if loaded.configure is None:
            raise ModelModuleError(
                f"{where} defines no configure(options), so it takes no --module-options "
                f"(given: {sorted(options)})"
            )
        try:
            loaded.configure(dict(options))
        except Exception as e:
            raise ModelModuleError(
                f"{where}: configure({options}) failed: {type(e).__name__}: {e}"
            ) from e
    return loaded
