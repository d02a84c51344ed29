"""A torch optimizer's state as (metadata, tensors) and back: round trips for the usual
optimizers, initialization that changes nothing the user can see, and a peer's state that
does not fit refused before anything changes."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmgrad.dht.validation import deserialize, serialize
from swarmgrad.optim.optimizer_state import (
    dump_optimizer_state,
    initialize_optimizer_state_,
    load_optimizer_state_,
    optimizer_parameters,
    optimizer_state_tensors,
)
from swarmgrad.utils.errors import ValidationError

SHAPES = [(4, 3), (3,), (2, 2, 2)]

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05),
}


def make_params(seed: int = 0, shapes=SHAPES) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def set_grads(params, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def trained(factory, params, steps: int = 3) -> torch.optim.Optimizer:
    optimizer = factory(params)
    for step in range(steps):
        set_grads(params, 100 + step)
        optimizer.step()
    return optimizer


def state_snapshot(optimizer) -> list[dict]:
    """Per parameter, a copy of its state (tensors cloned)."""
    return [
        {
            key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in optimizer.state.get(param, {}).items()
        }
        for param in optimizer_parameters(optimizer)
    ]


def assert_same_state(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert sorted(mine) == sorted(theirs), index
        for key in mine:
            a, b = mine[key], theirs[key]
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor), (index, key)
                assert torch.equal(a, b), (index, key)
            else:
                assert a == b, (index, key)


def groups_snapshot(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def fresh_initialized(factory, seed: int = 7, shapes=SHAPES) -> torch.optim.Optimizer:
    optimizer = factory(make_params(seed, shapes))
    initialize_optimizer_state_(optimizer)
    return optimizer


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_dumped_state_loads_into_a_fresh_optimizer_over_same_shaped_parameters(name):
    factory = OPTIMIZERS[name]
    source = trained(factory, make_params(0))
    source.param_groups[0]["lr"] = 0.0123  # as a scheduler would have set it
    metadata, tensors = dump_optimizer_state(source)
    metadata = deserialize(serialize(metadata))  # it travels as msgpack

    target = fresh_initialized(factory)
    load_optimizer_state_(target, metadata, [t.clone() for t in tensors])

    assert_same_state(state_snapshot(target), state_snapshot(source))
    assert target.param_groups[0]["lr"] == 0.0123
    if name != "sgd_momentum":
        steps = [target.state[p]["step"] for p in optimizer_parameters(target)]
        assert all(float(step) == 3 for step in steps)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_after_loading_both_optimizers_take_the_same_next_step(name):
    factory = OPTIMIZERS[name]
    source_params = make_params(0)
    source = trained(factory, source_params)
    metadata, tensors = dump_optimizer_state(source)
    target_params = make_params(5)
    target = factory(target_params)
    initialize_optimizer_state_(target)
    load_optimizer_state_(target, metadata, tensors)
    with torch.no_grad():
        for mine, theirs in zip(target_params, source_params, strict=True):
            mine.copy_(theirs)
    set_grads(source_params, 9)
    set_grads(target_params, 9)
    source.step()
    target.step()
    for mine, theirs in zip(target_params, source_params, strict=True):
        assert torch.equal(mine, theirs)


def test_every_param_group_gets_its_own_learning_rate():
    params = make_params(0)
    source = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}])
    set_grads(params, 1)
    source.step()
    source.param_groups[0]["lr"], source.param_groups[1]["lr"] = 0.01, 0.02
    metadata, tensors = dump_optimizer_state(source)

    target_params = make_params(3)
    target = torch.optim.Adam([{"params": target_params[:1]}, {"params": target_params[1:]}])
    initialize_optimizer_state_(target)
    load_optimizer_state_(target, metadata, tensors)
    assert [g["lr"] for g in target.param_groups] == [0.01, 0.02]
    assert_same_state(state_snapshot(target), state_snapshot(source))


def test_state_tensors_are_named_in_a_fixed_order_parameter_by_parameter():
    optimizer = trained(OPTIMIZERS["adam"], make_params(0))
    names = [name for name, _ in optimizer_state_tensors(optimizer)]
    assert names == [
        f"param {i} {key}" for i in range(len(SHAPES)) for key in ("exp_avg", "exp_avg_sq", "step")
    ]
    _, tensors = dump_optimizer_state(optimizer)
    assert [t for _, t in optimizer_state_tensors(optimizer)] == tensors  # the same objects


class _CountingSGD(torch.optim.Optimizer):
    """Keeps non-tensor state too: an int step counter, a None and an unshareable list."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state.setdefault("step", 0)
                state.setdefault("note", None)
                state.setdefault("history", [])  # a list: not shared
                state["step"] += 1
                state["velocity"] = state.get("velocity", torch.zeros_like(param)) + param.grad
                param.sub_(group["lr"] * state["velocity"])


