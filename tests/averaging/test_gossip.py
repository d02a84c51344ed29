"""Pair-wise gossip averaging: mixing rules, convergence, divergence threshold, flow
control, bad input, and the synchronous facade."""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time

import pytest
import torch

from swarmgrad.averaging.gossip.averager import AsyncGossipAverager, GossipAverager
from swarmgrad.averaging.gossip.rules import MixingRule, PeerScoreboard, mixing_factor
from swarmgrad.dht import DHT
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from swarmgrad.utils.errors import RemoteError, ValidationError
from tests.helpers.peers import shutdown

EPOCH = 1.8e9
PREFIX = "run"


# ---------------------------------------------------------------------- rules


def test_mixing_factors_follow_the_documented_rules():
    assert mixing_factor("constant", mixing_constant=0.3, remote_samples=99) == 0.3
    assert mixing_factor("clock", local_samples=10, remote_samples=30) == 0.75
    assert mixing_factor("clock", local_samples=0, remote_samples=0) == 0.5
    assert mixing_factor("loss", local_loss=3.0, remote_loss=1.0) == 0.75  # lower loss weighs more
    assert mixing_factor("loss", local_loss=1.0, remote_loss=3.0) == 0.25
    for local_loss, remote_loss in [(None, 1.0), (1.0, None), (-1.0, 2.0), (0.0, 0.0)]:
        assert (
            mixing_factor(
                "loss", mixing_constant=0.4, local_loss=local_loss, remote_loss=remote_loss
            )
            == 0.4
        )
    with pytest.raises(ValidationError, match="unknown mixing rule 'average'"):
        mixing_factor("average")
    assert MixingRule.parse("clock") is MixingRule.CLOCK


def test_scoreboard_prefers_fast_peers_and_nearly_forgets_failing_ones():
    board = PeerScoreboard(rng=random.Random(0))
    for _ in range(5):
        board.record_success("fast", 0.01)
        board.record_success("slow", 0.1)
    picks = [board.choose(["fast", "slow", "new"]) for _ in range(3000)]
    share = {p: picks.count(p) / len(picks) for p in ("fast", "slow", "new")}
    # scores 100 : 10 : median(0.01, 0.1) -> 1/0.055
    assert 0.7 < share["fast"] < 0.8 and 0.05 < share["slow"] < 0.1 and share["new"] > 0.1
    board.record_failure("fast", 1.0)
    board.record_failure("fast", 1.0)
    assert board.score("fast") < board.score("slow") / 10
    board.record_success("fast", 0.01)  # answering again: the failure penalty is gone
    assert board.score("slow") / 10 < board.score("fast") < board.score("slow")
    for _ in range(6):  # and its latency estimate recovers
        board.record_success("fast", 0.01)
    assert board.score("fast") > board.score("slow")
    assert board.choose([]) is None


# ---------------------------------------------------------------------- simulated swarms


async def start_nodes(network, count: int, rng: random.Random) -> list[DHTNode]:
    loop = asyncio.get_running_loop()
    nodes: list[DHTNode] = []
    for _ in range(count):
        peer = await create_sim_peer(network, rng=rng, keepalive_interval=None)
        initial = [str(nodes[0].peer.get_visible_maddrs()[0])] if nodes else []
        nodes.append(await DHTNode.create(peer, initial, time_fn=lambda: EPOCH + loop.time()))
    return nodes


def gossipers(nodes, tensors_per_node, **kwargs) -> list[AsyncGossipAverager]:
    averagers = []
    for i, (node, tensors) in enumerate(zip(nodes, tensors_per_node, strict=True)):
        averager = AsyncGossipAverager(
            tensors, node.peer, node, prefix=PREFIX, rng=random.Random(i), **kwargs
        )
        averager.start()
        averagers.append(averager)
    return averagers


