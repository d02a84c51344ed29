"""One peer of ``benchmarks/dedloc_heterogeneous.py``, or the solo measurement of them all.

A peer trains a small MLP (real forward and backward on a regression task, so the
gradients are real) with :class:`swarmgrad.Optimizer`; each local step also sleeps
``--step-sleep`` seconds, the rest of a step on the accelerator this peer would have, so
peers differ in speed as volunteers' machines do. ``--bandwidth`` (Mbit/s) is announced
to the averagers, which size the peer's share of the all-reduce to it; without it the
peer announces nothing and every peer that can reduce gets an equal share.

Prints JSON lines: ``ready``, ``epoch`` (each epoch this peer begins: time, samples it has
processed, its last loss, and ``full``: whether the gradient round that ended the previous
epoch averaged every span with every member, null if this peer took no part in one),
``done``.

``--solo 0.1,0.2,...``: no swarm at all; for each step sleep, one after another in this
process, the rate of a peer alone with no averaging (one ``solo`` line each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

INPUT = 64


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def make_model(hidden: int) -> torch.nn.Module:
    """About ``2 * 64 * hidden`` parameters (hidden 8192: 1.06M)."""
    return torch.nn.Sequential(
        torch.nn.Linear(INPUT, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, INPUT)
    )


def make_step(
    model: torch.nn.Module, batch_size: int, step_sleep: float, seed: int
) -> Callable[[], float]:
    """One local step's work: a batch's forward and backward, then the accelerator's sleep.
    The task (a fixed random linear map plus noise) is the same on every peer."""
    teacher = torch.randn(INPUT, INPUT, generator=torch.Generator().manual_seed(12345)) / 8
    generator = torch.Generator().manual_seed(1000 + seed)

    def step() -> float:
        x = torch.randn(batch_size, INPUT, generator=generator)
        y = x @ teacher + 0.01 * torch.randn(batch_size, INPUT, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step_sleep:
            time.sleep(step_sleep)
        return float(loss.detach())

    return step


def solo(args) -> None:
    """Each profile alone: no DHT, no averaging, a local SGD step per batch."""
    for index, step_sleep in enumerate(float(s) for s in args.solo.split(",")):
        torch.manual_seed(0)
        model = make_model(args.hidden)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        step = make_step(model, args.batch_size, step_sleep, index)
        for timed in (False, True):  # warm-up steps (allocations), then the timed ones
            began = time.perf_counter()
            for _ in range(args.solo_steps if timed else 2):
                step()
                opt.step()
                opt.zero_grad()
        seconds = (time.perf_counter() - began) / args.solo_steps
        say(event="solo", step_sleep=step_sleep, step_s=seconds, rate=args.batch_size / seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--solo", default=None, help="comma-separated step sleeps")
    parser.add_argument("--solo-steps", type=int, default=12)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--run-id", default="dedloc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--bandwidth", type=float, default=None, help="announced, Mbit/s")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--target-batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds, then stop")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.solo is not None:
        solo(args)
        return

    import swarmgrad

    if os.environ.get("DEDLOC_VERBOSE"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)  # every peer starts from the same weights
    model = make_model(args.hidden)
    step = make_step(model, args.batch_size, args.step_sleep, args.seed)

    # a client-mode peer listens nowhere (behind NAT in the lab: it could not be dialed)
    host_maddrs = [] if args.client_mode else [f"/ip4/{args.host}/tcp/0"]
    dht = swarmgrad.DHT(
        initial_peers=args.initial_peers,
        host_maddrs=host_maddrs,
        client_mode=args.client_mode,
        start=True,
    )
    averager_opts = {} if args.bandwidth is None else {"bandwidth": args.bandwidth}
    opt = swarmgrad.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        client_mode=args.client_mode,
        averager_opts=averager_opts,
        verbose=bool(os.environ.get("DEDLOC_VERBOSE")),
    )
    say(event="ready", pid=os.getpid())

    def round_outcome() -> bool | None:
        result = opt.grad_averager.last_result
        if result is None or result.group_id == seen_rounds[-1]:
            return None
        seen_rounds.append(result.group_id)
        return result.fully_averaged

    seen_rounds: list[bytes | None] = [None]
    samples, last_epoch, loss = 0, None, float("nan")
    deadline = time.monotonic() + args.deadline
    while opt.local_epoch < args.epochs and time.monotonic() < deadline:
        if opt.local_epoch != last_epoch:
            last_epoch = opt.local_epoch
            say(event="epoch", epoch=last_epoch, time=time.time(), samples=samples, loss=loss,
                full=round_outcome())  # fmt: skip
        loss = step()
        opt.step()
        opt.zero_grad()
        samples += args.batch_size
    say(event="epoch", epoch=opt.local_epoch, time=time.time(), samples=samples, loss=loss,
        full=round_outcome())  # fmt: skip
    say(event="done")
    opt.shutdown()
    dht.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
