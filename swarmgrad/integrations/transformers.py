"""Hugging Face ``transformers.Trainer`` with a swarm: the collaborative optimizer and a
callback, as hivemind's ALBERT example trains.

::

    from swarmgrad.integrations.transformers import SwarmgradCallback, collaborative_optimizers

    opt = swarmgrad.Optimizer(dht=dht, run_id="my_run", target_batch_size=4096,
                              batch_size_per_step=args.per_device_train_batch_size
                              * args.gradient_accumulation_steps,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                              params=model.parameters(),
                              scheduler=lambda o: get_linear_schedule_with_warmup(o, 100, 10_000))
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=collaborative_optimizers(opt),
                      callbacks=[SwarmgradCallback(opt)])
    trainer.train()

The Trainer steps the optimizer after each (accumulated) batch, as always; the
:class:`swarmgrad.Optimizer` turns those into contributions to the swarm's global batch.
The Trainer also insists on a learning-rate scheduler that it steps after every batch;
:func:`collaborative_optimizers` hands it an
:class:`~swarmgrad.integrations.epoch_scheduler.EpochScheduler`, which advances a
schedule once per global epoch (or only reports the rate when the schedule is the
Optimizer's own ``scheduler=``). :class:`SwarmgradCallback` checks that the batch size
the Optimizer counts is what the Trainer feeds, loads the swarm's state when training
begins, logs each global epoch, keeps an in-memory backup of the model and optimizer and
restores it if the loss or the parameters stop being finite, and can stop training after
a number of global epochs. Trainer checkpoints include the Optimizer's epoch
(``Optimizer.state_dict``), so ``trainer.train(resume_from_checkpoint=...)`` resumes it.

Install with ``pip install swarmgrad[transformers]``; without it importing this module
raises :class:`~swarmgrad.integrations.MissingExtraError`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

import torch

from swarmgrad.integrations._extras import missing_extra
from swarmgrad.integrations.epoch_scheduler import EpochScheduler
from swarmgrad.optim import Optimizer
from swarmgrad.optim.optimizer_state import optimizer_parameters
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as error:
    raise missing_extra("transformers", __name__, error) from error

__all__ = ["SwarmgradCallback", "collaborative_optimizers"]

logger = logging.getLogger(__name__)


def collaborative_optimizers(
    optimizer: Optimizer, scheduler: Any = None
) -> tuple[Optimizer, EpochScheduler]:
    """The ``optimizers=`` pair for ``transformers.Trainer``: the swarmgrad Optimizer and
    a scheduler the Trainer may step after every batch without changing the schedule's
    pace (``scheduler``, over ``optimizer.opt``, advances once per global epoch)."""
    if not isinstance(optimizer, Optimizer):
        raise ValidationError(
            "collaborative_optimizers needs a swarmgrad.Optimizer, got "
            f"{type(optimizer).__name__} (wrap your torch optimizer in swarmgrad.Optimizer)"
        )
    return optimizer, EpochScheduler(optimizer, scheduler)


class SwarmgradCallback(TrainerCallback):
    """Keeps a ``transformers.Trainer`` in step with the swarm (module docstring).

    ``optimizer``: the swarmgrad Optimizer given to the Trainer. ``max_epochs``: stop
    training once this peer reaches that global epoch (None: the Trainer's own limits).
    ``backup_every_epochs``: how often the in-memory backup is refreshed.
    ``load_state_at_start``: download the swarm's state when training begins (a peer
    that joins a running swarm starts from its model rather than from scratch).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        max_epochs: int | None = None,
        backup_every_epochs: int = 5,
        load_state_at_start: bool = True,
    ):
        if not isinstance(optimizer, Optimizer):
            raise ValidationError(
                f"SwarmgradCallback needs the swarmgrad.Optimizer the Trainer uses, got "
                f"{type(optimizer).__name__}"
            )
        for name, value in (
            ("max_epochs", max_epochs),
            ("backup_every_epochs", backup_every_epochs),
        ):
            if value is not None:
                positive_int(name, value)
        self.optimizer = optimizer
        self.max_epochs, self.backup_every_epochs = max_epochs, backup_every_epochs
        self.load_state_at_start = load_state_at_start
        self.last_loss: float | None = None
        self.restores = 0  # how many times the backup was put back
        self.history: list[dict] = []  # one entry per global epoch this peer reached
        self._model: torch.nn.Module | None = None
        self._backup: tuple[dict, dict, list[torch.Tensor]] | None = None
        self._backup_epoch = -1
        self._last_epoch = optimizer.local_epoch
        self._epoch_started = time.monotonic()
        self._samples_at_epoch = 0

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._check_arguments(args)
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise ValidationError(
                "SwarmgradCallback: the Trainer passed no model to on_train_begin"
            )
        self._model = model
        if self.load_state_at_start:
            self.optimizer.load_state_from_peers()
        self._last_epoch = self.optimizer.local_epoch
        self._epoch_started = time.monotonic()
        self._take_backup()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and isinstance(logs.get("loss"), int | float):
            self.last_loss = float(logs["loss"])
            report = getattr(self.optimizer, "report", None)
            if callable(report):  # this peer's metrics record, for swarmgrad monitor
                report(self.last_loss)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._healthy():
            self._restore_backup()
            return
        epoch = self.optimizer.local_epoch
        if epoch != self._last_epoch:
            self._on_new_epoch(epoch, state)
        if self.max_epochs is not None and epoch >= self.max_epochs:
            control.should_training_stop = True

    # ------------------------------------------------------------------ internals

    def _check_arguments(self, args: TrainingArguments) -> None:
        fed = args.per_device_train_batch_size * args.gradient_accumulation_steps
        fed *= max(1, args.n_gpu)
        counted = self.optimizer.batch_size_per_step
        if counted is not None and counted != fed:
            raise ValidationError(
                f"the Optimizer counts batch_size_per_step={counted} samples per step, but "
                f"the Trainer feeds {fed} (per_device_train_batch_size="
                f"{args.per_device_train_batch_size} x gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps} x devices): make them equal"
            )
        if counted is None:
            raise ValidationError(
                "the Trainer calls opt.step() without a batch size: create the Optimizer "
                f"with batch_size_per_step={fed}"
            )
        if args.fp16:
            raise ValidationError(
                "fp16 training with a loss scaler is not supported with a swarmgrad "
                "Optimizer in the Trainer yet: use bf16 or float32"
            )

    def _healthy(self) -> bool:
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            return False
        assert self._model is not None
        return all(bool(torch.isfinite(p).all()) for p in self._model.parameters())

    def _on_new_epoch(self, epoch: int, state: TrainerState) -> None:
        now = time.monotonic()
        progress = self.optimizer.tracker.global_progress
        entry = {
            "epoch": epoch,
            "loss": self.last_loss,
            "peers": progress.num_peers,
            "seconds": now - self._epoch_started,
            "step": state.global_step,
        }
        self.history.append(entry)
        logger.info(
            "%s: global epoch %d, loss %s, %d peers, %.1f s since the last epoch",
            self.optimizer.run_id,
            epoch,
            "n/a" if self.last_loss is None else f"{self.last_loss:.4f}",
            progress.num_peers,
            entry["seconds"],
        )
        self._last_epoch, self._epoch_started = epoch, now
        if epoch - self._backup_epoch >= self.backup_every_epochs:
            self._take_backup()

    def _take_backup(self) -> None:
        assert self._model is not None
        # the optimizer's own parameters too: with offload_optimizer they are a copy of
        # the model's that the next update would start from
        self._backup = (
            copy.deepcopy(self._model.state_dict()),
            copy.deepcopy(self.optimizer.state_dict()),
            [p.detach().clone() for p in optimizer_parameters(self.optimizer.opt)],
        )
        self._backup_epoch = self.optimizer.local_epoch

    def _restore_backup(self) -> None:
        assert self._model is not None and self._backup is not None
        logger.warning(
            "%s: loss or parameters are not finite; restoring the backup of epoch %d",
            self.optimizer.run_id,
            self._backup_epoch,
        )
        model_state, optimizer_state, parameters = self._backup
        self._model.load_state_dict(model_state)
        self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        with torch.no_grad():
            for param, saved in zip(
                optimizer_parameters(self.optimizer.opt), parameters, strict=True
            ):
                param.copy_(saved)
        self.last_loss = None
        self.restores += 1
