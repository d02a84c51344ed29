"""GradientAverager: gradients accumulated over local steps become the sample-weighted
mean gradient, and two peers over loopback average theirs weighted by their samples."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.dht import DHT
from swarmgrad.optim import GradientAverager
from swarmgrad.utils.errors import ValidationError

PREFIX = "grads"


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def make_batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 3, generator=generator), torch.randn(size, 2, generator=generator)


def backward(model: torch.nn.Module, batch) -> None:
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()  # a mean over the batch


def mean_gradient(model: torch.nn.Module, batches) -> list[torch.Tensor]:
    """The gradient of the mean loss over every sample of ``batches`` (large-batch SGD)."""
    model.zero_grad()
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    backward(model, (x, y))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def averaged(averager: GradientAverager) -> list[torch.Tensor]:
    with averager.get_tensors() as tensors:
        return [t.clone() for t in tensors]


def assert_close(got, want, atol=1e-6):
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=atol), (g - w).abs().max()


@pytest.fixture
def dht():
    dht = DHT(start=True)
    yield dht
    dht.shutdown()


@pytest.fixture
def make_averager(dht):
    """Builds averagers on the DHT (started: a real averager on the loop thread) and shuts
    each of them down after the test."""
    created: list[GradientAverager] = []

    def make(parameters, **options) -> GradientAverager:
        options.setdefault("prefix", PREFIX)
        averager = GradientAverager(parameters, dht=options.pop("dht", dht), start=True, **options)
        created.append(averager)
        return averager

    yield make
    for averager in created:
        averager.shutdown()


# ---------------------------------------------------------------------- accumulation


def test_steps_of_different_batch_sizes_accumulate_to_the_sample_weighted_mean(make_averager):
    model = make_model()
    averager = make_averager(model.parameters())
    generator = torch.Generator().manual_seed(1)
    batches = [make_batch(generator, size) for size in (2, 5, 1)]
    for batch in batches:
        backward(model, batch)
        averager.accumulate_grads_(batch_size=len(batch[0]))
        model.zero_grad()
    assert averager.local_samples_accumulated == 8
    assert averager.local_times_accumulated == 3

    averager.load_accumulators_into_averager_()
    assert_close(averaged(averager), mean_gradient(model, batches))
    # the plain mean of the three per-step gradients would be another thing
    per_step = [mean_gradient(model, [batch]) for batch in batches]
    unweighted = [sum(gs) / 3 for gs in zip(*per_step, strict=True)]
    assert not all(
        torch.allclose(a, b) for a, b in zip(averaged(averager), unweighted, strict=True)
    )


def test_gradients_of_scaled_losses_are_unscaled_as_they_are_accumulated(make_averager):
    """grad_scale: each step's loss was multiplied by a (possibly different) scale; the
    accumulators hold the true gradients, so the mean is the unscaled run's."""
    model = make_model()
    averager = make_averager(model.parameters())
    generator = torch.Generator().manual_seed(3)
    batches = [make_batch(generator, size) for size in (3, 5)]
    for batch, scale in zip(batches, (2.0**16, 2.0**10), strict=True):
        x, y = batch
        (torch.nn.functional.mse_loss(model(x), y) * scale).backward()
        averager.accumulate_grads_(batch_size=len(x), grad_scale=scale)
        model.zero_grad()
    averager.load_accumulators_into_averager_()
    assert_close(averaged(averager), mean_gradient(model, batches), atol=1e-6)


@pytest.mark.parametrize("scale", [0, -1.0, float("inf"), float("nan"), "2"])
def test_a_grad_scale_that_is_not_a_positive_finite_number_is_refused(make_averager, scale):
    model = make_model()
    averager = make_averager(model.parameters())
    backward(model, make_batch(torch.Generator().manual_seed(0), 2))
    with pytest.raises(ValidationError, match="grad_scale"):
        averager.accumulate_grads_(batch_size=2, grad_scale=scale)


def test_a_grad_scale_with_reused_grad_buffers_is_refused(make_averager):
    model = make_model()
    averager = make_averager(model.parameters(), reuse_grad_buffers=True)
    backward(model, make_batch(torch.Generator().manual_seed(0), 2))
    with pytest.raises(ValidationError, match="reuse_grad_buffers"):
        averager.accumulate_grads_(batch_size=2, grad_scale=1024.0)
    averager.accumulate_grads_(batch_size=2, grad_scale=1.0)  # no scaling: fine


