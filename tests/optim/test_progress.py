"""Training progress: how the swarm's epoch, samples, ETA and refresh period are derived
from the peers' records (honest and lying ones), and the strict schema of a record."""

from __future__ import annotations

import math
import random

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.schema import SchemaValidator
from swarmgrad.dht.validation import NO_SUBKEY, DHTRecord, serialize
from swarmgrad.net.identity import Identity
from swarmgrad.optim.progress import (
    MAX_EPOCH,
    MAX_SAMPLES,
    LocalTrainingProgress,
    ProgressRules,
    TrainingProgressSchema,
    aggregate_progress,
)

NOW = 10_000.0
LONG_AGO = NOW - 1_000.0  # the epoch began long ago: honest claims are all plausible
LOCAL = b"local"
RULES = ProgressRules()


def record(
    epoch: int = 0,
    samples: int = 0,
    rate: float = 1.0,
    time: float = NOW,
    client: bool = False,
    peer_id: bytes = b"peer",
) -> LocalTrainingProgress:
    return LocalTrainingProgress(
        peer_id=peer_id,
        epoch=epoch,
        samples_accumulated=samples,
        samples_per_second=rate,
        time=time,
        client_mode=client,
    )


def aggregate(
    records,
    local=None,
    *,
    target=1_000,
    started=LONG_AGO,
    distrusted=(),
    observing_since=None,
    read_failed=False,
    **rules,
):
    return aggregate_progress(
        records,
        local_key=LOCAL,
        local=local if local is not None else record(),
        target_batch_size=target,
        now=NOW,
        epoch_started_at=started,
        distrusted=frozenset(distrusted),
        rules=ProgressRules(**rules),
        observing_since=observing_since,
        read_failed=read_failed,
    )


def lower_median(values):
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


# ---------------------------------------------------------------------- honest swarms


def test_samples_are_summed_over_the_peers_at_the_global_epoch():
    records = {
        b"a": record(epoch=3, samples=20),
        b"b": record(epoch=3, samples=30),
        b"old": record(epoch=2, samples=500),  # still finishing the previous epoch
    }
    progress = aggregate(records, local=record(epoch=3, samples=10))
    assert progress.epoch == 3
    assert progress.samples_accumulated == 60
    assert progress.target_batch_size == 1_000
    assert progress.num_peers == 4 and progress.num_clients == 0


def test_a_peer_ahead_sets_the_epoch_and_only_samples_of_that_epoch_count():
    records = {b"a": record(epoch=4, samples=5), b"b": record(epoch=3, samples=70)}
    progress = aggregate(records, local=record(epoch=3, samples=10))
    assert progress.epoch == 4
    assert progress.samples_accumulated == 5


def test_clients_are_counted_as_clients_and_do_not_raise_the_epoch():
    records = {
        b"client_ahead": record(epoch=9, samples=400, client=True),
        b"client_here": record(epoch=3, samples=40, client=True),
        b"peer": record(epoch=3, samples=7),
    }
    progress = aggregate(records, local=record(epoch=3, samples=10))
    assert progress.epoch == 3  # a client's epoch cannot be caught up with: no state
    assert progress.samples_accumulated == 10 + 40 + 7
    assert progress.num_peers == 4 and progress.num_clients == 2


def test_a_local_client_counts_itself_as_a_client_and_keeps_its_own_epoch():
    progress = aggregate({b"peer": record(epoch=2)}, local=record(epoch=5, client=True))
    assert progress.epoch == 5
    assert progress.num_peers == 2 and progress.num_clients == 1


def test_our_own_progress_replaces_what_the_dht_still_holds_for_us():
    records = {LOCAL: record(epoch=7, samples=999), b"a": record(epoch=1, samples=3)}
    progress = aggregate(records, local=record(epoch=1, samples=4))
    assert progress.epoch == 1
    assert progress.samples_accumulated == 7
    assert progress.num_peers == 2


