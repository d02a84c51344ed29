"""Collaborative training (``swarmgrad.Optimizer``): efficiency, convergence and churn.

Runs with no arguments (about 5-8 minutes here) and prints a table, then one JSON line:

* **Efficiency.** 4 peers, each its own process, a 9.45M-parameter model; each local step
  computes 2 real rows and sleeps ``--step-sleep`` (the accelerator each peer would have),
  accounting for 32 samples; ``target_batch_size`` is set from the measured solo step time
  so that an epoch lasts about 5 s. Swarm throughput (samples/s over 10 epochs after a
  warm-up epoch) against the ideal, the sum of the peers' solo rates. The same worker runs
  hivemind 1.1.12's Optimizer when ``HIVEMIND_PYTHON`` names an interpreter that has it.
* **Convergence.** 4 peers train an MLP on scikit-learn's digits to 40 epochs of 256
  samples; one process trains the same model with the same global batch for the same
  number of updates. Held-out loss ratio, swarm / single.
* **Churn.** 4 peers (epochs of about 2 s); one is SIGKILLed in the middle of epoch 3 and
  a fifth joins at epoch 5. Reported: the time from the kill to the next epoch the
  survivors complete, whether any epoch was lost from the kill on (a survivor skipping
  or re-running an epoch; a peer that lags at start-up and catches up by a download
  also skips one, which is not the kill's cost), and whether the joiner's parameters
  equal the others' (1e-6) after its first update.

JSON keys: ``efficiency``, ``hivemind_efficiency`` (or null), ``loss_ratio_vs_single``,
``kill_recovery_s``, ``joiner_synced``, ``epochs_lost``, and the figures behind them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_collab_peer.py"
sys.path.insert(0, str(HERE))


class Worker:
    """A trainer process whose JSON lines are collected by a reader thread."""

    def __init__(self, python: str, args: list[str]):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
        self.process = subprocess.Popen(
            [python, str(WORKER), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # stop() kills its whole group (hivemind forks helpers)
        )
        self.events: queue.Queue = queue.Queue()
        self.epochs: dict[int, dict] = {}
        self.ready: dict | None = None
        self.stderr: list[str] = []
        log_dir = os.environ.get("COLLAB_LOG_DIR")
        self.log = None
        if log_dir:  # COLLAB_LOG_DIR=dir (and COLLAB_VERBOSE=1): each worker's log there
            os.makedirs(log_dir, exist_ok=True)
            self.log = open(os.path.join(log_dir, f"{self.process.pid}.log"), "w")
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "ready":
                self.ready = event
            elif event.get("event") == "epoch":
                self.epochs.setdefault(event["epoch"], event)
            self.events.put(event)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr = [*self.stderr[-40:], line]
            if self.log is not None:
                self.log.write(line)

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            if self.process.poll() is not None and not condition():
                time.sleep(0.3)
                if not condition():
                    tail = "".join(self.stderr[-15:])
                    raise RuntimeError(f"worker exited ({self.process.returncode}):\n{tail}")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 120) -> dict:
        self.wait(lambda: self.ready is not None, timeout, "a worker to start")
        return self.ready

    def wait_epoch(self, epoch: int, timeout: float) -> dict:
        self.wait(lambda: epoch in self.epochs, timeout, f"epoch {epoch}")
        return self.epochs[epoch]

    def stop(self) -> None:
        """SIGKILL the worker and every process it started (hivemind's DHT and averagers
        are child processes that would otherwise keep running and take the CPU)."""
        kill_group(self.process)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process started with ``start_new_session`` and all it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


def start_swarm(python: str, count: int, common: list[str], bootstrap: str) -> list[Worker]:
    workers = [
        Worker(python, [*common, "--seed", str(i), "--initial-peers", bootstrap])
        for i in range(count)
    ]
    for worker in workers:
        worker.wait_ready()
    return workers


def bootstrap_peer(python: str, impl: str) -> tuple[subprocess.Popen, str]:
    """A DHT peer of the same implementation, for the trainers to join through."""
    code = (
        "import sys, time\n"
        + ("import hivemind\n" if impl == "hivemind" else "import swarmgrad as hivemind\n")
        + "dht = hivemind.DHT(start=True"
        + (", host_maddrs=['/ip4/127.0.0.1/tcp/0']" if impl == "hivemind" else "")
        + ")\n"
        "print([str(m) for m in dht.get_visible_maddrs()][0], flush=True)\n"
        "time.sleep(3600)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    process = subprocess.Popen(
        [python, "-c", code], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    assert process.stdout is not None
    address = process.stdout.readline().strip()
    if not address:
        kill_group(process)
        raise RuntimeError(f"the {impl} bootstrap peer did not start")
    return process, address


def measure_efficiency(python: str, impl: str, args) -> dict:
    bootstrap, address = bootstrap_peer(python, impl)
    workers: list[Worker] = []
    try:
        # the epoch length is set from the solo step time, measured the same way the
        # workers measure it: 4 peers at 32 samples per step, epochs of about 5 s
        probe = Worker(
            python,
            [
                "--impl",
                impl,
                "--target-batch-size",
                "1",
                "--epochs",
                "0",
                "--step-sleep",
                str(args.step_sleep),
                "--initial-peers",
                address,
                "--run-id",
                "probe",
            ],
        )
        solo_step = probe.wait_ready()["solo_step"]
        probe.wait(lambda: probe.process.poll() is not None, 60, "the probe to exit")
        target = round(args.epoch_seconds * 4 * 32 / solo_step / 32) * 32
        common = [
            "--impl",
            impl,
            "--run-id",
            f"eff_{impl}",
            "--target-batch-size",
            str(target),
            "--step-sleep",
            str(args.step_sleep),
            "--epochs",
            str(args.epochs + 1),
            "--matchmaking-time",
            str(args.matchmaking_time),
            "--averaging-timeout",
            "30",
            *(["--delay"] if args.delay else []),
            "--average-state-every",
            str(args.average_state_every),
        ]
        workers = start_swarm(python, 4, common, address)
        for worker in workers:
            worker.wait_epoch(args.epochs + 1, 60 + 3 * args.epochs * args.epoch_seconds)
        rates = []
        for worker in workers:
            first, last = worker.epochs[1], worker.epochs[args.epochs + 1]
            rates.append((last["samples"] - first["samples"]) / (last["time"] - first["time"]))
        ideal = 4 * 32 / solo_step  # one peer's rate alone, measured before the swarm
        durations = [
            (w.epochs[args.epochs + 1]["time"] - w.epochs[1]["time"]) / args.epochs for w in workers
        ]
        return {
            "efficiency": sum(rates) / ideal,
            "swarm_samples_per_s": sum(rates),
            "ideal_samples_per_s": ideal,
            "epoch_s": sorted(durations)[len(durations) // 2],
            "target_batch_size": target,
        }
    finally:
        for worker in workers:
            worker.stop()
        kill_group(bootstrap)


def measure_convergence(python: str, args) -> dict:
    """Four peers against one process with the same global batch and updates."""
    from _collab_peer import digits_model, digits_split

    epochs, target, batch = args.digits_epochs, 256, 16
    bootstrap, address = bootstrap_peer(python, "swarmgrad")
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            common = [
                "--task",
                "digits",
                "--run-id",
                "digits",
                "--target-batch-size",
                str(target),
                "--batch-size",
                str(batch),
                "--epochs",
                str(epochs),
                "--lr",
                "0.5",
                "--step-sleep",
                "0.01",
                "--matchmaking-time",
                "1.0",
                "--dump-dir",
                tmp,
            ]
            workers = start_swarm(python, 4, common, address)
            for worker in workers:
                worker.wait_epoch(epochs, 400)
                worker.wait(lambda w=worker: w.process.poll() is not None, 60, "exit")
            swarm_model = digits_model()
            swarm_model.load_state_dict(torch.load(os.path.join(tmp, "model_0.pt")))
        finally:
            for worker in workers:
                worker.stop()
            kill_group(bootstrap)

    (train_x, train_y), (test_x, test_y) = digits_split()
    single_losses, single_accs = [], []
    for seed in range(3):  # the baseline's own noise is several %: average three runs
        torch.manual_seed(0)
        single = digits_model()
        opt = torch.optim.SGD(single.parameters(), lr=0.5)
        generator = torch.Generator().manual_seed(99 + seed)
        for _ in range(epochs):
            index = torch.randint(len(train_x), (target,), generator=generator)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(single(train_x[index]), train_y[index]).backward()
            opt.step()
        with torch.no_grad():
            logits = single(test_x)
            single_losses.append(float(torch.nn.functional.cross_entropy(logits, test_y)))
            single_accs.append(float((logits.argmax(1) == test_y).float().mean()))
    single_loss, single_acc = sum(single_losses) / 3, sum(single_accs) / 3
    with torch.no_grad():
        swarm_loss = float(torch.nn.functional.cross_entropy(swarm_model(test_x), test_y))
        swarm_acc = float((swarm_model(test_x).argmax(1) == test_y).float().mean())
    untrained = digits_model()
    with torch.no_grad():
        initial_loss = float(torch.nn.functional.cross_entropy(untrained(test_x), test_y))
    return {
        "loss_ratio_vs_single": swarm_loss / single_loss,
        "swarm_test_loss": swarm_loss,
        "single_test_loss": single_loss,
        "initial_test_loss": initial_loss,
        "swarm_test_accuracy": swarm_acc,
        "single_test_accuracy": single_acc,
        "digits_epochs": epochs,
    }


def measure_churn(python: str, args) -> dict:
    bootstrap, address = bootstrap_peer(python, "swarmgrad")
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            common = [
                "--run-id",
                "churn",
                "--target-batch-size",
                "768",
                "--step-sleep",
                "0.1",
                "--epochs",
                "10",
                "--matchmaking-time",
                "1.0",
                "--averaging-timeout",
                str(args.churn_timeout),
                "--dump-dir",
                tmp,
            ]
            workers = start_swarm(python, 4, common, address)
            victim, survivors = workers[3], workers[:3]
            start3 = survivors[0].wait_epoch(3, 120)
            time.sleep(max(0.0, start3["time"] + 1.0 - time.time()))  # mid-epoch 3
            killed_epoch = max(victim.epochs)
            victim.stop()
            killed_at = time.time()
            survivors[0].wait_epoch(5, 120)
            joiner = Worker(python, [*common, "--seed", "4", "--initial-peers", address])
            workers.append(joiner)
            joiner.wait_ready()
            for worker in (*survivors, joiner):
                worker.wait_epoch(10, 240)
            next_epochs = [w.epochs[killed_epoch + 1]["time"] for w in survivors]
            recovery = min(next_epochs) - killed_at
            lost = sum(1 for w in survivors for e in range(killed_epoch, 10) if e not in w.epochs)
            joined = min(e for e in joiner.epochs if e > 0)
            # its first update: the first epoch after joining that both the joiner and a
            # survivor began (a joiner that had to download again may skip one)
            first_update = min(e for e in joiner.epochs if e > joined and e in survivors[0].epochs)
            paths = [os.path.join(tmp, f"{seed}_{first_update}.pt") for seed in (4, 0)]
            deadline = time.monotonic() + 30  # the epoch's line is printed before its dump
            while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
                time.sleep(0.1)
            mine, theirs = (torch.load(p) for p in paths)
            gap = float((mine - theirs).abs().max())
            return {
                "kill_recovery_s": recovery,
                "killed_in_epoch": killed_epoch,
                "epochs_lost": lost,
                "joiner_joined_at_epoch": joined,
                "joiner_max_param_gap": gap,
                "joiner_synced": gap <= 1e-6,
            }
        finally:
            for worker in workers:
                worker.stop()
            kill_group(bootstrap)


def hivemind_python() -> str | None:
    python = os.environ.get("HIVEMIND_PYTHON")
    if not python:
        return None
    check = subprocess.run([python, "-c", "import hivemind"], capture_output=True)
    return python if check.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epoch-seconds", type=float, default=5.0)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument(
        "--average-state-every", type=int, default=1, help="both sides (hivemind's default: 1)"
    )
    parser.add_argument(
        "--delay",
        action="store_true",
        help="delay_optimizer_step and delay_grad_averaging (both sides)",
    )
    parser.add_argument("--digits-epochs", type=int, default=40)
    parser.add_argument("--churn-timeout", type=float, default=10.0)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=("efficiency", "hivemind", "convergence", "churn")
    )
    args = parser.parse_args()

    results: dict = {"efficiency": None, "hivemind_efficiency": None}
    if "efficiency" not in args.skip:
        ours = measure_efficiency(sys.executable, "swarmgrad", args)
        results.update(ours)
        print(
            f"efficiency: ours {ours['efficiency']:.3f} ({ours['swarm_samples_per_s']:.0f} "
            f"of {ours['ideal_samples_per_s']:.0f} samples/s, epochs of "
            f"{ours['epoch_s']:.2f} s)",
            flush=True,
        )
    python = hivemind_python()
    if python is not None and "hivemind" not in args.skip:
        theirs = measure_efficiency(python, "hivemind", args)
        results["hivemind_efficiency"] = theirs["efficiency"]
        results["hivemind_epoch_s"] = theirs["epoch_s"]
        results["hivemind_samples_per_s"] = theirs["swarm_samples_per_s"]
        print(
            f"efficiency: hivemind {theirs['efficiency']:.3f} "
            f"({theirs['swarm_samples_per_s']:.0f} of {theirs['ideal_samples_per_s']:.0f} "
            f"samples/s, epochs of {theirs['epoch_s']:.2f} s)",
            flush=True,
        )
    elif python is None:
        print(
            "efficiency: hivemind not measured (set HIVEMIND_PYTHON to an interpreter "
            "that has hivemind 1.1.12)",
            flush=True,
        )
    if "convergence" not in args.skip:
        conv = measure_convergence(sys.executable, args)
        results.update(conv)
        print(
            f"convergence: held-out loss swarm {conv['swarm_test_loss']:.4f} vs single "
            f"{conv['single_test_loss']:.4f} (ratio {conv['loss_ratio_vs_single']:.3f}; "
            f"untrained {conv['initial_test_loss']:.3f}); accuracy "
            f"{conv['swarm_test_accuracy']:.3f} vs {conv['single_test_accuracy']:.3f}",
            flush=True,
        )
    if "churn" not in args.skip:
        churn = measure_churn(sys.executable, args)
        results.update(churn)
        print(
            f"churn: killed in epoch {churn['killed_in_epoch']}, next epoch after "
            f"{churn['kill_recovery_s']:.2f} s, epochs lost {churn['epochs_lost']}, joiner "
            f"(epoch {churn['joiner_joined_at_epoch']}) in sync: {churn['joiner_synced']} "
            f"(max gap {churn['joiner_max_param_gap']:.2e})",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
