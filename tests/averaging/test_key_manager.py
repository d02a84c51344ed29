"""Group keys in the DHT: declarations written by one peer, read by the others."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.key_manager import GroupKeyManager
from swarmgrad.net.sim import run_simulation
from swarmgrad.utils.errors import ValidationError
from tests.helpers.peers import shutdown

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from moshpit_sim import build_dht_swarm


def test_declarations_are_read_back_in_ready_by_then_peer_id_order():
    async def main(network):
        nodes = await build_dht_swarm(network, 12, random.Random(1))
        managers = [GroupKeyManager(n, "run", initial_group_bits="0110") for n in nodes]
        now = nodes[0].time_fn()
        ready = [now + 30 + (i % 3) for i in range(6)]
        await asyncio.gather(
            *(
                m.declare(r, client_mode=(i == 5), maddrs=[f"/ip4/10.0.0.{i}/tcp/1"])
                for i, (m, r) in enumerate(zip(managers, ready, strict=False))
            )
        )
        found = await managers[9].get_declarations()
        await shutdown(nodes)
        return found, ready, [n.peer_id for n in nodes], managers[9].current_key

    found, ready, ids, key = run_simulation(main, seed=1, latency=0.02)
    assert key == "run.0b0110"
    assert [(d.ready_by, d.peer_id) for d in found] == sorted(
        (r, ids[i]) for i, r in enumerate(ready)
    )
    assert [d.client_mode for d in found if d.peer_id == ids[5]] == [True]
    assert {d.peer_id: d.maddrs for d in found}[ids[2]] == ("/ip4/10.0.0.2/tcp/1",)


def test_declarations_vanish_at_ready_by_and_other_keys_are_separate():
    async def main(network):
        nodes = await build_dht_swarm(network, 10, random.Random(2))
        a = GroupKeyManager(nodes[0], "run", initial_group_bits="01")
        b = GroupKeyManager(nodes[1], "run", initial_group_bits="10")
        reader = GroupKeyManager(nodes[7], "run", initial_group_bits="01")
        now = nodes[0].time_fn()
        await a.declare(now + 5)
        await b.declare(now + 50)
        before = await reader.get_declarations()
        other = await reader.get_declarations("run.0b10")
        await asyncio.sleep(6)
        after = await reader.get_declarations()
        await shutdown(nodes)
        return before, other, after, nodes[0].peer_id, nodes[1].peer_id

    before, other, after, a_id, b_id = run_simulation(main, seed=2, latency=0.02)
    assert [d.peer_id for d in before] == [a_id]
    assert [d.peer_id for d in other] == [b_id]
    assert after == []


def test_withdraw_hides_a_declaration_before_it_expires():
    async def main(network):
        nodes = await build_dht_swarm(network, 10, random.Random(3))
        a = GroupKeyManager(nodes[0], "run")
        reader = GroupKeyManager(nodes[6], "run")
        ready = nodes[0].time_fn() + 60
        await a.declare(ready)
        seen = await reader.get_declarations()
        await a.withdraw(ready)
        gone = await reader.get_declarations()
        await shutdown(nodes)
        return seen, gone

    seen, gone = run_simulation(main, seed=3, latency=0.02)
    assert len(seen) == 1 and gone == []


def test_malformed_declarations_from_other_peers_are_skipped():
    async def main(network):
        nodes = await build_dht_swarm(network, 10, random.Random(4))
        good = GroupKeyManager(nodes[0], "run")
        now = nodes[0].time_fn()
        await good.declare(now + 30)
        key = good.current_key
        await nodes[1].store(key, "not a list", now + 30, subkey=nodes[1].peer_id.to_bytes())
        await nodes[2].store(key, [now + 30, False], now + 30, subkey=b"not a peer id")
        await nodes[3].store(key, ["soon", False], now + 30, subkey=nodes[3].peer_id.to_bytes())
        await nodes[4].store(key, [now + 30, "yes"], now + 30, subkey=nodes[4].peer_id.to_bytes())
        await nodes[5].store(
            key, [now + 30, False, "x"], now + 30, subkey=nodes[5].peer_id.to_bytes()
        )
        await nodes[6].store(key, [now + 30, False], now + 30, subkey="text subkey")
        # extra fields are ignored (newer versions may add some)
        await nodes[7].store(
            key, [now + 31, False, [], 7], now + 31, subkey=nodes[7].peer_id.to_bytes()
        )
        found = await GroupKeyManager(nodes[8], "run").get_declarations()
        await shutdown(nodes)
        return found, nodes[0].peer_id, nodes[7].peer_id

    found, first, last = run_simulation(main, seed=4, latency=0.02)
    assert [d.peer_id for d in found] == [first, last]


def test_update_group_bits_shifts_in_the_members_coordinate():
    async def main(network):
        nodes = await build_dht_swarm(network, 4, random.Random(5))
        managers = [
            GroupKeyManager(n, "run", initial_group_bits="1011001", target_group_size=4)
            for n in nodes
        ]
        ids = tuple(n.peer_id for n in nodes)
        info = GroupInfo(b"group-1", ids, (b"",) * 4)
        new = [m.update_group_bits(info, n.peer_id) for m, n in zip(managers, nodes, strict=True)]
        await shutdown(nodes)
        return new, [m.current_key for m in managers]

    new, keys = run_simulation(main, seed=5, latency=0.02)
    assert all(b[:5] == "11001" for b in new)  # two bits (one coordinate) shifted out
    assert len({b[-2:] for b in new}) == 4
    assert keys == [f"run.0b{b}" for b in new]


def test_bad_prefix_bits_and_ready_by_are_refused():
    async def main(network):
        nodes = await build_dht_swarm(network, 2, random.Random(6))
        errors = []
        for make in (
            lambda: GroupKeyManager(nodes[0], ""),
            lambda: GroupKeyManager(nodes[0], "run", initial_group_bits="12"),
        ):
            with pytest.raises(ValidationError) as e:
                make()
            errors.append(str(e.value))
        manager = GroupKeyManager(nodes[0], "run")
        with pytest.raises(ValidationError, match="group bits"):
            manager.group_bits = "0x1"
        with pytest.raises(ValidationError, match="ready_by"):
            await manager.declare(float("nan"))
        await shutdown(nodes)
        return errors

    errors = run_simulation(main, seed=6, latency=0.02)
    assert "prefix" in errors[0] and "group bits" in errors[1]
