"""A record stays readable while the swarm grows quickly around it: when the joins take
time (links with latency) at every moment, and when 48 nodes join in no time at all from
the next maintenance tick on (holders hand records to the new nearest nodes once a tick,
so a read in the same instant as the burst can miss them; docs/reproductions.md, the
Learning@home throughput section)."""

from __future__ import annotations

import asyncio
import random

from swarmgrad.dht.node import DHTNode
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from swarmgrad.utils.timeutils import get_dht_time

KEYS = 32


def missing_after_a_burst_of_joins(latency: float, wait: float = 0.0) -> list[tuple[int, int]]:
    """4 nodes store KEYS records, then 48 nodes join one after another, then ``wait``
    seconds pass; returns the (key, newcomer) pairs whose get found nothing."""

    async def main(network):
        rng = random.Random(1)
        nodes: list[DHTNode] = []

        async def join() -> DHTNode:
            initial = [str(m) for m in nodes[0].peer.get_visible_maddrs()] if nodes else []
            nodes.append(await DHTNode.create(await create_sim_peer(network, rng=rng), initial))
            return nodes[-1]

        try:
            owners = [await join() for _ in range(4)]
            for i in range(KEYS):
                assert await owners[i % 4].store(f"key{i}", i, get_dht_time() + 600)
            newcomers = [await join() for _ in range(48)]
            await asyncio.sleep(wait)
            missing = [
                (i, n) for n, node in enumerate(newcomers) for i in range(KEYS)
                if await node.get(f"key{i}") is None
            ]  # fmt: skip
            return missing
        finally:
            for node in nodes:
                await node.shutdown()
                await node.peer.shutdown()

    return run_simulation(main, seed=1, latency=latency)


def test_records_follow_a_swarm_whose_joins_take_time():
    assert missing_after_a_burst_of_joins(latency=0.01) == []


def test_records_follow_a_burst_of_joins_from_the_next_maintenance_tick():
    # zero latency: the 48 joins take no virtual time; read in the same instant, 6 of
    # the 32 keys are missed (their new nearest nodes have not been handed them yet)
    assert missing_after_a_burst_of_joins(latency=0.0, wait=1.5) == []
