"""Hugging Face ``transformers.Trainer``, collaboratively: the Trainer gets a
``swarmgrad.Optimizer`` and ``SwarmgradCallback``; everything else is a usual script.

The first peer starts a swarm and prints its address; others join it::

    python examples/transformers_collaborative.py
    python examples/transformers_collaborative.py --initial-peers /ip4/.../tcp/PORT/p2p/12D3KooW...

``--local-peers 2`` starts two peers as child processes of this one instead. The model is
a small GPT-2 built from a config (no download) that reads bytes of Python's own
standard-library sources (real text, offline; a byte is a token, so no tokenizer); each
peer reads its own windows. ``pip install swarmgrad[transformers]``.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

import swarmgrad
from swarmgrad.integrations.transformers import SwarmgradCallback, collaborative_optimizers

CONTEXT, BATCH = 64, 16


def stdlib_windows(seed: int, count: int) -> tuple[list[dict], torch.Tensor]:
    """``count`` training windows of the stdlib's bytes, and 64 held-out windows."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-m]*.py"))
    text = b"".join(path.read_bytes() for path in sources)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))  # the last 10% is held out
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(cut - CONTEXT, (count,), generator=generator)
    train = [{"input_ids": data[s : s + CONTEXT], "labels": data[s : s + CONTEXT]} for s in starts]
    held = torch.randint(
        cut, len(data) - CONTEXT, (64,), generator=torch.Generator().manual_seed(0)
    )
    return train, torch.stack([data[s : s + CONTEXT] for s in held])


def held_out_loss(model: GPT2LMHeadModel, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)


def train(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("swarmgrad.integrations").setLevel(logging.INFO)  # one line per epoch
    dht = swarmgrad.DHT(initial_peers=args.initial_peers, start=True)
    print(f"To join, use --initial-peers {dht.get_visible_maddrs()[0]}", flush=True)

    torch.manual_seed(0)  # the same start everywhere (a joiner downloads it anyway)
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    opt = swarmgrad.Optimizer(
        dht=dht,
        run_id="transformers_stdlib",
        target_batch_size=args.target_batch_size,  # samples per global epoch, all peers
        batch_size_per_step=BATCH,  # = per_device_train_batch_size x accumulation steps
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        params=model.parameters(),
        matchmaking_time=3.0,
        averaging_timeout=30.0,
    )
    data, held_out = stdlib_windows(seed=dht.peer_id.to_bytes()[-1], count=100_000)
    before = held_out_loss(model, held_out)
    callback = SwarmgradCallback(opt, max_epochs=args.epochs)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="swarmgrad-transformers-"),
            per_device_train_batch_size=BATCH,
            max_steps=1_000_000,  # the callback stops at --epochs global epochs
            logging_steps=1,  # the callback reads the loss from the logs
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            log_level="warning",
        ),
        train_dataset=data,
        optimizers=collaborative_optimizers(opt),
        callbacks=[callback],
    )
    trainer.remove_callback(PrinterCallback)  # no dict printed per step
    try:
        trainer.train()
    finally:
        opt.shutdown()
        dht.shutdown()
    after = held_out_loss(model, held_out)
    print(f"global epoch {opt.local_epoch}: held-out loss {before:.3f} -> {after:.3f}", flush=True)


def run_local_swarm(args: argparse.Namespace) -> int:
    command = [sys.executable, __file__, "--epochs", str(args.epochs),
               "--target-batch-size", str(args.target_batch_size)]  # fmt: skip
    first = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    address = None
    for line in first.stdout:
        print(f"[peer 0] {line}", end="")
        if line.startswith("To join, use --initial-peers "):
            address = line.split()[-1]
            break
    if address is None:
        return first.wait() or 1
    others = [
        subprocess.Popen([*command, "--initial-peers", address])
        for _ in range(args.local_peers - 1)
    ]
    for line in first.stdout:
        print(f"[peer 0] {line}", end="")
    return max([first.wait(), *(other.wait() for other in others)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="*", default=[], help="a peer of the swarm")
    parser.add_argument("--epochs", type=int, default=30, help="global epochs to train")
    parser.add_argument("--target-batch-size", type=int, default=128)
    parser.add_argument("--local-peers", type=int, default=0, help="start this many peers")
    args = parser.parse_args()
    if args.local_peers:
        return run_local_swarm(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
