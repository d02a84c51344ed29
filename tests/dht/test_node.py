"""DHTNode behaviours on the simulated network: caching, coalescing, hand-off, blacklist,
client mode and clock skew."""

from __future__ import annotations

import asyncio
import logging
import random

from swarmgrad.dht import node as node_module
from swarmgrad.dht import protocol
from swarmgrad.dht.node import DHTNode, serialize
from swarmgrad.dht.routing import DHTID
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from swarmgrad.utils.errors import ValidationError
from tests.helpers.peers import shutdown

EPOCH = 1.8e9


async def make_nodes(network, count, rng, **kwargs):
    loop = asyncio.get_running_loop()
    kwargs.setdefault("time_fn", lambda: EPOCH + loop.time())
    nodes = [await DHTNode.create(await create_sim_peer(network, rng=rng), [], **kwargs)]
    for _ in range(count - 1):
        peer = await create_sim_peer(network, rng=rng)
        nodes.append(
            await DHTNode.create(peer, [str(nodes[0].peer.get_visible_maddrs()[0])], **kwargs)
        )
    return nodes


def count_finds(node):
    """Wrap a node's find handler to count the requests it serves."""
    counter = {"requests": 0, "keys": 0}
    original = node.rpc_find

    async def counting(request, context):
        counter["requests"] += 1
        counter["keys"] += len(request["keys"])
        return await original(request, context)

    node.peer.remove_handler(protocol.FIND)
    node.peer.add_handler(protocol.FIND, counting)
    return counter


def test_found_values_are_cached_locally_and_on_the_path():
    async def main(network):
        nodes = await make_nodes(network, 30, random.Random(0), cache_nearest=1)
        now = nodes[0].time_fn()
        assert await nodes[1].store("hot", "value", now + 100)
        reader = nodes[20]
        reader.cache.clear()
        assert (await reader.get("hot")).value == "value"
        key_id = DHTID.generate(serialize("hot"))
        assert reader.cache.get(key_id) is not None  # cached locally
        await asyncio.sleep(0.5)  # path caching runs in the background
        cached_elsewhere = sum(1 for n in nodes if n is not reader and n.cache.get(key_id))
        await shutdown(nodes)
        return cached_elsewhere

    assert run_simulation(main, latency=0.02) >= 1


def test_lookup_statistics_keep_only_the_latest_lookups(monkeypatch):
    """(issue 32) ``lookup_hops`` grew by one entry per lookup for the peer's lifetime."""
    monkeypatch.setattr(node_module, "_LOOKUP_HOPS_KEPT", 3)

    async def main(network):
        nodes = await make_nodes(network, 5, random.Random(1))
        now = nodes[0].time_fn()
        reader = nodes[4]
        for i in range(5):
            assert await nodes[1].store(f"key{i}", i, now + 100)
            reader.cache.clear()
            assert (await reader.get(f"key{i}", latest=True)).value == i
        hops = list(reader.lookup_hops)
        await shutdown(nodes)
        return hops

    hops = run_simulation(main, latency=0.01)
    assert len(hops) == 3 and all(h >= 1 for h in hops)


def test_concurrent_gets_of_one_key_share_one_lookup():
    async def main(network):
        nodes = await make_nodes(network, 12, random.Random(1))
        now = nodes[0].time_fn()
        assert await nodes[2].store("shared", 1, now + 100)
        reader = nodes[9]
        reader.cache.clear()
        reader.storage.clear()
        counters = [count_finds(n) for n in nodes if n is not reader]
        results = await asyncio.gather(*(reader.get("shared", latest=True) for _ in range(10)))
        served = sum(c["keys"] for c in counters)
        await shutdown(nodes)
        return results, served

    results, served = run_simulation(main, latency=0.02)
    assert all(r.value == 1 for r in results)
    assert served <= 12  # one lookup's worth of requests, not ten


