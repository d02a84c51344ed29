"""TrainingStateAverager over loopback: a state round in the background keeps the local
progress made while it ran (the delta rule)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarmgrad.dht import DHT
from swarmgrad.optim import TrainingStateAverager
from swarmgrad.optim.optimizer_state import optimizer_parameters
from tests.helpers.optim import dht_swarm, local_step, make_model, snapshot, wait_until

pytestmark = pytest.mark.slow

LR = 0.1


def make_state_averager(
    dht: DHT, model: torch.nn.Module, *, offload_optimizer: bool
) -> TrainingStateAverager:
    return TrainingStateAverager(
        dht=dht,
        prefix="delta_rule",
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        params=model.parameters(),
        offload_optimizer=offload_optimizer,
        target_group_size=2,
        min_matchmaking_time=0.5,
        start=True,
    )


@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_local_step_made_during_a_background_round_is_kept_on_top_of_the_average(
    offload_optimizer,
):
    """Peer 0 starts a state round in the background and, while it looks for a group,
    takes an optimizer step. Peer 1 joins only after that step, so the round cannot end
    before it. Peer 0 ends with the average plus its own step (``local += average -
    copy``); peer 1, which changed nothing meanwhile, with the average itself."""
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(1)]
        first, second = (
            make_state_averager(d, m, offload_optimizer=offload_optimizer)
            for d, m in zip(dhts, models, strict=True)
        )
        try:
            pairs = zip(snapshot(models[0]), snapshot(models[1]), strict=True)
            average = [(a + b) / 2 for a, b in pairs]
            first.step(averaging_round=True, delay_averaging=True, averaging_opts={"timeout": 20})
            # the round's copy of the state is taken before it looks for a group
            wait_until(lambda: first._round_control is not None, 10, "peer 0's round to begin")
            assert first.averaging_in_progress

            local_step(models[0], torch.Generator().manual_seed(0))
            grads = [p.grad.clone() for p in models[0].parameters()]
            if offload_optimizer:  # the optimizer steps on the CPU master copy
                for master, grad in zip(optimizer_parameters(first.optimizer), grads, strict=True):
                    master.grad = grad.clone()
            first.step(optimizer_step=True, wait_for_delayed_updates=False)
            assert first.averaging_in_progress, "the round ended before peer 1 joined"

            second.step(averaging_round=True, averaging_opts={"timeout": 20})
            first.step(wait_for_delayed_updates=True)  # applies the finished round
            assert not first.averaging_in_progress

            for got, want in zip(snapshot(models[1]), average, strict=True):
                assert torch.allclose(got, want, atol=1e-6)
            for got, want, grad in zip(snapshot(models[0]), average, grads, strict=True):
                assert torch.allclose(got, want - LR * grad, atol=1e-6)
            # the step was large enough that losing it (or the average) would show
            assert max(float((LR * g).abs().max()) for g in grads) > 1e-3
            assert first.state_version == second.state_version == 1
        finally:
            first.shutdown()
            second.shutdown()


def test_a_state_round_with_nobody_to_meet_gives_up_after_its_search_timeout(caplog):
    """``search_timeout`` bounds how long a state round looks for a group: alone, the
    round is given up after it (not after the whole ``timeout``), the state is left as
    it was and the averager can take the next round at once; a partner that arrives
    within the search time is averaged with as before. (Without the bound, two peers
    whose rounds alternate, each in one while the other is in another, wait out every
    timeout for each other for good: the ALBERT programs' swarm did so on a loaded box.)"""
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(1)]
        first, second = (
            make_state_averager(d, m, offload_optimizer=False)
            for d, m in zip(dhts, models, strict=True)
        )
        try:
            before = snapshot(models[0])
            started = time.monotonic()
            caplog.set_level("DEBUG", logger="swarmgrad.optim.state_averager")
            first.step(averaging_round=True, averaging_opts={"timeout": 30, "search_timeout": 1})
            took = time.monotonic() - started
            assert took < 10, f"a lone state round took {took:.1f} s with search_timeout=1"
            assert "skipped: no group within 1.0 s" in caplog.text
            for got, want in zip(snapshot(models[0]), before, strict=True):
                assert torch.equal(got, want)
            assert first.state_version == 0

            pairs = zip(snapshot(models[0]), snapshot(models[1]), strict=True)
            average = [(a + b) / 2 for a, b in pairs]
            options = {"timeout": 30, "search_timeout": 5}
            first.step(averaging_round=True, delay_averaging=True, averaging_opts=options)
            second.step(averaging_round=True, averaging_opts=options)
            first.step(wait_for_delayed_updates=True)
            for model in models:
                for got, want in zip(snapshot(model), average, strict=True):
                    assert torch.allclose(got, want, atol=1e-6)
        finally:
            first.shutdown()
            second.shutdown()


