"""GradScaler on CPU: between epochs it only looks for overflow (the accumulated gradients
stay scaled), inside ``running_global_step`` it unscales and steps for real, and the scale
changes only after a real step or an overflow.

torch 2.13's ``torch.amp.GradScaler("cpu")`` is enabled on CPU (only ``"cuda"`` without
CUDA disables itself), so these tests exercise the real scaling code.
"""

from __future__ import annotations

import math

import pytest
import torch

from swarmgrad.optim import GradScaler

INIT_SCALE = 1024.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def scaled_backward(scaler: GradScaler, model: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def scaler() -> GradScaler:
    return GradScaler(device="cpu", init_scale=INIT_SCALE, growth_interval=1)


def test_torch_scales_on_cpu_in_this_version():
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    assert scaler.is_enabled()
    assert float(scaler.scale(torch.tensor(2.0))) == 2.0 * INIT_SCALE
    assert GradScaler(device="cpu").is_enabled()


def test_between_epochs_unscale_only_checks_and_leaves_the_gradients_scaled(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    before = grads(model)

    assert scaler.unscale_(optimizer) is False
    assert equal(grads(model), before)
    assert scaler.are_grads_finite(optimizer, use_cached=True)


def test_between_epochs_update_keeps_the_scale_and_lets_the_next_step_unscale_again(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):  # growth_interval=1: torch's scaler would double it each time
        scaled_backward(scaler, model, seed=step)
        assert scaler.unscale_(optimizer) is False
        assert scaler.update() is False
        assert scaler.get_scale() == INIT_SCALE
    scaled_backward(scaler, model, seed=9)
    scaler.step(optimizer)  # a local step; torch's own step() calls our unscale_
    assert scaler.update() is False
    assert scaler.get_scale() == INIT_SCALE


def test_inside_the_global_step_unscale_divides_by_the_scale(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    before = grads(model)

    with scaler.running_global_step():
        assert scaler.unscale_(optimizer) is True
    for got, scaled in zip(grads(model), before, strict=True):
        assert torch.allclose(got, scaled / INIT_SCALE)


def test_the_global_step_uses_the_unscaled_gradients_once_and_then_the_scale_grows(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    start, scaled = params(model), grads(model)

    with scaler.running_global_step():
        assert scaler.unscale_(optimizer) is True
        assert scaler.step(optimizer) is True  # not unscaled a second time
    for new, old, grad in zip(params(model), start, scaled, strict=True):
        assert torch.allclose(new, old - 0.1 * grad / INIT_SCALE)

    assert scaler.update() is True
    assert scaler.get_scale() == 2 * INIT_SCALE  # growth_interval=1


def test_the_global_step_unscales_by_itself_when_nobody_did(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    start, scaled = params(model), grads(model)
    with scaler.running_global_step():
        scaler.step(optimizer)
    for new, old, grad in zip(params(model), start, scaled, strict=True):
        assert torch.allclose(new, old - 0.1 * grad / INIT_SCALE)


def test_an_inf_gradient_makes_the_grads_not_finite(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    assert scaler.are_grads_finite(optimizer)
    model.weight.grad[0, 0] = math.inf
    assert not scaler.are_grads_finite(optimizer)
    model.weight.grad[0, 0] = math.nan
    assert not scaler.are_grads_finite(optimizer)


def test_an_overflow_between_epochs_shrinks_the_scale(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    model.bias.grad[1] = math.inf
    assert scaler.unscale_(optimizer) is False
    assert not scaler.are_grads_finite(optimizer, use_cached=True)
    assert scaler.update() is True
    assert scaler.get_scale() == INIT_SCALE / 2

    # the next (finite) local step is no overflow: the scale stays
    model.zero_grad()
    scaled_backward(scaler, model)
    assert scaler.unscale_(optimizer) is False
    assert scaler.update() is False
    assert scaler.get_scale() == INIT_SCALE / 2


def test_a_local_step_on_overflowing_gradients_is_skipped(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    model.weight.grad[1, 2] = -math.inf
    start = params(model)
    scaler.step(optimizer)
    assert equal(params(model), start)
    assert scaler.update() is True
    assert scaler.get_scale() == INIT_SCALE / 2


def test_a_global_step_on_overflowing_gradients_is_skipped_and_shrinks_the_scale(scaler):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    model.weight.grad[0, 1] = math.nan
    start = params(model)
    with scaler.running_global_step():
        assert scaler.unscale_(optimizer) is True
        scaler.step(optimizer)
    assert equal(params(model), start)
    assert scaler.update() is True
    assert scaler.get_scale() == INIT_SCALE / 2


def test_local_steps_then_a_global_step_grow_the_scale_only_at_the_end(scaler):
    """The whole epoch's life: local steps check for overflow and leave the scale; the
    epoch's real step unscales once and may grow it."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        scaled_backward(scaler, model, seed=step)  # .grad accumulates (never zeroed)
        assert scaler.unscale_(optimizer) is False
        scaler.update()
        assert scaler.get_scale() == INIT_SCALE
    accumulated = grads(model)
    with scaler.running_global_step():
        assert scaler.unscale_(optimizer) is True
    for got, want in zip(grads(model), accumulated, strict=True):
        assert torch.allclose(got, want / INIT_SCALE)
    with scaler.running_global_step():
        scaler.step(optimizer)
    assert scaler.update() is True
    assert scaler.get_scale() == 2 * INIT_SCALE


def test_unscale_for_step_unscales_once_says_finite_and_lets_update_change_the_scale(scaler):
    """A step its owner takes later (a delayed local update): the gradients are unscaled
    now, the user's update() may follow before the step and the next step's unscale
    works again."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_backward(scaler, model)
    scaled = grads(model)
    assert scaler.unscale_for_step(optimizer) is True
    for got, want in zip(grads(model), scaled, strict=True):
        assert torch.allclose(got, want / INIT_SCALE)
    assert scaler.update() is True
    assert scaler.get_scale() == 2 * INIT_SCALE  # growth_interval=1

    model.zero_grad()
    scaled_backward(scaler, model, seed=2)
    model.weight.grad[0, 0] = math.inf
    assert scaler.unscale_for_step(optimizer) is False  # the owner skips its step
    assert scaler.update() is True
    assert scaler.get_scale() == INIT_SCALE