def test_a_stores_lookup_asks_for_nearest_nodes_only_and_a_get_for_the_record():
    """A run's progress dictionary came back with every lookup of every store to it:
    most of what a DiLoCo peer sent (benchmarks/slow_links.py)."""

    async def main(network):
        nodes = await make_nodes(network, 8, random.Random(3))
        now = nodes[0].time_fn()
        seen: list[tuple[bool, int]] = []  # (records skipped for every key, bytes answered)
        for node in nodes:
            original = node.rpc_find

            async def spying(request, context, original=original):
                answer = await original(request, context)
                skipped = protocol.skipped_records(request, len(request["keys"]))
                seen.append((len(skipped) == len(request["keys"]), len(serialize(answer))))
                return answer

            node.peer.remove_handler(protocol.FIND)
            node.peer.add_handler(protocol.FIND, spying)
        writer, reader = nodes[1], nodes[6]
        for subkey in range(20):
            assert await writer.store("progress", "x" * 200, now + 100, subkey=subkey)
        seen.clear()
        assert await writer.store("progress", "y" * 200, now + 100, subkey=99)
        store_lookup = list(seen)
        seen.clear()
        found = await reader.get("progress", latest=True)
        get_lookup = list(seen)
        await shutdown(nodes)
        return store_lookup, get_lookup, found

    store_lookup, get_lookup, found = run_simulation(main, latency=0.02)
    assert store_lookup and all(skipped for skipped, _ in store_lookup)
    assert max(size for _, size in store_lookup) < 2000  # nodes only: no 21 x 200 bytes
    assert get_lookup and not any(skipped for skipped, _ in get_lookup)
    assert len(found.value) == 21


def test_lookups_for_many_keys_share_requests_to_the_same_node():
    async def main(network):
        nodes = await make_nodes(network, 6, random.Random(2))
        now = nodes[0].time_fn()
        keys = [f"k{i}" for i in range(20)]
        await nodes[0].store_many(keys, list(range(20)), now + 100)
        reader = nodes[5]
        reader.cache.clear()
        reader.storage.clear()
        counters = [count_finds(n) for n in nodes if n is not reader]
        found = await reader.get_many(keys, latest=True)
        requests = sum(c["requests"] for c in counters)
        asked = sum(c["keys"] for c in counters)
        await shutdown(nodes)
        return found, requests, asked

    found, requests, asked = run_simulation(main, latency=0.02)
    assert {k: v.value for k, v in found.items()} == {f"k{i}": i for i in range(20)}
    assert requests < asked  # several keys travelled in one find request


def test_a_newcomer_nearer_to_a_key_receives_it():
    async def main(network):
        rng = random.Random(3)
        nodes = await make_nodes(network, 8, rng, num_replicas=2)
        now = nodes[0].time_fn()
        keys = [f"k{i}" for i in range(40)]
        await nodes[0].store_many(keys, list(range(40)), now + 1000)
        newcomer = await DHTNode.create(
            await create_sim_peer(network, rng=rng),
            [str(nodes[0].peer.get_visible_maddrs()[0])],
            num_replicas=2,
            time_fn=nodes[0].time_fn,
        )
        await asyncio.sleep(3)  # maintenance hands records over
        received = len(newcomer.storage)
        await shutdown([*nodes, newcomer])
        return received

    assert run_simulation(main, latency=0.02) > 0


def test_failing_nodes_are_blacklisted_with_backoff():
    async def main(network):
        nodes = await make_nodes(network, 5, random.Random(4), wait_timeout=1.0)
        victim = nodes[3]
        network.crash(victim.peer._backend.host)
        asker = nodes[1]
        assert not await asker.ping(victim.peer_id)
        assert victim.peer_id in asker.blacklist
        assert victim.node_id not in asker.routing
        first_ban = asker.blacklist._banned_until[victim.peer_id] - asker.time_fn()
        asker.blacklist.register_failure(victim.peer_id)
        second_ban = asker.blacklist._banned_until[victim.peer_id] - asker.time_fn()
        await shutdown([n for n in nodes if n is not victim])
        await victim.shutdown()
        await victim.peer.shutdown()
        return first_ban, second_ban

    first, second = run_simulation(main, latency=0.02)
    assert second > first * 1.5


def test_a_node_cut_off_from_everyone_is_isolated_and_rejoins_when_its_links_return():
    """Every call of a node whose links are down fails, so it forgets or bans every node
    it knows and would call nobody again; the others ban it too. Once its links are back
    it rejoins through its initial peers, and a node it reaches lifts its own ban on it."""

    async def main(network):
        nodes = await make_nodes(network, 5, random.Random(6), wait_timeout=1.0)
        lonely, others = nodes[4], nodes[:4]
        hosts = [n.peer._backend.host for n in others]
        assert not lonely.isolated
        now = lonely.time_fn()
        assert await others[1].store("key", "before", now + 600)
        network.partition([lonely.peer._backend.host], hosts)
        # every node it calls fails (a lookup, then the pings of its maintenance)
        await lonely.get("key", latest=True)
        assert not any([await lonely.ping(n.peer_id) for n in others])
        assert await others[0].ping(lonely.peer_id) is False
        isolated_while_cut = lonely.isolated
        assert lonely.peer_id in others[0].blacklist
        network.heal()
        await asyncio.sleep(15)  # a dial begun while cut off times out (10 s), then one more
        rejoined = not lonely.isolated
        assert await others[2].store("key", "after", lonely.time_fn() + 600)
        found_after = await lonely.get("key", latest=True)
        await shutdown(nodes)
        still_banned = lonely.peer_id in others[0].blacklist
        return isolated_while_cut, rejoined, found_after.value, still_banned

    isolated_while_cut, rejoined, value, still_banned = run_simulation(main, latency=0.02)
    assert isolated_while_cut and rejoined
    assert value == "after"
    assert not still_banned


