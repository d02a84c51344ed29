"""DiLoCo as a mode of ``Optimizer``: ``Optimizer(..., outer_optimizer=...)`` builds a
DiLoCoOptimizer from the hivemind arguments, trains like one, and refuses by name the
arguments that mean nothing without gradient averaging."""

from __future__ import annotations

import copy

import pytest
import torch

import swarmgrad
from swarmgrad.compression import Float16Compression
from swarmgrad.optim.diloco import DiLoCoOptimizer
from swarmgrad.utils.errors import ValidationError
from tests.helpers.optim import Trainer, dht_swarm, make_model, max_difference, start_together

RUN = "diloco_mode_run"


def nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def make_mode_optimizer(dht, model, **options):
    options.setdefault("run_id", RUN)
    options.setdefault("target_batch_size", 24)
    options.setdefault("batch_size_per_step", 8)
    options.setdefault("optimizer", lambda params: torch.optim.SGD(params, lr=0.05))
    options.setdefault("outer_optimizer", nesterov)
    options.setdefault("matchmaking_time", 1.0)
    options.setdefault("averaging_timeout", 15.0)
    return swarmgrad.Optimizer(dht=dht, params=model.parameters(), **options)


def train_alone(opt, model, steps: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    epochs = []
    for _ in range(steps):
        x = torch.randn(8, 8, generator=generator)
        torch.nn.functional.mse_loss(model(x), x[:, :2]).backward()
        opt.step()
        opt.zero_grad()
        epochs.append(opt.local_epoch)
    return epochs


def test_the_mode_steps_exactly_as_the_diloco_optimizer_given_the_same_settings():
    """target_batch_size=24 with batches of 8: an outer step every 3 steps of a lone peer,
    bit for bit what DiLoCoOptimizer(num_inner_steps=3) does."""
    with dht_swarm(2) as (first, second):
        model = make_model(seed=1)
        twin = copy.deepcopy(model)
        mode = make_mode_optimizer(first, model, run_id="mode_alone")
        direct = DiLoCoOptimizer(
            dht=second,
            run_id="direct_alone",
            batch_size=8,
            num_inner_steps=3,
            inner_optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
            outer_optimizer=nesterov,
            params=twin.parameters(),
            matchmaking_time=1.0,
            averaging_timeout=15.0,
        )
        try:
            assert isinstance(mode, DiLoCoOptimizer) and mode.num_inner_steps == 3
            assert train_alone(mode, model, 6) == [0, 0, 1, 1, 1, 2]
            assert train_alone(direct, twin, 6) == [0, 0, 1, 1, 1, 2]
            assert max_difference(list(model.parameters()), list(twin.parameters())) == 0
        finally:
            mode.shutdown()
            direct.shutdown()


def test_peers_in_the_mode_sync_together():
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [
            make_mode_optimizer(
                dht,
                model,
                target_batch_size=64,
                grad_compression=Float16Compression(),
            )
            for dht, model in zip(dhts, models, strict=True)
        ]
        trainers = [
            Trainer(opt, model, seed=i, until_epoch=3)
            for i, (opt, model) in enumerate(zip(opts, models, strict=True))
        ]
        try:
            start_together(trainers)
            for trainer in trainers:
                trainer.result()
            for epoch in (1, 2, 3):
                a, b = (t.params_at_epoch[epoch] for t in trainers)
                assert max_difference(a, b) < 1e-6
            assert max_difference(trainers[0].params_at_epoch[0], a) > 0
        finally:
            for opt in opts:
                opt.shutdown()


def test_diloco_options_pass_and_gradient_only_arguments_are_refused_by_name():
    with dht_swarm(1) as (dht,):
        model = make_model()
        for options, reason in (
            ({"delay_grad_averaging": True}, "delay_grad_averaging=True has no meaning"),
            ({"reuse_grad_buffers": True}, "reuse_grad_buffers=True has no meaning"),
            ({"average_state_every": 2}, "average_state_every=2 has no meaning"),
            ({"auxiliary": True}, "auxiliary=True has no meaning"),
            ({"extra_tensors": [torch.zeros(2)]}, "extra_tensors=.* has no meaning"),
            (
                {"state_averaging_compression": Float16Compression()},
                "state_averaging_compression=.* has no meaning",
            ),
            ({"batch_size_per_step": None}, "needs batch_size_per_step"),
            ({"diloco_opts": {"num_fragmnets": 2}}, r"unknown keys \['num_fragmnets'\]"),
            ({"diloco_opts": {"num_fragments": 0}}, "num_fragments must be a positive int"),
            ({"outer_optimizer": nesterov(model.parameters())}, "must be a factory"),
        ):
            with pytest.raises(ValidationError, match=reason):
                make_mode_optimizer(dht, model, **options)
        streaming = make_mode_optimizer(dht, model, diloco_opts={"num_fragments": 2})
        try:
            assert len(streaming.fragments) == 2
        finally:
            streaming.shutdown()
        with pytest.raises(ValidationError, match="diloco_opts needs outer_optimizer"):
            make_mode_optimizer(dht, model, outer_optimizer=None, diloco_opts={})
        with pytest.raises(TypeError, match="keyword arguments only"):
            swarmgrad.Optimizer(dht, outer_optimizer=nesterov)


def test_diloco_mode_and_diloco_optimizer_are_optimizers():
    with dht_swarm(1) as (dht,):
        mode = make_mode_optimizer(dht, make_model(), run_id="mode")
        direct = DiLoCoOptimizer(
            dht=dht,
            run_id="direct",
            batch_size=8,
            num_inner_steps=4,
            inner_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            params=make_model().parameters(),
        )
        try:
            for opt in (mode, direct):
                assert isinstance(opt, swarmgrad.Optimizer)
                assert isinstance(opt, swarmgrad.DiLoCoOptimizer)
                assert opt.opt is opt.inner_optimizer
                assert opt.use_local_updates and not opt.use_gradient_averaging
                assert opt.is_synchronized_with_peers()
            assert mode.num_inner_steps == 3  # target 24 / 8 per step
        finally:
            mode.shutdown()
            direct.shutdown()
        assert mode._closed and direct._closed
