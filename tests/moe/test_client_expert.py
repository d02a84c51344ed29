"""RemoteExpert: autograd through a server, schema checks, timeouts, failover, get_experts."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from swarmgrad.moe.client import RemoteExpert, create_remote_experts, get_experts
from swarmgrad.moe.client.health import SERVER_HEALTH
from swarmgrad.moe.expert_uid import ExpertInfo, ServerInfo
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.utils.errors import (
    DeadlineExceeded,
    PeerUnreachable,
    ProtocolViolation,
    RemoteError,
    ValidationError,
)
from swarmgrad.utils.loop_thread import run_coroutine
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.moe_fakes import FakeExpert, FakeExpertServer, Swarm


class TwoInTwoOut(nn.Module):
    """Two inputs, two outputs, with weights: enough to catch mixed-up arguments."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, y):
        hidden = self.linear(x) * y[:, :1]
        return hidden.tanh(), (x[:, :2] * y).sum(-1, keepdim=True)


SCHEMA = (BatchTensorDescriptor(4), BatchTensorDescriptor(2))


@pytest.fixture
def swarm():
    with Swarm() as swarm:
        yield swarm


def info_of(uid: str, *servers: FakeExpertServer) -> ExpertInfo:
    return ExpertInfo(uid, tuple(ServerInfo(s.peer.peer_id, (s.address,)) for s in servers))


def test_forward_and_backward_match_the_local_module(swarm):
    local = TwoInTwoOut()
    server = swarm.server({"ffn.0": FakeExpert(copy.deepcopy(local), SCHEMA)})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)

    x, y = torch.randn(5, 4, requires_grad=True), torch.randn(5, 2, requires_grad=True)
    out_a, out_b = expert(x, y)
    (out_a.square().sum() + 3 * out_b.sum()).backward()

    x_ref, y_ref = x.detach().requires_grad_(), y.detach().requires_grad_()
    ref_a, ref_b = local(x_ref, y_ref)
    (ref_a.square().sum() + 3 * ref_b.sum()).backward()
    torch.testing.assert_close(out_a, ref_a)
    torch.testing.assert_close(out_b, ref_b)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(y.grad, y_ref.grad)
    fake = server.experts["ffn.0"]
    assert (fake.forward_batches, fake.backward_batches, fake.info_calls) == ([5], [5], 1)


def test_backward_reaches_the_server_even_when_inputs_need_no_grad(swarm):
    server = swarm.server({"ffn.0": FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)])})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    expert(torch.randn(3, 4)).sum().backward()
    assert server.experts["ffn.0"].backward_batches == [3]


def test_info_is_fetched_once_and_describes_the_expert(swarm):
    server = swarm.server({"ffn.0": FakeExpert(TwoInTwoOut(), SCHEMA)})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    info = expert.info
    assert info["args_schema"] == SCHEMA
    assert [d.instance_shape for d in info["outputs_schema"]] == [(3,), (1,)]
    for _ in range(3):
        expert(torch.randn(2, 4), torch.randn(2, 2))
    assert server.experts["ffn.0"].info_calls == 1
    assert "ffn.0" in repr(expert)


def test_mismatched_inputs_are_refused_before_anything_is_sent(swarm):
    server = swarm.server({"ffn.0": FakeExpert(TwoInTwoOut(), SCHEMA)})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    with pytest.raises(ValidationError, match=r"inputs of expert 'ffn.0'\[1\].*shape"):
        expert(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(ValidationError, match=r"inputs of expert 'ffn.0'\[0\].*dtype"):
        expert(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 2))
    with pytest.raises(ValidationError, match="expected 2 tensors, got 1"):
        expert(torch.randn(2, 4))
    with pytest.raises(ValidationError, match="positional"):
        expert(torch.randn(2, 4), y=torch.randn(2, 2))
    assert server.experts["ffn.0"].forward_calls == 0


def test_a_hanging_expert_hits_the_deadline_naming_expert_and_server(swarm):
    server = swarm.server({"ffn.0": FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)])})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client, forward_timeout=0.3)
    expert.info  # noqa: B018 (fetch the schema before the expert starts hanging)
    server.experts["ffn.0"].behaviour = "hang"
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"ffn\.0") as caught:
        expert(torch.randn(2, 4))
    assert str(server.peer.peer_id) in str(caught.value)
    assert time.monotonic() - started < 10


def test_an_expert_error_arrives_as_remote_error_naming_the_expert(swarm):
    fake = FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)], behaviour="raise")
    server = swarm.server({"ffn.0": fake})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    with pytest.raises(RemoteError, match=r"ffn\.0.*failed on purpose") as caught:
        expert(torch.randn(2, 4))
    assert caught.value.remote_type == "RuntimeError"


def test_a_malformed_answer_is_a_protocol_violation_naming_expert_and_server(swarm):
    fake = FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)], behaviour="bad_shape")
    server = swarm.server({"ffn.0": fake})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    with pytest.raises(ProtocolViolation, match=r"outputs of expert 'ffn\.0' from .*shape") as e:
        expert(torch.randn(2, 4))
    assert str(server.peer.peer_id) in str(e.value)