def test_a_node_that_calls_us_is_no_longer_banned():
    async def main(network):
        nodes = await make_nodes(network, 3, random.Random(7), wait_timeout=1.0)
        banning, caller = nodes[1], nodes[2]
        for _ in range(4):  # banned for 40 s
            banning.blacklist.register_failure(caller.peer_id)
        banned_before = caller.peer_id in banning.blacklist
        assert await caller.ping(banning.peer_id)
        banned_after = caller.peer_id in banning.blacklist
        await shutdown(nodes)
        return banned_before, banned_after

    assert run_simulation(main, latency=0.02) == (True, False)


def test_client_mode_nodes_store_nothing_for_others_and_stay_out_of_routing():
    async def main(network):
        rng = random.Random(5)
        nodes = await make_nodes(network, 6, rng)
        client = await DHTNode.create(
            await create_sim_peer(network, rng=rng, client_mode=True),
            [str(nodes[0].peer.get_visible_maddrs()[0])],
            client_mode=True,
            time_fn=nodes[0].time_fn,
        )
        now = client.time_fn()
        assert await client.store("from-client", 7, now + 100)
        assert (await nodes[4].get("from-client")).value == 7
        in_routing = any(client.node_id in n.routing for n in nodes)
        stored_by_client = len(client.storage)
        await shutdown([client, *nodes])
        return in_routing, stored_by_client

    in_routing, stored = run_simulation(main, latency=0.02)
    assert not in_routing and stored == 0


def test_wildly_different_clock_is_warned(caplog):
    async def main(network):
        rng = random.Random(6)
        nodes = await make_nodes(network, 2, rng)
        loop = asyncio.get_running_loop()
        skewed = await DHTNode.create(
            await create_sim_peer(network, rng=rng),
            [],
            time_fn=lambda: EPOCH + loop.time() + 3600,
        )
        nodes[0].peer.add_addresses(skewed.peer_id, skewed.peer.get_visible_maddrs())
        with caplog.at_level(logging.WARNING, logger="swarmgrad.dht.node"):
            assert await nodes[0].ping(skewed.peer_id)
        await shutdown([*nodes, skewed])

    run_simulation(main, latency=0.02)
    assert "clock of" in caplog.text and "3600" in caplog.text


def test_hot_cached_keys_are_refreshed_before_they_expire():
    async def main(network):
        nodes = await make_nodes(network, 8, random.Random(7), cache_refresh_before_expiry=5)
        now = nodes[0].time_fn()
        assert await nodes[1].store("hot", "v1", now + 20)
        key_id = DHTID.generate(serialize("hot"))
        reader = next(n for n in nodes[2:] if n.storage.get(key_id) is None)  # not a replica
        reader.cache.clear()
        assert (await reader.get("hot")).value == "v1"
        assert await nodes[1].store("hot", "v2", now + 120)  # the owner renews it
        await asyncio.sleep(17)  # within 5 s of the cached copy's expiry
        cached = reader.cache.get(key_id)
        await shutdown(nodes)
        return cached, now

    cached, now = run_simulation(main, latency=0.02)
    assert cached is not None and cached.expiration_time == now + 120


def _count_searches(node) -> list:
    """Replace node._search by a wrapper that records, per search, whether it was latest."""
    searched, original = [], node._search

    async def counting(key_bytes, key_id, latest, *args):
        searched.append(latest)
        return await original(key_bytes, key_id, latest, *args)

    node._search = counting
    return searched


