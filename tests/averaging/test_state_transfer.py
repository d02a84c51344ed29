"""State download from donors: several donors at once, donors that die, lie, refuse or
crawl, priorities, timeouts, and donors that stay responsive. Simulated swarms on the
virtual clock, plus real loopback peers where wall-clock behaviour matters."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
import weakref

import torch

from swarmgrad.averaging.state.protocol import declaration_key, parse_declarations
from swarmgrad.averaging.state.transfer import (
    StateDownloader,
    StateSharing,
    load_state_from_peers,
)
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.peer import Peer
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import create_sim_peer
from tests.helpers.peers import shutdown

EPOCH = 1.8e9
PREFIX = "run"
CHUNK = 4096


def make_state(seed: int, size: int = 20_000) -> tuple[dict, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(size, generator=generator),
        torch.randint(0, 1000, (17,), generator=generator),
        torch.randn(3, 5, generator=generator).half(),
    ]
    return {"epoch": seed, "note": "state"}, tensors


def num_chunks(state) -> int:
    return -(-sum(t.numel() * t.element_size() for t in state[1]) // CHUNK)


def same_state(got, expected) -> bool:
    (meta, tensors), (expected_meta, expected_tensors) = got, expected
    return meta == expected_meta and all(
        a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(tensors, expected_tensors, strict=True)
    )


async def start_nodes(network, count: int, rng: random.Random) -> list[DHTNode]:
    loop = asyncio.get_running_loop()
    nodes: list[DHTNode] = []
    for _ in range(count):
        peer = await create_sim_peer(network, rng=rng, keepalive_interval=None)
        initial = [str(nodes[0].peer.get_visible_maddrs()[0])] if nodes else []
        nodes.append(await DHTNode.create(peer, initial, time_fn=lambda: EPOCH + loop.time()))
    return nodes


def share(node: DHTNode, state, cls=StateSharing, **kwargs) -> StateSharing:
    kwargs.setdefault("priority", 1.0)
    kwargs.setdefault("chunk_size_bytes", CHUNK)
    sharing = cls(node.peer, node, prefix=PREFIX, get_state=lambda: state, **kwargs)
    sharing.start()
    return sharing


def host_of(node: DHTNode) -> str:
    return node.peer._backend.host


def test_state_comes_from_three_donors_at_once_and_matches():
    state = make_state(1)

    async def main(network):
        nodes = await start_nodes(network, 5, random.Random(0))
        donors = [share(node, state) for node in nodes[1:4]]
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[4].peer, nodes[4], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        served = [d.stats.chunks_served for d in donors]
        sessions_left = [d.num_sessions for d in donors]
        await shutdown(donors, nodes)
        return result, served, downloader.chunks_from, sessions_left

    result, served, chunks_from, sessions_left = run_simulation(
        main, latency=0.01, bandwidth=50e6, check_leftover_tasks=True
    )
    assert same_state(result, state)
    assert len(chunks_from) == 3 and all(n > 0 for n in served)
    assert sum(chunks_from.values()) == num_chunks(state)  # every chunk exactly once
    assert sessions_left == [0, 0, 0]  # the downloader released its sessions


def test_a_one_chunk_state_comes_from_the_donor_with_the_fastest_announced_link():
    """A lab run of the DeDLOC benchmark had its 10 Mbit/s peer serve a whole model to a
    joiner while a 100 Mbit/s peer with the same state idled: the chunk went to whichever
    donor answered first. Now the donor order decides: priority, then announced links."""
    state = make_state(3)  # 80 KB: one chunk of 1 MiB
    rates = [10.0, 100.0, None, 20.0]

    async def main(network, seed):
        nodes = await start_nodes(network, 5, random.Random(seed))
        donors = [
            share(node, state, chunk_size_bytes=1 << 20, bandwidth=rate)
            for node, rate in zip(nodes[1:], rates, strict=True)
        ]
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[0].peer, nodes[0], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        served = [d.stats.chunks_served for d in donors]
        await shutdown(donors, nodes)
        return result, served

    for seed in range(4):
        result, served = run_simulation(
            lambda network, seed=seed: main(network, seed),
            latency=0.01,
            bandwidth=50e6,
            seed=seed,
            check_leftover_tasks=True,
        )
        assert same_state(result, state)
        assert served == [0, 1, 0, 0], (seed, served)


def test_a_donor_that_dies_midway_is_replaced_and_the_state_is_complete():
    state = make_state(2, size=100_000)

    class DyingDonor(StateSharing):
        def _chunk_parts(self, snapshot, index):
            if self.stats.chunks_served == 5:
                self.network.crash(host_of(self.dht_node))
            return super()._chunk_parts(snapshot, index)

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(1))
        dying = share(nodes[1], state, DyingDonor, priority=2.0)
        dying.network = network
        healthy = share(nodes[2], state)
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX, chunk_timeout=5)
        result = await downloader.run(timeout=60)
        await shutdown([dying, healthy], nodes)
        return result, downloader, dying.peer.peer_id, healthy.peer.peer_id

    result, downloader, dying_id, healthy_id = run_simulation(
        main, latency=0.01, bandwidth=20e6, check_leftover_tasks=True
    )
    assert same_state(result, state)
    assert dying_id in downloader.dropped
    assert downloader.chunks_from[dying_id] <= 5 and downloader.chunks_from[healthy_id] > 0


def test_a_donor_that_sends_corrupt_chunks_is_dropped_and_its_chunks_refetched(caplog):
    state = make_state(3)

    class LyingDonor(StateSharing):
        def _chunk_parts(self, snapshot, index):
            data = bytearray(b"".join(snapshot.chunk(index)))
            data[len(data) // 2] ^= 0xFF
            return [data]

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(2))
        liar = share(nodes[1], state, LyingDonor, priority=5.0)  # the liar looks best
        honest = share(nodes[2], state)
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        await shutdown([liar, honest], nodes)
        return result, downloader, liar.peer.peer_id, honest.peer.peer_id

    with caplog.at_level(logging.WARNING, logger="swarmgrad.averaging.state.download"):
        result, downloader, liar_id, honest_id = run_simulation(
            main, latency=0.01, check_leftover_tasks=True
        )
    assert same_state(result, state)
    assert "does not match its digest" in downloader.dropped[liar_id]
    assert liar_id not in downloader.chunks_from and downloader.chunks_from[honest_id] > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(liar_id) in w and "digest" in w for w in warnings), warnings


def test_a_donor_lying_about_its_metadata_is_dropped(caplog):
    state = make_state(4)

    class BadMetadataDonor(StateSharing):
        async def rpc_manifest(self, request, context):
            answer = await super().rpc_manifest(request, context)
            answer["metadata"] = type(answer["metadata"])(b"\x91\x01")  # msgpack [1]
            return answer

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(3))
        bad = share(nodes[1], state, BadMetadataDonor, priority=9.0)
        good = share(nodes[2], state)
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        await shutdown([bad, good], nodes)
        return result, downloader, bad.peer.peer_id

    result, downloader, bad_id = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert same_state(result, state)
    assert "metadata" in downloader.dropped[bad_id]


def test_a_busy_donor_refuses_clearly_and_another_one_serves():
    state = make_state(5)

    async def main(network):
        nodes = await start_nodes(network, 5, random.Random(4))
        busy = share(nodes[1], state, priority=3.0, max_concurrent_downloads=1)
        free = share(nodes[2], state)
        await asyncio.sleep(1)
        # another joiner holds the busy donor's only slot
        held = await nodes[4].peer.call(busy.peer.peer_id, busy.rpc.manifest, {"v": 1}, timeout=5)
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        await shutdown([busy, free], nodes)
        return result, downloader, held["status"], busy, free

    result, downloader, held, busy, free = run_simulation(
        main, latency=0.01, check_leftover_tasks=True
    )
    assert held == "ok"
    assert same_state(result, state)
    assert downloader.refused[busy.peer.peer_id].startswith("busy:")
    assert busy.stats.refused_busy == 1 and busy.stats.chunks_served == 0
    assert downloader.chunks_from == {free.peer.peer_id: free.stats.chunks_served}


def test_the_highest_priority_state_is_downloaded():
    states = {1.0: make_state(11), 5.0: make_state(15), 3.0: make_state(13)}

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(5))
        donors = {
            priority: share(node, state, priority=priority)
            for node, (priority, state) in zip(nodes[:3], states.items(), strict=True)
        }
        await asyncio.sleep(1)
        result = await load_state_from_peers(nodes[3].peer, nodes[3], prefix=PREFIX, timeout=30)
        served = {p: d.stats.chunks_served for p, d in donors.items()}
        await shutdown(donors.values(), nodes)
        return result, served

    result, served = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert same_state(result, states[5.0])
    assert served[5.0] > 0 and served[1.0] == served[3.0] == 0  # different states, no sharing


def test_a_better_state_that_turns_up_late_takes_over_the_download(caplog):
    """Donor A declared priority 1 but has reached 9 by the time it answers (slowly, from
    an async get_state); the download starts from B (priority 5) and switches to A."""
    state_a, state_b = make_state(31), make_state(35)
    priority_a = [1.0]

    async def slow_get_state():
        await asyncio.sleep(0.5)
        return state_a

    async def main(network):
        nodes = await start_nodes(network, 3, random.Random(12))
        a = StateSharing(nodes[0].peer, nodes[0], prefix=PREFIX, get_state=slow_get_state,
                         priority=lambda: priority_a[0], chunk_size_bytes=CHUNK,
                         declare_state_period=60)  # fmt: skip
        a.start()
        b = share(nodes[1], state_b, priority=5.0)
        await asyncio.sleep(1)
        priority_a[0] = 9.0  # not declared yet
        network.set_link(host_of(nodes[1]), host_of(nodes[2]), bandwidth=50e3)
        result = await load_state_from_peers(nodes[2].peer, nodes[2], prefix=PREFIX, timeout=60)
        served = a.stats.chunks_served, b.stats.chunks_served
        await shutdown([a, b], nodes)
        return result, served

    with caplog.at_level(logging.INFO, logger="swarmgrad.averaging.state.download"):
        result, (from_a, from_b) = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert same_state(result, state_a)
    assert from_b >= 1 and from_a == num_chunks(state_a)  # B had begun; A's chunks all count
    assert any("switching to the state of" in r.getMessage() for r in caplog.records)


def test_donors_with_partly_equal_states_share_the_equal_chunks():
    base = make_state(21, size=50_000)
    newer = (base[0], [t.clone() for t in base[1]])
    newer[1][0][:100] += 1  # only the first chunk differs

    async def main(network):
        nodes = await start_nodes(network, 3, random.Random(6))
        best = share(nodes[0], newer, priority=2.0)
        older = share(nodes[1], base, priority=1.0)
        await asyncio.sleep(1)
        result = await load_state_from_peers(nodes[2].peer, nodes[2], prefix=PREFIX, timeout=30)
        served = best.stats.chunks_served, older.stats.chunks_served
        await shutdown([best, older], nodes)
        return result, served

    result, (from_best, from_older) = run_simulation(
        main, latency=0.01, bandwidth=10e6, check_leftover_tasks=True
    )
    assert same_state(result, newer)
    assert from_best >= 1 and from_older >= 1


def test_a_slow_donor_does_not_hold_the_download_back():
    state = make_state(6, size=64 * CHUNK // 4)

    async def main(network):
        loop = asyncio.get_running_loop()
        nodes = await start_nodes(network, 4, random.Random(7))
        slow = share(nodes[1], state)
        fast = share(nodes[2], state)
        await asyncio.sleep(1)
        # one chunk from the slow donor takes about 4 s; the whole state from the fast one
        # about 0.3 s
        network.set_link(host_of(nodes[1]), host_of(nodes[3]), bandwidth=1000)
        started = loop.time()
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX, chunk_timeout=60)
        result = await downloader.run(timeout=120)
        elapsed = loop.time() - started
        await shutdown([slow, fast], nodes)
        return result, elapsed, downloader.chunks_from, slow.peer.peer_id

    result, elapsed, chunks_from, slow_id = run_simulation(
        main, latency=0.01, bandwidth=1e6, check_leftover_tasks=True
    )
    assert same_state(result, state)
    assert chunks_from[slow_id] == 0  # its chunks were fetched elsewhere before it answered
    assert elapsed < 3.0


def test_no_donor_gives_none_and_unreachable_donors_give_none_within_the_timeout():
    state = make_state(7)

    async def main(network):
        loop = asyncio.get_running_loop()
        nodes = await start_nodes(network, 4, random.Random(8))
        started = loop.time()
        nobody = await load_state_from_peers(nodes[3].peer, nodes[3], prefix=PREFIX, timeout=5)
        no_donor_time = loop.time() - started
        donors = [share(node, state) for node in nodes[1:3]]
        await asyncio.sleep(1)
        network.partition([host_of(nodes[3])], [host_of(n) for n in nodes[1:3]])
        started = loop.time()
        unreachable = await load_state_from_peers(
            nodes[3].peer, nodes[3], prefix=PREFIX, timeout=3, request_timeout=60
        )
        unreachable_time = loop.time() - started
        network.heal()
        await shutdown(donors, nodes)
        return nobody, no_donor_time, unreachable, unreachable_time

    nobody, no_donor_time, unreachable, unreachable_time = run_simulation(
        main, latency=0.01, check_leftover_tasks=True
    )
    assert nobody is None and no_donor_time < 5
    assert unreachable is None and 3 <= unreachable_time <= 3 + 2 + 0.1  # + bounded release


def test_sharing_toggle_and_shutdown_update_the_declaration():
    state = make_state(8)

    async def main(network):
        nodes = await start_nodes(network, 3, random.Random(9))
        reader = nodes[2]
        sharing = share(nodes[1], state, declare_state_period=5.0)

        async def declared() -> list:
            found = await reader.get(declaration_key(PREFIX), latest=True)
            return [r.peer_id for r in parse_declarations(found)]

        await asyncio.sleep(1)
        seen = [await declared()]
        sharing.allow_state_sharing = False
        await asyncio.sleep(1)
        seen.append(await declared())
        refused = await reader.peer.call(
            sharing.peer.peer_id, sharing.rpc.manifest, {"v": 1}, timeout=5
        )
        sharing.allow_state_sharing = True
        await asyncio.sleep(1)
        seen.append(await declared())
        await asyncio.sleep(30)  # refreshed: still declared long after the first expiry
        seen.append(await declared())
        await sharing.shutdown()
        seen.append(await declared())
        await shutdown([], nodes)
        return seen, refused, sharing.peer.peer_id

    seen, refused, donor = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert seen == [[donor], [], [donor], [donor], []]
    assert refused["status"] == "unavailable"


def test_sessions_expire_when_idle_and_concurrent_joiners_share_one_snapshot():
    state = make_state(9)

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(10))
        sharing = share(nodes[1], state, session_idle_timeout=10.0)
        await asyncio.sleep(1)
        results = await asyncio.gather(
            *(load_state_from_peers(n.peer, n, prefix=PREFIX, timeout=30) for n in nodes[2:])
        )
        snapshots = sharing.stats.snapshots_taken
        opened = await nodes[2].peer.call(
            sharing.peer.peer_id, sharing.rpc.manifest, {"v": 1}, timeout=5
        )
        request = {"session": opened["session"], "index": 0}
        first = await nodes[2].peer.call(sharing.peer.peer_id, sharing.rpc.chunk, request)
        stranger = await nodes[3].peer.call(sharing.peer.peer_id, sharing.rpc.chunk, request)
        await asyncio.sleep(30)
        late = await nodes[2].peer.call(sharing.peer.peer_id, sharing.rpc.chunk, request)
        await shutdown([sharing], nodes)
        return results, snapshots, first["status"], stranger["status"], late["status"]

    results, snapshots, first, stranger, late = run_simulation(
        main, latency=0.01, check_leftover_tasks=True
    )
    assert all(same_state(r, state) for r in results)
    assert snapshots == 1
    assert (first, stranger, late) == ("ok", "expired", "expired")


def test_a_snapshot_nobody_downloads_any_more_is_freed():
    """Once its sessions expired and its reuse period passed, nothing of the sharer still
    holds the snapshot (a keeper serves every restarted trainer a state: each snapshot
    kept alive is a model's worth of memory)."""
    state = make_state(11)

    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(12))
        sharing = share(nodes[0], state, session_idle_timeout=4.0, snapshot_reuse_period=1.0)
        await asyncio.sleep(1)
        result = await load_state_from_peers(nodes[1].peer, nodes[1], prefix=PREFIX, timeout=30)
        snapshot = weakref.ref(sharing._snapshot.snapshot)
        await asyncio.sleep(20)  # sessions idle out, the expiry loop drops the snapshot
        gc.collect()
        alive = snapshot() is not None
        await shutdown([sharing], nodes)
        return result, alive

    result, alive = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert same_state(result, state)
    assert not alive, "the sharer still holds a snapshot nobody downloads"


