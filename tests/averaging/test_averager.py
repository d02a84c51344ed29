"""DecentralizedAverager: Moshpit averaging end to end, on the simulated network (groups,
modes, bad input, crashes) and through the synchronous facade over real loopback DHTs
(triggers, cancellation, the tensors' lock, state download)."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from swarmgrad.averaging.allreduce import GroupMismatch
from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.averager_core import AsyncDecentralizedAverager
from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.compression import Float16Compression
from swarmgrad.dht import DHT
from swarmgrad.net.sim import run_simulation
from swarmgrad.utils.errors import ValidationError
from tests.helpers.peers import shutdown

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from moshpit_sim import build_dht_swarm

PREFIX = "run"


def tensors_of(seed: int, shape=(6, 5)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=generator),
        torch.randn(17, generator=generator).double(),
        torch.randn(3, generator=generator).half(),
    ]


def mean_of(sets, weights=None):
    weights = weights or [1.0] * len(sets)
    total = sum(weights)
    return [
        sum(w * ts[i].double() for ts, w in zip(sets, weights, strict=True)) / total
        for i in range(len(sets[0]))
    ]


def assert_close(got, want, atol=1e-5):
    for g, w in zip(got, want, strict=True):
        tolerance = 2e-3 if g.dtype == torch.float16 else atol
        assert torch.allclose(g.double(), w.double(), atol=tolerance), (g - w).abs().max()


def snapshot(sets):
    return [[t.clone() for t in ts] for ts in sets]


async def start_swarm(network, tensor_sets, *, seed=0, client=(), per_peer=None, **options):
    """One DHT node and one averager per tensor set, on the simulated network."""
    rng = random.Random(seed)
    nodes = await build_dht_swarm(network, len(tensor_sets), rng, client_mode=client)
    options.setdefault("prefix", PREFIX)
    options.setdefault("target_group_size", len(tensor_sets))
    options.setdefault("min_matchmaking_time", 2.0)
    options.setdefault("request_timeout", 1.0)
    averagers = []
    for i, (tensors, node) in enumerate(zip(tensor_sets, nodes, strict=True)):
        extra = dict(options, **(per_peer[i] if per_peer else {}))
        averager = AsyncDecentralizedAverager(
            tensors,
            node.peer,
            node,
            client_mode=i in client,
            rng=random.Random(rng.getrandbits(64)),
            **extra,
        )
        averager.start()
        averagers.append(averager)
    return nodes, averagers


def simulate(main, seed=0, **kwargs):
    kwargs.setdefault("latency", 0.01)
    return run_simulation(main, seed=seed, check_leftover_tasks=True, **kwargs)


# ---------------------------------------------------------------------- averages


def test_four_peers_reach_the_exact_mean_and_get_everyones_gather():
    sets = [tensors_of(i) for i in range(4)]
    expected = mean_of(snapshot(sets))

    async def main(network):
        nodes, avgs = await start_swarm(network, sets)
        results = await asyncio.gather(
            *(a.step(gather={"index": i}, timeout=20) for i, a in enumerate(avgs))
        )
        ids = [a.peer.peer_id for a in avgs]
        last = [a.last_result for a in avgs]
        await shutdown(avgs, nodes)
        return results, ids, last

    results, ids, last = simulate(main)
    for result in results:
        assert result == {peer_id: {"index": i} for i, peer_id in enumerate(ids)}
    assert all(r.fully_averaged and len(r.averaged_spans) == 4 for r in last)
    for ts in sets:
        assert_close(ts, expected)
        assert [t.dtype for t in ts] == [torch.float32, torch.float64, torch.float16]


def test_rounds_with_different_tags_never_meet():
    """Tagged steps (the optimizer tags gradient rounds with their epoch) group only with
    steps of the same tag, even when all four peers look for a group at once."""
    sets = [tensors_of(40 + i) for i in range(4)]
    tags = ["epoch1", "epoch1", "epoch2", "epoch2"]
    pairs = [mean_of(snapshot(sets[:2])), mean_of(snapshot(sets[2:]))]

    async def main(network):
        nodes, avgs = await start_swarm(network, sets, min_group_size=2)
        results = await asyncio.gather(
            *(
                a.step(gather=i, timeout=20, control=a.new_control(round_tag=tag))
                for i, (a, tag) in enumerate(zip(avgs, tags, strict=True))
            )
        )
        await shutdown(avgs, nodes)
        return results

    results = simulate(main)
    assert [sorted(r.values()) for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for i, ts in enumerate(sets):
        assert_close(ts, pairs[i // 2])
    for bad, reason in (("epoch 1", "letters, digits"), ("x" * 65, "limited to 64"), (3, "a str")):
        with pytest.raises(ValidationError, match=reason):
            StepControl(scheduled_time=0.0, weight=1.0, round_tag=bad)


def test_weights_and_averaging_alpha():
    weighted = [tensors_of(10 + i) for i in range(3)]
    weighted_expected = mean_of(snapshot(weighted), [1.0, 2.0, 5.0])
    partial = [tensors_of(20 + i) for i in range(3)]
    before = snapshot(partial)
    mean = mean_of(before)

    async def main(network):
        nodes, avgs = await start_swarm(network, weighted, seed=1)
        await asyncio.gather(
            *(a.step(weight=w, timeout=20) for a, w in zip(avgs, (1, 2, 5), strict=True))
        )
        await shutdown(avgs, nodes)
        nodes, avgs = await start_swarm(network, partial, seed=2, averaging_alpha=0.25)
        await asyncio.gather(*(a.step(timeout=20) for a in avgs))
        await shutdown(avgs, nodes)

    simulate(main)
    for ts in weighted:
        assert_close(ts, weighted_expected)
    for ts, old in zip(partial, before, strict=True):
        assert_close(
            ts, [o.double() + 0.25 * (m - o.double()) for o, m in zip(old, mean, strict=True)]
        )


def test_a_client_mode_peer_owns_nothing_and_gets_the_average():
    sets = [tensors_of(30 + i) for i in range(4)]
    expected = mean_of(snapshot(sets))

    async def main(network):
        nodes, avgs = await start_swarm(network, sets, seed=3, client=(3,))
        results = await asyncio.gather(*(a.step(timeout=20) for a in avgs))
        last = [a.last_result for a in avgs]
        await shutdown(avgs, nodes)
        return results, last, avgs[3].peer.peer_id

    results, last, client_id = simulate(main)
    assert all(r is not None and client_id in r for r in results)
    assert all(len(r.averaged_spans) == 3 and r.fully_averaged for r in last)  # 3 owners
    for ts in sets:
        assert_close(ts, expected)


def test_an_auxiliary_peer_reduces_but_contributes_nothing_and_keeps_its_tensors():
    sets = [tensors_of(40 + i) for i in range(4)]
    expected = mean_of(snapshot(sets[:3]))
    aux_before = snapshot(sets[3:])[0]

    async def main(network):
        nodes, avgs = await start_swarm(
            network, sets, seed=4, per_peer=[{}, {}, {}, {"auxiliary": True}]
        )
        with pytest.raises(ValidationError, match="weight must be 0"):
            await avgs[3].step(weight=1.0, timeout=1)
        results = await asyncio.gather(*(a.step(timeout=20) for a in avgs))
        aux_result = avgs[3].last_result
        await shutdown(avgs, nodes)
        return results, aux_result

    results, aux_result = simulate(main)
    assert all(r is not None and len(r) == 4 for r in results)
    assert not aux_result.averaged_spans and not aux_result.local_spans  # it applies nothing
    assert not aux_result.excluded_senders
    for ts in sets[:3]:
        assert_close(ts, expected)
    assert all(torch.equal(a, b) for a, b in zip(sets[3], aux_before, strict=True))


def test_moshpit_rounds_reach_the_global_mean_because_group_bits_move():
    """8 peers, groups of 4, on a 4-wide grid axis: round 1 averages within the two
    halves (initial bits 00 and 01); each member then takes a distinct new coordinate, so
    round 2 pairs one peer of each half, and everyone holds the global mean."""
    sets = [[torch.full((4,), float(i)) + torch.arange(4.0) * i] for i in range(8)]
    expected = mean_of(snapshot(sets))
    bits = ["00"] * 4 + ["01"] * 4

    async def main(network):
        nodes, avgs = await start_swarm(
            network,
            sets,
            seed=5,
            target_group_size=4,
            per_peer=[{"initial_group_bits": b} for b in bits],
        )
        history, sizes = [[a.get_group_bits() for a in avgs]], []
        errors = []
        for _ in range(3):
            results = await asyncio.gather(*(a.step(timeout=30) for a in avgs))
            sizes.append(sorted(len(r) for r in results if r is not None))
            history.append([a.get_group_bits() for a in avgs])
            errors.append(max(float((ts[0].double() - expected[0]).abs().max()) for ts in sets))
        await shutdown(avgs, nodes)
        return history, sizes, errors

    history, sizes, errors = simulate(main)
    assert sizes[0] == [4] * 8  # round 1: two groups of four
    # members of one round-1 group all moved to different cells
    assert len(set(history[1][:4])) == 4 and len(set(history[1][4:])) == 4
    assert history[1] != history[0] and history[2] != history[1]
    assert errors[0] > 1.0  # the halves differ after round 1
    assert errors[1] < 1e-6  # round 2 mixed the halves: the global mean
    assert errors[2] < 1e-6
    for ts in sets:
        assert_close(ts, expected)


# ---------------------------------------------------------------------- bad input and faults


def test_a_peer_with_other_tensor_shapes_gets_an_error_naming_the_mismatch(caplog):
    sets = [tensors_of(50 + i) for i in range(3)] + [tensors_of(53, shape=(6, 4))]
    expected = mean_of(snapshot(sets[:3]))
    odd_before = snapshot(sets[3:])[0]

    async def main(network):
        nodes, avgs = await start_swarm(network, sets, seed=6)
        results = await asyncio.gather(*(a.step(timeout=20) for a in avgs), return_exceptions=True)
        await shutdown(avgs, nodes)
        return results, [a.peer.peer_id for a in avgs]

    with caplog.at_level(logging.WARNING):
        results, ids = simulate(main)
    error = results[3]
    assert isinstance(error, GroupMismatch)
    message = str(error)
    assert "tensor 0 is ['float32', [6, 4]] here" not in message  # formatted, not raw
    assert "tensor 0 is float32[6, 4] here but float32[6, 5] at" in message
    assert all(r is not None and set(r) == set(ids[:3]) for r in results[:3])
    for ts in sets[:3]:
        assert_close(ts, expected)
    assert all(torch.equal(a, b) for a, b in zip(sets[3], odd_before, strict=True))
    assert f"{ids[3]} is left out of this round: its tensors differ" in caplog.text


def test_nan_from_a_peer_is_excluded_and_the_others_average_without_it():
    """Every owner refuses the NaN peer's parts (a refused sender gets no averages back,
    so it keeps its own values except in the span it owns)."""
    sets = [tensors_of(60 + i) for i in range(4)]
    for tensor in sets[2]:
        tensor[0] = float("nan")  # NaN in every tensor (spans cut across them)
        tensor[1:] = float("inf")
    expected = mean_of(snapshot([sets[0], sets[1], sets[3]]))

    async def main(network):
        nodes, avgs = await start_swarm(network, sets, seed=7)
        results = await asyncio.gather(*(a.step(timeout=20) for a in avgs))
        excluded = [a.last_result.excluded_senders for a in avgs]
        await shutdown(avgs, nodes)
        return results, excluded, avgs[2].peer.peer_id

    results, excluded, bad_peer = simulate(main)
    assert all(r is not None for r in results[:2] + results[3:])
    for i in (0, 1, 3):
        assert "sent NaN or Inf" in excluded[i][bad_peer]
        assert_close(sets[i], expected)


def test_a_member_crashing_mid_round_leaves_correct_partial_averages_and_no_hang():
    sets = [[torch.full((400_000,), float(i))] for i in range(4)]
    victim = 1

    async def main(network):
        nodes, avgs = await start_swarm(
            network, sets, seed=8, allreduce_timeout=30, part_size_bytes=64 * 1024
        )
        for node in nodes:  # slow links: a round takes a few virtual seconds
            network.set_host(node.peer._backend.host, bandwidth=1e6)
        loop = asyncio.get_running_loop()
        controls = [a.new_control() for a in avgs]
        tasks = [
            asyncio.create_task(a.step(timeout=60, allow_retries=False, control=c))
            for a, c in zip(avgs, controls, strict=True)
        ]
        while controls[victim].stage is not AveragingStage.RUNNING_ALLREDUCE:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        crashed_at = loop.time()
        network.crash(nodes[victim].peer._backend.host)
        tasks[victim].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        took = loop.time() - crashed_at
        last = [a.last_result for a in avgs]
        after_first = [sets[i][0].clone() for i in range(4)]
        survivors = [a for i, a in enumerate(avgs) if i != victim]
        again = await asyncio.gather(*(a.step(timeout=60) for a in survivors))
        await shutdown(avgs, nodes)
        return results, took, last, after_first, again, avgs[victim].peer.peer_id

    results, took, last, after_first, again, victim_id = simulate(main)
    assert isinstance(results[victim], asyncio.CancelledError)
    assert took < 10  # the survivors notice the crash, not the 30 s all-reduce deadline
    for i in (0, 2, 3):
        assert results[i] is None or victim_id in results[i]
        assert last[i].failed_reducers or last[i].excluded_senders  # it was mid-round
        # every element: the full mean, the survivors' mean, or (victim's span) local
        allowed = torch.tensor([1.5, 5 / 3, float(i)])
        distance = (after_first[i][:, None] - allowed[None, :]).abs().min(dim=1).values
        assert float(distance.max()) < 1e-5
    assert all(r is not None and victim_id not in r and len(r) == 3 for r in again)
    mean = sum(after_first[i] for i in (0, 2, 3)) / 3
    for i in (0, 2, 3):
        assert torch.allclose(sets[i][0], mean, atol=1e-5)


# ---------------------------------------------------------------------- aggregate hook


def test_an_aggregate_hook_runs_several_phases_in_the_group_it_was_given():
    """``aggregate`` replaces the round's one all-reduce: here a first phase averages a
    vector of another size with equal weights, a second the averaged tensors with the
    step's weights, both in the same group; phase names are checked and unique."""
    sets = [tensors_of(80 + i) for i in range(3)]
    weights = [1.0, 2.0, 5.0]
    expected = mean_of(snapshot(sets), weights)
    extras = [[torch.full((7,), float(i))] for i in range(3)]
    seen = []

    def hook(extra):
        async def aggregate(current):
            with pytest.raises(ValidationError, match="phase must be 1-32 letters"):
                await current.allreduce(extra, phase="no spaces")
            first = await current.allreduce(extra, phase="extra", weight=1.0)
            with pytest.raises(ValidationError, match="phase 'extra' already ran"):
                await current.allreduce(extra, phase="extra")
            second = await current.allreduce(current.tensors, phase="main")
            seen.append((current.weight, current.contributes, first, second))

        return aggregate

    async def main(network):
        per_peer = [{"aggregate": hook(e), "aggregate_tag": "two phases"} for e in extras]
        nodes, avgs = await start_swarm(network, sets, seed=10, per_peer=per_peer)
        results = await asyncio.gather(
            *(
                a.step(gather=i, timeout=20, weight=w)
                for i, (a, w) in enumerate(zip(avgs, weights, strict=True))
            )
        )
        last = [a.last_result for a in avgs]
        await shutdown(avgs, nodes)
        return results, last

    results, last = simulate(main)
    assert all(sorted(r.values()) == [0, 1, 2] for r in results)
    assert all(r.fully_averaged and len(r.averaged_spans) == 3 for r in last)
    assert sorted(weight for weight, *_ in seen) == weights and all(c for _, c, *_ in seen)
    for _, _, first, second in seen:
        assert first.averaged == (True,) and second.averaged == (True, True, True)
        assert first.result.group_id != second.result.group_id  # a stream id per phase
    for extra in extras:
        assert torch.equal(extra[0], torch.full((7,), 1.0))
    for ts in sets:
        assert_close(ts, expected)


