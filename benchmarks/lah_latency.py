"""Learning@home, throughput against latency: DMoE against model-parallel pipelines.

The throughput experiment of Ryabinin & Gusev (2020) on this machine: a stack of
``--layers`` (4) expert layers of ``ffn`` blocks (hidden ``--hidden``, 512) trained

* **DMoE**: each layer a :class:`RemoteMixtureOfExperts` over ``--experts`` (4) experts
  (``k_best`` ``--k``, 2), served by ``--servers`` (4) swarmgrad expert :class:`Server`
  peers; ``--trainers`` (48) trainer peers, each its own thread and peer, run forward and
  backward through the stack on batches of ``--batch`` (32); every expert updates itself
  on each backward call, asynchronously (no synchronisation between trainers);
* **model parallel**: the same layers, one per stage peer (a stage computes the mean of
  ``k`` ffn blocks: the same compute per sample as a DMoE layer), a batch passing from
  stage to stage and its gradient back; ``naive``: one batch of ``--batch`` in flight, the
  stage weights step after each batch (one update per 32 samples, as each DMoE trainer
  step); ``gpipe``: batches of ``--microbatches`` (4) micro-batches of ``--batch`` that
  flow through the stages concurrently (GPipe's overlap), the gradients accumulated and
  one step per batch. (Micro-batches of 32, not 8: on this CPU an ffn on 8 samples costs
  nearly what it costs on 32, so splitting a batch of 32 made GPipe 2-2.5x slower than
  the naive pipeline at 0 ms.)

Every peer lives in this process on swarmgrad's simulated network (:mod:`_lah_swarm`),
which runs in real time here: the link latency (one-way, per hop: 0, 10, 50, 100, 200
ms) is real waiting, the compute (the servers' device threads, the stages' executors,
one torch thread each) is real compute on the 2 cores. A DMoE layer costs two hops per
expert call, forward and backward (16 hops per step for 4 layers); the pipeline one hop
per stage boundary each way (8 hops per batch, the trainer's to the first stage
included). Bandwidth is unlimited (4 MiB TCP-like receive windows).

The workers (trainers, the pipeline's driver) run without pause while the latency steps
from one value to the next; throughput is the samples whose backward completed within
a window that opens once the new latency has settled (a step's worth of time after the
change), per second of the window. Prints a table and, last,
one JSON line. ``LAH_SMALL=1`` (or ``--small``) is a seconds-long configuration for
tests; ``LAH_PLOT`` is where the PNG goes (empty: no plot).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lah_swarm import SimSwarm
from _results import figure_path

from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.moe import RemoteMixtureOfExperts
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.moe.server.layers import name_to_block
from swarmgrad.utils.loop_thread import run_coroutine

DEFAULT_PLOT = figure_path("lah_latency.png")
STAGE_RPC = "lah.stage"
LR = 1e-4


# ---------------------------------------------------------------------- DMoE


def expert_backends(args: argparse.Namespace, server: int) -> dict[str, ModuleBackend]:
    """The experts that server ``server`` hosts: expert ``e`` of layer ``l`` goes to server
    ``(l * experts + e) % servers``, so every server holds experts of every layer."""
    backends = {}
    for layer in range(args.layers):
        for e in range(args.experts):
            if (layer * args.experts + e) % args.servers != server:
                continue
            uid = f"lah{layer}.{e}"
            module = name_to_block["ffn"](args.hidden)
            backends[uid] = ModuleBackend(
                uid,
                module,
                optimizer=torch.optim.SGD(module.parameters(), lr=LR),
                args_schema=(BatchTensorDescriptor(args.hidden),),
                max_batch_size=4096,
            )
    return backends


class Trainer:
    """One trainer peer: its gates, and a loop of forward + backward through the stack."""

    def __init__(self, swarm: SimSwarm, args: argparse.Namespace, seed: int):
        node = swarm.node()
        self.layers = nn.ModuleList(
            RemoteMixtureOfExperts(
                in_features=args.hidden,
                grid_size=(args.experts,),
                dht=node,
                uid_prefix=f"lah{layer}.",
                k_best=args.k,
                prefix_cache_ttl=600.0,  # the experts never move here (see docs)
            )
            for layer in range(args.layers)
        )
        self.optimizer = torch.optim.SGD(self.layers.parameters(), lr=LR)
        self.generator = torch.Generator().manual_seed(seed)
        self.batch = args.batch
        self.hidden = args.hidden

    def step(self) -> None:
        h = torch.randn(self.batch, self.hidden, generator=self.generator)
        for layer in self.layers:
            h = layer(h)
        h.pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def run(self, stop: threading.Event, done: list) -> None:
        while not stop.is_set():
            self.step()
            done.append((time.perf_counter(), self.batch))


def measure_dmoe(args: argparse.Namespace, latencies: list[float]) -> tuple[list, list]:
    with SimSwarm(seed=1) as swarm:
        # trainers join first, so that the servers declare their experts to the whole
        # swarm: with the servers first, 26 of 48 trainers found no record of 'lah2.'
        # (records are handed to newcomers once a second at most: docs/reproductions.md)
        trainers = [Trainer(swarm, args, seed) for seed in range(args.trainers)]
        for s in range(args.servers):
            swarm.server(expert_backends(args, s))
        for trainer in trainers:  # connections, schemas and prefix caches, at zero latency
            trainer.step()
        workers = [trainer.run for trainer in trainers]
        return sweep(
            swarm, workers, latencies, 4 * args.layers, args.trainers * args.batch, args, "DMoE"
        )


def sweep(
    swarm: SimSwarm,
    workers: list,
    latencies: list[float],
    hops: int,
    in_flight: int,
    args: argparse.Namespace,
    name: str,
) -> tuple[list[float], list[float]]:
    """Run every ``worker(stop, done)`` in its own thread, without pause, while the link
    latency steps through ``latencies`` (``--passes`` times, every other pass in reverse
    order, so that a drift in the machine's load does not read as a trend); for each
    latency, the median over passes of the samples/s completed in a window that opens
    once the new latency has settled (one step's worth of time after the change), and
    the median share of a core this process got during those windows.

    ``hops`` is the number of one-way trips a step of one worker makes, ``in_flight`` the
    samples all workers have in flight together: a step then lasts about ``hops x
    latency`` or ``in_flight / throughput``, whichever is longer."""
    stop, done = threading.Event(), []
    threads = [threading.Thread(target=w, args=(stop, done), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    rates: dict[float, list[float]] = {latency: [] for latency in latencies}
    shares: dict[float, list[float]] = {latency: [] for latency in latencies}
    step = args.measure / 2  # seconds a step took at the previous latency (a guess at first)
    try:
        for p in range(args.passes):
            for latency in latencies if p % 2 == 0 else latencies[::-1]:
                swarm.set_latency(latency)
                step = max(step, hops * latency)
                time.sleep(args.warmup + step)
                count, started, cpu = len(done), time.perf_counter(), time.process_time()
                time.sleep(max(args.measure, 2 * step))
                elapsed = time.perf_counter() - started
                rate = sum(n for t, n in done[count:] if t >= started) / elapsed
                rates[latency].append(rate)
                shares[latency].append((time.process_time() - cpu) / elapsed)
                step = max(hops * latency, in_flight / rate if rate else args.measure)
                print(
                    f"  {name:9} {latency * 1e3:5.0f} ms/hop: {rate:8.1f} samples/s "
                    f"(this process: {shares[latency][-1]:.2f} cores)",
                    flush=True,
                )
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return (
        [statistics.median(rates[latency]) for latency in latencies],
        [statistics.median(shares[latency]) for latency in latencies],
    )


# ---------------------------------------------------------------------- model parallel


class Stage:
    """One pipeline stage on its own peer: ``k`` ffn blocks averaged, computed on the
    stage's own thread (its device); forwards its output to the next stage and returns
    the gradient of its input."""

    def __init__(self, args: argparse.Namespace, node, next_peer=None):
        self.blocks = nn.ModuleList(name_to_block["ffn"](args.hidden) for _ in range(args.k))
        self.optimizer = torch.optim.SGD(self.blocks.parameters(), lr=LR)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage")
        self.peer, self.next_peer = node.peer, next_peer
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.backwards: dict[int, int] = {}
        if next_peer is not None:
            self.peer.add_addresses(next_peer.peer_id, next_peer.get_visible_maddrs())
        run_coroutine(self._attach())

    async def _attach(self) -> None:
        self.peer.add_handler(STAGE_RPC, self.rpc_stage)

    def _forward(self, key: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        with torch.enable_grad():
            y = sum(block(x) for block in self.blocks) / len(self.blocks)
        self.pending[key] = (x, y)
        return y.detach()

    def _backward(self, key: tuple[int, int], grad: torch.Tensor, micros: int) -> torch.Tensor:
        x, y = self.pending.pop(key)
        y.backward(grad)
        batch = key[0]
        self.backwards[batch] = self.backwards.get(batch, 0) + 1
        if self.backwards[batch] == micros:  # the whole batch is through: one step
            del self.backwards[batch]
            self.optimizer.step()
            self.optimizer.zero_grad()
        return x.grad

    async def rpc_stage(self, request: dict, context) -> dict:
        loop = asyncio.get_running_loop()
        key, micros = (request["batch"], request["micro"]), request["micros"]
        (x,) = tensors_from_message(request["x"])
        y = await loop.run_in_executor(self.executor, self._forward, key, x)
        if self.next_peer is None:  # the last stage: the loss is the mean square
            grad = y * (2.0 / (y.numel() * micros))
        else:
            reply = await self.peer.call(
                self.next_peer.peer_id, STAGE_RPC, {**request, "x": tensors_to_message([y])}
            )
            (grad,) = tensors_from_message(reply["grad"])
        gx = await loop.run_in_executor(self.executor, self._backward, key, grad, micros)
        return {"grad": tensors_to_message([gx])}

    def close(self) -> None:
        self.executor.shutdown()


def measure_pipeline(args: argparse.Namespace, latencies: list[float], micros: int) -> tuple:
    """Samples/s of a pipeline whose batches are ``micros`` micro-batches of ``--batch``."""
    batch_size = micros * args.batch
    with SimSwarm(seed=2) as swarm:
        driver = swarm.node()
        nodes = [swarm.node() for _ in range(args.layers)]
        stages = []
        for i in reversed(range(args.layers)):
            next_peer = nodes[i + 1].peer if i + 1 < args.layers else None
            stages.append(Stage(args, nodes[i], next_peer))
        first = nodes[0].peer
        driver.peer.add_addresses(first.peer_id, first.get_visible_maddrs())
        generator = torch.Generator().manual_seed(0)
        counter = iter(range(1 << 62))

        async def one_batch() -> int:
            batch = next(counter)
            x = torch.randn(batch_size, args.hidden, generator=generator)
            await asyncio.gather(
                *(
                    driver.peer.call(
                        first.peer_id,
                        STAGE_RPC,
                        {
                            "batch": batch,
                            "micro": m,
                            "micros": micros,
                            "x": tensors_to_message([part]),
                        },
                    )
                    for m, part in enumerate(x.chunk(micros))
                )
            )
            return batch_size

        def run(stop: threading.Event, done: list) -> None:
            async def loop() -> None:
                while not stop.is_set():
                    samples = await one_batch()
                    done.append((time.perf_counter(), samples))

            run_coroutine(loop())

        run_coroutine(one_batch())  # connections, at zero latency
        name = "naive MP" if micros == 1 else f"GPipe x{micros}"
        try:
            results = sweep(swarm, [run], latencies, 2 * args.layers, batch_size, args, name)
        finally:
            for stage in stages:
                stage.close()
    return results


# ---------------------------------------------------------------------- main


def plot(path: Path, latencies_ms: list[float], series: dict[str, list[float]], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the bench extra): no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (label, values), marker in zip(series.items(), "osv^", strict=False):
        ax.plot(latencies_ms, values, marker=marker, label=label)
    ax.set_xlabel("added latency per hop, ms (one way)")
    ax.set_ylabel("training samples/s")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    small = os.environ.get("LAH_SMALL", "") not in ("", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", default=small)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--experts", type=int, help="experts per layer")
    parser.add_argument("--k", type=int, help="experts per sample per layer (k_best)")
    parser.add_argument("--servers", type=int)
    parser.add_argument("--trainers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--latencies-ms", type=str)
    parser.add_argument("--passes", type=int, help="sweeps over the latencies (median)")
    parser.add_argument("--measure", type=float, help="seconds of the measurement window (min)")
    parser.add_argument(
        "--warmup", type=float, help="seconds of warm-up besides one step's latency"
    )
    parser.add_argument("--plot", type=str, default=os.environ.get("LAH_PLOT", str(DEFAULT_PLOT)))
    args = parser.parse_args(argv)
    defaults = dict(
        layers=4, hidden=512, experts=4, k=2, servers=4, trainers=48, batch=32,
        microbatches=4, latencies_ms="0,10,50,100,200", passes=2, measure=6.0, warmup=2.0,
    )  # fmt: skip
    if args.small:
        defaults.update(
            layers=2, hidden=64, experts=2, k=1, servers=2, trainers=4, batch=8,
            microbatches=2, latencies_ms="0,20", passes=1, measure=0.6, warmup=0.2,
        )  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            env = os.environ.get(f"LAH_{key.upper()}")
            setattr(args, key, type(value)(env) if env else value)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every peer's device computes on one thread
    latencies_ms = [float(v) for v in args.latencies_ms.split(",")]
    latencies = [v / 1e3 for v in latencies_ms]
    print(
        f"{args.layers} layers of ffn (hidden {args.hidden}), {args.experts} experts/layer on "
        f"{args.servers} servers, k={args.k}, {args.trainers} trainers x batch {args.batch}; "
        f"pipelines: {args.layers} stages, batch {args.batch} (naive) and "
        f"{args.microbatches} x {args.batch} (GPipe)",
        flush=True,
    )
    started = time.perf_counter()
    (dmoe, dmoe_cpu) = measure_dmoe(args, latencies)
    (naive, naive_cpu) = measure_pipeline(args, latencies, 1)
    (gpipe, gpipe_cpu) = measure_pipeline(args, latencies, args.microbatches)
    print(
        f"\nmedians of {args.passes} passes; samples/s (cores this process got)\n"
        f"{'latency/hop':>12} {'DMoE':>16} {'naive MP':>16} {'GPipe':>16}"
    )
    for i, ms in enumerate(latencies_ms):
        cells = [
            f"{v[i]:8.1f} ({c[i]:.2f})"
            for v, c in ((dmoe, dmoe_cpu), (naive, naive_cpu), (gpipe, gpipe_cpu))
        ]
        print(f"{ms:9.0f} ms " + " ".join(f"{c:>16}" for c in cells))
    figures = {
        "latency_ms": latencies_ms,
        "dmoe_samples_per_s": [round(v, 1) for v in dmoe],
        "naive_mp_samples_per_s": [round(v, 1) for v in naive],
        "gpipe_samples_per_s": [round(v, 1) for v in gpipe],
        "dmoe_retained": round(dmoe[-1] / dmoe[0], 3) if dmoe[0] else 0.0,
        "naive_mp_retained": round(naive[-1] / naive[0], 3) if naive[0] else 0.0,
        "gpipe_retained": round(gpipe[-1] / gpipe[0], 3) if gpipe[0] else 0.0,
        "dmoe_over_naive_mp_at_max": round(dmoe[-1] / naive[-1], 2) if naive[-1] else None,
        "cores_used": {
            "dmoe": [round(v, 2) for v in dmoe_cpu],
            "naive_mp": [round(v, 2) for v in naive_cpu],
            "gpipe": [round(v, 2) for v in gpipe_cpu],
        },
        "passes": args.passes,
        "config": {
            k: getattr(args, k)
            for k in (
                "layers",
                "hidden",
                "experts",
                "k",
                "servers",
                "trainers",
                "batch",
                "microbatches",
            )
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.plot:
        title = (
            f"{args.layers} ffn layers (hidden {args.hidden}), batch {args.batch}; "
            f"DMoE: {args.trainers} trainers, {args.servers} servers"
        )
        series = {"DMoE (swarmgrad)": dmoe, "model parallel, naive": naive,
                  f"model parallel, GPipe x{args.microbatches}": gpipe}  # fmt: skip
        if plot(Path(args.plot), latencies_ms, series, title):
            print(f"plot: {args.plot}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
