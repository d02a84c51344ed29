"""Chaos soak: ``swarmgrad train`` peers and a keeper under a seeded schedule of failures.

Runs with no arguments: six trainers and a keeper (``--role keeper``) train the demo's
tiny GPT on Python's standard-library sources for 30 minutes, while a chaos schedule
(seeded, every action logged with its time) every 30-90 s

* SIGKILLs a random trainer and restarts it (it comes back with no checkpoint: the swarm
  and the keeper carry the state),
* takes a random trainer's link down for 20 s (nft rules dropping every TCP port the
  process holds on loopback; needs root and nft, else logged as skipped),
* pauses a random trainer with SIGSTOP for 15 s,

and once, halfway, restarts every trainer at the same moment (only the keeper holds the
state then). The same swarm then runs undisturbed from scratch until its keeper has kept
the epoch the chaos run's keeper last kept: the same number of samples (an epoch is
``target_batch_size`` samples), so the loss ratio shows what the failures did to the
model, and the two runs' minutes show what they cost in time.

Reported (a table, then one JSON line): epochs lost (the swarm's epoch, the highest a live
trainer holds, lower than it had reached for longer than a peer takes to catch up, or
the epoch the swarm resumed at after every trainer restarted, below the one it left), the
held-out loss of the keeper's last state in both runs and their ratio (target within 3%),
each long-lived process's RSS at the start (after its first epoch) and at the end
(growth <= 10%) and over the run's second half (steady growth), its threads and open
files at the start and the end (equal; each the fewest of 5 reads over a second, so that
a checkpoint being written at that moment is not counted), and whether every checkpoint
the keeper left loads. ``--minutes`` and ``--peers`` scale it
down (``--small``: 3 trainers, 3 minutes per run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing it
MODEL_OPTIONS = ["context=32", "width=48", "layers=2", "heads=4", "corpus_bytes=400000"]


class Peer:
    """A ``swarmgrad train`` process whose --progress-json events a thread collects."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict):
        self.name, self.argv, self.workdir, self.env = name, argv, workdir, env
        self.events: list[dict] = []
        self.popen: subprocess.Popen | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"{self.name}-{self.starts}.log", "w")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "swarmgrad.cli.main", *self.argv],
            stdout=subprocess.PIPE, stderr=log, text=True, env=self.env,
        )  # fmt: skip
        log.close()  # the child has its own descriptor
        threading.Thread(target=self._read, args=(self.popen, self.starts), daemon=True).start()

    def _read(self, popen: subprocess.Popen, start: int) -> None:
        for line in popen.stdout:
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                    self.events.append({**event, "seen": time.monotonic(), "start": start})
                except json.JSONDecodeError:
                    pass

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait()

    def epochs(self) -> list[int]:
        return [e["epoch"] for e in self.events if e["event"] in ("epoch", "kept")]

    def latest_epoch(self) -> int | None:
        """The last epoch this process (its current start) reported, if any yet."""
        for event in reversed(self.events):
            if event.get("start") != self.starts:
                return None
            if event["event"] in ("epoch", "kept"):
                return event["epoch"]
        return None

    def kept_epoch(self) -> int | None:
        kept = [e["epoch"] for e in self.events if e["event"] == "kept"]
        return max(kept, default=None)


