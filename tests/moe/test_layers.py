"""RemoteMixtureOfExperts and RemoteSwitchMixtureOfExperts against fake expert servers."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch
from torch import nn

from swarmgrad.moe.client import (
    NoExpertsAnswered,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
)
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.utils.errors import DeadlineExceeded, ValidationError
from tests.helpers.moe_fakes import FakeExpert, Swarm

GRID = (2, 3)
DIM = 4


@pytest.fixture
def swarm():
    with Swarm() as swarm:
        yield swarm


def make_grid(swarm: Swarm, seed: int = 0, servers: int = 2) -> dict[str, nn.Module]:
    """Experts ffn.i.j on the 2x3 grid, spread over ``servers`` fake servers; returns
    local copies of their modules."""
    torch.manual_seed(seed)
    modules = {f"ffn.{i}.{j}": nn.Linear(DIM, DIM) for i in range(GRID[0]) for j in range(GRID[1])}
    uids = sorted(modules)
    for k in range(servers):
        hosted = {
            uid: FakeExpert(copy.deepcopy(modules[uid]), [BatchTensorDescriptor(DIM)])
            for uid in uids[k::servers]
        }
        swarm.server(hosted)
    return modules


def fake(swarm: Swarm, uid: str) -> FakeExpert:
    return next(s.experts[uid] for s in swarm.servers if uid in s.experts)


def layer(swarm: Swarm, cls=RemoteMixtureOfExperts, **kwargs):
    kwargs.setdefault("k_best", 2)
    return cls(in_features=DIM, grid_size=GRID, dht=swarm.client, uid_prefix="ffn", **kwargs)


def fix_ranking(moe: RemoteMixtureOfExperts, row_bias, col_bias) -> None:
    """Make every sample rank the experts the same way (scores = biases)."""
    with torch.no_grad():
        moe.proj.weight.zero_()
        moe.proj.bias.copy_(torch.tensor([*row_bias, *col_bias], dtype=torch.float32))


def reference(proj, modules, x, k_best):
    """The same layer computed locally, by brute force over the full grid."""
    scores = proj(x).split(GRID, dim=-1)
    outputs = []
    for b in range(len(x)):
        total = {
            uid: scores[0][b, int(uid.split(".")[1])] + scores[1][b, int(uid.split(".")[2])]
            for uid in modules
        }
        best = sorted(total, key=lambda uid: -total[uid].item())[:k_best]
        weights = torch.softmax(torch.stack([total[uid] for uid in best]), dim=0)
        pairs = zip(weights, best, strict=True)
        outputs.append(sum(w * modules[uid](x[b : b + 1])[0] for w, uid in pairs))
    return torch.stack(outputs)


def all_calls(swarm: Swarm, kind: str = "forward") -> dict[str, list[int]]:
    attribute = f"{kind}_batches"
    return {
        uid: getattr(e, attribute)
        for s in swarm.servers
        for uid, e in s.experts.items()
        if getattr(e, attribute)
    }


def test_output_and_gradients_match_a_local_mixture(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2)
    x = torch.randn(8, DIM, requires_grad=True)
    output = moe(x)
    (output * torch.arange(DIM)).sum().backward()

    local_proj = copy.deepcopy(moe.proj)
    local_proj.zero_grad()
    x_ref = x.detach().requires_grad_()
    expected = reference(local_proj, modules, x_ref, k_best=2)
    (expected * torch.arange(DIM)).sum().backward()
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(moe.proj.weight.grad, local_proj.weight.grad)
    assert moe.proj.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_one_request_per_chosen_expert_per_batch_forward_and_backward(swarm):
    make_grid(swarm)
    moe = layer(swarm, k_best=2)
    x = torch.randn(32, DIM, requires_grad=True)
    moe(x).sum().backward()
    forward, backward = all_calls(swarm, "forward"), all_calls(swarm, "backward")
    assert all(len(batches) == 1 for batches in forward.values()), forward
    assert sum(b[0] for b in forward.values()) == 32 * 2
    assert backward == forward
    assert len(forward) >= 2  # the batch really was spread over several experts


def test_expert_arguments_outputs_and_sequence_inputs(swarm):
    class TwoOutputs(nn.Module):
        def forward(self, x, scale):
            return x * scale[:, :, :1], x.sum(-1)

    schema = [BatchTensorDescriptor(5, DIM), BatchTensorDescriptor(5, 1)]
    swarm.server({f"seq.{i}": FakeExpert(TwoOutputs(), schema) for i in range(3)})
    moe = RemoteMixtureOfExperts(
        in_features=DIM, grid_size=(3,), dht=swarm.client, uid_prefix="seq.", k_best=3
    )
    x = torch.randn(2, 5, DIM, requires_grad=True)
    first, second = moe(x, torch.full((2, 5, 1), 2.0))
    torch.testing.assert_close(first, 2 * x)  # every expert is the same: weights sum to 1
    torch.testing.assert_close(second, x.sum(-1))
    first.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert moe.info["outputs_schema"][1].instance_shape == (5,)


@pytest.mark.parametrize("failure", ["raise", "bad_shape"])
def test_failed_experts_are_dropped_for_their_samples(swarm, failure):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])  # best: ffn.0.0, then ffn.0.1
    moe.info  # noqa: B018
    fake(swarm, "ffn.0.0").behaviour = failure
    x = torch.randn(4, DIM)
    torch.testing.assert_close(moe(x), modules["ffn.0.1"](x).detach())
    assert "ffn.0.2" not in all_calls(swarm)  # no fallback: each sample had an answer


def test_samples_whose_chosen_experts_all_fail_fall_back_on_the_next_best(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])  # ranking: 0.0, 0.1, 0.2, 1.0, ...
    for uid in ("ffn.0.0", "ffn.0.1"):
        fake(swarm, uid).behaviour = "raise"
    x = torch.randn(6, DIM, requires_grad=True)
    output = moe(x)
    scores = torch.tensor([2.0 + 0.0, 0.0 + 1.0])  # ffn.0.2 and ffn.1.0
    weights = torch.softmax(scores, dim=0)
    expected = weights[0] * modules["ffn.0.2"](x) + weights[1] * modules["ffn.1.0"](x)
    torch.testing.assert_close(output, expected)
    calls = all_calls(swarm)
    assert calls["ffn.0.2"] == calls["ffn.1.0"] == [6]  # the fallback is one request too
    output.sum().backward()
    assert all_calls(swarm, "backward") == {"ffn.0.2": [6], "ffn.1.0": [6]}


def test_a_dead_server_sends_its_samples_to_experts_of_the_other_server(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=1)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])  # ffn.0.0 (server 0), then ffn.0.1 (server 1)
    moe.info  # noqa: B018 (the schema, fetched while everything is alive)
    fake(swarm, "ffn.0.0").behaviour = "die"
    x = torch.randn(3, DIM)
    torch.testing.assert_close(moe(x), modules["ffn.0.1"](x).detach())
    assert swarm.servers[0].dead
    # next batch: the dead server's experts are skipped at once, without a failed call
    torch.testing.assert_close(moe(x), modules["ffn.0.1"](x).detach())
    assert fake(swarm, "ffn.0.0").forward_calls == 1


def test_no_answer_at_all_is_an_error_naming_samples_and_causes_or_zeros(swarm):
    make_grid(swarm)
    for server in swarm.servers:
        for expert in server.experts.values():
            expert.behaviour = "raise"
    strict = layer(swarm, k_best=1, max_attempts=2)
    x = torch.randn(5, DIM)
    strict.info  # noqa: B018
    with pytest.raises(NoExpertsAnswered, match=r"5 of 5 samples .*failed on purpose"):
        strict(x)
    tolerant = layer(swarm, k_best=1, allow_zero_outputs=True)
    torch.testing.assert_close(tolerant(x), torch.zeros(5, DIM))


def test_k_min_answers_then_timeout_after_k_min_cuts_the_stragglers(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2, k_min=1, timeout_after_k_min=0.2, forward_timeout=60)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])
    moe.info  # noqa: B018
    fake(swarm, "ffn.0.1").behaviour = "hang"
    x = torch.randn(3, DIM)
    started = time.monotonic()
    torch.testing.assert_close(moe(x), modules["ffn.0.0"](x).detach())
    assert time.monotonic() - started < 30  # far from forward_timeout


def test_waiting_for_k_min_stops_at_the_forward_timeout(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2, k_min=2, forward_timeout=0.5)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])
    moe.info  # noqa: B018
    fake(swarm, "ffn.0.1").behaviour = "hang"
    x = torch.randn(3, DIM)
    started = time.monotonic()
    torch.testing.assert_close(moe(x), modules["ffn.0.0"](x).detach())
    assert time.monotonic() - started >= 0.5 - 0.05  # it did wait for the second answer


def test_the_forward_timeout_covers_the_beam_search(swarm, monkeypatch):
    make_grid(swarm)
    moe = layer(swarm, forward_timeout=0.2)

    async def stuck(*args, **kwargs):
        await asyncio.Event().wait()

    monkeypatch.setattr(moe.beam_search, "search", stuck)
    with pytest.raises(DeadlineExceeded, match="beam search"):
        moe(torch.randn(2, DIM))


def test_detect_anomalies_drops_nan_outputs_and_nan_gradients(swarm):
    modules = make_grid(swarm)
    fix = ([2.0, 0.0], [1.0, 0.5, 0.0])
    fake(swarm, "ffn.0.0").behaviour = "nan"
    x = torch.randn(3, DIM, requires_grad=True)

    naive = layer(swarm, k_best=2)
    fix_ranking(naive, *fix)
    assert naive(x).isnan().all()

    careful = layer(swarm, k_best=2, detect_anomalies=True)
    fix_ranking(careful, *fix)
    fake(swarm, "ffn.0.0").behaviour = "normal"
    fake(swarm, "ffn.0.1").backward_behaviour = "nan"
    output = careful(x)
    expected = torch.softmax(torch.tensor([3.0, 2.5]), 0) @ torch.stack(
        [modules["ffn.0.0"](x), modules["ffn.0.1"](x)]
    ).transpose(0, 1)
    torch.testing.assert_close(output, expected)
    output.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_inputs_that_do_not_match_the_expert_schema_are_refused_before_sending(swarm):
    make_grid(swarm)
    moe = RemoteMixtureOfExperts(
        in_features=DIM + 1, grid_size=GRID, dht=swarm.client, uid_prefix="ffn.", k_best=2
    )
    with pytest.raises(ValidationError, match=r"inputs of RemoteMixtureOfExperts.*shape"):
        moe(torch.randn(2, DIM + 1))
    assert all_calls(swarm) == {}


def test_a_grid_without_servers_is_a_clear_error(swarm):
    moe = RemoteMixtureOfExperts(
        in_features=DIM, grid_size=GRID, dht=swarm.client, uid_prefix="nobody", k_best=2
    )
    with pytest.raises(NoExpertsAnswered, match=r"no live expert under 'nobody\.'"):
        moe(torch.randn(2, DIM))


def test_bad_parameters_are_refused():
    with pytest.raises(ValidationError, match="k_min"):
        RemoteMixtureOfExperts(
            in_features=2, grid_size=(2,), dht=None, uid_prefix="e", k_best=1, k_min=2
        )


# ---------------------------------------------------------------------- switch


def test_switch_layer_returns_residual_output_and_balancing_loss(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, RemoteSwitchMixtureOfExperts, k_best=1, jitter_eps=0.0)
    moe.train()
    x = torch.randn(16, DIM, requires_grad=True)
    output, loss = moe(x)
    assert output.shape == x.shape and loss.ndim == 0 and loss.item() > 0

    scores = moe.proj(x).split(GRID, dim=-1)
    probs = [torch.softmax(s, -1) for s in scores]
    rows, cols = scores[0].argmax(-1), scores[1].argmax(-1)
    expected = torch.stack(
        [
            probs[0][b, rows[b]] * probs[1][b, cols[b]] * modules[f"ffn.{rows[b]}.{cols[b]}"](x[b])
            for b in range(len(x))
        ]
    )
    torch.testing.assert_close(output, expected + x)

    utilization = moe.grid_utilization.split(GRID)
    assert all(torch.isclose(u.sum(), torch.tensor(1.0)) for u in utilization)
    (output.sum() + loss).backward()
    assert moe.proj.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_switch_layer_gives_its_input_back_when_no_expert_answers(swarm):
    make_grid(swarm)
    for server in swarm.servers:
        for expert in server.experts.values():
            expert.behaviour = "raise"
    moe = layer(swarm, RemoteSwitchMixtureOfExperts, k_best=1, grid_dropout=0.5)
    moe.train()
    moe.info  # noqa: B018
    x = torch.randn(4, DIM)
    output, loss = moe(x)
    torch.testing.assert_close(output, x)
    assert torch.isfinite(loss)


def test_switch_utilization_moves_toward_the_experts_used(swarm):
    make_grid(swarm)
    moe = layer(swarm, RemoteSwitchMixtureOfExperts, k_best=1, utilization_alpha=0.5)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])  # everyone goes to ffn.0.0
    moe.train()
    moe(torch.randn(8, DIM))
    rows, cols = moe.grid_utilization.split(GRID)
    torch.testing.assert_close(rows, torch.tensor([0.75, 0.25]))
    torch.testing.assert_close(cols, torch.tensor([2 / 3, 1 / 6, 1 / 6]))


def expected_input_grad(modules, uids_and_weights):
    """x.grad of sum(output) when output = sum_k w_k * expert_k(x) and the gate ignores x."""
    return sum(w * modules[uid].weight.sum(0) for uid, w in uids_and_weights)


def test_failed_or_late_backward_calls_contribute_no_gradient(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2, backward_timeout=0.5)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])  # ffn.0.0 (3.0) and ffn.0.1 (2.5)
    w0, w1 = torch.softmax(torch.tensor([3.0, 2.5]), 0).tolist()
    x = torch.randn(3, DIM, requires_grad=True)
    fake(swarm, "ffn.0.1").backward_behaviour = "hang"
    started = time.monotonic()
    moe(x).sum().backward()
    assert time.monotonic() - started < 30
    expected = expected_input_grad(modules, [("ffn.0.0", w0)]).expand(3, DIM)
    torch.testing.assert_close(x.grad, expected)

    x.grad = None
    fake(swarm, "ffn.0.1").backward_behaviour = "raise"
    moe(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_backward_with_no_expert_answering_is_an_error_unless_zeros_are_allowed(swarm):
    make_grid(swarm)
    for server in swarm.servers:
        for expert in server.experts.values():
            expert.backward_behaviour = "raise"
    x = torch.randn(3, DIM, requires_grad=True)
    with pytest.raises(NoExpertsAnswered, match=r"backward: none of the .* experts answered"):
        layer(swarm, k_best=2)(x).sum().backward()
    tolerant = layer(swarm, k_best=2, allow_zero_outputs=True)
    fix_ranking(tolerant, [2.0, 0.0], [1.0, 0.5, 0.0])
    x.grad = None
    tolerant(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros(3, DIM))


def test_backward_k_min_then_timeout_after_k_min_cuts_slow_backward_calls(swarm):
    modules = make_grid(swarm)
    moe = layer(swarm, k_best=2, backward_k_min=1, timeout_after_k_min=0.2, backward_timeout=60)
    fix_ranking(moe, [2.0, 0.0], [1.0, 0.5, 0.0])
    w0, _ = torch.softmax(torch.tensor([3.0, 2.5]), 0).tolist()
    fake(swarm, "ffn.0.1").backward_behaviour = "hang"
    x = torch.randn(2, DIM, requires_grad=True)
    started = time.monotonic()
    moe(x).sum().backward()
    assert time.monotonic() - started < 30
    torch.testing.assert_close(
        x.grad, expected_input_grad(modules, [("ffn.0.0", w0)]).expand(2, DIM)
    )
