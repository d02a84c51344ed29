"""Gradients mode of a SWARM pipeline against large-batch SGD in one process.

The model, data and loss of ``benchmarks/pipeline_convergence.py`` (a GPT-style model in
4 stages). Two stage servers per stage (8 in-process peers on loopback) in
``StageTrainingOptions(mode="gradients")``: a trainer sends ``--micro-batches`` micro-batches
of ``--batch-size`` sequences at once (threads, so the servers' runtimes merge some of
them into one backward), then every stage's two peers run a gradient round and step.
The reference trains the same stages in this process with one SGD step per round on
the concatenation of the round's micro-batches (one large batch).

Gradients mode is meant to be exactly large-batch SGD: the held-out losses should agree
to float rounding, the two replicas of every stage should be bit-identical at the end,
and no round should fall back to a solo step. Prints a table and, last, one JSON line.
About 15 s on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_convergence import batches, loss_of, make_stages

PEERS_PER_STAGE = 2


def chained(stages):
    def run(x):
        for stage in stages:
            x = stage(x)
        return x

    return run


def train_local(train, held, rounds, per_round, lr):
    stages = make_stages()
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=lr)
    run = chained(stages)
    for r in range(rounds):
        sequences = torch.cat(train[r * per_round : (r + 1) * per_round])
        optimizer.zero_grad()
        loss_of(run(sequences[:, :-1]), sequences).backward()
        optimizer.step()
    with torch.no_grad():
        return loss_of(run(held[:, :-1]), held).item()


def in_threads(function, items):
    threads = [threading.Thread(target=function, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def train_swarm(train, held, rounds, per_round, lr):
    from swarmgrad.dht import DHT
    from swarmgrad.pipeline import PipelineOptions, RemotePipeline, StageServer
    from swarmgrad.pipeline.stages import make_stage_backend, split_stages
    from swarmgrad.pipeline.training import StageAverager, StageTrainingOptions

    options = StageTrainingOptions(
        average_period=3600, averaging_timeout=30, min_matchmaking_time=0.3, mode="gradients"
    )
    root = DHT(start=True)
    dhts, servers, averagers = [root], [], []
    try:
        for _ in range(PEERS_PER_STAGE):
            specs = split_stages(make_stages(), train[0][:2, :-1])  # seeded: equal replicas
            for i, spec in enumerate(specs):
                dht = DHT(start=True, initial_peers=root.get_visible_maddrs())
                dhts.append(dht)
                backend = make_stage_backend(
                    f"grad.{i}", spec, lambda ps: torch.optim.SGD(ps, lr=lr), timeout=0.02
                )
                server = StageServer(dht, "grad", i, len(specs), backend)
                averagers.append(
                    StageAverager(dht, "grad", i, backend, options, target_group_size=2)
                )
                server.start()
                servers.append(server)
        client = DHT(start=True, initial_peers=root.get_visible_maddrs(), client_mode=True)
        dhts.append(client)
        pipe = RemotePipeline(client, "grad", len(specs), PipelineOptions(timeout=60))
        round_seconds, started = [], time.perf_counter()
        for r in range(rounds):
            in_threads(
                lambda seqs: loss_of(pipe(seqs[:, :-1]), seqs).backward(),
                train[r * per_round : (r + 1) * per_round],
            )
            began = time.perf_counter()
            in_threads(lambda averager: averager.average_once(), averagers)
            round_seconds.append(time.perf_counter() - began)
        seconds = time.perf_counter() - started
        num_stages = len(specs)
        identical = all(
            torch.equal(p, q)
            for i in range(num_stages)
            for k in range(1, PEERS_PER_STAGE)
            for p, q in zip(
                servers[i].backend.module.parameters(),
                servers[i + k * num_stages].backend.module.parameters(),
                strict=True,
            )
        )
        merged = sum(
            sum(1 for n in s.backend.backward_pool.stats.recent_batch_requests if n > 1)
            for s in servers
        )
        with torch.no_grad():
            held_loss = loss_of(pipe(held[:, :-1]), held).item()
        return {
            "loss": held_loss,
            "identical": identical,
            "solo_steps": sum(a.solo_steps for a in averagers),
            "steps": [s.backend.update_count for s in servers],
            "merged": merged,
            "round_seconds": sorted(round_seconds),
            "seconds": seconds,
            "dropped": pipe.stats.get("dropped", 0),
        }
    finally:
        for averager in averagers:
            averager.shutdown()
        for server in servers:
            server.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--micro-batches", type=int, default=4, help="per round")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--lr", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train = batches(args.rounds * args.micro_batches, args.batch_size, seed=1)
    held = batches(1, 256, seed=2)[0]
    with torch.no_grad():
        initial = loss_of(chained(make_stages())(held[:, :-1]), held).item()
    local = train_local(train, held, args.rounds, args.micro_batches, args.lr)
    swarm = train_swarm(train, held, args.rounds, args.micro_batches, args.lr)
    rounds = swarm["round_seconds"]
    result = {
        "benchmark": "pipeline_gradients",
        "rounds": args.rounds,
        "samples_per_round": args.micro_batches * args.batch_size,
        "heldout_loss_initial": round(initial, 4),
        "heldout_loss_local_large_batch": round(local, 4),
        "heldout_loss_gradients_mode": round(swarm["loss"], 4),
        "gradients_vs_local": round(swarm["loss"] / local, 5),
        "replicas_identical": swarm["identical"],
        "solo_steps": swarm["solo_steps"],
        "optimizer_steps_per_server": sorted(set(swarm["steps"])),
        "merged_backward_batches": swarm["merged"],
        "round_seconds_median": round(rounds[len(rounds) // 2], 3),
        "round_seconds_max": round(rounds[-1], 3),
        "swarm_seconds": round(swarm["seconds"], 2),
        "dropped": swarm["dropped"],
    }
    print(f"{'':36}{'held-out loss':>14}")
    print(f"{'untrained':36}{initial:14.4f}")
    print(f"{'one process, large-batch SGD':36}{local:14.4f}")
    print(f"{'pipeline, gradients mode (2 x 4)':36}{swarm['loss']:14.4f}   "
          f"({swarm['loss'] / local:.5f} x local)")  # fmt: skip
    print(f"replicas identical: {swarm['identical']}, solo steps: {swarm['solo_steps']}, "
          f"merged backward batches: {swarm['merged']}, round median "
          f"{result['round_seconds_median']} s")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