def test_a_member_that_skips_a_phase_costs_the_others_only_its_part_of_that_phase():
    """Peer 2 runs phase "a" and stops; peers 0 and 1 go on to phase "b". They wait for
    it a bounded time, then average "b" between themselves; the span peer 2 would have
    reduced stays local. Nothing hangs."""
    sets = [[torch.full((30,), float(i))] for i in range(3)]
    later = [[torch.full((600,), 10.0 * i)] for i in range(3)]
    record = {}

    def hook(index):
        async def aggregate(current):
            await current.allreduce(current.tensors, phase="a")
            if index == 2:
                return
            record[index] = (
                await current.allreduce(later[index], phase="b"),
                current.plan.span_sizes_for(600),
                current.plan.group.peer_ids,
            )

        return aggregate

    async def main(network):
        per_peer = [{"aggregate": hook(i), "aggregate_tag": "skips"} for i in range(3)]
        nodes, avgs = await start_swarm(network, sets, seed=11, per_peer=per_peer)
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(a.step(timeout=60) for a in avgs))
        took = loop.time() - started
        ids = [a.peer.peer_id for a in avgs]
        last = [a.last_result for a in avgs]
        await shutdown(avgs, nodes)
        return results, took, ids, last

    results, took, ids, last = simulate(main)
    assert took < 30 and all(r is not None for r in results)
    for ts in sets:  # phase "a" had everyone
        assert torch.allclose(ts[0], torch.full((30,), 1.0))
    for i in (0, 1):
        phase, spans, order = record[i]
        assert phase.averaged == (False,)  # part of the tensor stayed local
        assert ids[2] in phase.result.failed_reducers
        assert not last[i].fully_averaged and ids[2] in last[i].failed_reducers
        start = 0
        for owner, size in zip(order, spans, strict=True):
            piece = later[i][0][start : start + size]
            want = 10.0 * i if owner == ids[2] else 5.0  # local, or the mean of 0 and 1
            assert torch.allclose(piece, torch.full_like(piece, want)), (owner, piece)
            start += size
    assert torch.equal(later[2][0], torch.full((600,), 20.0))  # never ran "b"


