"""``swarmgrad demo`` (or ``swarmgrad demo train``): one model trained by a swarm on this
machine, in under three minutes on two cores.

What it shows:

1. a bootstrap peer (``swarmgrad dht``) and several trainers (``swarmgrad train``), each
   a separate process talking over real encrypted sockets on loopback, training one
   small GPT-style model on Python's own standard-library sources (real text, offline)
   with a collaborative :class:`swarmgrad.Optimizer` (by default in local-updates
   mode: each trainer steps on its own batches and the swarm averages the parameters at
   every global epoch; ``--mode sync`` averages gradients instead); the last tenth of the
   text is held out;
2. the last of the first trainers runs in client mode (it accepts no connections, as
   behind a NAT; it still trains and sends its gradients);
3. a trainer that joins late, downloads the model from the others and catches up;
4. a trainer SIGKILLed midway (no goodbye): the others carry on;
5. at the end, the held-out perplexity of the trained model against the untrained one,
   a few lines of text it generates, and a plot of loss and peers over time;
6. meanwhile, ``swarmgrad monitor`` serves the swarm's dashboard: its URL is printed at
   the start (``--monitor-port``, ``--no-monitor``).

Ctrl-C stops every process it started and removes its files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.cli.demo_nat import DemoNat
from swarmgrad.cli.demo_processes import ChildProcess, spawn, stop_all

__all__ = ["add_arguments", "run"]

_PROMPTS = (b"def ", b"import ", b"    if ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trainers", type=int, default=3,
        help="trainers at the start, the last in client mode (default 3); one more joins late",
    )  # fmt: skip
    parser.add_argument(
        "--duration", type=float, default=100.0, help="seconds of training (default 100)"
    )
    parser.add_argument(
        "--join-at",
        type=float,
        default=0.3,
        help="fraction of the run when the late trainer joins (0: none)",
    )
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.55,
        help="fraction of the run when trainer 2 is SIGKILLed (0: never)",
    )
    parser.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="samples the swarm processes per global epoch (default: 2048 local, 1024 sync)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="samples per local step")
    parser.add_argument("--width", type=int, default=64, help="the model's width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--context", type=int, default=64, help="bytes of context (default 64)")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW's learning rate (default: 2e-3 local, 8e-3 sync)")  # fmt: skip
    parser.add_argument(
        "--mode", choices=("local", "sync"), default="local",
        help="local: every trainer steps on each of its batches, parameters are averaged "
        "each global epoch (default; many steps, fit for 2 cores); sync: gradients are "
        "averaged and all step together once per global epoch (exact large-batch training)",
    )  # fmt: skip
    add_display_arguments(parser)
    parser.add_argument(
        "--no-nat",
        action="store_true",
        help="run the client-mode trainer on loopback, not behind a real NAT (which needs "
        "Linux, root and nftables; without them the demo does this by itself)",
    )
    parser.set_defaults(run=run)


#: defaults that depend on --mode: sync mode takes one optimizer step per global epoch, so
#: it wants a larger learning rate and shorter epochs than local updates
_MODE_DEFAULTS = {"local": {"lr": 2e-3, "target_batch_size": 2048},
                  "sync": {"lr": 8e-3, "target_batch_size": 1024}}  # fmt: skip


_LATE = " (+1 joining late)"
_MONITOR_URL = re.compile(r"Monitor running at (http://\S+)")
_MODE_TEXT = {
    "local": "local updates, parameters averaged each epoch",
    "sync": "gradients averaged, one step per epoch",
}


def add_display_arguments(parser: argparse.ArgumentParser) -> None:
    """What every demo shows and how: its plot, the seed of its text, the progress bar
    and the dashboard (the training demo's and the pipeline demo's options alike)."""
    parser.add_argument("--plot", default=None, help="where to write the PNG plot")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled text")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    parser.add_argument(
        "--monitor-port", type=int, default=0,
        help="port of the dashboard (swarmgrad monitor) on 127.0.0.1 (default 0: any free one)",
    )  # fmt: skip
    parser.add_argument("--no-monitor", action="store_true", help="start no dashboard")


def _check(args: argparse.Namespace) -> None:
    for name, value in _MODE_DEFAULTS[args.mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.trainers < 3:
        raise ValueError(
            f"--trainers must be at least 3 (one evaluated, one killed, one in client mode), "
            f"got {args.trainers}"
        )
    if not args.duration > 0:
        raise ValueError(f"--duration must be positive, got {args.duration}")
    for name in ("join_at", "kill_at"):
        if not 0 <= getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")
    for name in ("target_batch_size", "batch_size", "width", "layers", "context"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.monitor_port <= 65535:
        raise ValueError(f"--monitor-port must be between 0 and 65535, got {args.monitor_port}")
    if args.width % 4:
        raise ValueError(f"--width must be a multiple of 4 (the heads), got {args.width}")


# ---------------------------------------------------------------------- the swarm


@dataclass
class _Trainer:
    index: int
    process: ChildProcess
    role: str  # "", "client mode", "late joiner"
    started: float
    epochs: list[dict] = field(default_factory=list)
    done: bool = False
    killed_at_epoch: int | None = None

    @property
    def name(self) -> str:
        return f"trainer {self.index}"


class _Swarm:
    """The demo's processes and what their trainers report (JSON lines, one per event).
    ``swarmgrad demo pipeline`` reuses its bootstrap peer and dashboard (``run_id``)."""

    run_id = "swarmgrad-demo"

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.processes: list[ChildProcess] = []
        self.trainers: list[_Trainer] = []
        self.events: queue.Queue = queue.Queue()
        self.bootstrap = ""
        self.monitor_url: str | None = None
        self.nat: DemoNat | None = None  # the client trainer's NAT, when built
        self.listen_host = "127.0.0.1"  # the NAT's host side when there is one

    def start_nat(self) -> str:
        """Build the client trainer's NAT unless told not to; says what the client gets."""
        if self.args.no_nat:
            return "on loopback (--no-nat)"
        self.nat, reason = DemoNat.create()
        if self.nat is None:
            return f"on loopback: no real NAT here ({reason})"
        self.listen_host = self.nat.host_addr
        return self.nat.describe()

    def start_bootstrap(self) -> str:
        boot = spawn(
            "bootstrap peer", "dht", "--host-maddrs", f"/ip4/{self.listen_host}/tcp/0",
            log_path=str(self.workdir / "bootstrap.log"),
        )  # fmt: skip
        self.processes.append(boot)
        self.bootstrap = boot.wait_for_maddr(60)
        print(f"bootstrap peer (pid {boot.pid}) at {self.bootstrap}", flush=True)
        return self.bootstrap

    def start_monitor(self) -> str:
        """``swarmgrad monitor`` on the demo's run; returns the dashboard's URL."""
        monitor = spawn(
            "monitor", "monitor", "--initial-peers", self.bootstrap,
            "--run-id", self.run_id, "--port", str(self.args.monitor_port),
            "--poll-interval", "2", log_path=str(self.workdir / "monitor.log"),
        )  # fmt: skip
        self.processes.append(monitor)
        try:
            url = monitor.wait_for(_MONITOR_URL, 60, "its URL")
        except RuntimeError as e:
            _print_tail(self.workdir / "monitor.log", "the monitor")
            raise RuntimeError(f"the monitor did not start: {e}") from None
        print(f"dashboard (swarmgrad monitor, pid {monitor.pid}): {url}", flush=True)
        self.monitor_url = url
        return url

    def start_trainer(self, role: str = "") -> _Trainer:
        a = self.args
        index = len(self.trainers) + 1
        from swarmgrad.cli import demo_model

        options = [f"width={a.width}", f"layers={a.layers}", f"context={a.context}", f"lr={a.lr}"]
        argv = [
            "train",
            "--model-module", demo_model.__file__,
            "--module-options", *options,
            "--run-id", self.run_id,
            "--initial-peers", self.bootstrap,
            "--target-batch-size", str(a.target_batch_size),
            "--batch-size", str(a.batch_size),
            "--matchmaking-time", "1",
            "--averaging-timeout", "10",
            "--metadata-expiration", "12",  # so the killed trainer soon stops counting
            "--seed", str(1000 + index),
            "--checkpoint-dir", str(self.workdir / f"trainer-{index}"),
            "--checkpoint-every", "1000000",  # only when it stops
            "--progress-json",
            "--metrics-period", "2",  # for the dashboard
            "--log-level", "WARNING",
        ]  # fmt: skip
        behind_nat = role == "client mode" and self.nat is not None
        host = self.nat.home_addr if behind_nat and self.nat else self.listen_host
        argv += ["--host-maddrs", f"/ip4/{host}/tcp/0"]
        if role == "client mode":
            argv.append("--client-mode")
        if a.mode == "local":
            argv.append("--use-local-updates")
        log = str(self.workdir / f"trainer-{index}.log")
        prefix = self.nat.command_prefix() if behind_nat and self.nat else ()
        process = spawn(f"trainer {index}", *argv, log_path=log, prefix=prefix)
        self.processes.append(process)
        trainer = _Trainer(index, process, role, time.monotonic())
        self.trainers.append(trainer)
        threading.Thread(
            target=self._read, args=(trainer,), name=f"demo-{trainer.name}-events", daemon=True
        ).start()
        suffix = f", {role}" if role else ""
        suffix += " behind the NAT" if behind_nat else ""
        print(f"started trainer {index} (pid {process.pid}{suffix})", flush=True)
        return trainer

    def _read(self, trainer: _Trainer) -> None:
        while (line := trainer.process.lines.get()) is not None:
            if line.startswith("{"):
                try:
                    self.events.put((trainer, json.loads(line)))
                except json.JSONDecodeError:
                    continue
        self.events.put((trainer, {"event": "exit"}))

    def stop(self, timeout: float = 30.0) -> None:
        stop_all(self.processes, signal.SIGTERM, timeout)
        if self.nat is not None:
            self.nat.close()


