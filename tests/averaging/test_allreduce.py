"""Butterfly all-reduce between real peers on loopback (in one process) and on the
simulated network: averages, modes, faults, bad input, deadlines."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from swarmgrad.averaging.allreduce import (
    AGGREGATE_PART,
    PROTOCOL_VERSION,
    AllReduceRouter,
    AllReduceRunner,
    AveragingMode,
    GroupMismatch,
)
from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.allreduce.partition import tensor_schema
from swarmgrad.averaging.allreduce.protocol import encode_message, read_message
from swarmgrad.averaging.allreduce.streams import owners_after
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.compression import CompressionType, Uniform8BitQuantization
from swarmgrad.compression.base import tensor_bytes
from swarmgrad.net.peer import Peer
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from swarmgrad.utils.errors import ValidationError
from tests.helpers.peers import make_group, make_peers

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
FAST = AdaptiveTimeouts(min_timeout=2.0)  # generous for a busy box, short for a test


def random_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(37, 11, generator=generator),
        torch.randn(5, generator=generator),
        torch.randn(300, generator=generator).double(),
    ]


async def run_round(peers, tensors, group=None, per_peer=None, **kwargs):
    group = group or make_group(peers)
    per_peer = per_peer or [{} for _ in peers]
    kwargs.setdefault("part_size_bytes", 256)
    kwargs.setdefault("timeouts", FAST)
    runners = [
        AllReduceRunner(peer, group, ts, **{**kwargs, **extra})
        for peer, ts, extra in zip(peers, tensors, per_peer, strict=True)
    ]
    return await asyncio.gather(*(r.run() for r in runners), return_exceptions=True)


async def shutdown(peers):
    for peer in peers:
        await peer.shutdown()


def mean_of(tensors, members, weights=None):
    weights = weights or [1.0] * len(members)
    total = sum(weights)
    return [
        sum(w * tensors[m][i] for m, w in zip(members, weights, strict=True)) / total
        for i in range(len(tensors[0]))
    ]


def assert_close(got, want):
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()


def span_views(tensors, span_sizes):
    """Each span's values of the flattened tensors (as float64)."""
    flat = torch.cat([t.double().reshape(-1) for t in tensors])
    out, start = [], 0
    for size in span_sizes:
        out.append(flat[start : start + size])
        start += size
    return out


# ---------------------------------------------------------------------------- averages


def test_four_peers_end_with_the_exact_average_and_identical_values(arun):
    async def main():
        peers = await make_peers(4)
        tensors = [random_tensors(i) for i in range(4)]
        expected = mean_of([[t.clone() for t in ts] for ts in tensors], range(4))
        results = await run_round(peers, tensors)
        await shutdown(peers)
        return tensors, expected, results

    tensors, expected, results = arun(main)
    for result in results:
        assert result.fully_averaged and result.averaged_spans == {0, 1, 2, 3}
    for ts in tensors:
        assert_close(ts, expected)
        for got, first in zip(ts, tensors[0], strict=True):
            assert torch.equal(got, first)  # every member holds the same bits


def test_weights_give_the_weighted_average(arun):
    weights = [1.0, 2.0, 3.0, 10.0]

    async def main():
        peers = await make_peers(4)
        tensors = [random_tensors(i) for i in range(4)]
        expected = mean_of([[t.clone() for t in ts] for ts in tensors], range(4), weights)
        await run_round(peers, tensors, per_peer=[{"weight": w} for w in weights])
        await shutdown(peers)
        return tensors, expected

    tensors, expected = arun(main)
    for ts in tensors:
        assert_close(ts, expected)


