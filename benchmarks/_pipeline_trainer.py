"""A trainer process of ``benchmarks/swarm_pipeline.py``: trains through a
``RemotePipeline`` and prints one JSON line per event on stdout.

    python benchmarks/_pipeline_trainer.py --initial-peers ADDR --pipeline NAME \\
        --stages 4 --mode swarm --in-flight 6 --duration 60 --host 127.0.0.1

``--mode swarm``: ``--in-flight`` threads each send micro-batches one after another,
independently (SWARM: every stage's servers are kept busy all the time).
``--mode gpipe``: GPipe-style synchronous micro-batching: the forwards of
``--in-flight`` micro-batches go through the pipeline together, then their backwards,
then the next batch (a flush per batch).

Events: ``ready``; ``mb`` (a micro-batch finished: ``t`` wall time, ``samples``, ``ok``;
a failed one, that is one dropped after every retry, has ``ok`` false and the error);
with ``--watch``, ``stages`` every ``--watch-period`` seconds (the servers each stage has
in the DHT, by PeerID); at the end ``stats`` (the pipeline's counters). After a dropped
micro-batch the thread waits a second before the next, as a trainer would back off.
SIGTERM prints ``stats`` at once and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_convergence import batches, loss_of

_print_lock = threading.Lock()


def emit(**event) -> None:
    with _print_lock:
        print(json.dumps(event), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--mode", choices=("swarm", "gpipe"), required=True)
    parser.add_argument("--in-flight", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--timeout", type=float, default=20.0, help="PipelineOptions.timeout")
    parser.add_argument("--compression", default="blockwise_8bit")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--watch-period", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from swarmgrad.dht import DHT
    from swarmgrad.pipeline import PipelineOptions, RemotePipeline, read_stage_loads

    dht = DHT(
        initial_peers=args.initial_peers,
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        client_mode=True,
        start=True,
    )
    options = PipelineOptions(
        timeout=args.timeout, compression=args.compression, refresh_period=2.0
    )
    pipe = RemotePipeline(dht, args.pipeline, args.stages, options)
    data = batches(64, args.batch_size, seed=args.seed)
    stop = threading.Event()
    counter = iter(range(1 << 62))

    def forward():
        sequences = data[next(counter) % len(data)]
        return loss_of(pipe(sequences[:, :-1]), sequences)

    def failed(error: Exception) -> None:
        emit(event="mb", t=time.time(), samples=args.batch_size, ok=False, error=repr(error)[:300])
        stop.wait(1.0)

    def swarm_worker() -> None:
        while not stop.is_set():
            try:
                forward().backward()
            except Exception as e:  # a dropped micro-batch: counted, and the trainer goes on
                failed(e)
                continue
            emit(event="mb", t=time.time(), samples=args.batch_size, ok=True)

    def gpipe_loop(pool: ThreadPoolExecutor) -> None:
        def backward(loss):
            loss.backward()
            emit(event="mb", t=time.time(), samples=args.batch_size, ok=True)

        while not stop.is_set():
            losses = []
            for future in [pool.submit(forward) for _ in range(args.in_flight)]:
                try:
                    losses.append(future.result())
                except Exception as e:
                    failed(e)
            for future in [pool.submit(backward, loss) for loss in losses]:
                try:
                    future.result()
                except Exception as e:
                    failed(e)

    def watch() -> None:
        while not stop.wait(args.watch_period):
            try:
                loads = dht.run_coroutine(
                    lambda _dht, node: read_stage_loads(node, args.pipeline, args.stages)
                )
            except Exception as e:
                emit(event="watch_failed", t=time.time(), error=repr(e)[:200])
                continue
            emit(
                event="stages",
                t=time.time(),
                servers=[sorted(p.to_base58() for p in stage) for stage in loads],
                throughput=[sorted(stage.values()) for stage in loads],
            )

    threads = []
    if args.watch:
        threads.append(threading.Thread(target=watch, daemon=True))
    if args.mode == "swarm":
        threads += [
            threading.Thread(target=swarm_worker, daemon=True) for _ in range(args.in_flight)
        ]
        pool = None
    else:
        pool = ThreadPoolExecutor(args.in_flight)
        threads.append(threading.Thread(target=gpipe_loop, args=(pool,), daemon=True))

    def finish(*_):  # SIGTERM: the counters now, then exit without waiting for hops
        emit(event="stats", **{k: int(v) for k, v in pipe.stats.items()})
        os._exit(0)

    signal.signal(signal.SIGTERM, finish)
    emit(event="ready", t=time.time())
    for thread in threads:
        thread.start()
    time.sleep(args.duration)
    stop.set()
    for thread in threads:
        thread.join(args.timeout + 5)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    emit(event="stats", **{k: int(v) for k, v in pipe.stats.items()})
    dht.shutdown()


if __name__ == "__main__":
    main()