# ---------------------------------------------------------------------- the run


@dataclass
class _Watch:
    """What the demo saw: global epochs over time, losses, peers, throughput."""

    began: float
    epoch: int = 0
    loss: float | None = None
    peers: int = 0
    history: list[tuple[float, float, int]] = field(default_factory=list)  # t, loss, peers
    rates: dict[int, float] = field(default_factory=dict)
    trained: set[int] = field(default_factory=set)

    def record(self, trainer: _Trainer, event: dict) -> bool:
        """Take one epoch report; True when it begins a new global epoch."""
        trainer.epochs.append(event)
        if event.get("samples", 0) > 0:
            self.trained.add(trainer.index)
        self.rates[trainer.index] = float(event.get("samples_per_s") or 0.0)
        new = event["epoch"] > self.epoch
        if event.get("loss") is not None and (new or event["epoch"] == self.epoch):
            self.loss = float(event["loss"])
        self.peers = int(event.get("peers") or self.peers)
        if new:
            self.epoch = event["epoch"]
            if self.loss is not None:
                self.history.append((time.monotonic() - self.began, self.loss, self.peers))
        return new

    def samples_per_s(self, trainers: list[_Trainer]) -> float:
        return sum(self.rates.get(t.index, 0.0) for t in trainers if t.process.alive())


