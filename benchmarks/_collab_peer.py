"""One trainer of ``benchmarks/collaborative.py``: a hivemind-style training script.

The same code runs swarmgrad (``import swarmgrad as hivemind``) and hivemind itself
(``--impl hivemind``, in an interpreter that has it): switching is the import. It prints
one JSON line per event on stdout: ``ready`` (with the solo step time measured before
joining), ``epoch`` at each epoch this peer begins (time, samples it has processed so
far, its last loss), ``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def dump(value, path: str) -> None:
    """torch.save, atomically: the driver may read the file as soon as it appears."""
    torch.save(value, path + ".part")
    os.replace(path + ".part", path)


def efficiency_model() -> torch.nn.Module:
    """About 10M parameters (9.45M)."""
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
    )


def digits_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def digits_split():
    """scikit-learn's bundled digits (offline), scaled, 1,500 train / 297 held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    x, y = x[order], y[order]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("swarmgrad", "hivemind"), default="swarmgrad")
    parser.add_argument("--task", choices=("efficiency", "digits"), default="efficiency")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--run-id", default="bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-batch-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=2, help="rows really computed per step")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--delay", action="store_true", help="delay_optimizer_step/grad_averaging")
    parser.add_argument("--average-state-every", type=int, default=1)
    parser.add_argument("--dump-dir", default=None, help="save parameters at each epoch")
    args = parser.parse_args()

    if args.impl == "hivemind":
        import hivemind
    else:
        import swarmgrad as hivemind

    if os.environ.get("COLLAB_VERBOSE"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every peer starts from the same weights
    if args.task == "efficiency":
        model = efficiency_model()
        generator = torch.Generator().manual_seed(args.seed)

        def loss_of_batch() -> torch.Tensor:
            x = torch.randn(args.rows, 1024, generator=generator)
            return model(x).pow(2).mean()

    else:
        model = digits_model()
        (train_x, train_y), _ = digits_split()
        generator = torch.Generator().manual_seed(args.seed)

        def loss_of_batch() -> torch.Tensor:
            index = torch.randint(len(train_x), (args.batch_size,), generator=generator)
            return torch.nn.functional.cross_entropy(model(train_x[index]), train_y[index])

    def compute() -> float:
        loss = loss_of_batch()
        loss.backward()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # the accelerator's share of the step
        return float(loss.detach())

    # the solo step time: what this peer does per step with no swarm at all
    for timed in (False, True):  # 2 warm-up steps (allocations), then 10 timed ones
        began = time.perf_counter()
        for _ in range(10 if timed else 2):
            compute()
            model.zero_grad(set_to_none=True)
    solo_step = (time.perf_counter() - began) / 10

    dht = hivemind.DHT(initial_peers=args.initial_peers, start=True)
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        delay_optimizer_step=args.delay,
        delay_grad_averaging=args.delay,
        average_state_every=args.average_state_every,
        verbose=bool(os.environ.get("COLLAB_VERBOSE")),
    )
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    say(event="ready", pid=os.getpid(), solo_step=solo_step, maddrs=maddrs)

    samples, last_epoch, loss = 0, None, float("nan")
    deadline = time.monotonic() + 900
    while opt.local_epoch < args.epochs and time.monotonic() < deadline:
        if opt.local_epoch != last_epoch:
            last_epoch = opt.local_epoch
            say(event="epoch", epoch=last_epoch, time=time.time(), samples=samples, loss=loss)
            if args.dump_dir:
                flat = torch.cat([p.detach().flatten() for p in model.parameters()])
                dump(flat, os.path.join(args.dump_dir, f"{args.seed}_{last_epoch}.pt"))
        loss = compute()
        opt.step()
        opt.zero_grad()
        samples += args.batch_size
    say(event="epoch", epoch=opt.local_epoch, time=time.time(), samples=samples, loss=loss)
    if args.dump_dir:
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        dump(flat, os.path.join(args.dump_dir, f"{args.seed}_{opt.local_epoch}.pt"))
        if args.task == "digits":
            torch.save(model.state_dict(), os.path.join(args.dump_dir, f"model_{args.seed}.pt"))
    say(event="done")
    opt.shutdown()
    dht.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
