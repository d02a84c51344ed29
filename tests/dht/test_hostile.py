"""Hostile DHT requests through a real Peer on loopback: random and mutated payloads to
dht.ping / dht.store / dht.find, wrong types in every field, odd expirations, keys of the
wrong length, oversized keys. The node must refuse with a clear remote error (or a clear
per-record reason) and keep answering a well-behaved peer afterwards."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmgrad.dht import protocol
from swarmgrad.dht.node import DHTNode, serialize
from swarmgrad.dht.protocol import StoreItem
from swarmgrad.dht.routing import DHTID
from swarmgrad.dht.validation import DHTRecord, RecordValidatorBase
from swarmgrad.net.peer import MAX_ADDRESSES_PER_PEER, Peer
from swarmgrad.utils.errors import RemoteError
from swarmgrad.utils.timeutils import get_dht_time
from tests.conftest import run_checked
from tests.helpers.peers import shutdown


async def node_and_attacker():
    node = await DHTNode.create(await Peer.create(), [])
    attacker = await Peer.create()
    return node, attacker, node.peer.get_visible_maddrs()[0]


async def remote_store(attacker: Peer, addr, items, timeout: float = 5) -> list[str | None]:
    """Send a raw STORE; the node's per-record answers (None: stored, else why not)."""
    reply = await attacker.call(addr, protocol.STORE, protocol.encode_store(items), timeout=timeout)
    return protocol.decode_store_result(reply, len(items))


async def well_behaved_round_trip(attacker: Peer, addr, tag: str) -> None:
    """A correct store then find of a fresh key still works."""
    key = serialize(f"good-{tag}")
    item = StoreItem(key, None, serialize("value"), get_dht_time() + 60)
    assert await remote_store(attacker, addr, [item]) == [None]
    reply = await attacker.call(
        addr, protocol.FIND, protocol.encode_find([DHTID.generate(key)]), timeout=5
    )
    (answer,) = protocol.decode_find_result(reply, 1)
    assert answer.record is not None and answer.record.value == serialize("value")


async def assert_find_field_refused(attacker: Peer, addr, key_ids, field: str, bad_values):
    """Each bad value of a find request's ``field`` is refused with an error naming it."""
    for bad in bad_values:
        request = {**protocol.encode_find(key_ids), field: bad}
        with pytest.raises(RemoteError, match=field):
            await attacker.call(addr, protocol.FIND, request, timeout=5)


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=24)
)
_ANY = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=24,
)
_ITEM_FIELD = st.sampled_from([0, 1, 2, 3, 4])


@st.composite
def hostile_request(draw):
    """A request: random, or a valid one with one part replaced by something random."""
    name = draw(st.sampled_from([protocol.PING, protocol.STORE, protocol.FIND]))
    if draw(st.booleans()):
        return name, draw(_ANY)
    key = serialize("k")
    if name == protocol.PING:
        message = protocol.encode_ping(["/ip4/127.0.0.1/tcp/1"], False)
        message[draw(st.sampled_from(["maddrs", "client", "extra"]))] = draw(_ANY)
    elif name == protocol.STORE:
        message = protocol.encode_store([StoreItem(key, b"\xa1s", b"\xa1v", get_dht_time() + 60)])
        where = draw(st.sampled_from(["items", "item", "field", "sender"]))
        if where == "items":
            message["items"] = draw(_ANY)
        elif where == "item":
            message["items"][0] = draw(_ANY)
        elif where == "field":
            message["items"][0][draw(_ITEM_FIELD)] = draw(_ANY)
        else:
            message["sender"] = draw(_ANY)
    else:
        message = protocol.encode_find([DHTID.generate(key)])
        where = draw(st.sampled_from(["keys", "key", "k", "sender"]))
        if where == "key":
            message["keys"][0] = draw(_ANY)
        else:
            message[where] = draw(_ANY)
    return name, message


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(hostile_request(), min_size=25, max_size=25))
def test_random_and_mutated_requests_are_refused_clearly_and_the_node_keeps_serving(requests):
    async def main():
        node, attacker, addr = await node_and_attacker()
        for name, request in requests:
            try:
                await attacker.call(addr, name, request, timeout=5)
            except RemoteError as e:
                assert e.remote_type == "ProtocolViolation", (name, request, e)
                assert "malformed" in str(e)
        await well_behaved_round_trip(attacker, addr, "after-fuzz")
        await shutdown(attacker, node)

    run_checked(main, timeout=30)