def run(args: argparse.Namespace) -> int:
    return run_demo(_TrainingDemo, args, _check)


class DemoRun:
    """One run of a demo, in a folder of its own; :func:`run_demo` starts and ends it."""

    title = "swarmgrad demo"  # how its own lines begin; its folder is named after it too

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir

    def main(self) -> int:
        """The demo itself: its exit status, or RuntimeError when it could not finish."""
        raise NotImplementedError

    def failed_logs(self) -> Iterable[tuple[Path, str]]:
        """The (log file, process name) pairs whose last lines explain a failure."""
        return ()

    def stop(self) -> None:
        """Stop every process the demo started (called once, whatever happened)."""


def run_demo(
    demo: type[DemoRun],
    args: argparse.Namespace,
    check: Callable[[argparse.Namespace], None],
) -> int:
    """Check the options, run the demo in a new folder, then stop its processes and remove
    its files (a full run's plot stays). Exit status: the demo's, 1 when it failed, 2 for
    bad options, 130 after Ctrl-C."""
    title = demo.title
    try:
        check(args)
    except ValueError as e:
        print(f"{title}: error: {e}", flush=True)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = Path(tempfile.mkdtemp(prefix=title.replace(" ", "-") + "-"))
    session = demo(args, workdir)
    keep = False
    try:
        result = session.main()
        keep = True
        return result
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process of the demo", flush=True)
        return 130
    except RuntimeError as e:
        print(f"{title}: failed: {e}", flush=True)
        for path, name in session.failed_logs():
            _print_tail(path, name)
        return 1
    finally:
        # a second Ctrl-C must not cut the cleanup short and leave processes behind
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            session.stop()
            _clean(workdir, keep_plot=keep)
        finally:
            signal.signal(signal.SIGINT, previous)


