"""Kademlia routing: DHTID encoding, k-bucket bookkeeping, the splitting rule, exact
nearest-neighbour queries and the node id <-> PeerID mappings of the routing table."""

from __future__ import annotations

import hashlib
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from swarmgrad.dht.routing import DHTID, KBucket, RoutingTable
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError
from tests.helpers.peers import numbered_peer_id

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)

ID_LIMIT = 2**160
HALF = 2**159


peer = numbered_peer_id

PEERS = [peer(i) for i in range(3)]


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# Ids that collide in their top bits often enough to force deep splits and full buckets,
# mixed with uniformly random ones.
ids = st.one_of(
    st.integers(0, ID_LIMIT - 1),
    st.integers(0, 63).map(lambda i: i << 154),
    st.integers(0, 63).map(lambda i: HALF | i),
    st.integers(0, 63),
).map(DHTID)


def check_invariants(table: RoutingTable) -> None:
    """Everything a routing table promises about its structure and mappings."""
    buckets = table.buckets
    assert buckets[0].lower == 0 and buckets[-1].upper == ID_LIMIT
    for left, right in itertools.pairwise(buckets):
        assert left.upper == right.lower  # contiguous: the buckets partition the id space
    in_buckets = {}
    for index, bucket in enumerate(buckets):
        width = bucket.upper - bucket.lower
        assert width & (width - 1) == 0 and bucket.lower % width == 0
        assert width == ID_LIMIT >> bucket.depth
        assert len(bucket) <= table.bucket_size
        assert len(bucket.replacement_nodes) <= bucket.max_replacements
        assert not set(bucket.nodes_to_peer_id) & set(bucket.replacement_nodes)
        assert bucket.nodes_requested_for_ping <= set(bucket.nodes_to_peer_id)
        for node_id in [*bucket.nodes_to_peer_id, *bucket.replacement_nodes]:
            assert bucket.lower <= node_id < bucket.upper
            assert table.get_bucket_index(node_id) == index
        in_buckets.update(bucket.nodes_to_peer_id)
    assert table.node_id not in in_buckets
    assert in_buckets == table.uid_to_peer_id
    assert {p: n for n, p in in_buckets.items()} == table.peer_id_to_uid
    assert len(table.peer_id_to_uid) == len(table.uid_to_peer_id) == len(table)


def brute_force_nearest(table: RoutingTable, query: int, k: int, exclude=()) -> list:
    candidates = [(n, p) for n, p in table.uid_to_peer_id.items() if n not in set(exclude)]
    return sorted(candidates, key=lambda item: item[0] ^ query)[: max(k, 0)]


# --- DHTID ---------------------------------------------------------------------------


@given(st.integers(0, ID_LIMIT - 1))
@DETERMINISTIC
def test_dhtid_bytes_round_trip_is_20_bytes_big_endian(value):
    node_id = DHTID(value)
    raw = node_id.to_bytes()
    assert len(raw) == 20 == DHTID.HASH_NBYTES
    assert raw == value.to_bytes(20, "big")
    assert DHTID.from_bytes(raw) == node_id
    assert isinstance(DHTID.from_bytes(raw), DHTID)
    assert DHTID.from_bytes(bytearray(raw)) == node_id


@given(st.integers(0, ID_LIMIT - 1), st.integers(0, ID_LIMIT - 1))
@DETERMINISTIC
def test_dhtid_byte_order_matches_integer_order(a, b):
    assert (DHTID(a).to_bytes() < DHTID(b).to_bytes()) == (a < b)


@pytest.mark.parametrize("length", [0, 1, 19, 21, 32])
def test_dhtid_from_bytes_refuses_other_lengths(length):
    with pytest.raises(ValidationError, match="20 bytes"):
        DHTID.from_bytes(b"\x01" * length)


def test_dhtid_from_bytes_refuses_non_bytes():
    with pytest.raises(ValidationError):
        DHTID.from_bytes("x" * 20)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, ID_LIMIT, ID_LIMIT + 5, -(2**200)])
