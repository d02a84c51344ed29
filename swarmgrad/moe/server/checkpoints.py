"""Expert checkpoints on disk: atomic writes, rotation, and restore with fallback.

Layout: ``<checkpoint_dir>/<expert uid>/checkpoint_<20-digit ns timestamp>.pt``, each file
a ``torch.save`` of :meth:`ModuleBackend.checkpoint_state` (module, optimizer, scheduler,
counters). A file is written under a temporary name in the same directory, flushed to
disk and then renamed (``os.replace``), so a crash mid-write never leaves a truncated
file under a checkpoint name. The newest ``keep`` files are kept. On restore the newest
readable file wins; an unreadable one is reported (file name and error) and the one
before it is tried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from swarmgrad.moe.server.module_backend import ModuleBackend
from swarmgrad.utils.checks import positive_int, positive_seconds
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "CheckpointSaver",
    "list_checkpoints",
    "load_experts",
    "restore_expert",
    "save_expert",
    "store_experts",
]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^checkpoint_(\d{20})\.pt$")
DEFAULT_KEEP = 5


def _expert_dir(checkpoint_dir: str | Path, uid: str) -> Path:
    if os.sep in uid or (os.altsep and os.altsep in uid) or uid in (".", ".."):
        raise ValidationError(f"expert uid {uid!r} cannot be used as a directory name")
    return Path(checkpoint_dir) / uid


def list_checkpoints(checkpoint_dir: str | Path, uid: str) -> list[Path]:
    """An expert's checkpoint files, oldest first."""
    directory = _expert_dir(checkpoint_dir, uid)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def save_expert(
    backend: ModuleBackend, checkpoint_dir: str | Path, keep: int = DEFAULT_KEEP
) -> Path:
    """Write one checkpoint of ``backend`` atomically and delete all but the ``keep``
    newest; returns the new file's path."""
    positive_int("keep", keep)
    directory = _expert_dir(checkpoint_dir, backend.name)
    directory.mkdir(parents=True, exist_ok=True)
    state = backend.checkpoint_state()
    existing = list_checkpoints(checkpoint_dir, backend.name)
    stamp = time.time_ns()
    if existing:  # strictly after the newest one, even if the clock went back
        stamp = max(stamp, int(_NAME.match(existing[-1].name).group(1)) + 1)
    target = directory / f"checkpoint_{stamp:020d}.pt"
    fd, temp_name = tempfile.mkstemp(dir=directory, prefix=".checkpoint_", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    for old in list_checkpoints(checkpoint_dir, backend.name)[:-keep]:
        with contextlib.suppress(OSError):
            old.unlink()
    return target


def restore_expert(backend: ModuleBackend, checkpoint_dir: str | Path) -> Path | None:
    """Load the newest readable checkpoint into ``backend``; returns its path, or None
    when there is none (the expert keeps its fresh weights)."""
    candidates = list_checkpoints(checkpoint_dir, backend.name)
    for path in reversed(candidates):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            backend.load_state_dict(state)
        except Exception as e:
            logger.warning(
                "expert %r: checkpoint %s is unreadable or does not fit the expert (%s: %s); "
                "trying the previous one",
                backend.name, path, type(e).__name__, e,
            )  # fmt: skip
            continue
        logger.info("expert %r: restored from %s", backend.name, path)
        return path
    if candidates:
        logger.warning(
            "expert %r: none of its %d checkpoints in %s could be loaded; starting fresh",
            backend.name, len(candidates), checkpoint_dir,
        )  # fmt: skip
    return None


def store_experts(
    backends: Mapping[str, ModuleBackend], checkpoint_dir: str | Path, keep: int = DEFAULT_KEEP
) -> None:
    """Checkpoint every expert (hivemind's name); a failing expert is logged, not fatal."""
    for backend in backends.values():
        try:
            save_expert(backend, checkpoint_dir, keep)
        except Exception as e:
            logger.warning("expert %r: could not write a checkpoint: %r", backend.name, e)


def load_experts(backends: Mapping[str, ModuleBackend], checkpoint_dir: str | Path) -> None:
    """Restore every expert that has a checkpoint (hivemind's name)."""
    for backend in backends.values():
        restore_expert(backend, checkpoint_dir)


class CheckpointSaver:
    """A background thread that checkpoints every expert each ``interval`` seconds.

    A thread, not a loop task: ``torch.save`` and ``fsync`` block. Each expert's state is
    copied under that expert's lock (between two batches), then written without it, so
    the device thread waits only for the copy."""

    def __init__(
        self,
        backends: Mapping[str, ModuleBackend],
        checkpoint_dir: str | Path,
        interval: float,
        keep: int = DEFAULT_KEEP,
    ):
        positive_seconds("checkpoint interval", interval)
        self.backends = backends
        self.checkpoint_dir = Path(checkpoint_dir)
        self.interval = interval
        self.keep = keep
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="swarmgrad-checkpoints", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            store_experts(self.backends, self.checkpoint_dir, self.keep)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the thread (after the save in progress, if any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the checkpoint thread did not stop within %s s", timeout)
            self._thread = None