def test_snapshots_taken_under_the_state_lock_are_consistent():
    """A trainer thread keeps rewriting the donor's live tensors (all to the same value,
    under the lock); every downloaded state must show one value throughout."""
    live = [torch.zeros(50_000), torch.zeros(7, 3)]
    lock = threading.Lock()
    stop_writing = threading.Event()

    def trainer() -> None:
        value = 0.0
        while not stop_writing.is_set():
            value += 1
            with lock:
                for tensor in live:
                    tensor.fill_(value)

    async def main(network):
        nodes = await start_nodes(network, 3, random.Random(13))
        sharing = StateSharing(nodes[0].peer, nodes[0], prefix=PREFIX, priority=1.0,
                               get_state=lambda: ({}, live), state_lock=lock,
                               chunk_size_bytes=CHUNK, snapshot_reuse_period=0.0)  # fmt: skip
        sharing.start()
        await asyncio.sleep(1)
        results = []
        for node in nodes[1:] * 3:
            results.append(await load_state_from_peers(node.peer, node, prefix=PREFIX, timeout=30))
            await asyncio.sleep(1)
        snapshots = sharing.stats.snapshots_taken
        await shutdown([sharing], nodes)
        return results, snapshots

    writer = threading.Thread(target=trainer)
    writer.start()
    try:
        results, snapshots = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    finally:
        stop_writing.set()
        writer.join()
    assert snapshots == len(results) == 6
    for _, tensors in results:
        values = torch.cat([t.flatten() for t in tensors]).unique()
        assert len(values) == 1 and values.item() > 0