@pytest.mark.parametrize(
    ("mixing", "setup", "expected_factor"),
    [
        ("constant", {}, 0.3),
        ("clock", {"a_samples": 10, "b_samples": 30}, 0.75),
        ("loss", {"a_loss": 3.0, "b_loss": 1.0}, 0.75),
    ],
)
def test_two_peers_mix_exactly_by_the_rule(mixing, setup, expected_factor):
    a0 = [torch.tensor([1.0, 2.0, 3.0]), torch.full((2, 2), 4.0)]
    b0 = [torch.tensor([5.0, -2.0, 0.0]), torch.full((2, 2), -4.0)]

    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(0))
        a_tensors, b_tensors = [t.clone() for t in a0], [t.clone() for t in b0]
        a, b = gossipers(nodes, [a_tensors, b_tensors], mixing=mixing, mixing_constant=0.3)
        await asyncio.sleep(1)
        with b._clock_lock:
            b.samples_seen = float(setup.get("b_samples", 0))
            b.loss = setup.get("b_loss")
        # a starts from a zero clock, so samples_seen sets it
        result = await a.step(samples_seen=setup.get("a_samples", 1), loss=setup.get("a_loss"))
        clock = a.samples_seen
        await shutdown([a, b], nodes)
        return result, a_tensors, b_tensors, clock, b.peer.peer_id

    result, a_tensors, b_tensors, clock, b_id = run_simulation(
        main, latency=0.01, check_leftover_tasks=True
    )
    assert result.mixed and result.peer == b_id and result.factor == pytest.approx(expected_factor)
    f = expected_factor
    for got, x, y in zip(a_tensors, a0, b0, strict=True):
        assert torch.allclose(got, (1 - f) * x + f * y, atol=1e-6)
    assert all(torch.equal(got, y) for got, y in zip(b_tensors, b0, strict=True))  # pull only
    if mixing == "clock":
        assert clock == pytest.approx(0.25 * 10 + 0.75 * 30)


def test_eight_peers_converge_toward_their_mean():
    torch.manual_seed(0)
    initial = [torch.randn(16) * 10 for _ in range(8)]
    mean = torch.stack(initial).mean(0)
    spread0 = max(float((t - mean).norm()) for t in initial)
    rms0 = float(torch.stack([(t - mean).norm() for t in initial]).pow(2).mean().sqrt())

    async def main(network):
        nodes = await start_nodes(network, 8, random.Random(1))
        tensors = [[t.clone()] for t in initial]
        averagers = gossipers(nodes, tensors, mixing="constant", mixing_constant=0.5)
        await asyncio.sleep(1)
        for _ in range(25):
            results = await asyncio.gather(*(a.step() for a in averagers))
            assert all(r.mixed for r in results), results
        await shutdown(averagers, nodes)
        return [t[0] for t in tensors]

    final = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    consensus = torch.stack(final).mean(0)
    spread = max(float((t - consensus).norm()) for t in final)
    assert spread < 1e-3 * spread0  # everyone agrees...
    # ...on about the mean: one-sided pulls keep the mean only in expectation, so the
    # consensus is a random convex combination (0.1-0.37 x rms0 over 30 seeds)
    assert float((consensus - mean).norm()) < 0.6 * rms0


def test_peers_too_far_apart_are_not_mixed():
    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(2))
        a_tensors, b_tensors = [torch.zeros(4)], [torch.full((4,), 3.0)]  # distance 6
        strict, _ = gossipers(nodes, [a_tensors, b_tensors], divergence_threshold=5.0)
        await asyncio.sleep(1)
        skipped = await strict.step()
        unchanged = a_tensors[0].clone()
        strict.divergence_threshold = 7.0
        mixed = await strict.step()
        await shutdown([strict, _], nodes)
        return skipped, unchanged, mixed, a_tensors[0]

    skipped, unchanged, mixed, after = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert skipped.skipped == "diverged" and skipped.distance == pytest.approx(6.0)
    assert torch.equal(unchanged, torch.zeros(4))
    assert mixed.mixed and torch.allclose(after, torch.full((4,), 1.5))


def test_flow_control_avoids_a_failing_peer():
    async def main(network):
        nodes = await start_nodes(network, 5, random.Random(3))
        averagers = gossipers(nodes, [[torch.randn(8)] for _ in nodes], request_timeout=2.0)
        await asyncio.sleep(1)
        broken = averagers[4]
        network.crash(nodes[4].peer._backend.host)  # its DHT declaration stays behind
        puller = averagers[0]
        results = [await puller.step() for _ in range(60)]
        tried_broken = sum(
            1 for r in results for failure in r.failures if str(broken.peer.peer_id) in failure
        )
        await shutdown(averagers, nodes)
        return results, tried_broken, puller.known_peers, broken.peer.peer_id

    results, tried_broken, known, broken_id = run_simulation(
        main, latency=0.01, check_leftover_tasks=True
    )
    assert broken_id in known
    assert all(r.mixed and r.peer != broken_id for r in results)  # another peer stepped in
    assert 1 <= tried_broken <= 4  # chosen ~15 times by chance; failures make it rare


