"""One peer of tests/integrations/test_transformers.py: a transformers.Trainer with a
swarmgrad Optimizer and SwarmgradCallback trains a tiny GPT-2 (its own process, since
accelerate keeps process-wide state that two Trainers in threads would share).

    python tests/helpers/transformers_worker.py --initial-peers ADDR --seed 0 --epochs 6 --out FILE

writes the final parameters, epoch and per-epoch history to FILE (torch.save)."""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from swarmgrad.dht import DHT
from swarmgrad.integrations.transformers import SwarmgradCallback, collaborative_optimizers
from swarmgrad.optim import Optimizer
from tests.helpers.optim import wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
VOCAB, LENGTH, BATCH = 16, 12, 8


def counting_sequences(seed: int, count: int = 256) -> list[dict]:
    """Token ids that count up modulo VOCAB from a random start: learnable, no tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    ids = (torch.randint(VOCAB, (count, 1), generator=generator) + torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16)
    return GPT2LMHeadModel(config)


def held_out_loss(model: GPT2LMHeadModel) -> float:
    ids = torch.stack([row["input_ids"] for row in counting_sequences(seed=999, count=64)])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def make_optimizer(dht: DHT, model: torch.nn.Module, run_id: str, **options) -> Optimizer:
    return Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=32,
        batch_size_per_step=options.pop("batch_size_per_step", BATCH),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        params=model.parameters(),
        matchmaking_time=1.0,
        averaging_timeout=15.0,
        **options,
    )


def training_arguments(output_dir, seed: int = 0, **options) -> TrainingArguments:
    options.setdefault("save_strategy", "no")
    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=BATCH,
        max_steps=options.pop("max_steps", 400),
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        **options,
    )


class WaitForPeers(transformers.TrainerCallback):
    """Begin only once this peer's tracker sees ``count`` peers (a run started together)."""

    def __init__(self, opt: Optimizer, count: int):
        self.opt, self.count = opt, count

    def on_train_begin(self, args, state, control, **kwargs):
        def all_seen() -> bool:
            self.opt.tracker.refresh(timeout=5)
            return self.opt.tracker.global_progress.num_peers >= self.count

        wait_until(all_seen, 30.0, f"{self.count} peers seeing each other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dht = DHT(initial_peers=args.initial_peers, start=True, host_maddrs=LOOPBACK)
    model = tiny_gpt2()
    opt = make_optimizer(dht, model, "transformers_test")
    try:
        callback = SwarmgradCallback(opt, max_epochs=args.epochs)
        trainer = Trainer(
            model=model,
            args=training_arguments(tempfile.mkdtemp(), seed=args.seed),
            train_dataset=counting_sequences(seed=args.seed),
            optimizers=collaborative_optimizers(opt),
            callbacks=[callback, WaitForPeers(opt, args.peers)],
        )
        trainer.train()
        result = {
            "parameters": [p.detach().clone() for p in model.parameters()],
            "epoch": opt.local_epoch,
            "history": callback.history,
        }
        torch.save(result, args.out)
    finally:
        opt.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