def test_dhtid_refuses_integers_outside_160_bits(value):
    with pytest.raises(ValidationError, match="2\\*\\*160"):
        DHTID(value)


def test_dhtid_accepts_both_ends_of_the_range():
    assert DHTID(0) == 0
    assert DHTID(ID_LIMIT - 1).to_bytes() == b"\xff" * 20


def test_generate_is_sha1_of_bytes_and_utf8_of_str():
    expected = int.from_bytes(hashlib.sha1(b"expert.0.1").digest(), "big")
    assert DHTID.generate(b"expert.0.1") == expected
    assert DHTID.generate("expert.0.1") == expected
    assert DHTID.generate(bytearray(b"expert.0.1")) == expected
    assert DHTID.generate(memoryview(b"expert.0.1")) == expected
    assert DHTID.generate("é") == DHTID.generate("é".encode())
    assert isinstance(DHTID.generate(b""), DHTID)


@pytest.mark.parametrize("source", [42, 1.5, ["a"], object()])
def test_generate_refuses_other_types(source):
    with pytest.raises(ValidationError, match="bytes, str or None"):
        DHTID.generate(source)


def test_generate_without_source_is_random_in_range_and_replays_under_a_seed():
    state = random.getstate()
    try:
        random.seed(1234)
        first = [DHTID.generate() for _ in range(50)]
        random.seed(1234)
        again = [DHTID.generate() for _ in range(50)]
    finally:
        random.setstate(state)
    assert first == again
    assert len(set(first)) == 50
    assert all(isinstance(x, DHTID) and 0 <= x < ID_LIMIT for x in first)


def test_for_peer_is_the_hash_of_the_peer_id_bytes():
    a, b = peer(1), peer(2)
    assert DHTID.for_peer(a) == DHTID.generate(a.to_bytes())
    assert DHTID.for_peer(a) == DHTID.for_peer(PeerID(a.to_bytes()))
    assert DHTID.for_peer(a) != DHTID.for_peer(b)


@given(st.integers(0, ID_LIMIT - 1), st.lists(st.integers(0, ID_LIMIT - 1), max_size=5))
@DETERMINISTIC
def test_xor_distance_of_one_id_and_of_a_sequence(a, others):
    me = DHTID(a)
    assert me.xor_distance(me) == 0
    assert all(me.xor_distance(o) == a ^ o for o in others)
    assert me.xor_distance(others) == [a ^ o for o in others]
    assert me.xor_distance(iter(others)) == [a ^ o for o in others]


def test_dhtid_repr_is_short():
    assert repr(DHTID(ID_LIMIT - 1)) == "DHTID(0xffffffffff...)"


# --- KBucket ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lower, upper",
    [(0, 0), (5, 3), (0, 3), (1, 3), (HALF, HALF + 3), (-2, 2), (0, 2 * ID_LIMIT), (2, 4 + 2)],
)
def test_kbucket_refuses_unaligned_or_non_power_of_two_ranges(lower, upper):
    with pytest.raises(ValidationError, match="aligned power-of-two"):
        KBucket(lower, upper, 4)


def test_kbucket_refuses_size_below_one():
    with pytest.raises(ValidationError, match="at least one node"):
        KBucket(0, ID_LIMIT, 0)


def test_kbucket_refuses_nodes_outside_its_range():
    bucket = KBucket(HALF, ID_LIMIT, 4, depth=1)
    with pytest.raises(ValidationError, match="outside the bucket"):
        bucket.add_or_update_node(DHTID(HALF - 1), peer(0))


def test_kbucket_full_keeps_newcomers_as_replacements_freshest_last_and_bounded():
    bucket = KBucket(0, ID_LIMIT, 2, max_replacements=2)
    assert bucket.add_or_update_node(DHTID(1), peer(1))
    assert bucket.add_or_update_node(DHTID(2), peer(2))
    assert not bucket.add_or_update_node(DHTID(3), peer(3))
    assert not bucket.add_or_update_node(DHTID(4), peer(4))
    assert not bucket.add_or_update_node(DHTID(3), peer(3))  # heard again: freshest now
    assert list(bucket.replacement_nodes) == [4, 3]
    assert not bucket.add_or_update_node(DHTID(5), peer(5))  # the oldest replacement goes
    assert list(bucket.replacement_nodes) == [3, 5]
    assert list(bucket.nodes_to_peer_id) == [1, 2]