def test_a_donor_shutting_down_answers_pending_manifest_requests():
    async def never_ready():
        await asyncio.sleep(3600)

    async def main(network):
        loop = asyncio.get_running_loop()
        nodes = await start_nodes(network, 2, random.Random(14))
        sharing = StateSharing(nodes[0].peer, nodes[0], prefix=PREFIX, get_state=never_ready)
        sharing.start()
        request = nodes[1].peer.call(nodes[0].peer.peer_id, sharing.rpc.manifest, {"v": 1})
        pending = asyncio.ensure_future(request)
        await asyncio.sleep(1)
        started = loop.time()
        await sharing.shutdown()
        answer = await asyncio.wait_for(pending, 60)
        waited = loop.time() - started
        await shutdown([], nodes)
        return answer, waited

    answer, waited = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert answer["status"] == "unavailable" and "shutting down" in answer["reason"]
    assert waited < 1


def test_a_donor_refuses_an_out_of_range_chunk_with_a_clear_error():
    state = make_state(10)

    async def main(network):
        nodes = await start_nodes(network, 2, random.Random(11))
        sharing = share(nodes[0], state)
        opened = await nodes[1].peer.call(nodes[0].peer.peer_id, sharing.rpc.manifest, {"v": 1})
        try:
            await nodes[1].peer.call(
                nodes[0].peer.peer_id,
                sharing.rpc.chunk,
                {"session": opened["session"], "index": 99},
            )
        except Exception as e:
            error = e
        await shutdown([sharing], nodes)
        return error

    error = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert f"chunk index 99 is out of range [0, {num_chunks(state)})" in str(error)