def test_a_state_round_whose_partners_all_left_stops_searching_at_once(caplog):
    """``averaging_opts["alone"]`` (the Optimizer's: every other peer said goodbye or
    expired) ends the search for a group before ``search_timeout``: the last peer of a
    swarm no longer waits out the search for partners that are gone."""
    with dht_swarm(1) as (dht,):
        model = make_model(0)
        before = snapshot(model)
        averager = make_state_averager(dht, model, offload_optimizer=False)
        asked = threading.Event()

        def alone() -> bool:
            asked.set()
            return True

        try:
            caplog.set_level("DEBUG", logger="swarmgrad.optim.state_averager")
            started = time.monotonic()
            options = {"timeout": 30, "search_timeout": 20, "alone": alone}
            averager.step(averaging_round=True, averaging_opts=options)
            took = time.monotonic() - started
            assert asked.is_set()
            assert took < 5, f"a round with every partner gone searched {took:.1f} s"
            assert "skipped: every other peer left" in caplog.text
            for got, want in zip(snapshot(model), before, strict=True):
                assert torch.equal(got, want)
            assert averager.state_version == 0
        finally:
            averager.shutdown()


def test_a_round_waits_through_the_callers_wait_which_may_give_it_up():
    """``averaging_opts["wait"]`` waits for the round in place of ``control.result``: the
    Optimizer's gives up a round whose partners all left. A lonely peer's round that it
    gives up ends at once (no state change) rather than after its 30 s timeout."""
    import time

    with dht_swarm(1) as (dht,):
        model = make_model(0)
        before = snapshot(model)
        averager = make_state_averager(dht, model, offload_optimizer=False)
        waited = []

        def give_up(control):
            waited.append(control)
            time.sleep(0.5)
            control.cancel()
            return None

        try:
            began = time.monotonic()
            averager.step(averaging_round=True, averaging_opts={"timeout": 30, "wait": give_up})
            assert time.monotonic() - began < 15
            assert len(waited) == 1 and waited[0].cancelled()
            assert averager.state_version == 0
            for got, want in zip(snapshot(model), before, strict=True):
                assert torch.equal(got, want)
        finally:
            averager.shutdown()


def test_a_state_served_while_a_delayed_step_is_pending_is_the_epoch_before():
    """The epoch is counted when the epoch ends, its optimizer step comes later in the
    background (after the gradient round). A joiner asking for the state in between gets
    it at once, labelled with the epoch its tensors hold: the one before. Not the new
    epoch's label on the old tensors (two ALBERT trainers once passed such a state back
    and forth at start-up: a monitor saved "step 3" with no optimizer step in it), and
    no wait for the step (the step waits for a gradient round that may wait for the
    joiner: an ALBERT joiner once stalled for the whole averaging timeout)."""
    with dht_swarm(1) as (dht,):
        model = make_model(0)
        averager = make_state_averager(dht, model, offload_optimizer=True)
        released = threading.Event()
        try:
            local_step(model, torch.Generator().manual_seed(0))
            before = snapshot(model)
            averager.step(
                increment_epoch=True,
                optimizer_step=True,
                delay_optimizer_step=True,
                wait_for_trigger=lambda: released.wait(30),  # the gradient round
            )
            assert averager.local_epoch == 1
            began = time.monotonic()
            metadata, tensors = averager.get_current_state()
            assert time.monotonic() - began < 5, "the state waited for the delayed step"
            assert metadata["epoch"] == 0
            for got, want in zip(tensors[: len(before)], before, strict=True):
                assert torch.equal(got, want)

            released.set()
            averager.step(wait_for_delayed_updates=True)  # the step has come
            metadata, tensors = averager.get_current_state()
            assert metadata["epoch"] == 1
            params = tensors[: len(before)]
            assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
            for got, want in zip(snapshot(model), params, strict=True):
                assert torch.equal(got, want)
        finally:
            released.set()
            averager.shutdown()
