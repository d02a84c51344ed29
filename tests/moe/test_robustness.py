"""The MoE package against careless users and hostile peers: every bad input gets an
error naming what was wrong, the server keeps serving everyone else, and nothing leaks
or hangs. (Cases the per-module test files already cover are not repeated here.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from torch import nn

from swarmgrad.compression.wire import tensors_to_message
from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.moe import protocol
from swarmgrad.moe.client import RemoteExpert, RemoteMixtureOfExperts
from swarmgrad.moe.client.beam_search import MoEBeamSearcher
from swarmgrad.moe.dht_records import get_experts_info_on_node, parse_prefix_entries
from swarmgrad.moe.expert_uid import ExpertInfo, ServerInfo
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend, Server
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import DeadlineExceeded, RemoteError, SwarmgradError, ValidationError
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.moe_fakes import FakeExpert, Swarm, call_backward, call_forward, serving, until

TIMEOUT = 30.0
GOOD_PEER = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


def make_backend(uid: str, module: nn.Module | None = None, hidden: int = 4, **kwargs):
    module = module or nn.Linear(hidden, hidden)
    return ModuleBackend(
        uid,
        module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
        args_schema=BatchTensorDescriptor(hidden),
        **kwargs,
    )


# ---------------------------------------------------------------------- hostile clients


def test_hostile_request_fields_are_refused_naming_the_field_and_the_server_keeps_serving(arun):
    backends = {"f.0": make_backend("f.0")}
    x = torch.randn(2, 4)
    lying_header = tensors_to_message([x])[0]
    lying_header = {"h": {**lying_header["h"], "shape": [10**9, 4]}, "b": lying_header["b"]}

    async def main():
        async with serving(backends) as (server, client, addr):
            cases = [
                (protocol.FORWARD, {"uid": 7, "inputs": []}, "hosts no expert 7"),
                (protocol.FORWARD, {"uid": ["f.0"], "inputs": []}, r"hosts no expert \['f.0'\]"),
                (protocol.INFO, {"uid": None}, "hosts no expert None"),
                (protocol.FORWARD, {"uid": "f.0", "inputs": "x"}, "expected a list of tensor"),
                (protocol.FORWARD, {"uid": "f.0", "inputs": [lying_header]}, r"'f.0'\[0\]"),
                (
                    protocol.BACKWARD,
                    {
                        "uid": "f.0",
                        "inputs": tensors_to_message([x]),
                        "grad_outputs": tensors_to_message([x, x]),
                    },
                    r"grad_outputs of expert 'f.0': expected 1 tensors, got 2",
                ),
                (
                    protocol.BACKWARD,
                    {"uid": "f.0", "inputs": tensors_to_message([x])},
                    "'grad_outputs' field",
                ),
            ]
            for name, request, complaint in cases:
                with pytest.raises(RemoteError, match=complaint):
                    await client.call(addr, name, request, timeout=TIMEOUT)
            (out,) = await call_forward(client, addr, "f.0", x)
            assert out.shape == (2, 4)

    arun(main)


def test_backward_without_a_previous_forward_recomputes_it(arun):
    backends = {"f.0": make_backend("f.0")}

    async def main():
        async with serving(backends) as (server, client, addr):
            (grad,) = await call_backward(
                client, addr, "f.0", [torch.randn(3, 4)], [torch.ones(3, 4)]
            )
            assert grad.shape == (3, 4) and torch.isfinite(grad).all()
            assert server.module_backends["f.0"].update_count == 1

    arun(main)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["inputs", "grad_outputs"])
def test_non_finite_backward_tensors_are_refused_and_do_not_poison_the_expert(arun, poison, where):
    backends = {"f.0": make_backend("f.0")}
    weights_before = [p.detach().clone() for p in backends["f.0"].module.parameters()]

    async def main():
        async with serving(backends) as (server, client, addr):
            x, g = torch.randn(3, 4), torch.randn(3, 4)
            (x if where == "inputs" else g)[1, 2] = poison
            with pytest.raises(RemoteError, match=rf"{where} of expert 'f.0'\[0\].*finite"):
                await call_backward(client, addr, "f.0", [x], [g])
            backend = server.module_backends["f.0"]
            assert backend.update_count == 0
            for before, after in zip(weights_before, backend.module.parameters(), strict=True):
                assert torch.equal(before, after)
            (out,) = await call_forward(client, addr, "f.0", torch.randn(2, 4))
            assert torch.isfinite(out).all()

    arun(main)


class Overflowing(nn.Module):
    """Finite inputs, but its gradients overflow to Inf for large ones (an unlucky batch)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) ** 3


