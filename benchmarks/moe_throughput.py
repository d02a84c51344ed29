"""Remote-expert throughput and latency against the same module computed locally.

Modeled on hivemind's ``benchmarks/benchmark_throughput.py``:

* remote: one server process hosting ``--num-experts`` (16) ``ffn`` experts (hidden
  1024, Adam, every backward is an optimizer step) and ``--num-clients`` (4) client
  processes, each sending ``--batches-per-client`` batches of ``--batch-size`` (512)
  samples to random experts, forward then backward through :class:`RemoteExpert`. The
  throughput is all the samples over the wall time from the common start to the last
  client's end.
* local, in the same run: the same ``ffn`` modules (same Adam) computing forward,
  backward and the optimizer step on the same batch shape in one process with torch's
  default threads, which is what the server's device thread has too; measured right
  before and right after each remote run and averaged, as the machine's load drifts.
* latency: a second server hosting one ``nop`` expert; the p50 of sequential forward
  calls of a batch of one through a :class:`RemoteExpert` from a client process.

Everything runs on loopback with encryption on. Prints a table and, last, one JSON line
with ``remote_samples_per_s``, ``local_samples_per_s``, ``ratio``, ``rtt_batch1_ms`` and
the CPU seconds each side spends per batch (``server_cpu_ms_per_batch``: the ffn server's
process, all threads, over the throughput phase; ``server_loop_cpu_ms_per_batch``: its
event loop thread alone, i.e. transport and handlers; ``client_cpu_ms_per_batch``: the
clients' processes over their timed loops; ``local_cpu_ms_per_batch``: the local
reference; ``overhead_cpu_ms_per_batch`` = server + client - local). They move less with
the machine's load than samples/s, except that OpenMP threads spin while they wait for a
descheduled peer thread, which inflates the compute's CPU on a crowded machine; the loop
thread's and the clients' CPU do not run torch's parallel kernels and stay steady.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

HIDDEN = 1024


def _serve(
    expert_cls: str, num_experts: int, hidden: int, ready: mp.Queue, stop, report=None
) -> None:
    """Serve until ``stop``; when ``report`` (an event) is set, put the CPU seconds since
    it became ready on ``ready``: the whole process's and its event loop thread's."""
    import torch

    from swarmgrad.moe.server import Server

    server = Server.create(
        expert_cls=expert_cls,
        num_experts=num_experts,
        expert_pattern=f"{expert_cls}.[0:{num_experts}]",
        hidden_dim=hidden,
        optim_cls=torch.optim.Adam,
        max_batch_size=4096,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
    )
    try:
        cpu_at_ready, loop_cpu_at_ready = time.process_time(), _loop_thread_time()
        ready.put([str(m) for m in server.dht.get_visible_maddrs()])
        if report is not None and report.wait(600):
            ready.put((time.process_time() - cpu_at_ready, _loop_thread_time() - loop_cpu_at_ready))
        stop.wait(600)
    finally:
        server.shutdown()


def _loop_thread_time() -> float:
    """CPU seconds of the process's event loop thread (the transport and the RPC
    handlers; the experts' compute runs elsewhere)."""
    from swarmgrad.utils.loop_thread import run_coroutine

    async def read() -> float:
        return time.thread_time()

    return run_coroutine(read(), timeout=30)


def _client(
    index: int, maddrs: list[str], num_experts: int, args: argparse.Namespace, barrier, out
) -> None:
    import torch

    from swarmgrad.dht import DHT
    from swarmgrad.moe import get_experts

    torch.set_num_threads(1)
    dht = DHT(initial_peers=maddrs, client_mode=True, start=True)
    try:
        experts = get_experts(dht, [f"ffn.{i}" for i in range(num_experts)])
        assert all(e is not None for e in experts), "some experts are not declared"
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(args.batch_size, HIDDEN, generator=generator)
        grad = torch.randn(args.batch_size, HIDDEN, generator=generator)
        # before the clock starts, as the local reference warms up every expert: connect,
        # fetch each expert's schema, and pay the process's one-time costs (torch imports
        # sympy at a process's first backward with explicit gradients: 0.4 s of CPU here)
        for expert in experts:
            expert(x[:1].requires_grad_(True)).backward(grad[:1])
        barrier.wait(120)
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(args.batches_per_client):
            expert = experts[int(torch.randint(num_experts, (), generator=generator))]
            inputs = x.requires_grad_(True)
            expert(inputs).backward(grad)
            inputs.grad = None
        cpu = time.process_time() - cpu_started
        out.put((started, time.perf_counter(), args.batches_per_client * args.batch_size, cpu))
    finally:
        dht.shutdown()


def _latency(maddrs: list[str], calls: int, out) -> None:
    import torch

    from swarmgrad.dht import DHT
    from swarmgrad.moe import get_experts

    dht = DHT(initial_peers=maddrs, client_mode=True, start=True)
    try:
        (expert,) = get_experts(dht, ["nop.0"])
        x = torch.randn(1, HIDDEN)
        for _ in range(50):
            expert(x)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            expert(x)
            times.append(time.perf_counter() - started)
        out.put(statistics.median(times))
    finally:
        dht.shutdown()


def _collect(out, processes: list, count: int, timeout: float) -> list:
    """``count`` results from ``out``; fails at once when a worker process dies."""
    import queue

    results, deadline = [], time.monotonic() + timeout
    while len(results) < count:
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(results)} of {count} workers finished") from None
    return results


