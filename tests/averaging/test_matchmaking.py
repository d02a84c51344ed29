"""Matchmaking on the simulated network: groups form, agree, survive crashes, refuse junk."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import zlib
from collections import Counter
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.matchmaking.driver import Matchmaking
from swarmgrad.averaging.matchmaking.protocol import (
    JOIN_GROUP,
    Accepted,
    Begin,
    Rejection,
    decode_answer,
)
from swarmgrad.averaging.matchmaking.rules import MatchmakingRules
from swarmgrad.net.identity import Identity
from swarmgrad.net.sim import run_simulation
from swarmgrad.utils.errors import ProtocolViolation, SwarmgradError, ValidationError
from tests.helpers.peers import shutdown

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from moshpit_sim import build_dht_swarm


async def make_swarm(network, num_peers, *, seed=0, bits=None, client=(), **kwargs):
    kwargs.setdefault("prefix", "avg")
    kwargs.setdefault("target_group_size", 4)
    kwargs.setdefault("min_matchmaking_time", 3.0)
    kwargs.setdefault("request_timeout", 1.0)
    rng = random.Random(seed)
    nodes = await build_dht_swarm(network, num_peers, rng, client_mode=client)
    matchmakers = [
        Matchmaking(
            node.peer,
            node,
            client_mode=i in client,
            initial_group_bits=bits[i] if bits else "",
            rng=random.Random(rng.getrandbits(64)),
            **kwargs,
        )
        for i, node in enumerate(nodes)
    ]
    return nodes, matchmakers


def check_consistent(results, matchmakers, data):
    """Every member of a group got the identical GroupInfo; nobody is in two groups."""
    by_id = {m.peer.peer_id: i for i, m in enumerate(matchmakers)}
    groups = {}
    for i, info in enumerate(results):
        if info is None:
            continue
        assert matchmakers[i].peer.peer_id in info.peer_ids
        groups.setdefault(info.group_id, []).append((i, info))
    membership = Counter()
    for members in groups.values():
        infos = {info for _, info in members}
        assert len(infos) == 1, "members of one group got different GroupInfos"
        (info,) = infos
        assert sorted(i for i, _ in members) == sorted(by_id[p] for p in info.peer_ids)
        assert list(info.gathered) == [data[by_id[p]] for p in info.peer_ids]
        membership.update(info.peer_ids)
    assert all(count == 1 for count in membership.values())
    return [info for (_, info), *_ in groups.values()]


def test_a_swarm_forms_groups_of_target_size_with_identical_group_info():
    async def main(network):
        rng = random.Random(7)
        bits = [rng.choice(["010", "111"]) for _ in range(40)]
        nodes, mms = await make_swarm(network, 40, seed=7, bits=bits, target_group_size=8)
        data = [f"peer {i}".encode() for i in range(40)]
        results = await asyncio.gather(
            *(
                m.look_for_group(data_for_gather=d, timeout=20)
                for m, d in zip(mms, data, strict=True)
            )
        )
        new_bits = [m.get_group_bits() for m in mms]
        await shutdown(mms, nodes)
        return bits, results, mms, data, new_bits

    bits, results, mms, data, new_bits = run_simulation(main, seed=7, latency=0.02)
    assert all(r is not None for r in results)
    groups = check_consistent(results, mms, data)
    index = {m.peer.peer_id: i for i, m in enumerate(mms)}
    for info in groups:
        assert 2 <= info.group_size <= 8
        assert len({bits[index[p]] for p in info.peer_ids}) == 1  # one key per group
        assert len({new_bits[index[p]] for p in info.peer_ids}) == info.group_size
    # each key holds about 20 peers: groups of 8 fill up, and few stragglers remain
    assert sum(info.group_size == 8 for info in groups) >= 4


def test_client_mode_peers_join_but_never_lead():
    """Two keys, each with one ordinary peer and four client-mode peers (no listener):
    each ordinary peer leads a full group of 4; one client per key is left over, since
    clients never lead."""
    bits = ["0", "1", "0", "0", "0", "0", "1", "1", "1", "1"]

    async def main(network):
        nodes, mms = await make_swarm(network, 10, seed=3, bits=bits, client=range(2, 10))
        accepted = Counter()
        for m in mms:
            original = m._serve_join

            async def counting(request, context, m=m, original=original):
                async for message in original(request, context):
                    if isinstance(message, Accepted):
                        accepted[m.peer.peer_id] += 1
                    yield message

            m._serve_join = counting
        data = [bytes([i]) for i in range(10)]
        results = await asyncio.gather(
            *(
                m.look_for_group(data_for_gather=d, timeout=20)
                for m, d in zip(mms, data, strict=True)
            )
        )
        await shutdown(mms, nodes)
        return results, mms, data, accepted

    results, mms, data, accepted = run_simulation(main, seed=3, latency=0.02)
    groups = check_consistent(results, mms, data)
    leaders = [mms[0].peer.peer_id, mms[1].peer.peer_id]
    assert sorted(accepted.items()) == sorted((leader, 3) for leader in leaders)
    assert sorted(len(set(leaders) & set(info.peer_ids)) for info in groups) == [1, 1]
    assert sorted(info.group_size for info in groups) == [4, 4]


def test_client_mode_peers_alone_find_no_group():
    async def main(network):
        nodes, mms = await make_swarm(network, 4, seed=4, client=range(4))
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(m.look_for_group(timeout=10) for m in mms))
        elapsed = loop.time() - started
        await shutdown(mms, nodes)
        return results, elapsed

    results, elapsed = run_simulation(main, seed=4, latency=0.02)
    assert results == [None] * 4
    assert 10 <= elapsed < 13


def test_followers_of_a_crashed_leader_find_another_group():
    async def main(network):
        nodes, mms = await make_swarm(
            network, 6, seed=5, target_group_size=8, min_matchmaking_time=5.0
        )
        tasks = [
            asyncio.create_task(m.look_for_group(data_for_gather=bytes([i]), timeout=30))
            for i, m in enumerate(mms)
        ]
        await asyncio.sleep(2.0)  # everyone has joined the earliest leader, which waits
        leaders = [i for i, m in enumerate(mms) if m._search and m._search.followers]
        assert len(leaders) == 1 and len(mms[leaders[0]]._search.followers) == 5
        dead = leaders[0]
        network.crash(nodes[dead].peer._backend.host)
        tasks[dead].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await shutdown(mms, nodes)
        return dead, results, [m.peer.peer_id for m in mms]

    dead, results, ids = run_simulation(main, seed=5, latency=0.02)
    assert isinstance(results[dead], asyncio.CancelledError)
    survivors = [r for i, r in enumerate(results) if i != dead]
    assert all(r is not None for r in survivors)
    assert len({r.group_id for r in survivors}) == 1
    assert set(survivors[0].peer_ids) == set(ids) - {ids[dead]}


@pytest.mark.parametrize("how", ["cancel", "crash"])
def test_a_leader_drops_a_follower_that_vanishes_before_the_group_begins(how):
    async def main(network):
        nodes, mms = await make_swarm(
            network, 3, seed=6, target_group_size=8, min_matchmaking_time=5.0
        )
        tasks = [asyncio.create_task(m.look_for_group(timeout=30)) for m in mms]
        await asyncio.sleep(2.0)
        (leader,) = [i for i, m in enumerate(mms) if m._search and m._search.followers]
        gone = next(i for i in range(3) if i != leader)
        if how == "crash":
            network.crash(nodes[gone].peer._backend.host)
        tasks[gone].cancel()
        await asyncio.gather(tasks[gone], return_exceptions=True)
        results = [await t for i, t in enumerate(tasks) if i != gone]
        await shutdown(mms, nodes)
        return results, {mms[i].peer.peer_id for i in range(3) if i != gone}

    results, survivors = run_simulation(main, seed=6, latency=0.02)
    assert all(r is not None and set(r.peer_ids) == survivors for r in results)
    assert results[0] == results[1]


def test_groups_below_min_group_size_disband_and_retry_until_enough_peers_come():
    async def main(network):
        nodes, mms = await make_swarm(
            network, 3, seed=8, target_group_size=8, min_group_size=3, min_matchmaking_time=3.0
        )
        loop = asyncio.get_running_loop()
        early = [asyncio.create_task(m.look_for_group(timeout=20)) for m in mms[:2]]
        await asyncio.sleep(7.0)  # two disbanded rounds of two peers
        assert not any(t.done() for t in early)
        late = await mms[2].look_for_group(timeout=20)
        results = [await t for t in early] + [late]
        finished = loop.time()
        lonely = await asyncio.gather(*(m.look_for_group(timeout=8) for m in mms[:2]))
        await shutdown(mms, nodes)
        return results, lonely, finished

    results, lonely, finished = run_simulation(main, seed=8, latency=0.02)
    assert all(r is not None and r.group_size == 3 for r in results)
    assert len({r.group_id for r in results}) == 1
    assert finished < 7.0 + 8.0
    assert lonely == [None, None]


def test_a_peer_with_followers_hands_them_to_the_earlier_leader_it_joins():
    async def main(network):
        nodes, mms = await make_swarm(
            network, 3, seed=9, target_group_size=8, min_matchmaking_time=6.0
        )
        first = asyncio.create_task(mms[0].look_for_group(timeout=30))
        await asyncio.sleep(0.5)
        second = asyncio.create_task(mms[1].look_for_group(timeout=30))
        await asyncio.sleep(1.5)
        assert set(mms[0]._search.followers) == {mms[1].peer.peer_id}
        # a third peer with an earlier scheduled time: the first one must follow it
        now = nodes[2].time_fn()
        third = asyncio.create_task(mms[2].look_for_group(timeout=30, scheduled_time=now + 2.0))
        results = [await t for t in (first, second, third)]
        await shutdown(mms, nodes)
        return results, {m.peer.peer_id for m in mms}

    results, everyone = run_simulation(main, seed=9, latency=0.02)
    assert all(r is not None and set(r.peer_ids) == everyone for r in results)
    assert len(set(results)) == 1


def test_join_requests_that_break_the_rules_are_refused_with_a_reason():
    async def main(network):
        nodes, mms = await make_swarm(
            network, 3, seed=10, target_group_size=8, min_matchmaking_time=10.0
        )
        leader, asker = mms[0], nodes[2].peer
        task = asyncio.create_task(leader.look_for_group(timeout=30))
        await asyncio.sleep(1.0)
        search = leader._search
        good = {
            "v": 1,
            "prefix": "avg",
            "group_key": search.key,
            "ready_by": search.ready_by + 1,
            "client_mode": False,
            "gather": b"",
        }

        async def ask(request):
            stream = asker.iterate(nodes[0].peer.peer_id, JOIN_GROUP, request, timeout=5)
            try:
                return await anext(stream)
            finally:
                await stream.aclose()

        answers = {
            "not a map": await ask([1, 2]),
            "bad types": await ask({**good, "ready_by": "later"}),
            "unknown prefix": await ask({**good, "prefix": "other"}),
            "wrong key": await ask({**good, "group_key": "avg.0b1"}),
            "earlier": await ask({**good, "ready_by": search.ready_by - 1}),
            "too much data": await ask({**good, "gather": b"x" * (2 << 20)}),
        }
        # an accepted join holds its stream open; a second one from the same peer is refused
        stream = asker.iterate(nodes[0].peer.peer_id, JOIN_GROUP, good, timeout=20)
        answers["accepted"] = await anext(stream)
        answers["duplicate"] = await ask(good)
        assert list(search.followers) == [asker.peer_id]
        result = await task
        answers["group"] = await anext(stream)
        await stream.aclose()
        await shutdown(mms, nodes)
        return answers, result, {asker.peer_id, nodes[0].peer_id}

    answers, result, members = run_simulation(main, seed=10, latency=0.02)
    reasons = {k: v.get("reason") for k, v in answers.items()}
    assert reasons == {
        "not a map": Rejection.UNKNOWN_PREFIX,
        "bad types": Rejection.BAD_REQUEST,
        "unknown prefix": Rejection.UNKNOWN_PREFIX,
        "wrong key": Rejection.BAD_GROUP_KEY,
        "earlier": Rejection.BAD_ORDER,
        "too much data": Rejection.BAD_REQUEST,
        "accepted": None,
        "duplicate": Rejection.DUPLICATE_PEER_ID,
        "group": None,
    }
    assert answers["accepted"]["code"] == "accepted"
    assert "already in this group" in answers["duplicate"]["message"]
    assert answers["group"]["code"] == "begin"
    assert set(result.peer_ids) == members and result.group_size == 2


def test_two_prefixes_on_one_peer_match_independently_and_a_prefix_is_taken_once():
    async def main(network):
        nodes, grads = await make_swarm(network, 4, seed=11, prefix="grads")
        states = [
            Matchmaking(n.peer, n, prefix="state", target_group_size=4, min_matchmaking_time=3)
            for n in nodes
        ]
        with pytest.raises(ValidationError, match="already runs matchmaking for prefix 'state'"):
            Matchmaking(nodes[0].peer, nodes[0], prefix="state", target_group_size=4)
        results = await asyncio.gather(
            *(m.look_for_group(data_for_gather=b"g", timeout=10) for m in grads),
            *(m.look_for_group(data_for_gather=b"s", timeout=10) for m in states),
        )
        await shutdown(grads + states, nodes)
        return results

    results = run_simulation(main, seed=11, latency=0.02)
    assert all(r is not None and r.group_size == 4 for r in results)
    assert len({r.group_id for r in results[:4]}) == 1 and set(results[0].gathered) == {b"g"}
    assert len({r.group_id for r in results[4:]}) == 1 and set(results[4].gathered) == {b"s"}


def test_a_lonely_peer_gives_up_at_its_timeout_and_bad_arguments_are_refused():
    async def main(network):
        nodes, mms = await make_swarm(network, 2, seed=12)
        m = mms[0]
        loop = asyncio.get_running_loop()
        started = loop.time()
        alone = await m.look_for_group(timeout=7.5)
        elapsed = loop.time() - started
        with pytest.raises(ValidationError, match="timeout"):
            await m.look_for_group(timeout=0)
        with pytest.raises(ValidationError, match="data_for_gather must be bytes"):
            await m.look_for_group(data_for_gather="text", timeout=1)
        with pytest.raises(ValidationError, match="over the limit"):
            await m.look_for_group(data_for_gather=b"x" * (2 << 20), timeout=1)
        task = asyncio.create_task(m.look_for_group(timeout=5))
        await asyncio.sleep(0.1)
        with pytest.raises(SwarmgradError, match="already looking"):
            await m.look_for_group(timeout=5)
        await m.shutdown()
        stopped = await task
        with pytest.raises(SwarmgradError, match="shut down"):
            await m.look_for_group(timeout=5)
        for kwargs in (
            {"target_group_size": 1},
            {"target_group_size": 4, "min_group_size": 5},
            {"target_group_size": 4, "request_timeout": 0},
        ):
            with pytest.raises(ValidationError):
                Matchmaking(nodes[1].peer, nodes[1], prefix="x", **kwargs)
        await shutdown(mms, nodes)
        return alone, elapsed, stopped

    alone, elapsed, stopped = run_simulation(main, seed=12, latency=0.02)
    # the deadline passes through DHT time (an epoch of 1.8e9 s, float steps of ~2e-7 s)
    assert alone is None and 7.5 - 1e-6 <= elapsed < 8.5
    assert stopped is None


def run_with_wall_limit(main, seconds, **kwargs):
    """run_simulation, cancelled after ``seconds`` of wall time: a livelock on the virtual
    clock (tasks waking each other without time moving) fails instead of hanging."""

    async def guarded(network):
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        timer = threading.Timer(seconds, lambda: loop.call_soon_threadsafe(task.cancel))
        timer.start()
        try:
            return await main(network)
        finally:
            timer.cancel()
            timer.join()

    return run_simulation(guarded, **kwargs)


@pytest.mark.parametrize("client", [False, True])
def test_a_search_ends_when_the_clock_stops_a_hair_before_its_deadline(client):
    """Regression: asyncio fires timers due within its clock resolution without moving the
    clock. With exact time comparisons, a search whose clock stopped 5e-15 s before its
    deadline (another task's timer) woke up forever on the virtual clock."""

    async def main(network):
        nodes, mms = await make_swarm(network, 2, seed=13, client=(1,) if client else ())
        loop = asyncio.get_running_loop()
        results = []
        for timeout in (2.0, 7.3, 3.1):
            deadline = loop.time() + timeout
            loop.call_at(deadline - 5e-15, lambda: None)
            results.append(await mms[1].look_for_group(timeout=timeout))
            assert abs(loop.time() - deadline) < 1e-3
        await shutdown(mms, nodes)
        return results

    assert run_with_wall_limit(main, 60, seed=13, latency=0.02) == [None, None, None]


@pytest.mark.parametrize("expected", [4, None])
def test_a_group_with_every_expected_peer_begins_without_waiting_out_its_window(expected):
    """The collaborative optimizer knows how many peers a round will have: once they are
    all in, the leader begins instead of waiting for its scheduled time (which short
    epochs would pay at every round). Without the hint the window is waited out."""

    async def main(network):
        nodes, mms = await make_swarm(
            network, 4, seed=3, target_group_size=16, min_matchmaking_time=10.0
        )
        loop = asyncio.get_running_loop()
        began = loop.time()
        results = await asyncio.gather(
            *(
                m.look_for_group(data_for_gather=b"x", timeout=30, expected_size=expected)
                for m in mms
            )
        )
        elapsed = loop.time() - began
        with pytest.raises(ValidationError, match="expected_size"):
            await mms[0].look_for_group(timeout=5, expected_size=1)
        await shutdown(mms, nodes)
        return results, elapsed, mms

    results, elapsed, mms = run_simulation(main, seed=3, latency=0.02)
    assert all(r is not None and r.group_size == 4 for r in results)
    check_consistent(results, mms, [b"x"] * 4)
    if expected:
        assert elapsed < 3.0, elapsed
    else:
        assert elapsed >= 9.0, elapsed


async def _searching(matchmakers):
    await asyncio.gather(*(m._looking.wait() for m in matchmakers))


def test_an_expected_size_changed_mid_search_is_what_the_leader_waits_for():
    """A diloco round is scheduled before the epoch ends, with the peers counted then; a
    peer counted later raises the expected size of the search under way. Raised from 2
    to 3, the leader waits for the third peer, who starts looking 1 s later (with 2 the
    first two would have begun without it); lowered from 4 to 3, a group of three begins
    at once instead of waiting out its 10-s window."""

    async def main(network):
        nodes, mms = await make_swarm(
            network, 3, seed=5, target_group_size=16, min_matchmaking_time=10.0
        )
        loop = asyncio.get_running_loop()

        def looking(m, size):
            return asyncio.create_task(
                m.look_for_group(data_for_gather=b"x", timeout=30, expected_size=size)
            )

        began = loop.time()
        early = [looking(m, 2) for m in mms[:2]]
        await _searching(mms[:2])
        for m in mms[:2]:
            m.set_expected_size(3)
        await asyncio.sleep(1.0)
        late = looking(mms[2], 3)
        raised = [await t for t in [*early, late]]
        raised_elapsed = loop.time() - began

        began = loop.time()
        tasks = [looking(m, 4) for m in mms]
        await _searching(mms)
        await asyncio.sleep(1.0)
        for m in mms:
            m.set_expected_size(3)
        lowered = [await t for t in tasks]
        lowered_elapsed = loop.time() - began
        with pytest.raises(ValidationError, match="expected_size must be an int >= 2"):
            mms[0].set_expected_size(1)
        mms[0].set_expected_size(5)  # no search under way: nothing to change
        await shutdown(mms, nodes)
        return raised, raised_elapsed, lowered, lowered_elapsed, mms

    raised, raised_elapsed, lowered, lowered_elapsed, mms = run_simulation(
        main, seed=5, latency=0.02
    )
    for results in (raised, lowered):
        assert all(r is not None and r.group_size == 3 for r in results)
        check_consistent(results, mms, [b"x"] * 3)
    assert raised_elapsed < 3.0, raised_elapsed
    assert 1.0 <= lowered_elapsed < 3.0, lowered_elapsed


def _count_dht_calls(matchmakers):
    """Wrap each key manager's declare and get_declarations with a counter."""
    calls = Counter()
    for m in matchmakers:
        manager = m.key_manager
        for name in ("declare", "get_declarations"):
            original = getattr(manager, name)

            def counting(*args, _original=original, _key=(m.peer.peer_id, name), **kwargs):
                calls[_key] += 1
                return _original(*args, **kwargs)

            setattr(manager, name, counting)
    return calls


def test_followers_of_a_known_leader_join_it_without_the_dht_and_wait_for_it():
    """Streaming DiLoCo's later fragments meet the peers of the step's first group: with
    the leader as hint, followers that start looking 2 s before it wait at it (held, not
    polling) and touch the DHT not at all; the leader declares once and reads nothing."""

    async def main(network):
        nodes, mms = await make_swarm(
            network, 4, seed=21, target_group_size=16, min_matchmaking_time=4.0
        )
        first = await asyncio.gather(
            *(m.look_for_group(data_for_gather=b"x", timeout=30, expected_size=4) for m in mms)
        )
        assert all(r is not None and r.group_size == 4 for r in first)
        (leader,) = {m.last_group[1] for m in mms}
        assert {m.last_group[0] for m in mms} == {""}
        calls = _count_dht_calls(mms)
        joins = Counter()
        for m in mms:
            original = m._serve_join

            async def counting(request, context, m=m, original=original):
                joins[m.peer.peer_id] += 1
                async for message in original(request, context):
                    yield message

            m._serve_join = counting
        leader_mm = next(m for m in mms if m.peer.peer_id == leader)
        followers = [m for m in mms if m is not leader_mm]
        loop = asyncio.get_running_loop()
        began = loop.time()
        hinted_search = dict(
            data_for_gather=b"y", timeout=30, round_tag="f1", expected_size=4, leader_hint=leader
        )

        async def leader_later():
            await asyncio.sleep(2.0)
            return await leader_mm.look_for_group(**hinted_search)

        results = await asyncio.gather(
            leader_later(),
            *(m.look_for_group(**hinted_search) for m in followers),
        )
        elapsed = loop.time() - began
        await shutdown(mms, nodes)
        return results, leader, followers, calls, joins, elapsed, mms

    results, leader, followers, calls, joins, elapsed, mms = run_simulation(
        main, seed=21, latency=0.02
    )
    assert all(r is not None and r.group_size == 4 for r in results)
    assert len({r.group_id for r in results}) == 1
    assert {m.last_group for m in mms} == {("f1", leader)}
    assert 2.0 <= elapsed < 3.0, elapsed  # began once the leader looked and all had joined
    for m in followers:
        assert calls[(m.peer.peer_id, "declare")] == 0
        assert calls[(m.peer.peer_id, "get_declarations")] == 0
    assert calls[(leader, "declare")] == 1 and calls[(leader, "get_declarations")] == 0
    assert joins == {leader: 3}  # one request per follower: held, not repeated


@pytest.mark.parametrize("trouble", ["dead leader", "other key"])
def test_followers_fall_back_to_the_dht_when_the_known_leader_fails_them(trouble):
    """The hinted leader is gone, or looks under another key (a round of another step):
    the followers notice (the connection fails, or a rejection) and form their group
    through the DHT as usual."""

    async def main(network):
        nodes, mms = await make_swarm(
            network, 4, seed=22, target_group_size=16, min_matchmaking_time=3.0
        )
        hinted = mms[0]
        others = mms[1:]
        if trouble == "dead leader":
            await hinted.shutdown()
            await nodes[0].shutdown()
            await nodes[0].peer.shutdown()
            tasks = []
        else:
            tasks = [asyncio.create_task(hinted.look_for_group(timeout=6, round_tag="other"))]
        hinted_search = dict(
            data_for_gather=b"z", timeout=20, round_tag="f2", expected_size=3,
            leader_hint=hinted.peer.peer_id,
        )  # fmt: skip
        results = await asyncio.gather(*(m.look_for_group(**hinted_search) for m in others))
        await asyncio.gather(*tasks)
        survivors = nodes[1:] if trouble == "dead leader" else nodes
        await shutdown(others if tasks == [] else mms, survivors)
        return results, others

    results, others = run_simulation(main, seed=22, latency=0.02)
    assert all(r is not None and r.group_size == 3 for r in results)
    check_consistent(results, others, [b"z"] * 3)


def test_held_join_requests_are_bounded_and_malformed_holds_are_not_held():
    """A leader keeps at most target_group_size early requests open, each at most as long
    as it asked (and MAX_HOLD); a hold that is not a positive number is no hold."""

    async def main(network):
        nodes, mms = await make_swarm(network, 3, seed=23, target_group_size=2)
        target = nodes[0].peer.peer_id
        asker = nodes[1].peer
        loop = asyncio.get_running_loop()
        request = {
            "v": 1, "prefix": "avg", "group_key": "avg", "ready_by": 1e12,
            "client_mode": False, "gather": b"",
        }  # fmt: skip

        async def ask(hold):
            began = loop.time()
            stream = asker.iterate(target, JOIN_GROUP, {**request, "hold": hold}, timeout=60)
            try:
                answer = await anext(stream)
            finally:
                await stream.aclose()
            return answer.get("reason"), round(loop.time() - began, 1)

        malformed = [await ask(h) for h in ("soon", -1.0, float("nan"), True)]
        held = await asyncio.gather(*(ask(5.0) for _ in range(3)))
        capped = await ask(1000.0)
        await shutdown(mms, nodes)
        return malformed, held, capped

    malformed, held, capped = run_simulation(main, seed=23, latency=0.02)
    assert all(reason == Rejection.NOT_LOOKING and t < 0.5 for reason, t in malformed)
    assert sorted(t for _, t in held)[0] < 0.5  # the third is not held: two already are
    assert [t >= 5.0 for _, t in sorted(held, key=lambda x: x[1])] == [False, True, True]
    assert all(reason == Rejection.NOT_LOOKING for reason, _ in held)
    assert capped == (Rejection.NOT_LOOKING, pytest.approx(30.0, abs=0.5))


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6), st.integers(0, 5))
def test_begin_messages_carry_the_gathered_bytes_exactly_coded_or_not(gathered, me_index):
    ids = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(len(gathered))]
    me = ids[me_index % len(ids)]
    message = Begin(b"g" * 20, tuple(ids), tuple(gathered)).encode()
    begin = decode_answer(message, max_gather_bytes=300)
    rules = MatchmakingRules(me, target_group_size=8)
    info = rules.check_group(begin, ids[0], gathered[ids.index(me)])
    assert list(info.gathered) == gathered and list(info.peer_ids) == ids


def test_begin_messages_with_bad_coded_gathered_data_are_refused_by_name():
    ids = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(3)]
    base = {"code": "begin", "group_id": b"g" * 20, "peer_ids": [p.to_bytes() for p in ids]}
    bomb = zlib.compress(msgpack.packb([b"\0" * 5_000_000, b"", b""]))
    cases = {
        "not bytes": ({"gathered_z": "text"}, "not bytes"),
        "not zlib": ({"gathered_z": b"\x00garbage"}, "undecodable"),
        "cut short": ({"gathered_z": zlib.compress(msgpack.packb([b"a", b"b", b"c"]))[:-4]},
                      "cut short"),
        "too large": ({"gathered_z": bomb}, "over"),
        "not a list": ({"gathered_z": zlib.compress(msgpack.packb({"a": 1}))}, "malformed"),
    }  # fmt: skip
    for name, (extra, match) in cases.items():
        with pytest.raises(ProtocolViolation, match=match):
            decode_answer({**base, **extra}, max_gather_bytes=1 << 20)
            pytest.fail(name)
