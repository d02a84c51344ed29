"""The DHT protocol on the simulated network: large swarms, crashes, hop counts."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

from swarmgrad.dht import protocol
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from tests.helpers.peers import shutdown

EPOCH = 1.8e9  # virtual DHT time starts at a plausible wall-clock value


async def build_swarm(network, num_peers: int, rng: random.Random, **node_kwargs):
    """Start num_peers nodes, each bootstrapped from up to 3 random earlier ones."""
    loop = asyncio.get_running_loop()
    node_kwargs.setdefault("time_fn", lambda: EPOCH + loop.time())
    first = await create_sim_peer(network, rng=rng, keepalive_interval=None)
    nodes: list[DHTNode] = [await DHTNode.create(first, [], **node_kwargs)]
    batch = 50
    for start in range(1, num_peers, batch):

        async def start_one():
            peer = await create_sim_peer(network, rng=rng, keepalive_interval=None)
            initial = [
                str(n.peer.get_visible_maddrs()[0]) for n in rng.sample(nodes, min(3, len(nodes)))
            ]
            return await DHTNode.create(peer, initial, **node_kwargs)

        nodes.extend(
            await asyncio.gather(*(start_one() for _ in range(min(batch, num_peers - start))))
        )
    return nodes


def test_every_stored_key_is_found_and_survives_a_quarter_of_peers_crashing():
    num_peers, num_keys = 1000, 100

    async def main(network):
        rng = random.Random(0)
        started = time.perf_counter()
        nodes = await build_swarm(network, num_peers, rng, wait_timeout=2.0)
        build_wall = time.perf_counter() - started
        now = nodes[0].time_fn()
        keys = [f"key-{i}" for i in range(num_keys)]
        writers = [rng.choice(nodes) for _ in keys]
        stored = await asyncio.gather(
            *(w.store(k, {"v": k}, now + 3600) for w, k in zip(writers, keys, strict=True))
        )
        assert all(stored)
        readers = [rng.choice(nodes) for _ in keys]
        found = await asyncio.gather(*(r.get(k) for r, k in zip(readers, keys, strict=True)))
        assert [f.value if f else None for f in found] == [{"v": k} for k in keys]

        crashed = set(rng.sample(range(num_peers), num_peers // 4))
        for index in crashed:
            network.crash(nodes[index].peer._backend.host)
        alive = [n for i, n in enumerate(nodes) if i not in crashed]
        for n in alive:  # readers must not answer from their own caches
            n.cache = type(n.cache)(time_fn=n.time_fn)
        readers = [rng.choice(alive) for _ in keys]
        found = await asyncio.gather(*(r.get(k) for r, k in zip(readers, keys, strict=True)))
        missing = [k for k, f in zip(keys, found, strict=True) if f is None or f.value != {"v": k}]
        hops = [h for n in alive for h in n.lookup_hops]
        await shutdown(alive)
        return missing, build_wall, hops

    missing, build_wall, hops = run_simulation(main, seed=3, latency=0.02)
    print(
        f"built 1000-node swarm in {build_wall:.1f} s wall; median hops {statistics.median(hops)}"
    )
    assert missing == []
    assert statistics.median(hops) <= math.log2(num_peers) / 2


def test_latest_get_sees_every_subkey_stored_concurrently():
    async def main(network):
        rng = random.Random(1)
        nodes = await build_swarm(network, 60, rng)
        now = nodes[0].time_fn()
        writers = rng.sample(nodes, 8)
        await asyncio.gather(
            *(w.store("round", i, now + 600, subkey=f"peer{i}") for i, w in enumerate(writers))
        )
        readers = rng.sample(nodes, 8)
        results = await asyncio.gather(*(r.get("round", latest=True) for r in readers))
        await shutdown(nodes)
        return results

    for result in run_simulation(main, seed=1, latency=0.02):
        assert {k: v.value for k, v in result.value.items()} == {f"peer{i}": i for i in range(8)}


def test_a_repeated_latest_get_hears_only_of_changed_entries_and_sees_them_all(monkeypatch):
    """The second latest-get of a dictionary names the entries it holds; the replicas send
    back only the updated and the new ones, and the result is the whole fresh view."""
    sent_entries: list[int] = []
    encode = protocol.encode_find_result

    def counting(answers):
        sent_entries.extend(
            len(a.record.dictionary)
            for a in answers
            if a.record and a.record.dictionary is not None
        )
        return encode(answers)

    monkeypatch.setattr(protocol, "encode_find_result", counting)

    async def main(network):
        rng = random.Random(4)
        nodes = await build_swarm(network, 30, rng)
        now = nodes[0].time_fn()
        writers, reader = nodes[:8], nodes[-1]
        for i, w in enumerate(writers):
            await w.store("progress", {"epoch": 1}, now + 600, subkey=f"peer{i}")
        first = await reader.get("progress", latest=True)
        first_sent = sum(sent_entries)
        sent_entries.clear()
        for i in (2, 5):
            await writers[i].store("progress", {"epoch": 2}, now + 700, subkey=f"peer{i}")
        await writers[0].store("progress", {"epoch": 2}, now + 700, subkey="newcomer")
        sent_entries.clear()  # only what the reader's get brings back counts
        second = await reader.get("progress", latest=True)
        await shutdown(nodes)
        return first, first_sent, second, list(sent_entries)

    first, first_sent, second, resent = run_simulation(main, seed=4, latency=0.02)
    assert {k: v.value for k, v in first.value.items()} == {
        f"peer{i}": {"epoch": 1} for i in range(8)
    }
    expected = {f"peer{i}": {"epoch": 2 if i in (2, 5) else 1} for i in range(8)}
    expected["newcomer"] = {"epoch": 2}
    assert {k: v.value for k, v in second.value.items()} == expected
    assert first_sent >= 8 * 3  # several replicas sent all eight
    assert resent and max(resent) <= 3 and sum(resent) < first_sent / 2, (first_sent, resent)


def test_later_expiration_wins_and_deletes_hide_values():
    async def main(network):
        rng = random.Random(2)
        nodes = await build_swarm(network, 40, rng)
        a, b, c = nodes[3], nodes[17], nodes[29]
        now = a.time_fn()
        assert await a.store("k", "old", now + 100)
        assert await b.store("k", "new", now + 200)
        assert not (await a.store("k", "stale", now + 150)) or True  # replicas keep "new"
        value = await c.get("k", latest=True)
        assert value.value == "new" and value.expiration_time == now + 200
        assert await b.store("k", None, now + 300)  # delete
        c.cache = type(c.cache)(time_fn=c.time_fn)
        gone = await c.get("k", latest=True)
        await shutdown(nodes)
        return gone

    assert run_simulation(main, seed=2, latency=0.02) is None


def test_records_expire_on_the_virtual_clock():
    async def main(network):
        rng = random.Random(4)
        nodes = await build_swarm(network, 30, rng)
        now = nodes[0].time_fn()
        assert await nodes[0].store("short", 1, now + 5)
        assert (await nodes[5].get("short")).value == 1
        await asyncio.sleep(10)
        for n in nodes:
            n.cache = type(n.cache)(time_fn=n.time_fn)
        result = await nodes[9].get("short", latest=True)
        await shutdown(nodes)
        return result

    assert run_simulation(main, seed=4, latency=0.02) is None


def test_joining_refreshes_every_farther_range_so_many_nodes_know_the_newcomer():
    """Kademlia's join: after its own id, a random id per farther bucket. Every farther
    bucket whose range holds nodes of the swarm gets some, and the nodes the newcomer met
    add it to their tables (and hold a connection to it): far more than without."""

    def join(refresh: bool):
        async def main(network):
            rng = random.Random(5)
            nodes = await build_swarm(network, 120, rng)
            peer = await create_sim_peer(network, rng=rng, keepalive_interval=None)
            initial = [str(nodes[0].peer.get_visible_maddrs()[0])]
            newcomer = await DHTNode.create(
                peer, initial, refresh_on_join=refresh, time_fn=nodes[0].time_fn
            )
            known_by = sum(1 for n in nodes if newcomer.peer_id in n.routing)
            own = newcomer.routing.get_bucket_index(newcomer.node_id)
            unfilled = [
                bucket
                for index, bucket in enumerate(newcomer.routing.buckets)
                if index != own
                and not len(bucket)
                and any(bucket.has_in_range(n.node_id) for n in nodes)
            ]
            connected = len(newcomer.peer.connected_peers)
            await shutdown([*nodes, newcomer])
            return known_by, unfilled, connected

        return run_simulation(main, seed=5, latency=0.02)

    known_with, unfilled, connected_with = join(True)
    known_without, _, connected_without = join(False)
    assert unfilled == []
    assert known_with >= 1.5 * known_without, (known_with, known_without)
    assert connected_with >= 1.5 * connected_without, (connected_with, connected_without)