def test_kbucket_without_replacement_cache_forgets_newcomers():
    bucket = KBucket(0, ID_LIMIT, 1, max_replacements=0)
    assert bucket.add_or_update_node(DHTID(1), peer(1))
    assert not bucket.add_or_update_node(DHTID(2), peer(2))
    assert not bucket.replacement_nodes


def test_kbucket_update_moves_node_to_most_recently_seen():
    bucket = KBucket(0, ID_LIMIT, 3)
    for i in (1, 2, 3):
        bucket.add_or_update_node(DHTID(i), peer(i))
    bucket.add_or_update_node(DHTID(1), peer(1))
    assert list(bucket.nodes_to_peer_id) == [2, 3, 1]


def test_kbucket_ping_requests_go_oldest_first_and_once_each():
    bucket = KBucket(0, ID_LIMIT, 2)
    bucket.add_or_update_node(DHTID(1), peer(1))
    bucket.add_or_update_node(DHTID(2), peer(2))
    assert bucket.request_ping_node() == (1, peer(1))
    assert bucket.request_ping_node() == (2, peer(2))
    assert bucket.request_ping_node() is None
    bucket.add_or_update_node(DHTID(1), peer(1))  # it answered
    assert bucket.request_ping_node() == (1, peer(1))


def test_kbucket_split_distributes_nodes_replacements_and_pings_by_range():
    bucket = KBucket(0, ID_LIMIT, 2)
    low, high, low2 = DHTID(5), DHTID(HALF + 5), DHTID(6)
    bucket.add_or_update_node(low, peer(1))
    bucket.add_or_update_node(high, peer(2))
    bucket.add_or_update_node(low2, peer(3))  # a replacement
    bucket.request_ping_node()  # low
    left, right = bucket.split()
    assert (left.lower, left.upper, left.depth) == (0, HALF, 1)
    assert (right.lower, right.upper, right.depth) == (HALF, ID_LIMIT, 1)
    assert dict(left.nodes_to_peer_id) == {low: peer(1)}
    assert dict(right.nodes_to_peer_id) == {high: peer(2)}
    assert dict(left.replacement_nodes) == {low2: peer(3)}
    assert left.nodes_requested_for_ping == {low} and not right.nodes_requested_for_ping


def test_kbucket_single_id_bucket_cannot_split():
    with pytest.raises(ValidationError, match="single-id"):
        KBucket(7, 8, 1, depth=160).split()


def test_kbucket_random_id_is_inside_the_bucket():
    rng_state = random.getstate()
    try:
        random.seed(5)
        bucket = KBucket(HALF + 2**100, HALF + 2**101, 1, depth=59)
        assert all(bucket.has_in_range(bucket.random_id()) for _ in range(100))
    finally:
        random.setstate(rng_state)


# --- RoutingTable: structure and the splitting rule -------------------------------------


@given(
    own=ids,
    nodes=st.lists(st.tuples(ids, st.integers(0, 40)), max_size=80),
    bucket_size=st.integers(1, 4),
    depth_modulo=st.integers(1, 5),
)
@DETERMINISTIC
def test_buckets_partition_the_id_space_and_obey_the_splitting_rule(
    own, nodes, bucket_size, depth_modulo
):
    table = RoutingTable(own, bucket_size, depth_modulo)
    for node_id, peer_index in nodes:
        to_ping = table.add_or_update_node(node_id, peer(peer_index))
        if node_id == own:
            assert to_ping is None and own not in table
            continue
        bucket = table.buckets[table.get_bucket_index(node_id)]
        if node_id in table:
            assert to_ping is None
            assert table[node_id] == peer(peer_index)
            assert table[peer(peer_index)] == node_id
            assert list(bucket.nodes_to_peer_id)[-1] == node_id  # most recently seen
        else:
            # refused only by a full bucket that the rule forbids to split
            assert len(bucket) == bucket_size
            assert not bucket.has_in_range(own)
            assert bucket.depth % depth_modulo == 0
            assert node_id in bucket.replacement_nodes
            assert to_ping is None or (to_ping[0] in bucket and to_ping[1] == bucket[to_ping[0]])
        check_invariants(table)