def test_eta_is_what_remains_of_the_target_over_the_swarms_rate():
    local = record(samples=10, rate=2.0)
    records = {b"a": record(samples=30, rate=3.0)}
    progress = aggregate(records, local=local, target=100)
    assert progress.eta_next_epoch == pytest.approx(NOW + 60 / 5)


def test_eta_extrapolates_old_records_by_their_rate_at_most_max_extrapolation():
    local = record(samples=0, rate=2.0)
    ten_seconds_old = {b"a": record(samples=30, rate=3.0, time=NOW - 10)}
    progress = aggregate(ten_seconds_old, local=local, target=100)
    # the peer has done about 30 + 10 * 3 samples by now
    assert progress.samples_accumulated == 30
    assert progress.eta_next_epoch == pytest.approx(NOW + (100 - 60) / 5)

    ancient = {b"a": record(samples=0, rate=1.0, time=NOW - 500)}
    progress = aggregate(ancient, local=record(rate=1.0), target=1_000)
    assert progress.eta_next_epoch == pytest.approx(NOW + (1_000 - 60) / 2)


def test_eta_is_now_once_the_target_is_reached_and_infinite_without_any_rate():
    reached = aggregate({b"a": record(samples=600)}, local=record(samples=500), target=1_000)
    assert reached.samples_accumulated == 1_100
    assert reached.eta_next_epoch == NOW

    idle = aggregate({b"a": record(rate=0.0)}, local=record(rate=0.0))
    assert idle.eta_next_epoch == math.inf
    # peers, none with a speed yet: they are starting, and their pace is news soon
    assert idle.next_fetch_time == NOW + RULES.min_refresh_period


def test_a_lonely_peer_reads_again_before_newcomers_could_finish_the_epoch_unseen():
    # alone, eta 990 s: 990 * 1 / (1 + 3), clipped to the longest period
    progress = aggregate({}, local=record(samples=10, rate=1.0))
    assert progress.num_peers == 1
    assert progress.next_fetch_time == NOW + RULES.max_refresh_period
    # eta 8 s: read again after 2 s
    progress = aggregate({}, local=record(samples=10, rate=1.0), target=18)
    assert progress.next_fetch_time == pytest.approx(NOW + 2.0)
    # no speed yet (just started): the others' records may be a moment away
    progress = aggregate({}, local=record(samples=0, rate=0.0))
    assert progress.next_fetch_time == NOW + RULES.min_refresh_period


def test_a_young_estimate_is_not_trusted_beyond_half_the_time_watched():
    """Lab peers read an ETA of 38 s four seconds after starting (the speeds were still
    start-up lower bounds) and planned their next read 10 s ahead; epoch 0 ended 3 s
    later without them."""
    peers = {b"a": record(rate=10.0), b"b": record(rate=10.0)}
    unbounded = aggregate(peers, local=record(rate=10.0), target=1_200)  # eta 40 s
    assert unbounded.next_fetch_time == NOW + RULES.max_refresh_period
    young = aggregate(peers, local=record(rate=10.0), target=1_200, observing_since=NOW - 4)
    assert young.next_fetch_time == pytest.approx(NOW + 2.0)
    just_started = aggregate(peers, local=record(rate=10.0), target=1_200, observing_since=NOW)
    assert just_started.next_fetch_time == NOW + RULES.min_refresh_period
    old = aggregate(peers, local=record(rate=10.0), target=1_200, observing_since=NOW - 60)
    assert old.next_fetch_time == unbounded.next_fetch_time


def test_after_a_failed_read_the_next_waits_the_default_refresh_period():
    progress = aggregate({}, local=record(samples=0, rate=0.0), read_failed=True)
    assert progress.next_fetch_time == NOW + RULES.default_refresh_period