def test_a_lonely_peer_gives_up_at_its_deadline_and_leaves_its_tensors_alone():
    sets = [tensors_of(70)]
    before = snapshot(sets)

    async def main(network):
        nodes, avgs = await start_swarm(network, [*sets, tensors_of(71)], seed=9)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await avgs[0].step(timeout=7.5)
        elapsed = loop.time() - started
        once = await avgs[0].step(timeout=30, allow_retries=False)
        elapsed_once = loop.time() - started - elapsed
        await shutdown(avgs, nodes)
        return result, elapsed, once, elapsed_once

    result, elapsed, once, elapsed_once = simulate(main)
    # deadlines pass through DHT time (an epoch of 1.8e9 s, whose float steps are ~2e-7 s)
    tick = 1e-6
    assert result is None and 7.5 - tick <= elapsed < 8.0
    assert once is None and elapsed_once <= 30 + tick  # one search window, no retries
    assert all(torch.equal(a, b) for a, b in zip(sets[0], before[0], strict=True))


def test_bad_arguments_are_refused_with_a_clear_error():
    async def noop(current):
        pass

    async def main(network):
        nodes = await build_dht_swarm(network, 1, random.Random(0))
        peer, node = nodes[0].peer, nodes[0]

        def make(tensors=None, **options):
            options.setdefault("prefix", PREFIX)
            options.setdefault("target_group_size", 4)
            return AsyncDecentralizedAverager(tensors or [torch.zeros(3)], peer, node, **options)

        cases = {
            "integers": lambda: make([torch.zeros(3, dtype=torch.int64)]),
            "view": lambda: make([torch.zeros(4, 4).t()]),
            "grad_fn": lambda: make([torch.zeros(3, requires_grad=True) * 2]),
            "aux client": lambda: make(auxiliary=True, client_mode=True),
            "client sharing": lambda: make(client_mode=True, allow_state_sharing=True),
            "alpha": lambda: make(averaging_alpha=0),
            "bandwidth": lambda: make(bandwidth=-1.0),
            "timeout": lambda: make(allreduce_timeout=0),
            "hook without tag": lambda: make(aggregate=noop),
            "tag without hook": lambda: make(aggregate_tag="plain?"),
            "empty tag": lambda: make(aggregate=noop, aggregate_tag=""),
            "long tag": lambda: make(aggregate=noop, aggregate_tag="x" * 201),
            "hook": lambda: make(aggregate=5, aggregate_tag="five"),
        }
        messages = {}
        for name, build in cases.items():
            with pytest.raises(ValidationError) as info:
                build()
            messages[name] = str(info.value)
        averager = make()
        with pytest.raises(ValidationError, match="not running"):
            await averager.step()
        averager.start()
        with pytest.raises(ValidationError, match="msgpack"):
            await averager.step(gather=object(), timeout=1)
        with pytest.raises(ValidationError, match="weight"):
            await averager.step(weight=-1, timeout=1)
        with pytest.raises(ValidationError, match="timeout"):
            await averager.step(timeout=0)
        await averager.shutdown()
        await shutdown([], nodes)
        return messages

    messages = simulate(main)
    assert "tensor 0 has dtype torch.int64" in messages["integers"]
    assert "not contiguous" in messages["view"]
    assert "grad_fn" in messages["grad_fn"]
    assert "auxiliary=True needs client_mode=False" in messages["aux client"]
    assert "cannot share its state" in messages["client sharing"]
    assert "averaging_alpha" in messages["alpha"]
    assert "bandwidth" in messages["bandwidth"]
    assert "allreduce_timeout" in messages["timeout"]
    assert "aggregate and aggregate_tag go together" in messages["hook without tag"]
    assert "aggregate and aggregate_tag go together" in messages["tag without hook"]
    assert "aggregate_tag must not be empty" in messages["empty tag"]
    assert "aggregate_tag must be printable text of at most 200" in messages["long tag"]
    assert "aggregate must be a coroutine function, got 5" in messages["hook"]