class _TrainingDemo(DemoRun):
    """Trainers of a tiny GPT, one of them in client mode, one killed, one joining late."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        super().__init__(args, workdir)
        self.swarm = _Swarm(args, workdir)

    def main(self) -> int:
        args, swarm = self.args, self.swarm
        print(
            f"swarmgrad demo: {args.trainers} trainers{_LATE if args.join_at else ''} train a "
            "tiny GPT on "
            f"Python's standard library for {args.duration:.0f} s ({_MODE_TEXT[args.mode]}, "
            f"{args.target_batch_size} samples per global epoch); files in {self.workdir}",
            flush=True,
        )
        began = time.monotonic()
        print(f"the client-mode trainer runs {swarm.start_nat()}", flush=True)
        swarm.start_bootstrap()
        if not args.no_monitor:
            swarm.start_monitor()
        for index in range(args.trainers):
            swarm.start_trainer("client mode" if index == args.trainers - 1 else "")
        watch = _train(swarm, args)
        swarm.stop()
        return _report(swarm, watch, args, self.workdir, time.monotonic() - began)

    def failed_logs(self) -> Iterable[tuple[Path, str]]:
        return [(self.workdir / f"trainer-{t.index}.log", t.name) for t in self.swarm.trainers]

    def stop(self) -> None:
        self.swarm.stop(timeout=20.0)


def progress_bar(duration: float, disable: bool) -> tuple[Any, Callable[[str], None]]:
    """The demos' progress bar (seconds of the run, a status after them) and how to print
    a line above it (plain prints when it is disabled)."""
    from tqdm import tqdm

    bar = tqdm(
        total=round(duration), disable=disable, unit="s", dynamic_ncols=True,
        desc="training", bar_format="{desc} {bar} {n_fmt}/{total_fmt} s {postfix}",
    )  # fmt: skip
    say = bar.write if not disable else (lambda text: print(text, flush=True))
    return bar, say


def _train(swarm: _Swarm, args: argparse.Namespace) -> _Watch:
    join_time = args.join_at * args.duration if args.join_at > 0 else None
    kill_time = args.kill_at * args.duration if args.kill_at > 0 else None
    began = time.monotonic()
    watch = _Watch(began)
    bar, say = progress_bar(args.duration, args.no_progress)
    victim = swarm.trainers[1]
    joiner: _Trainer | None = None
    while (elapsed := time.monotonic() - began) < args.duration:
        if join_time is not None and joiner is None and elapsed >= join_time:
            joiner = swarm.start_trainer("late joiner")
            say(f"{elapsed:5.1f} s: trainer {joiner.index} joins late (swarm at epoch "
                f"{watch.epoch}); it will download the model from the others")  # fmt: skip
        if kill_time is not None and victim.killed_at_epoch is None and elapsed >= kill_time:
            victim.process.stop(signal.SIGKILL)
            victim.killed_at_epoch = watch.epoch
            say(f"{elapsed:5.1f} s: trainer {victim.index} SIGKILLed at epoch {watch.epoch}; "
                "the others carry on")  # fmt: skip
        try:
            trainer, event = swarm.events.get(timeout=0.5)
        except queue.Empty:
            trainer, event = None, {}
        if event.get("event") == "epoch":
            first = not trainer.epochs
            new = watch.record(trainer, event)
            if first and trainer.role == "late joiner":
                say(f"{elapsed:5.1f} s: trainer {trainer.index} caught up: its first step "
                    f"was global epoch {event['epoch']}, with the others")  # fmt: skip
            if new and args.no_progress:
                print(_status(watch, swarm, elapsed), flush=True)
        elif event.get("event") == "exit" and trainer is not victim:
            raise RuntimeError(f"{trainer.name} exited early (code {trainer.process.popen.wait()})")
        bar.set_postfix_str(_status(watch, swarm, None), refresh=False)
        bar.update(min(round(elapsed), bar.total) - bar.n)
    bar.close()
    return watch


def _status(watch: _Watch, swarm: _Swarm, elapsed: float | None) -> str:
    loss = "-" if watch.loss is None else f"{watch.loss:.3f}"
    head = "" if elapsed is None else f"{elapsed:5.1f} s: "
    return (
        f"{head}epoch {watch.epoch}, loss {loss}, peers {watch.peers}, "
        f"{watch.samples_per_s(swarm.trainers):.0f} samples/s"
    )


# ---------------------------------------------------------------------- the end


def _report(
    swarm: _Swarm, watch: _Watch, args: argparse.Namespace, workdir: Path, elapsed: float
) -> int:
    import torch

    from swarmgrad.cli import demo_model
    from swarmgrad.cli.tiny_lm import generate, validation_loss

    demo_model.configure({"width": str(args.width), "layers": str(args.layers),
                          "context": str(args.context)})  # fmt: skip
    _, held_out = demo_model.corpus_split()
    torch.manual_seed(0)
    untrained = demo_model.make_model()
    trained = demo_model.make_model()
    checkpoint = _final_checkpoint(swarm, workdir)
    trained.load_state_dict(checkpoint["model"])
    before = math.exp(validation_loss(untrained, held_out, windows=256))
    after = math.exp(validation_loss(trained, held_out, windows=256))
    print(
        f"\nValidation perplexity on held-out standard-library text: {after:.2f} "
        f"(untrained model: {before:.2f}, {before / after:.1f}x lower) after "
        f"{checkpoint['epoch']} global epochs",
        flush=True,
    )
    generator = torch.Generator().manual_seed(args.seed)
    print("Sampled text:")
    for prompt in _PROMPTS:
        text = (prompt + generate(trained, prompt, 80, generator)).decode("utf-8", "replace")
        for line in text.splitlines()[:3]:
            print(f"  | {line}")
    plot = _plot(watch, Path(args.plot) if args.plot else workdir / "swarmgrad-demo.png")
    peers = sorted(watch.trained)
    print(
        f"Summary: {len(peers)} trainers trained ({', '.join(map(str, peers))}) in "
        f"{elapsed:.0f} s; global epoch {watch.epoch}; " + _kill_text(swarm.trainers[1]),
        flush=True,
    )
    print(f"Plot: {plot}" if plot else "Plot: not drawn (pip install matplotlib to get one)")
    print(json.dumps({
        "wall_s": elapsed, "perplexity_untrained": before, "perplexity_trained": after,
        "peers_trained": len(peers), "global_epoch": watch.epoch, "plot": str(plot or ""),
        "monitor_url": swarm.monitor_url,
    }), flush=True)  # fmt: skip
    return 0 if after < before else 1


def _kill_text(victim: _Trainer) -> str:
    if victim.killed_at_epoch is None:
        return "no trainer was killed."
    return f"{victim.name} was SIGKILLed at epoch {victim.killed_at_epoch}."


def _final_checkpoint(swarm: _Swarm, workdir: Path) -> dict:
    """The checkpoint of the first trainer that saved one when it stopped."""
    from swarmgrad.cli.train_checkpoint import load_checkpoint

    for trainer in swarm.trainers:
        if trainer.killed_at_epoch is None:
            state = load_checkpoint(workdir / f"trainer-{trainer.index}")
            if state is not None:
                return state
    raise RuntimeError("no trainer saved a checkpoint when it stopped")


def _plot(watch: _Watch, path: Path) -> Path | None:
    return plot_history(
        watch.history, path, "swarmgrad demo: one tiny GPT trained by a swarm", "peers"
    )


def plot_history(
    history: list[tuple[float, float, int]], path: Path, title: str, count_label: str
) -> Path | None:
    """Loss (left axis) and a count of peers (right axis, a step line) over seconds, as
    a PNG at ``path``; None without matplotlib. ``history``: (seconds, loss, count)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    times = [t for t, _, _ in history]
    figure, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot(times, [loss for _, loss, _ in history], color="tab:blue")
    loss_axis.set_xlabel("seconds")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    peer_axis = loss_axis.twinx()
    peer_axis.step(times, [p for _, _, p in history], where="post", color="tab:orange")
    peer_axis.set_ylabel(count_label, color="tab:orange")
    peer_axis.set_ylim(0, max([p for _, _, p in history], default=1) + 1)
    loss_axis.set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _clean(workdir: Path, keep_plot: bool) -> None:
    """Remove the demo's files; after a full run, only its plot stays."""
    if keep_plot and any(workdir.glob("*.png")):
        for entry in workdir.iterdir():
            if entry.suffix != ".png":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def _print_tail(path: Path, name: str, lines: int = 15) -> None:
    if path.exists():
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            print(f"--- last lines of {name}'s log:\n" + "\n".join(tail), flush=True)