def test_client_sends_without_owning_and_aux_owns_without_contributing(arun):
    modes = [NODE, NODE, CLIENT, AUX]

    async def main():
        peers = await make_peers(4)
        tensors = [random_tensors(i) for i in range(4)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        results = await run_round(peers, tensors, modes=modes)
        await shutdown(peers)
        return tensors, originals, results

    tensors, originals, results = arun(main)
    expected = mean_of(originals, [0, 1, 2])  # the auxiliary member's values are not in it
    for member in (0, 1, 2):
        assert_close(tensors[member], expected)
        assert results[member].fully_averaged
    for got, original in zip(tensors[3], originals[3], strict=True):
        assert torch.equal(got, original)  # an auxiliary member's tensors are left alone
    spans = results[0].averaged_spans
    assert 2 not in spans and spans == {0, 1, 3}  # the client owns no span


def test_lossy_compression_still_leaves_every_member_with_the_same_bits(arun):
    async def main():
        peers = await make_peers(3)
        tensors = [random_tensors(i) for i in range(3)]
        expected = mean_of([[t.clone() for t in ts] for ts in tensors], range(3))
        await run_round(peers, tensors, compression=CompressionType.FLOAT16)
        await shutdown(peers)
        return tensors, expected

    tensors, expected = arun(main)
    for ts in tensors:
        for got, want, first in zip(ts, expected, tensors[0], strict=True):
            assert torch.allclose(got, want, atol=1e-2)
            assert torch.equal(got, first)


def test_deflated_parts_average_to_the_same_bits_with_fewer_bytes(arun):
    """Deflate is lossless and sender-side: a round whose members deflate ends with the
    same values as one whose members do not, bit for bit, and moves fewer bytes."""

    def peaked(seed):
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(40_000, generator=generator) ** 3]

    async def one_round(deflate_by):
        peers = await make_peers(3)
        tensors = [peaked(i) for i in range(3)]
        codecs = [Uniform8BitQuantization(deflate=d) for d in deflate_by]
        await run_round(
            peers, tensors, part_size_bytes=8192, per_peer=[{"compression": c} for c in codecs]
        )
        sent = sum(p.bytes_sent for p in peers)
        await shutdown(peers)
        return tensors, sent

    async def main():
        return await one_round([False] * 3), await one_round([True, True, False])

    (plain, plain_sent), (deflated, deflated_sent) = arun(main)
    for got, want in zip(deflated, plain, strict=True):
        assert torch.equal(got[0], want[0])
    assert deflated_sent < 0.9 * plain_sent


def test_averaging_alpha_moves_values_part_way(arun):
    async def main():
        peers = await make_peers(2)
        tensors = [[torch.zeros(10)], [torch.ones(10)]]
        await run_round(peers, tensors, averaging_alpha=0.5)
        await shutdown(peers)
        return tensors

    tensors = arun(main)
    assert torch.allclose(tensors[0][0], torch.full((10,), 0.25))
    assert torch.allclose(tensors[1][0], torch.full((10,), 0.75))


def test_large_parts_stream_through_several_windows(arun, monkeypatch):
    """Owners receive at most a window per sender at a time (bounded memory)."""
    from swarmgrad.averaging.allreduce import owner

    monkeypatch.setattr(owner, "RECEIVE_WINDOW_BYTES", 3000)

    async def main():
        peers = await make_peers(3)
        tensors = [[torch.randn(10_000)] for _ in range(3)]
        expected = mean_of([[t.clone() for t in ts] for ts in tensors], range(3))
        results = await run_round(peers, tensors, part_size_bytes=1024)
        await shutdown(peers)
        return tensors, expected, results

    tensors, expected, results = arun(main)
    assert all(r.fully_averaged for r in results)
    for ts in tensors:
        assert_close(ts, expected)


# ---------------------------------------------------------------------------- faults


async def make_sim_peers(network, n: int) -> list[Peer]:
    peers = [await create_sim_peer(network) for _ in range(n)]
    for peer in peers:
        for other in peers:
            if other is not peer:
                peer.add_addresses(other.peer_id, other.get_visible_maddrs())
    return peers


# The tests that depend on timers run on the simulated network: its clock is virtual, so
# a busy machine cannot make an honest peer look stalled.