# ---------------------------------------------------------------------- real loopback peers


async def start_tcp_nodes(count: int) -> list[DHTNode]:
    nodes: list[DHTNode] = []
    for _ in range(count):
        peer = await Peer.create()
        initial = [str(nodes[0].peer.get_visible_maddrs()[0])] if nodes else []
        nodes.append(await DHTNode.create(peer, initial))
    return nodes


async def wait_declared(node: DHTNode, count: int, timeout: float = 60) -> None:
    """Until ``count`` donors are visible in the DHT (real peers: no fixed sleep)."""
    async with asyncio.timeout(timeout):
        while True:
            found = await node.get(declaration_key(PREFIX), latest=True)
            if len(parse_declarations(found)) >= count:
                return
            await asyncio.sleep(0.05)


async def echo(request, context):
    return request


def test_donors_keep_answering_other_calls_while_they_snapshot_and_serve(arun):
    """A slow, blocking get_state runs in a worker thread: while it is stuck, and while a
    download is under way, the donors answer other RPCs."""
    state = make_state(12, size=2_000_000)  # 8 MB
    release = threading.Event()
    called_from = []

    class GatedDonor(StateSharing):
        """Holds chunk 12 and later until the test opens the gate."""

        gate: asyncio.Event
        reached: asyncio.Event

        async def rpc_chunk(self, request, context):
            if request["index"] >= 12:
                self.reached.set()
                await self.gate.wait()
            return await super().rpc_chunk(request, context)

    async def main():
        loop = asyncio.get_running_loop()
        arrivals: asyncio.Queue[str] = asyncio.Queue()

        def blocking_get_state():
            loop.call_soon_threadsafe(arrivals.put_nowait, threading.current_thread().name)
            assert release.wait(30)
            return state

        nodes = await start_tcp_nodes(4)
        gate, reached = asyncio.Event(), asyncio.Event()
        donors = []
        for node in nodes[1:3]:
            node.peer.add_handler("echo", echo)
            donor = GatedDonor(node.peer, node, prefix=PREFIX, get_state=blocking_get_state,
                               priority=1.0, chunk_size_bytes=256 * 1024)  # fmt: skip
            donor.gate, donor.reached = gate, reached
            donor.start()
            donors.append(donor)
        await wait_declared(nodes[3], 2)
        downloader = StateDownloader(
            nodes[3].peer, nodes[3], prefix=PREFIX, request_timeout=30, chunks_in_flight_per_donor=3
        )
        download = asyncio.ensure_future(downloader.run(timeout=60))
        async with asyncio.timeout(60):
            called_from.extend([await arrivals.get(), await arrivals.get()])
        # both donors are stuck in get_state, and they still answer
        for node in nodes[1:3]:
            assert await nodes[0].peer.call(node.peer.peer_id, "echo", b"1", timeout=30) == b"1"
        release.set()
        async with asyncio.timeout(60):
            await reached.wait()
        # mid-download (chunk 12 requested, so at least 13 - 2 donors x 3 slots chunks
        # delivered): still answering
        delivered_mid_download = sum(downloader.chunks_from.values())
        for node in nodes[1:3]:
            assert await nodes[0].peer.call(node.peer.peer_id, "echo", b"2", timeout=30) == b"2"
        gate.set()
        result = await download
        for donor in donors:
            await donor.shutdown()
        for node in nodes:
            await node.shutdown()
            await node.peer.shutdown()
        return result, delivered_mid_download, downloader.chunks_from

    result, delivered_mid_download, chunks_from = arun(main)
    assert same_state(result, state)
    assert all(name not in ("MainThread", "swarmgrad-loop") for name in called_from)
    assert 13 - 2 * 3 <= delivered_mid_download < sum(chunks_from.values())


