"""Checkpoints of ``swarmgrad train``: the model, the optimizer state and the epoch.

Written in the background and atomically. :meth:`CheckpointWriter.save` copies the
tensors to host memory (the training thread pays only that copy) and a thread writes
them to a temporary file in the same directory, flushes it to the disk (``fsync``) and
renames it into place: a crash or a full disk mid-write leaves the previous checkpoints
as they were. Each checkpoint is ``checkpoint-EPOCH.pt``; the newest ``keep`` stay.
:func:`load_checkpoint` takes the newest one that reads, so a damaged file costs one
checkpoint, not the run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from swarmgrad.utils.errors import SwarmgradError, ValidationError

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
    "CheckpointWriter",
    "checkpoint_paths",
    "export_model",
    "load_checkpoint",
    "save_checkpoint",
    "snapshot_to_host",
]

logger = logging.getLogger("swarmgrad.cli.train")

#: the single file of checkpoints written before ``--keep-checkpoints`` (still loaded)
CHECKPOINT_NAME = "checkpoint.pt"
_NAMED = re.compile(r"^checkpoint-(\d+)\.pt$")
_PARTIAL_PREFIX = ".checkpoint-"
_FORMAT = 1


class CheckpointError(SwarmgradError, OSError):
    """A checkpoint could not be written (the message names the directory and why)."""


def snapshot_to_host(value: Any) -> Any:
    """A copy of ``value`` (tensors in dicts, lists and tuples) whose tensors live in host
    memory and share nothing with the originals, so training may go on changing them.
    CUDA tensors are copied into pinned memory without waiting one by one: one
    synchronisation per device at the end."""
    devices: set[torch.device] = set()

    def copy(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            item = item.detach()
            if item.device.type == "cuda":
                devices.add(item.device)
                host = torch.empty(item.shape, dtype=item.dtype, pin_memory=True)
                return host.copy_(item, non_blocking=True)
            return item.to("cpu", copy=True)
        if isinstance(item, dict):
            return {key: copy(v) for key, v in item.items()}
        if isinstance(item, list | tuple) and not hasattr(item, "_fields"):
            return type(item)(copy(v) for v in item)
        return item

    result = copy(value)
    for device in devices:
        torch.cuda.synchronize(device)
    return result


def checkpoint_paths(directory: str | Path) -> list[Path]:
    """The checkpoints in ``directory``, newest first (the single-file form last)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    named = []
    for path in directory.iterdir():
        match = _NAMED.match(path.name)
        if match:
            named.append((int(match.group(1)), path))
    paths = [path for _, path in sorted(named, reverse=True)]
    legacy = directory / CHECKPOINT_NAME
    return [*paths, legacy] if legacy.is_file() else paths


def _serialize(state: dict, file: Any) -> None:
    torch.save(state, file)


class _RecordingFile:
    """A binary file that remembers the first OSError a write raised: torch's writer
    turns it into an opaque "unexpected pos" RuntimeError, and "No space left on device"
    is what the user must read."""

    def __init__(self, file: Any):
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.file.flush()


