"""RemotePipeline against in-process stage servers on loopback: results equal to a local
model, stochastic wiring, retries around liars, late and missing servers, 8-bit."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch
from torch import nn

from swarmgrad.pipeline import protocol
from swarmgrad.pipeline.protocol import (
    BackwardAnswer,
    BackwardRequest,
    ForwardAnswer,
    ForwardRequest,
)
from swarmgrad.pipeline.server import StageServicer
from swarmgrad.utils.errors import DeadlineExceeded, RemoteError, ValidationError
from swarmgrad.utils.loop_thread import run_coroutine
from tests.helpers.pipeline import PipelineSwarm


@pytest.fixture(scope="module")
def swarm():
    with PipelineSwarm() as swarm:
        yield swarm


def local_stages(seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
            nn.Linear(8, 3)]  # fmt: skip


WIDTHS = (4, 8, 8)


def reference(stages, x):
    x = x.detach().clone().requires_grad_()
    out = x
    for stage in stages:
        out = stage(out)
    return x, out


def test_forward_backward_and_updates_match_a_local_model(swarm):
    name = swarm.new_name()
    stages = local_stages()
    for i, module in enumerate(stages):
        swarm.serve(name, i, 3, copy.deepcopy(module), WIDTHS[i], lr=0.1)
    pipe = swarm.pipeline(name, 3, timeout=20)
    x = torch.randn(5, 4, requires_grad=True)
    out = pipe(x)
    out.square().sum().backward()

    x_ref, out_ref = reference(stages, x)
    out_ref.square().sum().backward()
    torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1).step()
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    served = [s for s in swarm.servers if s.pipeline == name]
    for server, module in zip(served, stages, strict=True):  # one optimizer step each
        for remote, local in zip(
            server.backend.module.parameters(), module.parameters(), strict=True
        ):
            torch.testing.assert_close(remote, local)
    assert pipe.stats["forward_hops"] == 3 and pipe.stats["backward_hops"] == 3


def test_micro_batches_spread_over_the_servers_of_a_stage(swarm):
    name = swarm.new_name()
    stages = local_stages()[:2]
    first = [swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4) for _ in range(2)]
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8)
    pipe = swarm.pipeline(name, 2, timeout=20)
    for _ in range(24):
        x = torch.randn(2, 4)
        torch.testing.assert_close(pipe(x), reference(stages, x)[1])
    counts = [s.forward_requests for s in first]
    # equal servers: fewer than 4 of 24 on one of them has a chance of 3e-4
    assert sum(counts) == 24 and min(counts) >= 4, counts
    # the hop deadline adapted from the initial 30 s to the measured (millisecond) hops
    assert pipe.caller.routers[0].hop_deadline() == pipe.caller.options.routing.min_deadline


class WrongShapeServicer(StageServicer):
    """Answers forward with one feature too few."""

    async def rpc_forward(self, request, context):
        message = ForwardRequest.decode(request)
        (out,) = self.server.backend.forward(*message.inputs)
        self.server.forward_requests += 1
        return ForwardAnswer((out[:, :-1],)).encode("none")


class WrongDtypeServicer(StageServicer):
    async def rpc_forward(self, request, context):
        message = ForwardRequest.decode(request)
        (out,) = self.server.backend.forward(*message.inputs)
        self.server.forward_requests += 1
        return ForwardAnswer((out.double(),)).encode("none")


@pytest.mark.parametrize(
    "liar, named", [(WrongShapeServicer, "shape"), (WrongDtypeServicer, "dtype")]
)
def test_wrong_activations_are_refused_naming_them_blamed_and_retried_elsewhere(
    swarm, caplog, liar, named
):
    name = swarm.new_name()
    stages = local_stages()[:2]
    bad = swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4, servicer=liar)
    swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4)
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8)
    pipe = swarm.pipeline(name, 2, timeout=20)
    caplog.set_level(logging.WARNING, logger="swarmgrad.pipeline.client")
    for _ in range(30):
        x = torch.randn(3, 4, requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        x_ref, out_ref = reference(stages, x)
        out_ref.sum().backward()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(x.grad, x_ref.grad)
        if pipe.stats["blamed"]:
            break
    assert pipe.stats["blamed"] == 1 and bad.forward_requests == 1
    assert pipe.caller.routers[0].is_banned(bad.dht.peer_id, time.monotonic())
    assert any(
        named in r.getMessage() and "outputs of stage 0" in r.getMessage() for r in caplog.records
    )


class WrongGradientServicer(StageServicer):
    """Answers backward with input gradients of the wrong shape (or dtype), after doing
    the real backward (so a wrong answer is all that differs)."""

    wrong = "shape"

    async def rpc_backward(self, request, context):
        message = BackwardRequest.decode(request)
        grads = self.server.backend.backward(*message.inputs, *message.grad_outputs)
        self.server.backward_requests += 1
        (grad,) = grads
        grad = grad[:, :-1] if self.wrong == "shape" else grad.double()
        return BackwardAnswer((grad,)).encode("none")


class WrongGradientDtypeServicer(WrongGradientServicer):
    wrong = "dtype"


@pytest.mark.parametrize(
    "liar, named",
    [(WrongGradientServicer, "shape"), (WrongGradientDtypeServicer, "dtype")],
)
def test_wrong_gradients_are_refused_naming_them_blamed_and_retried_elsewhere(
    swarm, caplog, liar, named
):
    name = swarm.new_name()
    stages = local_stages()[:2]
    # stage 1 has two servers, one of them lies in its backward answers; the backward of
    # a micro-batch whose forward went through the liar is tried there first
    bad = swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8, servicer=liar, lr=0.0)
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8, lr=0.0)
    swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4, lr=0.0)
    pipe = swarm.pipeline(name, 2, timeout=20)
    caplog.set_level(logging.WARNING, logger="swarmgrad.pipeline.client")
    for _ in range(30):
        x = torch.randn(3, 4, requires_grad=True)
        pipe(x).sum().backward()
        x_ref, out_ref = reference(stages, x)
        out_ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)  # the refused answer never counted
        if pipe.stats["blamed"]:
            break
    assert pipe.stats["blamed"] == 1 and bad.backward_requests == 1
    assert pipe.stats["dropped"] == 0 and pipe.stats["retried_hops"] >= 1
    assert pipe.caller.routers[1].is_banned(bad.dht.peer_id, time.monotonic())
    assert any(
        named in r.getMessage() and "grad_inputs[0] of stage 1" in r.getMessage()
        for r in caplog.records
    )


class SlowWhenGradEnabled(nn.Module):
    """Sleeps in the passes that build a graph: the backward recomputation."""

    def __init__(self, inner, seconds):
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):
        if torch.is_grad_enabled():
            time.sleep(self.seconds)
        return self.inner(x)


class SlowForward(SlowWhenGradEnabled):
    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def test_late_forward_answers_are_dropped_and_the_hop_retried(swarm):
    name = swarm.new_name()
    stages = local_stages()[:2]
    slow = swarm.serve(name, 0, 2, SlowForward(copy.deepcopy(stages[0]), 3.0), 4)
    swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4)
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8)
    pipe = swarm.pipeline(
        name,
        2,
        timeout=20,
        routing={
            "initial_deadline": 0.5,
            "min_deadline": 0.3,
            "ban_seconds": 0.01,
            "max_ban_seconds": 0.01,
        },
    )
    for _ in range(20):
        x = torch.randn(2, 4)
        torch.testing.assert_close(pipe(x), reference(stages, x)[1])
        if pipe.stats["late"]:
            break
    assert pipe.stats["late"] >= 1 and slow.forward_requests == 0  # its answers never came back


def test_a_stage_whose_only_server_outlasts_the_deadline_gets_longer_ones(swarm):
    # a stage that lost servers: the one left is slower than recent hops; each late try
    # doubles the next one's deadline, so the micro-batch gets through instead of being
    # dropped after max_attempts tries that all end at the same deadline
    name = swarm.new_name()
    stages = local_stages()[:2]
    swarm.serve(name, 0, 2, SlowForward(copy.deepcopy(stages[0]), 0.8), 4)
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8)
    routing = {"initial_deadline": 0.3, "min_deadline": 0.3, "ban_seconds": 0.01,
               "max_ban_seconds": 0.01}  # fmt: skip
    pipe = swarm.pipeline(name, 2, timeout=30, max_attempts=8, routing=routing)
    x = torch.randn(2, 4)
    torch.testing.assert_close(pipe(x), reference(stages, x)[1])
    assert pipe.stats["late"] >= 1 and pipe.stats["dropped"] == 0
    assert pipe.stats["forward_hops"] == 2


def test_late_backward_answers_are_dropped_and_gradients_applied_once(swarm):
    name = swarm.new_name()
    stages = local_stages()[:2]
    slow = swarm.serve(
        name, 0, 2, SlowWhenGradEnabled(copy.deepcopy(stages[0]), 3.0), 4, cache_bytes=0
    )
    swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4, cache_bytes=0)
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8)
    pipe = swarm.pipeline(
        name,
        2,
        timeout=20,
        routing={
            "initial_deadline": 0.5,
            "min_deadline": 0.3,
            "ban_seconds": 0.01,
            "max_ban_seconds": 0.01,
        },
    )
    for _ in range(20):
        x = torch.randn(2, 4, requires_grad=True)
        pipe(x).sum().backward()
        x_ref, out_ref = reference(stages, x)
        out_ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)  # once, not twice
        if pipe.stats["late"]:
            break
    assert pipe.stats["late"] >= 1 and slow.backward_requests == 0


def test_a_stage_without_servers_waits_with_a_message_then_fails(swarm, caplog):
    name = swarm.new_name()
    swarm.serve(name, 0, 2, local_stages()[0], 4)
    pipe = swarm.pipeline(name, 2, timeout=1.5, refresh_period=0.5)
    caplog.set_level(logging.WARNING, logger="swarmgrad.pipeline.client")
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="stage 1 has no servers"):
        pipe(torch.randn(2, 4))
    assert 1.4 < time.monotonic() - started < 10
    assert any("stage 1 has no servers; waiting" in r.getMessage() for r in caplog.records)
    assert pipe.stats["no_servers"] == 1


def test_servers_refuse_bad_inputs_and_other_stages_naming_them(swarm):
    name = swarm.new_name()
    server = swarm.serve(name, 0, 2, local_stages()[0], 4)
    pipe = swarm.pipeline(name, 2, timeout=5)
    peer = pipe.caller.peer
    peer.add_addresses(server.dht.peer_id, server.dht.get_visible_maddrs())

    def call(request):
        return run_coroutine(
            peer.call(server.dht.peer_id, protocol.FORWARD, request.encode(), timeout=5)
        )

    with pytest.raises(RemoteError, match=r"expected shape \['batch', 4\], got \[3, 5\]"):
        call(ForwardRequest(name, 0, (torch.zeros(3, 5),)))
    with pytest.raises(RemoteError, match="expected dtype float32, got float64"):
        call(ForwardRequest(name, 0, (torch.zeros(3, 4, dtype=torch.float64),)))
    with pytest.raises(RemoteError, match=f"serves stage 0 of pipeline '{name}', not stage 1"):
        call(ForwardRequest(name, 1, (torch.zeros(3, 4),)))
    assert call(ForwardRequest(name, 0, (torch.zeros(3, 4),)))["outputs"]
    nan_grads = BackwardRequest(name, 0, (torch.zeros(3, 4),), (torch.full((3, 8), float("nan")),))
    with pytest.raises(RemoteError, match=r"grad_outputs of stage 0 .*\[0\]: holds NaN"):
        run_coroutine(
            peer.call(server.dht.peer_id, protocol.BACKWARD, nan_grads.encode(), timeout=5)
        )
    # the trainer checks its own inputs against the stage's schema: refused locally, no retry
    with pytest.raises(ValidationError, match=r"inputs of stage 0 .*expected shape"):
        pipe(torch.zeros(3, 7))
    with pytest.raises(ValidationError, match="has 5000 samples, more than the stage's max_batch"):
        pipe(torch.zeros(5000, 4))
    assert pipe.stats["failed"] == 0


def test_records_announce_throughput_and_are_refreshed(swarm):
    name = swarm.new_name()
    server = swarm.serve(name, 0, 1, local_stages()[0], 4, update_period=0.3)
    pipe = swarm.pipeline(name, 1, timeout=10)
    for _ in range(5):
        pipe(torch.randn(4, 4, requires_grad=True)).sum().backward()
    written = server.records_written
    deadline = time.monotonic() + 10
    while server.records_written < written + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.records_written >= written + 2
    records = run_coroutine(pipe.caller.refresh(0))
    record = records[server.dht.peer_id]
    assert record.throughput > 0 and record.queue == 0 and record.maddrs


def test_eight_bit_activations_stay_close_to_exact_ones(swarm):
    name = swarm.new_name()
    stages = local_stages()
    for i, module in enumerate(stages):
        swarm.serve(name, i, 3, copy.deepcopy(module), WIDTHS[i])
    pipe = swarm.pipeline(name, 3, timeout=20, compression="blockwise_8bit")
    x = torch.randn(16, 4, requires_grad=True)
    out = pipe(x)
    out.sum().backward()
    x_ref, out_ref = reference(stages, x)
    out_ref.sum().backward()
    assert not torch.equal(out, out_ref)
    torch.testing.assert_close(out, out_ref, atol=0.05, rtol=0.05)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=0.05, rtol=0.05)


def test_concurrent_micro_batches_from_several_threads_all_get_their_own_results(swarm):
    name = swarm.new_name()
    stages = local_stages()[:2]
    for _ in range(2):
        swarm.serve(name, 0, 2, copy.deepcopy(stages[0]), 4)
    swarm.serve(name, 1, 2, copy.deepcopy(stages[1]), 8)
    pipe = swarm.pipeline(name, 2, timeout=30)
    errors = []

    def trainer(seed):
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(5):
                x = torch.randn(3, 4, generator=generator, requires_grad=True)
                out = pipe(x)
                out.square().sum().backward()
                x_ref, out_ref = reference(stages, x)
                out_ref.square().sum().backward()
                torch.testing.assert_close(out, out_ref)
                torch.testing.assert_close(x.grad, x_ref.grad)
        except Exception as e:  # reported below, with the thread's seed
            errors.append((seed, e))

    threads = [threading.Thread(target=trainer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert pipe.stats["forward_hops"] == pipe.stats["backward_hops"] == 40
    assert pipe.stats["dropped"] == 0