def test_refresh_period_shrinks_with_the_eta_within_its_bounds():
    # two peers, eta 5 s: read again after 5 * 2 / max(2 + 3, 2 * 1.2) = 2 s
    local = record(rate=10.0)
    peers = {b"a": record(rate=10.0)}
    progress = aggregate(peers, local=local, target=100)
    assert progress.eta_next_epoch == pytest.approx(NOW + 5)
    assert progress.next_fetch_time == pytest.approx(NOW + 2)

    soon = aggregate(peers, local=record(samples=99, rate=10.0), target=100)
    assert soon.next_fetch_time == NOW + RULES.min_refresh_period
    late = aggregate(peers, local=local, target=100_000)
    assert late.next_fetch_time == NOW + RULES.max_refresh_period


def test_many_peers_expect_a_proportional_drift_in_their_number():
    local = record(rate=1.0)
    peers = {bytes([i]): record(rate=1.0) for i in range(29)}  # 30 peers, 30 samples/s
    progress = aggregate(peers, local=local, target=300, max_refresh_period=100.0)
    # eta 10 s; 30 peers may become max(33, 36) = 36
    assert progress.next_fetch_time == pytest.approx(NOW + 10 * 30 / 36)


# ---------------------------------------------------------------------- records that lie


def test_a_record_from_the_future_beyond_the_skew_is_ignored():
    future = {b"liar": record(epoch=50, samples=900, time=NOW + RULES.max_time_skew + 1)}
    progress = aggregate(future, local=record(epoch=1, samples=10))
    assert progress.epoch == 1
    assert progress.samples_accumulated == 10
    assert progress.num_peers == 1

    within_skew = {b"peer": record(epoch=1, samples=20, time=NOW + RULES.max_time_skew - 1)}
    progress = aggregate(within_skew, local=record(epoch=1, samples=10))
    assert progress.samples_accumulated == 30
    assert progress.num_peers == 2


@pytest.mark.parametrize("liar_rate", [10.0, 1e18, 1e300])
def test_absurd_samples_from_one_peer_cannot_end_the_epoch_early(liar_rate):
    honest_rate, elapsed = 10.0, 5.0
    records = {
        b"a": record(epoch=2, samples=50, rate=honest_rate),
        b"b": record(epoch=2, samples=40, rate=honest_rate),
        b"liar": record(epoch=2, samples=10**18, rate=liar_rate),
    }
    local = record(epoch=2, samples=45, rate=honest_rate)
    progress = aggregate(records, local=local, target=10_000, started=NOW - elapsed)
    # the liar counts at most what rate_clip x the median rate could do since the epoch began
    bound = RULES.rate_clip * honest_rate * (elapsed + RULES.plausibility_grace)
    assert progress.samples_accumulated <= 45 + 50 + 40 + bound
    assert progress.samples_accumulated < 10_000
    # nor can its rate make the end look imminent
    max_rate = 3 * honest_rate + RULES.rate_clip * honest_rate
    assert progress.eta_next_epoch - NOW >= (10_000 - 135 - bound) / max_rate - 1e-9


def test_a_peer_claiming_the_target_at_once_is_limited_by_its_own_rate():
    records = {b"a": record(samples=0, rate=5.0), b"fast": record(samples=500, rate=5.0)}
    progress = aggregate(records, local=record(rate=5.0), target=1_000, started=NOW - 1)
    assert progress.samples_accumulated == 5 * (1 + RULES.plausibility_grace)


def test_an_honest_peer_that_started_long_ago_is_not_clipped():
    records = {b"a": record(samples=900, rate=5.0)}
    progress = aggregate(records, local=record(rate=5.0), target=1_000, started=LONG_AGO)
    assert progress.samples_accumulated == 900


def test_no_single_peer_counts_for_more_than_the_target():
    records = {b"a": record(samples=5_000, rate=100.0)}
    progress = aggregate(records, local=record(rate=100.0), target=1_000)
    assert progress.samples_accumulated == 1_000


