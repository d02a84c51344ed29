"""SWARM pipeline parallelism against a fixed GPipe-style pipeline: throughput, a peer
killed mid-run, rebalancing from a starved stage.

    python benchmarks/swarm_pipeline.py          # about 4 minutes here

A GPT-style model (``_pipeline_stages.py``: the model of ``pipeline_convergence.py``) in
4 stages. Eight stage peers, each a ``swarmgrad serve-stage`` process, with unequal
speeds: each sleeps ``--base-slowdown / speed`` seconds per forward pass (a backward that
recomputes the forward sleeps again), speeds ``1, 1`` and six of ``0.6`` (two fast
devices, six slower ones), so the sleeps, not the machine's two cores, set how fast a
peer is. Micro-batches of 16 sequences, one per server batch (``--max-batch-size 16``:
a server cannot speed up by merging requests, as a device at full use would not). Every
peer and trainer runs in its own network namespace behind a link shaped to ``--rate``
(50 Mbit/s) both ways (``_star_lab``); the bootstrap peer sits on the hub. Where the
lab cannot be built (no root, no ``ip``), everything runs on loopback, unshaped, and
``network`` says so.

1. **Fixed pipeline**: the four fastest peers, one per stage (``--fixed``: peers 0, 2,
   1, 3), no rebalancing; two trainers, each GPipe-style (the forwards of
   ``--in-flight`` micro-batches, then their backwards, then a flush). Its throughput,
   then its stage-1 peer (``--kill-stage``) is SIGKILLed.
2. **SWARM**: all eight peers, starting 3/2/2/1 (the last stage, one peer, the
   bottleneck), rebalancing every ``--rebalance-interval`` seconds, stage averaging on;
   two trainers, each with ``--in-flight`` micro-batches in flight, routed by stochastic
   wiring. The throughput before the first move, the layout after rebalancing and the
   throughput then; then the same peer as in 1 is SIGKILLed (by default peer 2, a slow
   one sharing stage 1 with a fast one; ``--kill-stage 0`` kills fast peer 0, whose
   stage then needs a peer moved to it): the time until the
   throughput is back to 0.8 of before, and what became of the micro-batches in flight
   (retried hops; dropped ones, that failed on every try). A trainer samples every
   stage's servers in the DHT twice a second: no stage may ever be empty.

Throughput: samples whose backward finished, summed over both trainers, per second.
Recovery: from the kill to the end of the first ``--window``-second window, starting
after the kill, at >= 0.8 x the throughput before, from whose start to the end of the
fault window the throughput averages >= 0.8 x too (back, and staying back; never less
than one window). The stage peers keep no activation cache (``--activation-cache-mb
0``): every backward recomputes its forward, so a peer takes as long per micro-batch
loaded or idle (with the cache, an idle peer skips the recomputation, looks twice as
fast, and misleads the rebalancing plan: seen here).
Convergence comes from ``pipeline_convergence.py``, run first (``--no-convergence``:
only point to it).

The plot (throughput over time for both pipelines, the SWARM stages' servers over time)
goes to ``benchmarks/results/swarm_pipeline.png`` (``docs/`` with
``SWARMGRAD_UPDATE_DOCS=1``; needs matplotlib). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _child_process import JsonLinesProcess  # noqa: E402
from _results import figure_path  # noqa: E402
from _star_lab import StarLab, lab_unavailable_reason  # noqa: E402

STAGE_MODULE = HERE / "_pipeline_stages.py"
TRAINER = HERE / "_pipeline_trainer.py"
SUBNET = "10.83.0"
RECOVERED = 0.8  # the fraction of the throughput before a kill that counts as recovered


def parse_layout(text: str) -> list[list[int]]:
    """``"0,5,7/1,6/2,4/3"``: the peers (by index) of each stage."""
    return [[int(p) for p in stage.split(",")] for stage in text.split("/")]


# ---------------------------------------------------------------------- processes


class Network:
    """Where processes run: the star lab's hosts (peers, then trainers), or loopback."""

    def __init__(self, lab: StarLab | None):
        self.lab = lab

    def place(self, host: int | None) -> tuple[list[str], str]:
        """(command prefix, address to listen on) of ``host`` (None: the hub)."""
        if self.lab is None:
            return [], "127.0.0.1"
        address = self.lab.hub_addr if host is None else self.lab.addresses[host]
        return self.lab.exec_prefix(host), address