def test_an_update_with_non_finite_parameter_gradients_is_skipped_with_a_clear_error(arun):
    backends = {"f.0": make_backend("f.0", Overflowing())}
    weights_before = [p.detach().clone() for p in backends["f.0"].module.parameters()]

    async def main():
        async with serving(backends) as (server, client, addr):
            huge = torch.full((2, 4), 1e30)
            with pytest.raises(RemoteError, match=r"f.0.*non-finite.*gradient"):
                await call_backward(client, addr, "f.0", [huge], [torch.ones(2, 4)])
            backend = server.module_backends["f.0"]
            assert backend.update_count == 0
            for before, after in zip(weights_before, backend.module.parameters(), strict=True):
                assert torch.equal(before, after)
            (grad,) = await call_backward(
                client, addr, "f.0", [torch.randn(2, 4)], [torch.ones(2, 4)]
            )
            assert torch.isfinite(grad).all() and backend.update_count == 1

    arun(main)


class Blocking(nn.Module):
    """Blocks the device thread until released (a slow expert)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x):
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return self.linear(x)


def test_callers_that_give_up_mid_request_leak_nothing_and_others_are_served(arun):
    module = Blocking()
    schema = BatchTensorDescriptor(4, requires_grad=True)
    backends = {"f.0": make_backend("f.0", module, outputs_schema=schema)}

    async def main():
        async with serving(backends) as (server, client, addr):
            pool = server.module_backends["f.0"].forward_pool
            # the first request occupies the device thread; the next ones queue behind it
            first = asyncio.create_task(call_forward(client, addr, "f.0", torch.randn(1, 4)))
            try:
                await asyncio.to_thread(module.entered.wait, TIMEOUT)
                for _ in range(5):
                    with pytest.raises(DeadlineExceeded):
                        await call_forward(client, addr, "f.0", torch.randn(1, 4), timeout=0.2)
                assert pool.num_pending == 5
                # the server learns of each give-up from the stream reset, and cancels
                await until(lambda: all(task.future.cancelled() for task in pool.tasks))
            finally:
                module.release.set()
            (out,) = await first
            assert out.shape == (1, 4)
            (out,) = await call_forward(client, addr, "f.0", torch.randn(2, 4))
            assert out.shape == (2, 4)
            assert pool.num_pending == 0
            assert pool.stats.requests == 2  # the abandoned requests never ran

    arun(main)


def test_a_flood_of_concurrent_requests_is_served_or_refused_clearly(arun):
    backends = {"f.0": make_backend("f.0", max_batch_size=64)}

    async def main():
        async with serving(backends) as (server, client, addr):
            x = torch.randn(1, 4)
            results = await asyncio.gather(
                *(call_forward(client, addr, "f.0", x) for _ in range(600)), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            for error in errors:
                assert isinstance(error, RemoteError) and "calls in flight" in str(error)
            assert len(errors) < 600
            (out,) = await call_forward(client, addr, "f.0", x)
            assert out.shape == (1, 4)
            assert server.module_backends["f.0"].forward_pool.num_pending == 0

    arun(main)


# ---------------------------------------------------------------------- hostile DHT records


def test_prefix_records_with_odd_coordinates_are_skipped():
    record = ValueWithExpiration(
        {
            f"3:{GOOD_PEER}": ValueWithExpiration(["ffn.3.1", ["/ip4/1.2.3.4/tcp/1"]], 1.0),
            f"\u00b2:{GOOD_PEER}": ValueWithExpiration(["ffn.2.1", []], 1.0),  # superscript 2
            f"\u0663:{GOOD_PEER}": ValueWithExpiration(["ffn.3.1", []], 1.0),  # arabic 3
            f"{10**40}:{GOOD_PEER}": ValueWithExpiration(["ffn.1.1", []], 1.0),
            f"-1:{GOOD_PEER}": ValueWithExpiration(["ffn.1.1", []], 1.0),
        },
        1.0,
    )
    entries = parse_prefix_entries("ffn.", record)
    assert sorted(entries) == [3, 10**40]
    assert [uid for uid, _ in entries[3]] == ["ffn.3.1"]


def test_beam_search_and_get_experts_skip_malformed_expert_records(arun):
    async def main():
        peer = await Peer.create()
        node = await DHTNode.create(peer, [])
        try:
            expiration = get_dht_time() + 60
            good = ["/ip4/127.0.0.1/tcp/1"]
            bad_maddrs = ["/ip4/999.1.1.1/tcp/1", "garbage", "/ip4/1.2.3.4/tcp/99999"]
            records = [
                ("ffn.", f"0:{GOOD_PEER}", ["ffn.0", good]),
                ("ffn.", f"1:{GOOD_PEER}", ["ffn.1", bad_maddrs]),
                ("ffn.", f"\u00b2:{GOOD_PEER}", ["ffn.2", good]),
                ("ffn.", f"3:{GOOD_PEER}", ["ffn.3", 17]),
                ("ffn.", f"{10**30}:{GOOD_PEER}", ["ffn.0", good]),
                ("ffn.", f"2:{GOOD_PEER}", {"uid": "ffn.2"}),
                ("ffn.0", GOOD_PEER, good),
                ("ffn.1", GOOD_PEER, bad_maddrs),
                ("ffn.2", "not-a-peer", good),
                ("ffn.3", GOOD_PEER, {"not": "a list"}),
            ]
            for key, subkey, value in records:
                assert await node.store(key, value, expiration, subkey=subkey)
            searcher = MoEBeamSearcher(node, "ffn.", (4,))
            ranked = await searcher.search([torch.tensor([[4.0, 3.0, 2.0, 1.0]])], beam_size=4)
            assert [info.uid for _, info in ranked[0]] == ["ffn.0", "ffn.1"]
            infos = await get_experts_info_on_node(node, ["ffn.0", "ffn.1", "ffn.2", "ffn.3"])
            assert [info is not None for info in infos] == [True, True, False, False]
        finally:
            await node.shutdown()
            await peer.shutdown()

    arun(main)


# ---------------------------------------------------------------------- careless users


@pytest.fixture
def swarm():
    with Swarm() as swarm:
        yield swarm


def test_non_tensor_inputs_to_a_remote_expert_are_refused_naming_the_argument(swarm):
    server = swarm.server({"f.0": FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)])})
    info = ExpertInfo("f.0", (ServerInfo(server.peer.peer_id, (server.address,)),))
    expert = RemoteExpert(info, swarm.client)
    for bad in ([[0.0] * 4], torch.randn(2, 4).numpy(), None):
        with pytest.raises(
            ValidationError, match=r"inputs of expert 'f.0'\[0\]: expected a tensor"
        ):
            expert(bad)
    assert expert(torch.randn(2, 4)).shape == (2, 4)


def test_a_remote_expert_whose_dht_was_shut_down_fails_clearly(swarm):
    server = swarm.server({"f.0": FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)])})
    info = ExpertInfo("f.0", (ServerInfo(server.peer.peer_id, (server.address,)),))
    dht = swarm.dht(client_mode=True)
    expert = RemoteExpert(info, dht, forward_timeout=10.0)
    assert expert(torch.randn(1, 4)).shape == (1, 4)
    dht.shutdown()
    with pytest.raises(SwarmgradError, match="DHT is not running: start it before"):
        expert(torch.randn(1, 4))


def test_a_gate_sized_for_other_inputs_is_a_clear_error(swarm):
    moe = RemoteMixtureOfExperts(
        in_features=4, grid_size=(2,), dht=swarm.client, uid_prefix="ffn.", k_best=1
    )
    with pytest.raises(ValidationError, match=r"in_features=4.*got.*\[2, 5\]"):
        moe(torch.randn(2, 5))


def test_server_create_with_a_raising_optimizer_names_it_and_leaves_nothing_running():
    def broken_optimizer(params):
        raise TypeError("lr is required")

    threads_before = set(threading.enumerate())
    with pytest.raises(ValidationError, match=r"optim_cls.*broken_optimizer.*lr is required"):
        Server.create(
            expert_uids=["e.0"],
            expert_cls="ffn",
            hidden_dim=4,
            optim_cls=broken_optimizer,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        )
    leftover = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not [t for t in leftover if "runtime" in t.name]
