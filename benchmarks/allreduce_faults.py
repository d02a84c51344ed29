"""All-reduce under failure: a member SIGKILLed mid-round, then a round without it.

Eight peers, each its own process, average 16 million float32 values over encrypted
loopback. In each trial one member, chosen at random, is SIGKILLed at a random moment
inside the round (between 10% and 90% of a normal round's time). Checks:

* every survivor's round ends within its deadline, and each of its values is a correct
  partial average: the average over all members, over the survivors (the victim's part
  did not arrive), or the survivor's own value (the victim owned that span) -- never
  anything else, never half a span;
* the next round, among the survivors only, averages everything exactly.

A fresh process then takes the victim's place for the next trial (started in advance,
not counted). Prints one line per trial ("mid-round": the death left some survivor without a full
average, i.e. it really happened during the round), then one JSON line with the totals.
Usage: ``python benchmarks/allreduce_faults.py [--trials 20] [--numel N]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _allreduce_peer import fault_worker, peer_id_string


class Member:
    def __init__(self, ctx, label: int, options: dict):
        self.label = label
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=fault_worker, args=(label, child, options), daemon=True)
        self.proc.start()
        child.close()
        self.maddr: str | None = None

    def ready(self, timeout: float = 120.0) -> str:
        if self.maddr is None:
            if not self.pipe.poll(timeout):
                raise RuntimeError(f"worker {self.label} did not start")
            self.maddr = self.pipe.recv()
        return self.maddr

    @property
    def peer_id(self) -> str:
        return peer_id_string(self.ready())


def run_round(members: list[Member], values: list[float], allowed, tag: str, delay=None):
    """Order a round; optionally SIGKILL ``delay = (member, seconds)`` after the start."""
    start_at = time.time() + 0.3
    order = {
        "members": [m.peer_id for m in members],
        "values": values,
        "allowed": allowed,
        "tag": tag,
        "start_at": start_at,
    }
    for member in members:
        member.pipe.send({"round": True, **order})
    victim = None
    if delay is not None:
        victim, seconds = delay
        time.sleep(max(0.0, start_at + seconds - time.time()))
        os.kill(victim.proc.pid, signal.SIGKILL)
    reports = []
    for member in members:
        if member is victim:
            continue
        report = member.pipe.recv()
        if "error" in report:
            raise RuntimeError(f"worker {member.label} failed: {report['error']}")
        reports.append(report)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--numel", type=int, default=16_000_000)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from swarmgrad.averaging.allreduce.partition import DEFAULT_PART_SIZE_BYTES

    options = {
        "numel": args.numel,
        "deadline": args.deadline,
        "part_size_bytes": DEFAULT_PART_SIZE_BYTES,
    }
    rng = random.Random(args.seed)
    ctx = mp.get_context("spawn")
    labels = iter(range(10**6))
    members = [Member(ctx, next(labels), options) for _ in range(args.peers)]
    maddrs = [m.ready() for m in members]
    for member in members:
        member.pipe.send(maddrs)
    spare = Member(ctx, next(labels), options)

    # normal rounds: warm-up (connections, buffers), then the length of a round to aim at
    values = list(range(args.peers))
    for warmup in range(2):
        reports = run_round(members, values, [statistics.mean(values)], f"warm-up-{warmup}")
    round_time = max(r["elapsed"] for r in reports)
    print(f"{args.peers} peers, {args.numel:,} float32, normal round {round_time:.3f} s")
    print(
        "trial victim  kill@s  mid-round  survivors: max s  correct  in-deadline | "
        "next round s  exact"
    )

    failures, kill_times, next_times = [], [], []
    hits = 0
    started = time.time()
    for trial in range(args.trials):
        values = [float(v) for v in rng.sample(range(100), len(members))]
        victim_index = rng.randrange(len(members))
        victim = members[victim_index]
        survivors = [m for m in members if m is not victim]
        survivor_values = [v for i, v in enumerate(values) if i != victim_index]
        allowed = [statistics.mean(values), statistics.mean(survivor_values)]
        kill_at = round_time * rng.uniform(0.1, 0.9)
        reports = run_round(members, values, allowed, f"t{trial}", delay=(victim, kill_at))
        victim.proc.join(timeout=10)
        slowest = max(r["elapsed"] for r in reports)
        hit = any(not r["fully_averaged"] for r in reports)  # the death touched the round
        hits += hit
        correct = all(r["correct"] for r in reports)
        in_time = all(r["elapsed"] < args.deadline and not r["deadline_exceeded"] for r in reports)
        after = run_round(
            survivors, survivor_values, [statistics.mean(survivor_values)], f"t{trial}-after"
        )
        next_time = max(r["elapsed"] for r in after)
        exact = all(r["full_average"] and r["fully_averaged"] for r in after)
        kill_times.append(slowest)
        next_times.append(next_time)
        if not (correct and in_time and exact):
            failures.append(trial)
        print(
            f"{trial:>5} {victim_index:>6} {kill_at:>7.3f}  {hit!s:>9}  {slowest:>16.3f}  "
            f"{correct!s:>7}  "
            f"{in_time!s:>11} | {next_time:>12.3f}  {exact!s:>5}",
            flush=True,
        )
        # the spare takes the victim's place; everyone learns its address
        maddr = spare.ready()
        spare.pipe.send([m.ready() for m in survivors] + [maddr])
        for member in survivors:
            member.pipe.send({"add": maddr})
        members = [*survivors[:victim_index], spare, *survivors[victim_index:]]
        spare = Member(ctx, next(labels), options)

    for member in [*members, spare]:
        try:
            if member.maddr is None:
                member.ready()
                member.pipe.send([])
            member.pipe.send(None)
        except (OSError, EOFError, RuntimeError):
            pass
    for member in [*members, spare]:
        member.proc.join(timeout=30)
        if member.proc.is_alive():
            member.proc.kill()
    summary = {
        "peers": args.peers,
        "trials": args.trials,
        "trials_ok": args.trials - len(failures),
        "kills_mid_round": hits,
        "failed_trials": failures,
        "normal_round_s": round(round_time, 4),
        "kill_round_max_s_median": round(statistics.median(kill_times), 4),
        "kill_round_max_s_worst": round(max(kill_times), 4),
        "next_round_s_median": round(statistics.median(next_times), 4),
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps({"faults": summary}))


if __name__ == "__main__":
    main()