# ---------------------------------------------------------------------- the facade, real DHTs


@pytest.fixture
def dhts():
    """Four DHT peers on loopback, in this process (they share the loop thread)."""
    first = DHT(start=True)
    others = [DHT(initial_peers=[str(first.get_visible_maddrs()[0])], start=True) for _ in range(3)]
    yield [first, *others]
    for dht in [first, *others]:
        dht.shutdown()


def facade(tensors, dht, **options):
    options.setdefault("prefix", PREFIX)
    options.setdefault("target_group_size", 4)
    options.setdefault("min_matchmaking_time", 1.0)
    options.setdefault("request_timeout", 5.0)
    return DecentralizedAverager(tensors, dht, start=True, **options)


def test_facade_averages_over_loopback_with_triggers_weights_and_cancel(dhts):
    sets = [tensors_of(80 + i) for i in range(4)]
    expected = mean_of(snapshot(sets), [1.0, 1.0, 1.0, 3.0])
    averagers = [facade(ts, dht) for ts, dht in zip(sets, dhts, strict=True)]
    try:
        assert averagers[0].is_alive() and averagers[0].peer_id == dhts[0].peer_id
        with pytest.raises(ValidationError, match="require_trigger=True needs wait=False"):
            averagers[0].step(require_trigger=True)
        controls = [a.step(gather=i, wait=False, timeout=60) for i, a in enumerate(averagers[:3])]
        last = averagers[3].step(gather=3, wait=False, require_trigger=True, timeout=60)
        deadline = time.monotonic() + 60
        while last.stage is not AveragingStage.AWAITING_TRIGGER and time.monotonic() < deadline:
            time.sleep(0.01)
        assert last.stage is AveragingStage.AWAITING_TRIGGER and not last.done()
        last.weight = 3.0  # may still change until the all-reduce begins
        last.allow_allreduce()
        results = [c.result(60) for c in [*controls, last]]
        assert last.stage is AveragingStage.FINISHED
        ids = [a.peer_id for a in averagers]
        assert all(r == dict(zip(ids, range(4), strict=True)) for r in results)
        for averager in averagers:
            with averager.get_tensors() as tensors:
                assert_close(tensors, expected)
        with pytest.raises(ValidationError, match="can no longer change"):
            last.weight = 1.0

        # a step nobody joins, cancelled: it ends at once and leaves the tensors alone
        before = snapshot(sets[:1])[0]
        lonely = averagers[0].step(wait=False, timeout=60)
        time.sleep(0.2)
        assert lonely.cancel() and lonely.cancelled()
        again = averagers[0].step(wait=False, timeout=0.5)  # runs once the lonely one is gone
        assert again.result(30) is None
        assert all(torch.equal(a, b) for a, b in zip(sets[0], before, strict=True))
    finally:
        for averager in averagers:
            averager.shutdown()
    assert not averagers[0].is_alive()
    with pytest.raises(ValidationError, match="not running"):
        averagers[0].step()