def test_bucket_holding_our_id_splits_and_far_full_bucket_does_not_with_modulo_1():
    own = DHTID(0)
    table = RoutingTable(own, bucket_size=1, depth_modulo=1)
    a, b = DHTID(HALF + 1), DHTID(HALF + 2)
    assert table.add_or_update_node(a, peer(1)) is None
    assert len(table.buckets) == 1
    # the root is full and holds our id: it splits; the upper half (depth 1, no own id,
    # 1 % 1 == 0) is full and may not split, so b waits and a is to be pinged
    assert table.add_or_update_node(b, peer(2)) == (a, peer(1))
    assert [(x.lower, x.upper, x.depth) for x in table.buckets] == [
        (0, HALF, 1),
        (HALF, ID_LIMIT, 1),
    ]
    assert b not in table and b in table.buckets[1].replacement_nodes
    # nodes near us keep splitting our own bucket
    c, d = DHTID(2**100), DHTID(2**99)
    assert table.add_or_update_node(c, peer(3)) is None
    assert table.add_or_update_node(d, peer(4)) is None
    assert c in table and d in table
    # our bucket split until c and d fell apart: one bucket per depth 1..60 off our path,
    # plus ours, [0, 2**100), at depth 60
    assert [(x.lower, x.depth) for x in table.buckets] == [(0, 60)] + [
        (2**bit, 160 - bit) for bit in range(100, 160)
    ]
    assert table.buckets[0].nodes_to_peer_id == {d: peer(4)}
    assert table.buckets[1].nodes_to_peer_id == {c: peer(3)}
    check_invariants(table)


def test_depth_modulo_lets_far_buckets_split_until_depth_is_a_multiple():
    own = DHTID(0)
    table = RoutingTable(own, bucket_size=1, depth_modulo=2)
    a = DHTID(HALF + 1)
    b = DHTID(HALF + 2**158 + 1)
    c = DHTID(HALF + 2)
    assert table.add_or_update_node(a, peer(1)) is None
    # root splits (holds own id); the upper half has depth 1, 1 % 2 != 0: it splits too
    assert table.add_or_update_node(b, peer(2)) is None
    assert [(x.lower, x.depth) for x in table.buckets] == [
        (0, 1),
        (HALF, 2),
        (HALF + 2**158, 2),
    ]
    # a's bucket has depth 2, 2 % 2 == 0, and does not hold our id: c must wait
    assert table.add_or_update_node(c, peer(3)) == (a, peer(1))
    assert c not in table
    check_invariants(table)


def test_large_depth_modulo_splits_every_full_bucket():
    table = RoutingTable(DHTID(0), bucket_size=1, depth_modulo=10**6)
    for i in range(1, 40):
        assert table.add_or_update_node(DHTID(HALF + (i << 100)), peer(i)) is None
    assert len(table) == 39
    check_invariants(table)


def test_table_refuses_depth_modulo_below_one():
    with pytest.raises(ValidationError, match="depth_modulo"):
        RoutingTable(DHTID(0), 4, depth_modulo=0)


# --- RoutingTable: full buckets, pings and replacements --------------------------------


def full_far_bucket_table():
    """Own id 0, k=2, modulo 1: the upper half fills with a, b and refuses newcomers."""
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=1)
    a, b, c = DHTID(HALF + 1), DHTID(HALF + 2), DHTID(HALF + 3)
    assert table.add_or_update_node(DHTID(1), peer(100)) is None
    assert table.add_or_update_node(a, peer(1)) is None
    assert table.add_or_update_node(b, peer(2)) is None
    return table, a, b, c


