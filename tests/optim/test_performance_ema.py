"""PerformanceEMA: a smoothed samples-per-second figure; time in pause() is not work. The
clock is replaced by a fake one, so no test depends on how fast the machine runs."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.optim import performance_ema
from swarmgrad.optim.performance_ema import PerformanceEMA
from swarmgrad.utils.errors import ValidationError


class FakeClock:
    """Stands in for the ``time`` module inside performance_ema."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(performance_ema, "time", fake)
    return fake


def test_rate_is_zero_before_any_update(clock):
    ema = PerformanceEMA()
    clock.advance(5)
    assert ema.samples_per_second == 0.0
    assert ema.num_updates == 0
    assert "0 updates" in repr(ema)


def test_first_update_gives_the_measured_rate_and_later_ones_are_averaged():
    ema = PerformanceEMA(alpha=0.5)
    assert ema.update(10, interval=2.0) == pytest.approx(5.0)  # 0.2 s per sample
    # the second update weighs max(alpha, 1/2) = 0.5: (0.1 + 0.2) / 2 s per sample
    assert ema.update(10, interval=1.0) == pytest.approx(1 / 0.15)
    # the third weighs alpha: 0.5 * 0.4 + 0.5 * 0.15
    assert ema.update(5, interval=2.0) == pytest.approx(1 / 0.275)
    assert ema.num_updates == 3
    assert ema.ema_seconds_per_sample == pytest.approx(0.275)


def test_early_updates_are_a_plain_mean_until_alpha_takes_over():
    ema = PerformanceEMA(alpha=0.25)
    per_sample = [0.1, 0.3, 0.2, 0.4]  # 1/n >= 0.25 for n <= 4: the running mean
    for seconds in per_sample:
        ema.update(1, interval=seconds)
    assert ema.ema_seconds_per_sample == pytest.approx(sum(per_sample) / 4)
    ema.update(1, interval=1.0)
    assert ema.ema_seconds_per_sample == pytest.approx(0.25 * 1.0 + 0.75 * 0.25)


def test_the_interval_defaults_to_the_time_since_the_previous_update(clock):
    ema = PerformanceEMA(alpha=1.0)
    ema.reset_timer()
    clock.advance(4)
    assert ema.update(8) == pytest.approx(2.0)
    clock.advance(1)
    assert ema.update(8) == pytest.approx(8.0)


def test_the_start_up_before_the_first_update_is_a_lower_bound_then_dropped(clock):
    """The first interval runs from construction and holds the process and the swarm
    starting: a lab peer counted its 1.2 s start-up in its first step and published 20
    to 107 samples/s over its first six steps where it made 720."""
    ema = PerformanceEMA(alpha=0.1)
    clock.advance(1.2)
    # a rate at once (a peer whose epoch is one big step needs its samples counted)...
    assert ema.update(16) == pytest.approx(16 / 1.2) and ema.num_updates == 0
    for _ in range(3):
        clock.advance(0.02)
        ema.update(16)
    # ...but not averaged in: the measured steps alone
    assert ema.samples_per_second == pytest.approx(800.0) and ema.num_updates == 3
    # an interval given explicitly is a measurement, first or not
    assert PerformanceEMA(alpha=1.0).update(16, interval=0.5) == pytest.approx(32.0)


def test_reset_timer_starts_the_next_interval_now(clock):
    ema = PerformanceEMA(alpha=1.0)
    clock.advance(100)  # e.g. waiting for the swarm: not work
    ema.reset_timer()
    clock.advance(2)
    assert ema.update(4) == pytest.approx(2.0)


def test_time_inside_pause_is_not_counted(clock):
    ema = PerformanceEMA(alpha=0.5)
    ema.reset_timer()
    clock.advance(2)
    assert ema.update(10) == pytest.approx(5.0)
    clock.advance(1)  # one second of work before the pause...
    with ema.pause():
        clock.advance(60)
        # an update while paused does not count and does not change the rate
        assert ema.update(1_000) == pytest.approx(5.0)
        assert ema.num_updates == 1
        clock.advance(60)
    clock.advance(2)  # ...is forgotten too: the interval starts when the pause ends
    assert ema.update(10) == pytest.approx(5.0)
    assert ema.num_updates == 2


def test_nested_pauses_stay_paused_until_the_outer_one_ends(clock):
    ema = PerformanceEMA(alpha=1.0)
    with ema.pause():
        with ema.pause():
            clock.advance(10)
        ema.update(5)
        assert ema.num_updates == 0
    clock.advance(1)
    assert ema.update(5) == pytest.approx(5.0)


def test_a_zero_interval_gives_a_huge_but_finite_rate():
    ema = PerformanceEMA(alpha=1.0)
    rate = ema.update(1, interval=0.0)
    assert math.isfinite(rate) and rate > 1e15
    ema.update(1, interval=-3.0)  # a clock that went backwards counts as zero
    assert math.isfinite(ema.samples_per_second)


@pytest.mark.parametrize("alpha", [0, 0.0, -0.1, 1.5, math.nan, math.inf, True, "0.1", None])
def test_an_alpha_outside_zero_to_one_is_refused(alpha):
    with pytest.raises(ValidationError, match="performance_ema_alpha"):
        PerformanceEMA(alpha=alpha)


def test_alpha_one_is_allowed_and_keeps_only_the_last_measurement():
    ema = PerformanceEMA(alpha=1)
    ema.update(1, interval=10.0)
    ema.update(1, interval=0.5)
    assert ema.samples_per_second == pytest.approx(2.0)


@pytest.mark.parametrize("task_size", [0, -1, math.nan, math.inf])
def test_a_task_size_that_is_not_a_positive_number_is_refused(task_size):
    ema = PerformanceEMA()
    with pytest.raises(ValidationError, match="task_size"):
        ema.update(task_size, interval=1.0)
    assert ema.num_updates == 0


@settings(max_examples=200, deadline=None)
@given(
    alpha=st.floats(0.01, 1.0),
    seconds_per_sample=st.floats(1e-6, 1e3),
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=30),
)
def test_a_steady_speed_is_reported_exactly_whatever_the_batch_sizes(
    alpha, seconds_per_sample, sizes
):
    ema = PerformanceEMA(alpha=alpha)
    for size in sizes:
        ema.update(size, interval=size * seconds_per_sample)
    assert ema.samples_per_second == pytest.approx(1 / seconds_per_sample, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    alpha=st.floats(0.01, 1.0),
    steps=st.lists(
        # intervals a clock can measure: zero or at least a nanosecond (hypothesis found
        # subnormal ones, ~1e-315 s, where no float arithmetic keeps 1e-9 relative error)
        st.tuples(st.integers(1, 1_000), st.one_of(st.just(0.0), st.floats(1e-9, 100.0))),
        min_size=1,
        max_size=30,
    ),
)
def test_the_rate_stays_between_the_slowest_and_fastest_measurement(alpha, steps):
    ema = PerformanceEMA(alpha=alpha)
    for size, interval in steps:
        ema.update(size, interval=interval)
    per_sample = [interval / size for size, interval in steps]
    slowest, fastest = max(per_sample), min(per_sample)
    assert ema.ema_seconds_per_sample <= slowest * (1 + 1e-9)
    assert ema.ema_seconds_per_sample >= fastest * (1 - 1e-9)
    assert ema.samples_per_second > 0 and math.isfinite(ema.samples_per_second)


def test_updates_from_several_threads_are_all_counted():
    ema = PerformanceEMA(alpha=0.1)

    def work():
        for _ in range(500):
            ema.update(2, interval=1.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert ema.num_updates == 2_000
    assert ema.samples_per_second == pytest.approx(2.0)
