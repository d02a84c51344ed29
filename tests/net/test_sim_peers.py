"""Real peers (handshake, mux, RPC, relays) on the simulated network and virtual clock."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from swarmgrad.net.rpc import Blob
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from swarmgrad.utils.errors import ConnectionClosed, DeadlineExceeded, PeerUnreachable


async def echo(request, context):
    return request


def _swarm_of_rpcs(num_peers: int, calls_per_peer: int, seed: int):
    async def main(network):
        rng = random.Random(seed)
        loop = asyncio.get_running_loop()
        peers = [await create_sim_peer(network, rng=rng) for _ in range(num_peers)]
        for p in peers:
            p.add_handler("echo", echo)
        addrs = [p.get_visible_maddrs()[0] for p in peers]
        trace = []

        async def work(i):
            for _ in range(calls_per_peer):
                j = rng.randrange(num_peers - 1)
                j += j >= i
                payload = rng.randbytes(100)
                assert await peers[i].call(addrs[j], "echo", payload, timeout=60) == payload
                trace.append((round(loop.time(), 9), i, j))

        await asyncio.gather(*(work(i) for i in range(num_peers)))
        elapsed = loop.time()
        for p in peers:
            await p.shutdown()
        return trace, elapsed

    return run_simulation(main, seed=seed, latency=0.05, bandwidth=10e6)


def test_thousand_simulated_peers_make_rpcs_in_seconds():
    started = time.perf_counter()
    trace, virtual_elapsed = _swarm_of_rpcs(1000, 5, seed=1)
    wall = time.perf_counter() - started
    print(f"1000 peers x 5 RPCs: {wall:.1f} s wall, {virtual_elapsed:.2f} s virtual")
    assert len(trace) == 5000
    assert virtual_elapsed < 5.0  # a few round trips of 50 ms each, not timeouts
    assert wall < 60


def test_same_seed_gives_the_same_run():
    assert _swarm_of_rpcs(30, 3, seed=7) == _swarm_of_rpcs(30, 3, seed=7)


def test_latency_and_bandwidth_shape_rpc_time():
    async def main(network):
        a = await create_sim_peer(network)
        b = await create_sim_peer(network)
        b.add_handler("echo", echo)
        loop = asyncio.get_running_loop()
        addr = b.get_visible_maddrs()[0]
        await a.connect(addr)
        t0 = loop.time()
        await a.call(addr, "echo", b"x")
        small = loop.time() - t0
        t0 = loop.time()
        await a.call(addr, "echo", Blob(bytes(2_000_000)))
        big = loop.time() - t0
        for p in (a, b):
            await p.shutdown()
        return small, big

    small, big = run_simulation(main, latency=0.1, bandwidth=1e6)
    assert small == pytest.approx(0.2, abs=0.01)  # one round trip
    assert big >= 4.0  # 2 MB each way at 1 MB/s


def test_crash_and_partition_give_clear_errors_on_the_virtual_clock():
    async def main(network):
        a = await create_sim_peer(network, dial_timeout=5)
        b = await create_sim_peer(network)
        c = await create_sim_peer(network)
        for p in (b, c):
            p.add_handler("echo", echo)
        b_addr, c_addr = b.get_visible_maddrs()[0], c.get_visible_maddrs()[0]
        assert await a.call(b_addr, "echo", 1) == 1
        network.crash(b._backend.host)
        with pytest.raises(ConnectionClosed, match="crashed"):
            await a.call(b_addr, "echo", 2, timeout=30)  # the pooled connection was reset
        with pytest.raises(PeerUnreachable, match="refused"):
            await a.call(b_addr, "echo", 2, timeout=30)  # and nothing answers a new dial
        network.partition([a._backend.host], [c._backend.host])
        with pytest.raises((PeerUnreachable, DeadlineExceeded)):
            await a.call(c_addr, "echo", 3, timeout=30)
        network.heal()
        assert await a.call(c_addr, "echo", 4, timeout=30) == 4
        for p in (a, b, c):
            await p.shutdown()

    run_simulation(main, latency=0.05)


def test_relays_work_on_the_simulated_network():
    async def main(network):
        relay = await create_sim_peer(network)
        home = await create_sim_peer(network, client_mode=True, relays=relay.get_visible_maddrs())
        home.add_handler("echo", echo)
        caller = await create_sim_peer(network)
        (relayed,) = home.get_visible_maddrs()
        result = await caller.call(relayed, "echo", "via relay", timeout=30)
        for p in (caller, home, relay):
            await p.shutdown()
        return result

    assert run_simulation(main, latency=0.02) == "via relay"


def test_keepalive_drops_a_connection_whose_peer_vanished_silently():
    async def main(network):
        a = await create_sim_peer(network, keepalive_interval=10, keepalive_timeout=5)
        b = await create_sim_peer(network, keepalive_interval=None)
        b.add_handler("echo", echo)
        await a.call(b.get_visible_maddrs()[0], "echo", 1)
        assert a.is_connected(b.peer_id)
        # b stops answering without closing anything: its side no longer reads
        (conn,) = [c for c in b._all_connections if c.remote_peer_id == a.peer_id]
        conn.transport.pause_reading()
        await asyncio.sleep(30)
        assert not a.is_connected(b.peer_id)
        for p in (a, b):
            await p.shutdown()

    run_simulation(main, latency=0.05)


def test_keepalive_keeps_a_slow_connection_whose_ping_answer_waits_behind_data():
    """b sends a's 8 MB answer over a 250 kB/s link with 8 MB of write buffering (what
    TLS and the kernel's socket buffer hold on real sockets): b's reply to a's ping queues
    behind up to a stream window (4 MB, 16 s) of data, longer than the 5-s keepalive
    timeout. Bytes keep arriving, so the connection is alive and the call completes."""

    async def main(network):
        a = await create_sim_peer(network, keepalive_interval=4, keepalive_timeout=5)
        b = await create_sim_peer(network, keepalive_interval=None)

        async def blob(request, context):
            return Blob(bytes(8_000_000))

        b.add_handler("blob", blob)
        network.set_link(
            a.get_visible_maddrs()[0].host + ":31337",
            b.get_visible_maddrs()[0].host + ":31337",
            bandwidth=250_000,
        )
        b.add_handler("echo", echo)
        await a.call(b.get_visible_maddrs()[0], "echo", 1)
        (conn,) = [c for c in b._all_connections if c.remote_peer_id == a.peer_id]
        conn.transport.set_write_buffer_limits(high=8_000_000)
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await a.call(b.get_visible_maddrs()[0], "blob", 1, timeout=120)
        elapsed = loop.time() - started
        connected = a.is_connected(b.peer_id)
        for p in (a, b):
            await p.shutdown()
        return len(answer), elapsed, connected

    size, elapsed, connected = run_simulation(main, latency=0.05)
    assert size == 8_000_000
    assert elapsed > 30  # several keepalive rounds passed during the transfer
    assert connected
