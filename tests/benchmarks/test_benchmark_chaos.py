"""``benchmarks/chaos.py``'s count of epochs lost, on made-up swarms: a laggard or a
leader killed just after its update costs nothing; a swarm that goes back and stays
back has lost the difference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def _chaos():
    spec = importlib.util.spec_from_file_location("chaos_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


class FakeTrainer:
    def __init__(self, epoch: int | None, alive: bool = True):
        self.epoch, self.is_alive = epoch, alive

    def alive(self) -> bool:
        return self.is_alive

    def latest_epoch(self) -> int | None:
        return self.epoch


def test_a_laggard_and_a_short_dip_lose_nothing_a_lasting_drop_is_counted():
    watch = _chaos().EpochWatch(settle=10)
    leader, laggard = FakeTrainer(30), FakeTrainer(29)
    watch.sample([leader, laggard], now=0)
    assert (watch.high, watch.lost) == (30, 0)
    # the leader dies right after its update; the others catch up within the settle time
    leader.is_alive = False
    watch.sample([leader, laggard], now=1)
    laggard.epoch = 30
    watch.sample([leader, laggard], now=5)
    assert watch.lost == 0
    # a restarted trainer that has not reported yet says nothing about the swarm
    restarted = FakeTrainer(None)
    watch.sample([laggard, restarted], now=6)
    assert watch.lost == 0
    # every trainer back at an older state, for longer than the settle time: lost
    laggard.epoch, restarted.epoch = 27, 27
    watch.sample([laggard, restarted], now=20)
    watch.sample([laggard, restarted], now=31)
    assert watch.lost == 3


def test_a_file_held_for_a_moment_is_not_counted_one_held_through_every_read_is():
    import os
    import threading

    chaos = _chaos()
    pid = os.getpid()
    quiet = chaos.proc_figures(pid, reads=3, gap=0.05)
    moment = open(BENCHMARK, "rb")  # open during the first read only (a checkpoint write)
    threading.Timer(0.1, moment.close).start()
    assert chaos.proc_figures(pid, reads=4, gap=0.1)["fds"] == quiet["fds"]
    with open(BENCHMARK, "rb"):  # held through every read: counted
        assert chaos.proc_figures(pid, reads=3, gap=0.05)["fds"] == quiet["fds"] + 1
