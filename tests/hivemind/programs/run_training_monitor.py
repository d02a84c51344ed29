#!/usr/bin/env python3
"""The training monitor of a collaborative ALBERT run, written against hivemind's API and
run on swarmgrad: the calls of hivemind's `examples/albert/run_training_monitor.py` with
the same arguments. It joins the DHT with the run's validators, reads every peer's signed
metrics record each refresh period, logs the swarm's loss per global step, and every few
steps downloads the training state from the trainers (a TrainingStateAverager under the
Optimizer's prefix) and saves it to --repo_path (where hivemind pushes it to the Hub).

--stop_at_step N (not in hivemind's script, which runs until interrupted) makes it exit
once it has logged step N or later and saved the state of that step.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import model as albert
import torch
import utils
from arguments import (
    AveragerArguments,
    BaseTrainingArguments,
    OptimizerArguments,
    parse_args_into_dataclasses,
)

import swarmgrad as hivemind
from swarmgrad.optim.state_averager import TrainingStateAverager
from swarmgrad.utils.logging import get_logger, use_hivemind_log_handler
from swarmgrad.utils.networking import log_visible_maddrs

use_hivemind_log_handler("in_root_logger")
logger = get_logger(__name__)


@dataclass
class TrainingMonitorArguments(BaseTrainingArguments):
    refresh_period: float = 30  # seconds between reads of the metrics
    store_checkpoints: bool = True
    save_checkpoint_step_interval: int = 5
    model_config_path: str = "data/config"
    tokenizer_path: str = "data/tokenizer"
    repo_path: str | None = None  # where the downloaded state is saved
    upload_interval: float | None = None  # seconds between saves
    stop_at_step: int | None = None


class CheckpointHandler:
    def __init__(
        self,
        monitor_args: TrainingMonitorArguments,
        optimizer_args: OptimizerArguments,
        averager_args: AveragerArguments,
        dht: hivemind.DHT,
    ):
        self.save_checkpoint_step_interval = monitor_args.save_checkpoint_step_interval
        self.repo_path = monitor_args.repo_path
        self.upload_interval = monitor_args.upload_interval
        self.previous_step = -1

        config = albert.load_config(monitor_args.model_config_path)
        tokenizer = albert.load_tokenizer(monitor_args.tokenizer_path)
        self.model = albert.new_model(config, tokenizer)

        no_decay = ["bias", "LayerNorm.weight"]
        optimizer_grouped_parameters = [
            {
                "params": [
                    p
                    for n, p in self.model.named_parameters()
                    if not any(nd in n for nd in no_decay)
                ],
                "weight_decay": 0.01,
            },
            {
                "params": [
                    p for n, p in self.model.named_parameters() if any(nd in n for nd in no_decay)
                ],
                "weight_decay": 0.0,
            },
        ]
        opt = torch.optim.AdamW(optimizer_grouped_parameters, lr=0.00176, weight_decay=0.01)

        self.state_averager = TrainingStateAverager(
            dht=dht,
            optimizer=opt,
            scheduler=albert.linear_schedule_with_warmup(
                opt, num_warmup_steps=5000, num_training_steps=125_000
            ),
            prefix=f"{run_id}_state_averager",
            state_compression=hivemind.compression.Float16Compression(),
            bandwidth=optimizer_args.bandwidth,
            client_mode=optimizer_args.client_mode,
            start=True,
            **asdict(averager_args),
        )
        self.previous_timestamp = time.time()
        self.saved_steps: list[int] = []

    def is_time_to_save_state(self, cur_step):
        if self.save_checkpoint_step_interval is None:
            return False
        return cur_step - self.previous_step >= self.save_checkpoint_step_interval

    def save_state(self, cur_step):
        logger.info("Saving state from peers")
        self.state_averager.load_state_from_peers()
        self.previous_step = cur_step

    def is_time_to_upload(self):
        if self.repo_path is None:
            return False
        return time.time() - self.previous_timestamp >= self.upload_interval

    def upload_checkpoint(self, current_step, current_loss):
        logger.info("Saving optimizer")
        os.makedirs(self.repo_path, exist_ok=True)
        torch.save(
            self.state_averager.optimizer.state_dict(), f"{self.repo_path}/optimizer_state.pt"
        )
        self.previous_timestamp = time.time()
        albert.save_model(self.model, self.repo_path)
        self.saved_steps.append(current_step)
        logger.info(
            f"Saved the state of step #{current_step} (loss {current_loss:.3f}) to {self.repo_path}"
        )


if __name__ == "__main__":
    monitor_args, optimizer_args, averager_args = parse_args_into_dataclasses(
        TrainingMonitorArguments, OptimizerArguments, AveragerArguments
    )
    torch.set_num_threads(1)
    run_id = monitor_args.run_id
    validators, local_public_key = utils.make_validators(run_id)

    dht = hivemind.DHT(
        start=True,
        initial_peers=monitor_args.initial_peers,
        record_validators=validators,
        use_ipfs=monitor_args.use_ipfs,
        host_maddrs=monitor_args.host_maddrs,
        announce_maddrs=monitor_args.announce_maddrs,
        identity_path=monitor_args.identity_path,
    )
    log_visible_maddrs(dht.get_visible_maddrs(), only_p2p=monitor_args.use_ipfs)

    current_step = 0
    if monitor_args.store_checkpoints:
        checkpoint_handler = CheckpointHandler(monitor_args, optimizer_args, averager_args, dht)

    while True:
        metrics_dict = dht.get(run_id + "_metrics", latest=True)
        if metrics_dict is not None:
            metrics_dict = metrics_dict.value
            metrics = [
                utils.LocalMetrics.parse_obj(metrics_dict[peer].value) for peer in metrics_dict
            ]
            latest_step = max(item.step for item in metrics)

            if latest_step != current_step:
                logger.debug(f"Got metrics from {len(metrics)} peers")
                for i, metrics_for_peer in enumerate(metrics):
                    logger.debug(f"{i} peer {metrics_for_peer}")

                current_step = latest_step
                alive_peers = 0
                sum_loss = 0
                num_samples = 0
                sum_perf = 0
                sum_mini_steps = 0
                for item in metrics:
                    sum_loss += item.loss
                    alive_peers += 1
                    sum_perf += item.samples_per_second
                    num_samples += item.samples_accumulated
                    sum_mini_steps += item.mini_steps
                current_loss = sum_loss / sum_mini_steps
                logger.info(f"Step #{current_step}\tloss = {current_loss:.5f}")

                if monitor_args.store_checkpoints:
                    if checkpoint_handler.is_time_to_save_state(current_step):
                        checkpoint_handler.save_state(current_step)
                        if checkpoint_handler.is_time_to_upload():
                            checkpoint_handler.upload_checkpoint(current_step, current_loss)
        stop = monitor_args.stop_at_step
        if stop is not None and current_step >= stop:
            if not monitor_args.store_checkpoints or checkpoint_handler.saved_steps:
                break
        logger.debug("Peer is still alive...")
        time.sleep(monitor_args.refresh_period)

    if monitor_args.store_checkpoints:
        checkpoint_handler.state_averager.shutdown()
    dht.shutdown()
    logger.info("Monitor finished")
