"""``swarmgrad demo moe``: a whole decentralized mixture-of-experts swarm on this machine.

What it shows, in about two minutes on 2 cores:

1. a bootstrap peer (``swarmgrad dht``) and several expert servers (``swarmgrad server``),
   each a separate process talking over real encrypted sockets on loopback;
2. a trainer (this process) whose network has a :class:`RemoteMixtureOfExperts` layer:
   every batch is routed by a gate to the best live experts found in the DHT, which run
   forward and backward on the servers and update their own weights there;
3. midway, one expert server is killed with SIGKILL (no goodbye); training carries on
   with the experts that remain, which the progress bar shows;
4. the test accuracy and a summary at the end.

The data are scikit-learn's bundled handwritten digits (1,797 real 8x8 images, shipped
inside the scikit-learn wheel, so the demo needs no download).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from collections.abc import Iterator

from swarmgrad.cli.demo_processes import ChildProcess, spawn, stop_all

__all__ = ["add_arguments", "run"]

_HIDDEN = 64
_NUM_CLASSES = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-servers", "--num_servers", type=int, default=3)
    parser.add_argument(
        "--experts-per-server", "--experts_per_server", type=int, default=4,
        help="distinct experts each server hosts",
    )  # fmt: skip
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32)
    parser.add_argument("--k-best", "--k_best", type=int, default=2)
    parser.add_argument(
        "--kill-at", "--kill_at", type=float, default=0.5,
        help="fraction of training after which one expert server is SIGKILLed (0: never)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    parser.set_defaults(run=run)


@contextlib.contextmanager
def _swarm(num_servers: int, experts_per_server: int) -> Iterator[tuple[str, list[ChildProcess]]]:
    """Start the bootstrap peer and the expert servers; stop them all on exit."""
    processes: list[ChildProcess] = []
    try:
        boot = spawn("bootstrap peer", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
        processes.append(boot)
        bootstrap = boot.wait_for_maddr(60)
        servers = []
        for index in range(num_servers):
            first = index * experts_per_server
            pattern = f"expert.[{first}:{first + experts_per_server}]"
            server = spawn(
                f"expert server {index + 1}",
                "server",
                "--expert-cls", "ffn",
                "--hidden-dim", str(_HIDDEN),
                "--num-experts", str(experts_per_server),
                "--expert-pattern", pattern,
                "--max-batch-size", "1024",
                "--optimizer", "adam",
                "--update-period", "2",
                "--expiration", "6",
                "--initial-peers", bootstrap,
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            )  # fmt: skip
            processes.append(server)
            servers.append(server)
        for server in servers:
            server.wait_for_maddr(120)
        yield bootstrap, servers
    finally:
        stop_all(processes)


# ---------------------------------------------------------------------- training


def _load_digits(seed: int):
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-3
    x = (x - mean) / std
    return (x[:split], y[:split]), (x[split:], y[split:])


def _accuracy(model, x, y, batch_size: int = 256) -> float:
    import torch

    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start : start + batch_size])
            correct += (logits.argmax(-1) == y[start : start + batch_size]).sum().item()
    return correct / len(x)


def run(args: argparse.Namespace) -> int:
    # One intra-op thread per process: five processes share two cores here, and idle
    # OpenMP workers that spin on an oversubscribed machine stall everybody.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from torch import nn

    from swarmgrad.dht import DHT
    from swarmgrad.moe import RemoteMixtureOfExperts
    from swarmgrad.utils.logging import use_swarmgrad_log_handler

    use_swarmgrad_log_handler("WARNING")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (train_x, train_y), (test_x, test_y) = _load_digits(args.seed)
    num_experts = args.num_servers * args.experts_per_server
    print(
        f"swarmgrad demo: {args.num_servers} expert servers x {args.experts_per_server} "
        f"experts, digits dataset ({len(train_x)} train / {len(test_x)} test images)",
        flush=True,
    )
    started = time.monotonic()
    with _swarm(args.num_servers, args.experts_per_server) as (bootstrap, servers):
        print(f"swarm up in {time.monotonic() - started:.1f} s; bootstrap peer {bootstrap}")
        dht = DHT(initial_peers=[bootstrap], start=True)
        try:
            moe = RemoteMixtureOfExperts(
                in_features=_HIDDEN,
                grid_size=(num_experts,),
                dht=dht,
                uid_prefix="expert.",
                k_best=args.k_best,
                k_min=1,
                forward_timeout=10.0,
                timeout_after_k_min=1.0,
                backward_timeout=10.0,
                allow_zero_outputs=True,
            )
            model = nn.Sequential(
                nn.Linear(64, _HIDDEN), nn.ReLU(), moe, nn.Linear(_HIDDEN, _NUM_CLASSES)
            )
            summary = _train(model, moe, servers, dht, args, train_x, train_y)
            accuracy = _accuracy(model, test_x, test_y)
        finally:
            dht.shutdown()
    elapsed = time.monotonic() - started
    print(
        f"\nTest accuracy: {accuracy:.1%} on {len(test_x)} held-out images\n"
        f"Summary: {summary['steps']} steps in {elapsed:.0f} s through {num_experts} remote "
        f"experts on {args.num_servers} servers; {summary['killed']} after step "
        f"{summary['kill_step']}; training went on with {summary['live_after']} servers; "
        f"final training loss {summary['loss']:.3f}.",
        flush=True,
    )
    return 0 if accuracy > 0.5 else 1


def _train(model, moe, servers, dht, args, train_x, train_y) -> dict:
    import torch
    from torch import nn
    from tqdm import tqdm

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = (len(train_x) + args.batch_size - 1) // args.batch_size
    total = steps_per_epoch * args.epochs
    kill_step = int(total * args.kill_at) if args.kill_at > 0 else None
    summary = {"steps": 0, "killed": "no server was killed", "kill_step": "-", "loss": 0.0}
    summary["live_after"] = len(servers)
    bar = tqdm(total=total, disable=args.no_progress, unit="step", dynamic_ncols=True)
    ema_loss = ema_acc = None
    generator = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_x), generator=generator)
        for start in range(0, len(train_x), args.batch_size):
            index = order[start : start + args.batch_size]
            logits = model(train_x[index])
            loss = loss_fn(logits, train_y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            accuracy = (logits.argmax(-1) == train_y[index]).float().mean().item()
            ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
            ema_acc = accuracy if ema_acc is None else 0.9 * ema_acc + 0.1 * accuracy
            summary["steps"] += 1
            if summary["steps"] == kill_step:
                victim = servers[-1]
                victim.stop(signal.SIGKILL)
                summary["killed"] = f"{victim.name} was SIGKILLed"
                summary["kill_step"] = kill_step
                summary["live_after"] = sum(s.popen.poll() is None for s in servers)
                bar.write(f"step {kill_step}: killed {victim.name} (SIGKILL); training goes on")
            bar.set_postfix(
                epoch=epoch + 1, loss=f"{ema_loss:.3f}", acc=f"{ema_acc:.1%}",
                servers=sum(s.popen.poll() is None for s in servers),
            )  # fmt: skip
            bar.update(1)
            if args.no_progress and summary["steps"] % steps_per_epoch == 0:
                print(f"epoch {epoch + 1}: loss {ema_loss:.3f}, accuracy {ema_acc:.1%}")
    bar.close()
    summary["loss"] = ema_loss or 0.0
    return summary
