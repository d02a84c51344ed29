"""ModuleBackend: schemas, forward, backward with an optimizer step, state, the
activation cache, learning-rate schedules."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server.activation_cache import ActivationCache
from swarmgrad.moe.server.module_backend import ModuleBackend
from swarmgrad.moe.server.schedulers import get_linear_schedule_with_warmup, make_scheduler
from swarmgrad.utils.errors import ValidationError


class MaskedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, mask):
        out = self.linear(x) * mask[:, :1].to(x.dtype)
        return out, mask.sum(1, keepdim=True)


SCHEMA = (BatchTensorDescriptor(4), BatchTensorDescriptor(2, dtype=torch.int64))


def backend(cache=None, lr=0.1, **kwargs) -> ModuleBackend:
    torch.manual_seed(0)
    module = MaskedLinear()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    return ModuleBackend(
        "masked.0",
        module,
        optimizer=optimizer,
        args_schema=SCHEMA,
        activation_cache=cache,
        **kwargs,
    )


def batch(n=5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    mask = torch.randint(0, 2, (n, 2), generator=generator)
    grads = torch.randn(n, 3, generator=generator), torch.zeros(n, 1, dtype=torch.int64)
    return x, mask, grads


def test_outputs_schema_is_derived_from_a_sample_run():
    b = backend()
    (out, count) = b.outputs_schema
    assert out.instance_shape == (3,) and out.dtype == torch.float32 and out.requires_grad
    assert count.instance_shape == (1,) and count.dtype == torch.int64 and not count.requires_grad
    info = b.get_info()
    assert info["uid"] == "masked.0" and info["max_batch_size"] == 4096
    assert info["args_schema"][1] == {
        "shape": [2],
        "dtype": "int64",
        "requires_grad": False,
        "compression": "none",
    }


def test_backward_returns_input_gradients_and_updates_the_weights_once():
    b = backend()
    reference = copy.deepcopy(b.module)
    x, mask, (grad_out, grad_count) = batch()
    grad_x, grad_mask = b.backward(x, mask, grad_out, grad_count)

    leaf = x.clone().requires_grad_()
    out, _ = reference(leaf, mask)
    out.backward(grad_out)
    assert torch.allclose(grad_x, leaf.grad)
    assert torch.equal(grad_mask, torch.zeros_like(mask))  # a non-float input gets zeros
    with torch.no_grad():
        for new, old in zip(b.module.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(new, old - 0.1 * old.grad)
    assert b.update_count == 1 and b.examples_processed == 5
    assert all(p.grad is None for p in b.module.parameters())


def test_with_a_gradient_sink_backward_hands_gradients_over_and_steps_only_when_applied():
    cache = ActivationCache(1 << 20)
    b, reference = backend(cache), backend()
    received = []

    def sink(batch_size):
        received.append((batch_size, [p.grad.clone() for p in b.module.parameters()]))

    b.gradient_sink = sink
    before = [p.detach().clone() for p in b.module.parameters()]
    x, mask, grads = batch()
    b.forward(x, mask)
    got = b.backward(x, mask, *grads)
    want = reference.backward(x, mask, *grads)  # the same input gradients
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert cache.hits == 1 and len(received) == 1 and received[0][0] == 5
    assert b.update_count == 0 and b.examples_processed == 5
    for param, old in zip(b.module.parameters(), before, strict=True):
        assert torch.equal(param, old) and param.grad is None  # no step, gradients gone
    b.forward(x, mask)  # no step: a forward's graph stays valid for its backward
    with b.lock:
        for param, grad in zip(b.module.parameters(), received[0][1], strict=True):
            param.grad = grad
        b.apply_gradients()
    assert b.update_count == 1 and len(cache) == 0  # graphs of the old weights dropped
    for new, ref in zip(b.module.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(new, ref)  # one step on the same gradients


def test_a_gradient_sink_never_sees_non_finite_gradients():
    b = backend()
    b.gradient_sink = lambda batch_size: pytest.fail("the sink got NaN gradients")
    x, mask, (grad_out, grad_count) = batch()
    with pytest.raises(ValidationError, match="non-finite parameter gradients"):
        b.backward(x, mask, grad_out * float("nan"), grad_count)


def test_forward_builds_no_graph_without_a_cache_and_leaves_weights_alone():
    b = backend()
    before = copy.deepcopy(b.module.state_dict())
    x, mask, _ = batch()
    out, count = b.forward(x, mask)
    assert not out.requires_grad and torch.equal(count, mask.sum(1, keepdim=True))
    assert all(torch.equal(before[k], v) for k, v in b.module.state_dict().items())


def test_a_cached_forward_gives_exactly_the_recomputed_backward():
    cache = ActivationCache(1 << 20)
    cached, plain = backend(cache), backend()
    x, mask, grads = batch()
    assert torch.equal(cached.forward(x, mask)[0], plain.forward(x, mask)[0])
    assert len(cache) == 1 and cache.nbytes > 0
    assert not cached.forward(x, mask)[0].requires_grad  # outputs are detached
    got = cached.backward(x, mask, *grads)
    want = plain.backward(x, mask, *grads)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert cache.hits == 1
    for a, b in zip(cached.module.parameters(), plain.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(cache) == 0  # the second forward's graph belongs to old weights: dropped


def test_the_cache_is_not_used_after_the_weights_changed_or_for_other_inputs():
    cache = ActivationCache(1 << 20)
    cached, plain = backend(cache), backend()
    x, mask, grads = batch()
    other_x, other_mask, other_grads = batch(seed=2)
    cached.forward(x, mask)
    for b in (cached, plain):  # an update between the forward and its backward
        b.backward(other_x, other_mask, *other_grads)
    got = cached.backward(x, mask, *grads)
    want = plain.backward(x, mask, *grads)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert cache.hits == 0 and cache.misses == 2


def test_the_cache_evicts_the_oldest_graphs_beyond_its_budget():
    probe = ActivationCache(1 << 30)
    backend(probe).forward(*batch()[:2])
    per_entry = probe.nbytes
    cache = ActivationCache(2 * per_entry)
    b = backend(cache)
    for seed in range(4):
        b.forward(*batch(seed=seed)[:2])
    assert len(cache) == 2 and cache.evictions == 2 and cache.nbytes <= 2 * per_entry


def test_clip_grad_norm_bounds_the_update():
    b = backend(lr=1.0, clip_grad_norm=1e-3)
    before = [p.detach().clone() for p in b.module.parameters()]
    x, mask, grads = batch()
    b.backward(x, mask, grads[0] * 1000, grads[1])
    step = torch.cat(
        [(p - q).flatten() for p, q in zip(b.module.parameters(), before, strict=True)]
    )
    assert step.norm() <= 1e-3 * 1.01


def test_state_dict_round_trip_includes_optimizer_and_scheduler():
    def make():
        b = backend()
        b.optimizer = torch.optim.Adam(b.module.parameters(), lr=0.01)
        b.scheduler = get_linear_schedule_with_warmup(b.optimizer, 2, 10)
        return b

    trained, fresh = make(), make()
    for seed in range(3):
        x, mask, grads = batch(seed=seed)
        trained.backward(x, mask, *grads)
    fresh.load_state_dict(trained.checkpoint_state())
    assert fresh.update_count == 3 and fresh.scheduler.last_epoch == 3
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 3
    x, mask, grads = batch(seed=9)
    a, b = trained.backward(x, mask, *grads), fresh.backward(x, mask, *grads)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    for p, q in zip(trained.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_linear_schedule_warms_up_then_decays_to_zero():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=6)
    lrs = []
    for _ in range(8):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert make_scheduler("none", optimizer) is None
    with pytest.raises(ValidationError, match="unknown scheduler 'cosine'"):
        make_scheduler("cosine", optimizer, 1, 2)


def test_bad_backend_definitions_are_refused_clearly():
    with pytest.raises(ValidationError, match="needs an args_schema"):
        ModuleBackend("e.0", nn.Linear(2, 2))
    with pytest.raises(
        ValidationError, match=r"failed on a sample input shaped like .*\[None, 3\]"
    ):
        ModuleBackend("e.0", nn.Linear(2, 2), args_schema=BatchTensorDescriptor(3))
    with pytest.raises(ValidationError, match="keyword arguments"):
        ModuleBackend(
            "e.0",
            nn.Linear(2, 2),
            args_schema=BatchTensorDescriptor(2),
            kwargs_schema={"y": BatchTensorDescriptor(2)},
        )


def test_an_output_that_breaks_the_schema_is_an_error_naming_the_expert():
    class Shrinking(nn.Module):
        def forward(self, x):
            return x[:, :1] if x.shape[0] > 2 else x

    b = ModuleBackend("shrink.0", Shrinking(), args_schema=BatchTensorDescriptor(4))
    with pytest.raises(ValidationError, match=r"outputs of expert 'shrink.0'\[0\]: expected shape"):
        b.forward(torch.zeros(3, 4))


def test_the_cache_bounds_graphs_that_save_nothing_by_count_and_age():
    cache = ActivationCache(1 << 30, max_entries=3, max_age=3600)
    schema = BatchTensorDescriptor(4)
    identity = ModuleBackend("id.0", nn.Identity(), args_schema=schema, activation_cache=cache)
    for _ in range(5):
        identity.forward(torch.randn(2, 4))
    assert len(cache) == 3 and cache.nbytes > 0  # inputs it keeps are counted too
    cache.max_age = 0.0
    identity.forward(torch.randn(2, 4))
    assert len(cache) <= 1