def _write_atomically(directory: Path, name: str, state: dict) -> Path:
    """Write ``state`` to ``directory/name`` through a temporary file in the same
    directory, fsync'd, then renamed (and the directory fsync'd for the rename)."""
    fd, partial = tempfile.mkstemp(prefix=_PARTIAL_PREFIX, suffix=".part", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            recording = _RecordingFile(file)
            try:
                _serialize(state, recording)
                file.flush()
            except Exception as e:
                if recording.error is not None and recording.error is not e:
                    raise recording.error from e
                raise
            os.fsync(file.fileno())
        path = directory / name
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # (no directory handles on some systems)
        return path
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return path


def _state(model: torch.nn.Module, optimizer: Any, extra: dict) -> dict:
    return {
        "format": _FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": optimizer.local_epoch,
        **extra,
    }


class CheckpointWriter:
    """Saves checkpoints of a training run to ``directory`` on a background thread,
    keeping the newest ``keep``. One write at a time: a save while the previous write
    still runs waits for it first (memory holds at most one snapshot)."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory)
        self.keep = keep
        self.last_good: Path | None = next(iter(checkpoint_paths(self.directory)), None)
        self.error: CheckpointError | None = None
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint directory {str(self.directory)!r} cannot be created: {e}"
            ) from e
        for stale in self.directory.glob(f"{_PARTIAL_PREFIX}*.part"):  # a crash mid-write
            stale.unlink(missing_ok=True)

    def save(
        self, model: torch.nn.Module, optimizer: Any, *, background: bool = True, **extra: Any
    ) -> None:
        """Snapshot the state now and write it in the background (``background=False``:
        in this thread, for a caller that waits for it anyway; no thread is started)."""
        self.wait(raise_error=False)
        state = snapshot_to_host(_state(model, optimizer, extra))
        name = f"checkpoint-{int(state['epoch']):08d}.pt"
        if not background:
            self._write(name, state)
            return
        self._thread = threading.Thread(
            target=self._write, args=(name, state), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def wait(self, raise_error: bool = True) -> Path | None:
        """Wait for the write in progress; its path. With ``raise_error``, a failed
        write raises :class:`CheckpointError` (else it was logged and is in ``error``)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if raise_error and self.error is not None:
            raise self.error
        return self._result

    def _write(self, name: str, state: dict) -> None:
        self.error, self._result = None, None
        try:
            path = _write_atomically(self.directory, name, state)
        except Exception as e:
            kept = str(self.last_good) if self.last_good else "none yet"
            self.error = CheckpointError(
                f"checkpoint not written in {str(self.directory)!r}: {type(e).__name__}: {e} "
                f"(the last good checkpoint is kept: {kept})"
            )
            logger.error("%s", self.error)
            return
        self._result = self.last_good = path
        for old in checkpoint_paths(self.directory)[self.keep :]:
            if old.name != CHECKPOINT_NAME:
                old.unlink(missing_ok=True)
        logger.debug("checkpoint written: %s", path)


#: the keeper's export of the model alone: ``torch.load(path)`` is its state_dict
MODEL_NAME = "model.pt"
PRETRAINED_DIR = "pretrained"


def export_model(directory: str | Path, model: torch.nn.Module) -> list[str]:
    """Write the model alone, for users outside swarmgrad: ``model.pt`` (a state_dict,
    for ``torch.load``) and, for a ``transformers`` model, ``pretrained/`` (its
    ``save_pretrained`` form, for ``from_pretrained``). Both replaced atomically."""
    directory = Path(directory)
    written = [str(_write_atomically(directory, MODEL_NAME, snapshot_to_host(model.state_dict())))]
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        final = directory / PRETRAINED_DIR
        fresh = Path(tempfile.mkdtemp(prefix=".pretrained-", dir=directory))
        old = directory / ".pretrained-old"
        try:
            save_pretrained(str(fresh))
            if final.exists():
                final.rename(old)
            fresh.rename(final)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
        written.append(str(final))
    return written


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: Any, **extra) -> Path:
    """Write a checkpoint now (in the calling thread), atomically; its path."""
    writer = CheckpointWriter(directory, keep=2**31)
    writer.save(model, optimizer, **extra)
    path = writer.wait()
    assert path is not None
    return path


def load_checkpoint(directory: str | Path) -> dict | None:
    """The newest readable checkpoint in ``directory``, or None when there is none yet.
    A damaged newest file is skipped (logged) in favour of the one before it."""
    paths = checkpoint_paths(directory)
    problems = []
    for path in paths:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            problems.append(f"{str(path)!r} cannot be read: {e}")
            logger.warning("checkpoint %s cannot be read (%s); trying an older one", path, e)
            continue
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            problems.append(f"{str(path)!r} is not a swarmgrad train checkpoint")
            continue
        state["path"] = str(path)
        return state
    if problems:
        raise ValidationError("no usable checkpoint: " + "; ".join(problems))
    return None
