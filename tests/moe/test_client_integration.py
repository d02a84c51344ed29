"""The client against the real expert server (swarmgrad.moe.server) in this process."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.dht import DHT
from swarmgrad.moe.client import (
    MoEBeamSearcher,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
    get_experts,
)
from swarmgrad.moe.server import background_server

HIDDEN = 16
GRID = (2, 3)
UIDS = [f"expert.{i}.{j}" for i in range(GRID[0]) for j in range(GRID[1])]


@pytest.fixture(scope="module")
def client_dht():
    with background_server(
        expert_cls="ffn",
        hidden_dim=HIDDEN,
        expert_uids=UIDS,
        optim_cls=lambda params: torch.optim.SGD(params, lr=0.1),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        batch_timeout=0.001,
    ) as server_info:
        dht = DHT(initial_peers=[str(a) for a in server_info.addrs], start=True, client_mode=True)
        try:
            yield dht
        finally:
            dht.shutdown()


def test_remote_expert_runs_on_the_server_and_learns_there(client_dht):
    experts = get_experts(client_dht, [UIDS[0], "expert.9.9"])
    expert, missing = experts
    assert missing is None
    assert expert.info["args_schema"][0].instance_shape == (HIDDEN,)
    x = torch.randn(4, HIDDEN, requires_grad=True)
    before = expert(x)
    assert before.shape == (4, HIDDEN)
    before.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    after = expert(x)  # the server took an SGD step on the backward pass
    assert not torch.allclose(before, after)


def test_beam_search_sees_every_declared_expert(client_dht):
    searcher = MoEBeamSearcher(client_dht, "expert", GRID)
    found = searcher.find_best_experts([torch.zeros(2), torch.zeros(3)], beam_size=6)
    assert sorted(info.uid for info in found) == UIDS


def test_mixture_of_experts_trains_through_the_real_server(client_dht):
    moe = RemoteMixtureOfExperts(
        in_features=HIDDEN, grid_size=GRID, dht=client_dht, uid_prefix="expert.", k_best=3
    )
    x = torch.randn(10, HIDDEN, requires_grad=True)
    output = moe(x)
    assert output.shape == (10, HIDDEN) and torch.isfinite(output).all()
    output.sum().backward()
    assert x.grad.abs().sum() > 0 and moe.proj.weight.grad.abs().sum() > 0


def test_switch_mixture_through_the_real_server(client_dht):
    moe = RemoteSwitchMixtureOfExperts(
        in_features=HIDDEN, grid_size=GRID, dht=client_dht, uid_prefix="expert."
    )
    x = torch.randn(6, HIDDEN, requires_grad=True)
    output, balancing_loss = moe(x)
    assert output.shape == x.shape and balancing_loss.ndim == 0
    (output.sum() + balancing_loss).backward()
    assert moe.proj.weight.grad.abs().sum() > 0
