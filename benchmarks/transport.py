"""Transport benchmark: bulk transfer over one encrypted stream, and small-RPC latency.

Runs ours and the reference in the same run on this machine:

* bulk: 256 MiB from one process to another over one swarmgrad stream (TLS 1.3 handshake
  and AES-256-GCM records, mux, credit flow control, zero-copy receive into a
  preallocated buffer) versus raw blocking sockets (``sendall`` / ``recv_into``) between
  the same two processes, plaintext; and again with plain TLS 1.3 records.
* RPC: 100-byte echo calls, sequential (p50/p99 latency) and with 64 in flight (calls/s),
  between two processes.

Prints a table, then one JSON line with bulk_ratio_vs_raw, rpc_p50_us, rpc_p99_us,
rpc_calls_per_s_64. Usage: ``python benchmarks/transport.py [--repeats N] [--mib M]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

TOTAL_MIB = 256
CHUNK = 4 * 1024 * 1024


# ----------------------------------------------------------------------------- raw sockets


def _raw_receiver(port_queue: mp.Queue, total: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buffer = bytearray(total)
    view = memoryview(buffer)
    received = 0
    while received < total:
        n = conn.recv_into(view[received:], min(CHUNK, total - received))
        if n == 0:
            raise RuntimeError("raw sender closed early")
        received += n
    conn.sendall(b"k")
    conn.close()
    server.close()


def bench_raw(total: int) -> float:
    queue: mp.Queue = mp.Queue()
    proc = mp.Process(target=_raw_receiver, args=(queue, total))
    proc.start()
    port = queue.get(timeout=30)
    sock = socket.create_connection(("127.0.0.1", port))
    data = memoryview(bytearray(total))
    started = time.perf_counter()
    for offset in range(0, total, CHUNK):
        sock.sendall(data[offset : offset + CHUNK])
    assert sock.recv(1) == b"k"
    elapsed = time.perf_counter() - started
    sock.close()
    proc.join(timeout=30)
    return total / elapsed / 1e9


def _raw_echo_server(port_queue: mp.Queue) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()
    server.close()


def bench_raw_echo(calls: int) -> float:
    """p50 round trip of 100 bytes over a plaintext blocking socket: the floor that the
    machine's process wake-ups set for any RPC system here."""
    queue: mp.Queue = mp.Queue()
    proc = mp.Process(target=_raw_echo_server, args=(queue,))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", queue.get(timeout=30)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        sock.sendall(b"x" * 100)
        received = 0
        while received < 100:
            received += len(sock.recv(65536))
        latencies.append(time.perf_counter() - started)
    sock.close()
    proc.join(timeout=30)
    return statistics.median(latencies) * 1e6


# ----------------------------------------------------------------------------- swarmgrad


def _run(coro):
    """Run on swarmgrad's process loop (uvloop when installed), as a user's script would."""
    from swarmgrad.utils.loop_thread import run_coroutine, shutdown_loop

    try:
        return run_coroutine(coro)
    finally:
        shutdown_loop()


def _ours_server(addr_queue: mp.Queue, total: int, stop: mp.Event) -> None:
    async def main() -> None:
        from swarmgrad.net.peer import Peer

        peer = await Peer.create()
        buffer = bytearray(total)

        async def sink(stream) -> None:
            await stream.readexactly_into(buffer)
            await stream.write_eof(b"k")

        async def echo(request, context):
            return request

        peer.add_protocol_handler("bench.sink", sink)
        peer.add_handler("bench.echo", echo)
        addr_queue.put(str(peer.get_visible_maddrs()[0]))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await peer.shutdown()

    _run(main())


async def _ours_bulk(peer, addr: str, total: int) -> float:
    data = memoryview(bytearray(total))
    started = time.perf_counter()
    stream = await peer.open_stream(addr, "bench.sink")
    for offset in range(0, total, CHUNK):
        await stream.write(data[offset : offset + CHUNK])
    await stream.close_write()
    assert await stream.read() == b"k"
    return total / (time.perf_counter() - started) / 1e9