def test_a_server_dying_mid_call_is_a_clear_error(swarm):
    server = swarm.server({"ffn.0": FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)])})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    expert.info  # noqa: B018
    server.experts["ffn.0"].behaviour = "die"
    with pytest.raises(PeerUnreachable, match=r"no server of expert 'ffn\.0' answered"):
        expert(torch.randn(2, 4))
    assert server.dead
    assert not SERVER_HEALTH.is_healthy(server.peer.peer_id)


def test_a_call_is_retried_on_the_second_server_when_the_first_dies_mid_call(swarm):
    module = nn.Linear(4, 4)
    dying = swarm.server({"ffn.0": FakeExpert(copy.deepcopy(module), [BatchTensorDescriptor(4)])})
    healthy = swarm.server({"ffn.0": FakeExpert(copy.deepcopy(module), [BatchTensorDescriptor(4)])})
    dying.experts["ffn.0"].behaviour = "die"
    expert = RemoteExpert(info_of("ffn.0", dying, healthy), swarm.client)
    expert.info  # noqa: B018
    expert.caller._turn = 0  # the next call tries `dying` first
    x = torch.randn(2, 4)
    torch.testing.assert_close(expert(x), module(x).detach())
    assert dying.dead and dying.experts["ffn.0"].forward_calls == 1
    assert healthy.experts["ffn.0"].forward_calls == 1
    torch.testing.assert_close(expert(x), module(x).detach())  # `dying` is now avoided
    assert healthy.experts["ffn.0"].forward_calls == 2


def test_calls_rotate_over_the_servers_of_an_expert(swarm):
    servers = [
        swarm.server({"ffn.0": FakeExpert(nn.Identity(), [BatchTensorDescriptor(2)])})
        for _ in range(2)
    ]
    expert = RemoteExpert(info_of("ffn.0", *servers), swarm.client)
    for _ in range(6):
        expert(torch.ones(1, 2))
    assert [s.experts["ffn.0"].forward_calls for s in servers] == [3, 3]


def test_batches_above_the_server_limit_are_split(swarm):
    server = swarm.server(
        {"ffn.0": FakeExpert(nn.Linear(4, 2), [BatchTensorDescriptor(4)])}, max_batch_size=4
    )
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    x = torch.randn(10, 4, requires_grad=True)
    expert(x).sum().backward()
    fake = server.experts["ffn.0"]
    assert sorted(fake.forward_batches) == [2, 4, 4] == sorted(fake.backward_batches)
    torch.testing.assert_close(x.grad, fake.module.weight.sum(0).expand(10, 4))


def test_compressed_arguments_travel_with_their_codec(swarm):
    schema = [BatchTensorDescriptor(8, compression="float16")]
    server = swarm.server({"ffn.0": FakeExpert(nn.Identity(), schema)})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    x = torch.randn(3, 8) * 1000 + 0.1234567
    output = expert(x)
    assert not torch.equal(output, x)
    torch.testing.assert_close(output, x.half().float())


def test_async_variants_run_many_calls_concurrently(swarm):
    server = swarm.server({"ffn.0": FakeExpert(nn.Linear(4, 4), [BatchTensorDescriptor(4)])})
    expert = RemoteExpert(info_of("ffn.0", server), swarm.client)
    xs = [torch.randn(2, 4) for _ in range(8)]

    async def many():
        import asyncio

        outputs = await asyncio.gather(*(expert.forward_async(x) for x in xs))
        grads = await expert.backward_async([xs[0]], [torch.ones(2, 4)])
        return outputs, grads, await expert.info_async()

    outputs, grads, info = run_coroutine(many(), timeout=30)
    module = server.experts["ffn.0"].module
    for x, (output,) in zip(xs, outputs, strict=True):
        torch.testing.assert_close(output, module(x).detach())
    torch.testing.assert_close(grads[0], module.weight.sum(0).expand(2, 4))
    assert info["uid"] == "ffn.0"


def test_get_experts_lists_every_server_and_none_for_unknown_uids(swarm):
    servers = [
        swarm.server({"ffn.0": FakeExpert(nn.Identity(), [BatchTensorDescriptor(2)])})
        for _ in range(2)
    ]
    found, missing = get_experts(swarm.client, ["ffn.0", "ffn.9"])
    assert missing is None
    assert {s.peer_id for s in found.expert_info.servers} == {s.peer.peer_id for s in servers}
    torch.testing.assert_close(found(torch.ones(1, 2)), torch.ones(1, 2))
    future = get_experts(swarm.client, ["ffn.0"], return_future=True)
    assert future.result(30)[0].uid == "ffn.0"
    assert get_experts(swarm.client, ["ffn.0"], expiration_time=get_dht_time() + 1e6) == [None]
    assert create_remote_experts([None, found.expert_info], swarm.client)[0] is None


def test_an_expert_hosted_only_by_the_calling_peer_is_refused_clearly(swarm):
    server = swarm.server({"ffn.0": FakeExpert(nn.Identity(), [BatchTensorDescriptor(2)])})
    expert = RemoteExpert(info_of("ffn.0", server), server.node)
    with pytest.raises(ValidationError, match="hosted only by this very peer"):
        expert.info  # noqa: B018
