"""What ``swarmgrad.Optimizer.step()`` costs between epoch boundaries.

Runs with no arguments (about 30 s here). One or more peers in this process train the
model of ``benchmarks/collaborative.py``'s efficiency cell (9.45M parameters, 2 rows per
step, accounting for 32 samples) with a target batch no swarm reaches, so every step is
an ordinary one: accumulate the gradients, report progress, maybe schedule a round. The
reference, timed in the same loop, is the accumulation alone (one ``add_`` per parameter
into a buffer of its size, as the averager does): what no bookkeeping can save. Reported:
the median wall and CPU (``time.process_time``, every thread of the process) time of the
first peer's ``step()``, the reference's, and their ratio.

JSON keys: ``step_wall_ms``, ``step_cpu_ms``, ``accumulate_wall_ms``, ``ratio``,
``bookkeeping_wall_ms`` (step minus accumulation), ``peers``, ``steps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import swarmgrad

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--profile", default=None, help="cProfile the first peer's steps here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from _collab_peer import efficiency_model  # (benchmarks/ is on sys.path)

    dhts = [swarmgrad.DHT(start=True)]
    address = [str(m) for m in dhts[0].get_visible_maddrs()]
    dhts += [swarmgrad.DHT(initial_peers=address, start=True) for _ in range(args.peers - 1)]
    models, opts = [], []
    for dht in dhts:
        torch.manual_seed(0)
        model = efficiency_model()
        models.append(model)
        opts.append(
            swarmgrad.Optimizer(
                dht=dht,
                run_id="step_cost",
                target_batch_size=10**9,
                batch_size_per_step=32,
                params=model.parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                matchmaking_time=3.0,
                averaging_timeout=30.0,
                metrics=False,
            )
        )
    reference = [torch.zeros_like(p) for p in models[0].parameters()]
    x = torch.randn(2, 1024)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    walls, cpus, refs = [], [], []
    try:
        for index in range(args.steps + 5):
            for peer, (model, opt) in enumerate(zip(models, opts, strict=True)):
                model(x).pow(2).mean().backward()
                if peer == 0:
                    began = time.perf_counter()
                    with torch.no_grad():
                        for buffer, param in zip(reference, model.parameters(), strict=True):
                            buffer.add_(param.grad, alpha=32.0)
                    ref = time.perf_counter() - began
                    if profiler is not None and index >= 5:
                        profiler.enable()
                    wall, cpu = time.perf_counter(), time.process_time()
                    opt.step()
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    if profiler is not None:
                        profiler.disable()
                    if index >= 5:  # warm-up: the first steps allocate
                        walls.append(wall)
                        cpus.append(cpu)
                        refs.append(ref)
                else:
                    opt.step()
                opt.zero_grad()
        if opts[0].local_epoch != 0:
            raise RuntimeError("an epoch ended: the measurement is not of ordinary steps")
    finally:
        for opt in opts:
            opt.shutdown()
        for dht in dhts:
            dht.shutdown()
    if profiler is not None:
        profiler.dump_stats(args.profile)

    step, accumulate = statistics.median(walls), statistics.median(refs)
    result = {
        "step_wall_ms": 1e3 * step,
        "step_cpu_ms": 1e3 * statistics.median(cpus),
        "accumulate_wall_ms": 1e3 * accumulate,
        "ratio": step / accumulate,
        "bookkeeping_wall_ms": 1e3 * (step - accumulate),
        "peers": args.peers,
        "steps": args.steps,
    }
    print(
        f"Optimizer.step(): {result['step_wall_ms']:.2f} ms wall, {result['step_cpu_ms']:.2f} "
        f"ms CPU (median of {args.steps}); the accumulation alone "
        f"{result['accumulate_wall_ms']:.2f} ms: {result['ratio']:.2f} x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