def test_plain_values_in_the_state_travel_in_the_metadata():
    source = trained(_CountingSGD, make_params(0), steps=4)
    metadata, tensors = dump_optimizer_state(source)
    assert len(tensors) == len(SHAPES)
    target = fresh_initialized(_CountingSGD)
    assert all(target.state[p]["step"] == 0 for p in optimizer_parameters(target))
    load_optimizer_state_(target, deserialize(serialize(metadata)), tensors)
    for mine, theirs in zip(state_snapshot(target), state_snapshot(source), strict=True):
        assert mine["step"] == theirs["step"] == 4
        assert mine["note"] is None
        assert torch.equal(mine["velocity"], theirs["velocity"])
        assert mine["history"] == []  # ours, untouched


# ---------------------------------------------------------------------- initialization


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_initialization_creates_the_state_without_changing_parameters_or_grads(name):
    params = make_params(0)
    params[1].grad = torch.full(params[1].shape, 3.0)  # the user's gradient, mid-accumulation
    user_grad = params[1].grad
    before = [p.detach().clone() for p in params]
    optimizer = OPTIMIZERS[name](params)

    initialize_optimizer_state_(optimizer)

    for param, old in zip(params, before, strict=True):
        assert torch.equal(param, old)
        assert optimizer.state.get(param)
    assert params[0].grad is None and params[2].grad is None
    assert params[1].grad is user_grad and torch.equal(user_grad, torch.full((3,), 3.0))
    for param in params:
        state = optimizer.state[param]
        if "step" in state:
            assert float(state["step"]) == 0
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                assert value.shape == param.shape


def test_initialization_leaves_an_existing_state_alone():
    optimizer = trained(OPTIMIZERS["adam"], make_params(0))
    before = state_snapshot(optimizer)
    initialize_optimizer_state_(optimizer)
    assert_same_state(state_snapshot(optimizer), before)


def test_initialization_skips_frozen_parameters():
    params = make_params(0)
    params[2].requires_grad_(False)
    frozen = params[2].detach().clone()
    optimizer = torch.optim.Adam(params, lr=0.1)
    initialize_optimizer_state_(optimizer)
    assert torch.equal(params[2], frozen) and params[2].grad is None
    assert not optimizer.state.get(params[2])
    assert optimizer.state[params[0]] and optimizer.state[params[1]]


@pytest.mark.parametrize(
    "factory",
    [
        lambda params: torch.optim.Adam(params, lr=0.1),
        lambda params: torch.optim.Adam(params, lr=0.1, weight_decay=0.1),
        lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    ],
    ids=["adam", "adam_weight_decay", "adamw", "sgd_momentum", "sgd_momentum_weight_decay"],
)
def test_training_after_initialization_is_training_from_a_fresh_optimizer(factory):
    """The virtual step's effect is undone: the state it leaves behind is what a fresh
    optimizer would start from (zero moments), so the run trains as plain torch would."""
    fresh_params, initialized_params = make_params(0), make_params(0)
    fresh, initialized = factory(fresh_params), factory(initialized_params)
    initialize_optimizer_state_(initialized)
    for step in range(3):
        set_grads(fresh_params, step)
        set_grads(initialized_params, step)
        fresh.step()
        initialized.step()
    for mine, theirs in zip(initialized_params, fresh_params, strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-7), (mine - theirs).abs().max()


# ---------------------------------------------------------------------- states that do not fit


def test_another_optimizer_class_is_refused_naming_the_entries_before_anything_changes():
    metadata, tensors = dump_optimizer_state(trained(OPTIMIZERS["adam"], make_params(0)))
    target = fresh_initialized(OPTIMIZERS["sgd_momentum"])
    before, groups = state_snapshot(target), groups_snapshot(target)
    with pytest.raises(ValidationError, match="another layout") as refused:
        load_optimizer_state_(target, metadata, tensors)
    assert "exp_avg" in str(refused.value) and "momentum_buffer" in str(refused.value)
    assert_same_state(state_snapshot(target), before)
    assert groups_snapshot(target) == groups