def test_full_bucket_returns_least_recently_seen_node_and_keeps_newcomer_as_replacement():
    table, a, b, c = full_far_bucket_table()
    assert table.add_or_update_node(c, peer(3)) == (a, peer(1))
    bucket = table.buckets[table.get_bucket_index(c)]
    assert c not in table and peer(3) not in table
    assert dict(bucket.replacement_nodes) == {c: peer(3)}
    assert len(bucket) == 2
    # every node already awaits a ping once both were handed out
    d = DHTID(HALF + 4)
    assert table.add_or_update_node(d, peer(4)) == (b, peer(2))
    assert table.add_or_update_node(DHTID(HALF + 5), peer(5)) is None
    assert DHTID(HALF + 5) not in table
    check_invariants(table)


def test_pinged_node_that_answers_stays_and_newcomer_keeps_waiting():
    table, a, b, c = full_far_bucket_table()
    assert table.add_or_update_node(c, peer(3)) == (a, peer(1))
    assert table.add_or_update_node(a, peer(1)) is None  # a answered the ping
    bucket = table.buckets[table.get_bucket_index(a)]
    assert list(bucket.nodes_to_peer_id) == [b, a]
    assert c not in table and c in bucket.replacement_nodes
    assert table.add_or_update_node(DHTID(HALF + 9), peer(9)) == (b, peer(2))


def test_removing_a_dead_node_promotes_the_freshest_replacement():
    table, a, b, c = full_far_bucket_table()
    d = DHTID(HALF + 4)
    table.add_or_update_node(c, peer(3))
    table.add_or_update_node(d, peer(4))
    del table[a]
    assert a not in table and peer(1) not in table
    assert table[d] == peer(4) and table[peer(4)] == d  # freshest replacement first
    assert c not in table
    del table[b]
    assert table[c] == peer(3)
    del table[c]
    del table[d]
    assert len(table) == 1
    check_invariants(table)


def test_deleting_a_replacement_forgets_it_and_unknown_ids_raise_keyerror():
    table, a, b, c = full_far_bucket_table()
    table.add_or_update_node(c, peer(3))
    del table[c]
    assert c not in table.buckets[table.get_bucket_index(c)].replacement_nodes
    del table[a]
    assert c not in table
    with pytest.raises(KeyError):
        del table[c]
    with pytest.raises(KeyError):
        del table[DHTID(12345)]


# --- RoutingTable: mappings ------------------------------------------------------------


def test_peer_showing_up_under_another_id_replaces_its_old_entry():
    table = RoutingTable(DHTID(0), 4, 5)
    old, new = DHTID(HALF + 1), DHTID(7)
    table.add_or_update_node(old, peer(1))
    table.add_or_update_node(new, peer(1))
    assert old not in table and table[peer(1)] == new and len(table) == 1
    check_invariants(table)


def test_node_id_reappearing_with_another_peer_forgets_the_old_peer():
    table = RoutingTable(DHTID(0), 4, 5)
    node = DHTID(HALF + 1)
    table.add_or_update_node(node, peer(1))
    table.add_or_update_node(node, peer(2))
    assert peer(1) not in table and table[node] == peer(2) and table[peer(2)] == node
    check_invariants(table)


def test_lookups_by_node_id_and_by_peer_id():
    table = RoutingTable(DHTID(0), 4, 5)
    node = DHTID(HALF + 1)
    table.add_or_update_node(node, peer(1))
    assert node in table and peer(1) in table
    assert DHTID(3) not in table and peer(2) not in table
    assert table[node] == peer(1) and table[peer(1)] == node
    assert table.get(node_id=node) == peer(1)
    assert table.get(peer_id=peer(1)) == node
    assert table.get(peer_id=peer(2), default="none") == "none"
    assert table.peer_ids == [peer(1)]
    with pytest.raises(ValidationError, match="exactly one"):
        table.get()
    with pytest.raises(ValidationError, match="exactly one"):
        table.get(node_id=node, peer_id=peer(1))
    with pytest.raises(KeyError):
        table[peer(2)]


