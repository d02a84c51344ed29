"""Training metrics to TensorBoard and Weights & Biases.

``swarmgrad train --tensorboard DIR --wandb PROJECT`` writes the trainer's figures (loss,
samples/s, peers, the swarm's epoch) once per epoch; ``swarmgrad monitor`` with the same
options writes the swarm's figures per run, one point each time a run's epoch moves.
Both packages are optional extras (``pip install 'swarmgrad[tensorboard]'``,
``'swarmgrad[wandb]'``); asking for one that is not installed is a clear error naming
the extra, raised before anything starts. W&B honours its own environment
(``WANDB_MODE=offline`` writes the run to ``WANDB_DIR`` without an account).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from swarmgrad.utils.errors import ValidationError

__all__ = [
    "Exporter",
    "ExporterMissing",
    "SnapshotExporter",
    "TensorBoardExporter",
    "WandbExporter",
    "make_exporters",
]


class ExporterMissing(ValidationError):
    """An exporter was asked for whose package is not installed (names the extra)."""


class Exporter:
    """Writes named numbers at an integer step; closed once."""

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _numbers(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among ``scalars`` (None, NaN and non-numbers are left out)."""
    kept = {}
    for name, value in scalars.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            kept[name] = float(value)
    return kept


class TensorBoardExporter(Exporter):
    """Event files in ``logdir`` (``tensorboard --logdir DIR``)."""

    def __init__(self, logdir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's module needs the tensorboard package
            raise ExporterMissing(
                f"--tensorboard {logdir} needs the tensorboard package: "
                f"pip install 'swarmgrad[tensorboard]' ({e})"
            ) from e
        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=logdir)

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        for name, value in _numbers(scalars).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbExporter(Exporter):
    """A W&B run in ``project`` (named ``name``, with ``config``)."""

    def __init__(self, project: str, name: str | None = None, config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ExporterMissing(
                f"--wandb {project} needs the wandb package: pip install 'swarmgrad[wandb]' ({e})"
            ) from e
        self.project = project
        self._run = wandb.init(project=project, name=name, config=config or {}, reinit=True)
        self._step = -1

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        numbers = _numbers(scalars)
        if not numbers:
            return
        step = max(step, self._step)  # W&B steps never go back
        self._run.log(numbers, step=step)
        self._step = step

    def close(self) -> None:
        self._run.finish()


def make_exporters(
    tensorboard: str | None, wandb: str | None, name: str | None = None, config: dict | None = None
) -> list[Exporter]:
    """The exporters asked for (none when both are None); a missing package raises
    :class:`ExporterMissing` before any is started."""
    if tensorboard:
        _require("torch.utils.tensorboard", f"--tensorboard {tensorboard}", "tensorboard")
    if wandb:
        _require("wandb", f"--wandb {wandb}", "wandb")
    exporters: list[Exporter] = []
    try:
        if tensorboard:
            exporters.append(TensorBoardExporter(tensorboard))
        if wandb:
            exporters.append(WandbExporter(wandb, name=name, config=config))
    except BaseException:
        for exporter in exporters:
            exporter.close()
        raise
    return exporters


def _require(module: str, option: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ExporterMissing(
            f"{option} needs the {extra} package: pip install 'swarmgrad[{extra}]' ({e})"
        ) from e


#: the per-run figures of the monitor's snapshot that are exported
RUN_FIELDS = (
    "epoch",
    "num_peers",
    "num_clients",
    "loss",
    "samples_per_second",
    "rounds_ok",
    "rounds_failed",
    "bytes_sent",
    "bytes_received",
)


class SnapshotExporter:
    """Feeds the monitor's snapshots to exporters: for each run, one point (tagged
    ``RUN/FIELD``, at the run's epoch) whenever its epoch moves forward (a run whose peers
    all left reads as epoch 0 with no peers: nothing is written for it)."""

    def __init__(self, exporters: Iterable[Exporter]):
        self.exporters = list(exporters)
        self._epochs: dict[str, int] = {}

    def export(self, snapshot: Mapping[str, Any]) -> int:
        """Write what is new in ``snapshot``; the number of points written."""
        points = 0
        for run in snapshot.get("runs", ()):
            run_id, epoch = run.get("run_id"), run.get("epoch")
            if not isinstance(run_id, str) or not isinstance(epoch, int):
                continue
            if epoch <= self._epochs.get(run_id, -1) or not run.get("num_peers"):
                continue
            self._epochs[run_id] = epoch
            scalars = {f"{run_id}/{field}": run.get(field) for field in RUN_FIELDS}
            for exporter in self.exporters:
                exporter.write(epoch, scalars)
            points += 1
        return points

    def close(self) -> None:
        for exporter in self.exporters:
            exporter.close()
