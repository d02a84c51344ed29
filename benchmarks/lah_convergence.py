"""Learning@home, convergence under delay and failure, on scikit-learn's digits.

The convergence experiment of Ryabinin & Gusev (2020), scaled to this machine: a small
classifier (64 pixels -> ``Linear`` + ReLU to ``--hidden`` (64) -> two DMoE layers ->
``Linear`` to 10 classes) whose DMoE layers are :class:`RemoteMixtureOfExperts` over a
``2 x 2`` grid of ``ffn`` experts each (``k_best`` 2), served by 4 swarmgrad expert
:class:`Server` peers on the simulated network (:mod:`_lah_swarm`, real time). Conditions:

* ``dmoe_0ms``: no added delay;
* ``dmoe_100ms``, ``dmoe_1000ms``: every expert call takes that much longer (half of it
  each way on the simulated links), forward and backward;
* ``dmoe_1000ms_fail10``: the same, and 10% of expert calls (forward and backward) fail
  on the server before reaching the expert (the caller gets an error one round trip
  later and the layer carries on with the experts that answered);
* ``dense``: the same model with each DMoE layer replaced by one ffn block as wide as all
  of its experts together (equal parameter count), trained synchronously in-process.

Training is asynchronous, as in Learning@home: to keep starting a batch of ``--batch``
(32) every ``--interval`` (300 ms) despite the delay, a trainer keeps as many batches in
flight as a step's delay requires (1 at 0 ms, 2 at 100 ms, 14 at 1,000 ms: a step makes
four expert calls one after another), each computed on a snapshot of the trainer's own
layers (gates, input and output layers: a master copy), whose gradients are applied to
the master when the batch comes back. So with a delay, both the experts (updated by each
backward call) and the trainer's layers receive gradients computed on stale weights. A
*step* is one batch's update of the trainer's layers; ``staleness`` is how many other
steps happened between a batch's snapshot and its update (about ``in_flight - 1``; set
by the delay, not by this machine's speed). Every optimizer is Adam with lr ``LAH_LR``
(1e-4): at 1e-3 (and with plain SGD at 0.05-0.1) even the dense model, trained locally
on gradients 10 steps stale, falls to chance level, so how many batches are in flight
and the learning rate together decide whether a delay is survivable. Accuracy on a
held-out 20% of the digits is measured every ``--eval-every`` steps (through the same
experts, with the same delays and failures). ``--seeds`` (5) seeds per condition, run
concurrently (each its own swarm; they mostly wait on the network).

Prints a table and, last, one JSON line. ``LAH_SMALL=1`` (or ``--small``) is a
seconds-long configuration for tests; ``LAH_PLOT`` is where the PNG goes (empty: none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lah_swarm import SimSwarm
from _results import figure_path

from swarmgrad.moe import RemoteMixtureOfExperts
from swarmgrad.moe.client import NoExpertsAnswered
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.moe.server.layers import name_to_block

DEFAULT_PLOT = figure_path("lah_convergence.png")
GRID = (2, 2)
SERVERS = 4
LR = float(os.environ.get("LAH_LR", "1e-4"))
_SETUP = threading.Lock()  # seeded set-up (torch's global generator) one run at a time
CLASSES = 10

#: condition -> (delay of each expert call in seconds, fraction of calls failing)
CONDITIONS = {
    "dmoe_0ms": (0.0, 0.0),
    "dmoe_100ms": (0.1, 0.0),
    "dmoe_1000ms": (1.0, 0.0),
    "dmoe_1000ms_fail10": (1.0, 0.1),
}


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test = order[: len(x) // 5]
    train = order[len(x) // 5 :]
    return x[train], y[train], x[test], y[test]


# ---------------------------------------------------------------------- models


class WideFFN(nn.Module):
    """One ffn block (pre-norm, residual, GELU) with an inner width of ``inner``."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Dense(nn.Module):
    """The dense baseline: each DMoE layer is one ffn block as wide as its experts."""

    def __init__(self, hidden: int, experts: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(64, hidden)
        self.blocks = nn.ModuleList(WideFFN(hidden, 4 * hidden * experts) for _ in range(layers))
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Local(nn.Module):
    """The trainer's own layers of the DMoE model: input layer, one gate per DMoE layer
    (scores along each grid dimension), output layer. The experts live on the servers."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(64, hidden)
        self.gates = nn.ModuleList(nn.Linear(hidden, sum(GRID)) for _ in range(layers))
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor, moes: list[RemoteMixtureOfExperts]) -> torch.Tensor:
        h = F.relu(self.inp(x))
        for gate, moe in zip(self.gates, moes, strict=True):
            h = mix(moe, gate(h).split(GRID, dim=-1), h)
        return self.head(h)


def mix(moe: RemoteMixtureOfExperts, grid_scores, h: torch.Tensor) -> torch.Tensor:
    """What ``RemoteMixtureOfExperts.forward`` computes, with the gate's scores given:
    the experts' answers averaged with softmax weights over the answering experts'
    scores (so many batches can share one layer object and its connections, each with
    its own snapshot of the gate)."""
    mask, coords, (outputs,) = moe.call_experts(grid_scores, (h,))
    logits = moe.compute_scores(grid_scores, coords)
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=1) * mask
    return (weights.unsqueeze(-1) * outputs).sum(dim=1)


def dmoe_parameters(hidden: int, layers: int) -> int:
    expert = sum(p.numel() for p in name_to_block["ffn"](hidden).parameters())
    local = sum(p.numel() for p in Local(hidden, layers).parameters())
    return local + expert * GRID[0] * GRID[1] * layers


# ---------------------------------------------------------------------- training


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(dim=1) == y).float().mean())


def train_dense(args, seed: int, data) -> dict:
    x, y, x_test, y_test = data
    torch.manual_seed(seed)
    model = Dense(args.hidden, GRID[0] * GRID[1], args.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(1000 + seed)
    curve = []
    for step in range(1, args.steps + 1):
        index = torch.randint(len(x), (args.batch,), generator=generator)
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.eval_every == 0:
            with torch.no_grad():
                curve.append((step, accuracy(model(x_test), y_test)))
    return {"curve": curve, "staleness": 0.0, "failed_steps": 0, "in_flight": 1}


def expert_backends(hidden: int, layers: int, server: int) -> dict[str, ModuleBackend]:
    backends = {}
    for layer in range(layers):
        for i in range(GRID[0]):
            for j in range(GRID[1]):
                if (i * GRID[1] + j) % SERVERS != server:
                    continue
                uid = f"digits{layer}.{i}.{j}"
                module = name_to_block["ffn"](hidden)
                backends[uid] = ModuleBackend(
                    uid,
                    module,
                    optimizer=torch.optim.Adam(module.parameters(), lr=LR),
                    args_schema=(BatchTensorDescriptor(hidden),),
                )
    return backends


class AsyncTrainer:
    """Keeps ``in_flight`` batches going, each computed on a snapshot of the master
    weights, whose gradients are applied to the master when they come back
    (asynchronous SGD)."""

    def __init__(self, args, seed: int, data, moes: list[RemoteMixtureOfExperts], in_flight: int):
        self.args, self.data, self.moes, self.in_flight = args, data, moes, in_flight
        torch.manual_seed(seed)
        self.master = Local(args.hidden, args.layers)
        self.optimizer = torch.optim.Adam(self.master.parameters(), lr=LR)
        self.lock = threading.Lock()
        self.version = 0
        self.started = 0
        self.staleness: list[int] = []
        self.failed = 0
        self.curve: list[tuple[int, float]] = []
        self.generator = torch.Generator().manual_seed(1000 + seed)
        self.evaluations = concurrent.futures.ThreadPoolExecutor(2)

    def snapshot(self) -> tuple[Local, int]:
        replica = Local(self.args.hidden, self.args.layers)
        with self.lock, torch.no_grad():
            for mine, master in zip(replica.parameters(), self.master.parameters(), strict=True):
                mine.copy_(master)
            return replica, self.version

    def batch(self, index: torch.Tensor) -> None:
        x, y = self.data[0][index], self.data[1][index]
        replica, version = self.snapshot()
        try:
            F.cross_entropy(replica(x, self.moes), y).backward()
        except NoExpertsAnswered:
            # every expert a sample chose failed (forward), or every expert called by a
            # layer failed (backward: with 10% failing calls, 1% when all the batch's
            # samples chose the same two experts): the layer raises and the batch is lost
            with self.lock:
                self.failed += 1
            return
        with self.lock:
            for master, mine in zip(self.master.parameters(), replica.parameters(), strict=True):
                master.grad = mine.grad
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.staleness.append(self.version - version)
            self.version += 1
            step = self.version
        if step % self.args.eval_every == 0:
            self.evaluations.submit(self.evaluate, step, self.snapshot()[0])

    def evaluate(self, step: int, replica: Local) -> None:
        with torch.no_grad():
            acc = accuracy(replica(self.data[2], self.moes), self.data[3])
        with self.lock:
            self.curve.append((step, acc))

    def worker(self) -> None:
        while True:
            with self.lock:
                if self.started >= self.args.steps:
                    return
                self.started += 1
                index = torch.randint(
                    len(self.data[0]), (self.args.batch,), generator=self.generator
                )
            self.batch(index)

    def run(self) -> dict:
        threads = [threading.Thread(target=self.worker) for _ in range(self.in_flight)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.version % self.args.eval_every:  # lost batches: fewer steps than started
            self.evaluate(self.version, self.snapshot()[0])
        self.evaluations.shutdown(wait=True)
        self.curve.sort()
        return {
            "curve": self.curve,
            "staleness": statistics.mean(self.staleness) if self.staleness else 0.0,
            "failed_steps": self.failed,
            "in_flight": self.in_flight,
        }


def batches_in_flight(args, delay: float) -> int:
    """Batches a trainer keeps going to start one every ``--interval`` seconds despite
    the delay: a step makes ``2 x layers`` expert calls one after another (forward, then
    backward), each ``delay`` long."""
    return max(1, math.ceil(round(2 * args.layers * delay / args.interval, 6)))


def train_dmoe(args, seed: int, data, delay: float, failure_rate: float) -> dict:
    with SimSwarm(seed=seed) as swarm:
        with _SETUP:
            torch.manual_seed(10_000 + seed)
            for s in range(SERVERS):
                swarm.server(expert_backends(args.hidden, args.layers, s), failure_rate)
            node = swarm.node()
            moes = [
                RemoteMixtureOfExperts(
                    in_features=args.hidden,
                    grid_size=GRID,
                    dht=node,
                    uid_prefix=f"digits{layer}.",
                    k_best=args.k,
                    prefix_cache_ttl=600.0,  # the experts never move here
                )
                for layer in range(args.layers)
            ]
            trainer = AsyncTrainer(args, seed, data, moes, batches_in_flight(args, delay))
        with torch.no_grad():  # connections, schemas, prefix caches: before the delay
            trainer.snapshot()[0](data[0][: args.batch], moes)
        swarm.set_latency(delay / 2)  # each call: half the delay each way
        return trainer.run()


def train_seeds(args, name: str, data) -> list[dict]:
    """Every seed of one condition; the DMoE runs go concurrently (each its own swarm on
    the shared event loop: they spend most of their time waiting on the network)."""
    if name == "dense":
        return [train_dense(args, seed, data) for seed in range(args.seeds)]
    delay, failure_rate = condition(name)
    with concurrent.futures.ThreadPoolExecutor(args.seeds) as pool:
        futures = [
            pool.submit(train_dmoe, args, seed, data, delay, failure_rate)
            for seed in range(args.seeds)
        ]
        return [f.result() for f in futures]


# ---------------------------------------------------------------------- main


def label(name: str) -> str:
    if name == "dense":
        return "dense, equal parameters"
    delay, failure_rate = condition(name)
    text = f"DMoE, {delay * 1e3:.0f} ms delay" if delay else "DMoE, no delay"
    return text + (f", {failure_rate:.0%} of calls fail" if failure_rate else "")


def at_step(curve: list[tuple[int, float]], step: int) -> float:
    """The accuracy a run had at ``step``: its last evaluation at or before it (a run
    that lost batches has its last evaluation a few steps short of the others')."""
    return max(((s, a) for s, a in curve if s <= step), default=(0, 0.0))[1]


def plot(
    path: Path, curves: dict[str, list[list[tuple[int, float]]]], eval_every: int, title: str
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the bench extra): no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, runs in curves.items():
        steps = list(range(eval_every, max(s for run in runs for s, _ in run) + 1, eval_every))
        accs = [[at_step(run, s) for run in runs] for s in steps]
        med = [statistics.median(values) for values in accs]
        lo, hi = [min(values) for values in accs], [max(values) for values in accs]
        (line,) = ax.plot(steps, med, label=label(name))
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("training steps (trainer updates, batch of 32)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    small = os.environ.get("LAH_SMALL", "") not in ("", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", default=small)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--k", type=int, help="k_best")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument(
        "--interval", type=float, help="seconds between batch starts that in-flight batches aim at"
    )
    parser.add_argument("--seeds", type=int)
    parser.add_argument(
        "--conditions", type=str, help="comma-separated, of: " + ", ".join(CONDITIONS)
    )
    parser.add_argument("--plot", type=str, default=os.environ.get("LAH_PLOT", str(DEFAULT_PLOT)))
    args = parser.parse_args(argv)
    defaults = dict(
        hidden=64, layers=2, k=2, batch=32, steps=300, eval_every=25, interval=0.3,
        seeds=5, conditions=",".join(CONDITIONS),
    )  # fmt: skip
    if args.small:
        defaults.update(steps=20, eval_every=10, interval=0.02, seeds=2,
                        conditions="dmoe_0ms,dmoe_100ms_fail10")  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            env = os.environ.get(f"LAH_{key.upper()}")
            setattr(args, key, type(value)(env) if env else value)
    return args


def condition(name: str) -> tuple[float, float]:
    """``dmoe_<delay>ms[_fail<percent>]`` -> (delay in seconds, failure rate)."""
    if name in CONDITIONS:
        return CONDITIONS[name]
    parts = name.split("_")
    if parts[0] != "dmoe" or len(parts) not in (2, 3) or not parts[1].endswith("ms"):
        raise SystemExit(f"unknown condition {name!r}: dmoe_<ms>ms[_fail<percent>] or dense")
    failure = float(parts[2].removeprefix("fail")) / 100 if len(parts) == 3 else 0.0
    return float(parts[1][:-2]) / 1e3, failure


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    names = [n for n in args.conditions.split(",") if n] + ["dense"]
    data = load_digits_split()
    print(
        f"digits: {len(data[0])} train / {len(data[2])} held out; hidden {args.hidden}, "
        f"{args.layers} DMoE layers of {GRID[0]}x{GRID[1]} ffn experts, k_best {args.k}, "
        f"batch {args.batch}, batches in flight for one every {args.interval * 1e3:.0f} ms, "
        f"{args.steps} steps, {args.seeds} seeds",
        flush=True,
    )
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for name in names:
        t0 = time.perf_counter()
        runs[name] = train_seeds(args, name, data)
        for seed, result in enumerate(runs[name]):
            print(
                f"  {name:20} seed {seed}: final accuracy {result['curve'][-1][1]:.3f}, "
                f"in flight {result['in_flight']}, mean staleness {result['staleness']:5.1f} "
                f"steps, lost batches "
                f"{result['failed_steps']}",
                flush=True,
            )
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    summary = {}
    print(f"\n{'condition':20} {'final acc (median)':>19} {'min':>6} {'max':>6} {'staleness':>10}")
    for name, results in runs.items():
        finals = [r["curve"][-1][1] for r in results]
        stale = statistics.median(r["staleness"] for r in results)
        summary[name] = {
            "final_accuracy_median": round(statistics.median(finals), 4),
            "final_accuracy_min": round(min(finals), 4),
            "final_accuracy_max": round(max(finals), 4),
            "in_flight": results[0]["in_flight"],
            "staleness_median": round(stale, 1),
            "lost_batches": sum(r["failed_steps"] for r in results),
            "median_curve": [
                [s, round(statistics.median(at_step(r["curve"], s) for r in results), 4)]
                for s in range(args.eval_every, args.steps + 1, args.eval_every)
            ],
        }
        print(
            f"{name:20} {summary[name]['final_accuracy_median']:19.3f} {min(finals):6.3f} "
            f"{max(finals):6.3f} {stale:10.1f}"
        )
    figures = {
        "conditions": summary,
        "parameters": {
            "dmoe": dmoe_parameters(args.hidden, args.layers),
            "dense": sum(
                p.numel() for p in Dense(args.hidden, GRID[0] * GRID[1], args.layers).parameters()
            ),
        },
        "config": {
            k: getattr(args, k)
            for k in ("hidden", "layers", "k", "batch", "steps", "eval_every", "interval", "seeds")
        }
        | {"lr": LR},
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.plot:
        title = (
            f"digits, {args.layers} DMoE layers of {GRID[0] * GRID[1]} ffn experts (hidden "
            f"{args.hidden}), median and range of {args.seeds} seeds"
        )
        curves = {n: [r["curve"] for r in rs] for n, rs in runs.items()}
        if plot(Path(args.plot), curves, args.eval_every, title):
            print(f"plot: {args.plot}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
