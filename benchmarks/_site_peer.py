"""One worker of ``benchmarks/sites.py``: a flat swarm peer, or one rank of a site.

``--mode flat``: one process, one ``swarmgrad.Optimizer`` peer. ``--mode site``: one rank
under ``torchrun`` (2 per site); the ranks form a ``SiteOptimizer`` whose speaker is the
site's peer. Either way the worker draws batches of ``--batch-size`` digits with its own
generator (``--index``: 0-3, the same four streams in both modes), stops at ``--epochs``
global epochs, and saves its final parameters to ``OUT/INDEX.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
from _collab_peer import digits_model, digits_split

import swarmgrad
from swarmgrad.optim.site import SiteOptimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("flat", "site"), required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--index", type=int, default=0, help="flat: this peer's stream")
    parser.add_argument("--site-index", type=int, default=0, help="site: streams 2i, 2i+1")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--step-sleep", type=float, default=0.01)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every worker starts from the same weights
    model = digits_model()
    (train_x, train_y), _ = digits_split()

    def swarm_optimizer(dht, params):
        return swarmgrad.Optimizer(
            dht=dht,
            run_id=args.run_id,
            target_batch_size=args.target_batch_size,
            batch_size_per_step=args.batch_size,
            params=params,
            optimizer=lambda p: torch.optim.SGD(p, lr=args.lr),
            matchmaking_time=1.0,
            averaging_timeout=30.0,
        )

    if args.mode == "site":
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        index = 2 * args.site_index + torch.distributed.get_rank()
        opt = SiteOptimizer(
            params=model.named_parameters(),
            batch_size_per_step=args.batch_size,
            dht_factory=lambda: swarmgrad.DHT(initial_peers=[args.peers], start=True),
            swarm_optimizer=swarm_optimizer,
        )
        dht = None
    else:
        index = args.index
        dht = swarmgrad.DHT(initial_peers=[args.peers], start=True)
        opt = swarm_optimizer(dht, list(model.parameters()))

    generator = torch.Generator().manual_seed(99 + index)
    samples, deadline = 0, time.monotonic() + 600
    while opt.local_epoch < args.epochs and time.monotonic() < deadline:
        batch = torch.randint(len(train_x), (args.batch_size,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(train_x[batch]), train_y[batch])
        loss.backward()
        time.sleep(args.step_sleep)  # the accelerator's share of the step
        opt.step()
        opt.zero_grad()
        samples += args.batch_size
    torch.save(
        {"epoch": opt.local_epoch, "samples": samples, "state": model.state_dict()},
        os.path.join(args.out, f"{index}.pt"),
    )
    opt.shutdown()
    if dht is not None:
        dht.shutdown()
    if args.mode == "site":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