def test_only_reads_the_cache_answers_keep_a_key_refreshed():
    """A plain get marks a key for one refresh before its cached copy expires; neither a
    latest-get (which asks the network every time anyway) nor the refresh itself does:
    before, a streaming DiLoCo peer refreshed its progress key about once a second, and a
    key read once was refreshed for as long as it existed."""

    async def main(network):
        nodes = await make_nodes(network, 8, random.Random(7), cache_refresh_before_expiry=5)
        now = nodes[0].time_fn()
        assert await nodes[1].store("plain", "v1", now + 10)
        assert await nodes[1].store("latest", "v1", now + 10)
        ids = [DHTID.generate(serialize(k)) for k in ("plain", "latest")]
        reader = next(n for n in nodes[2:] if all(n.storage.get(key_id) is None for key_id in ids))
        reader.cache.clear()
        assert (await reader.get("plain")).value == "v1"
        assert (await reader.get("latest", latest=True)).value == "v1"
        searched = _count_searches(reader)
        # the owner renews both twice; only "plain" was read from the cache, once
        assert await nodes[1].store("plain", "v2", now + 20)
        assert await nodes[1].store("latest", "v2", now + 20)
        await asyncio.sleep(9)  # within 5 s of the cached copies' expiry: one refresh
        refreshed = reader.cache.get(ids[0])
        assert await nodes[1].store("plain", "v3", now + 40)
        await asyncio.sleep(10)  # within 5 s of the refreshed copy's expiry: no read since
        await shutdown(nodes)
        return searched, refreshed, now

    searched, refreshed, now = run_simulation(main, latency=0.02)
    assert refreshed is not None and refreshed.expiration_time == now + 20
    assert searched == [False]  # the plain key's one refresh; nothing for the latest one


def test_a_node_heard_again_within_a_second_keeps_its_rank():
    """Every request and answer reaches _add_node; re-ranking a node heard moments ago
    only costs CPU, so it happens at most once a second per node, and a node that was
    forgotten is added again at once."""

    async def main(network):
        nodes = await make_nodes(network, 6, random.Random(3))
        node, other = nodes[0], nodes[1]
        bucket = node.routing.buckets[node.routing.get_bucket_index(other.node_id)]

        def rank() -> int:
            return list(bucket.nodes_to_peer_id).index(other.node_id)

        await asyncio.sleep(2.0)
        node._add_node(other.peer_id)
        first = rank()
        for peer in (p for p in nodes[2:] if DHTID.for_peer(p.peer_id) in bucket.nodes_to_peer_id):
            node._add_node(peer.peer_id)
        node._add_node(other.peer_id)  # within the second: not re-ranked
        held = rank()
        await asyncio.sleep(1.5)
        node._add_node(other.peer_id)
        moved = rank()
        node._forget(other.peer_id)
        node._add_node(other.peer_id)  # forgotten: added again at once
        back = other.node_id in node.routing
        size = len(bucket.nodes_to_peer_id)
        await shutdown(nodes)
        return first, held, moved, back, size

    first, held, moved, back, size = run_simulation(main, latency=0.01)
    assert first == size - 1 or size == 1
    assert back
    if size > 1:
        assert held < size - 1 and moved == size - 1


def _quorum_swarm(network, count=10):
    """``count`` nodes, three writers each storing a subkey of "progress" (on every
    replica), and the ids of the key's replicas."""

    async def build():
        nodes = await make_nodes(network, count, random.Random(11))
        now = nodes[0].time_fn()
        for index, writer in enumerate(nodes[1:4]):
            assert await writer.store("progress", f"record {index}", now + 100, subkey=index)
        key_id = DHTID.generate(serialize("progress"))
        replicas = [n for n in nodes if n.storage.get(key_id) is not None]
        return nodes, replicas

    return build()


def test_a_quorum_read_asks_that_many_replicas_and_sees_every_writer():
    async def main(network):
        nodes, replicas = await _quorum_swarm(network)
        others = [n for n in nodes if n not in replicas]
        counters = {n.peer_id: count_finds(n) for n in nodes}

        async def served_for(reader, **kwargs):
            before = sum(c["requests"] for c in counters.values())
            found = await reader.get("progress", latest=True, **kwargs)
            return sorted(found.value), sum(c["requests"] for c in counters.values()) - before

        outcome = {
            "replica, quorum 2": await served_for(replicas[0], quorum=2),
            "replica, quorum 1": await served_for(replicas[1], quorum=1),
            "other, quorum 2": await served_for(others[0], quorum=2),
            "other, full read": await served_for(others[1]),
        }
        await shutdown(nodes)
        return outcome, len(replicas)

    outcome, num_replicas = run_simulation(main, latency=0.02)
    assert num_replicas >= 5  # the 5 nearest and, when it is as near, the writer
    for subkeys, _ in outcome.values():
        assert subkeys == [0, 1, 2]
    assert outcome["replica, quorum 2"][1] == 1  # its own copy and one other
    assert outcome["replica, quorum 1"][1] == 0  # its own copy alone
    assert outcome["other, quorum 2"][1] == 2
    assert outcome["other, full read"][1] >= 5