def test_find_with_keys_of_the_wrong_length_or_type_names_the_problem(arun):
    async def main():
        node, attacker, addr = await node_and_attacker()
        for bad in (b"\x01" * 19, b"\x01" * 21, "x" * 20, -1, None):
            with pytest.raises(RemoteError, match=r"a key id must be 20 bytes|malformed find"):
                await attacker.call(addr, protocol.FIND, {"keys": [bad]}, timeout=5)
        too_many = [DHTID.generate(b"%d" % i).to_bytes() for i in range(protocol.MAX_BATCH + 1)]
        with pytest.raises(RemoteError, match="at most 1024"):
            await attacker.call(addr, protocol.FIND, {"keys": too_many}, timeout=5)
        await well_behaved_round_trip(attacker, addr, "after-find")
        await shutdown(attacker, node)

    arun(main)


def test_find_may_skip_records_and_bad_skip_lists_are_refused_by_name(arun):
    """A store's lookup wants only the nearest nodes: skip_records leaves a key's record
    out of the answer (and a bad list of positions is refused, naming it)."""

    async def main():
        node, attacker, addr = await node_and_attacker()
        key = serialize("skipped")
        item = StoreItem(key, None, serialize("value" * 50), get_dht_time() + 60)
        assert await remote_store(attacker, addr, [item]) == [None]
        key_ids = [DHTID.generate(key), DHTID.generate(key)]
        request = protocol.encode_find(key_ids, skip_records=[1])
        reply = await attacker.call(addr, protocol.FIND, request, timeout=5)
        with_record, without = protocol.decode_find_result(reply, 2)
        assert with_record.record is not None and without.record is None
        bad_lists = ([2], [-1], [True], ["0"], "0", [0, 0, 0])
        await assert_find_field_refused(attacker, addr, key_ids, "skip_records", bad_lists)
        await well_behaved_round_trip(attacker, addr, "after-skip")
        await shutdown(attacker, node)

    arun(main)


def test_find_with_known_versions_answers_only_newer_entries_and_refuses_bad_lists(arun):
    """An asker that lists the dictionary entries it holds gets only newer ones (an empty
    dictionary when nothing is newer: "I have the key"); a malformed list is refused,
    naming ``known``, and the node keeps serving."""

    async def main():
        node, attacker, addr = await node_and_attacker()
        key = serialize("progress")
        now = get_dht_time()
        subs = [serialize(f"peer{i}") for i in range(4)]
        items = [StoreItem(key, sub, serialize(i), now + 60 + i) for i, sub in enumerate(subs)]
        assert await remote_store(attacker, addr, items) == [None] * 4
        key_id = DHTID.generate(key)

        async def entries(known):
            request = protocol.encode_find([key_id], known={0: known} if known else None)
            reply = await attacker.call(addr, protocol.FIND, request, timeout=5)
            (answer,) = protocol.decode_find_result(reply, 1)
            return {sub for sub, _, _ in answer.record.dictionary}

        digest = protocol.subkey_digest
        assert await entries(None) == set(subs)
        held = [(digest(sub), now + 60 + i) for i, sub in enumerate(subs)]
        assert await entries(held) == set()  # nothing newer, but the key is there
        assert await entries(held[:2]) == set(subs[2:])
        older = [(digest(subs[0]), now + 59), *held[1:]]
        assert await entries(older) == {subs[0]}
        newer_than_stored = [(digest(sub), now + 999) for sub in subs]
        assert await entries(newer_than_stored) == set()
        bad_lists = (
            "x",
            [[0]],
            [[1, []]],
            [[0, [[b"short", 1.0]]]],
            [[0, [[b"8 bytes!", math.nan]]]],
            [[0, [[b"8 bytes!", True]]]],
            [[True, []]],
            [[0, [[b"8 bytes!", 1.0]] * (protocol.MAX_KNOWN + 1)]],
        )
        await assert_find_field_refused(attacker, addr, [key_id], "known", bad_lists)
        await well_behaved_round_trip(attacker, addr, "after-known")
        await shutdown(attacker, node)

    arun(main)