def test_a_finished_steps_control_is_freed_without_the_cyclic_collector(dhts):
    """(issue 32) Once the caller drops a finished step's control, nothing keeps it (nor
    its result): the step's expected-size hook and the loop call's future made reference
    cycles that lived until the collector's next full pass, rare in a process with
    torch's many long-lived objects, and a keeper's memory grew with every round."""
    averagers = [
        facade(tensors_of(90 + i), dht, target_group_size=2) for i, dht in enumerate(dhts[:2])
    ]
    gc.disable()
    try:
        controls = [a.step(gather=i, wait=False, timeout=60) for i, a in enumerate(averagers)]
        results = [c.result(60) for c in controls]
        assert all(r is not None and len(r) == 2 for r in results)
        gone = [weakref.ref(c) for c in controls]
        del controls
        deadline = time.monotonic() + 10
        while any(ref() is not None for ref in gone) and time.monotonic() < deadline:
            time.sleep(0.01)  # the step's task lets go of it as it ends, on the loop
        assert all(ref() is None for ref in gone), "a finished control lived on in a cycle"

        lonely = averagers[0].step(wait=False, timeout=60)  # cancelled while it looks
        deadline = time.monotonic() + 30
        while lonely.stage is not AveragingStage.LOOKING_FOR_GROUP:
            assert time.monotonic() < deadline, lonely.stage
            time.sleep(0.01)
        assert lonely.cancel()
        gone = weakref.ref(lonely)
        del lonely
        deadline = time.monotonic() + 10
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # its task ends on the loop, raising CancelledError
        assert gone() is None, "a cancelled control lived on in a cycle"
    finally:
        gc.enable()
        for averager in averagers:
            averager.shutdown()


