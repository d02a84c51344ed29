"""The moe.* RPC handlers through real peers: answers, and a clear error for every bad
request while the server keeps serving."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch
from torch import nn

from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.moe import protocol
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.moe.server.connection_handler import ConnectionHandler
from swarmgrad.utils.errors import RemoteError, UnknownHandler
from tests.helpers.moe_fakes import call_backward, call_forward, serving, until

TIMEOUT = 30.0


class Fragile(nn.Module):
    """A linear layer that raises on inputs above 100 (a bug triggered by some data)."""

    def __init__(self, hidden: int = 4):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        if (x > 100).any():
            raise RuntimeError("activation overflow in Fragile")
        return self.linear(x)


def make_backend(uid: str, module: nn.Module | None = None, hidden: int = 4, **kwargs):
    module = module or Fragile(hidden)
    return ModuleBackend(
        uid,
        module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.5),
        args_schema=BatchTensorDescriptor(hidden),
        **kwargs,
    )


def test_info_forward_and_backward_answer_like_the_local_module(arun):
    backends = {"f.0": make_backend("f.0")}
    reference = copy.deepcopy(backends["f.0"].module)

    async def main():
        async with serving(backends) as (server, client, addr):
            info = await client.call(addr, protocol.INFO, {"uid": "f.0"}, timeout=TIMEOUT)
            assert info["uid"] == "f.0" and info["max_batch_size"] == 4096
            assert protocol.schema_from_message(info["args_schema"]) == (BatchTensorDescriptor(4),)
            x, g = torch.randn(3, 4), torch.randn(3, 4)
            (out,) = await call_forward(client, addr, "f.0", x)
            assert torch.allclose(out, reference(x))
            (grad_x,) = await call_backward(client, addr, "f.0", [x], [g])
            leaf = x.clone().requires_grad_()
            reference(leaf).backward(g)
            assert torch.allclose(grad_x, leaf.grad)
            # the weights moved by one SGD step on the server
            for new, old in zip(
                server.module_backends["f.0"].module.parameters(),
                reference.parameters(),
                strict=True,
            ):
                assert torch.allclose(new, old - 0.5 * old.grad)
                assert not torch.equal(new, old)

    arun(main)


@pytest.mark.parametrize(
    ("tensor", "complaint"),
    [
        (torch.randn(3, 5), r"expert 'f.0'\[0\]: expected shape \['batch', 4\], got \[3, 5\]"),
        (torch.randn(3, 4, 1), r"expected shape \['batch', 4\], got \[3, 4, 1\]"),
        (torch.randn(3, 4).double(), r"expert 'f.0'\[0\]: expected dtype float32, got float64"),
        (torch.ones(3, 4, dtype=torch.int64), "expected dtype float32, got int64"),
    ],
)
def test_a_wrong_input_is_a_clear_remote_error_and_the_server_keeps_serving(
    arun, tensor, complaint
):
    backends = {"f.0": make_backend("f.0")}

    async def main():
        async with serving(backends) as (server, client, addr):
            with pytest.raises(RemoteError, match=complaint) as info:
                await call_forward(client, addr, "f.0", tensor)
            assert info.value.remote_type == "ValidationError"
            with pytest.raises(RemoteError, match=r"grad_outputs of expert 'f.0'\[0\]"):
                await call_backward(client, addr, "f.0", [torch.randn(3, 4)], [tensor])
            (out,) = await call_forward(client, addr, "f.0", torch.randn(2, 4))
            assert out.shape == (2, 4)

    arun(main)


def test_malformed_requests_are_refused_with_what_was_expected(arun):
    backends = {"f.0": make_backend("f.0")}

    async def main():
        async with serving(backends) as (server, client, addr):
            cases = [
                (protocol.FORWARD, ["not", "a", "dict"], "must be a dict with a 'uid' field"),
                (protocol.FORWARD, {"uid": "f.0"}, "must be a dict with a 'inputs' field"),
                (
                    protocol.FORWARD,
                    {"uid": "f.0", "inputs": [{"h": 1}]},
                    r"inputs of expert 'f.0'\[0\]",
                ),
                (protocol.FORWARD, {"uid": "f.0", "inputs": []}, "expected 1 tensors, got 0"),
                (
                    protocol.BACKWARD,
                    {
                        "uid": "f.0",
                        "inputs": tensors_to_message([torch.randn(2, 4)]),
                        "grad_outputs": tensors_to_message([torch.randn(3, 4)]),
                    },
                    "batch size 3 differs from 2",
                ),
            ]
            for name, request, complaint in cases:
                with pytest.raises(RemoteError, match=complaint):
                    await client.call(addr, name, request, timeout=TIMEOUT)
            (out,) = await call_forward(client, addr, "f.0", torch.randn(1, 4))
            assert out.shape == (1, 4)

    arun(main)


def test_an_unknown_uid_is_named_with_the_number_of_hosted_experts(arun):
    backends = {f"f.{i}": make_backend(f"f.{i}") for i in range(3)}

    async def main():
        async with serving(backends) as (server, client, addr):
            for name in (protocol.INFO, protocol.FORWARD):
                with pytest.raises(
                    RemoteError, match=r"hosts no expert 'f.9' \(it hosts 3 experts\)"
                ):
                    await client.call(
                        addr,
                        name,
                        {"uid": "f.9", "inputs": tensors_to_message([torch.randn(1, 4)])},
                        timeout=TIMEOUT,
                    )

    arun(main)


def test_a_request_above_max_batch_size_is_refused_not_hung(arun):
    backends = {"f.0": make_backend("f.0", max_batch_size=8)}

    async def main():
        async with serving(backends) as (server, client, addr):
            with pytest.raises(
                RemoteError, match=r"'f.0': a request of 9 samples exceeds its max_batch_size of 8"
            ):
                await call_forward(client, addr, "f.0", torch.randn(9, 4))
            with pytest.raises(RemoteError, match="exceeds its max_batch_size of 8"):
                await call_backward(client, addr, "f.0", [torch.randn(9, 4)], [torch.randn(9, 4)])
            (out,) = await call_forward(client, addr, "f.0", torch.randn(8, 4))
            assert out.shape == (8, 4)

    arun(main)


def test_an_error_inside_the_module_reaches_every_request_of_its_batch(arun):
    backends = {"f.0": make_backend("f.0", min_batch_size=3, timeout=TIMEOUT)}

    async def main():
        async with serving(backends) as (server, client, addr):
            bad = torch.full((1, 4), 1000.0)
            results = await asyncio.gather(
                call_forward(client, addr, "f.0", torch.randn(1, 4)),
                call_forward(client, addr, "f.0", bad),
                call_forward(client, addr, "f.0", torch.randn(1, 4)),
                return_exceptions=True,
            )
            for result in results:
                assert isinstance(result, RemoteError), result
                assert result.remote_type == "ExpertFailure"
                assert "f.0_forward failed on a batch of 3 requests (3 samples)" in str(result)
                assert "RuntimeError: activation overflow in Fragile" in str(result)
            # still serving, and a good batch works
            outs = await asyncio.gather(
                *(call_forward(client, addr, "f.0", torch.randn(1, 4)) for _ in range(3))
            )
            assert all(out.shape == (1, 4) for (out,) in outs)

    arun(main)


def test_concurrent_calls_are_batched_and_each_gets_its_own_rows(arun):
    backends = {"f.0": make_backend("f.0", min_batch_size=8, timeout=TIMEOUT)}
    reference = copy.deepcopy(backends["f.0"].module)

    async def main():
        async with serving(backends) as (server, client, addr):
            inputs = [torch.randn(2, 4) for _ in range(4)]
            outputs = await asyncio.gather(*(call_forward(client, addr, "f.0", x) for x in inputs))
            for x, (out,) in zip(inputs, outputs, strict=True):
                assert torch.allclose(out, reference(x), atol=1e-6)
            stats = server.module_backends["f.0"].forward_pool.stats
            assert stats.batches == 1 and list(stats.recent_batch_sizes) == [8]

    arun(main)


def test_empty_requests_are_answered_without_touching_the_expert(arun):
    backends = {"f.0": make_backend("f.0")}

    async def main():
        async with serving(backends) as (server, client, addr):
            (out,) = await call_forward(client, addr, "f.0", torch.randn(0, 4))
            (grad,) = await call_backward(
                client, addr, "f.0", [torch.randn(0, 4)], [torch.randn(0, 4)]
            )
            assert out.shape == (0, 4) and grad.shape == (0, 4)
            assert server.runtime.batches_processed == 0

    arun(main)


def test_outputs_travel_with_the_schemas_compression(arun):
    module = Fragile()
    backend = ModuleBackend(
        "f.0",
        module,
        args_schema=BatchTensorDescriptor(4, compression="float16"),
        outputs_schema=BatchTensorDescriptor(4, compression="float16"),
    )

    async def main():
        async with serving({"f.0": backend}) as (server, client, addr):
            x = torch.randn(2, 4)
            reply = await client.call(
                addr,
                protocol.FORWARD,
                {"uid": "f.0", "inputs": tensors_to_message([x])},
                timeout=TIMEOUT,
            )
            assert reply["outputs"][0]["h"]["codec"] == "float16"
            (out,) = tensors_from_message(reply["outputs"])
            assert out.dtype == torch.float32 and torch.allclose(out, module(x), atol=1e-2)

    arun(main)


def test_after_shutdown_calls_get_unknown_handler_and_queued_ones_an_error(arun):
    entered, gate = threading.Event(), threading.Event()

    class Blocking(nn.Module):
        def forward(self, x):
            entered.set()
            assert gate.wait(TIMEOUT)
            return x

    schema = BatchTensorDescriptor(4)
    backends = {"b.0": ModuleBackend("b.0", Blocking(), args_schema=schema, outputs_schema=schema)}

    async def main():
        async with serving(backends) as (server, client, addr):
            pending = asyncio.ensure_future(call_forward(client, addr, "b.0", torch.randn(1, 4)))
            assert await asyncio.to_thread(entered.wait, TIMEOUT)
            queued = asyncio.ensure_future(call_forward(client, addr, "b.0", torch.randn(1, 4)))
            await until(lambda: backends["b.0"].forward_pool.num_pending == 1)
            stopping = asyncio.ensure_future(server.ashutdown())
            await until(lambda: server.runtime._stopping)
            gate.set()
            await stopping
            (out,) = await pending
            assert out.shape == (1, 4)
            with pytest.raises(RemoteError, match=r"b\.0_forward: the server is shutting down"):
                await queued
            with pytest.raises(UnknownHandler):
                await call_forward(client, addr, "b.0", torch.randn(1, 4))

    arun(main)


def test_the_expert_protocol_is_served_under_the_moe_names():
    names = sorted(handler.name for handler in ConnectionHandler({}).rpc_handlers())
    assert names == ["moe.backward", "moe.forward", "moe.info"]
    assert names == sorted([protocol.BACKWARD, protocol.FORWARD, protocol.INFO])


def test_batches_run_on_the_servers_loop_answer_exactly_like_the_device_thread(arun):
    """The same expert served twice, once with the loop's fast path and once without:
    outputs, input gradients, weights after the optimizer steps and a failing batch's
    error are identical, and the fast path was really taken."""
    torch.manual_seed(0)
    module = Fragile()
    answers = {}

    async def serve(budget: float) -> None:
        backends = {"f.0": make_backend("f.0", copy.deepcopy(module))}
        async with serving(backends) as (server, client, addr):
            server.runtime.inline_max_seconds = budget
            generator = torch.Generator().manual_seed(1)
            replies = []
            for _ in range(4):
                x = torch.randn(2, 4, generator=generator)
                g = torch.randn(2, 4, generator=generator)
                replies.append(await call_forward(client, addr, "f.0", x))
                replies.append(await call_backward(client, addr, "f.0", [x], [g]))
            with pytest.raises(RemoteError) as failure:
                await call_forward(client, addr, "f.0", torch.full((1, 4), 1e3))
            replies.append(await call_forward(client, addr, "f.0", torch.ones(1, 4)))
            backend = backends["f.0"]
            stats = backend.forward_pool.stats, backend.backward_pool.stats
            inline = sum(s.inline_batches for s in stats)
            assert (inline > 0) == (budget > 0)
            assert [s.batches for s in stats] == [6, 4]
            assert [s.failed_batches for s in stats] == [1, 0]
            weights = [p.detach().clone() for p in backend.module.parameters()]
            # "ExpertFailure on <server's PeerID>: <message>": the servers' ids differ
            kind, message = str(failure.value).split(": ", 1)
            assert kind.startswith("ExpertFailure on ")
            answers[budget] = replies, message, weights

    async def main():
        await serve(1.0)  # a generous budget: every measured batch fits
        await serve(0.0)

    arun(main)
    (fast, fast_error, fast_weights), (slow, slow_error, slow_weights) = answers[1.0], answers[0.0]
    for fast_reply, slow_reply in zip(fast, slow, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(fast_reply, slow_reply, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fast_weights, slow_weights, strict=True))
    assert fast_error == slow_error and "activation overflow in Fragile" in fast_error