def measure_local(num_experts: int, args: argparse.Namespace) -> tuple[float, float]:
    """Samples/s and CPU seconds per batch of the local reference."""
    import torch

    from swarmgrad.moe.server.layers import name_to_block

    experts = [name_to_block["ffn"](HIDDEN) for _ in range(num_experts)]
    optimizers = [torch.optim.Adam(e.parameters()) for e in experts]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, HIDDEN, generator=generator)
    grad = torch.randn(args.batch_size, HIDDEN, generator=generator)

    def step(i: int) -> None:
        inputs = x.requires_grad_(True)
        experts[i](inputs).backward(grad)
        optimizers[i].step()
        optimizers[i].zero_grad()
        inputs.grad = None

    for i in range(num_experts):  # warm up every expert (allocations, Adam state)
        step(i)
    batches = args.num_clients * args.batches_per_client
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(batches):
        step(int(torch.randint(num_experts, (), generator=generator)))
    cpu = time.process_time() - cpu_started
    return batches * args.batch_size / (time.perf_counter() - started), cpu / batches


def measure_remote(args: argparse.Namespace) -> tuple[float, float, float, float, float]:
    """Samples/s, batch-1 round trip (s), and CPU seconds per batch: the server process,
    its loop thread, the clients."""
    ctx = mp.get_context("spawn")
    stop, ready, report = ctx.Event(), ctx.Queue(), ctx.Event()
    servers = [
        ctx.Process(target=_serve, args=("ffn", args.num_experts, HIDDEN, ready, stop, report)),
        ctx.Process(target=_serve, args=("nop", 1, HIDDEN, ready, stop)),
    ]
    clients: list = []
    try:
        servers[0].start()
        (ffn_maddrs,) = _collect(ready, servers[:1], 1, 180)
        servers[1].start()
        (nop_maddrs,) = _collect(ready, servers, 1, 180)
        out, barrier = ctx.Queue(), ctx.Barrier(args.num_clients)
        clients = [
            ctx.Process(target=_client, args=(i, ffn_maddrs, args.num_experts, args, barrier, out))
            for i in range(args.num_clients)
        ]
        for client in clients:
            client.start()
        results = _collect(out, clients + servers, len(clients), 600)
        report.set()
        ((server_cpu, server_loop_cpu),) = _collect(ready, servers, 1, 60)
        starts, ends, samples, client_cpus = zip(*results, strict=True)
        throughput = sum(samples) / (max(ends) - min(starts))
        batches = args.num_clients * args.batches_per_client
        latency_out = ctx.Queue()
        probe = ctx.Process(target=_latency, args=(nop_maddrs, args.latency_calls, latency_out))
        clients.append(probe)
        probe.start()
        (rtt,) = _collect(latency_out, [probe, *servers], 1, 300)
        cpu = (server_cpu / batches, server_loop_cpu / batches, sum(client_cpus) / batches)
        return throughput, rtt, *cpu
    finally:
        stop.set()
        for process in clients + servers:
            process.join(60)
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--num-clients", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--batches-per-client", type=int, default=16)
    parser.add_argument("--latency-calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    remote, local, rtts = [], [], []
    server_cpu, loop_cpu, client_cpu, local_cpu = [], [], [], []
    for repeat in range(args.repeats):
        # local before and after remote, averaged: the machine's load drifts
        before, before_cpu = measure_local(args.num_experts, args)
        throughput, rtt, server_s, loop_s, client_s = measure_remote(args)
        after, after_cpu = measure_local(args.num_experts, args)
        remote.append(throughput)
        rtts.append(rtt)
        local.append((before + after) / 2)
        server_cpu.append(server_s)
        loop_cpu.append(loop_s)
        client_cpu.append(client_s)
        local_cpu.append((before_cpu + after_cpu) / 2)
        print(
            f"run {repeat + 1}: remote {remote[-1]:,.0f} samples/s, local {local[-1]:,.0f} "
            f"samples/s (ratio {remote[-1] / local[-1]:.2f}), batch-1 RTT {rtt * 1e3:.3f} ms; "
            f"CPU per batch: server {server_s * 1e3:.1f} ms (loop {loop_s * 1e3:.1f}) + clients "
            f"{client_s * 1e3:.1f} ms, "
            f"local {local_cpu[-1] * 1e3:.1f} ms",
            flush=True,
        )
    cpu_ms = {
        name: round(statistics.median(values) * 1e3, 2)
        for name, values in (
            ("server", server_cpu),
            ("server_loop", loop_cpu),
            ("client", client_cpu),
            ("local", local_cpu),
            (
                "overhead",
                [s + c - loc for s, c, loc in zip(server_cpu, client_cpu, local_cpu, strict=True)],
            ),
        )
    }
    figures = {
        "remote_samples_per_s": round(statistics.median(remote), 1),
        "local_samples_per_s": round(statistics.median(local), 1),
        "ratio": round(statistics.median(r / loc for r, loc in zip(remote, local, strict=True)), 3),
        "rtt_batch1_ms": round(statistics.median(rtts) * 1e3, 3),
        **{f"{name}_cpu_ms_per_batch": value for name, value in cpu_ms.items()},
    }
    print(
        f"\n{args.num_experts} ffn experts (hidden {HIDDEN}), {args.num_clients} clients, "
        f"batch {args.batch_size}, forward+backward, medians of {args.repeats} runs:\n"
        f"  remote  {figures['remote_samples_per_s']:>10,.0f} samples/s\n"
        f"  local   {figures['local_samples_per_s']:>10,.0f} samples/s\n"
        f"  ratio   {figures['ratio']:>10.3f}   (target >= 0.85)\n"
        f"  batch-1 round trip through a nop expert: {figures['rtt_batch1_ms']:.3f} ms "
        f"(target <= 1 ms)\n"
        f"  CPU per batch: server {cpu_ms['server']:.1f} ms (its loop thread "
        f"{cpu_ms['server_loop']:.1f}) + clients {cpu_ms['client']:.1f} ms "
        f"against local {cpu_ms['local']:.1f} ms (overhead {cpu_ms['overhead']:.1f} ms)"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
