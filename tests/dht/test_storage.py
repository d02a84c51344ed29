"""DHT local storage: the later expiration wins in any arrival order, records vanish at
their expiration (on a fake clock), subkeys and tombstones follow the module's rules,
limits raise StorageLimitExceeded naming the key or peer, and maxsize evicts the record
that expires soonest. A model of the rules, written without heaps, checks random runs."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from swarmgrad.dht.routing import DHTID
from swarmgrad.dht.storage import DHTLocalStorage, DictionaryDHTValue, ValueWithExpiration
from swarmgrad.utils.errors import StorageLimitExceeded, SwarmgradError, ValidationError
from tests.helpers.peers import numbered_peer_id

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)


peer = numbered_peer_id

PEERS = [peer(i) for i in range(3)]
KEY, OTHER = DHTID.generate(b"key"), DHTID.generate(b"other")
NOW = 1000.0


class FakeClock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(**limits) -> tuple[DHTLocalStorage, FakeClock]:
    clock = FakeClock()
    return DHTLocalStorage(time_fn=clock, **limits), clock


def snapshot(record):
    """A comparable form of what get() returned."""
    if record is None:
        return None
    value, expiration_time = record
    if isinstance(value, DictionaryDHTValue):
        return "dict", sorted(value.items()), expiration_time
    return "plain", value, expiration_time


def subkeys_of(record) -> dict:
    assert isinstance(record.value, DictionaryDHTValue)
    return {subkey: tuple(item) for subkey, item in record.value.items()}


# --- the later expiration wins ---------------------------------------------------------


def test_later_expiration_replaces_earlier_and_earlier_is_refused():
    storage, _ = make()
    assert storage.store(KEY, b"v1", NOW + 10)
    assert storage.store(KEY, b"v2", NOW + 20)
    assert not storage.store(KEY, b"v3", NOW + 15)
    assert storage.get(KEY) == (b"v2", NOW + 20)
    assert isinstance(storage.get(KEY), ValueWithExpiration)
    value, expiration_time = storage.get(KEY)
    assert (value, expiration_time) == (b"v2", NOW + 20)


def test_equal_expiration_keeps_the_first_and_the_same_record_again_succeeds():
    storage, _ = make()
    assert storage.store(KEY, b"first", NOW + 10)
    assert not storage.store(KEY, b"second", NOW + 10)
    assert storage.store(KEY, b"first", NOW + 10)  # the very same record: harmless
    assert storage.get(KEY) == (b"first", NOW + 10)
    assert storage.store(KEY, b"a", NOW + 10, subkey=b"s") is False  # the plain one wins
    assert storage.store(OTHER, b"x", NOW + 5, subkey=b"s")
    assert not storage.store(OTHER, b"y", NOW + 5, subkey=b"s")
    assert storage.store(OTHER, b"x", NOW + 5, subkey=b"s")
    assert subkeys_of(storage.get(OTHER)) == {b"s": (b"x", NOW + 5)}


def test_plain_record_wins_a_tie_with_a_subkey_in_either_order():
    first, _ = make()
    assert first.store(KEY, b"plain", NOW + 10)
    assert not first.store(KEY, b"sub", NOW + 10, subkey=b"s")
    second, _ = make()
    assert second.store(KEY, b"sub", NOW + 10, subkey=b"s")
    assert second.store(KEY, b"plain", NOW + 10)
    assert first.get(KEY) == second.get(KEY) == (b"plain", NOW + 10)


def test_expired_or_now_expiring_stores_are_refused():
    storage, clock = make()
    assert not storage.store(KEY, b"v", NOW - 1)
    assert not storage.store(KEY, b"v", NOW)  # expires now: already expired
    assert not storage.store(KEY, b"v", NOW, subkey=b"s")
    assert not storage.store(KEY, None, -math.inf)
    assert storage.get(KEY, include_tombstones=True) is None
    assert storage.num_records == 0
    with pytest.raises(ValidationError, match="NaN"):
        storage.store(KEY, b"v", math.nan)


places = st.sampled_from([None, b"a", b"b", b"c"])


@st.composite
def store_sets(draw):
    """Stores on one key: per place (plain or a subkey) distinct expirations."""
    stores = []
    for place in draw(st.lists(places, min_size=1, max_size=4, unique=True)):
        expirations = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True))
        for expiration in expirations:
            value = draw(st.one_of(st.none(), st.binary(min_size=0, max_size=3)))
            stores.append((place, value, NOW + expiration))
    return stores


def expected_state(stores):
    """The final state the module docstring promises, computed from the whole set."""
    plain = max((s for s in stores if s[0] is None), key=lambda s: s[2], default=None)
    best: dict[bytes, tuple] = {}
    for subkey, value, expiration in stores:
        if subkey is not None and (subkey not in best or expiration > best[subkey][1]):
            best[subkey] = (value, expiration)
    latest = max((e for _, e in best.values()), default=-math.inf)
    if plain is not None and plain[2] >= latest:
        return "plain", plain[1], plain[2]
    floor = -math.inf if plain is None else plain[2]
    kept = {s: r for s, r in best.items() if r[1] > floor}
    return "dict", sorted(kept.items()), max(e for _, e in kept.values())


@given(store_sets().flatmap(lambda stores: st.tuples(st.just(stores), st.permutations(stores))))
@DETERMINISTIC
def test_any_arrival_order_of_stores_gives_the_same_final_state(stores_and_order):
    stores, order = stores_and_order
    storage, _ = make()
    for subkey, value, expiration in order:
        storage.store(KEY, value, expiration, subkey=subkey)
    kind, content, expiration = expected_state(stores)
    got = storage.get(KEY, include_tombstones=True)
    if kind == "plain":
        assert snapshot(got) == ("plain", content, expiration)
        visible = None if content is None else got
    else:
        assert snapshot(got) == (
            "dict",
            [(s, ValueWithExpiration(*r)) for s, r in content],
            expiration,
        )
        live = {s: r for s, r in content if r[0] is not None}
        visible = live or None
        if live:
            assert subkeys_of(storage.get(KEY)) == live
            assert storage.get(KEY).expiration_time == max(e for _, e in live.values())
    assert (storage.get(KEY) is not None) == (visible is not None) == (KEY in storage)
    assert len(storage) == (visible is not None)


@given(store_sets(), st.permutations(range(16)))
@DETERMINISTIC
def test_store_results_agree_with_the_final_state(stores, shuffle):
    """A store that reported success and was not superseded later is what get() shows."""
    order = [stores[i] for i in shuffle if i < len(stores)]
    storage, _ = make()
    results = [storage.store(KEY, v, e, subkey=s) for s, v, e in order]
    kind, content, expiration = expected_state(stores)
    if kind == "plain":
        winner = next(i for i, (s, v, e) in enumerate(order) if s is None and e == expiration)
        assert results[winner]
    else:
        for subkey, (value, sub_expiration) in content:
            winner = order.index((subkey, value, sub_expiration))
            assert results[winner]


# --- expiry ----------------------------------------------------------------------------


def test_records_vanish_at_their_expiration_time():
    storage, clock = make()
    storage.store(KEY, b"v", NOW + 10)
    storage.store(OTHER, b"w", NOW + 20)
    clock.now = NOW + 9.999
    assert storage.get(KEY) == (b"v", NOW + 10) and len(storage) == 2
    clock.now = NOW + 10
    assert storage.get(KEY) is None
    assert KEY not in storage and len(storage) == 1 and storage.num_records == 1
    assert storage.keys() == [OTHER] and list(storage) == [OTHER]
    assert [k for k, _ in storage.items()] == [OTHER]
    clock.now = NOW + 25
    assert storage.items() == [] and len(storage) == 0 and storage.num_records == 0
    assert storage.top() is None


def test_key_can_be_stored_again_after_its_record_expired():
    storage, clock = make()
    storage.store(KEY, b"old", NOW + 10)
    clock.now = NOW + 11
    assert storage.store(KEY, b"new", NOW + 12)
    assert storage.get(KEY) == (b"new", NOW + 12)


def test_subkeys_expire_independently():
    storage, clock = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 20, subkey=b"b")
    storage.store(KEY, b"c", NOW + 30, subkey=b"c")
    record = storage.get(KEY)
    assert record.expiration_time == NOW + 30
    assert subkeys_of(record) == {
        b"a": (b"a", NOW + 10),
        b"b": (b"b", NOW + 20),
        b"c": (b"c", NOW + 30),
    }
    clock.now = NOW + 10
    assert subkeys_of(storage.get(KEY)) == {b"b": (b"b", NOW + 20), b"c": (b"c", NOW + 30)}
    assert storage.num_records == 2
    clock.now = NOW + 25
    assert subkeys_of(storage.get(KEY)) == {b"c": (b"c", NOW + 30)}
    clock.now = NOW + 30
    assert storage.get(KEY) is None and storage.num_records == 0 and len(storage) == 0


def test_refreshing_a_subkey_moves_its_expiration():
    storage, clock = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 20, subkey=b"b")
    assert storage.store(KEY, b"a2", NOW + 40, subkey=b"a")
    clock.now = NOW + 25
    assert subkeys_of(storage.get(KEY)) == {b"a": (b"a2", NOW + 40)}


def test_dictionary_handed_out_is_a_copy_that_expires_on_the_same_clock():
    storage, clock = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 20, subkey=b"b")
    copy = storage.get(KEY).value
    copy.store(b"z", b"z", NOW + 50)
    assert b"z" not in subkeys_of(storage.get(KEY))
    clock.now = NOW + 15
    assert list(copy.keys()) == [b"b", b"z"]
    assert len(copy) == 2 and b"a" not in copy


def test_freeze_pauses_expiry_until_the_block_ends():
    storage, clock = make()
    storage.store(KEY, b"v", NOW + 10)
    storage.store(OTHER, b"a", NOW + 10, subkey=b"a")
    storage.store(OTHER, b"b", NOW + 30, subkey=b"b")
    with storage.freeze() as frozen:
        assert frozen is storage
        clock.now = NOW + 20
        assert storage.get(KEY) == (b"v", NOW + 10)
        assert len(storage) == 2 and storage.num_records == 3
        with storage.freeze():  # nested
            pass
        assert KEY in storage
        # dictionaries read in the block show the same frozen view
        record = storage.get(OTHER)
        assert subkeys_of(record) == {b"a": (b"a", NOW + 10), b"b": (b"b", NOW + 30)}
        assert [dict(v.value.items()) for k, v in storage.items() if k == OTHER] == [
            {b"a": (b"a", NOW + 10), b"b": (b"b", NOW + 30)}
        ]
        # already expired stores are still refused
        assert not storage.store(KEY, b"late", NOW + 15)
    assert storage.get(KEY) is None
    assert subkeys_of(storage.get(OTHER)) == {b"b": (b"b", NOW + 30)}
    assert subkeys_of(record) == {b"b": (b"b", NOW + 30)}  # the old copy resumes expiring
    assert storage.num_records == 1


def test_freeze_does_not_show_records_that_expired_before_it_began():
    storage, clock = make()
    storage.store(KEY, b"v", NOW + 10)
    clock.now = NOW + 10  # nothing touched the storage since the expiry
    with storage.freeze():
        assert storage.get(KEY) is None
        assert storage.num_records == 0


def test_clear_inside_freeze_leaves_expiry_working_after_the_block():
    storage, clock = make()
    with storage.freeze():
        storage.clear()
    storage.store(KEY, b"v", NOW + 10)
    clock.now = NOW + 10
    assert storage.get(KEY) is None


def test_eviction_still_applies_while_frozen():
    storage, clock = make(maxsize=1)
    storage.store(KEY, b"v", NOW + 10)
    with storage.freeze():
        assert storage.store(OTHER, b"w", NOW + 20)
        assert KEY not in storage and OTHER in storage


def test_remove_outdated_drops_expired_records_now():
    storage, clock = make()
    storage.store(KEY, b"v", NOW + 10)
    clock.now = NOW + 10
    storage.remove_outdated()
    assert storage.num_records == 0 and storage.get(KEY) is None


# --- tombstones ------------------------------------------------------------------------


def test_tombstone_hides_the_value_and_blocks_an_older_resurrection():
    storage, clock = make()
    storage.store(KEY, b"v", NOW + 10)
    assert storage.store(KEY, None, NOW + 20)
    assert storage.get(KEY) is None and KEY not in storage and len(storage) == 0
    assert storage.get(KEY, include_tombstones=True) == (None, NOW + 20)
    assert storage.num_records == 1  # the tombstone is a record
    assert not storage.store(KEY, b"v", NOW + 15)  # an older store arrives late
    assert storage.get(KEY) is None
    assert storage.items() == [] and storage.keys() == []
    assert storage.items(include_tombstones=True) == [(KEY, (None, NOW + 20))]
    assert storage.keys(include_tombstones=True) == [KEY]
    assert storage.store(KEY, b"newer", NOW + 25)  # a newer store wins over the delete
    assert storage.get(KEY) == (b"newer", NOW + 25) and len(storage) == 1


def test_tombstone_older_than_the_value_is_refused():
    storage, _ = make()
    storage.store(KEY, b"v", NOW + 20)
    assert not storage.store(KEY, None, NOW + 10)
    assert storage.get(KEY) == (b"v", NOW + 20)


def test_tombstone_expires_and_then_older_stores_are_welcome_again():
    storage, clock = make()
    storage.store(KEY, None, NOW + 10)
    clock.now = NOW + 10
    assert storage.get(KEY, include_tombstones=True) is None
    assert storage.store(KEY, b"v", NOW + 11)


def test_subkey_tombstones_hide_subkeys_and_an_all_deleted_dictionary_reads_absent():
    storage, _ = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 10, subkey=b"b")
    assert storage.store(KEY, None, NOW + 20, subkey=b"a")
    assert subkeys_of(storage.get(KEY)) == {b"b": (b"b", NOW + 10)}
    assert storage.get(KEY).expiration_time == NOW + 10  # tombstones excluded
    assert not storage.store(KEY, b"a-old", NOW + 15, subkey=b"a")
    assert storage.store(KEY, None, NOW + 20, subkey=b"b")
    assert storage.get(KEY) is None and KEY not in storage and len(storage) == 0
    shown = storage.get(KEY, include_tombstones=True)
    assert subkeys_of(shown) == {b"a": (None, NOW + 20), b"b": (None, NOW + 20)}
    assert shown.expiration_time == NOW + 20
    assert storage.store(KEY, b"back", NOW + 30, subkey=b"b")
    assert subkeys_of(storage.get(KEY)) == {b"b": (b"back", NOW + 30)}
    assert len(storage) == 1


def test_dictionary_reads_absent_once_its_last_live_subkey_expires_among_tombstones():
    storage, clock = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, None, NOW + 20, subkey=b"b")
    assert KEY in storage and len(storage) == 1
    clock.now = NOW + 10
    assert storage.get(KEY) is None and KEY not in storage and len(storage) == 0
    assert storage.items() == [] and storage.keys() == []
    assert subkeys_of(storage.get(KEY, include_tombstones=True)) == {b"b": (None, NOW + 20)}


def test_plain_tombstone_newer_than_every_subkey_deletes_the_dictionary():
    storage, _ = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    assert storage.store(KEY, None, NOW + 10)
    assert storage.get(KEY) is None
    assert storage.get(KEY, include_tombstones=True) == (None, NOW + 10)
    assert not storage.store(KEY, b"a", NOW + 9, subkey=b"b")


# --- plain <-> dictionary --------------------------------------------------------------


def test_subkey_newer_than_the_plain_value_turns_the_key_into_a_dictionary():
    storage, _ = make()
    storage.store(KEY, b"plain", NOW + 10)
    assert not storage.store(KEY, b"s", NOW + 5, subkey=b"s")
    assert storage.store(KEY, b"s", NOW + 15, subkey=b"s")
    assert subkeys_of(storage.get(KEY)) == {b"s": (b"s", NOW + 15)}
    # the old plain record still sets the floor: older subkeys stay refused
    assert not storage.store(KEY, b"t", NOW + 8, subkey=b"t")
    assert not storage.store(KEY, b"t", NOW + 10, subkey=b"t")
    assert storage.store(KEY, b"t", NOW + 11, subkey=b"t")
    assert storage.num_records == 2


def test_plain_record_at_least_as_new_as_every_subkey_replaces_the_dictionary():
    storage, _ = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 20, subkey=b"b")
    assert storage.store(KEY, b"plain", NOW + 20)
    assert storage.get(KEY) == (b"plain", NOW + 20)
    assert storage.num_records == 1
    assert not storage.store(KEY, b"c", NOW + 19, subkey=b"c")


def test_plain_record_older_than_the_dictionary_drops_older_subkeys_and_sets_a_floor():
    storage, _ = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 30, subkey=b"b")
    storage.store(KEY, b"c", NOW + 15, subkey=b"c")
    assert not storage.store(KEY, b"plain", NOW + 15)  # not stored ...
    # ... yet it supersedes the subkeys it is newer than (a, and c at a tie)
    assert subkeys_of(storage.get(KEY)) == {b"b": (b"b", NOW + 30)}
    assert storage.num_records == 1
    assert not storage.store(KEY, b"a", NOW + 12, subkey=b"a")
    assert not storage.store(KEY, b"d", NOW + 15, subkey=b"d")
    assert storage.store(KEY, b"d", NOW + 16, subkey=b"d")
    assert not storage.store(KEY, b"plain", NOW + 12)  # an older floor changes nothing
    assert set(subkeys_of(storage.get(KEY))) == {b"b", b"d"}


# --- limits ----------------------------------------------------------------------------


def test_value_size_limit_names_the_key():
    storage, _ = make(max_value_bytes=8)
    assert storage.store(KEY, b"x" * 8, NOW + 10)
    with pytest.raises(StorageLimitExceeded, match="max_value_bytes=8") as info:
        storage.store(OTHER, b"x" * 9, NOW + 10)
    assert repr(OTHER) in str(info.value) and "9 bytes" in str(info.value)
    with pytest.raises(StorageLimitExceeded):
        storage.store(OTHER, b"x" * 9, NOW + 10, subkey=b"s")
    assert storage.store(OTHER, None, NOW + 10)  # a tombstone has no size
    assert storage.get(KEY) == (b"x" * 8, NOW + 10)
    assert isinstance(info.value, SwarmgradError) and isinstance(info.value, ValidationError)


def test_subkey_size_limit_names_the_key():
    storage, _ = make(max_key_bytes=4)
    assert storage.store(KEY, b"v", NOW + 10, subkey=b"1234")
    with pytest.raises(StorageLimitExceeded, match="max_key_bytes=4") as info:
        storage.store(KEY, b"v", NOW + 10, subkey=b"12345")
    assert repr(KEY) in str(info.value)
    assert set(subkeys_of(storage.get(KEY))) == {b"1234"}


def test_expiration_ahead_limit_names_the_key():
    storage, _ = make(max_expiration_ahead=60)
    assert storage.store(KEY, b"v", NOW + 60)
    with pytest.raises(StorageLimitExceeded, match="max_expiration_ahead=60") as info:
        storage.store(OTHER, b"v", NOW + 61)
    assert repr(OTHER) in str(info.value)
    with pytest.raises(StorageLimitExceeded):
        storage.store(OTHER, b"v", math.inf, subkey=b"s")
    assert OTHER not in storage


def test_records_per_source_limit_names_the_peer_and_the_key():
    storage, _ = make(max_records_per_source=2)
    p, q = PEERS[0], PEERS[1]
    assert storage.store(DHTID(1), b"v", NOW + 10, source=p)
    assert storage.store(DHTID(2), b"v", NOW + 10, subkey=b"s", source=p)
    with pytest.raises(StorageLimitExceeded, match="max_records_per_source=2") as info:
        storage.store(DHTID(3), b"v", NOW + 10, source=p)
    assert str(p) in str(info.value) and repr(DHTID(3)) in str(info.value)
    with pytest.raises(StorageLimitExceeded):
        storage.store(DHTID(2), b"v", NOW + 10, subkey=b"t", source=p)
    assert storage.records_by(p) == 2
    assert storage.store(DHTID(3), b"v", NOW + 10, source=q)  # other peers are not limited
    assert storage.store(DHTID(4), b"v", NOW + 10)  # nor are the node's own records
    # a peer at its limit may still refresh its own records
    assert storage.store(DHTID(1), b"v2", NOW + 20, source=p)
    assert storage.store(DHTID(2), b"v2", NOW + 20, subkey=b"s", source=p)
    # ... but not take over another peer's record
    with pytest.raises(StorageLimitExceeded):
        storage.store(DHTID(3), b"v2", NOW + 20, source=p)
    assert storage.get(DHTID(3)) == (b"v", NOW + 10)


def test_peer_at_its_limit_may_turn_its_own_plain_record_into_a_dictionary_and_back():
    storage, _ = make(max_records_per_source=1)
    p = PEERS[0]
    assert storage.store(KEY, b"plain", NOW + 10, source=p)
    assert storage.store(KEY, b"sub", NOW + 20, subkey=b"s", source=p)
    assert storage.records_by(p) == 1
    assert storage.store(KEY, b"plain", NOW + 30, source=p)
    assert storage.records_by(p) == 1
    with pytest.raises(StorageLimitExceeded):
        storage.store(OTHER, b"v", NOW + 30, source=p)


def test_per_source_limit_is_not_checked_for_refused_stores():
    storage, _ = make(max_records_per_source=1)
    storage.store(DHTID(1), b"v", NOW + 10, source=PEERS[0])
    storage.store(DHTID(2), b"v", NOW + 20, source=PEERS[1])
    assert not storage.store(DHTID(2), b"older", NOW + 15, source=PEERS[0])


def test_per_source_counts_go_down_when_records_expire_or_are_replaced():
    storage, clock = make(max_records_per_source=2)
    p, q = PEERS[0], PEERS[1]
    storage.store(DHTID(1), b"v", NOW + 10, source=p)
    storage.store(DHTID(2), b"v", NOW + 30, source=p)
    assert storage.records_by(p) == 2
    clock.now = NOW + 10  # DHTID(1) expires
    assert storage.records_by(p) == 1
    assert storage.store(DHTID(3), b"v", NOW + 30, subkey=b"s", source=p)
    assert storage.store(DHTID(2), b"v", NOW + 40, source=q)  # q replaces p's record
    assert storage.records_by(p) == 1 and storage.records_by(q) == 1
    assert storage.store(DHTID(3), b"v", NOW + 40, subkey=b"s", source=q)  # and the subkey
    assert storage.records_by(p) == 0 and storage.records_by(q) == 2
    assert storage.store(DHTID(3), b"v", NOW + 50, subkey=b"t", source=p)
    assert storage.store(DHTID(3), b"plain", NOW + 60, source=p)  # replaces 2 subkeys
    assert storage.records_by(p) == 1 and storage.records_by(q) == 1
    clock.now = NOW + 60
    assert storage.records_by(p) == 0 and storage.records_by(q) == 0


def test_plain_record_superseding_subkeys_releases_their_sources():
    storage, _ = make(max_records_per_source=1)
    storage.store(KEY, b"a", NOW + 10, subkey=b"a", source=PEERS[0])
    storage.store(KEY, b"b", NOW + 30, subkey=b"b", source=PEERS[1])
    assert not storage.store(KEY, b"plain", NOW + 20)
    assert storage.records_by(PEERS[0]) == 0 and storage.records_by(PEERS[1]) == 1


def test_limits_must_be_none_or_non_negative_and_types_are_checked():
    with pytest.raises(ValidationError, match="maxsize"):
        DHTLocalStorage(maxsize=-1)
    with pytest.raises(ValidationError, match="max_records_per_source"):
        DHTLocalStorage(max_records_per_source=-1)
    with pytest.raises(ValidationError, match="max_expiration_ahead"):
        DHTLocalStorage(max_expiration_ahead=math.nan)
    storage, _ = make(max_value_bytes=None, max_key_bytes=None, max_expiration_ahead=None)
    assert storage.store(KEY, b"x" * 5_000_000, math.inf, subkey=b"k" * 10_000)
    with pytest.raises(ValidationError, match="DHTIDs"):
        storage.store(int(KEY), b"v", NOW + 10)
    with pytest.raises(ValidationError, match="bytes or None"):
        storage.store(KEY, "text", NOW + 10)
    with pytest.raises(ValidationError, match="subkey"):
        storage.store(KEY, b"v", NOW + 10, subkey="s")
    with pytest.raises(ValidationError, match="PeerID"):
        storage.store(KEY, b"v", NOW + 10, source="peer")


# --- maxsize ---------------------------------------------------------------------------


def test_maxsize_evicts_the_soonest_expiring_record():
    storage, _ = make(maxsize=3)
    storage.store(DHTID(1), b"v", NOW + 30)
    storage.store(DHTID(2), b"v", NOW + 10)
    storage.store(DHTID(3), b"v", NOW + 20)
    assert storage.store(DHTID(4), b"v", NOW + 40)
    assert storage.keys() == [DHTID(1), DHTID(3), DHTID(4)]
    assert storage.num_records == 3
    # a record expiring sooner than all of a full storage is refused, and so is a tie
    assert not storage.store(DHTID(5), b"v", NOW + 5)
    assert not storage.store(DHTID(5), b"v", NOW + 20)
    assert DHTID(5) not in storage
    # replacing a record in place needs no room
    assert storage.store(DHTID(3), b"w", NOW + 21)
    assert storage.num_records == 3


def test_maxsize_counts_subkeys_and_tombstones_and_evicts_single_subkeys():
    storage, _ = make(maxsize=3)
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 30, subkey=b"b")
    storage.store(OTHER, None, NOW + 20)
    assert storage.store(KEY, b"c", NOW + 40, subkey=b"c")
    assert set(subkeys_of(storage.get(KEY))) == {b"b", b"c"}
    assert storage.store(DHTID(7), b"v", NOW + 50)
    assert storage.get(OTHER, include_tombstones=True) is None
    assert storage.num_records == 3


def test_maxsize_zero_stores_nothing():
    storage, _ = make(maxsize=0)
    assert not storage.store(KEY, b"v", NOW + 10)
    assert not storage.store(KEY, b"v", NOW + 10, subkey=b"s")
    assert storage.num_records == 0


def test_eviction_releases_the_source_count():
    storage, _ = make(maxsize=1, max_records_per_source=5)
    storage.store(KEY, b"v", NOW + 10, source=PEERS[0])
    storage.store(OTHER, b"v", NOW + 20, source=PEERS[1])
    assert storage.records_by(PEERS[0]) == 0 and storage.records_by(PEERS[1]) == 1


# --- top -------------------------------------------------------------------------------


def test_top_returns_the_soonest_expiring_record_tombstones_and_subkeys_included():
    storage, clock = make()
    assert storage.top() is None
    storage.store(DHTID(1), b"v", NOW + 30)
    storage.store(DHTID(2), None, NOW + 20)
    storage.store(DHTID(3), b"a", NOW + 40, subkey=b"a")
    storage.store(DHTID(3), b"b", NOW + 10, subkey=b"b")
    key_id, (value, expiration_time) = storage.top()
    assert key_id == DHTID(3) and expiration_time == NOW + 10
    assert isinstance(value, DictionaryDHTValue)
    assert dict(value.items()) == {b"b": (b"b", NOW + 10)}
    clock.now = NOW + 10
    assert storage.top() == (DHTID(2), (None, NOW + 20))
    clock.now = NOW + 20
    assert storage.top() == (DHTID(1), (b"v", NOW + 30))
    storage.store(DHTID(1), b"w", NOW + 50)  # refreshed: no longer the soonest
    top_key, (top_value, top_expiration) = storage.top()
    assert top_key == DHTID(3) and top_expiration == NOW + 40


def test_top_follows_a_refreshed_subkey():
    storage, _ = make()
    storage.store(KEY, b"a", NOW + 10, subkey=b"a")
    storage.store(KEY, b"b", NOW + 20, subkey=b"b")
    storage.store(OTHER, b"v", NOW + 15)
    storage.store(KEY, b"a", NOW + 30, subkey=b"a")
    assert storage.top() == (OTHER, (b"v", NOW + 15))


def test_repr_mentions_counts():
    storage, _ = make(maxsize=9)
    storage.store(KEY, b"v", NOW + 10)
    assert repr(storage) == "DHTLocalStorage(1 keys, 1 records, maxsize=9)"


# --- DictionaryDHTValue on its own ------------------------------------------------------


def test_dictionary_value_keeps_the_later_record_per_subkey_and_expires_on_its_clock():
    clock = FakeClock()
    value = DictionaryDHTValue(clock)
    assert value.latest_expiration_time == -math.inf
    assert value.store(b"a", b"1", NOW + 10)
    assert value.store(b"a", b"2", NOW + 20)
    assert not value.store(b"a", b"3", NOW + 15)
    assert not value.store(b"a", b"4", NOW + 20)
    assert value.store(b"a", b"2", NOW + 20)
    assert not value.store(b"b", b"x", NOW)
    assert not value.store(b"b", b"x", math.nan)
    assert value.store(b"b", b"x", NOW + 5)
    assert value.get(b"a") == (b"2", NOW + 20)
    assert value.latest_expiration_time == NOW + 20
    assert sorted(value) == [b"a", b"b"] and b"b" in value and len(value) == 2
    clock.now = NOW + 5
    assert value.get(b"b") is None and value.items() == [(b"a", (b"2", NOW + 20))]
    clock.now = NOW + 20
    assert len(value) == 0 and value.latest_expiration_time == -math.inf
    other = DictionaryDHTValue(clock)
    assert value == other and value != {} and "DictionaryDHTValue({})" == repr(value)


@given(st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), st.integers(1, 30)), max_size=60))
@DETERMINISTIC
def test_dictionary_value_heap_stays_exact_under_many_refreshes(stores):
    clock = FakeClock()
    value = DictionaryDHTValue(clock)
    best: dict[bytes, float] = {}
    for subkey, offset in stores:
        value.store(subkey, b"v", NOW + offset)
        best[subkey] = max(best.get(subkey, -math.inf), NOW + offset)
    for step in range(0, 32, 3):
        clock.now = NOW + step
        live = {s: e for s, e in best.items() if e > clock.now}
        assert {s: r.expiration_time for s, r in value.items()} == live
        assert value.latest_expiration_time == max(live.values(), default=-math.inf)


# --- a model of the rules, checked on random runs ------------------------------------------


class Model:
    """The module docstring's rules, written plainly: no heaps, no lazy expiry.

    A key maps to ``("plain", (value, expiration, source))`` or to
    ``("dict", {subkey: (value, expiration, source)}, floor)``.
    """

    def __init__(self, maxsize, max_records_per_source):
        self.maxsize = maxsize
        self.max_records_per_source = max_records_per_source
        self.keys: dict = {}

    def records(self):
        """(expiration, key, subkey or None, value, source) of every record."""
        for key_id, state in self.keys.items():
            if state[0] == "plain":
                value, expiration, source = state[1]
                yield expiration, key_id, None, value, source
            else:
                for subkey, (value, expiration, source) in state[1].items():
                    yield expiration, key_id, subkey, value, source

    def purge(self, now):
        for key_id in list(self.keys):
            state = self.keys[key_id]
            if state[0] == "plain":
                if state[1][1] <= now:
                    del self.keys[key_id]
            else:
                live = {s: r for s, r in state[1].items() if r[1] > now}
                if live:
                    self.keys[key_id] = ("dict", live, state[2])
                else:
                    del self.keys[key_id]

    def held(self, source):
        return sum(1 for r in self.records() if r[4] == source)

    def check_source(self, source, freed):
        limit = self.max_records_per_source
        if limit is not None and source is not None and self.held(source) - freed >= limit:
            raise StorageLimitExceeded("model")

    def has_room(self, expiration):
        if self.maxsize is None:
            return True
        records = list(self.records())
        if len(records) < self.maxsize:
            return True
        return bool(records) and expiration > min(r[0] for r in records)

    def evict(self):
        while self.maxsize is not None and len(list(self.records())) > self.maxsize:
            _, key_id, subkey, _, _ = min(self.records(), key=lambda r: r[0])
            state = self.keys[key_id]
            if subkey is None:
                del self.keys[key_id]
            else:
                del state[1][subkey]
                if not state[1]:
                    del self.keys[key_id]

    def store(self, now, key_id, value, expiration, subkey, source):
        if expiration <= now:
            return False
        self.purge(now)
        state = self.keys.get(key_id)
        record = (value, expiration, source)
        if state is None:
            self.check_source(source, 0)
            if not self.has_room(expiration):
                return False
            if subkey is None:
                self.keys[key_id] = ("plain", record)
            else:
                self.keys[key_id] = ("dict", {subkey: record}, -math.inf)
            self.evict()
            return True
        if state[0] == "plain":
            old = state[1]
            if subkey is None:
                if expiration != old[1]:
                    if expiration < old[1]:
                        return False
                    self.check_source(source, int(old[2] == source))
                    self.keys[key_id] = ("plain", record)
                    return True
                return value == old[0]
            if expiration <= old[1]:
                return False
            self.check_source(source, int(old[2] == source))
            self.keys[key_id] = ("dict", {subkey: record}, old[1])
            return True
        subkeys, floor = state[1], state[2]
        if subkey is None:
            if expiration >= max(r[1] for r in subkeys.values()):
                self.check_source(source, sum(1 for r in subkeys.values() if r[2] == source))
                self.keys[key_id] = ("plain", record)
                return True
            kept = {s: r for s, r in subkeys.items() if r[1] > expiration}
            self.keys[key_id] = ("dict", kept, max(floor, expiration))
            return False
        if expiration <= floor:
            return False
        old = subkeys.get(subkey)
        if old is not None:
            if expiration < old[1]:
                return False
            if expiration == old[1]:
                return value == old[0]
            self.check_source(source, int(old[2] == source))
            subkeys[subkey] = record
            return True
        self.check_source(source, 0)
        if not self.has_room(expiration):
            return False
        subkeys[subkey] = record
        self.evict()
        return True

    def read(self, key_id, include_tombstones):
        state = self.keys.get(key_id)
        if state is None:
            return None
        if state[0] == "plain":
            value, expiration, _ = state[1]
            if value is None and not include_tombstones:
                return None
            return "plain", value, expiration
        shown = {
            s: ValueWithExpiration(v, e)
            for s, (v, e, _) in state[1].items()
            if include_tombstones or v is not None
        }
        if not shown:
            return None
        return "dict", sorted(shown.items()), max(r.expiration_time for r in shown.values())


MODEL_KEYS = [DHTID(1), DHTID(2**159 + 3)]


class StorageMachine(RuleBasedStateMachine):
    """Random stores and clock steps on a few keys, compared with the model after each
    step. With maxsize, expirations are made distinct so eviction has one answer."""

    @initialize(
        maxsize=st.one_of(st.none(), st.integers(0, 6)),
        max_records_per_source=st.one_of(st.none(), st.integers(0, 4)),
    )
    def create(self, maxsize, max_records_per_source):
        self.clock = FakeClock()
        self.storage = DHTLocalStorage(
            maxsize, max_records_per_source=max_records_per_source, time_fn=self.clock
        )
        self.model = Model(maxsize, max_records_per_source)
        self.distinct = maxsize is not None
        self.counter = 0

    @rule(
        key_index=st.integers(0, len(MODEL_KEYS) - 1),
        subkey=st.sampled_from([None, b"a", b"b"]),
        value=st.sampled_from([None, b"x", b"y"]),
        offset=st.integers(-2, 12),
        source_index=st.one_of(st.none(), st.integers(0, len(PEERS) - 1)),
    )
    def store(self, key_index, subkey, value, offset, source_index):
        key_id = MODEL_KEYS[key_index]
        expiration = self.clock.now + offset
        if self.distinct:
            self.counter += 1
            expiration += self.counter / 1024  # exact in binary, unique per run
        source = None if source_index is None else PEERS[source_index]
        try:
            expected = self.model.store(self.clock.now, key_id, value, expiration, subkey, source)
        except StorageLimitExceeded:
            with pytest.raises(StorageLimitExceeded):
                self.storage.store(key_id, value, expiration, subkey=subkey, source=source)
        else:
            got = self.storage.store(key_id, value, expiration, subkey=subkey, source=source)
            assert got == expected

    @rule(step=st.sampled_from([0.5, 1, 2, 5]))
    def advance(self, step):
        self.clock.now += step
        self.model.purge(self.clock.now)

    @invariant()
    def matches_the_model(self):
        storage, model = self.storage, self.model
        model.purge(self.clock.now)
        for include_tombstones in (False, True):
            expected = {k: model.read(k, include_tombstones) for k in MODEL_KEYS}
            expected = {k: v for k, v in expected.items() if v is not None}
            got = dict(storage.items(include_tombstones=include_tombstones))
            assert {k: snapshot(v) for k, v in got.items()} == expected
            for key_id in MODEL_KEYS:
                assert snapshot(storage.get(key_id, include_tombstones=include_tombstones)) == (
                    expected.get(key_id)
                )
        visible = [k for k in MODEL_KEYS if model.read(k, False) is not None]
        assert len(storage) == len(visible)
        assert sorted(storage.keys()) == sorted(visible)
        assert all((k in storage) == (k in visible) for k in MODEL_KEYS)
        records = list(model.records())
        assert storage.num_records == len(records)
        if model.maxsize is not None:
            assert storage.num_records <= model.maxsize
        for source in PEERS:
            assert storage.records_by(source) == model.held(source)
        top = storage.top()
        if not records:
            assert top is None
        else:
            soonest = min(records, key=lambda r: r[0])
            assert top[1].expiration_time == soonest[0]
            if self.distinct:
                assert top[0] == soonest[1]
                if soonest[2] is None:
                    assert top[1].value == soonest[3]
                else:
                    assert dict(top[1].value.items()) == {soonest[2]: (soonest[3], soonest[0])}


StorageMachine.TestCase.settings = settings(DETERMINISTIC, max_examples=250, stateful_step_count=50)
test_storage_matches_a_plain_model_of_the_rules = StorageMachine.TestCase