def test_find_leaves_out_the_nodes_the_asker_knows_and_refuses_bad_lists(arun):
    """``known_nodes``: the nearest nodes of an answer leave out those the asker named by
    prefix (they are its candidates already); malformed lists are refused by name."""

    async def main():
        node = await DHTNode.create(await Peer.create(), [])
        addr = node.peer.get_visible_maddrs()[0]
        others = [await DHTNode.create(await Peer.create(), [str(addr)]) for _ in range(3)]
        attacker = await Peer.create()
        key_id = DHTID.generate(serialize("anything"))

        async def listed(known_nodes):
            request = protocol.encode_find([key_id], known_nodes=known_nodes)
            reply = await attacker.call(addr, protocol.FIND, request, timeout=5)
            (answer,) = protocol.decode_find_result(reply, 1)
            return {peer for peer, _ in answer.nearest}

        everyone = {o.peer.peer_id for o in others}
        assert await listed(None) == everyone
        first = others[0].peer.peer_id
        prefix = protocol.node_prefix(DHTID.for_peer(first))
        assert await listed({0: [prefix]}) == everyone - {first}
        bad_lists = (
            "x",
            [[0]],
            [[2, []]],
            [[0, [b"short"]]],
            [[0, ["8 chars!"]]],
            [[0, [b"8 bytes!"] * (protocol.MAX_KNOWN_NODES + 1)]],
        )
        await assert_find_field_refused(attacker, addr, [key_id], "known_nodes", bad_lists)
        await well_behaved_round_trip(attacker, addr, "after-known-nodes")
        for other in others:
            await other.shutdown()
            await other.peer.shutdown()
        await shutdown(attacker, node)

    arun(main)


def test_odd_expirations_are_refused_per_record_with_a_reason(arun):
    async def main():
        node, attacker, addr = await node_and_attacker()
        now = get_dht_time()
        expirations = [math.nan, math.inf, -math.inf, -1.0, 0, now + 10 * 365 * 86400]
        items = [
            StoreItem(serialize(f"odd-{i}"), None, serialize(i), e)
            for i, e in enumerate(expirations)
        ]
        reasons = await remote_store(attacker, addr, items)
        assert all(reason for reason in reasons), reasons
        assert "NaN" in reasons[0] and "max_expiration_ahead" in reasons[1]
        assert len(node.storage) == 0
        await well_behaved_round_trip(attacker, addr, "after-expirations")
        await shutdown(attacker, node)

    arun(main)


def test_remote_store_of_an_oversized_key_is_refused_naming_the_limit(arun):
    async def main():
        node, attacker, addr = await node_and_attacker()
        huge_key = serialize("k" * 200_000)  # 50x max_key_bytes, kept by the node if stored
        item = StoreItem(huge_key, None, serialize("v"), get_dht_time() + 60)
        (reason,) = await remote_store(attacker, addr, [item])
        assert reason is not None and "max_key_bytes" in reason
        assert len(node.storage) == 0 and not node._serialized_keys
        await well_behaved_round_trip(attacker, addr, "after-key")
        await shutdown(attacker, node)

    arun(main)