def test_a_distrusted_peer_ahead_cannot_move_the_epoch():
    records = {b"liar": record(epoch=1_000, samples=500)}
    trusted = aggregate(records, local=record(epoch=5, samples=10))
    assert trusted.epoch == 1_000  # until shown unbacked, an epoch claim is believed

    capped = aggregate(records, local=record(epoch=5, samples=10), distrusted={b"liar"})
    assert capped.epoch == 5  # else it would keep us one epoch "behind" forever
    assert capped.samples_accumulated == 10  # its samples belong to no epoch we know

    honest_next = {**records, b"peer": record(epoch=6, samples=30)}
    progress = aggregate(honest_next, local=record(epoch=5, samples=10), distrusted={b"liar"})
    assert progress.epoch == 6
    assert progress.samples_accumulated == 30


def test_a_distrusted_peer_at_our_epoch_still_counts_its_samples():
    records = {b"peer": record(epoch=5, samples=30)}
    progress = aggregate(records, local=record(epoch=5), distrusted={b"peer"})
    assert progress.epoch == 5
    assert progress.samples_accumulated == 30


# ---------------------------------------------------------------------- properties

_rates = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
_honest = st.builds(
    record,
    epoch=st.integers(0, 3),
    samples=st.integers(0, 10**6),
    rate=_rates,
    time=st.floats(NOW - 200, NOW),
    client=st.booleans(),
)
_liar = st.builds(
    record,
    epoch=st.integers(0, MAX_EPOCH),
    samples=st.integers(0, MAX_SAMPLES),
    rate=st.floats(min_value=0.0, max_value=1e300, allow_nan=False),
    time=st.floats(-1e12, 1e12),
    client=st.booleans(),
)


def _key(i: int) -> bytes:
    return b"peer%d" % i


