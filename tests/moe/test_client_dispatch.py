"""The dispatch coroutines on a fresh event loop: nothing is left running afterwards."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from torch import nn

from swarmgrad.dht.node import DHTNode
from swarmgrad.moe.client import MoEBeamSearcher
from swarmgrad.moe.client.dispatch import CallerPool, backward_from_experts, forward_to_experts
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.net.peer import Peer
from tests.helpers.moe_fakes import FakeExpert, FakeExpertServer


async def start(behaviours: dict[str, str]):
    server_peer = await Peer.create()
    server_node = await DHTNode.create(server_peer, [])
    client_peer = await Peer.create()
    address = str(server_peer.get_visible_maddrs()[0])
    client_node = await DHTNode.create(client_peer, [address], client_mode=True)
    experts = {
        uid: FakeExpert(nn.Linear(3, 3), [BatchTensorDescriptor(3)], behaviour=behaviour)
        for uid, behaviour in behaviours.items()
    }
    server = await FakeExpertServer.create(server_node, experts)

    async def stop():
        await server.aclose()
        for node, peer in ((client_node, client_peer), (server_node, server_peer)):
            await node.shutdown()
            await peer.shutdown()

    return client_node, server, stop


def test_stragglers_are_cut_and_leave_no_task_behind(arun):
    async def main():
        node, server, stop = await start({"e.0": "normal", "e.1": "hang", "e.2": "normal"})
        try:
            searcher = MoEBeamSearcher(node, "e", (3,))
            ranked = await searcher.search([np.array([[3.0, 2.0, 1.0]] * 4)], 2, 3)
            candidates = [[info for _, info in sample] for sample in ranked]
            pool = CallerPool(node, timeout=30)
            schema = await pool.get(candidates[0][0]).get_schema()
            x = torch.randn(4, 3)
            outcome = await forward_to_experts(
                candidates,
                [x],
                pool,
                schema,
                k_best=2,
                k_min=1,
                deadline=None,
                timeout_after_k_min=0.05,
                detect_anomalies=False,
            )
            assert outcome.answered == [1, 1, 1, 1]
            assert [a.caller.uid for a in outcome.answers] == ["e.0"]
            assert all("e.1: no answer in time" in f for f in outcome.failures)
            results, failures = await backward_from_experts(
                [(a.caller, a.samples, [x], [torch.ones(4, 3)]) for a in outcome.answers],
                4,
                schema,
                k_min=1,
                deadline=asyncio.get_running_loop().time() + 30,
                timeout_after_k_min=None,
                detect_anomalies=False,
            )
            assert [samples for samples, _ in results] == [[0, 1, 2, 3]] and not failures
            assert server.experts["e.1"].forward_calls == 1
        finally:
            await stop()

    arun(main)


def test_cancelling_a_forward_cancels_its_calls(arun):
    async def main():
        node, server, stop = await start({"e.0": "hang"})
        try:
            searcher = MoEBeamSearcher(node, "e.", (1,))
            ranked = await searcher.search([np.zeros((2, 1))], 1)
            candidates = [[info for _, info in sample] for sample in ranked]
            pool = CallerPool(node, timeout=30)
            schema = await pool.get(candidates[0][0]).get_schema()
            forward = forward_to_experts(
                candidates,
                [torch.zeros(2, 3)],
                pool,
                schema,
                k_best=1,
                k_min=1,
                deadline=None,
                timeout_after_k_min=None,
                detect_anomalies=False,
            )
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await forward
            assert server.experts["e.0"].forward_calls == 1
        finally:
            await stop()

    arun(main)
