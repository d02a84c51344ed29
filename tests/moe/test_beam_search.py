"""MoEBeamSearcher: exact top-k on product grids, dead prefixes, shared and cached lookups."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.moe.client import MoEBeamSearcher
from swarmgrad.moe.expert_uid import uid_prefixes
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ValidationError
from tests.helpers.moe_fakes import FakeExpert, Swarm

PEERS = [Identity.generate().peer_id for _ in range(3)]
FAR = 1e12  # an expiration time far in the future


class MemoryNode:
    """Just enough of a DHTNode: records in a dict, and a log of the keys asked for."""

    class _Peer:
        def __init__(self):
            self.peer_id = Identity.generate().peer_id
            self.addresses: dict = {}

        def add_addresses(self, peer_id, maddrs):
            self.addresses.setdefault(peer_id, []).extend(maddrs)

    def __init__(self):
        self.records: dict[str, dict] = {}
        self.asked: list[str] = []
        self.peer = self._Peer()

    def declare(self, uid: str, server: int = 0, with_prefixes: bool = True) -> None:
        peer = PEERS[server]
        maddr = f"/ip4/127.0.0.1/tcp/{4000 + server}/p2p/{peer.to_base58()}"
        self.records.setdefault(uid, {})[peer.to_base58()] = [maddr]
        if with_prefixes:
            for prefix, coord in uid_prefixes(uid):
                self.add_prefix_entry(prefix, coord, uid, server)

    def add_prefix_entry(self, prefix: str, coord: int, uid: str, server: int = 0) -> None:
        peer = PEERS[server]
        maddr = f"/ip4/127.0.0.1/tcp/{4000 + server}/p2p/{peer.to_base58()}"
        self.records.setdefault(prefix, {})[f"{coord}:{peer.to_base58()}"] = [uid, [maddr]]

    async def get_many(self, keys, latest=False):
        self.asked.extend(keys)
        await asyncio.sleep(0)
        return {key: self._record(key) for key in keys}

    def _record(self, key):
        entries = self.records.get(key)
        if not entries:
            return None
        return ValueWithExpiration(
            {k: ValueWithExpiration(v, FAR) for k, v in entries.items()}, FAR
        )


def search(searcher, scores, beam_size, num_results=None):
    return asyncio.run(searcher.search(scores, beam_size, num_results))


def brute_force(live_uids, scores, sample):
    def total(uid):
        coords = [int(c) for c in uid.split(".")[1:]]
        return sum(scores[d][sample, c] for d, c in enumerate(coords))

    return sorted((total(uid) for uid in live_uids), reverse=True)


@st.composite
def product_grids(draw):
    grid = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    live = [draw(st.sets(st.integers(0, n - 1), min_size=1)) for n in grid]
    batch = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    beam_size = draw(st.integers(1, 6))
    return grid, live, batch, seed, beam_size


@settings(max_examples=80, deadline=None)
@given(product_grids())
def test_beam_search_finds_the_true_top_k_on_product_grids(case):
    grid, live, batch, seed, beam_size = case
    rng = np.random.default_rng(seed)
    node = MemoryNode()
    uids = ["ffn." + ".".join(map(str, c)) for c in itertools.product(*map(sorted, live))]
    for uid in uids:
        node.declare(uid)
    scores = [rng.normal(size=(batch, n)) for n in grid]
    searcher = MoEBeamSearcher(node, "ffn", grid)
    results = search(searcher, scores, beam_size)
    for s in range(batch):
        expected = brute_force(uids, scores, s)[:beam_size]
        assert [score for score, _ in results[s]] == pytest.approx(expected)
        found_uids = [info.uid for _, info in results[s]]
        assert len(set(found_uids)) == len(found_uids) and set(found_uids) <= set(uids)


@settings(max_examples=60, deadline=None)
@given(
    st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=16),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
)
def test_beam_search_on_ragged_grids_returns_live_sorted_experts(live, beam_size, seed):
    node = MemoryNode()
    uids = [f"ffn.{i}.{j}" for i, j in live]
    for uid in uids:
        node.declare(uid)
    scores = [np.random.default_rng(seed).normal(size=(2, 4)) for _ in range(2)]
    (first, second) = search(MoEBeamSearcher(node, "ffn.", (4, 4)), scores, beam_size)
    for s, result in enumerate((first, second)):
        found = [score for score, _ in result]
        assert found == sorted(found, reverse=True)
        assert len(result) == min(beam_size, len(uids))
        assert {info.uid for _, info in result} <= set(uids)
        rows = {i for i, _ in live}
        if beam_size >= len(rows):  # the beam holds every live row: exact
            assert found == pytest.approx(brute_force(uids, scores, s)[:beam_size])


def test_dead_prefixes_are_skipped_and_remembered():
    node = MemoryNode()
    for uid in ("ffn.0.0", "ffn.0.1", "ffn.2.2"):
        node.declare(uid)
    node.add_prefix_entry("ffn.", 1, "ffn.1.0")  # listed, but "ffn.1." has no record
    scores = [np.array([[0.0, 10.0, 5.0]]), np.array([[1.0, 0.0, 0.0]])]
    searcher = MoEBeamSearcher(node, "ffn", (3, 3))
    (best,) = search(searcher, scores, beam_size=1)
    assert [info.uid for _, info in best] == ["ffn.2.2"]
    assert node.asked == ["ffn.", "ffn.1.", "ffn.2."]
    node.asked.clear()
    search(searcher, scores, beam_size=1)
    assert node.asked == []  # everything came from the cache, the dead prefix too

    forgetful = MoEBeamSearcher(node, "ffn", (3, 3), negative_caching=False)
    search(forgetful, scores, beam_size=1)
    search(forgetful, scores, beam_size=1)
    assert node.asked.count("ffn.1.") == 2


def test_cached_prefixes_expire_after_the_ttl():
    node = MemoryNode()
    node.declare("ffn.0")
    searcher = MoEBeamSearcher(node, "ffn", (2,), prefix_cache_ttl=0.0)
    scores = [np.zeros((1, 2))]
    search(searcher, scores, 1)
    node.declare("ffn.1")
    assert [info.uid for _, info in search(searcher, scores, 2)[0]] == ["ffn.0", "ffn.1"]
    assert node.asked == ["ffn.", "ffn."]


def test_a_batch_fetches_each_prefix_once():
    node = MemoryNode()
    for i, j in itertools.product(range(8), range(8)):
        node.declare(f"ffn.{i}.{j}")
    scores = [np.random.default_rng(0).normal(size=(64, 8)) for _ in range(2)]
    searcher = MoEBeamSearcher(node, "ffn", (8, 8), num_workers=3)
    results = search(searcher, scores, beam_size=3)
    assert all(len(r) == 3 for r in results)
    assert len(node.asked) == len(set(node.asked)) <= 1 + 8


def test_extra_results_come_from_the_final_beam_in_order():
    node = MemoryNode()
    for i, j in itertools.product(range(3), range(3)):
        node.declare(f"ffn.{i}.{j}")
    scores = [np.array([[3.0, 2.0, 1.0]]), np.array([[0.3, 0.2, 0.1]])]
    (ranked,) = search(MoEBeamSearcher(node, "ffn", (3, 3)), scores, 2, num_results=5)
    assert [info.uid for _, info in ranked] == [
        "ffn.0.0",
        "ffn.0.1",
        "ffn.0.2",
        "ffn.1.0",
        "ffn.1.1",
    ]


def test_servers_of_a_uid_are_merged_and_their_addresses_learned():
    node = MemoryNode()
    node.declare("ffn.0", server=0)
    node.declare("ffn.0", server=1)
    (best,) = search(MoEBeamSearcher(node, "ffn.", (1,)), [np.zeros((1, 1))], 1)
    (_, info) = best[0]
    assert {s.peer_id for s in info.servers} == {PEERS[0], PEERS[1]}
    assert set(node.peer.addresses) == {PEERS[0], PEERS[1]}


def test_dropped_coordinates_and_experts_outside_the_grid_are_left_out():
    node = MemoryNode()
    for uid in ("ffn.0.0", "ffn.1.0", "ffn.5.0"):
        node.declare(uid)
    node.declare("ffn.1.0.7", server=1)  # a deeper grid under the same name
    scores = [np.array([[float("-inf"), 1.0]]), np.array([[0.0]])]
    (found,) = search(MoEBeamSearcher(node, "ffn", (2, 1)), scores, 4)
    assert [info.uid for _, info in found] == ["ffn.1.0"]
    nan_scores = [np.array([[float("nan"), float("nan")]]), np.array([[0.0]])]
    assert search(MoEBeamSearcher(node, "ffn", (2, 1)), nan_scores, 4) == [[]]


def test_bad_scores_and_parameters_are_refused():
    searcher = MoEBeamSearcher(MemoryNode(), "ffn", (2, 3))
    with pytest.raises(ValidationError, match="2 grid dimensions"):
        search(searcher, [np.zeros((1, 2))], 1)
    with pytest.raises(ValidationError, match=r"dimension 1: expected shape \[batch, 3\]"):
        search(searcher, [np.zeros((1, 2)), np.zeros((2, 3))], 1)
    with pytest.raises(ValidationError, match="beam_size"):
        search(searcher, [np.zeros((1, 2)), np.zeros((1, 3))], 0)
    with pytest.raises(ValidationError, match="grid_size"):
        MoEBeamSearcher(MemoryNode(), "ffn", (2, 0))
    with pytest.raises(ValidationError, match="prefix"):
        MoEBeamSearcher(MemoryNode(), "bad prefix", (2,))


def test_beam_search_through_a_real_dht():
    with Swarm() as swarm:
        for hosted in (["ffn.0.0", "ffn.0.1", "ffn.1.1"], ["ffn.1.1", "ffn.1.2"]):
            experts = {uid: FakeExpert(nn.Identity(), [BatchTensorDescriptor(2)]) for uid in hosted}
            swarm.server(experts)
        searcher = MoEBeamSearcher(swarm.client, "ffn.", (2, 3))
        scores = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0, 0.5])]
        best = searcher.find_best_experts(scores, beam_size=2)
        assert [info.uid for info in best] == ["ffn.1.1", "ffn.0.1"]
        assert len(best[0].servers) == 2
        batch = searcher.batch_find_best_experts(
            [torch.stack([s, -s]) for s in scores], beam_size=1, return_future=True
        ).result(30)
        assert [[info.uid for info in sample] for sample in batch] == [["ffn.1.1"], ["ffn.0.0"]]


def test_an_empty_grid_is_asked_again_on_the_next_search():
    node = MemoryNode()
    searcher = MoEBeamSearcher(node, "ffn", (2,))
    assert search(searcher, [np.zeros((1, 2))], 1) == [[]]
    node.declare("ffn.1")
    assert [info.uid for _, info in search(searcher, [np.zeros((1, 2))], 1)[0]] == ["ffn.1"]