@settings(max_examples=300, deadline=None)
@given(
    local=_honest,
    peers=st.lists(_honest, max_size=8),
    liar=st.none() | _liar,
    target=st.integers(1, 10**7),
    elapsed=st.floats(0, 1e4),
)
def test_a_single_liar_adds_at_most_a_bounded_number_of_samples(
    local, peers, liar, target, elapsed
):
    records = {_key(i): r for i, r in enumerate(peers)}
    if liar is not None:
        records[b"liar"] = liar
    progress = aggregate(records, local=local, target=target, started=NOW - elapsed)

    honest = [local, *peers]
    at_epoch = sum(r.samples_accumulated for r in honest if r.epoch == progress.epoch)
    lie = 0.0
    if liar is not None and liar.epoch == progress.epoch and liar.time <= NOW + RULES.max_time_skew:
        positive = sorted(r.samples_per_second for r in honest if r.samples_per_second > 0)
        if positive:  # the liar's rate is clipped at rate_clip x (about) the honest median
            cap = RULES.rate_clip * positive[len(positive) // 2]
            lie = min(float(target), cap * (elapsed + RULES.plausibility_grace))
        else:  # nobody honest has a rate: nothing to compare with, only the target bounds it
            lie = float(target)
    assert progress.samples_accumulated <= at_epoch + lie + 1


@settings(max_examples=300, deadline=None)
@given(
    local=_honest | _liar,
    peers=st.lists(_honest | _liar, max_size=8),
    target=st.integers(1, MAX_SAMPLES),
    elapsed=st.floats(-1e6, 1e6),
)
def test_eta_is_never_in_the_past_and_the_next_read_is_within_the_refresh_bounds(
    local, peers, target, elapsed
):
    records = {_key(i): r for i, r in enumerate(peers)}
    progress = aggregate(records, local=local, target=target, started=NOW - elapsed)
    assert progress.eta_next_epoch >= NOW  # inf allowed, nan not (nan >= NOW is False)
    assert NOW + RULES.min_refresh_period <= progress.next_fetch_time
    assert progress.next_fetch_time <= NOW + RULES.max_refresh_period
    assert 0 <= progress.samples_accumulated
    assert 1 <= progress.num_peers <= len(peers) + 1
    assert 0 <= progress.num_clients <= progress.num_peers


@settings(max_examples=200, deadline=None)
@given(
    local=_honest | _liar,
    peers=st.lists(_honest | _liar, min_size=1, max_size=8),
    seed=st.integers(0, 2**32),
    distrust=st.sets(st.integers(0, 7)),
)
def test_the_result_does_not_depend_on_the_order_of_the_records(local, peers, seed, distrust):
    keys = [_key(i) for i in range(len(peers))]
    distrusted = {_key(i) for i in distrust}
    shuffled = list(zip(keys, peers, strict=True))
    random.Random(seed).shuffle(shuffled)
    first = aggregate(dict(zip(keys, peers, strict=True)), local=local, distrusted=distrusted)
    second = aggregate(dict(shuffled), local=local, distrusted=distrusted)
    assert (first.epoch, first.samples_accumulated, first.num_peers, first.num_clients) == (
        second.epoch,
        second.samples_accumulated,
        second.num_peers,
        second.num_clients,
    )
    # float sums in another order may differ in their last bits, no more
    assert second.eta_next_epoch == pytest.approx(first.eta_next_epoch, rel=1e-9, abs=1e-6)
    assert second.next_fetch_time == pytest.approx(first.next_fetch_time, rel=1e-9, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(
    local=_honest,
    peers=st.lists(_honest, max_size=8),
    rates=st.lists(st.floats(1.0, RULES.rate_clip), min_size=9, max_size=9),
    data=st.data(),
)
def test_an_honest_swarm_of_similar_speeds_counts_every_sample_at_the_global_epoch(
    local, peers, rates, data
):
    """Rates within rate_clip of each other, and no more samples than a rate produced
    since the epoch began: no rule clips anything."""
    elapsed = 1_000.0
    honest = [
        record(
            epoch=r.epoch,
            samples=data.draw(st.integers(0, min(int(rate * elapsed), 10**12))),  # exact floats
            rate=rate,
            time=r.time,
            client=r.client_mode,
        )
        for r, rate in zip([local, *peers], rates, strict=False)
    ]
    local, peers = honest[0], honest[1:]
    target = 10**7
    progress = aggregate(
        {_key(i): r for i, r in enumerate(peers)}, local=local, target=target, started=NOW - elapsed
    )
    epoch = max([local.epoch, *(r.epoch for r in peers if not r.client_mode)])
    assert progress.epoch == epoch
    assert progress.samples_accumulated == sum(
        r.samples_accumulated for r in honest if r.epoch == epoch
    )
    assert progress.num_peers == len(honest)
    assert progress.num_clients == sum(r.client_mode for r in honest)


@settings(max_examples=200, deadline=None)
@given(local=_honest, liars=st.lists(_liar, min_size=1, max_size=5))
def test_distrusted_peers_alone_never_move_the_epoch(local, liars):
    records = {b"liar%d" % i: r for i, r in enumerate(liars)}
    progress = aggregate(records, local=local, distrusted=set(records))
    assert progress.epoch == local.epoch


# ---------------------------------------------------------------------- the record's schema

_GOOD = dict(
    peer_id=b"\x12\x20" + bytes(32),
    epoch=3,
    samples_accumulated=128,
    samples_per_second=12.5,
    time=1_700_000_000.5,
    client_mode=False,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epoch", -1),
        ("epoch", MAX_EPOCH + 1),
        ("epoch", "3"),
        ("epoch", 3.0),
        ("epoch", True),
        ("epoch", None),
        ("samples_accumulated", -1),
        ("samples_accumulated", MAX_SAMPLES + 1),
        ("samples_accumulated", "128"),
        ("samples_per_second", -0.5),
        ("samples_per_second", math.nan),
        ("samples_per_second", math.inf),
        ("samples_per_second", "12.5"),
        ("time", math.nan),
        ("time", math.inf),
        ("time", -math.inf),
        ("time", "now"),
        ("client_mode", 0),
        ("client_mode", 1),
        ("client_mode", "false"),
        ("client_mode", None),
        ("peer_id", "a str, not bytes"),
    ],
)
def test_local_progress_refuses_values_out_of_range_or_of_another_type(field, value):
    with pytest.raises(pydantic.ValidationError):
        LocalTrainingProgress(**{**_GOOD, field: value})
    with pytest.raises(pydantic.ValidationError):
        LocalTrainingProgress.model_validate({**_GOOD, field: value}, strict=True)


def test_local_progress_accepts_its_bounds_and_ignores_unknown_fields():
    edge = LocalTrainingProgress(
        **{**_GOOD, "epoch": MAX_EPOCH, "samples_accumulated": MAX_SAMPLES, "client_mode": True}
    )
    assert edge.epoch == MAX_EPOCH and edge.samples_accumulated == MAX_SAMPLES
    zero = LocalTrainingProgress(**{**_GOOD, "epoch": 0, "samples_per_second": 0.0, "time": -1.0})
    assert zero.samples_per_second == 0.0
    newer = LocalTrainingProgress.model_validate({**_GOOD, "from_a_newer_version": 1}, strict=True)
    assert newer == LocalTrainingProgress(**_GOOD)
    for field in _GOOD:
        with pytest.raises(pydantic.ValidationError):
            LocalTrainingProgress(**{k: v for k, v in _GOOD.items() if k != field})


@settings(max_examples=200, deadline=None)
@given(
    st.builds(
        LocalTrainingProgress,
        peer_id=st.binary(max_size=40),
        epoch=st.integers(0, MAX_EPOCH),
        samples_accumulated=st.integers(0, MAX_SAMPLES),
        samples_per_second=st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
        time=st.floats(allow_nan=False, allow_infinity=False),
        client_mode=st.booleans(),
    )
)
def test_a_record_survives_the_trip_through_the_dht_encoding(progress):
    from swarmgrad.dht.validation import deserialize

    decoded = deserialize(serialize(progress.model_dump()))
    assert LocalTrainingProgress.model_validate(decoded, strict=True) == progress


ALICE = Ed25519SignatureValidator(Identity.from_seed(bytes(range(32))))
RUN = "my_run"


def _dht_record(value, subkey, key=f"{RUN}_progress") -> DHTRecord:
    return DHTRecord(
        serialize(key),
        NO_SUBKEY if subkey is None else serialize(subkey),
        serialize(value),
        NOW + 60,
    )


@pytest.fixture
def schema():
    return SchemaValidator(TrainingProgressSchema, prefix=RUN)


def test_schema_accepts_a_record_under_its_owners_subkey_and_a_goodbye(schema):
    assert schema.validate(_dht_record(_GOOD, ALICE.local_public_key))
    assert schema.validate(_dht_record(_GOOD, b"peer " + ALICE.local_public_key))
    assert schema.validate(_dht_record(None, ALICE.local_public_key))


def test_schema_refuses_a_subkey_without_an_owner_marker(schema):
    assert not schema.validate(_dht_record(_GOOD, b"no marker here"))
    assert not schema.validate(_dht_record(_GOOD, ALICE.local_public_key.decode()))
    assert not schema.validate(_dht_record(None, b"no marker here"))


def test_schema_refuses_malformed_values_and_a_map_without_subkey(schema):
    marker = ALICE.local_public_key
    assert not schema.validate(_dht_record({**_GOOD, "epoch": -1}, marker))
    assert not schema.validate(_dht_record({**_GOOD, "samples_per_second": math.inf}, marker))
    assert not schema.validate(_dht_record({**_GOOD, "client_mode": 1}, marker))
    assert not schema.validate(_dht_record({**_GOOD, "epoch": "3"}, marker))
    assert not schema.validate(_dht_record(7, marker))
    assert not schema.validate(_dht_record({marker: _GOOD}, None))
    # another run's key is none of this schema's business
    assert schema.validate(_dht_record(_GOOD, b"no marker", key="other_run_progress"))