class Run:
    """The processes of one benchmark run; :meth:`close` kills those still alive."""

    def __init__(self, net: Network, args: argparse.Namespace, log_dir: Path):
        self.net, self.args, self.log_dir = net, args, log_dir
        self.env = {"SWARM_PIPELINE_STAGES": str(args.stages), "OMP_NUM_THREADS": "1"}
        self.processes: list[JsonLinesProcess] = []
        self.bootstrap = ""

    def spawn(self, host: int | None, argv: list[str], name: str) -> JsonLinesProcess:
        prefix, _ = self.net.place(host)
        process = JsonLinesProcess([*prefix, *argv], self.log_dir / f"{name}.log", self.env)
        process.name = name
        self.processes.append(process)
        return process

    def start_bootstrap(self) -> str:
        _, address = self.net.place(None)
        boot = self.spawn(
            None,
            [sys.executable, "-m", "swarmgrad.cli.main", "dht",
             "--host-maddrs", f"/ip4/{address}/tcp/0"],
            "bootstrap",
        )  # fmt: skip
        self.bootstrap = wait_line(boot, "/ip4/", 120)
        return self.bootstrap

    def start_peer(self, peer: int, pipeline: str, stage: int, rebalance: bool) -> JsonLinesProcess:
        a = self.args
        _, address = self.net.place(peer)
        argv = [
            sys.executable, "-m", "swarmgrad.cli.main", "serve-stage",
            "--module", str(STAGE_MODULE), "--pipeline", pipeline, "--stage", str(stage),
            "--initial-peers", self.bootstrap, "--host-maddrs", f"/ip4/{address}/tcp/0",
            "--update-period", str(a.update_period),
            "--average-period", str(a.average_period if rebalance else 0),
            "--rebalance-interval", str(a.rebalance_interval if rebalance else 0),
            "--hysteresis", str(a.hysteresis),
            "--max-batch-size", str(a.batch_size), "--batch-timeout", "0.005",
            "--activation-cache-mb", "0",
            "--slowdown", f"{a.base_slowdown / a.speeds[peer]:.4f}",
            "--log-level", "WARNING",
        ]  # fmt: skip
        return self.spawn(peer, argv, f"{pipeline}-peer{peer}")

    def start_trainer(
        self, index: int, pipeline: str, mode: str, duration: float, watch: bool
    ) -> JsonLinesProcess:
        a = self.args
        host = len(a.speeds) + index
        _, address = self.net.place(host)
        argv = [
            sys.executable, str(TRAINER), "--initial-peers", self.bootstrap,
            "--pipeline", pipeline, "--stages", str(a.stages), "--mode", mode,
            "--in-flight", str(a.in_flight), "--batch-size", str(a.batch_size),
            "--duration", str(duration), "--timeout", str(a.hop_timeout),
            "--host", address, "--seed", str(index + 1),
        ]  # fmt: skip
        if watch:
            argv.append("--watch")
        return self.spawn(host, argv, f"{pipeline}-trainer{index}")

    def stop(self, processes: list[JsonLinesProcess]) -> None:
        for process in processes:
            if process.process.poll() is None:
                try:
                    os.killpg(process.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for process in processes:
            try:
                process.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            process.kill()  # SIGKILL to whatever is left, then reaped
            with open(self.log_dir / f"{process.name}.events.jsonl", "w") as f:
                f.writelines(json.dumps(event) + "\n" for event in process.events)

    def close(self) -> None:
        self.stop(self.processes)


def wait_line(process: JsonLinesProcess, prefix: str, timeout: float) -> str:
    """The first line of ``process``'s output (stripped) that starts with ``prefix``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = process.lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if process.process.poll() is not None:
                break
            continue
        if line.startswith(prefix):
            return line
    raise RuntimeError(
        f"{process.name} printed no line starting with {prefix!r} within {timeout:.0f} s "
        f"(exit code {process.process.poll()}); see its log"
    )


def wait_serving(peers: dict[int, JsonLinesProcess], timeout: float) -> dict[str, int]:
    """Wait until every peer serves; returns {PeerID: peer index}."""
    ids = {}
    for index, process in peers.items():
        maddr = wait_line(process, "/ip4/", timeout)
        ids[maddr.rsplit("/p2p/", 1)[1]] = index
    return ids


def wait_ready(trainers: list[JsonLinesProcess], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [t.of_kind("ready") for t in trainers]
        if all(ready):
            return max(r[0]["t"] for r in ready)
        for trainer in trainers:
            if trainer.process.poll() is not None:
                raise RuntimeError(f"{trainer.name} exited early; see its log")
        time.sleep(0.2)
    raise RuntimeError(f"the trainers were not ready within {timeout:.0f} s")


def kill_peer(process: JsonLinesProcess) -> float:
    os.killpg(process.process.pid, signal.SIGKILL)
    return time.time()


# ---------------------------------------------------------------------- figures


def finished(trainers: list[JsonLinesProcess]) -> list[tuple[float, int, bool]]:
    return sorted((e["t"], e["samples"], e["ok"]) for t in trainers for e in t.of_kind("mb"))


def rate(events: list[tuple[float, int, bool]], start: float, end: float) -> float:
    if end <= start:
        return 0.0
    return sum(n for t, n, ok in events if ok and start <= t < end) / (end - start)


def recovery(events, killed: float, before: float, window: float, horizon: float):
    """(seconds from the kill to the end of the first window at >= RECOVERED x before
    from whose start to the horizon the throughput also averages >= RECOVERED x before
    (recovered, and staying so), or None; the lowest window's throughput after the kill
    as a fraction of before)."""
    if before <= 0:
        return None, None
    recovered, lowest = None, float("inf")
    start, end = killed, killed + horizon
    while start + window <= end:
        ratio = rate(events, start, start + window) / before
        lowest = min(lowest, ratio)
        stays = rate(events, start, end) / before >= RECOVERED
        if recovered is None and ratio >= RECOVERED and stays:
            recovered = start + window - killed
        start += 0.25
    return recovered, (None if lowest == float("inf") else lowest)


def dropped(trainers, start: float = 0.0) -> int:
    return sum(1 for t in trainers for e in t.of_kind("mb") if not e["ok"] and e["t"] >= start)


def stats(trainers) -> dict[str, int]:
    total: dict[str, int] = {}
    for trainer in trainers:
        for event in trainer.of_kind("stats")[-1:]:
            for key, value in event.items():
                if key != "event":
                    total[key] = total.get(key, 0) + value
    return total


def layout_of(servers: list[list[str]], ids: dict[str, int]) -> list[list[int]]:
    return [sorted(ids.get(s, -1) for s in stage) for stage in servers]


def counts(layout) -> str:
    return "/".join(str(len(stage)) for stage in layout)


# ---------------------------------------------------------------------- phases


def fixed_phase(run: Run, args) -> dict:
    """One peer per stage (the fastest), GPipe-style trainers, then a kill."""
    fixed = args.fixed
    victim = fixed[args.kill_stage]
    peers = {p: run.start_peer(p, "fixed", stage, rebalance=False) for stage, p in enumerate(fixed)}
    wait_serving(peers, 240)
    duration = args.warmup + args.measure + args.fault_window + 60
    trainers = [
        run.start_trainer(i, "fixed", "gpipe", duration, False) for i in range(args.trainers)
    ]
    began = wait_ready(trainers, 240)
    time.sleep(args.warmup + args.measure)
    events = finished(trainers)
    start = began + args.warmup
    before = rate(events, start, start + args.measure)
    killed = kill_peer(peers[victim])
    print(f"fixed: {before:.1f} samples/s; peer {victim} (stage {args.kill_stage}) killed")
    time.sleep(args.fault_window)
    run.stop(trainers)
    events = finished(trainers)
    recovered, lowest = recovery(events, killed, before, args.window, args.fault_window)
    run.stop(list(peers.values()))
    return {
        "peers": fixed,
        "victim": victim,
        "samples_per_s": before,
        "recovery_s": recovered,
        "after_ratio": rate(events, killed + args.window, killed + args.fault_window) / before
        if before
        else None,
        "lowest_ratio": lowest,
        "dropped": dropped(trainers, killed),
        "stats": stats(trainers),
        "series": events,
        "began": began,
        "killed": killed,
    }


def swarm_phase(run: Run, args, victim: int) -> dict:
    """All peers from the starved layout, rebalancing, then the same kill."""
    start_layout = args.start
    peers = {
        p: run.start_peer(p, "swarm", stage, rebalance=True)
        for stage, members in enumerate(start_layout)
        for p in members
    }
    ids = wait_serving(peers, 240)
    budget = args.warmup + args.start_window + args.settle_budget + args.measure
    duration = budget + args.fault_window + 60
    trainers = [
        run.start_trainer(i, "swarm", "swarm", duration, watch=i == 0) for i in range(args.trainers)
    ]
    began = wait_ready(trainers, 240)
    watcher = trainers[0]

    def layout_now():
        samples = watcher.of_kind("stages")
        return layout_of(samples[-1]["servers"], ids) if samples else None

    expected = [sorted(s) for s in start_layout]
    first_move = None
    start_end = began + args.warmup + args.start_window
    while time.time() < start_end:  # the start window ends at the first move
        time.sleep(0.25)
        now = layout_now()
        if now is not None and now != expected:
            first_move = time.time()
            break
    start_rate_end = first_move or time.time()
    start_rate = rate(finished(trainers), began + args.warmup, start_rate_end)
    print(
        f"swarm: {start_rate:.1f} samples/s at the start ({counts(expected)}); "
        f"first move {'at %.0f s' % (first_move - began) if first_move else 'not yet'}"
    )
    # rebalancing settles: the layout unchanged for a rebalancing interval and a record
    # lifetime (every peer checked again and found no move worth making)
    settle_for = args.rebalance_interval + 3 * args.update_period
    deadline = time.time() + args.settle_budget
    last, since = layout_now(), time.time()
    while time.time() < deadline:
        time.sleep(0.5)
        now = layout_now()
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= settle_for and now != expected:
            break
    settled = time.time()
    time.sleep(args.measure)
    measured_end = time.time()
    after_rate = rate(finished(trainers), settled, measured_end)
    final_layout = layout_now()
    killed = kill_peer(peers[victim])
    print(f"swarm: {after_rate:.1f} samples/s after rebalancing ({counts(final_layout)}); "
          f"peer {victim} killed")  # fmt: skip
    time.sleep(args.fault_window)
    run.stop(trainers)
    events = finished(trainers)
    recovered, lowest = recovery(events, killed, after_rate, args.window, args.fault_window)
    samples = watcher.of_kind("stages")
    run.stop(list(peers.values()))
    # only samples while the trainers ran count; every record of a stage is a server
    sizes = [[len(stage) for stage in s["servers"]] for s in samples if s["t"] >= began]
    moves = []
    previous = expected
    for sample in samples:
        layout = layout_of(sample["servers"], ids)
        if layout != previous:
            moves.append({"t": round(sample["t"] - began, 1), "layout": layout})
            previous = layout
    return {
        "ids": ids,
        "start_layout": expected,
        "start_samples_per_s": start_rate,
        "start_window_s": start_rate_end - began - args.warmup,
        "first_move_s": None if first_move is None else first_move - began,
        "final_layout": final_layout,
        "samples_per_s": after_rate,
        "layouts": moves,
        "min_servers": min((min(s) for s in sizes), default=None),
        "stage_samples": len(sizes),
        "recovery_s": recovered,
        "lowest_ratio": lowest,
        "after_ratio": rate(events, killed + args.window, killed + args.fault_window) / after_rate
        if after_rate
        else None,
        "dropped": dropped(trainers),
        "dropped_after_kill": dropped(trainers, killed),
        "stats": stats(trainers),
        "series": events,
        "sizes": [(s["t"], [len(stage) for stage in s["servers"]]) for s in samples],
        "began": began,
        "killed": killed,
    }


def convergence(args) -> dict | str:
    if args.no_convergence:
        return "see benchmarks/pipeline_convergence.py (docs/pipeline.md, docs/benchmarks.md)"
    done = subprocess.run(
        [sys.executable, str(HERE / "pipeline_convergence.py")],
        capture_output=True, text=True, timeout=600, check=False,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))),
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"pipeline_convergence.py failed ({done.returncode}): {done.stderr[-300:]}"
    figures = json.loads(lines[-1])
    keep = ("heldout_loss_local", "heldout_loss_pipeline", "heldout_loss_pipeline_8bit",
            "pipeline_vs_local", "eight_bit_vs_exact", "bytes_ratio")  # fmt: skip
    return {key: figures[key] for key in keep}


def plot(fixed: dict, swarm: dict, args) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=False)
    for name, phase, color in (("fixed (GPipe)", fixed, "tab:gray"), ("SWARM", swarm, "tab:blue")):
        began, events = phase["began"], phase["series"]
        end = max((t for t, _, _ in events), default=began) - began
        xs = [x * 0.5 for x in range(int(end / 0.5))]
        ys = [rate(events, began + x - args.window, began + x) if x >= args.window else None
              for x in xs]  # fmt: skip
        top.plot(xs, ys, label=name, color=color)
        top.axvline(phase["killed"] - began, color=color, linestyle=":")
    top.set_ylabel(f"samples/s ({args.window:g} s window)")
    top.set_xlabel("seconds since the trainers started (dotted: a peer SIGKILLed)")
    top.legend()
    times = [t - swarm["began"] for t, _ in swarm["sizes"]]
    for stage in range(args.stages):
        bottom.step(
            times, [s[stage] for _, s in swarm["sizes"]], where="post", label=f"stage {stage}"
        )
    bottom.set_ylabel("SWARM servers")
    bottom.set_xlabel("seconds since the SWARM trainers started")
    bottom.legend(ncol=args.stages)
    figure.suptitle("SWARM pipeline vs a fixed pipeline of the fastest peers")
    figure.tight_layout()
    path = Path(args.plot) if args.plot else figure_path("swarm_pipeline.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _round(value, digits=2):
    return None if value is None else round(value, digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--speeds", default="1,1,0.6,0.6,0.6,0.6,0.6,0.6",
                        help="each stage peer's relative speed")  # fmt: skip
    parser.add_argument("--start", default="0,4,5/1,2/3,6/7",
                        help="SWARM's first layout: stages' peers, '/' between")  # fmt: skip
    parser.add_argument("--fixed", default="0,2,1,3",
                        help="the fixed pipeline's peer of each stage: the fastest")  # fmt: skip
    parser.add_argument("--kill-stage", type=int, default=1,
                        help="the fixed pipeline's peer here is SIGKILLed (both)")  # fmt: skip
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=8, help="micro-batches per trainer")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--base-slowdown", type=float, default=0.1,
                        help="seconds per forward pass of a peer of speed 1")  # fmt: skip
    parser.add_argument("--rate", default="50mbit", help="every link's rate (tc syntax)")
    parser.add_argument("--no-lab", action="store_true", help="loopback, unshaped")
    parser.add_argument("--update-period", type=float, default=1.0)
    parser.add_argument("--average-period", type=float, default=10.0)
    parser.add_argument("--rebalance-interval", type=float, default=20.0)
    parser.add_argument("--hysteresis", type=float, default=0.2)
    parser.add_argument("--hop-timeout", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--start-window", type=float, default=25.0)
    parser.add_argument("--settle-budget", type=float, default=90.0)
    parser.add_argument("--measure", type=float, default=20.0)
    parser.add_argument("--fault-window", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=3.0, help="throughput window (s)")
    parser.add_argument("--no-convergence", action="store_true")
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here")
    parser.add_argument("--plot", default=None, help="the figure's path (default: see above)")
    args = parser.parse_args()
    args.speeds = [float(s) for s in args.speeds.split(",")]
    args.start = parse_layout(args.start)
    if len(args.start) != args.stages or sorted(p for s in args.start for p in s) != list(
        range(len(args.speeds))
    ):
        parser.error("--start must place every peer of --speeds on one of --stages stages")
    args.fixed = [int(p) for p in args.fixed.split(",")]
    fastest = sorted(args.speeds, reverse=True)[: args.stages]
    if len(args.fixed) != args.stages or sorted(args.speeds[p] for p in args.fixed) != sorted(
        fastest
    ):
        parser.error("--fixed must name one of the fastest peers for every stage")
    if not 0 <= args.kill_stage < args.stages:
        parser.error("--kill-stage must be a stage")

    wall = time.monotonic()
    converged = convergence(args)
    reason = "--no-lab" if args.no_lab else lab_unavailable_reason()
    hosts = len(args.speeds) + args.trainers
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="swarm-pipe-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    lab = None
    try:
        if reason is None:
            lab = StarLab(hosts, args.rate, prefix="sgp", subnet=SUBNET).__enter__()
            network = f"lab: every peer and trainer behind its own {args.rate} link (tc tbf)"
        else:
            network = f"loopback, unshaped (no network lab: {reason})"
        print(f"network: {network}", flush=True)
        run = Run(Network(lab), args, log_dir)
        try:
            run.start_bootstrap()
            fixed = fixed_phase(run, args)
            swarm = swarm_phase(run, args, fixed["victim"])
        finally:
            run.close()
    except Exception:
        print(f"failed; the processes' logs are in {log_dir}", file=sys.stderr)
        raise
    finally:
        if lab is not None:
            lab.close()
    if not args.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)

    figure = plot(fixed, swarm, args)
    ratio = swarm["samples_per_s"] / fixed["samples_per_s"] if fixed["samples_per_s"] else None
    rebalance_ratio = (
        swarm["samples_per_s"] / swarm["start_samples_per_s"]
        if swarm["start_samples_per_s"]
        else None
    )
    result = {
        "benchmark": "swarm_pipeline",
        "network": network,
        "stages": args.stages,
        "peers": len(args.speeds),
        "trainers": args.trainers,
        "speeds": args.speeds,
        "micro_batch": args.batch_size,
        "in_flight_per_trainer": args.in_flight,
        "fixed_peers": fixed["peers"],
        "fixed_samples_per_s": _round(fixed["samples_per_s"]),
        "swarm_samples_per_s": _round(swarm["samples_per_s"]),
        "throughput_ratio": _round(ratio),
        "throughput_ratio_target": ">= 1.3",
        "killed_peer": fixed["victim"],
        "fault_recovery_s": _round(swarm["recovery_s"], 1),
        "fault_recovery_s_target": "<= 10",
        "fault_lowest_ratio": _round(swarm["lowest_ratio"]),
        "fault_after_ratio": _round(swarm["after_ratio"]),
        "fault_retried_hops": swarm["stats"].get("retried_hops", 0),
        "fault_dropped": swarm["dropped"],
        "fault_dropped_target": 0,
        "fixed_fault_recovery_s": _round(fixed["recovery_s"], 1),
        "fixed_fault_after_ratio": _round(fixed["after_ratio"]),
        "fixed_fault_dropped": fixed["dropped"],
        "rebalance_start_layout": counts(swarm["start_layout"]),
        "rebalance_final_layout": counts(swarm["final_layout"] or []),
        "rebalance_layouts": swarm["layouts"],
        "rebalance_start_samples_per_s": _round(swarm["start_samples_per_s"]),
        "rebalance_start_window_s": _round(swarm["start_window_s"], 1),
        "rebalance_after_samples_per_s": _round(swarm["samples_per_s"]),
        "rebalance_ratio": _round(rebalance_ratio),
        "rebalance_ratio_target": ">= 1.5",
        "min_servers_per_stage": swarm["min_servers"],
        "min_servers_per_stage_target": ">= 1",
        "stage_samples": swarm["stage_samples"],
        "convergence": converged,
        "convergence_target": "pipeline within 3 % of local; 8-bit within 1 % of exact and "
                              "4 x fewer bytes",
        "plot": str(figure or ""),
        "wall_s": round(time.monotonic() - wall, 1),
    }  # fmt: skip
    print(f"{'':34}{'samples/s':>10}")
    print(f"{'fixed pipeline (GPipe, fastest)':34}{fixed['samples_per_s']:10.1f}")
    for name, value in (
        ("SWARM, start " + result["rebalance_start_layout"], swarm["start_samples_per_s"]),
        ("SWARM, rebalanced " + result["rebalance_final_layout"], swarm["samples_per_s"]),
    ):
        print(f"{name:34}{value:10.1f}")
    print(f"kill: SWARM back to {RECOVERED:g} x in {result['fault_recovery_s']} s, "
          f"{result['fault_dropped']} dropped; fixed: {result['fixed_fault_after_ratio']} x after, "
          f"{result['fixed_fault_dropped']} dropped")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