# ---------------------------------------------------------------------- state compression


def half_precision(state):
    """What a float16-compressed download of ``state`` gives back."""
    metadata, tensors = state
    return metadata, [t.half().to(t.dtype) if t.is_floating_point() else t for t in tensors]


def test_a_float16_state_moves_half_the_bytes_from_several_donors():
    state = make_state(11)
    raw_bytes = sum(t.numel() * t.element_size() for t in state[1])

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(11))
        donors = [share(node, state, state_compression="float16") for node in nodes[1:3]]
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        served = sum(d.stats.bytes_served for d in donors)
        await shutdown(donors, nodes)
        return result, downloader, served

    result, downloader, served = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert same_state(result, half_precision(state))
    manifest = downloader.manifest
    assert manifest.decoded_bytes == raw_bytes
    # float32 and float16 tensors cost 2 bytes per value, the int64 one stays exact
    assert manifest.total_bytes == 20_000 * 2 + 17 * 8 + 15 * 2
    assert downloader.bytes_received == served == manifest.total_bytes  # each chunk once
    assert downloader.bytes_received < 0.51 * raw_bytes
    assert len(downloader.chunks_from) == 2  # identical manifests: both donors served


def test_a_corrupt_compressed_chunk_is_refused_and_fetched_from_another_donor():
    state = make_state(12)

    class LyingDonor(StateSharing):
        def _chunk_parts(self, snapshot, index):
            data = bytearray(b"".join(snapshot.chunk(index)))
            data[len(data) // 3] ^= 0x10
            return [data]

    async def main(network):
        nodes = await start_nodes(network, 4, random.Random(12))
        liar = share(nodes[1], state, LyingDonor, priority=5.0, state_compression="float16")
        honest = share(nodes[2], state, priority=5.0, state_compression="float16")
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[3].peer, nodes[3], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        await shutdown([liar, honest], nodes)
        return result, downloader, liar.peer.peer_id, liar.stats.chunks_served

    result, downloader, liar_id, lies = run_simulation(main, latency=0.01)
    assert lies >= 1  # the liar did send (compressed) chunks, and all were refused
    assert same_state(result, half_precision(state))
    assert "does not match its digest" in downloader.dropped[liar_id]
    assert liar_id not in downloader.chunks_from


def test_a_donor_with_another_codec_does_not_corrupt_the_download():
    state = make_state(13)

    async def main(network):
        nodes = await start_nodes(network, 5, random.Random(13))
        donors = [share(node, state, state_compression="float16") for node in nodes[1:3]]
        other = share(nodes[3], state, state_compression="blockwise_8bit")
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[4].peer, nodes[4], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        await shutdown([*donors, other], nodes)
        return result, downloader, other.peer.peer_id, other.stats.chunks_served

    result, downloader, other_id, other_served = run_simulation(main, latency=0.01)
    # two donors share the float16 manifest: it is the target, and the third donor's
    # chunks (another layout) are never fetched into it
    assert same_state(result, half_precision(state))
    assert other_served == 0 and other_id not in downloader.chunks_from
    assert len(downloader.chunks_from) == 2


def test_a_state_that_does_not_decode_drops_its_donors_and_another_state_is_used(monkeypatch):
    from swarmgrad.averaging.state import chunks as state_chunks

    state = make_state(14)
    real = state_chunks.deserialize_torch_tensor

    def broken_for_bfloat16(serialized):
        value = real(serialized)
        broken = serialized.codec == "bfloat16" and serialized.numel == 20_000
        return value[:-1] if broken else value

    monkeypatch.setattr(state_chunks, "deserialize_torch_tensor", broken_for_bfloat16)

    async def main(network):
        nodes = await start_nodes(network, 5, random.Random(14))
        bad = [
            share(node, state, priority=9.0, state_compression="bfloat16") for node in nodes[1:3]
        ]
        good = share(nodes[3], state, priority=1.0, state_compression="float16")
        await asyncio.sleep(1)
        downloader = StateDownloader(nodes[4].peer, nodes[4], prefix=PREFIX)
        result = await downloader.run(timeout=30)
        await shutdown([*bad, good], nodes)
        return result, downloader, [b.peer.peer_id for b in bad]

    result, downloader, bad_ids = run_simulation(main, latency=0.01, check_leftover_tasks=True)
    assert same_state(result, half_precision(state))
    reasons = {peer: downloader.dropped[peer] for peer in bad_ids}
    # the state of the first target (either of the two) does not decode; the other donor
    # of the same manifest is dropped with it, and the float16 donor's state is used
    target = next(p for p, r in reasons.items() if r.startswith("tensor 0 of the state"))
    (other,) = set(bad_ids) - {target}
    assert reasons[target] == (
        f"tensor 0 of the state from {target} decodes to float32[19999], "
        "the manifest says float32[20000]"
    )
    assert reasons[other] == f"serves the same state as {target}: {reasons[target]}"