def resume(pid: int) -> None:
    """SIGCONT to a paused trainer, unless it was killed (and restarted) meanwhile."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def proc_figures(pid: int, reads: int = 5, gap: float = 0.25) -> dict | None:
    """RSS (bytes), threads and open file descriptors of a process, from /proc: the
    median RSS and the fewest threads and descriptors of ``reads`` reads ``gap`` seconds
    apart. A keeper writing a checkpoint holds a file (and a trainer's background write a
    thread) for a moment; one read that lands in it is not a leak, a count that stays up
    through every read is."""
    samples = [s for s in (_proc_read(pid, i and gap) for i in range(reads)) if s]
    if not samples:
        return None
    rss = sorted(s["rss"] for s in samples)[len(samples) // 2]
    return {
        "rss": rss,
        "threads": min(s["threads"] for s in samples),
        "fds": min(s["fds"] for s in samples),
    }


def _proc_read(pid: int, delay: float) -> dict | None:
    time.sleep(delay)
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {
            "rss": int(fields["VmRSS"].split()[0]) * 1024,
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
        }
    except (OSError, KeyError, ValueError):
        return None


class LinkCutter:
    """Drops every loopback TCP packet to or from the ports a process holds (nft), for a
    while: the process's links are down, nobody else's."""

    def __init__(self) -> None:
        self.available = os.geteuid() == 0 and shutil.which("nft") and shutil.which("ss")
        self.table = f"swarmgrad_chaos_{os.getpid()}"

    def ports_of(self, pid: int) -> list[int]:
        out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True).stdout
        out += subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout
        ports = set()
        for line in out.splitlines():
            if f"pid={pid}," in line:
                local = line.split()[3]
                ports.add(int(local.rsplit(":", 1)[1]))
        return sorted(ports)

    def cut(self, pid: int, seconds: float) -> list[int]:
        ports = self.ports_of(pid)
        if not ports:
            return []
        listed = ", ".join(map(str, ports))
        rules = (
            f"table inet {self.table} {{\n chain input {{ type filter hook input priority 0; "
            f"tcp dport {{ {listed} }} drop; tcp sport {{ {listed} }} drop; }}\n}}\n"
        )
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
        threading.Timer(seconds, self.restore).start()
        return ports

    def restore(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)


class Swarm:
    def __init__(self, label: str, args: argparse.Namespace, workdir: Path, env: dict):
        self.label, self.args, self.workdir, self.env = label, args, workdir, env
        workdir.mkdir(parents=True, exist_ok=True)
        boot_log = open(workdir / "boot.log", "w")
        self.boot = subprocess.Popen(
            [sys.executable, "-m", "swarmgrad.cli.main", "dht", "--host-maddrs",
             "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE, stderr=boot_log, text=True, env=env,
        )  # fmt: skip
        boot_log.close()
        self.address = ""
        for line in self.boot.stdout:
            if "--initial-peers" in line:
                self.address = line.split()[-1]
                break
        module = str(REPO / "swarmgrad" / "cli" / "demo_model.py")
        self.common = [
            "train", "--model-module", module, "--module-options", *MODEL_OPTIONS,
            "--run-id", f"chaos-{label}", "--initial-peers", self.address,
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--target-batch-size", "512",
            "--batch-size", "16", "--matchmaking-time", "2", "--averaging-timeout", "20",
            "--metadata-expiration", "20", "--metrics-period", "0", "--progress-json",
        ]  # fmt: skip
        kept = str(workdir / "kept")
        keeper = ["--role", "keeper", "--keep-every", "1", "--checkpoint-dir", kept]
        self.keeper = Peer("keeper", [*self.common, *keeper], workdir, env)
        self.trainers = [
            Peer(f"trainer{i}", [*self.common, "--seed", str(i)], workdir, env)
            for i in range(args.peers)
        ]

    def swarm_epoch(self) -> int:
        return max((max(p.epochs(), default=0) for p in self.trainers), default=0)

    def shutdown(self) -> None:
        for peer in [*self.trainers, self.keeper]:
            if peer.alive():
                peer.popen.send_signal(signal.SIGTERM)
        for peer in [*self.trainers, self.keeper]:
            try:
                peer.popen.wait(60)
            except subprocess.TimeoutExpired:
                peer.kill()
        self.boot.send_signal(signal.SIGTERM)
        try:
            self.boot.wait(30)
        except subprocess.TimeoutExpired:
            self.boot.kill()


class EpochWatch:
    """Epochs lost: the swarm's epoch (the highest that a live trainer, started and
    reporting, holds) below the highest it had reached, for longer than a peer takes to
    catch up (``settle`` seconds: a laggard, or a leader killed just after its update,
    is not progress lost; a swarm that went back to an older state is)."""

    def __init__(self, settle: float):
        self.settle, self.high, self.lost = settle, 0, 0
        self._below_since: float | None = None

    def sample(self, trainers: list[Peer], now: float) -> None:
        live = [p.latest_epoch() for p in trainers if p.alive()]
        if not live or None in live:
            return  # a (re)started trainer has not reported yet
        current = max(live)
        if current >= self.high:
            self.high, self._below_since = current, None
            return
        if self._below_since is None:
            self._below_since = now
        elif now - self._below_since >= self.settle:
            self.lost = max(self.lost, self.high - current)


def run(
    label: str,
    args: argparse.Namespace,
    workdir: Path,
    env: dict,
    chaos: bool,
    stop_epoch: int | None = None,
) -> dict:
    """One swarm for ``args.minutes`` (chaos) or until its keeper has kept
    ``stop_epoch`` (calm: the same number of samples as the chaos run trained)."""
    swarm = Swarm(label, args, workdir, env)
    rng = random.Random(args.seed)
    cutter = LinkCutter()
    log: list[dict] = []
    began = time.monotonic()
    duration = args.minutes * 60
    first: dict[str, dict] = {}
    middle: dict | None = None  # the keeper's figures halfway
    restarted_all = False
    watch = EpochWatch(settle=30 * args.pace)
    resumed: dict | None = None  # the restart of every trainer: where the swarm went on
    next_action = began + rng.uniform(30, 90) * args.pace
    try:
        while (now := time.monotonic()) - began < duration * (1 if chaos else 2):
            kept = swarm.keeper.kept_epoch()
            if stop_epoch is not None and kept is not None and kept >= stop_epoch:
                break
            watch.sample(swarm.trainers, now)
            if resumed is not None and resumed["resumed_at"] is None:
                firsts = [p.latest_epoch() for p in swarm.trainers]
                if any(e is not None for e in firsts):
                    resumed["resumed_at"] = max(e for e in firsts if e is not None)
            for peer in [swarm.keeper, *swarm.trainers]:
                if peer.name not in first and peer.epochs() and peer.alive():
                    figures = proc_figures(peer.popen.pid)
                    if figures:
                        first[peer.name] = {**figures, "pid": peer.popen.pid}
            if chaos and middle is None and now - began >= duration / 2 and swarm.keeper.alive():
                middle = proc_figures(swarm.keeper.popen.pid)  # before the restart of all
            if chaos and not restarted_all and now - began >= duration / 2:
                before = swarm.swarm_epoch()
                for peer in swarm.trainers:
                    peer.kill()
                for peer in swarm.trainers:
                    peer.start()
                restarted_all = True
                resumed = {"before": before, "resumed_at": None}
                log.append({"t": now - began, "action": "restart all trainers", "epoch": before})
            elif chaos and now >= next_action:
                victim = rng.choice(swarm.trainers)
                action = rng.choice(["kill", "link", "pause"])
                entry = {"t": now - began, "action": action, "peer": victim.name,
                         "epoch": swarm.swarm_epoch()}  # fmt: skip
                if action == "kill":
                    victim.kill()
                    victim.start()
                elif action == "pause" and victim.alive():
                    victim.popen.send_signal(signal.SIGSTOP)
                    pid = victim.popen.pid
                    threading.Timer(15 * args.pace, resume, (pid,)).start()
                elif action == "link":
                    if cutter.available and victim.alive():
                        try:
                            entry["ports"] = cutter.cut(victim.popen.pid, 20 * args.pace)
                        except (OSError, subprocess.CalledProcessError) as e:
                            entry["skipped"] = f"nft failed: {e}"
                    else:
                        entry["skipped"] = "needs root, nft and ss"
                log.append(entry)
                next_action = now + rng.uniform(30, 90) * args.pace
            time.sleep(0.5)
        epochs_lost = watch.lost
        if resumed is not None and resumed["resumed_at"] is not None:
            epochs_lost = max(epochs_lost, resumed["before"] - resumed["resumed_at"])
        end = {}
        for peer in [swarm.keeper, *swarm.trainers]:
            if peer.name in first and peer.alive() and peer.popen.pid == first[peer.name]["pid"]:
                end[peer.name] = proc_figures(peer.popen.pid)
    finally:
        swarm.shutdown()
        if cutter.available:
            cutter.restore()
    return {
        "label": label,
        "chaos_log": log,
        "final_epoch": swarm.swarm_epoch(),
        "kept_epoch": swarm.keeper.kept_epoch(),
        "minutes": (time.monotonic() - began) / 60,
        "epochs_lost": epochs_lost,
        "restart_all": resumed,
        "held_out_loss": held_out_loss(workdir / "kept"),
        "checkpoints_load": checkpoints_load(workdir / "kept"),
        "processes": {name: {"start": first[name], "end": end.get(name)} for name in first},
        "keeper_middle": middle,
    }


def held_out_loss(directory: Path) -> float | None:
    """The held-out loss of the last state the keeper exported (``model.pt``)."""
    from swarmgrad.cli import demo_model
    from swarmgrad.cli.tiny_lm import validation_loss

    path = directory / "model.pt"
    if not path.exists():
        return None
    demo_model.configure(dict(o.split("=") for o in MODEL_OPTIONS))
    model = demo_model.make_model()
    model.load_state_dict(torch.load(path))
    _, held = demo_model.corpus_split()
    return validation_loss(model, held, windows=256)


def checkpoints_load(directory: Path) -> bool:
    from swarmgrad.cli.train_checkpoint import checkpoint_paths

    paths = checkpoint_paths(directory)
    try:
        for path in paths:
            state = torch.load(path, weights_only=True)
            assert "model" in state and "epoch" in state
    except Exception:
        return False
    return bool(paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="of each run (30)")
    parser.add_argument("--peers", type=int, default=6, help="trainers (6)")
    parser.add_argument("--seed", type=int, default=0, help="of the chaos schedule (0)")
    parser.add_argument("--small", action="store_true", help="3 trainers, 3 minutes a run")
    parser.add_argument("--keep", action="store_true", help="keep the logs directory")
    args = parser.parse_args()
    if args.small:
        args.minutes, args.peers = min(args.minutes, 3.0), min(args.peers, 3)
    # the schedule's 30-90 s gaps, 15 s pauses and 20 s link cuts scale with short runs
    args.pace = min(1.0, args.minutes / 30.0 * 2.0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    workdir = Path(tempfile.mkdtemp(prefix="swarmgrad-chaos-"))
    try:
        disturbed = run("chaos", args, workdir / "chaos", env, chaos=True)
        calm = run("calm", args, workdir / "calm", env, chaos=False,
                   stop_epoch=disturbed["kept_epoch"] or 1)  # fmt: skip
    finally:
        if args.keep:
            print(f"logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    growth = {}
    for name, figures in disturbed["processes"].items():
        if figures["end"]:
            start, end = figures["start"], figures["end"]
            growth[name] = {
                "rss_growth": end["rss"] / start["rss"] - 1,
                "threads": [start["threads"], end["threads"]],
                "fds": [start["fds"], end["fds"]],
            }
            middle = disturbed["keeper_middle"]
            if name == "keeper" and middle:
                growth[name]["rss_growth_second_half"] = end["rss"] / middle["rss"] - 1
    ratio = None
    if disturbed["held_out_loss"] and calm["held_out_loss"]:
        ratio = disturbed["held_out_loss"] / calm["held_out_loss"]
    for entry in disturbed["chaos_log"]:
        note = f"  ({entry['skipped']})" if "skipped" in entry else ""
        print(f"{entry['t']:8.1f} s  {entry['action']:<22} {entry.get('peer', ''):<10} "
              f"epoch {entry['epoch']}{note}")  # fmt: skip
    print(f"epochs lost: {disturbed['epochs_lost']} (restart of every trainer: "
          f"{disturbed['restart_all']}); the keeper kept epoch {disturbed['kept_epoch']} in "
          f"{disturbed['minutes']:.1f} min, undisturbed: epoch {calm['kept_epoch']} in "
          f"{calm['minutes']:.1f} min")  # fmt: skip
    print(f"held-out loss at that epoch: {disturbed['held_out_loss']} vs undisturbed "
          f"{calm['held_out_loss']} (ratio {ratio})")  # fmt: skip
    for name, g in growth.items():
        half = g.get("rss_growth_second_half")
        half_text = "" if half is None else f" ({half:+.1%} in the second half)"
        print(f"{name:<10} RSS {g['rss_growth']:+.1%}{half_text}  threads {g['threads']}  "
              f"fds {g['fds']} (threads and fds: the fewest of 5 reads over 1 s)")  # fmt: skip
    print(f"keeper checkpoints load: {disturbed['checkpoints_load']}")
    print(json.dumps({
        "minutes": args.minutes, "peers": args.peers, "seed": args.seed,
        "epochs_lost": disturbed["epochs_lost"], "final_epoch": disturbed["final_epoch"],
        "kept_epoch": disturbed["kept_epoch"], "kept_epoch_undisturbed": calm["kept_epoch"],
        "minutes_undisturbed": calm["minutes"], "restart_all": disturbed["restart_all"],
        "held_out_loss": disturbed["held_out_loss"],
        "held_out_loss_undisturbed": calm["held_out_loss"], "loss_ratio": ratio,
        "processes": growth, "checkpoints_load": disturbed["checkpoints_load"],
        "chaos_log": disturbed["chaos_log"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
