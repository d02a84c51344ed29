"""All-reduce benchmark: our butterfly all-reduce against torch.distributed gloo.

N peers (4 and 8 by default), each its own process, average 16 million float32 values
over real sockets on loopback, with our transport's encryption on (TLS 1.3 handshake,
AES-256-GCM records; gloo sends plaintext). In the same processes and the same run,
rounds of ``torch.distributed.all_reduce`` (gloo backend) alternate with rounds of ours,
each round starting from a gloo barrier. Matchmaking is excluded: the members exchange
addresses at start-up and every round builds its GroupInfo directly.

A round's time is the slowest member's (from the barrier to its tensors being averaged);
the figure is the median over ``--rounds`` rounds after ``--warmup``. Before timing, one
round of each checks ours against gloo's sum divided by N.

CPU: each member's ``time.process_time()`` around each round (every thread of its
process: the loop thread, data-path workers, gloo's threads), summed over the members
(``*_cpu_s``) and per member (``*_cpu_per_peer_s``), medians over the timed rounds. On a
shared machine this is the figure to compare: wall time depends on what else runs, CPU
seconds much less.

Prints a table, then one JSON line:
``{"results": [{"peers": 4, "ours_s": ..., "gloo_s": ..., "ratio": ..., "ours_cpu_s": ...,
"gloo_cpu_s": ..., "ours_cpu_per_peer_s": ..., "gloo_cpu_per_peer_s": ..., "cpu_ratio":
...}, ...]}``.
The fault-tolerance run (a peer SIGKILLed mid-round) is ``benchmarks/allreduce_faults.py``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _allreduce_peer import perf_worker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(world: int, options: dict) -> dict:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    port = _free_port()
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=perf_worker, args=(rank, world, child, port, options))
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        maddrs = [pipe.recv() for pipe in pipes]
        for pipe in pipes:
            pipe.send(maddrs)
        reports = [pipe.recv() for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"{world} peers: worker failed: {errors[0]}")
    rounds = len(reports[0]["times"]["ours"])
    per_round = {
        name: [max(r["times"][name][i] for r in reports) for i in range(rounds)]
        for name in ("ours", "gloo")
    }
    cpu = {
        name: statistics.median(
            sum(r["cpu"][name][i] for r in reports) for i in range(len(reports[0]["cpu"][name]))
        )
        if reports[0]["cpu"][name]
        else 0.0
        for name in ("ours", "gloo")
    }
    ours, gloo = statistics.median(per_round["ours"]), statistics.median(per_round["gloo"])
    return {
        "peers": world,
        "ours_s": round(ours, 4),
        "gloo_s": round(gloo, 4),
        "ratio": round(ours / gloo, 3) if gloo else None,
        "ours_rounds": [round(t, 4) for t in per_round["ours"]],
        "gloo_rounds": [round(t, 4) for t in per_round["gloo"]],
        "max_error_vs_gloo": max(r["max_error"] for r in reports),
        "ours_cpu_s": round(cpu["ours"], 3),
        "gloo_cpu_s": round(cpu["gloo"], 3),
        # the same per member: what one peer's process spends on a round
        "ours_cpu_per_peer_s": round(cpu["ours"] / world, 4),
        "gloo_cpu_per_peer_s": round(cpu["gloo"] / world, 4),
        "cpu_ratio": round(cpu["ours"] / cpu["gloo"], 3) if cpu["gloo"] else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--numel", type=int, default=16_000_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--part-size-bytes", type=int, default=None)
    parser.add_argument("--no-gloo", action="store_true", help="ours only (for profiling)")
    parser.add_argument(
        "--compression",
        choices=["none", "uniform_8bit"],
        default="none",
        help="our wire codec (gloo always sends float32); uniform_8bit: 8-bit quantized",
    )
    args = parser.parse_args()
    from swarmgrad.averaging.allreduce.partition import DEFAULT_PART_SIZE_BYTES

    options = {
        "numel": args.numel,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "part_size_bytes": args.part_size_bytes or DEFAULT_PART_SIZE_BYTES,
        "no_gloo": args.no_gloo,
        "compression": args.compression,
    }
    started = time.time()
    results = []
    print(
        f"all-reduce of {args.numel:,} float32 per peer, encrypted loopback; median of "
        f"{args.rounds} rounds (slowest member per round); parts of "
        f"{options['part_size_bytes']:,} bytes; our codec: {args.compression}"
    )
    print(f"{'peers':>5} {'ours s':>8} {'gloo s':>8} {'ratio':>6}  max |ours - gloo|")
    for world in args.peers:
        result = run_group(world, options)
        results.append(result)
        ratio = f"{result['ratio']:>6.2f}" if result["ratio"] is not None else "     -"
        print(
            f"{world:>5} {result['ours_s']:>8.3f} {result['gloo_s']:>8.3f} {ratio}  "
            f"{result['max_error_vs_gloo']:.2e}",
            flush=True,
        )
        print(
            f"      CPU seconds per round, all members: ours {result['ours_cpu_s']:.3f}, "
            f"gloo {result['gloo_cpu_s']:.3f}; per member: ours "
            f"{result['ours_cpu_per_peer_s']:.4f}, gloo {result['gloo_cpu_per_peer_s']:.4f}"
        )
        print(f"      ours rounds: {result['ours_rounds']}")
        print(f"      gloo rounds: {result['gloo_rounds']}")
    print(f"total wall time {time.time() - started:.0f} s")
    cpu_keys = ("ours_cpu_s", "gloo_cpu_s", "ours_cpu_per_peer_s", "gloo_cpu_per_peer_s")
    summary = [
        {
            **{k: r[k] for k in ("peers", "ours_s", "gloo_s", "ratio")},
            **{k: r[k] for k in (*cpu_keys, "cpu_ratio")},
            "codec": args.compression,
        }
        for r in results
    ]
    print(json.dumps({"results": summary}))


if __name__ == "__main__":
    main()
