"""Expert records in the DHT: uids, prefixes, several servers per uid, withdrawal."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.dht.node import DHTNode
from swarmgrad.moe.dht_records import (
    declare_experts_on_node,
    get_experts_info_on_node,
    parse_prefix_entries,
    withdraw_experts_on_node,
)
from swarmgrad.moe.expert_uid import (
    is_valid_prefix,
    is_valid_uid,
    normalize_prefix,
    split_uid,
    uid_prefixes,
)
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from swarmgrad.utils.errors import ValidationError

EPOCH = 1.8e9


@pytest.mark.parametrize("uid", ["expert.0", "ffn.3.17", "x.10.0.255"])
def test_valid_uids(uid):
    assert is_valid_uid(uid)
    assert not is_valid_prefix(uid)


@pytest.mark.parametrize("text", ["expert", "expert.", "expert.01", "a b.1", ".1", "e.1.", ""])
def test_invalid_uids(text):
    assert not is_valid_uid(text)


def test_prefixes_and_splitting():
    assert uid_prefixes("ffn.3.17") == [("ffn.", 3), ("ffn.3.", 17)]
    assert split_uid("ffn.3.17") == ("ffn.3.", 17)
    assert split_uid("ffn.3.") == ("ffn.", 3)
    assert normalize_prefix("expert") == normalize_prefix("expert.") == "expert."
    with pytest.raises(ValidationError, match="not an expert uid prefix"):
        normalize_prefix("bad prefix")
    with pytest.raises(ValidationError, match="no grid coordinate"):
        split_uid("expert.")


@given(
    st.text(alphabet="abcxyz_-", min_size=1, max_size=8),
    st.lists(st.integers(0, 999), min_size=1, max_size=4),
)
def test_every_generated_uid_splits_back_into_its_prefixes(name, coords):
    uid = ".".join([name, *map(str, coords)])
    assert is_valid_uid(uid)
    pairs = uid_prefixes(uid)
    assert [c for _, c in pairs] == coords
    assert all(is_valid_prefix(p) for p, _ in pairs)
    assert pairs[-1] == split_uid(uid)


async def _nodes(network, count):
    loop = asyncio.get_running_loop()
    rng = random.Random(1)
    kwargs = {"time_fn": lambda: EPOCH + loop.time()}
    nodes = [await DHTNode.create(await create_sim_peer(network, rng=rng), [], **kwargs)]
    for _ in range(count - 1):
        peer = await create_sim_peer(network, rng=rng)
        first = str(nodes[0].peer.get_visible_maddrs()[0])
        nodes.append(await DHTNode.create(peer, [first], **kwargs))
    return nodes


def test_two_servers_of_one_uid_are_both_found_and_withdrawal_removes_one():
    async def main(network):
        nodes = await _nodes(network, 12)
        server_a, server_b, client = nodes[3], nodes[7], nodes[11]
        now = client.time_fn()
        assert await declare_experts_on_node(server_a, ["ffn.1.2", "ffn.0.5"], now + 60) == {
            "ffn.1.2": True,
            "ffn.0.5": True,
        }
        assert (await declare_experts_on_node(server_b, ["ffn.1.2"], now + 60))["ffn.1.2"]

        both, single, missing = await get_experts_info_on_node(
            client, ["ffn.1.2", "ffn.0.5", "ffn.9.9"]
        )
        assert {s.peer_id for s in both.servers} == {server_a.peer.peer_id, server_b.peer.peer_id}
        assert single.peer_id == server_a.peer.peer_id
        assert missing is None

        top = parse_prefix_entries("ffn.", await client.get("ffn.", latest=True))
        assert set(top) == {0, 1}
        assert len(top[1]) == 2 and {uid for uid, _ in top[1]} == {"ffn.1.2"}
        last = parse_prefix_entries("ffn.1.", await client.get("ffn.1.", latest=True))
        assert set(last) == {2}

        await withdraw_experts_on_node(server_b, ["ffn.1.2"], now + 61)
        (after,) = await get_experts_info_on_node(client, ["ffn.1.2"], latest=True)
        assert [s.peer_id for s in after.servers] == [server_a.peer.peer_id]
        for node in nodes:
            await node.shutdown()
            await node.peer.shutdown()

    run_simulation(main, seed=3)


def test_malformed_prefix_entries_are_skipped():
    from swarmgrad.dht.storage import ValueWithExpiration as V

    good_peer = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
    record = V(
        {
            f"3:{good_peer}": V(["ffn.3.1", ["/ip4/1.2.3.4/tcp/1"]], 1.0),
            "x:junk": V(["ffn.3.1", []], 1.0),
            f"4:{good_peer}": V(["other.4.1", []], 1.0),
            f"5:{good_peer}": V("not a list", 1.0),
            "6:notapeer": V(["ffn.6.1", []], 1.0),
        },
        1.0,
    )
    entries = parse_prefix_entries("ffn.", record)
    assert list(entries) == [3]