def test_reused_grad_buffers_hold_the_sum_and_are_divided_by_the_number_of_steps(make_averager):
    model = make_model()
    averager = make_averager(model.parameters(), reuse_grad_buffers=True)
    generator = torch.Generator().manual_seed(2)
    batches = [make_batch(generator, size) for size in (4, 4, 4)]
    per_step = [mean_gradient(model, [batch]) for batch in batches]
    expected = mean_gradient(make_model(), batches)  # on a copy: ours keeps its .grad
    for batch in batches:
        backward(model, batch)  # no zero_grad: .grad accumulates the per-step means
        averager.accumulate_grads_(batch_size=4)
    summed = [sum(gs) for gs in zip(*per_step, strict=True)]
    assert_close([p.grad for p in model.parameters()], summed, atol=1e-5)

    averager.load_accumulators_into_averager_()
    assert_close(averaged(averager), [s / 3 for s in summed], atol=1e-6)
    assert_close(averaged(averager), expected, atol=1e-6)  # batches of equal sizes
    assert averager.local_samples_accumulated == 12 and averager.local_times_accumulated == 3

    averager.reset_accumulated_grads_()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    assert averager.local_samples_accumulated == averager.local_times_accumulated == 0


def test_reset_forgets_what_was_accumulated(make_averager):
    model = make_model()
    averager = make_averager(model.parameters())
    generator = torch.Generator().manual_seed(3)
    backward(model, make_batch(generator, 6))
    averager.accumulate_grads_(batch_size=6)
    averager.reset_accumulated_grads_()
    assert averager.local_samples_accumulated == averager.local_times_accumulated == 0

    averager.load_accumulators_into_averager_()  # nothing accumulated: zeros, not NaN
    assert all(torch.count_nonzero(t) == 0 for t in averaged(averager))

    model.zero_grad()
    batch = make_batch(generator, 3)
    backward(model, batch)
    averager.accumulate_grads_(batch_size=3)
    averager.load_accumulators_into_averager_()
    assert_close(averaged(averager), mean_gradient(model, [batch]))


def test_a_parameter_without_a_gradient_contributes_zeros(make_averager):
    model = make_model()
    params = list(model.parameters())
    averager = make_averager(params)
    generator = torch.Generator().manual_seed(4)
    backward(model, make_batch(generator, 2))
    params[0].grad = None  # e.g. a layer that was not used in this step
    averager.accumulate_grads_(batch_size=2)
    averager.load_accumulators_into_averager_()
    result = averaged(averager)
    assert torch.count_nonzero(result[0]) == 0
    assert torch.count_nonzero(result[-1]) > 0


def test_after_a_reset_only_the_new_batches_count_even_for_a_parameter_without_gradient(
    make_averager,
):
    """The reset's zeros are written by the next accumulation (not at the epoch's end): a
    parameter without a gradient in that batch must come out zero, not last epoch's, and
    the batches after it add up as usual."""
    model = make_model()
    params = list(model.parameters())
    averager = make_averager(params)
    generator = torch.Generator().manual_seed(5)
    backward(model, make_batch(generator, 4))
    averager.accumulate_grads_(batch_size=4)
    averager.reset_accumulated_grads_()

    model.zero_grad()
    first, second = make_batch(generator, 2), make_batch(generator, 5)
    backward(model, first)
    saved = params[0].grad
    params[0].grad = None
    averager.accumulate_grads_(batch_size=2)
    params[0].grad = saved
    model.zero_grad()
    backward(model, second)
    averager.accumulate_grads_(batch_size=5)
    averager.load_accumulators_into_averager_()
    result = averaged(averager)

    want = mean_gradient(model, [first, second])
    want_second = mean_gradient(model, [second])
    assert_close(result[1:], want[1:])
    assert_close(result[:1], [want_second[0] * 5 / 7])  # only the second batch had one


def test_caller_given_averaged_grads_receive_the_mean(make_averager):
    model = make_model()
    buffers = [torch.full_like(p, 7.0).detach() for p in model.parameters()]
    averager = make_averager(model.parameters(), averaged_grads=buffers)
    generator = torch.Generator().manual_seed(5)
    batch = make_batch(generator, 4)
    backward(model, batch)
    averager.accumulate_grads_(batch_size=4)
    averager.load_accumulators_into_averager_()
    with averager.use_averaged_gradients() as grads:
        assert all(g is b for g, b in zip(grads, buffers, strict=True))
    assert_close(buffers, mean_gradient(model, [batch]))


# ---------------------------------------------------------------------- bad arguments


def test_worker_momentum_sends_an_average_of_this_peers_mean_gradients(make_averager):
    """m = beta m + (1 - beta) g per send, starting from the first g; loading the same
    accumulation twice (the fallback after a failed round) does not fold it twice."""
    model = make_model()
    averager = make_averager(model.parameters(), worker_momentum=0.75)
    generator = torch.Generator().manual_seed(3)
    first, second = make_batch(generator, 4), make_batch(generator, 4)
    sent = []
    for batch in (first, second):
        backward(model, batch)
        averager.accumulate_grads_(batch_size=4)
        model.zero_grad()
        averager.load_accumulators_into_averager_()
        averager.load_accumulators_into_averager_()  # again: the same momentum
        sent.append(averaged(averager))
        averager.reset_accumulated_grads_()
    g1, g2 = mean_gradient(model, [first]), mean_gradient(model, [second])
    assert_close(sent[0], g1)
    assert_close(sent[1], [0.75 * a + 0.25 * b for a, b in zip(g1, g2, strict=True)])


