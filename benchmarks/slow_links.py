"""Training over slow links: synchronous averaging against DiLoCo, Streaming DiLoCo and
PowerSGD, with every peer behind a 20 Mbit/s link.

    python benchmarks/slow_links.py            # all modes, about 10 minutes here

Four peers train :class:`_tiny_lm.TinyGPT` (120k parameters, byte-level, context 64) on
Python's own standard-library sources, each peer in its own network namespace behind a
veth shaped with ``tc tbf`` to 20 Mbit/s both ways (``_star_lab``); the bootstrap peer
sits on the hub, unshaped. Where the lab cannot be built (no root, no ``ip``), the same
runs go over loopback, unshaped, and the bytes are the loopback's total over four.
Compute is real (one thread per peer, batch 16), plus ``--step-sleep`` (0.2 s) per step
for the rest of a real step, as in ``collaborative.py``: with 20-ms steps, epochs of one
step per peer would measure the progress tracker's lag, not the links.

Every mode processes the same number of samples (4 outer steps x 50 x 16 x 4 peers)
with the
same inner optimizer (AdamW, lr 3e-3):

* ``sync``: :class:`swarmgrad.Optimizer`, gradients averaged every step of the swarm
  (``target_batch_size`` = 4 x 16), uncompressed, as data-parallel training does;
* ``diloco``: :class:`swarmgrad.DiLoCoOptimizer`, H = 50 inner steps per peer between
  outer steps (Nesterov, lr 0.7), pseudo-gradients in 4 bits (``blockwise_4bit``, error
  feedback; OpenDiLoCo sent float16, INTELLECT-1 int8);
* ``streaming``: the same with 4 fragments synced in turn and 8-bit pseudo-gradients
  (``uniform_8bit``, error feedback);

both with ``deflate=True`` (the codes zlib-coded, losslessly);
* ``powersgd``: ``sync`` with :class:`swarmgrad.PowerSGDGradientAverager`, rank 4.

Reported per mode: ``bytes_per_1k_samples`` (bytes one peer sent, the mean over peers,
per 1,000 samples of the swarm), ``peak_bytes_per_s`` (the most one peer sent in any
one-second window, median over peers), ``wall_s``, ``final_loss`` (held-out loss of peer
0's model at the end) and the loss curve. Then a DiLoCo run in which one peer is
SIGKILLed during the second outer step: ``kill_outer_steps_lost`` counts outer steps the
survivors skipped or repeated. ``site_loss_ratio`` comes from ``benchmarks/sites.py``
(two sites of two ``torch.distributed`` ranks against four flat peers, one repeat) when
it exists.
The plot of loss against wall time goes to ``benchmarks/results/slow_links.png`` (``docs/`` with
``SWARMGRAD_UPDATE_DOCS=1``; needs matplotlib).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _child_process import JsonLinesProcess  # noqa: E402
from _results import figure_path  # noqa: E402
from _star_lab import HUB_ADDR, StarLab, lab_unavailable_reason  # noqa: E402
from _tiny_lm import untrained_loss  # noqa: E402

MODES = ("sync", "diloco", "streaming", "powersgd")
GRADIENT_MODES = ("sync", "powersgd")
BOOTSTRAP = (
    "import sys, time, swarmgrad\n"
    "dht = swarmgrad.DHT(host_maddrs=[f'/ip4/{sys.argv[1]}/tcp/0'], start=True)\n"
    "print(dht.get_visible_maddrs()[0], flush=True)\n"
    "time.sleep(3600)\n"
)


class Proc(JsonLinesProcess):
    """A peer process (see ``_child_process``) and the events this benchmark reads."""

    def epochs(self) -> dict[int, dict]:
        return {e["epoch"]: e for e in self.of_kind("epoch")}

    def done(self) -> bool:
        return bool(self.of_kind("done"))


class Network:
    """Where peers run: the star lab's hosts, or loopback."""

    def __init__(self, lab: StarLab | None, peers: int):
        self.lab, self.peers = lab, peers

    def host(self, index: int | None) -> tuple[list[str], str]:
        if self.lab is None:
            return [], "127.0.0.1"
        address = HUB_ADDR if index is None else self.lab.addresses[index]
        return self.lab.exec_prefix(index), address

    def sent(self) -> list[int]:
        if self.lab is not None:
            return self.lab.tx_bytes_all()
        with open("/proc/net/dev") as f:
            for line in f:
                if line.strip().startswith("lo:"):
                    return [int(line.split()[9]) // self.peers] * self.peers
        return [0] * self.peers


def run_mode(
    net: Network,
    mode: str,
    epochs: int,
    args,
    kill_at: float | None = None,
    per_peer_samples: int | None = None,
) -> dict:
    """One swarm of ``args.peers`` peers in ``mode`` until the swarm reaches ``epochs``."""
    log_dir = Path(args.log_dir) if args.log_dir else None
    # about a dozen points on the loss curve (gradient modes: ~1.5 steps per peer per epoch)
    if per_peer_samples is not None:
        evaluate_every = max(1, per_peer_samples // 16 // 18)
    else:
        evaluate_every = max(1, epochs // 12)
    prefix, hub = net.host(None)
    procs: list[Proc] = []
    try:
        boot = Proc([*prefix, sys.executable, "-c", BOOTSTRAP, hub], None)
        procs.append(boot)
        address = boot.first_line(60)
        before = net.sent()
        samples_log: list[tuple[float, list[int]]] = []
        began = time.time()
        peers = []
        for i in range(args.peers):
            prefix, host = net.host(i)
            argv = [
                *prefix, sys.executable, str(HERE / "_slow_links_peer.py"), "--mode", mode,
                "--host", host, "--initial-peers", address, "--seed", str(i),
                "--peers", str(args.peers), "--epochs", str(epochs),
                "--step-sleep", str(args.step_sleep),
                "--evaluate-every", str(evaluate_every),
            ]  # fmt: skip
            if i == 0:
                argv.append("--evaluate")
            if per_peer_samples is not None:
                argv += ["--samples", str(per_peer_samples)]
            if mode in GRADIENT_MODES:
                # a one-step epoch waits out the matchmaking window (the optimizer begins a
                # round early only when the group is full): 1 s keeps the run under budget
                argv += ["--matchmaking-time", "1.0"]
            log = log_dir / f"{mode}{'_kill' if kill_at else ''}_{i}.log" if log_dir else None
            peers.append(Proc(argv, log))
        procs.extend(peers)
        victim = peers[-1] if kill_at is not None else None
        killed_epoch = None
        deadline = time.monotonic() + args.mode_timeout
        while not all(p.done() for p in peers if p is not victim):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: the swarm did not finish in {args.mode_timeout} s")
            for p in peers:
                if p.process.poll() not in (None, 0) and p is not victim:
                    raise RuntimeError(f"{mode}: a peer exited with {p.process.returncode}")
            sent = net.sent()  # timestamped when read, not before the read began
            samples_log.append((time.time(), sent))
            if victim is not None and killed_epoch is None:
                reached = peers[0].epochs()
                if (
                    int(kill_at) in reached
                    and time.time()
                    > reached[int(kill_at)]["time"] + (kill_at % 1) * args.epoch_estimate
                ):
                    killed_epoch = max(peers[0].epochs())  # the swarm's outer step
                    victim.kill()
            time.sleep(0.1)
        wall = time.time() - began
        after = net.sent()
        if log_dir:  # the bytes each peer had sent, every 0.1 s: where the peaks are
            (log_dir / f"{mode}{'_kill' if kill_at else ''}_tx.json").write_text(
                json.dumps(
                    {"began": began, "tx": [(round(t - began, 2), s) for t, s in samples_log]}
                )
            )
        records = [p.epochs() for p in peers]
        total_samples = sum(max(r.values(), key=lambda e: e["epoch"])["samples"] for r in records)
        if victim is not None:
            total_samples = sum(
                max(r.values(), key=lambda e: e["epoch"])["samples"]
                for r, p in zip(records, peers, strict=True)
                if p is not victim
            )
        sent = [a - b for a, b in zip(after, before, strict=True)]
        evals = sorted(
            (e["time"] - began, e["samples"], e["val_loss"])
            for e in records[0].values()
            if "val_loss" in e
        )
        result = {
            "wall_s": round(wall, 1),
            "samples": total_samples,
            "bytes_per_1k_samples": round(statistics.mean(sent) / (total_samples / 1000)),
            "peak_bytes_per_s": round(_peak_rate(samples_log)),
            "final_loss": round(evals[-1][2], 4),
            "curve": [(round(t, 1), s, round(loss, 4)) for t, s, loss in evals],
        }
        if victim is not None:
            survivors = [r for r, p in zip(records, peers, strict=True) if p is not victim]
            lost = 0
            for r in survivors:
                seen = sorted(r)
                lost += sum(1 for e in range(seen[0], seen[-1] + 1) if e not in r)
            result.update(killed_in_epoch=killed_epoch, outer_steps_lost=lost)
        return result
    finally:
        for p in procs:
            p.kill()


def _peak_rate(samples_log: list[tuple[float, list[int]]], window: float = 1.0) -> float:
    """The most bytes one peer sent in any ``window`` seconds (median over peers)."""
    if len(samples_log) < 2:
        return 0.0
    peaks = []
    for peer in range(len(samples_log[0][1])):
        best, start = 0.0, 0
        for end in range(len(samples_log)):
            while samples_log[end][0] - samples_log[start][0] > window:
                start += 1
            best = max(best, samples_log[end][1][peer] - samples_log[start][1][peer])
        peaks.append(best / window)
    return statistics.median(peaks)


def site_ratio() -> float | None:
    script = HERE / "sites.py"
    if not script.exists():
        return None
    # one repeat (2.5 min): three, the script's default, took this run past 15 minutes;
    # `python benchmarks/sites.py` alone gives the median of three
    done = subprocess.run(
        [sys.executable, str(script), "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"sites.py failed ({done.returncode}): {done.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1]).get("site_loss_ratio")


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for mode, result in results.items():
        curve = result.get("curve") or []
        if curve:
            axis.plot([t for t, _, _ in curve], [loss for _, _, loss in curve], label=mode)
    axis.set_xlabel("wall time (s), 4 peers on 20 Mbit/s links")
    axis.set_ylabel("held-out loss (nats per byte)")
    axis.set_title("TinyGPT on the Python standard library")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", default="20mbit")
    parser.add_argument("--outer-steps", type=int, default=4, help="DiLoCo outer steps")
    parser.add_argument("--mode-timeout", type=float, default=420.0)
    parser.add_argument("--epoch-estimate", type=float, default=12.0)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument("--skip-sites", action="store_true")
    parser.add_argument("--log-dir", default=os.environ.get("SLOW_LOG_DIR"))
    args = parser.parse_args()
    # SIGTERM (timeout, a CI runner) ends through the finally blocks: peers killed and the
    # lab's namespaces deleted, instead of left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    inner_steps, batch = 50, 16
    samples = args.outer_steps * inner_steps * batch * args.peers
    gradient_modes = GRADIENT_MODES
    epochs = {mode: 10**9 if mode in gradient_modes else args.outer_steps for mode in MODES}
    reason = lab_unavailable_reason()
    results: dict[str, dict] = {}
    extra: dict = {}
    lab = StarLab(args.peers, args.rate) if reason is None else None
    try:
        if lab is not None:
            lab.__enter__()
        else:
            print(f"network lab unavailable ({reason}): loopback, unshaped", file=sys.stderr)
        net = Network(lab, args.peers)
        for mode in args.modes:
            budget = samples // args.peers if mode in gradient_modes else None
            results[mode] = run_mode(net, mode, epochs[mode], args, per_peer_samples=budget)
            brief = {k: v for k, v in results[mode].items() if k != "curve"}
            print(f"{mode}: {json.dumps(brief)}", file=sys.stderr)
        if not args.skip_kill:
            killed = run_mode(net, "diloco", 4, args, kill_at=1.5)
            extra["kill_outer_steps_lost"] = killed["outer_steps_lost"]
            extra["kill_final_loss"] = killed["final_loss"]
            print(f"diloco with a kill: {json.dumps(killed)}", file=sys.stderr)
    finally:
        if lab is not None:
            lab.close()
    extra["site_loss_ratio"] = None if args.skip_sites else site_ratio()

    sync = results.get("sync")
    if sync:
        for mode in ("diloco", "streaming", "powersgd"):
            if mode in results:
                r = results[mode]
                r["bytes_ratio_vs_sync"] = round(
                    sync["bytes_per_1k_samples"] / max(1, r["bytes_per_1k_samples"]), 1
                )
                r["loss_ratio_vs_sync"] = round(r["final_loss"] / sync["final_loss"], 4)
    if "diloco" in results and "streaming" in results:
        extra["streaming_peak_ratio"] = round(
            results["diloco"]["peak_bytes_per_s"]
            / max(1, results["streaming"]["peak_bytes_per_s"]),
            2,
        )
    plot_path = figure_path("slow_links.png")
    plotted = plot(results, plot_path)
    summary = {
        "lab": lab is not None,
        "rate": args.rate if lab is not None else None,
        "samples": samples,
        "untrained_loss": round(untrained_loss(), 4),
        **{mode: {k: v for k, v in r.items() if k != "curve"} for mode, r in results.items()},
        **extra,
        "plot": str(plot_path.relative_to(REPO)) if plotted else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