def test_peer_moving_away_does_not_promote_a_replacement_carrying_the_same_peer():
    """Regression: a's bucket promoted (z, P) while P moved to n, leaving P under two ids."""
    table = RoutingTable(DHTID(0), bucket_size=1, depth_modulo=1)
    a, z, n = DHTID(HALF + 1), DHTID(HALF + 2), DHTID(5)
    assert table.add_or_update_node(a, peer(2)) is None
    assert table.add_or_update_node(z, peer(1)) == (a, peer(2))  # z waits as a replacement
    assert table.add_or_update_node(a, peer(1)) is None  # a now reports peer 1
    assert table.add_or_update_node(n, peer(1)) is None  # peer 1 moves to n
    assert table[peer(1)] == n and a not in table and z not in table
    assert dict(table.uid_to_peer_id) == {n: peer(1)}
    check_invariants(table)


def test_own_id_is_never_stored():
    own = DHTID(HALF + 3)
    table = RoutingTable(own, 4, 5)
    assert table.add_or_update_node(own, peer(1)) is None
    assert own not in table and peer(1) not in table and len(table) == 0


# Ids that differ only in their top 6 bits: buckets fill, refuse nodes and keep
# replacements, and the table stays shallow, so long sequences check quickly.
crowded_ids = st.integers(0, 63).map(lambda i: DHTID(i << 154))


class RoutingTableMachine(RuleBasedStateMachine):
    """Few peers for many ids: peers move between ids, ids change peers, replacements
    carry peers that meanwhile moved. After every step the table must be consistent."""

    @initialize(own=crowded_ids, bucket_size=st.integers(1, 2), depth_modulo=st.integers(1, 3))
    def create(self, own, bucket_size, depth_modulo):
        self.table = RoutingTable(own, bucket_size, depth_modulo)

    @rule(node_id=crowded_ids, peer_index=st.integers(0, 2))
    def add(self, node_id, peer_index):
        table = self.table
        to_ping = table.add_or_update_node(node_id, PEERS[peer_index])
        if node_id == table.node_id:
            assert to_ping is None and node_id not in table
        elif node_id in table:
            assert to_ping is None
            assert table[node_id] == PEERS[peer_index]
            assert table[PEERS[peer_index]] == node_id
        else:
            assert node_id in table.buckets[table.get_bucket_index(node_id)].replacement_nodes

    @rule(node_id=crowded_ids)
    def remove(self, node_id):
        table = self.table
        bucket = table.buckets[table.get_bucket_index(node_id)]
        if node_id in bucket or node_id in bucket.replacement_nodes:
            del table[node_id]
            assert node_id not in table and node_id not in bucket.replacement_nodes
        else:
            with pytest.raises(KeyError):
                del table[node_id]

    @invariant()
    def consistent(self):
        check_invariants(self.table)


RoutingTableMachine.TestCase.settings = settings(
    DETERMINISTIC, max_examples=200, stateful_step_count=60
)
test_mappings_stay_consistent_under_random_adds_and_removes = RoutingTableMachine.TestCase


# --- RoutingTable: nearest neighbours --------------------------------------------------


