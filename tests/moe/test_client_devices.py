"""Remote calls keep their autograd Functions on the CPU, so that a backward pass never
blocks the autograd engine's CUDA thread (an expert server in the same process needs it).

The CPU tests check the contract (the Functions see CPU tensors, their backward runs on
the thread that called ``backward()``, gradients are right); the ``gpu`` test runs the
case that used to deadlock: a CUDA server and a CUDA mixture in one process."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from swarmgrad.dht import DHT
from swarmgrad.moe.client import RemoteExpert, RemoteMixtureOfExperts
from swarmgrad.moe.client import expert as expert_module
from swarmgrad.moe.client import moe as moe_module
from swarmgrad.moe.expert_uid import ExpertInfo, ServerInfo
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import background_server
from tests.helpers.moe_fakes import FakeExpert, Swarm


class Spy:
    """Wraps an autograd Function's forward and backward, recording what they saw."""

    def __init__(self, monkeypatch, function: type[torch.autograd.Function]):
        self.forward_devices: list[str] = []
        self.backward_devices: list[str] = []
        self.backward_threads: list[int] = []
        forward, backward = function.forward, function.backward

        def spy_forward(ctx, *args):
            self.forward_devices += [str(a.device) for a in args if isinstance(a, torch.Tensor)]
            return forward(ctx, *args)

        def spy_backward(ctx, *grads):
            self.backward_devices += [str(g.device) for g in grads if g is not None]
            self.backward_threads.append(threading.get_ident())
            return backward(ctx, *grads)

        monkeypatch.setattr(function, "forward", staticmethod(spy_forward))
        monkeypatch.setattr(function, "backward", staticmethod(spy_backward))


def test_remote_call_function_sees_cpu_tensors_and_runs_backward_on_the_caller(monkeypatch):
    spy = Spy(monkeypatch, expert_module._RemoteCall)
    local = nn.Linear(4, 3)
    with Swarm() as swarm:
        server = swarm.server(
            {"ffn.0": FakeExpert(copy.deepcopy(local), [BatchTensorDescriptor(4)])}
        )
        info = ExpertInfo("ffn.0", (ServerInfo(server.peer.peer_id, (server.address,)),))
        expert = RemoteExpert(info, swarm.client)
        x = torch.randn(5, 4, requires_grad=True)
        expert(x).square().sum().backward()
    x_ref = x.detach().requires_grad_()
    local(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert spy.forward_devices and set(spy.forward_devices) == {"cpu"}
    assert spy.backward_devices and set(spy.backward_devices) == {"cpu"}
    assert spy.backward_threads == [threading.get_ident()]


def test_host_and_device_moves_are_autograd_nodes_and_free_on_cpu():
    x = torch.randn(3, 2, requires_grad=True)
    (host,) = expert_module.to_host([x])
    assert host is x  # no copy, no node for CPU tensors
    (back,) = expert_module.to_device([host], torch.device("cpu"))
    assert back is x


HIDDEN = 8
GRID = (2, 2)
UIDS = [f"expert.{i}.{j}" for i in range(GRID[0]) for j in range(GRID[1])]


def _mixture_backward_in_one_process(device: str, spy: Spy) -> None:
    """A server and a mixture on ``device`` in this process: forward, then a backward
    that must answer (on a thread, so that a deadlock fails the test instead of hanging)."""
    with background_server(
        expert_cls="ffn",
        hidden_dim=HIDDEN,
        expert_uids=UIDS,
        device=device,
        optim_cls=lambda params: torch.optim.SGD(params, lr=0.01),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        batch_timeout=0.001,
    ) as server_info:
        dht = DHT(initial_peers=[str(a) for a in server_info.addrs], start=True, client_mode=True)
        try:
            moe = RemoteMixtureOfExperts(
                in_features=HIDDEN, grid_size=GRID, dht=dht, uid_prefix="expert.", k_best=2,
                backward_timeout=20.0,
            ).to(device)  # fmt: skip
            x = torch.randn(6, HIDDEN, device=device, requires_grad=True)
            output = moe(x)
            assert output.device.type == torch.device(device).type
            errors: list[BaseException] = []

            def backward() -> None:
                try:
                    output.square().sum().backward()
                except BaseException as e:
                    errors.append(e)

            worker = threading.Thread(target=backward, daemon=True)
            worker.start()
            worker.join(timeout=60)
            assert not worker.is_alive(), "the backward pass never answered (deadlock)"
            assert not errors, errors
            assert x.grad is not None and x.grad.device == x.device
            assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
            assert moe.proj.weight.grad.abs().sum() > 0
        finally:
            dht.shutdown()
    assert set(spy.forward_devices) == {"cpu"} and set(spy.backward_devices) == {"cpu"}


def test_mixture_function_sees_cpu_tensors_with_an_in_process_server(monkeypatch):
    spy = Spy(monkeypatch, moe_module._RemoteMixtureCall)
    _mixture_backward_in_one_process("cpu", spy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch sees no GPU)")
def test_cuda_server_and_cuda_mixture_in_one_process_complete_backward(monkeypatch):
    spy = Spy(monkeypatch, moe_module._RemoteMixtureCall)
    _mixture_backward_in_one_process("cuda", spy)
