"""Connection set-up over a slow link: how long until a new connection answers its first call.

On the internet a new connection costs round trips, not CPU: each flight of the handshake
waits one one-way delay. This benchmark puts a delay proxy between a client and a server
(both on 127.0.0.1, each in its own process; the proxy in a third) that holds every chunk
``--delay-ms`` milliseconds in each direction, then times, on a fresh connection each
trial, the first call (dial, TLS 1.3, identity handshake, one 100-byte echo) and then a
second call on the same connection.

Reference, in the same run through the same proxy: the floor of any TLS-based transport,
the stdlib's ``asyncio.open_connection(ssl=...)`` (TLS 1.3 with the same ed25519
certificates) followed by one 100-byte echo: 2 round trips after TCP (TLS 1.3's one, then
the call's). Reported: median first-call and warm-call latency, and the first call in
one-way delays ("flights"), ours and the reference's.

Prints a table, then one JSON line: ``delay_ms``, ``ours_first_ms``, ``ours_warm_ms``,
``ours_flights``, ``tls_first_ms``, ``tls_flights``, ``first_call_ratio_vs_tls``.
Usage: ``python benchmarks/connect_latency.py [--delay-ms 25] [--trials 15]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time

ECHO_BYTES = 100


# ----------------------------------------------------------------------------- delay proxy


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float):
    """Forward bytes in order, each chunk ``delay`` seconds after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write(data)
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((loop.time() + delay, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, None))
    await sender


def _proxy(upstream_port: int, delay: float, ports: mp.Queue, stop) -> None:
    async def main() -> None:
        async def handle(reader, writer):
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(
                _pump(reader, up_writer, delay),
                _pump(up_reader, writer, delay),
                return_exceptions=True,
            )

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        server.close()

    asyncio.run(main())


# ----------------------------------------------------------------------------- servers


def _servers(addresses: mp.Queue, stop) -> None:
    """Our peer with an echo handler, and a stdlib TLS 1.3 echo server, same identity."""
    from swarmgrad.net.identity import Identity
    from swarmgrad.net.peer import Peer
    from swarmgrad.net.tls import server_ssl_context

    async def main() -> None:
        identity = Identity.generate()
        peer = await Peer.create(identity=identity, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

        async def echo(request, context):
            return request

        peer.add_handler("echo", echo)

        async def tls_echo(reader, writer):
            try:
                while data := await reader.read(65536):
                    writer.write(data)
            except ConnectionError:
                pass
            writer.close()

        tls_server = await asyncio.start_server(
            tls_echo, "127.0.0.1", 0, ssl=server_ssl_context(identity)
        )
        maddr = peer.get_visible_maddrs()[0]
        peer_port = int(maddr.host_port.rpartition(":")[2])
        addresses.put((str(maddr), peer_port, tls_server.sockets[0].getsockname()[1]))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        tls_server.close()
        await peer.shutdown()

    asyncio.run(main())


# ----------------------------------------------------------------------------- clients


async def _ours(server_maddr: str, proxy_port: int, trials: int) -> tuple[list, list]:
    from swarmgrad.net.multiaddr import Multiaddr
    from swarmgrad.net.peer import Peer

    peer_id = Multiaddr.parse(server_maddr).peer_id
    target = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{proxy_port}/p2p/{peer_id}")
    client = await Peer.create(client_mode=True)
    first, warm = [], []
    payload = b"x" * ECHO_BYTES
    try:
        await client.call(Multiaddr.parse(server_maddr), "echo", payload, timeout=30)  # warm-up
        await _drop(client, peer_id)
        for _ in range(trials):
            started = time.perf_counter()
            await client.call(target, "echo", payload, timeout=30)
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            await client.call(peer_id, "echo", payload, timeout=30)
            warm.append(time.perf_counter() - started)
            await _drop(client, peer_id)
    finally:
        await client.shutdown()
    return first, warm


async def _drop(client, peer_id) -> None:
    """Close our connection to peer_id and wait until it is gone."""
    conn = client._connections.get(peer_id)
    if conn is not None:
        conn.close("next trial")
    for _ in range(200):
        if peer_id not in client._connections:
            return
        await asyncio.sleep(0.005)
    raise RuntimeError("the connection did not close")


async def _stdlib_tls(proxy_port: int, trials: int) -> tuple[list, list]:
    import ssl

    from swarmgrad.net.identity import Identity
    from swarmgrad.net.tls import client_ssl_context

    context = client_ssl_context(Identity.generate())
    payload = b"x" * ECHO_BYTES
    first, warm = [], []
    for _ in range(trials):
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port, ssl=context)
        assert writer.get_extra_info("ssl_object").version() == "TLSv1.3"
        for timings in (first, warm):
            writer.write(payload)
            await reader.readexactly(len(payload))
            timings.append(time.perf_counter() - started)
            started = time.perf_counter()
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass
    return first, warm


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay added")
    parser.add_argument("--trials", type=int, default=15)
    args = parser.parse_args()
    delay = args.delay_ms / 1000

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    addresses, ports = ctx.Queue(), ctx.Queue()
    servers = ctx.Process(target=_servers, args=(addresses, stop), daemon=True)
    servers.start()
    processes = [servers]
    try:
        maddr, peer_port, tls_port = addresses.get(timeout=60)
        proxy_ports = {}
        for name, port in (("ours", peer_port), ("tls", tls_port)):
            proxy = ctx.Process(target=_proxy, args=(port, delay, ports, stop), daemon=True)
            proxy.start()
            processes.append(proxy)
            proxy_ports[name] = ports.get(timeout=60)
        ours_first, ours_warm = asyncio.run(_ours(maddr, proxy_ports["ours"], args.trials))
        tls_first, tls_warm = asyncio.run(_stdlib_tls(proxy_ports["tls"], args.trials))
    finally:
        stop.set()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    def flights(values: list[float]) -> float:
        return statistics.median(values) / delay if delay else float("nan")

    print(f"one-way delay {args.delay_ms:g} ms, {args.trials} fresh connections each")
    print(f"{'transport':44s} {'first call':>11s} {'warm call':>10s} {'flights':>8s}")
    print(
        f"{'swarmgrad (TLS 1.3 + identity + RPC)':44s} {ms(ours_first):9.1f} ms "
        f"{ms(ours_warm):8.1f} ms {flights(ours_first):8.2f}"
    )
    print(
        f"{'stdlib asyncio TLS 1.3 + echo (floor)':44s} {ms(tls_first):9.1f} ms "
        f"{ms(tls_warm):8.1f} ms {flights(tls_first):8.2f}"
    )
    result = {
        "delay_ms": args.delay_ms,
        "trials": args.trials,
        "ours_first_ms": round(ms(ours_first), 2),
        "ours_warm_ms": round(ms(ours_warm), 2),
        "ours_flights": round(flights(ours_first), 2),
        "tls_first_ms": round(ms(tls_first), 2),
        "tls_warm_ms": round(ms(tls_warm), 2),
        "tls_flights": round(flights(tls_first), 2),
        "first_call_ratio_vs_tls": round(ms(ours_first) / ms(tls_first), 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