@given(
    own=ids,
    nodes=st.lists(ids, min_size=1, max_size=100, unique=True),
    queries=st.lists(ids, min_size=1, max_size=4),
    bucket_size=st.integers(1, 5),
    depth_modulo=st.integers(1, 5),
    exclude_every=st.integers(1, 4),
)
@DETERMINISTIC
def test_nearest_neighbors_equal_brute_force_xor_sort(
    own, nodes, queries, bucket_size, depth_modulo, exclude_every
):
    table = RoutingTable(own, bucket_size, depth_modulo)
    for i, node_id in enumerate(nodes):
        table.add_or_update_node(node_id, peer(i))
    stored = list(table.uid_to_peer_id)
    excluded = stored[::exclude_every]
    first = stored[0] if stored else own
    for query in [*queries, *stored[:1], *stored[-1:], own]:  # a stored id is at distance 0
        everything = brute_force_nearest(table, query, len(stored))
        remaining = brute_force_nearest(table, query, len(stored), excluded)
        without_first = brute_force_nearest(table, query, len(stored), [first])
        assert table.get_nearest_neighbors(query, -1) == []
        for k in range(len(stored) + 2):
            assert table.get_nearest_neighbors(query, k) == everything[:k]
            assert table.get_nearest_neighbors(query, k, exclude=excluded) == remaining[:k]
            assert table.get_nearest_neighbors(query, k, exclude=first) == without_first[:k]
        for k in (1, len(remaining) // 2, len(stored)):
            assert table.get_nearest_neighbors(query, k, exclude=set(excluded)) == remaining[:k]
            assert table.get_nearest_neighbors(query, k, exclude=tuple(excluded)) == remaining[:k]
            assert table.get_nearest_neighbors(query, k, exclude=iter(excluded)) == remaining[:k]


def test_nearest_neighbors_small_example_and_exclusions_do_not_count_towards_k():
    table = RoutingTable(DHTID(0), bucket_size=20, depth_modulo=5)
    for i in range(1, 9):
        table.add_or_update_node(DHTID(i), peer(i))
    assert [n for n, _ in table.get_nearest_neighbors(DHTID(5), 3)] == [5, 4, 7]
    assert [n for n, _ in table.get_nearest_neighbors(DHTID(5), 3, exclude=5)] == [4, 7, 6]
    assert [n for n, _ in table.get_nearest_neighbors(DHTID(5), 3, exclude={5, 4})] == [7, 6, 1]
    assert table.get_nearest_neighbors(DHTID(5), 0) == []
    assert len(table.get_nearest_neighbors(DHTID(5), 100)) == 8
    assert table.get_nearest_neighbors(DHTID(5), 3)[0] == (DHTID(5), peer(5))


def test_nearest_neighbors_of_an_empty_table():
    table = RoutingTable(DHTID(0), 4, 5)
    assert table.get_nearest_neighbors(DHTID(3), 5) == []


# --- RoutingTable: refresh -------------------------------------------------------------


def test_buckets_to_refresh_follow_the_fake_clock():
    clock = FakeClock(1000.0)
    table = RoutingTable(DHTID(0), bucket_size=1, depth_modulo=1, time_fn=clock)
    assert table.buckets_to_refresh(60) == []
    clock.now = 1059.0
    assert table.buckets_to_refresh(60) == []
    clock.now = 1060.0
    assert table.buckets_to_refresh(60) == table.buckets

    a, b = DHTID(HALF + 1), DHTID(HALF + 2)
    clock.now = 1100.0
    table.add_or_update_node(a, peer(1))
    assert table.buckets_to_refresh(60) == []
    clock.now = 1110.0
    table.add_or_update_node(b, peer(2))  # splits; b is refused, yet we heard from it
    lower, upper = table.buckets
    assert lower.last_updated == 1100.0  # a half inherits the time of the whole
    assert upper.last_updated == 1110.0
    clock.now = 1165.0
    assert table.buckets_to_refresh(60) == [lower]
    clock.now = 1170.0
    assert table.buckets_to_refresh(60) == [lower, upper]

    del table[a]  # losing a node is no news from the range
    assert upper.last_updated == 1110.0
    clock.now = 1171.0
    table.add_or_update_node(DHTID(5), peer(5))
    assert table.buckets_to_refresh(60) == [upper]
    assert table.buckets_to_refresh(0) == table.buckets


def test_table_repr_mentions_size():
    table = RoutingTable(DHTID(0), 4, 5)
    table.add_or_update_node(DHTID(1), peer(1))
    assert "1 nodes in 1 buckets" in repr(table)
    assert "1/4 nodes" in repr(table.buckets[0])
