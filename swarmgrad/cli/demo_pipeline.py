"""``swarmgrad demo pipeline``: a model split into stages, each served by a swarm of peers
(SWARM pipeline parallelism), trained on this machine in about two minutes.

What it shows:

1. a bootstrap peer (``swarmgrad dht``) and eight stage peers (``swarmgrad serve-stage``),
   each a separate process talking over real encrypted sockets on loopback, serving a
   small byte-level GPT split into four stages (:mod:`swarmgrad.cli.demo_pipeline_stages`)
   that learns Python's standard-library sources;
2. the stages start unevenly, 3/2/2/1: the last stage is starved, the bottleneck; the
   peers see it in the DHT and one moves there (adaptive rebalancing), downloading the
   stage's parameters and optimizer state from the peer already serving it;
3. a trainer (this process) sends micro-batches through one peer per stage, chosen by
   measured throughput (stochastic wiring), several at once;
4. midway a peer of stage 1 (or of another stage with two peers or more) is SIGKILLed:
   the micro-batches it held are retried on the other peers of its stage, none is lost;
5. at the end, the held-out perplexity through the trained pipeline against the
   untrained model, and a plot of loss and stage servers over time;
6. meanwhile, ``swarmgrad monitor`` serves the dashboard (the trainer publishes its
   loss and speed): its URL is printed at the start (``--monitor-port``,
   ``--no-monitor``).

Ctrl-C stops every process it started and removes its files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.cli.demo_processes import ChildProcess, spawn
from swarmgrad.cli.demo_train import (
    DemoRun,
    _Swarm,
    add_display_arguments,
    plot_history,
    progress_bar,
    run_demo,
)

__all__ = ["add_arguments", "run"]

PIPELINE = "demo-gpt"

# the stage module, by path (importing it here would import torch for every command)
STAGES_MODULE = Path(__file__).with_name("demo_pipeline_stages.py")
HEADS = 4  # attention heads of every stage's blocks: --width must divide by it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, default=4, help="stages of the model (default 4)")
    parser.add_argument(
        "--peers", type=int, default=8,
        help="stage peers (default 8); they start with one too few on the last stage",
    )  # fmt: skip
    parser.add_argument(
        "--duration", type=float, default=100.0, help="seconds of training (default 100)"
    )
    parser.add_argument(
        "--kill-at", type=float, default=0.6,
        help="fraction of the run when a peer of stage 1 (or of a stage with two peers or more) "
        "is SIGKILLed (0: never)",
    )  # fmt: skip
    parser.add_argument(
        "--rebalance-interval", type=float, default=10.0,
        help="seconds between the peers' rebalancing checks (default 10)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument(
        "--in-flight", type=int, default=4, help="micro-batches the trainer keeps in flight"
    )
    parser.add_argument("--width", type=int, default=32, help="the model's width (default 32)")
    parser.add_argument("--context", type=int, default=32, help="bytes of context (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="the stages' Adam learning rate")
    parser.add_argument(
        "--slowdown", type=float, default=0.02,
        help="seconds each stage peer sleeps per batch, standing in for a real device's "
        "compute (keeps two cores from being the bottleneck; default 0.02)",
    )  # fmt: skip
    add_display_arguments(parser)
    parser.set_defaults(run=run, no_nat=True)


def _check(args: argparse.Namespace) -> None:
    if args.stages < 2:
        raise ValueError(f"--stages must be at least 2, got {args.stages}")
    if args.peers < 2 * args.stages:
        raise ValueError(
            f"--peers must be at least twice --stages ({2 * args.stages}: two per stage, so "
            f"that a killed peer leaves its stage served), got {args.peers}"
        )
    for name in ("duration", "batch_size", "in_flight", "width", "context", "lr"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if not args.rebalance_interval > 0:
        raise ValueError("--rebalance-interval must be positive")
    if args.slowdown < 0:
        raise ValueError("--slowdown must be 0 or more")
    if not 0 <= args.kill_at < 1:
        raise ValueError("--kill-at must be in [0, 1)")
    if args.width % HEADS:
        raise ValueError(f"--width must be a multiple of 4 (the heads), got {args.width}")
    if not 0 <= args.monitor_port <= 65535:
        raise ValueError(f"--monitor-port must be between 0 and 65535, got {args.monitor_port}")


def starved_layout(stages: int, peers: int) -> list[int]:
    """Peers per stage at the start: as even as possible, then one moved from the last
    stage to the first, so the last stage is the one bottleneck (3/2/2/1 for 8 on 4)."""
    counts = [peers // stages + (1 if i < peers % stages else 0) for i in range(stages)]
    counts[-1] -= 1
    counts[0] += 1
    return counts


# ---------------------------------------------------------------------- the swarm


class _PipelineSwarm(_Swarm):
    """The training demo's bootstrap peer and dashboard, plus stage peers."""

    run_id = "swarmgrad-demo-pipeline"

    def __init__(self, args: argparse.Namespace, workdir: Path):
        super().__init__(args, workdir)
        self.peers: dict[str, tuple[ChildProcess, int]] = {}  # PeerID -> (process, index)
        self.killed: tuple[int | None, int] | None = None  # (peer, its stage) once done
        self.final_layout: list[list[int]] = []

    def environment(self) -> None:
        """The stage module's options, for the stage peers and for this process."""
        a = self.args
        os.environ.update(
            SWARMGRAD_DEMO_STAGES=str(a.stages), SWARMGRAD_DEMO_WIDTH=str(a.width),
            SWARMGRAD_DEMO_CONTEXT=str(a.context), SWARMGRAD_DEMO_LR=str(a.lr),
        )  # fmt: skip

    def start_stage_peers(self, layout: list[int]) -> None:
        a = self.args
        started = []
        for stage, count in enumerate(layout):
            for _ in range(count):
                index = len(started) + 1
                process = spawn(
                    f"stage peer {index}", "serve-stage",
                    "--module", str(STAGES_MODULE), "--pipeline", PIPELINE,
                    "--stage", str(stage), "--initial-peers", self.bootstrap,
                    "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--update-period", "2",
                    "--average-period", "10", "--rebalance-interval", str(a.rebalance_interval),
                    "--hysteresis", "0.2", "--max-batch-size", str(4 * a.batch_size),
                    "--slowdown", str(a.slowdown), "--log-level", "INFO",
                    log_path=str(self.workdir / f"stage-peer-{index}.log"),
                )  # fmt: skip
                self.processes.append(process)
                started.append((process, index, stage))
        for process, index, stage in started:
            maddr = process.wait_for_maddr(180)
            self.peers[maddr.rsplit("/p2p/", 1)[1]] = (process, index)
            print(f"stage peer {index} (pid {process.pid}) serves stage {stage}", flush=True)