def test_pulls_with_mismatched_shapes_are_refused_with_a_clear_error(caplog):
    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(4))
        mine = [torch.zeros(3, 4), torch.zeros(2)]
        theirs = [torch.zeros(4, 3), torch.zeros(2)]
        a, b = gossipers(nodes, [mine, theirs])
        await asyncio.sleep(1)
        result = await a.step()
        try:
            await nodes[0].peer.call(
                nodes[1].peer.peer_id, b.rpc_name, {"v": 1, "schema": a._schema}, timeout=5
            )
        except RemoteError as e:
            error = e
        await shutdown([a, b], nodes)
        return result, error, mine

    with caplog.at_level(logging.INFO, logger="swarmgrad.averaging.gossip.averager"):
        result, error, mine = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert not result.mixed and result.skipped == "no peer answered"
    assert "tensor 0:" in str(error) and "has float32[3, 4], this peer float32[4, 3]" in str(error)
    assert "tensor 0:" in result.failures[0]
    assert torch.equal(mine[0], torch.zeros(3, 4))
    with pytest.raises(ValidationError, match="averaged tensor 0 must be a floating-point"):
        AsyncGossipAverager([torch.zeros(2, dtype=torch.int64)], None, None, prefix="x")


def test_nan_parameters_from_a_peer_are_rejected():
    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(5))
        mine, theirs = [torch.ones(3)], [torch.tensor([1.0, float("nan"), 2.0])]
        a, b = gossipers(nodes, [mine, theirs])
        await asyncio.sleep(1)
        result = await a.step()
        await shutdown([a, b], nodes)
        return result, mine

    result, mine = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert not result.mixed and "tensor 0 from" in result.failures[0]
    assert "NaN or Inf" in result.failures[0]
    assert torch.equal(mine[0], torch.ones(3))


def test_fetch_probability_and_client_mode():
    async def main(network):
        nodes = await start_nodes(network, 3, random.Random(6))
        never, server = gossipers(
            nodes[:2], [[torch.zeros(2)], [torch.ones(2)]], fetch_probability=0
        )
        client = AsyncGossipAverager(
            [torch.ones(2) * 3], nodes[2].peer, nodes[2], prefix=PREFIX, client_mode=True
        )
        client.start()
        await asyncio.sleep(1)
        skipped = [await never.step() for _ in range(10)]
        pulled = await client.step()
        found = await nodes[0].get(f"{PREFIX}.gossip", latest=True)
        known = [PeerID.from_base58(subkey) for subkey in found.value]
        await shutdown([never, server, client], nodes)
        served = never.pulls_served + server.pulls_served
        return skipped, pulled, known, client.peer.peer_id, served

    skipped, pulled, known, client_id, served = run_simulation(
        main, latency=0.01, check_leftover_tasks=True
    )
    assert all(r.skipped == "fetch_probability" for r in skipped)
    assert pulled.mixed and served == 1
    assert len(known) == 2 and client_id not in known  # a client pulls but is not declared


def test_compressed_pulls_mix_the_decompressed_values():
    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(7))
        mine, theirs = [torch.zeros(5)], [torch.linspace(0, 1, 5)]
        a, b = gossipers(nodes, [mine, theirs], compression="float16", mixing_constant=1.0)
        await asyncio.sleep(1)
        result = await a.step()
        await shutdown([a, b], nodes)
        return result, mine[0]

    result, got = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert result.mixed and got.dtype == torch.float32
    assert torch.allclose(got, torch.linspace(0, 1, 5), atol=1e-3)


# ---------------------------------------------------------------------- synchronous facade


def test_synchronous_facade_over_real_dhts():
    first = DHT(start=True)
    second = DHT(initial_peers=[str(first.get_visible_maddrs()[0])], start=True)
    a_tensors, b_tensors = [torch.zeros(3)], [torch.full((3,), 2.0)]
    a = GossipAverager(a_tensors, first, prefix=PREFIX, start=True, request_timeout=10)
    b = GossipAverager(b_tensors, second, prefix=PREFIX, start=True, request_timeout=10)
    try:
        deadline = time.monotonic() + 60
        result = a.step(timeout=30)
        while not result.mixed and time.monotonic() < deadline:  # until b's declaration lands
            time.sleep(0.05)
            result = a.step(timeout=30)
        assert result is not None and result.mixed and result.peer == second.peer_id
        with a.get_tensors() as tensors:
            assert torch.allclose(tensors[0], torch.full((3,), 1.0))
        future = b.step(wait=False)
        assert future.result(30).mixed
        assert statistics.fmean(b_tensors[0].tolist()) == pytest.approx(1.5)
    finally:
        a.shutdown()
        b.shutdown()
        second.shutdown()
        first.shutdown()
    assert not a.is_alive()
    with pytest.raises(ValidationError, match="not running"):
        a.step()
