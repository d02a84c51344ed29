"""``swarmgrad demo`` (collaborative training): its options, and Ctrl-C in the middle of
a run, after which no process, listening port or file of the demo may remain."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from swarmgrad.cli import demo_command, demo_moe, demo_nat, demo_train
from swarmgrad.cli.main import main


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


def test_demo_alone_and_demo_train_run_collaborative_training_and_moe_the_experts():
    assert parse().run is demo_train.run
    assert parse("--duration", "30").duration == 30
    assert parse("train", "--trainers", "4").trainers == 4
    assert parse("train").run is demo_train.run
    assert parse("moe", "--epochs", "2").run is demo_moe.run


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainers", "2"], "--trainers must be at least 3"),
        (["--duration", "0"], "--duration must be positive"),
        (["--kill-at", "1.5"], "--kill-at must be in [0, 1)"),
        (["--width", "30"], "--width must be a multiple of 4"),
        (["--monitor-port", "70000"], "--monitor-port must be between 0 and 65535"),
    ],
)
def test_bad_demo_options_are_refused_by_name_before_starting_anything(capsys, argv, message):
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().out


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN"}


def test_without_the_lab_the_client_runs_on_loopback_and_says_why(monkeypatch):
    assert parse("--no-nat").no_nat and not parse().no_nat
    monkeypatch.setattr(demo_nat.os, "geteuid", lambda: 1000)
    nat, reason = demo_nat.DemoNat.create()
    assert nat is None and reason == "not root (ip netns needs it)"
    monkeypatch.setattr(demo_nat.shutil, "which", lambda tool: None)
    monkeypatch.setattr(demo_nat.os, "geteuid", lambda: 0)
    assert demo_nat.unavailable_reason() == "`ip` is not installed"


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_removes_the_files():
    demo = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad.cli.main", "demo", "--duration", "300",
         "--target-batch-size", "256", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
    )  # fmt: skip
    output: list[str] = []
    try:
        deadline = time.monotonic() + 180
        for line in demo.stdout:  # until the swarm has taken its first global step
            output.append(line)
            if re.match(r"\s*[\d.]+ s: epoch 1,", line) or time.monotonic() > deadline:
                break
        assert any(" s: epoch " in line for line in output), "".join(output)
        text = "".join(output)
        pids = [int(p) for p in re.findall(r"\bpid (\d+)", text)]  # the monitor's too
        port = int(re.search(r"bootstrap peer .* at /ip4/[\d.]+/tcp/(\d+)/", text).group(1))
        behind_nat = "client-mode trainer runs behind a NAT" in text
        if demo_nat.unavailable_reason() is None:  # this machine can: the demo must
            assert behind_nat and "client mode behind the NAT" in text, text
        dashboard = int(re.search(r"dashboard .*: http://127.0.0.1:(\d+)/", text).group(1))
        workdir = Path(re.search(r"files in (\S+)", text).group(1))
        assert len(pids) == 5 and workdir.is_dir()
        assert {port, dashboard} <= listening_ports()

        demo.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends
        rest, _ = demo.communicate(timeout=90)
        output.append(rest)
        assert demo.returncode == 130, "".join(output)
        assert "interrupted" in rest
        alive = [pid for pid in pids if psutil.pid_exists(pid)]
        assert not alive, f"processes left behind: {alive}\n" + "".join(output)
        assert not {port, dashboard} & listening_ports()
        assert not workdir.exists()
        if behind_nat:  # its namespaces (and with them the veths) are gone
            assert (
                f"sgdemo{demo.pid}"
                not in subprocess.run(
                    ["ip", "netns", "list"], capture_output=True, text=True, check=True
                ).stdout
            )
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()


class _FakeProcess:
    def __init__(self, alive: bool):
        self._alive = alive

    def alive(self) -> bool:
        return self._alive


def test_progress_follows_the_newest_global_epoch_and_counts_trainers_that_trained():
    one = demo_train._Trainer(1, _FakeProcess(True), "", 0.0)
    two = demo_train._Trainer(2, _FakeProcess(False), "", 0.0)
    watch = demo_train._Watch(began=time.monotonic())
    epoch = {"event": "epoch", "samples_per_s": 100.0, "samples": 32}
    assert watch.record(one, {**epoch, "epoch": 1, "loss": 5.0, "peers": 2})
    assert not watch.record(two, {**epoch, "epoch": 1, "loss": 4.0, "peers": 2})
    assert watch.record(one, {**epoch, "epoch": 2, "loss": 3.0, "peers": 3})
    assert not watch.record(two, {**epoch, "epoch": 1, "loss": 9.0, "peers": 3})  # stale
    assert (watch.epoch, watch.loss, watch.peers) == (2, 3.0, 3)
    assert [(loss, peers) for _, loss, peers in watch.history] == [(5.0, 2), (3.0, 3)]
    assert watch.trained == {1, 2}
    assert watch.samples_per_s([one, two]) == 100.0  # the dead trainer no longer counts


class _FailingDemo(demo_train.DemoRun):
    """A demo whose process writes a log and then fails (no real process)."""

    title = "swarmgrad demo failing"
    runs: list[_FailingDemo] = []

    def __init__(self, args: argparse.Namespace, workdir: Path):
        super().__init__(args, workdir)
        self.stopped = 0
        _FailingDemo.runs.append(self)

    def main(self) -> int:
        (self.workdir / "peer.log").write_text("starting\nthe reason it broke\n")
        raise RuntimeError("the peer exited")

    def failed_logs(self):
        return [(self.workdir / "peer.log", "peer 1")]

    def stop(self) -> None:
        self.stopped += 1


def test_a_failed_demo_shows_its_logs_stops_once_and_removes_its_folder(capsys):
    args = argparse.Namespace()
    assert demo_train.run_demo(_FailingDemo, args, lambda a: None) == 1
    out = capsys.readouterr().out
    assert "swarmgrad demo failing: failed: the peer exited" in out
    assert "last lines of peer 1's log" in out and "the reason it broke" in out
    (run,) = _FailingDemo.runs
    assert run.stopped == 1 and not run.workdir.exists()
    assert run.workdir.name.startswith("swarmgrad-demo-failing-")

    def refuse(a: argparse.Namespace) -> None:
        raise ValueError("--peers must be at least 4")

    assert demo_train.run_demo(_FailingDemo, args, refuse) == 2
    assert "swarmgrad demo failing: error: --peers must be at least 4" in capsys.readouterr().out
    assert len(_FailingDemo.runs) == 1  # refused before any folder or process
