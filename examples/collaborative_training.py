"""Collaborative training: several peers train one model by swapping the optimizer.

Each peer runs this script. The first one starts a swarm of its own::

    python examples/collaborative_training.py
    # ... To join, use --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW...

and the others join it (on this machine or any other that can reach the address)::

    python examples/collaborative_training.py --initial-peers /ip4/.../tcp/PORT/p2p/12D3KooW...

``python examples/collaborative_training.py --local-peers 3`` starts 3 peers as child
processes of this one instead, and prints what each of them reports.

The task is scikit-learn's bundled handwritten digits (real data, offline): an MLP,
trained with SGD on a global batch of ``--target-batch-size`` samples per epoch, which
the peers fill together with their local batches. Every peer prints its held-out
accuracy at the end; since the peers apply the same averaged update every epoch, they
print the same figure.

The training loop is an ordinary PyTorch loop; the only swarm-specific lines are the
``DHT`` and the ``Optimizer`` (``import swarmgrad as hivemind`` runs hivemind scripts).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import torch

import swarmgrad


def load_digits_split(seed: int = 0):
    """The 1,797 digits scaled to [0, 1], split 1,500 for training / 297 held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def train(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("swarmgrad.optim").setLevel(logging.INFO)  # verbose=True: one line per epoch
    dht = swarmgrad.DHT(initial_peers=args.initial_peers, start=True)
    if not args.initial_peers:
        print(f"To join, use --initial-peers {dht.get_visible_maddrs()[0]}", flush=True)

    torch.manual_seed(0)  # same initial model everywhere (a joiner downloads it anyway)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = swarmgrad.Optimizer(
        dht=dht,
        run_id="digits_example",  # peers with the same run_id train together
        target_batch_size=args.target_batch_size,  # samples per global epoch
        batch_size_per_step=args.batch_size,  # samples per local opt.step()
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
        params=model.parameters(),
        matchmaking_time=3.0,  # seconds to gather a group before an epoch is due
        averaging_timeout=30.0,
        verbose=True,
    )

    (train_x, train_y), (test_x, test_y) = load_digits_split()
    generator = torch.Generator().manual_seed(dht.peer_id.to_bytes()[-1])
    while opt.local_epoch < args.epochs:
        index = torch.randint(len(train_x), (args.batch_size,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(train_x[index]), train_y[index])
        loss.backward()
        opt.step()  # accumulates; once the swarm has target_batch_size samples: averages
        opt.zero_grad()

    with torch.no_grad():
        accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
    print(
        f"epoch {opt.local_epoch}: held-out accuracy {accuracy:.3f} "
        f"(first parameter sums to {next(model.parameters()).sum().item():.6f})",
        flush=True,
    )
    opt.shutdown()
    dht.shutdown()


def run_local_swarm(args: argparse.Namespace) -> int:
    """Start ``--local-peers`` copies of this script: the first one, then the rest joining it."""
    command = [sys.executable, __file__, "--epochs", str(args.epochs),
               "--target-batch-size", str(args.target_batch_size),
               "--batch-size", str(args.batch_size)]  # fmt: skip
    first = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    address = None
    for line in first.stdout:
        print(f"[peer 0] {line}", end="")
        if line.startswith("To join, use --initial-peers "):
            address = line.split()[-1]
            break
    if address is None:
        return first.wait() or 1
    join = [*command, "--initial-peers", address]
    others = [subprocess.Popen(join) for _ in range(args.local_peers - 1)]
    for line in first.stdout:
        print(f"[peer 0] {line}", end="")
    codes = [first.wait(), *(other.wait() for other in others)]
    return max(codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="*", default=[], help="a peer of the swarm")
    parser.add_argument("--epochs", type=int, default=30, help="global epochs to train")
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per local step")
    parser.add_argument(
        "--local-peers", type=int, default=0, help="start this many peers as child processes"
    )
    args = parser.parse_args()
    if args.local_peers:
        return run_local_swarm(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
