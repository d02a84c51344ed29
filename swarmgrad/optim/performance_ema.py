"""A smoothed samples-per-second figure for one peer.

The progress tracker publishes it so that others can estimate when the swarm reaches its
target batch; time spent averaging or waiting is not work and is kept out of the estimate
by :meth:`PerformanceEMA.pause`.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator

from swarmgrad.utils.errors import ValidationError

__all__ = ["PerformanceEMA"]


class PerformanceEMA:
    """Exponential moving average of the time per sample, reported as samples/s.

    ``alpha`` weighs the newest measurement (hivemind's ``performance_ema_alpha``).
    :meth:`update` is called after each unit of work with its size; the interval is the
    time since the previous update (or since :meth:`reset_timer`), unless given.

    The first update without an interval measures from construction, which includes the
    process, the swarm and the model starting up: its rate is only a lower bound, reported
    until the first real measurement and then dropped rather than averaged in. Averaging
    it in made three lab peers whose pace summed to 1,800 samples/s publish 77 after a few
    steps (one peer's first six steps: 20 to 107 samples/s where it made 720); a peer that
    read those rates planned its next read 5 s ahead, by when the others had averaged
    epoch 0 without it. (A peer whose epoch is one big step still publishes a rate after
    that step, so its samples count for the others at once.)
    """

    def __init__(self, alpha: float = 0.1, eps: float = 1e-20, paused: bool = False):
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 1:
            raise ValidationError(f"performance_ema_alpha must be in (0, 1], got {alpha!r}")
        self.alpha, self.eps = float(alpha), eps
        self.ema_seconds_per_sample = 0.0
        self.num_updates = 0
        self._timestamp = time.perf_counter()
        self._measuring = False  # whether an interval ending now would be a real measurement
        self._lower_bound = 0.0  # the rate of the first, start-up-inflated interval
        self._paused = bool(paused)  # hivemind's flag: start paused (updates not counted)
        self._lock = threading.Lock()

    def update(self, task_size: float, interval: float | None = None) -> float:
        """Account for ``task_size`` samples done in ``interval`` seconds (default: since
        the last update); returns the new samples/s."""
        if not task_size > 0 or not math.isfinite(task_size):
            raise ValidationError(f"task_size must be a positive number, got {task_size!r}")
        with self._lock:
            now = time.perf_counter()
            started, self._timestamp = self._timestamp, now
            measuring, self._measuring = self._measuring, True
            if self._paused:
                return self.samples_per_second
            if interval is None:
                interval = now - started
                if not measuring:
                    self._lower_bound = task_size / max(interval, self.eps)
                    return self.samples_per_second
            interval = max(float(interval), 0.0)
            per_sample = interval / task_size
            self.num_updates += 1
            # Bias correction as in Adam: the first updates are not pulled towards zero.
            adjusted_alpha = max(self.alpha, 1.0 / self.num_updates)
            self.ema_seconds_per_sample = (
                adjusted_alpha * per_sample + (1 - adjusted_alpha) * self.ema_seconds_per_sample
            )
            return self.samples_per_second

    @property
    def samples_per_second(self) -> float:
        """0 until the first update (no evidence yet; never an absurd rate), then a lower
        bound until the first measured interval (see the class docstring)."""
        if self.num_updates == 0:
            return self._lower_bound
        return 1.0 / max(self.ema_seconds_per_sample, self.eps)

    def reset_timer(self) -> None:
        """The next interval starts now (after a pause in work, e.g. a reset)."""
        with self._lock:
            self._timestamp, self._measuring = time.perf_counter(), True

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Time inside the block is not work: the next interval starts at its end."""
        with self._lock:
            was_paused, self._paused = self._paused, True
        try:
            yield
        finally:
            with self._lock:
                self._paused = was_paused
                self._timestamp, self._measuring = time.perf_counter(), True

    def __repr__(self) -> str:
        return (
            f"PerformanceEMA({self.samples_per_second:.3g} samples/s, {self.num_updates} updates)"
        )