# ---------------------------------------------------------------------- the trainer


@dataclass
class _Progress:
    """What the trainer's threads did: losses over time, micro-batches, errors."""

    began: float
    losses: list[tuple[float, float]] = field(default_factory=list)  # (seconds, loss)
    samples: int = 0
    dropped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, loss: float, samples: int) -> None:
        with self.lock:
            self.losses.append((time.monotonic() - self.began, loss))
            self.samples += samples

    def recent_loss(self, count: int = 20) -> float | None:
        with self.lock:
            recent = [loss for _, loss in self.losses[-count:]]
        return sum(recent) / len(recent) if recent else None

    def rate(self, seconds: float = 10.0) -> float:
        now = time.monotonic() - self.began
        with self.lock:
            done = sum(1 for t, _ in self.losses if t >= now - seconds)
        return done / min(seconds, max(now, 1e-3))


class _Trainer:
    """This process's trainer: a RemotePipeline fed by ``in_flight`` threads."""

    def __init__(self, swarm: _PipelineSwarm, args: argparse.Namespace):
        import torch

        from swarmgrad.cli.demo_model import corpus_split
        from swarmgrad.dht import DHT
        from swarmgrad.optim.metrics import MetricsPublisher
        from swarmgrad.pipeline import PipelineOptions, RemotePipeline

        self.args = args
        self.dht = DHT(initial_peers=[swarm.bootstrap], client_mode=True, start=True)
        options = PipelineOptions(compression="blockwise_8bit", timeout=60, refresh_period=2)
        self.pipe = RemotePipeline(self.dht, PIPELINE, args.stages, options)
        self.train, self.held_out = corpus_split()
        self.progress = _Progress(time.monotonic())
        self.publisher = MetricsPublisher(
            self.dht, swarm.run_id, self._metrics, period=2.0, expiration=12.0
        )
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._work, args=(seed,), daemon=True, name=f"demo-mb-{seed}")
            for seed in range(args.in_flight)
        ]
        self._torch = torch

    def _metrics(self) -> dict[str, Any]:
        return {"samples_per_second": self.progress.rate() * self.args.batch_size,
                "epoch": len(self.progress.losses)}  # fmt: skip

    def _work(self, seed: int) -> None:
        from swarmgrad.cli.tiny_lm import VOCAB, random_windows

        torch = self._torch
        generator = torch.Generator().manual_seed(1000 * self.args.seed + seed)
        while not self.stop.is_set():
            x, y = random_windows(self.train, self.args.batch_size, self.args.context, generator)
            try:
                logits = self.pipe(x)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
            except Exception:  # dropped after every retry: counted, the trainer goes on
                self.progress.dropped += 1
                self.stop.wait(1.0)
                continue
            value = loss.item()
            self.progress.add(value, self.args.batch_size)
            self.publisher.report_loss(value)

    def start(self) -> None:
        self.progress.began = time.monotonic()
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(70)

    def held_out_loss(self, windows: int = 64) -> float:
        """Mean loss over fixed held-out windows, forward only, through the pipeline."""
        from swarmgrad.cli.tiny_lm import VOCAB

        torch, context = self._torch, self.args.context
        step = (len(self.held_out) - context - 1) // windows
        rows = torch.stack(
            [self.held_out[i * step : i * step + context + 1] for i in range(windows)]
        )
        total = 0.0
        with torch.no_grad():
            for chunk in rows.split(self.args.batch_size):
                logits = self.pipe(chunk[:, :-1])
                total += float(
                    torch.nn.functional.cross_entropy(
                        logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1), reduction="sum"
                    )
                )
        return total / (windows * context)

    def shutdown(self) -> None:
        self.publisher.shutdown()
        self.dht.shutdown()