def test_thousands_of_subkeys_do_not_make_finds_of_that_key_fail(arun):
    async def main():
        node, attacker, addr = await node_and_attacker()
        key, innocent = serialize("crowded"), serialize("good-innocent")
        await well_behaved_round_trip(attacker, addr, "innocent")
        exp, filler = get_dht_time() + 60, serialize(bytes(10_000))
        for batch in range(3):  # 3000 subkeys, 30 MB: an answer with all of them is too big
            items = [
                StoreItem(key, serialize(batch * 1000 + i), filler, exp + i) for i in range(1000)
            ]
            reply = await attacker.call(
                addr, protocol.STORE, protocol.encode_store(items), timeout=20
            )
            assert protocol.decode_store_result(reply, 1000) == [None] * 1000
        request = protocol.encode_find([DHTID.generate(key), DHTID.generate(innocent)])
        reply = await attacker.call(addr, protocol.FIND, request, timeout=20)
        crowded, other = protocol.decode_find_result(reply, 2)
        assert 100 < len(crowded.record.dictionary) < 3000  # the freshest that fit
        assert min(e for _, _, e in crowded.record.dictionary) > exp + 100
        assert other.record is not None and other.record.value == serialize("value")
        await shutdown(attacker, node)

    arun(main)


def test_a_peer_announcing_new_addresses_on_every_ping_cannot_grow_our_address_book(arun):
    async def main():
        node, attacker, addr = await node_and_attacker()
        for i in range(200):
            maddrs = [f"/ip4/10.1.{i}.{j}/tcp/{2000 + j}" for j in range(protocol.MAX_ADDRS)]
            reply = await attacker.call(addr, protocol.PING, {"maddrs": maddrs, "client": False})
            protocol.decode_pong(reply)
        book = node.peer.addresses_of(attacker.peer_id)
        assert len(book) <= MAX_ADDRESSES_PER_PEER
        assert str(book[-1]).startswith("/ip4/10.1.199.")  # the newest are kept
        await well_behaved_round_trip(attacker, addr, "after-addresses")
        await shutdown(attacker, node)

    arun(main)


def test_ping_with_huge_address_lists_learns_at_most_a_few(arun):
    async def main():
        node, attacker, addr = await node_and_attacker()
        maddrs = [f"/ip4/10.0.{i // 256}.{i % 256}/tcp/{1000 + i}" for i in range(20_000)]
        maddrs += ["/not/a/maddr", "", "/ip4/999.1.1.1/tcp/1", "/ip4/1.1.1.1/tcp/99999"]
        reply = await attacker.call(addr, protocol.PING, {"maddrs": maddrs, "client": False})
        protocol.decode_pong(reply)
        assert len(node.peer.addresses_of(attacker.peer_id)) <= protocol.MAX_ADDRS
        await asyncio.sleep(0)
        await well_behaved_round_trip(attacker, addr, "after-ping")
        await shutdown(attacker, node)

    arun(main)


class _RefusesForged(RecordValidatorBase):
    """Believes every record except those whose value is ``"forged"``."""

    def validate(self, record: DHTRecord) -> bool:
        return record.value != serialize("forged")


def test_a_forged_subkey_stored_by_a_lax_node_hides_no_honest_entry(arun):
    """A node that checks nothing may hold a dictionary mixing honest entries with a forged
    one; a reader that validates drops that entry only, not the whole dictionary."""

    async def main():
        lax, attacker, addr = await node_and_attacker()
        reader = await DHTNode.create(
            await Peer.create(), [addr], record_validator=_RefusesForged()
        )
        key, exp = serialize("run_progress"), get_dht_time() + 60
        items = [
            StoreItem(key, serialize("alice"), serialize({"epoch": 3}), exp),
            StoreItem(key, serialize("mallory"), serialize("forged"), exp + 1),
            StoreItem(key, serialize("bob"), serialize({"epoch": 4}), exp),
        ]
        assert await remote_store(attacker, addr, items) == [None, None, None]
        found = await reader.get("run_progress", latest=True)
        assert found is not None
        assert {sub: v.value for sub, v in found.value.items()} == {
            "alice": {"epoch": 3},
            "bob": {"epoch": 4},
        }
        only_forged = [StoreItem(serialize("lonely"), serialize("m"), serialize("forged"), exp)]
        assert await remote_store(attacker, addr, only_forged) == [None]
        assert await reader.get("lonely", latest=True) is None  # nothing valid: absent
        await reader.shutdown()
        await reader.peer.shutdown()
        await shutdown(attacker, lax)

    arun(main)
