"""Robust aggregation: the rules' properties (hypothesis), the owner-side reducer, and a
round on the simulated network in which one member scales its tensors by 1000."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.robust.reducer import RobustPartReducer
from swarmgrad.averaging.robust.rules import (
    CenteredClip,
    TrimmedMean,
    cap_weights,
    lower_median,
    sorted_rows,
    sorting_network,
)
from swarmgrad.utils.errors import ProtocolViolation, ValidationError
from tests.averaging.test_averager import simulate, start_swarm
from tests.helpers.peers import numbered_peer_id, shutdown

RULES = [CenteredClip(tau=1.0), TrimmedMean(trim=1)]


def honest_and_outliers(draw, n_honest: int, n_bad: int, dim: int):
    values = st.floats(-1.0, 1.0, allow_nan=False, width=32)
    honest = torch.tensor(draw(st.lists(values, min_size=n_honest * dim, max_size=n_honest * dim)))
    magnitude = draw(st.sampled_from([1e3, 1e6]))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n_bad * dim, max_size=n_bad * dim))
    bad = torch.tensor(signs) * magnitude
    return honest.view(n_honest, dim), bad.view(n_bad, dim)


@st.composite
def swarms(draw):
    n_honest = draw(st.integers(3, 7))
    n_bad = draw(st.integers(0, (n_honest - 1) // 2))
    dim = draw(st.integers(1, 6))
    return honest_and_outliers(draw, n_honest, n_bad, dim)


@given(st.integers(1, 6), st.integers(1, 5), st.floats(-5, 5, allow_nan=False))
def test_equal_inputs_give_that_input(n, dim, value):
    inputs = torch.full((n, dim), value, dtype=torch.float64)
    for rule in RULES:
        result, limited = rule.aggregate(inputs, torch.ones(n))
        assert torch.allclose(result, inputs[0]) and len(limited) == n


@settings(max_examples=60)
@given(swarms(), st.randoms(use_true_random=False))
def test_a_minority_of_huge_outliers_cannot_move_the_result_far(swarm, rng):
    honest, bad = swarm
    inputs = torch.cat([honest, bad]).double()
    weights = torch.ones(inputs.shape[0])
    order = list(range(inputs.shape[0]))
    rng.shuffle(order)
    for rule in RULES:
        result, limited = rule.aggregate(inputs, weights)
        if isinstance(rule, TrimmedMean) and bad.shape[0] <= rule.trim:
            # trimmed out entirely: inside the honest range, coordinate by coordinate
            assert bool((result >= honest.min(0).values - 1e-9).all())
            assert bool((result <= honest.max(0).values + 1e-9).all())
        if isinstance(rule, CenteredClip):
            # each outlier pulls with force tau at most: the center stays within the
            # honest inputs' spread plus tau times the outliers' share, times two
            spread = float((honest.double() - honest.double().mean(0)).norm(dim=1).max())
            share = bad.shape[0] / (honest.shape[0] - bad.shape[0])
            distance = float((result - honest.double().mean(0)).norm())
            assert distance <= 2 * (spread + rule.tau * share) + 1e-6
            assert all(limited[honest.shape[0] :])  # every outlier was clipped
        permuted, _ = rule.aggregate(inputs[order], weights[order])
        assert torch.allclose(permuted, result, atol=1e-9)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_the_sorting_network_sorts_every_zero_one_input(size):
    """The 0-1 principle: a comparator network that sorts all 2^size inputs of zeros and
    ones sorts every input."""
    network = sorting_network(size)
    for bits in range(1 << size):
        wires = [(bits >> i) & 1 for i in range(size)]
        for i, j in network:
            if wires[i] > wires[j]:
                wires[i], wires[j] = wires[j], wires[i]
        assert wires == sorted(wires)


def test_a_sorting_network_needs_a_power_of_two():
    with pytest.raises(ValidationError, match="power of two wires, got 6"):
        sorting_network(6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(1, 50), st.integers(0, 2**31 - 1))
def test_sorted_rows_and_the_median_match_torch(n, dim, seed):
    inputs = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    inputs[:, : dim // 3] = inputs[:, : dim // 3].round()  # ties too
    assert torch.equal(torch.stack(sorted_rows(inputs)), inputs.sort(dim=0).values)
    assert torch.equal(lower_median(inputs), inputs.median(dim=0).values)
    wide = inputs.repeat(1, 1100 // dim + 1)  # past TORCH_MEDIAN_MAX_COLUMNS: the network
    assert torch.equal(lower_median(wide), wide.median(dim=0).values)


def centered_clip_by_definition(inputs, weights, tau, n_iters):
    """The iteration as written in the paper, one pass over all values per step, with
    the rule's stop (a step below 1e-7 of the center's norm)."""
    weights = weights / weights.sum()
    center = inputs.double().median(dim=0).values
    for _ in range(n_iters):
        offsets = inputs.double() - center
        norms = offsets.norm(dim=1)
        step = (weights.double() * (tau / norms.clamp_min(1e-30)).clamp(max=1)) @ offsets
        center = center + step
        if float(step.norm()) <= 1e-7 * max(1.0, float(center.norm())):
            break
    return center


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 9),
    st.integers(1, 400),
    st.sampled_from([1e-6, 1e-3, 1.0, 100.0]),  # spread around 1.0: down to peers in sync
    st.sampled_from([1e-3, 0.1, 10.0]),  # tau relative to the spread
    st.integers(0, 2**31 - 1),
)
def test_centered_clip_in_coefficient_space_equals_the_direct_iteration(n, dim, spread, tau, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = 1.0 + spread * torch.randn(n, dim, generator=gen)
    inputs[: max(0, (n - 1) // 3)] *= -50  # a minority far away
    weights = torch.rand(n, generator=gen) + 0.5
    rule = CenteredClip(tau=tau * spread, n_iters=30, max_weight_ratio=100.0)
    ours, _ = rule.aggregate(inputs, weights)
    truth = centered_clip_by_definition(inputs, weights, tau * spread, 30)
    # 0.1% of the spread, plus what a float32 result can resolve and what stopping one
    # iteration apart can leave (each step below 1e-7 of the center's norm)
    bound = 1e-3 * spread * dim**0.5 + (1e-6 + 30 * 1e-7) * max(1.0, float(truth.norm()))
    assert float((ours.double() - truth).norm()) <= bound


def test_a_plain_mean_is_moved_anywhere_by_one_outlier_and_the_rules_are_not():
    honest = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    inputs = torch.cat([honest, 1000 * honest[:1]])
    target = honest.mean(0)
    assert float((inputs.mean(0) - target).norm()) > 100
    for rule in RULES:
        result, limited = rule.aggregate(inputs, torch.ones(6))
        assert float((result - target).norm()) < 2.0, rule


def test_weights_are_capped_at_a_multiple_of_the_median():
    capped = cap_weights(torch.tensor([1.0, 1.0, 2.0, 1000.0]), 3.0)
    assert capped.tolist() == [1.0, 1.0, 2.0, 3.0]
    assert cap_weights(torch.zeros(3), 3.0).tolist() == [0.0, 0.0, 0.0]
    rule = CenteredClip(tau=10.0)
    inputs = torch.tensor([[0.0], [0.0], [0.0], [9.0]])
    result, _ = rule.aggregate(inputs, torch.tensor([1.0, 1.0, 1.0, 1e9]))
    assert float(result) <= 9.0 * 3 / 6 + 1e-6  # the claim counts as 3, not a billion


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0, 7.5, 1e6]), min_size=1, max_size=12),
    st.sampled_from([1.0, 2.5, 3.0]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_weight_capping_follows_its_definition_on_tensors(weights, ratio, dtype):
    """cap_weights works on Python floats; the definition on tensors: the lower median,
    of the positive weights when the median is 0."""
    tensor = torch.tensor(weights, dtype=dtype)
    median = float(tensor.median())
    if median <= 0 and bool((tensor > 0).any()):
        median = float(tensor[tensor > 0].median())
    expected = tensor.clamp(max=ratio * median) if median > 0 else tensor
    capped = cap_weights(tensor, ratio)
    assert capped.dtype == dtype and torch.equal(capped, expected)
    # the rule normalises what it capped: all-zero weights count as equal ones
    inputs = torch.arange(float(len(weights)), dtype=dtype).unsqueeze(1)
    result, _ = CenteredClip(tau=1e9, max_weight_ratio=ratio).aggregate(inputs, tensor)
    shares = expected / expected.sum() if float(expected.sum()) > 0 else None
    mean = inputs.mean() if shares is None else shares @ inputs.squeeze(1)
    assert float(result) == pytest.approx(float(mean), rel=1e-5, abs=1e-5)


def test_weights_that_are_nan_or_infinite_are_refused_and_a_0d_weight_keeps_its_shape():
    for rule in RULES:
        for bad in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(ValidationError, match="weights must be finite and >= 0"):
                rule.aggregate(torch.zeros(2, 2), torch.tensor([1.0, bad]))
    assert cap_weights(torch.tensor(5.0), 3.0).tolist() == 5.0


def test_bad_parameters_and_inputs_are_refused_by_name():
    for make, reason in (
        (lambda: CenteredClip(tau=0), "tau must be a positive number"),
        (lambda: CenteredClip(tau=float("inf")), "tau must be a positive number"),
        (lambda: CenteredClip(n_iters=0), "n_iters must be a positive int"),
        (lambda: CenteredClip(max_weight_ratio=0.5), "max_weight_ratio must be a number >= 1"),
        (lambda: TrimmedMean(trim=-1), "trim must be an int >= 0"),
        (lambda: CenteredClip(min_inputs=0), "min_inputs must be an int >= 1"),
        (lambda: TrimmedMean(min_inputs=2.5), "min_inputs must be an int >= 1"),
    ):
        with pytest.raises(ValidationError, match=reason):
            make()
    rule = CenteredClip()
    with pytest.raises(ValidationError, match="inputs must be"):
        rule.aggregate(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValidationError, match="no inputs"):
        rule.aggregate(torch.zeros(0, 2), torch.ones(0))
    with pytest.raises(ValidationError, match="weights must be finite"):
        rule.aggregate(torch.zeros(2, 2), torch.tensor([1.0, -1.0]))
    assert CenteredClip(tau=1.0).tag != CenteredClip(tau=2.0).tag != TrimmedMean().tag
    assert CenteredClip(min_inputs=3).tag != CenteredClip().tag  # members agree on the quorum
    assert CenteredClip(outlier_factor=5).tag == CenteredClip().tag  # blame only, not results
    for factor in (0.5, True, "3"):
        with pytest.raises(ValidationError, match="outlier_factor must be a number >= 1"):
            CenteredClip(outlier_factor=factor)


def test_centered_clip_blames_inputs_far_beyond_the_spread_not_the_farthest_honest_one():
    gen = torch.Generator().manual_seed(3)
    honest = 1.0 + torch.randn(6, 50, generator=gen)  # spread ~7 in norm
    rule = CenteredClip(tau=2.0, n_iters=50)  # below the spread: honest inputs are clipped
    _, blamed = rule.aggregate(honest, torch.ones(6))
    assert blamed == [False] * 6
    liars = torch.stack([-4 * honest.mean(0)] * 2)
    _, blamed = rule.aggregate(torch.cat([honest, liars]), torch.ones(8))
    assert blamed == [False] * 6 + [True] * 2
    # with factor 1 any clipped input farther than the median one is blamed
    _, blamed = CenteredClip(tau=2.0, n_iters=50, outlier_factor=1.0).aggregate(
        honest, torch.ones(6)
    )
    assert any(blamed)


# ---------------------------------------------------------------------- the reducer


def test_the_reducer_applies_the_rule_per_part_and_counts_who_was_limited(arun):
    async def main():
        reducer = RobustPartReducer([(4, torch.float32), (2, torch.float16)], 4, TrimmedMean(1))
        parts = [[torch.full((4,), float(s)), torch.full((2,), float(s)).half()] for s in range(3)]
        parts.append([torch.full((4,), 1e6), torch.full((2,), 1e4).half()])
        for sender, (first, second) in enumerate(parts):
            reducer.accumulate_part(sender, 0, first)
            if sender != 3:
                reducer.accumulate_part(sender, 1, second)
        with pytest.raises(ProtocolViolation, match="sent part 1 twice"):
            reducer.accumulate_part(0, 1, parts[0][1])
        with pytest.raises(ProtocolViolation, match="part 0 is already finished"):
            reducer.accumulate_part(3, 0, parts[3][0])
        with pytest.raises(ProtocolViolation, match=r"must be 2 float16 values"):
            reducer.accumulate_part(3, 1, torch.zeros(3))
        assert not reducer.finished
        reducer.on_sender_failed(3)  # part 1 finishes without it
        await reducer.wait_all()
        first, second = (reducer.part_future(k).result() for k in range(2))
        assert first.tolist() == [1.5] * 4  # 0 and 1e6 cut, mean of 1 and 2
        assert second.dtype == torch.float16 and second.tolist() == [1.0, 1.0]
        assert reducer.limited[3] == 1 and reducer.contributions == [2, 2, 2, 1]

    arun(main)


def test_a_borrowed_input_gives_the_same_result_and_is_never_written(arun):
    async def main():
        results = []
        for borrow in (False, True):
            reducer = RobustPartReducer([(4, torch.float32)], 3, CenteredClip(tau=1.0))
            own = torch.tensor([0.0, 1.0, 2.0, 3.0])
            reducer.accumulate_part(0, 0, own, borrow=borrow)
            reducer.accumulate_part(1, 0, torch.full((4,), 2.0))
            reducer.accumulate_part(2, 0, torch.full((4,), 50.0))
            results.append(await reducer.wait_part(0))
            assert torch.equal(own, torch.tensor([0.0, 1.0, 2.0, 3.0]))
        assert torch.equal(results[0], results[1])

    arun(main)


def test_a_part_thinned_below_min_inputs_is_not_aggregated(arun):
    """Two liars among five senders: if two honest senders are excluded, the liars are a
    majority of what is left and CenteredClip would follow them; with min_inputs=5 the
    part is left unaggregated (None: every member keeps its own values) instead."""

    async def main():
        rule = CenteredClip(tau=0.1, min_inputs=5)
        reducer = RobustPartReducer([(3, torch.float32), (3, torch.float32)], 5, rule)
        liars, honest = torch.full((3,), 100.0), torch.ones(3)
        for sender in range(5):  # part 0 from everyone
            reducer.accumulate_part(sender, 0, liars if sender >= 3 else honest)
        for sender in (0, 3, 4):  # part 1: two honest senders stall and are excluded
            reducer.accumulate_part(sender, 1, liars if sender >= 3 else honest)
        reducer.on_sender_failed(1)
        reducer.on_sender_failed(2)
        await reducer.wait_all()
        first, second = (reducer.part_future(k).result() for k in range(2))
        assert float((first - honest).norm()) < 1.0  # 3 honest of 5: clipped liars
        assert second is None and reducer.short_parts == 1
        # without the quorum the thinned part follows the liars
        loose = RobustPartReducer([(3, torch.float32)], 3, CenteredClip(tau=0.1))
        for sender, values in enumerate((honest, liars, liars)):
            loose.accumulate_part(sender, 0, values)
        await loose.wait_all()
        assert float((loose.part_future(0).result() - liars).norm()) < 1.0

    arun(main)


# ---------------------------------------------------------------------- a round


def test_a_member_scaling_its_tensors_by_1000_is_clipped_and_named_in_the_result():
    honest = [[torch.randn(64, generator=torch.Generator().manual_seed(i))] for i in range(4)]
    attacker = [honest[0][0] * 1000]
    sets = [[t.clone() for t in ts] for ts in honest] + [attacker]
    target = torch.stack([ts[0] for ts in honest]).mean(0)
    rule = CenteredClip(tau=20.0, n_iters=50)  # above the honest spread: only it is clipped

    async def main(network):
        nodes, avgs = await start_swarm(network, sets, seed=4, aggregation=rule)
        await asyncio.gather(*(a.step(timeout=20) for a in avgs))
        last = [a.last_result for a in avgs]
        attacker_id = avgs[-1].peer.peer_id
        everyone = [a.peer.peer_id for a in avgs]
        await shutdown(avgs, nodes)
        return last, attacker_id, everyone

    last, attacker_id, everyone = simulate(main)
    for me, result in zip(everyone, last, strict=True):  # who our span's reduction used
        assert result.contributors == frozenset(everyone) - {me}
    for ts in sets[:4]:
        # the clipped attacker moves each of the 5 spans' results by tau / 4 at most (the
        # plain mean would be ~1600 away)
        assert float((ts[0] - target).norm()) <= rule.tau / 4 * 5**0.5 + 0.5
    assert all(r.fully_averaged for r in last[:4])
    assert all(r.limited_senders.get(attacker_id, 0) >= 1 for r in last[:4] if r is not None)


def test_members_with_another_rule_never_average_together(caplog):
    sets = [[torch.full((8,), float(i))] for i in range(2)]
    per_peer = [{"aggregation": CenteredClip(tau=1.0)}, {"aggregation": TrimmedMean(1)}]

    async def main(network):
        nodes, avgs = await start_swarm(network, sets, seed=5, per_peer=per_peer)
        results = await asyncio.gather(*(a.step(timeout=8) for a in avgs))
        await shutdown(avgs, nodes)
        return results

    with caplog.at_level(logging.WARNING, logger="swarmgrad.averaging"):
        results = simulate(main)
    assert results == [None, None]
    assert sets[0][0].tolist() == [0.0] * 8 and sets[1][0].tolist() == [1.0] * 8
    said = [r.getMessage() for r in caplog.records if "nobody in the group" in r.getMessage()]
    assert said and all("centered_clip" in m and "trimmed_mean" in m for m in said)


class LyingRule(CenteredClip):
    """Announces CenteredClip, returns its result scaled by 100: a malicious reducer."""

    def aggregate(self, inputs, weights):
        result, limited = super().aggregate(inputs, weights)
        return result * 100, limited


def test_a_reducer_returning_a_wrong_average_is_caught_named_and_banned():
    sets = [[torch.randn(64, generator=torch.Generator().manual_seed(i))] for i in range(3)]
    before = [[t.clone() for t in ts] for ts in sets]
    rule = CenteredClip(tau=2.0)
    liar_rule = LyingRule(tau=2.0)
    assert liar_rule.tag == rule.tag  # it claims the same rule
    per_peer = [{}, {}, {"aggregation": liar_rule}]

    async def main(network):
        nodes, avgs = await start_swarm(
            network, sets, seed=6, per_peer=per_peer, aggregation=rule, ban_after=1
        )
        await asyncio.gather(*(a.step(timeout=20) for a in avgs))
        liar = avgs[2].peer.peer_id
        results = [a.last_result for a in avgs[:2]]
        evidence = [a.offenders.counts.get(liar) for a in avgs[:2]]
        banned = [a.offenders.is_banned(liar) for a in avgs[:2]]
        second = await asyncio.gather(*(a.step(timeout=6) for a in avgs))
        await shutdown(avgs, nodes)
        return liar, results, evidence, banned, second

    liar, results, evidence, banned, second = simulate(main)
    for result, counts in zip(results, evidence, strict=True):
        assert liar in result.bad_reducers and "beyond the" in result.failed_reducers[liar]
        assert counts is not None and counts.bad_reductions == 1
    assert banned == [True, True]
    # the liar's span stayed local on the honest peers: those values are untouched
    assert results[0].local_spans and results[0].local_spans == results[1].local_spans
    for ts, old in zip(sets[:2], before[:2], strict=True):
        assert not torch.equal(ts[0], old[0])  # the honest spans were averaged
        assert float(ts[0].abs().max()) < 10  # nothing scaled by 100 was written
    # banned: the honest peers met again without the liar
    assert second[2] is None
    assert second[0] is not None and len(second[0]) == 2 and liar not in second[0]


def test_the_facade_takes_the_rule_and_the_ban_and_refuses_bad_values_by_name():
    from swarmgrad.averaging.averager import DecentralizedAverager
    from swarmgrad.dht import DHT

    dht = DHT(start=True)
    try:
        make = functools.partial(DecentralizedAverager, [torch.zeros(4)], dht, prefix="robust")
        averager = make(start=True, aggregation=CenteredClip(tau=0.5), ban_after=2)
        try:
            assert averager.offenders == {}
        finally:
            averager.shutdown()
        for options, reason in (
            ({"aggregation": "centered_clip"}, "aggregation must be an AggregationRule"),
            ({"ban_after": 0}, "ban_after must be a positive int or None"),
            ({"ban_duration": -1}, "ban_duration must be a positive number of seconds"),
            ({"ban_after": 3, "ban_window": 2}, "ban_window must be an int >= ban_after"),
            ({"ban_after": 3, "ban_window": 4.5}, "ban_window must be an int >= ban_after"),
            ({"ban_after": 3, "ban_window": True}, "ban_window must be an int >= ban_after"),
        ):
            with pytest.raises(ValidationError, match=reason):
                make(start=True, **options)
    finally:
        dht.shutdown()


def _round(contributors, limited=(), bad=()):
    from swarmgrad.averaging.allreduce import AllReduceResult

    return AllReduceResult(
        group_id=b"g",
        averaged_spans=frozenset(),
        local_spans=frozenset(),
        limited_senders={p: 1 for p in limited},
        bad_reducers=frozenset(bad),
        failed_reducers={p: "its span was 100 x beyond the check" for p in bad},
        contributors=frozenset(contributors),
    )


def test_bans_count_offences_among_recent_rounds_not_a_running_total(caplog):
    from swarmgrad.averaging.robust.offenders import OffenderLog

    straggler, liar, bad_owner = numbered_peer_id(1), numbered_peer_id(2), numbered_peer_id(3)
    log = OffenderLog(ban_after=3, ban_duration=60, owner="test", ban_window=6)
    with caplog.at_level(logging.WARNING, logger="swarmgrad.averaging.robust.offenders"):
        for i in range(40):  # the straggler stands out once in every 4 rounds: 10 in all
            limited = [straggler] if i % 4 == 0 else []
            limited += [liar] if i >= 30 else []
            log.record(_round([straggler, liar], limited=limited))
            if i == 31:
                assert not log.is_banned(liar)  # two offences in its last 6 rounds
            if i == 32:
                assert log.is_banned(liar)
    assert log.counts[straggler].clipped_rounds == 10
    assert not log.is_banned(straggler)
    assert log.banned == frozenset({liar})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "offended in 3 of its last 6 round(s)" in said[0]
    # a bad reduction is an offence too, in the same window; its reason is logged
    for _ in range(3):
        log.record(_round([], bad=[bad_owner]))
    assert log.is_banned(bad_owner) and "100 x beyond" in caplog.records[-1].getMessage()
    assert log.as_metrics()[str(bad_owner)]["bad_reductions"] == 3


def test_without_bans_counts_are_kept_and_nobody_is_banned():
    from swarmgrad.averaging.robust.offenders import OffenderLog

    liar = numbered_peer_id(2)
    log = OffenderLog(ban_after=None, ban_duration=60, owner="test")
    for _ in range(50):
        log.record(_round([liar], limited=[liar]))
    assert log.counts[liar].clipped_rounds == 50 and log.banned == frozenset()
    assert log.ban_window == 0 and log._recent == {}


def test_a_log_follows_another_logs_bans_until_they_expire():
    from swarmgrad.averaging.robust.offenders import OffenderLog

    liar = numbered_peer_id(2)
    grads = OffenderLog(ban_after=1, ban_duration=0.05, owner="grads")
    state = OffenderLog(ban_after=None, ban_duration=60, owner="state")
    state.follow(grads)
    with pytest.raises(ValueError, match="cannot follow itself"):
        state.follow(state)
    for _ in range(3):  # its own blame never bans (ban_after None)...
        state.record(_round([liar], limited=[liar]))
    assert not state.is_banned(liar)
    grads.record(_round([liar], limited=[liar]))  # ...the followed log's ban does
    assert grads.is_banned(liar) and state.is_banned(liar)
    assert state.as_metrics()[str(liar)]["banned"] is True
    time.sleep(0.06)
    assert not grads.is_banned(liar) and not state.is_banned(liar)