def _untrained_loss(args: argparse.Namespace, held_out: Any) -> float:
    """The same held-out windows through the stages as every peer first built them."""
    import torch

    from swarmgrad.cli.tiny_lm import VOCAB
    from swarmgrad.pipeline.stages import load_stage_module

    stages = [spec.module for spec in load_stage_module(str(STAGES_MODULE)).build()]
    windows, context = 64, args.context
    step = (len(held_out) - context - 1) // windows
    rows = torch.stack([held_out[i * step : i * step + context + 1] for i in range(windows)])
    with torch.no_grad():
        out = rows[:, :-1]
        for stage in stages:
            out = stage(out)
        return float(
            torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
        )


# ---------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    return run_demo(_PipelineDemo, args, _check)


class _PipelineDemo(DemoRun):
    """A trainer through stages served by stage peers, the last stage starved at first."""

    title = "swarmgrad demo pipeline"

    def __init__(self, args: argparse.Namespace, workdir: Path):
        super().__init__(args, workdir)
        self.swarm = _PipelineSwarm(args, workdir)
        self.swarm.environment()
        self.trainer: _Trainer | None = None

    def main(self) -> int:
        args, swarm = self.args, self.swarm
        layout = starved_layout(args.stages, args.peers)
        print(
            f"swarmgrad demo pipeline: a tiny GPT in {args.stages} stages served by "
            f"{args.peers} peer processes (starting {'/'.join(map(str, layout))}: the last "
            f"stage starved), trained for {args.duration:.0f} s; files in {self.workdir}",
            flush=True,
        )
        began = time.monotonic()
        swarm.start_bootstrap()
        if not args.no_monitor:
            swarm.start_monitor()
        swarm.start_stage_peers(layout)
        self.trainer = trainer = _Trainer(swarm, args)
        history = _train(swarm, trainer, args)
        trained_loss = trainer.held_out_loss()
        return _report(swarm, trainer, history, args, trained_loss, time.monotonic() - began)

    def failed_logs(self) -> Iterable[tuple[Path, str]]:
        return [
            (self.workdir / f"stage-peer-{index}.log", process.name)
            for process, index in self.swarm.peers.values()
        ]

    def stop(self) -> None:
        if self.trainer is not None:
            self.trainer.stop.set()
            self.trainer.shutdown()
        self.swarm.stop(timeout=20.0)


def _layout(swarm: _PipelineSwarm, trainer: _Trainer) -> list[list[int]]:
    """The stage peers (by index) each stage has in the DHT now."""
    from swarmgrad.pipeline import read_stage_loads

    loads = trainer.dht.run_coroutine(
        lambda _dht, node: read_stage_loads(node, PIPELINE, swarm.args.stages)
    )
    return [
        sorted(swarm.peers[p.to_base58()][1] for p in stage if p.to_base58() in swarm.peers)
        for stage in loads
    ]