def test_another_parameter_shape_is_refused_naming_the_tensor_before_anything_changes():
    source = trained(OPTIMIZERS["adam"], make_params(0))
    source.param_groups[0]["lr"] = 0.5
    metadata, tensors = dump_optimizer_state(source)
    # the first parameter fits; the second does not
    target = fresh_initialized(OPTIMIZERS["adam"], shapes=[(4, 3), (5,), (2, 2, 2)])
    before, groups = state_snapshot(target), groups_snapshot(target)
    with pytest.raises(ValidationError, match=r"'param 1 exp_avg' has shape \[3\] at the peer"):
        load_optimizer_state_(target, metadata, tensors)
    assert_same_state(state_snapshot(target), before)
    assert groups_snapshot(target) == groups


def test_another_number_of_parameters_is_refused():
    metadata, tensors = dump_optimizer_state(trained(OPTIMIZERS["adamw"], make_params(0)))
    target = fresh_initialized(OPTIMIZERS["adamw"], shapes=SHAPES[:2])
    before = state_snapshot(target)
    with pytest.raises(ValidationError, match="another layout: 9 entries, ours 6"):
        load_optimizer_state_(target, metadata, tensors)
    assert_same_state(state_snapshot(target), before)


def test_an_uninitialized_optimizer_has_no_layout_to_load_into():
    metadata, tensors = dump_optimizer_state(trained(OPTIMIZERS["adam"], make_params(0)))
    with pytest.raises(ValidationError, match="another layout"):
        load_optimizer_state_(OPTIMIZERS["adam"](make_params(1)), metadata, tensors)


@pytest.mark.parametrize("metadata", [None, [], "layout", {}, {"layout": "abc"}, {"layout": None}])
def test_malformed_metadata_is_refused(metadata):
    target = fresh_initialized(OPTIMIZERS["adam"])
    with pytest.raises(ValidationError, match="malformed"):
        load_optimizer_state_(target, metadata, [])


def test_a_missing_or_extra_tensor_is_refused():
    metadata, tensors = dump_optimizer_state(trained(OPTIMIZERS["sgd_momentum"], make_params(0)))
    target = fresh_initialized(OPTIMIZERS["sgd_momentum"])
    before = state_snapshot(target)
    for wrong in (tensors[:-1], [*tensors, torch.zeros(1)]):
        with pytest.raises(ValidationError, match="optimizer state tensors"):
            load_optimizer_state_(target, metadata, wrong)
    assert_same_state(state_snapshot(target), before)


def test_a_learning_rate_that_is_not_a_finite_number_is_not_taken_from_a_peer():
    """A donor's param groups only carry what a scheduler changes; a value of another type
    than ours (or NaN) must not end up in our optimizer, where the next step would fail."""
    source = trained(OPTIMIZERS["adam"], make_params(0))
    metadata, tensors = dump_optimizer_state(source)
    for bad in (math.nan, "fast", None, [0.1]):
        target = fresh_initialized(OPTIMIZERS["adam"])
        hostile = {**metadata, "param_groups": [{**metadata["param_groups"][0], "lr": bad}]}
        with contextlib.suppress(ValidationError):  # refusing is as good as ignoring
            load_optimizer_state_(target, hostile, tensors)
        lr = target.param_groups[0]["lr"]
        assert type(lr) is float and math.isfinite(lr), repr(bad)
        set_grads(optimizer_parameters(target), 1)
        target.step()  # still trains


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_layout_entries = st.one_of(
    _msgpack_values,
    st.tuples(
        st.integers(-1, 3),
        st.sampled_from(["exp_avg", "exp_avg_sq", "step", "x"]),
        st.sampled_from(["tensor", "value"]),
    ).map(list),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=_msgpack_values | st.lists(_layout_entries, max_size=10),
    values=_msgpack_values,
    param_groups=_msgpack_values,
    tensor_count=st.integers(0, 10),
)
def test_a_peers_garbage_metadata_raises_validation_error_only_and_changes_nothing(
    layout, values, param_groups, tensor_count
):
    target = fresh_initialized(OPTIMIZERS["adam"], shapes=[(2,), (3,)])
    before, groups = state_snapshot(target), groups_snapshot(target)
    metadata = {"layout": layout, "values": values, "param_groups": param_groups}
    tensors = [torch.ones(2) for _ in range(tensor_count)]
    try:
        load_optimizer_state_(target, metadata, tensors)
    except ValidationError:
        assert_same_state(state_snapshot(target), before)
        assert groups_snapshot(target) == groups
