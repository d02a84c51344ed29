"""Checkpoints of ``swarmgrad train``: the model, the optimizer state and the epoch, in
one file replaced atomically (a trainer killed while saving keeps its previous one)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from swarmgrad.utils.errors import ValidationError

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.pt"
_FORMAT = 1


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: Any, **extra) -> Path:
    """Write ``directory/checkpoint.pt`` (through a temporary file and a rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    state = {
        "format": _FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": optimizer.local_epoch,
        **extra,
    }
    partial = path.with_suffix(".part")
    torch.save(state, partial)
    os.replace(partial, path)
    return path


def load_checkpoint(directory: str | Path) -> dict | None:
    """The checkpoint in ``directory``, or None when there is none yet."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValidationError(f"checkpoint {str(path)!r} cannot be read: {e}") from e
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValidationError(f"checkpoint {str(path)!r} is not a swarmgrad train checkpoint")
    return state
