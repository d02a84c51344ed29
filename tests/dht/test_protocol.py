"""DHT wire messages: round trips, and malformed messages refused with ProtocolViolation;
nodes refuse bad stores with a reason and keep serving."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.dht import protocol
from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.protocol import FindAnswer, FoundRecord, StoreItem
from swarmgrad.dht.routing import DHTID
from swarmgrad.net.identity import Identity
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import ProtocolViolation, RemoteError, UnknownHandler, ValidationError
from swarmgrad.utils.timeutils import get_dht_time

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.binary(max_size=30)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(anything)
def test_decoders_accept_or_raise_protocol_violation_on_any_input(message):
    for decode in (
        protocol.decode_ping,
        protocol.decode_pong,
        protocol.decode_store,
        protocol.decode_find,
        lambda m: protocol.decode_store_result(m, 1),
        lambda m: protocol.decode_find_result(m, 1),
        lambda m: protocol.skipped_records(m, 2),
        lambda m: protocol.known_versions(m, 2),
        lambda m: protocol.known_versions({"known": m}, 2),
        lambda m: protocol.known_node_prefixes({"known_nodes": m}, 2),
    ):
        try:
            decode(message)
        except ProtocolViolation:
            pass


def test_store_and_find_messages_round_trip():
    items = [
        StoreItem(b"\xa3key", None, b"\xa5value", 123.5),
        StoreItem(b"\xa3key", b"\xa1s", b"\x01", 124.0, in_cache=True),
    ]
    assert protocol.decode_store(protocol.encode_store(items)) == items
    key_ids = [DHTID.generate(b"a"), DHTID.generate(b"b")]
    assert protocol.decode_find(protocol.encode_find(key_ids)) == key_ids
    peer = Identity.generate().peer_id
    answers = [
        FindAnswer(
            FoundRecord(value=b"v", expiration_time=5.0), ((peer, ("/ip4/1.2.3.4/tcp/5",)),)
        ),
        FindAnswer(FoundRecord(dictionary=((b"s", b"v", 6.0),)), ()),
        FindAnswer(None, ()),
    ]
    encoded = protocol.encode_find_result(answers)
    assert protocol.decode_find_result(encoded, 3) == answers


_versions = st.lists(
    st.tuples(
        st.binary(min_size=protocol.DIGEST_BYTES, max_size=protocol.DIGEST_BYTES),
        st.floats(allow_nan=False, allow_infinity=False),
    ),
    max_size=6,
)


@given(st.dictionaries(st.integers(0, 3), _versions, max_size=4))
def test_known_versions_round_trip_keeping_each_digests_latest(known):
    key_ids = [DHTID.generate(bytes([i])) for i in range(4)]
    decoded = protocol.known_versions(protocol.encode_find(key_ids, known=known), 4)
    expected: dict = {}  # an empty ``known`` is not sent at all
    for index, versions in known.items():
        table = expected.setdefault(index, {})
        for digest, exp in versions:
            table[digest] = max(exp, table.get(digest, -float("inf")))
    assert decoded == expected


def test_oversized_batches_and_bad_ids_are_refused():
    with pytest.raises(ProtocolViolation, match="at most"):
        protocol.decode_find({"keys": [bytes(20)] * (protocol.MAX_BATCH + 1)})
    with pytest.raises(ProtocolViolation, match="20 bytes"):
        protocol.decode_find({"keys": [b"short"]})
    with pytest.raises(ProtocolViolation, match="expected 2 results"):
        protocol.decode_store_result({"results": [None]}, 2)


def test_nodes_refuse_bad_stores_with_reasons_and_keep_serving(arun):
    async def main():
        a = await DHTNode.create(await Peer.create(), max_value_bytes=1000)
        b = await DHTNode.create(await Peer.create(), [str(a.peer.get_visible_maddrs()[0])])
        now = get_dht_time()
        try:
            with pytest.raises(ValidationError, match="over the limit"):
                await b.store("big", "x" * (b.max_value_bytes + 1), now + 10)
            with pytest.raises(ValidationError, match="would expire in"):
                await b.store("far", 1, now + 10 * 365 * 86400)
            # a remote refusal (a's smaller limit) comes back as a reason
            items = [StoreItem(b"\xa3big", None, b"\xc5" + bytes(2000), now + 10)]
            (reason,) = await b._store_remote(a.peer_id, items)
            assert "max_value_bytes=1000" in reason
            # a malformed request is refused with a clear error, and a keeps serving
            with pytest.raises(RemoteError, match="malformed store request"):
                await b.peer.call(a.peer_id, protocol.STORE, {"items": "garbage"})
            assert await b.store("small", "ok", now + 10)
            assert (await a.get("small")).value == "ok"
        finally:
            for node in (b, a):
                await node.shutdown()
                await node.peer.shutdown()

    arun(main)


def test_a_node_serves_the_dht_names_until_shutdown_and_a_client_serves_none(arun):
    async def main():
        server = await DHTNode.create(await Peer.create())
        address = str(server.peer.get_visible_maddrs()[0])
        client = await DHTNode.create(await Peer.create(), [address], client_mode=True)
        try:
            names = sorted(handler.name for handler in server.rpc_handlers())
            assert names == ["dht.find", "dht.ping", "dht.store"]  # the wire names
            ping = protocol.encode_ping([], True)
            their_time, is_client = protocol.decode_pong(
                await client.peer.call(server.peer_id, "dht.ping", ping)
            )
            assert not is_client and their_time > 0
            with pytest.raises(UnknownHandler):  # a client answers no lookups
                await server.peer.call(client.peer_id, "dht.ping", ping)
            await server.shutdown()
            with pytest.raises(UnknownHandler):
                await client.peer.call(server.peer_id, "dht.ping", ping)
        finally:
            for node in (client, server):
                await node.shutdown()
                await node.peer.shutdown()

    arun(main)
