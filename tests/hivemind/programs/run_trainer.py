#!/usr/bin/env python3
"""A collaborative ALBERT trainer written against hivemind's API, run on swarmgrad.

It makes the calls of hivemind's `examples/albert/run_trainer.py` with the same arguments
(the DHT with the run's validators, the collaborative Optimizer with offloading, delayed
updates and fp16 compression, signed metrics records in the DHT, state loaded from peers
at start); only the training loop is a plain one instead of transformers' Trainer, and
the model is as small as prepare_data.py makes it. Runs until interrupted (as hivemind's
does: max_steps is "forever"), or until --max_steps optimizer steps.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import asdict
from pathlib import Path

import model as albert
import torch
import utils
from arguments import (
    AlbertTrainingArguments,
    AveragerArguments,
    CollaborationArguments,
    DatasetArguments,
    ProgressTrackerArguments,
    parse_args_into_dataclasses,
)
from torch.utils.data import DataLoader

from swarmgrad import DHT, Float16Compression, Optimizer, get_dht_time
from swarmgrad.optim.state_averager import LRSchedulerBase
from swarmgrad.utils.logging import get_logger, use_hivemind_log_handler
from swarmgrad.utils.networking import log_visible_maddrs

use_hivemind_log_handler("in_root_logger")
logger = get_logger(__name__)


def get_model(training_args, config, tokenizer):
    output_dir = Path(training_args.output_dir)
    logger.info(f"Checkpoint dir {output_dir}, contents {list(output_dir.glob('checkpoint*'))}")
    latest_checkpoint_dir = max(output_dir.glob("checkpoint*"), default=None, key=os.path.getctime)
    if latest_checkpoint_dir is not None:
        logger.info(f"Loading model from {latest_checkpoint_dir}")
        return albert.load_model(str(latest_checkpoint_dir))
    logger.info("Training from scratch")
    return albert.new_model(config, tokenizer)


class CollaborativeCallback:
    """Reports this peer's progress to the run's metrics record once per global epoch and
    keeps a backup to return to if the parameters stop being finite (hivemind's example
    does this in a transformers TrainerCallback)."""

    def __init__(
        self,
        dht: DHT,
        optimizer: Optimizer,
        model: torch.nn.Module,
        local_public_key: bytes,
        statistics_expiration: float,
        backup_every_steps: int,
    ):
        self.model = model
        self.dht, self.optimizer = dht, optimizer
        self.local_public_key = local_public_key
        self.statistics_expiration = statistics_expiration
        self.last_reported_collaboration_step = -1
        self.samples = 0
        self.steps = 0
        self.loss = 0
        self.total_samples_processed = 0
        self.backup_every_steps = backup_every_steps
        self.latest_backup = self.backup_state()

    def on_train_begin(self):
        logger.info("Loading state from peers")
        self.optimizer.load_state_from_peers()

    def on_step_end(self, log_history: list[dict]):
        if not self.params_are_finite():
            self.restore_from_backup(self.latest_backup)
            return
        local_progress = self.optimizer.local_progress
        if log_history:
            self.loss += log_history[-1]["loss"]
            self.steps += 1
            if self.optimizer.local_epoch != self.last_reported_collaboration_step:
                self.last_reported_collaboration_step = self.optimizer.local_epoch
                self.total_samples_processed += self.samples
                samples_per_second = local_progress.samples_per_second
                statistics = utils.LocalMetrics(
                    step=self.optimizer.local_epoch,
                    samples_per_second=samples_per_second,
                    samples_accumulated=self.samples,
                    loss=self.loss,
                    mini_steps=self.steps,
                )
                logger.info(f"Step #{self.optimizer.local_epoch}")
                logger.info(f"Your current contribution: {self.total_samples_processed} samples")
                logger.info(f"Performance: {samples_per_second:.3f} samples/sec")
                if self.steps:
                    logger.info(f"Local loss: {self.loss / self.steps:.5f}")
                if self.optimizer.local_epoch % self.backup_every_steps == 0:
                    self.latest_backup = self.backup_state()
                self.loss = 0
                self.steps = 0
                if self.optimizer.is_synchronized_with_peers():
                    self.dht.store(
                        key=self.optimizer.run_id + "_metrics",
                        subkey=self.local_public_key,
                        value=statistics.dict(),
                        expiration_time=get_dht_time() + self.statistics_expiration,
                        return_future=True,
                    )
        self.samples = local_progress.samples_accumulated

    @torch.no_grad()
    def params_are_finite(self):
        return all(torch.all(torch.isfinite(p)) for p in self.model.parameters())

    @torch.no_grad()
    def backup_state(self) -> bytes:
        return pickle.dumps(
            {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        )

    @torch.no_grad()
    def restore_from_backup(self, backup: bytes):
        state = pickle.loads(backup)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class NoOpScheduler(LRSchedulerBase):
    """The training loop's scheduler does nothing: the real one is inside the Optimizer
    and steps once per global epoch."""

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self):
        self._last_lr = self.get_lr()

    def state_dict(self):
        return {}

    def load_state_dict(self, *args, **kwargs):
        logger.debug("Called NoOpScheduler.load_state_dict")


def train(model, optimizer, scheduler, callback, loader, training_args):
    """The part of transformers' Trainer.train that hivemind's example relies on."""
    callback.on_train_begin()
    model.train()
    log_history: list[dict] = []
    steps = 0
    batches = iter(loader)
    while steps < training_args.max_steps:
        step_loss = 0.0
        for _ in range(training_args.gradient_accumulation_steps):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            loss = model(**batch).loss / training_args.gradient_accumulation_steps
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training_args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        steps += 1
        log_history.append({"loss": step_loss, "step": steps})
        callback.on_step_end(log_history)


def main():
    training_args, dataset_args, collaboration_args, averager_args, tracker_args = (
        parse_args_into_dataclasses(
            AlbertTrainingArguments,
            DatasetArguments,
            CollaborationArguments,
            AveragerArguments,
            ProgressTrackerArguments,
        )
    )
    logger.info(
        f"Found {len(collaboration_args.initial_peers)} initial peers: "
        f"{collaboration_args.initial_peers}"
    )
    albert.set_seed(training_args.seed)
    torch.set_num_threads(1)

    config = albert.load_config(dataset_args.config_path)
    tokenizer = albert.load_tokenizer(dataset_args.tokenizer_path)
    model = get_model(training_args, config, tokenizer)
    tokenized_datasets = albert.load_dataset(dataset_args.dataset_path)
    data_collator = albert.data_collator(tokenizer)

    validators, local_public_key = utils.make_validators(collaboration_args.run_id)

    dht = DHT(
        start=True,
        initial_peers=collaboration_args.initial_peers,
        client_mode=collaboration_args.client_mode,
        record_validators=validators,
        use_ipfs=collaboration_args.use_ipfs,
        host_maddrs=collaboration_args.host_maddrs,
        announce_maddrs=collaboration_args.announce_maddrs,
        identity_path=collaboration_args.identity_path,
    )
    log_visible_maddrs(dht.get_visible_maddrs(), only_p2p=collaboration_args.use_ipfs)

    total_batch_size_per_step = (
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    )
    adjusted_target_batch_size = (
        collaboration_args.target_batch_size - collaboration_args.batch_size_lead
    )

    # a factory, not an optimizer instance, so that Optimizer(offload_optimizer=True) works
    def opt(params):
        return torch.optim.AdamW(
            params,
            lr=training_args.learning_rate,
            betas=(training_args.adam_beta1, training_args.adam_beta2),
            eps=training_args.adam_epsilon,
            weight_decay=training_args.weight_decay,
        )

    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": training_args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]

    def scheduler(opt):
        return albert.linear_schedule_with_warmup(
            opt,
            num_warmup_steps=training_args.warmup_steps,
            num_training_steps=training_args.total_steps,
        )

    optimizer = Optimizer(
        dht=dht,
        run_id=collaboration_args.run_id,
        target_batch_size=adjusted_target_batch_size,
        batch_size_per_step=total_batch_size_per_step,
        optimizer=opt,
        params=params,
        scheduler=scheduler,
        matchmaking_time=collaboration_args.matchmaking_time,
        averaging_timeout=collaboration_args.averaging_timeout,
        offload_optimizer=True,
        delay_optimizer_step=True,
        delay_grad_averaging=True,
        client_mode=collaboration_args.client_mode,
        grad_compression=Float16Compression(),
        state_averaging_compression=Float16Compression(),
        averager_opts={"bandwidth": collaboration_args.bandwidth, **asdict(averager_args)},
        tracker_opts=asdict(tracker_args),
        verbose=True,
    )

    # shuffle data independently on each peer, so that peers do not compute the same batches
    torch.manual_seed(hash(local_public_key))
    loader = DataLoader(
        tokenized_datasets["train"],
        batch_size=training_args.per_device_train_batch_size,
        shuffle=True,
        collate_fn=data_collator,
    )
    callback = CollaborativeCallback(
        dht,
        optimizer,
        model,
        local_public_key,
        collaboration_args.statistics_expiration,
        collaboration_args.backup_every_steps,
    )
    try:
        train(model, optimizer, NoOpScheduler(optimizer), callback, loader, training_args)
    except KeyboardInterrupt:
        logger.info("Interrupted: leaving the run")
    finally:
        optimizer.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