@pytest.mark.parametrize("beta", [-0.1, 1.0, 2, True, "0.9"])
def test_a_worker_momentum_outside_0_1_is_refused(dht, beta):
    with pytest.raises(ValidationError, match="worker_momentum"):
        GradientAverager(make_model().parameters(), dht=dht, prefix=PREFIX, start=False,
                         worker_momentum=beta)  # fmt: skip


def test_averaged_grads_of_the_wrong_shape_or_number_are_refused(dht):
    model = make_model()
    good = [torch.zeros_like(p).detach() for p in model.parameters()]
    wrong_shape = [*good[:1], torch.zeros(5), *good[2:]]
    with pytest.raises(ValidationError, match=r"averaged_grads\[1\] has shape \[5\], parameter 1"):
        GradientAverager(
            model.parameters(), dht=dht, prefix=PREFIX, start=True, averaged_grads=wrong_shape
        )
    with pytest.raises(ValidationError, match="averaged_grads has 3 tensors for 4 parameters"):
        GradientAverager(
            model.parameters(), dht=dht, prefix=PREFIX, start=True, averaged_grads=good[:3]
        )


def test_parameters_that_do_not_require_grad_are_refused(dht):
    model = make_model()
    params = list(model.parameters())
    params[2].requires_grad_(False)
    with pytest.raises(ValidationError, match="parameter 2 does not require grad"):
        GradientAverager(params, dht=dht, prefix=PREFIX, start=True)
    with pytest.raises(ValidationError, match="at least one parameter"):
        GradientAverager([], dht=dht, prefix=PREFIX, start=True)


@pytest.mark.parametrize("batch_size", [0, -3, True, 2.0, "4"])
def test_a_batch_size_that_is_not_a_positive_int_is_refused(make_averager, batch_size):
    model = make_model()
    averager = make_averager(model.parameters())
    with pytest.raises(ValidationError, match="batch_size"):
        averager.accumulate_grads_(batch_size=batch_size)
    assert averager.local_samples_accumulated == averager.local_times_accumulated == 0


# ---------------------------------------------------------------------- two peers


@pytest.fixture
def two_dhts():
    first = DHT(start=True)
    second = DHT(initial_peers=[str(a) for a in first.get_visible_maddrs()], start=True)
    yield first, second
    second.shutdown()
    first.shutdown()


@pytest.mark.timeout(120)
def test_two_peers_average_to_the_mean_gradient_over_all_their_samples(two_dhts):
    models = [make_model(0), make_model(0)]
    generator = torch.Generator().manual_seed(6)
    data = [
        [make_batch(generator, 1), make_batch(generator, 2)],  # 3 samples
        [make_batch(generator, 5)],  # 5 samples
    ]
    expected = mean_gradient(make_model(0), [batch for batches in data for batch in batches])
    averagers = [
        GradientAverager(
            model.parameters(),
            dht=dht,
            prefix=PREFIX,
            start=True,
            target_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=5.0,
        )
        for model, dht in zip(models, two_dhts, strict=True)
    ]
    controls = []
    try:
        for averager, model, batches in zip(averagers, models, data, strict=True):
            for batch in batches:
                backward(model, batch)
                averager.accumulate_grads_(batch_size=len(batch[0]))
                model.zero_grad()
        controls = [averager.schedule_step(timeout=60) for averager in averagers]
        for averager, control in zip(averagers, controls, strict=True):
            assert averager.step(control=control, wait=False) is control
        assert [c.weight for c in controls] == [3.0, 5.0]
        results = [control.result(90) for control in controls]

        peer_ids = {averager.peer_id for averager in averagers}
        assert all(result is not None and set(result) == peer_ids for result in results)
        for averager in averagers:
            assert_close(averaged(averager), expected, atol=1e-5)
            # the accumulators were reset for the next epoch
            assert averager.local_samples_accumulated == 0
    finally:
        for control in controls:
            if not control.done():
                control.cancel()
        for averager in averagers:
            averager.shutdown()


def test_step_refuses_round_options_for_an_already_scheduled_round(make_averager):
    model = make_model()
    averager = make_averager(model.parameters(), min_matchmaking_time=1.0)
    control = averager.schedule_step(timeout=30)
    try:
        with pytest.raises(ValidationError, match="cannot apply to a scheduled step"):
            averager.step(control=control, gather="x", wait=False)
    finally:
        control.cancel()