def test_a_sender_that_stalls_is_excluded_and_the_rest_average():
    async def main(network):
        peers = await make_sim_peers(network, 4)
        tensors = [random_tensors(i) for i in range(4)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        modes = [NODE, NODE, NODE, CLIENT]
        runners = [
            AllReduceRunner(
                p, group, ts, modes=modes, part_size_bytes=256, sender_timeout=0.3, timeouts=FAST
            )
            for p, ts in zip(peers, tensors, strict=True)
        ]

        async def stall(stream, span_index, sent):
            await asyncio.sleep(3600)

        runners[3]._send_parts = stall  # the client never sends its data
        results = await asyncio.gather(*(r.run() for r in runners))
        await shutdown(peers)
        return tensors, originals, results, peers[3].peer_id

    tensors, originals, results, client = run_simulation(main, seed=3, latency=0.01)
    expected = mean_of(originals, [0, 1, 2])
    for member in (0, 1, 2):
        assert_close(tensors[member], expected)
        assert client in results[member].excluded_senders
    assert "no progress for 0.3 s" in results[0].excluded_senders[client]
    assert results[3].local_spans == {0, 1, 2}
    for got, original in zip(tensors[3], originals[3], strict=True):
        assert torch.equal(got, original)


def test_a_sender_that_fails_is_excluded_at_once():
    async def main(network):
        peers = await make_sim_peers(network, 4)
        tensors = [random_tensors(i) for i in range(4)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        modes = [NODE, NODE, NODE, CLIENT]
        runners = [
            AllReduceRunner(p, group, ts, modes=modes, part_size_bytes=256, timeouts=FAST)
            for p, ts in zip(peers, tensors, strict=True)
        ]

        async def fail(stream, span_index, sent):
            raise ConnectionResetError("disk on fire")

        runners[3]._send_parts = fail
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(r.run() for r in runners))
        elapsed = asyncio.get_running_loop().time() - started
        await shutdown(peers)
        return tensors, originals, results, elapsed

    tensors, originals, results, elapsed = run_simulation(main, seed=4, latency=0.01)
    for member in (0, 1, 2):
        assert_close(tensors[member], mean_of(originals, [0, 1, 2]))
        assert "disk on fire" in next(iter(results[member].excluded_senders.values()))
    assert elapsed < 0.5  # a few round trips of 20 ms; no timer ran out


def test_a_reducer_that_dies_leaves_its_span_local_and_the_rest_averaged(arun):
    modes = [NODE, NODE, NODE, AUX]

    async def main():
        peers = await make_peers(4)
        tensors = [random_tensors(i) for i in range(4)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        runners = [
            AllReduceRunner(p, group, ts, modes=modes, part_size_bytes=256, timeouts=FAST)
            for p, ts in zip(peers, tensors, strict=True)
        ]

        deaths = []

        def die(part_index):  # the moment it would send its first average, it dies
            deaths.append(asyncio.ensure_future(peers[3].shutdown()))
            raise ConnectionResetError("the owner's process died")

        runners[3]._reply = die
        results = await asyncio.gather(*(r.run() for r in runners), return_exceptions=True)
        await asyncio.gather(*deaths)
        await shutdown(peers)
        return tensors, originals, results, runners[3].span_sizes

    tensors, originals, results, span_sizes = arun(main)
    expected = span_views(mean_of(originals, [0, 1, 2]), span_sizes)
    for member in (0, 1, 2):
        got = span_views(tensors[member], span_sizes)
        local = span_views(originals[member], span_sizes)
        for span in range(3):
            assert torch.allclose(got[span], expected[span], atol=1e-5)
        assert torch.equal(got[3], local[3])  # the dead owner's span kept local values
        assert results[member].local_spans == {3}


def test_a_reducer_that_stalls_leaves_its_span_local():
    async def main(network):
        peers = await make_sim_peers(network, 3)
        tensors = [random_tensors(i) for i in range(3)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        runners = [
            AllReduceRunner(
                p, group, ts, part_size_bytes=256, reducer_timeout=0.3, sender_timeout=0.2
            )
            for p, ts in zip(peers, tensors, strict=True)
        ]

        async def never_answer(stream, hello):
            await asyncio.sleep(3600)

        runners[2]._serve_sender = never_answer
        results = await asyncio.gather(*(r.run() for r in runners))
        await shutdown(peers)
        return tensors, originals, results, runners[0].span_sizes

    tensors, originals, results, span_sizes = run_simulation(main, seed=5, latency=0.01)
    for member in (0, 1):
        got = span_views(tensors[member], span_sizes)
        local = span_views(originals[member], span_sizes)
        assert torch.equal(got[2], local[2])
        assert results[member].local_spans == {2}
        assert "did not answer" in next(iter(results[member].failed_reducers.values()))


def test_the_round_ends_at_its_deadline_with_tensors_untouched():
    async def main(network):
        peers = await make_sim_peers(network, 3)
        AllReduceRouter.for_peer(peers[2])  # peer 2 knows the protocol but never joins
        tensors = [random_tensors(i) for i in range(3)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        runners = [
            AllReduceRunner(p, group, ts, timeout=0.5)
            for p, ts in zip(peers, tensors[:2], strict=False)
        ]
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(r.run() for r in runners))
        elapsed = loop.time() - started
        await shutdown(peers)
        return tensors, originals, results, elapsed

    tensors, originals, results, elapsed = run_simulation(main, seed=6, latency=0.01)
    assert 0.5 <= elapsed < 0.6
    for member in (0, 1):
        assert results[member].deadline_exceeded
        for got, original in zip(tensors[member], originals[member], strict=True):
            assert torch.equal(got, original)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("compression", [CompressionType.NONE, CompressionType.UNIFORM_8BIT])
def test_a_member_with_different_shapes_gets_a_clear_error_and_the_rest_average(arun, compression):
    """With a codec the parts follow the hello before the owner's answer: the refusal
    must still reach the sender whole, and the others still average."""

    async def main():
        peers = await make_peers(4)
        tensors = [random_tensors(i) for i in range(4)]
        tensors[3][0] = torch.randn(37, 10)
        tensors[3][2] = torch.randn(337).double()  # same total size, other shapes
        originals = [[t.clone() for t in ts] for ts in tensors]
        group = make_group(peers)
        spans = (200, 200, 200, 112)
        runners = [
            AllReduceRunner(
                p,
                group,
                ts,
                span_sizes=spans,
                part_size_bytes=256,
                timeouts=FAST,
                compression=compression,
            )
            for p, ts in zip(peers, tensors, strict=True)
        ]
        results = await asyncio.gather(*(r.run() for r in runners), return_exceptions=True)
        await shutdown(peers)
        return tensors, originals, results, spans

    tensors, originals, results, spans = arun(main)
    assert isinstance(results[3], GroupMismatch)
    assert "tensor 0 is ['float32', [37, 11]]" in str(results[3])
    assert "[37, 10]" in str(results[3])
    expected = span_views(mean_of(originals, [0, 1, 2]), spans)
    atol = 1e-5 if compression is CompressionType.NONE else 0.05
    for member in (0, 1, 2):
        got = span_views(tensors[member], spans)
        for span in range(3):
            assert torch.allclose(got[span], expected[span], atol=atol)
        assert results[member].local_spans == {3}


@pytest.mark.parametrize("compression", [CompressionType.NONE, CompressionType.UNIFORM_8BIT])
def test_encoded_parts_follow_the_hello_at_once_and_raw_ones_wait_for_the_answer(arun, compression):
    """The owner's runner starts late (its router holds the stream for the group): an
    encoded span is already on its way meanwhile, a raw one waits for the owner's ok
    (its receive buffer). Either way the round then averages."""
    numel, part = 64 * 1024, 16 * 1024

    async def main():
        owner, sender = await make_peers(2)
        AllReduceRouter.for_peer(owner).unknown_group_grace = 30.0
        group = make_group([owner, sender])
        tensors = [[torch.full((numel,), 1.0)], [torch.full((numel,), 3.0)]]
        options = dict(
            span_sizes=(numel, 0), part_size_bytes=part, timeouts=FAST, compression=compression
        )
        received = owner.bytes_received
        sending = asyncio.ensure_future(
            AllReduceRunner(sender, group, tensors[1], modes=(NODE, CLIENT), **options).run()
        )
        polls = 500 if compression is not CompressionType.NONE else 50  # 10 s or 1 s
        for _ in range(polls):
            if owner.bytes_received - received >= numel // 2:
                break
            await asyncio.sleep(0.02)
        early = owner.bytes_received - received
        owned = AllReduceRunner(owner, group, tensors[0], modes=(NODE, CLIENT), **options)
        results = await asyncio.gather(owned.run(), sending)
        await shutdown([owner, sender])
        return early, results, tensors

    early, results, tensors = arun(main)
    if compression is CompressionType.NONE:
        assert early < part  # the hello only
    else:
        assert early >= numel // 2  # most of the 8-bit span (numel bytes), before any ok
    assert all(r.fully_averaged for r in results)
    for ts in tensors:
        assert torch.allclose(ts[0], torch.full((numel,), 2.0), atol=0.02)


def test_each_member_starts_on_the_owner_after_it():
    """Members send to owners in a rotated order, so that no owner's link is the one
    everybody starts on; owners of empty spans (clients) are skipped."""
    assert owners_after(0, [5, 5, 5, 5]) == [1, 2, 3]
    assert owners_after(2, [5, 5, 5, 5]) == [3, 0, 1]
    assert owners_after(3, [5, 5, 5, 5]) == [0, 1, 2]
    assert owners_after(1, [5, 0, 5, 0, 5]) == [2, 4, 0]
    starts = [owners_after(me, [5] * 8)[0] for me in range(8)]
    assert sorted(starts) == list(range(8))


def test_nan_from_a_peer_excludes_it_with_a_warning(arun, caplog):
    """Peer 3's NaN lies in span 0: owner 0 averages that span without peer 3; the other
    owners get finite values from it and keep it."""

    async def main():
        peers = await make_peers(4)
        tensors = [random_tensors(i) for i in range(4)]
        tensors[3][0][0, 5] = float("nan")
        originals = [[t.clone() for t in ts] for ts in tensors]
        results = await run_round(peers, tensors)
        await shutdown(peers)
        return tensors, originals, results, peers[3].peer_id, results[0]

    with caplog.at_level(logging.WARNING, logger="swarmgrad.averaging.allreduce"):
        tensors, originals, results, bad, _ = arun(main)
    spans = (178, 178, 178, 178)
    without = span_views(mean_of(originals, [0, 1, 2]), spans)
    with_all = span_views(
        mean_of([[t.nan_to_num() for t in ts] for ts in originals], range(4)), spans
    )
    for member in (0, 1, 2):
        got = span_views(tensors[member], spans)
        assert torch.allclose(got[0], without[0], atol=1e-5)
        for span in (1, 2, 3):
            assert torch.allclose(got[span], with_all[span], atol=1e-5)
    assert "NaN or Inf in part 0" in results[0].excluded_senders[bad]
    assert bad not in results[1].excluded_senders
    assert any("NaN or Inf" in record.getMessage() for record in caplog.records)


def test_an_owner_with_nan_in_its_own_span_averages_the_others(arun):
    async def main():
        peers = await make_peers(2)
        tensors = [[torch.ones(8)], [torch.full((8,), 3.0)]]
        tensors[0][0][1] = float("inf")
        results = await run_round(peers, tensors, span_sizes=[8, 0], modes=[NODE, CLIENT])
        await shutdown(peers)
        return tensors, results

    tensors, results = arun(main)
    assert torch.equal(tensors[0][0], torch.full((8,), 3.0))  # the Inf is averaged away
    assert torch.equal(tensors[1][0], torch.full((8,), 3.0))


def test_an_average_that_overflows_leaves_every_span_local(arun):
    """Finite inputs near float32's maximum sum to Inf: the owner keeps its span local
    instead of writing Inf, and the sender refuses the Inf it is sent."""

    async def main():
        peers = await make_peers(2)
        big = torch.finfo(torch.float32).max / 2
        tensors = [[torch.full((8,), big)], [torch.full((8,), big * 1.5)]]
        originals = [[t.clone() for t in ts] for ts in tensors]
        results = await run_round(peers, tensors, span_sizes=[8, 0], modes=[NODE, CLIENT])
        await shutdown(peers)
        return tensors, originals, results

    tensors, originals, results = arun(main)
    for got, want in zip(tensors, originals, strict=True):
        assert torch.equal(got[0], want[0])
    assert results[0].local_spans == frozenset({0})
    assert results[1].local_spans == frozenset({0})
    assert "NaN or Inf" in next(iter(results[1].failed_reducers.values()))


async def open_raw(caller, owner, hello):
    stream = await caller.open_stream(owner.peer_id, AGGREGATE_PART)
    await stream.write(encode_message(hello))
    return stream, await read_message(stream)


def test_parts_for_an_unknown_or_finished_group_are_refused(arun):
    async def main():
        owner, caller = await make_peers(2)
        AllReduceRouter.for_peer(owner).unknown_group_grace = 0.1
        hello = {"v": PROTOCOL_VERSION, "g": b"no such group"}
        _, unknown = await open_raw(caller, owner, hello)
        # a group that ran here and finished
        tensors = [[torch.ones(4)], [torch.zeros(4)]]
        group = make_group([owner, caller])
        await run_round([owner, caller], tensors, group=group)
        _, finished = await open_raw(caller, owner, {**hello, "g": group.group_id})
        _, old_version = await open_raw(caller, owner, {**hello, "v": 99})
        await shutdown([owner, caller])
        return unknown, finished, old_version

    unknown, finished, old_version = arun(main)
    assert unknown["type"] == "UnknownGroup" and "is not running here" in unknown["error"]
    assert finished["type"] == "UnknownGroup" and "has finished" in finished["error"]
    assert "protocol version 99" in old_version["error"]


def sender_hello(group, tensors):
    """The hello a client-mode member sends to owner 0 of a 64-element, one-part span."""
    return {
        "v": PROTOCOL_VERSION,
        "g": group.group_id,
        "span": 0,
        "w": 1.0,
        "codec": "none",
        "schema": tensor_schema(tensors),
        "spans": [64, 0],
        "part": 64,
    }


def test_a_sender_sending_more_than_its_share_is_excluded(arun):
    async def main():
        owner, attacker = await make_peers(2)
        tensors = [torch.ones(64)]
        group = make_group([owner, attacker])
        runner = AllReduceRunner(
            owner, group, tensors, modes=[NODE, CLIENT], part_size_bytes=64, timeouts=FAST
        )
        task = asyncio.ensure_future(runner.run())
        await asyncio.sleep(0)
        hello = sender_hello(group, tensors)
        stream, status = await open_raw(attacker, owner, hello)
        await stream.write(tensor_bytes(torch.full((64,), 3.0)))
        await stream.write(b"extra bytes beyond the share")
        result = await task
        stream.reset()
        await shutdown([owner, attacker])
        return status, result, attacker.peer_id

    status, result, attacker = arun(main)
    assert status["ok"]
    assert "more than the data of its share" in result.excluded_senders[attacker]


def test_a_second_stream_from_the_same_member_is_refused(arun):
    async def main():
        owner, caller = await make_peers(2)
        tensors = [torch.ones(64)]
        group = make_group([owner, caller])
        runner = AllReduceRunner(
            owner, group, tensors, modes=[NODE, CLIENT], part_size_bytes=64, timeout=1.0
        )
        task = asyncio.ensure_future(runner.run())
        await asyncio.sleep(0)
        hello = sender_hello(group, tensors)
        first, ok = await open_raw(caller, owner, hello)
        second, refused = await open_raw(caller, owner, hello)
        first.reset()
        await task
        await shutdown([owner, caller])
        return ok, refused

    ok, refused = arun(main)
    assert ok["ok"]
    assert "opened a second stream" in refused["error"]


def test_duplicate_and_foreign_peer_ids_are_refused(arun):
    async def main():
        a, b, c = await make_peers(3)
        group = make_group([a, b])
        with pytest.raises(ValidationError, match="appears twice"):
            AllReduceRunner(a, group, [torch.ones(2)], ordered_peer_ids=[a.peer_id, a.peer_id])
        with pytest.raises(ValidationError, match="is not a member"):
            AllReduceRunner(c, group, [torch.ones(2)])
        with pytest.raises(ValidationError, match="lists a member twice"):
            GroupInfo(b"g", (a.peer_id, a.peer_id), (b"", b""))
        with pytest.raises(ValidationError, match="client and cannot own a span"):
            AllReduceRunner(a, group, [torch.ones(2)], modes=[CLIENT, NODE], span_sizes=[1, 1])
        with pytest.raises(ValidationError, match="weight must be 0"):
            AllReduceRunner(a, group, [torch.ones(2)], modes=[AUX, NODE], weight=2.0)
        await shutdown([a, b, c])

    arun(main)


# ---------------------------------------------------------------------------- simulation


def test_four_peers_average_over_a_simulated_network_with_latency():
    async def main(network):
        peers = [await create_sim_peer(network) for _ in range(4)]
        for peer in peers:
            for other in peers:
                if other is not peer:
                    peer.add_addresses(other.peer_id, other.get_visible_maddrs())
        tensors = [[torch.randn(20_000)] for _ in range(4)]
        expected = mean_of([[t.clone() for t in ts] for ts in tensors], range(4))
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await run_round(peers, tensors, part_size_bytes=16 * 1024)
        elapsed = loop.time() - started
        await shutdown(peers)
        return tensors, expected, results, elapsed

    tensors, expected, results, elapsed = run_simulation(main, seed=1, latency=0.05, bandwidth=10e6)
    assert all(r.fully_averaged for r in results)
    for ts in tensors:
        assert_close(ts, expected)
    # 60 KB out and back per member at 10 MB/s plus a few round trips of 100 ms
    assert 0.2 < elapsed < 2.0


def test_peers_slower_than_the_guess_still_finish_with_adaptive_waits():
    """Links 100x slower than the initial guess: a part takes longer than any wait sized
    from the guess, yet nobody is dropped, because a wait only runs out when nothing at all
    arrives (and grows with the throughput seen)."""
    timeouts = AdaptiveTimeouts(min_timeout=0.3, initial_rate=10e6)

    async def main(network):
        peers = [await create_sim_peer(network) for _ in range(3)]
        for peer in peers:
            for other in peers:
                if other is not peer:
                    peer.add_addresses(other.peer_id, other.get_visible_maddrs())
        tensors = [[torch.randn(48_000)] for _ in range(3)]
        expected = mean_of([[t.clone() for t in ts] for ts in tensors], range(3))
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await run_round(peers, tensors, part_size_bytes=64 * 1024, timeouts=timeouts)
        elapsed = loop.time() - started
        await shutdown(peers)
        return tensors, expected, results, elapsed

    tensors, expected, results, elapsed = run_simulation(
        main, seed=2, latency=0.02, bandwidth=100e3, chunk_size=8 * 1024
    )
    # a 64 KiB part needs 0.65 s on a link, twice the longest wait the guess allows
    assert elapsed > 2 * 0.65
    assert all(r.fully_averaged for r in results), results
    for ts in tensors:
        assert_close(ts, expected)