def test_a_quorum_read_replaces_a_dead_replica_and_reads_all_when_lost():
    """A replica that does not answer is replaced by the next; a reader that does not know
    the key's neighbourhood (an answer names a nearer node) reads it in full."""

    async def main(network):
        nodes, replicas = await _quorum_swarm(network)
        key_id = DHTID.generate(serialize("progress"))
        reader = next(n for n in nodes if n not in replicas)
        reader._rng.shuffle = lambda items: None  # ask the nearest first
        nearest = min(replicas, key=lambda n: n.node_id ^ key_id)
        await shutdown([nearest])
        with_dead = await reader.get("progress", latest=True, quorum=2)

        lost = next(n for n in nodes if n not in replicas and n is not reader)
        for replica in replicas[1:]:  # it knows one replica only, and the key is far
            lost.routing._remove_node(replica.node_id)
        searched = _count_searches(lost)
        lookups = []
        original = lost._lookup

        async def counting_lookup(*args, **kwargs):
            lookups.append(kwargs.get("find_value"))
            return await original(*args, **kwargs)

        lost._lookup = counting_lookup
        when_lost = await lost.get("progress", latest=True, quorum=2)
        await shutdown([n for n in nodes if n is not nearest])
        return with_dead, when_lost, searched, lookups

    with_dead, when_lost, searched, lookups = run_simulation(main, latency=0.02)
    assert sorted(with_dead.value) == [0, 1, 2]
    assert sorted(when_lost.value) == [0, 1, 2]
    assert searched == [True] and lookups == [True]  # the quorum read gave way to a lookup


def test_a_read_quorum_is_checked():
    async def main(network):
        nodes = await make_nodes(network, 2, random.Random(1))
        errors = []
        for kwargs in (
            {"quorum": 0},
            {"quorum": True},
            {"quorum": 2.0},
            {"quorum": 2, "latest": False},
        ):
            try:
                await nodes[1].get("key", **{"latest": True, **kwargs})
            except ValidationError as e:
                errors.append(str(e))
        await shutdown(nodes)
        return errors

    errors = run_simulation(main, latency=0.02)
    assert len(errors) == 4
    assert "latest-gets only" in errors[3] and "positive int" in errors[0]


def test_a_store_in_a_known_neighbourhood_asks_one_node_and_lands_on_the_replicas():
    """A store checks its routing table's nearest nodes with one probe instead of a
    lookup of num_replicas + 2, and stores on the same nodes a lookup would have found."""

    async def main(network):
        nodes = await make_nodes(network, 12, random.Random(5))
        writer = nodes[3]
        key_id = DHTID.generate(serialize("probed"))
        counters = [count_finds(n) for n in nodes]
        assert await writer.store("probed", "v", writer.time_fn() + 100)
        asked = sum(c["requests"] for c in counters)
        holders = {n.peer_id for n in nodes if n.storage.get(key_id) is not None}
        lookup = await writer._lookup(key_id, find_value=False, k=7, alpha=7)
        await shutdown(nodes)
        return asked, holders, {p for _, p in lookup.nearest[:5]}, writer.peer_id

    asked, holders, nearest, writer = run_simulation(main, latency=0.02)
    assert asked == 1
    assert nearest <= holders <= nearest | {writer}


def test_a_store_looks_up_the_neighbourhood_when_a_probe_or_a_replica_fails():
    async def main(network):
        nodes = await make_nodes(network, 12, random.Random(5))
        key_id = DHTID.generate(serialize("probed"))
        by_distance = sorted(nodes, key=lambda n: n.node_id ^ key_id)
        writer = by_distance[-1]  # the farthest: never a replica itself
        # a writer that knows only far nodes: its probe names nearer ones
        lost = by_distance[-2]
        for node in by_distance[:6]:
            lost.routing._remove_node(node.node_id)
        assert await lost.store("probed", "from lost", lost.time_fn() + 100)
        lost_holders = [n for n in by_distance[:5] if n.storage.get(key_id) is not None]
        # a replica that died, still in the writer's routing table: it is replaced
        key2 = DHTID.generate(serialize("probed2"))
        others = sorted((n for n in nodes if n is not writer), key=lambda n: n.node_id ^ key2)
        dead = others[0]
        await shutdown([dead])
        writer._rng.choice = lambda seq: seq[-1]  # probe a live node
        assert await writer.store("probed2", "x", writer.time_fn() + 100)
        holders2 = [n for n in others[1:6] if n.storage.get(key2) is not None]
        await shutdown([n for n in nodes if n is not dead])
        return len(lost_holders), len(holders2)

    lost_holders, holders2 = run_simulation(main, latency=0.02)
    assert lost_holders == 5  # the true replicas, which it did not know
    assert holders2 == 5  # the 5 nearest live nodes: the dead one's place taken