def _train(swarm: _PipelineSwarm, trainer: _Trainer, args: argparse.Namespace):
    """Train for ``--duration`` seconds; kill a stage-1 peer on time; report moves."""
    kill_time = args.kill_at * args.duration if args.kill_at > 0 else None
    bar, say = progress_bar(args.duration, args.no_progress)
    history: list[tuple[float, float, int]] = []
    trainer.start()
    began = trainer.progress.began
    layout = _layout(swarm, trainer)
    say(f"  0.0 s: stages served by peers {_show(layout)}")
    next_look = 0.0
    while (elapsed := time.monotonic() - began) < args.duration:
        if kill_time is not None and swarm.killed is None and elapsed >= kill_time:
            # a peer of stage 1, or of another stage that has two peers or more
            stage = next((s for s in (1, *range(args.stages)) if len(layout[s]) >= 2), 1)
            victim = layout[stage][0] if len(layout[stage]) >= 2 else None
            process = next((p for p, i in swarm.peers.values() if i == victim), None)
            if process is not None:
                process.stop(signal.SIGKILL)
                swarm.killed = (victim, stage)
                say(f"{elapsed:5.1f} s: stage peer {victim} (stage {stage}) SIGKILLed; its "
                    "micro-batches are retried on the other peer of its stage")  # fmt: skip
            else:
                swarm.killed = (None, stage)
        if elapsed >= next_look:
            next_look = elapsed + 1.0
            try:
                now = _layout(swarm, trainer)
            except Exception:
                now = layout
            if now != layout:
                say(f"{elapsed:5.1f} s: stages served by peers {_show(now)}")
                layout = now
            loss = trainer.progress.recent_loss()
            if loss is not None:
                history.append((elapsed, loss, sum(map(len, layout))))
            status = _status(trainer, layout)
            if args.no_progress:
                print(f"{elapsed:5.1f} s: {status}", flush=True)
            bar.set_postfix_str(status, refresh=False)
        bar.update(min(round(elapsed), bar.total) - bar.n)
        time.sleep(0.25)
    bar.close()
    trainer.finish()
    swarm.final_layout = layout
    return history


def _show(layout: list[list[int]]) -> str:
    return " | ".join(",".join(map(str, stage)) or "none" for stage in layout)


def _status(trainer: _Trainer, layout: list[list[int]]) -> str:
    loss = trainer.progress.recent_loss()
    return (
        f"loss {'-' if loss is None else f'{loss:.3f}'}, "
        f"{trainer.progress.rate() * trainer.args.batch_size:.0f} samples/s, "
        f"servers {'/'.join(str(len(s)) for s in layout)}, "
        f"{trainer.pipe.stats['retried_hops']} hops retried, {trainer.progress.dropped} dropped"
    )


def _report(swarm, trainer: _Trainer, history, args, trained_loss: float, elapsed: float) -> int:
    before = math.exp(_untrained_loss(args, trainer.held_out))
    after = math.exp(trained_loss)
    stats = trainer.pipe.stats
    print(
        f"\nValidation perplexity on held-out standard-library text, through the pipeline: "
        f"{after:.2f} (untrained model: {before:.2f}, {before / after:.1f}x lower) after "
        f"{len(trainer.progress.losses)} micro-batches",
        flush=True,
    )
    plot = plot_history(
        history,
        Path(args.plot) if args.plot else swarm.workdir / "swarmgrad-demo-pipeline.png",
        "swarmgrad demo pipeline: a GPT in stages served by a swarm",
        "stage servers",
    )
    victim, stage = swarm.killed or (None, None)
    killed = (
        f"stage peer {victim} (stage {stage}) was SIGKILLed"
        if victim is not None
        else "no peer was killed"
    )
    print(
        f"Summary: {len(trainer.progress.losses)} micro-batches in {elapsed:.0f} s; {killed}; "
        f"{stats['retried_hops']} hops retried, {trainer.progress.dropped} micro-batches "
        f"dropped; stages served at the end by {_show(swarm.final_layout)}",
        flush=True,
    )
    print(f"Plot: {plot}" if plot else "Plot: not drawn (pip install matplotlib to get one)")
    print(json.dumps({
        "wall_s": elapsed, "perplexity_untrained": before, "perplexity_trained": after,
        "micro_batches": len(trainer.progress.losses), "dropped": trainer.progress.dropped,
        "retried_hops": stats["retried_hops"], "killed_peer": victim,
        "final_layout": swarm.final_layout, "plot": str(plot or ""),
        "monitor_url": swarm.monitor_url,
    }), flush=True)  # fmt: skip
    return 0 if after < before else 1