def test_holding_the_tensors_delays_the_round_but_never_the_event_loop(dhts):
    sets = [[torch.full((5,), float(i))] for i in range(2)]
    averagers = [
        facade(ts, dht, target_group_size=2) for ts, dht in zip(sets, dhts[:2], strict=True)
    ]
    try:
        with averagers[0].get_tensors():
            controls = [a.step(wait=False, timeout=60) for a in averagers]
            deadline = time.monotonic() + 60
            while (
                controls[0].stage is not AveragingStage.RUNNING_ALLREDUCE
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            # the loop still serves the DHT while the round waits for our lock
            assert dhts[2].store("probe", 1, time.time() + 60)
            assert dhts[3].get("probe", latest=True).value == 1
            assert torch.equal(sets[0][0], torch.zeros(5)) and not controls[0].done()
        assert all(c.result(60) is not None for c in controls)
        assert torch.equal(sets[0][0], torch.full((5,), 0.5))
        assert torch.equal(sets[1][0], torch.full((5,), 0.5))
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_joining_peer_downloads_the_state_of_a_running_averager(dhts):
    class Shared(DecentralizedAverager):
        def get_current_state(self):
            with self.get_tensors() as tensors:
                return {"epoch": 7}, [t * 1 for t in tensors]

    donor_tensors = tensors_of(90)
    donor = Shared(donor_tensors, dhts[0], start=True, prefix=PREFIX, target_group_size=4)
    newcomer = facade([torch.zeros_like(t) for t in donor_tensors], dhts[1])
    client = facade(tensors_of(91), dhts[2], client_mode=True)
    try:
        assert donor.allow_state_sharing and not client.allow_state_sharing
        with pytest.raises(ValidationError, match="client-mode peer cannot share"):
            client.allow_state_sharing = True
        donor.state_sharing_priority = 3
        assert donor.state_sharing_priority == 3
        state = None
        deadline = time.monotonic() + 60
        while state is None and time.monotonic() < deadline:  # until the declaration lands
            state = newcomer.load_state_from_peers(timeout=10)
        metadata, tensors = state
        assert metadata == {"epoch": 7}
        assert all(torch.equal(a, b) for a, b in zip(tensors, donor_tensors, strict=True))
        future = client.load_state_from_peers(wait=False, timeout=20)
        assert future.result(30)[0] == {"epoch": 7}
        donor.allow_state_sharing = False
        assert not donor.allow_state_sharing
    finally:
        for averager in (donor, newcomer, client):
            averager.shutdown()


def test_facade_settings_before_start_and_unknown_options(dhts):
    with pytest.raises(ValidationError, match="unknown options \\['target_size'\\]"):
        DecentralizedAverager([torch.zeros(2)], dhts[0], start=False, prefix="x", target_size=4)
    averager = DecentralizedAverager(
        [torch.zeros(2)], dhts[0], start=False, prefix="x", target_group_size=4, daemon=True
    )
    assert not averager.is_alive() and averager.get_group_bits() == ""
    averager.set_group_bits("0110")
    averager.state_sharing_priority = 2.5
    with averager:
        assert averager.is_alive()
        assert averager.get_group_bits() == "0110"
        assert averager.state_sharing_priority == 2.5
        with pytest.raises(ValidationError, match="already running"):
            averager.run_in_background()
        with pytest.raises(ValidationError, match="group bits"):
            averager.set_group_bits("012")
    assert not averager.is_alive()
    averager.shutdown()  # idempotent


def test_state_compression_is_applied_to_the_state_a_joining_peer_downloads(dhts):
    with pytest.raises(ValidationError, match="unknown compression 'float17'"):
        DecentralizedAverager(
            [torch.zeros(2)], dhts[0], start=False, prefix="x", state_compression="float17"
        )
    donor_tensors = tensors_of(95)  # float32, float64, float16
    donor = facade(donor_tensors, dhts[0], state_compression=Float16Compression())
    newcomer = facade([torch.zeros_like(t) for t in donor_tensors], dhts[1])
    try:
        state = None
        deadline = time.monotonic() + 60
        while state is None and time.monotonic() < deadline:  # until the declaration lands
            state = newcomer.load_state_from_peers(timeout=10)
        _, tensors = state
        for got, sent in zip(tensors, donor_tensors, strict=True):
            assert got.dtype == sent.dtype and torch.equal(got, sent.half().to(sent.dtype))
        assert not torch.equal(tensors[0], donor_tensors[0])  # it was rounded on the way
    finally:
        for averager in (donor, newcomer):
            averager.shutdown()