async def _ours_rpc(peer, addr: str, calls: int, concurrency: int) -> tuple[list[float], float]:
    payload = b"x" * 100
    server_id = await peer.connect(addr)
    for _ in range(200):  # warm up
        await peer.call(server_id, "bench.echo", payload)
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        await peer.call(server_id, "bench.echo", payload)
        latencies.append(time.perf_counter() - started)

    async def worker(n: int) -> None:
        for _ in range(n):
            await peer.call(server_id, "bench.echo", payload)

    per_worker = max(1, calls * 2 // concurrency)
    started = time.perf_counter()
    await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
    rate = per_worker * concurrency / (time.perf_counter() - started)
    return latencies, rate


def bench_ours(total: int, repeats: int, rpc_calls: int, tls_records: bool = False) -> dict:
    """Our bulk and RPC figures; ``tls_records`` forces plain TLS 1.3 records (both sides)
    instead of the default AES-GCM records after the TLS handshake."""
    os.environ["SWARMGRAD_TLS_RECORDS"] = "1" if tls_records else "0"
    queue: mp.Queue = mp.Queue()
    stop = mp.Event()
    proc = mp.Process(target=_ours_server, args=(queue, total, stop))
    proc.start()
    addr = queue.get(timeout=60)

    async def main() -> dict:
        from swarmgrad.net.peer import Peer

        peer = await Peer.create(client_mode=True)
        try:
            bulk = [await _ours_bulk(peer, addr, total) for _ in range(repeats)]
            if rpc_calls == 0:
                return {"bulk": bulk}
            p50s, p99s, rates = [], [], []
            for _ in range(repeats):
                latencies, rate = await _ours_rpc(peer, addr, rpc_calls, 64)
                latencies.sort()
                p50s.append(latencies[len(latencies) // 2] * 1e6)
                p99s.append(latencies[int(len(latencies) * 0.99)] * 1e6)
                rates.append(rate)
            return {"bulk": bulk, "p50": p50s, "p99": p99s, "rate": rates}
        finally:
            await peer.shutdown()

    try:
        return _run(main())
    finally:
        stop.set()
        proc.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=TOTAL_MIB)
    parser.add_argument("--rpc-calls", type=int, default=5000)
    args = parser.parse_args()
    total = args.mib * 1024 * 1024

    raw = [bench_raw(total) for _ in range(args.repeats)]
    raw_echo_p50 = statistics.median(bench_raw_echo(args.rpc_calls) for _ in range(3))
    ours = bench_ours(total, args.repeats, args.rpc_calls)
    plain_tls = bench_ours(total, args.repeats, 0, tls_records=True)["bulk"]
    plain_tls_ratio = statistics.median(o / r for o, r in zip(plain_tls, raw, strict=True))
    raw_gbps, ours_gbps = statistics.median(raw), statistics.median(ours["bulk"])
    ratios = [o / r for o, r in zip(ours["bulk"], raw, strict=True)]
    result = {
        "bulk_ratio_vs_raw": round(statistics.median(ratios), 3),
        "bulk_gb_per_s": round(ours_gbps, 3),
        "raw_gb_per_s": round(raw_gbps, 3),
        "rpc_p50_us": round(statistics.median(ours["p50"]), 1),
        "rpc_p99_us": round(statistics.median(ours["p99"]), 1),
        "rpc_calls_per_s_64": round(statistics.median(ours["rate"])),
        "raw_echo_p50_us": round(raw_echo_p50, 1),
        "bulk_tls_records_gb_per_s": round(statistics.median(plain_tls), 3),
        "bulk_tls_records_ratio_vs_raw": round(plain_tls_ratio, 3),
        "rpc_p50_vs_raw_echo": round(statistics.median(ours["p50"]) / raw_echo_p50, 2),
        "repeats": args.repeats,
        "mib": args.mib,
    }
    print(f"bulk {args.mib} MiB, median of {args.repeats} runs")
    print(f"  raw sockets (plaintext)   {raw_gbps:7.3f} GB/s   runs {[round(x, 2) for x in raw]}")
    print(
        f"  swarmgrad (TLS 1.3, mux)  {ours_gbps:7.3f} GB/s   runs "
        f"{[round(x, 2) for x in ours['bulk']]}"
    )
    print(f"  ratio ours / raw          {result['bulk_ratio_vs_raw']:7.3f}   (target >= 0.40)")
    print(
        f"  with plain TLS 1.3 records (SWARMGRAD_TLS_RECORDS=1): "
        f"{result['bulk_tls_records_gb_per_s']:.3f} GB/s, ratio "
        f"{result['bulk_tls_records_ratio_vs_raw']:.3f}"
    )
    print("RPC 100-byte echo between two processes")
    print(f"  p50 {result['rpc_p50_us']} us (target <= 200), p99 {result['rpc_p99_us']} us")
    print(
        f"  raw blocking socket echo p50 {result['raw_echo_p50_us']} us (the machine's floor);"
        f" ours / raw {result['rpc_p50_vs_raw_echo']}"
    )
    print(f"  {result['rpc_calls_per_s_64']} calls/s with 64 in flight (target >= 20000)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
