"""PyTorch Lightning, collaboratively: the same LightningModule and Trainer as usual, with
``strategy=SwarmgradStrategy(...)``.

The first peer starts a swarm and prints its address; others join it, from this machine
or any that can reach it::

    python examples/lightning_collaborative.py
    python examples/lightning_collaborative.py --initial-peers /ip4/.../tcp/PORT/p2p/12D3KooW...

``--local-peers 2`` starts two peers as child processes of this one instead. The task is
scikit-learn's bundled handwritten digits (``pip install swarmgrad[lightning,demo]``):
each peer reads its own shuffle of the data; every ``--target-batch-size`` samples of the
swarm, the peers average their gradients and take one step together, so they end with
the same model and print the same accuracy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import lightning.pytorch as pl
import torch

from swarmgrad.integrations.lightning import SwarmgradStrategy


class DigitsClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same start everywhere (a joiner downloads it anyway)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        # stepped by Lightning after every batch; the strategy makes it once per global epoch
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class GlobalEpochs(pl.Callback):
    """Lightning counts passes over the local data; a swarm counts global epochs. Waits
    for ``min_peers`` after the first batch, stops after ``epochs`` global epochs."""

    def __init__(self, epochs: int, min_peers: int):
        self.epochs, self.min_peers = epochs, min_peers

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        opt = trainer.strategy.optimizers[0]
        while trainer.global_step <= 1 and trainer.strategy.num_peers < self.min_peers:
            opt.tracker.refresh(timeout=5)  # a lone first peer would train alone meanwhile
        if opt.local_epoch >= self.epochs:
            trainer.should_stop = True


def digits(seed: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = torch.utils.data.TensorDataset(x[order[:1500]], y[order[:1500]])
    loader = torch.utils.data.DataLoader(
        train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return loader, (x[order[1500:]], y[order[1500:]])


def train(args: argparse.Namespace) -> None:
    strategy = SwarmgradStrategy(
        target_batch_size=args.target_batch_size,
        run_id="lightning_digits",
        initial_peers=args.initial_peers or None,
        matchmaking_time=3.0,
        averaging_timeout=30.0,
    )
    print(f"To join, use --initial-peers {strategy.peer_addresses[0]}", flush=True)
    model = DigitsClassifier()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1000,
        callbacks=[GlobalEpochs(args.epochs, args.min_peers)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
    )
    loader, (test_x, test_y) = digits(seed=strategy.dht.peer_id.to_bytes()[-1])
    trainer.fit(model, loader)
    with torch.no_grad():
        accuracy = (model.net(test_x).argmax(-1) == test_y).float().mean().item()
    print(f"global epoch {args.epochs}: held-out accuracy {accuracy:.3f}", flush=True)


def run_local_swarm(args: argparse.Namespace) -> int:
    command = [sys.executable, __file__, "--epochs", str(args.epochs),
               "--target-batch-size", str(args.target_batch_size),
               "--min-peers", str(args.local_peers)]  # fmt: skip
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
    parser.add_argument("--epochs", type=int, default=20, help="global epochs to train")
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--min-peers", type=int, default=1, help="wait for this many peers")
    parser.add_argument("--local-peers", type=int, default=0, help="start this many peers")
    args = parser.parse_args()
    if args.local_peers:
        return run_local_swarm(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
