"""Robust aggregation rules: what a span's owner computes from its senders' parts when some
senders may lie.

A plain weighted mean lets one peer move the average anywhere (send a gradient scaled by
1000, or claim the whole batch as its weight). These rules bound that influence:

* :class:`CenteredClip` (Karimireddy, He and Jaggi, 2021, as used by Gorbunov et al.'s
  BTARD): start at the coordinate-wise median, then repeatedly move the center by the
  weighted mean of each input's offset clipped to norm ``tau``. An input farther than
  ``tau`` from the center pulls with force ``tau`` at most, so a minority of outliers moves
  the result by a bounded amount however large they are.
* :class:`TrimmedMean`: per coordinate, drop the ``trim`` largest and smallest values and
  average the rest (weights are not used: a weight is itself a claim).

Both cap weights first (:func:`cap_weights`): no input counts for more than
``max_weight_ratio`` times the median weight. Inputs with NaN or Inf are dropped by the
caller before (the all-reduce excludes such senders).

Rules are applied per *part* of a span (the unit the all-reduce streams), so ``tau``
bounds the clipped offset of each part, not of the whole vector: clipping in blocks is
as robust per block and needs no second pass over the span (see docs/design-notes.md).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from swarmgrad.utils.checks import (
    int_at_least,
    non_negative_int,
    number_at_least,
    positive_int,
)
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "AggregationRule",
    "CenteredClip",
    "TrimmedMean",
    "cap_weights",
    "lower_median",
    "sorted_rows",
    "sorting_network",
]


def cap_weights(weights: torch.Tensor, max_weight_ratio: float) -> torch.Tensor:
    """``min(w, max_weight_ratio x median(w))`` per input (the lower median for an even
    count); all-zero weights stay zero."""
    if weights.numel() == 0:
        return weights
    capped = _capped(weights.reshape(-1).tolist(), max_weight_ratio)
    return torch.tensor(capped, dtype=weights.dtype).reshape(weights.shape)


def _capped(weights: list[float], max_weight_ratio: float) -> list[float]:
    """:func:`cap_weights` on a list: a group's few weights cost less as Python floats
    than as a handful of tensor calls."""
    median = sorted(weights)[(len(weights) - 1) // 2]
    if median <= 0:
        positive = sorted(w for w in weights if w > 0)
        median = positive[(len(positive) - 1) // 2] if positive else 0.0
    if median <= 0:
        return weights
    cap = max_weight_ratio * median
    return [min(w, cap) for w in weights]


NETWORK_MAX_INPUTS = 16  # above this, torch's sort; below, a sorting network


@functools.cache
def sorting_network(size: int) -> tuple[tuple[int, int], ...]:
    """Compare-exchange pairs of Batcher's odd-even merge sort on ``size`` wires (a power
    of two): after them, wire ``i`` holds the ``i``-th smallest value. Blocks of ``2p``
    sorted halves are merged by comparing wires ``k`` apart, for ``k`` from ``p`` down."""
    if size < 1 or size & (size - 1):
        raise ValidationError(f"a sorting network needs a power of two wires, got {size}")
    pairs = []
    block = 1
    while block < size:
        gap = block
        while gap >= 1:
            for start in range(gap % block, size - gap, 2 * gap):
                for offset in range(min(gap, size - start - gap)):
                    low = start + offset
                    if low // (2 * block) == (low + gap) // (2 * block):
                        pairs.append((low, low + gap))
            gap //= 2
        block *= 2
    return tuple(pairs)


def sorted_rows(inputs: torch.Tensor) -> list[torch.Tensor]:
    """The ``n`` rows of ``inputs`` ``[n, d]`` sorted coordinate by coordinate (row 0 the
    smallest values). For a group's few inputs, a sorting network of elementwise
    min/max is 10-20 x faster than ``torch.sort`` along the short dimension (which was
    most of CenteredClip's time); missing wires of the padded network act as +inf."""
    n = inputs.shape[0]
    if n > NETWORK_MAX_INPUTS:
        return list(inputs.sort(dim=0).values.unbind(0))
    rows: list[torch.Tensor | None] = list(inputs.unbind(0))
    rows += [None] * ((1 << (n - 1).bit_length()) - n)
    for i, j in sorting_network(len(rows)):
        low, high = rows[i], rows[j]
        if high is None:  # +inf stays above
            continue
        if low is None:
            rows[i], rows[j] = high, None
        else:
            rows[i], rows[j] = torch.minimum(low, high), torch.maximum(low, high)
    return [row for row in rows[:n] if row is not None]


TORCH_MEDIAN_MAX_COLUMNS = 1024  # below, torch's median beats the network (15 vs 43 us)


def lower_median(inputs: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise lower median of the rows (as ``inputs.median(dim=0)``, which it
    is for short rows: there one call costs less than the network's few dozen)."""
    if inputs.shape[1] <= TORCH_MEDIAN_MAX_COLUMNS:
        return inputs.median(dim=0).values
    return sorted_rows(inputs)[(inputs.shape[0] - 1) // 2]


@dataclass(frozen=True)
class AggregationRule:
    """Base: ``aggregate(inputs, weights)`` with inputs of shape ``[n, d]`` (float32 or
    float64) and weights ``[n]``; returns the ``[d]`` result and, per input, whether the
    rule limited its influence (clipped or trimmed in most coordinates).

    ``min_inputs``: an owner aggregates a part only when at least this many senders
    delivered it, else the span stays local for everyone this round. No rule survives a
    dishonest majority, and a group thinned by exclusions (slow or dead honest peers) can
    have lost its honest majority; to tolerate ``f`` liars use ``min_inputs = 2 f + 1``
    and a ``min_group_size`` of at least that."""

    max_weight_ratio: float = 3.0
    check_factor: float = 4.0
    min_inputs: int = 1

    def __post_init__(self) -> None:
        int_at_least("min_inputs", self.min_inputs, 1)
        number_at_least("max_weight_ratio", self.max_weight_ratio, 1)
        factor = self.check_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise ValidationError(f"check_factor must be a positive number, got {factor!r}")

    def max_result_distance(self, own_norm: float) -> float:
        """How far a span's result may lie from a receiver's own input before the receiver
        calls the reduction bad (a norm bound: the receiver knows only its own input).
        Honest inputs of similar size average within about twice their norm of each one;
        a reducer that scales or replaces the result by something large fails it, a
        subtle shift does not (docs/security.md)."""
        return self.check_factor * own_norm + 1e-6

    @property
    def _quorum_tag(self) -> str:
        return f",min_inputs={self.min_inputs}" if self.min_inputs != 1 else ""

    @property
    def tag(self) -> str:
        """What members compare: peers with another rule (or other parameters) never
        average together."""
        raise NotImplementedError

    def aggregate(
        self, inputs: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool]]:
        raise NotImplementedError

    def _check(self, inputs: torch.Tensor, weights: torch.Tensor) -> list[float]:
        """The capped weights, as Python floats rounded to the inputs' dtype."""
        if inputs.dim() != 2 or weights.shape != (inputs.shape[0],):
            raise ValidationError(
                f"inputs must be [n, d] with n weights, got {tuple(inputs.shape)} and "
                f"{tuple(weights.shape)}"
            )
        if inputs.shape[0] == 0:
            raise ValidationError("nothing to aggregate: no inputs")
        values = weights.to(inputs.dtype).tolist()
        if not all(0 <= w < math.inf for w in values):  # NaN fails both comparisons
            raise ValidationError("weights must be finite and >= 0")
        if sum(values) <= 0:  # all weight 0 (auxiliary-only): equal weights
            values = [1.0] * len(values)
        return _capped(values, self.max_weight_ratio)


@dataclass(frozen=True)
class CenteredClip(AggregationRule):
    """``CenteredClip(tau=1.0, n_iters=20, outlier_factor=3.0)``; ``tau`` in the units of
    the averaged values (a gradient's per-part norm scale), ``n_iters`` the fixed-point
    iterations. An input counts as limited (evidence against its sender) when it was
    clipped *and* lies more than ``outlier_factor`` times the inputs' median distance from
    the result: with ``tau`` near the honest spread, the honest input that happens to lie
    farthest is clipped too, and with worker momentum it stays farthest for several
    rounds; a liar that pulls hard enough to matter lies far beyond the others. The
    factor decides blame only, never the result, so it is not part of the tag."""

    tau: float = 1.0
    n_iters: int = 20
    outlier_factor: float = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.tau, bool) or not isinstance(self.tau, int | float):
            raise ValidationError(f"tau must be a positive number, got {self.tau!r}")
        if not 0 < self.tau < math.inf:
            raise ValidationError(f"tau must be a positive number, got {self.tau!r}")
        positive_int("n_iters", self.n_iters)
        number_at_least("outlier_factor", self.outlier_factor, 1)

    @property
    def tag(self) -> str:
        return (
            f"centered_clip(tau={self.tau!r},iters={self.n_iters},cap={self.max_weight_ratio!r}"
            f"{self._quorum_tag})"
        )

    def max_result_distance(self, own_norm: float) -> float:
        return self.check_factor * (own_norm + self.tau)

    def aggregate(
        self, inputs: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool]]:
        """The iteration runs in the space of coefficients: every center is ``median +
        beta @ (inputs - median)`` (each step moves it by a weighted sum of offsets, whose
        weights sum to what it keeps of the old one), so with the Gram matrix of the
        offsets from the median each iteration costs O(n^2) instead of five passes over
        all ``n x d`` values: the data are read a few times in all (median, Gram matrix,
        the final combination). Working with offsets from the median keeps the
        distances free of cancellation for inputs that nearly agree (parameters in sync);
        the small algebra is float64."""
        dtype = _NUMPY_DTYPE.get(inputs.dtype, np.float64)
        capped = np.array(self._check(inputs, weights), dtype=dtype)
        w = (capped / capped.sum()).astype(np.float64)  # normalised in the inputs' dtype
        median = lower_median(inputs)
        offsets = inputs - median  # [n, d]
        gram = (offsets @ offsets.T).to(torch.float64).numpy()  # [n, n]
        diagonal = gram.diagonal().copy()
        beta = np.zeros(len(w))
        gram_beta = np.zeros(len(w))  # gram @ beta, kept up to date
        center_sq = 0.0  # |c - median|^2 = beta @ gram @ beta
        median_norm = float(median.norm())
        tau = float(self.tau)
        w_tau = w * tau
        distances = np.zeros(len(w))
        # n x n numpy: microseconds, not torch calls; few operations per iteration, since
        # for a small tensor the iteration is most of the rule's cost (robust_overhead)
        for _ in range(self.n_iters):
            # |x_i - c|^2 = |y_i|^2 - 2 y_i.(c - median) + |c - median|^2
            distances = np.sqrt(np.maximum(diagonal - 2 * gram_beta + center_sq, 0.0))
            pull = w_tau / np.maximum(distances, tau)  # w_i min(tau / d_i, 1)
            # c += sum_i pull_i (x_i - c): in coefficients, beta += pull - sum(pull) beta
            delta = pull - pull.sum() * beta
            gram_delta = gram @ delta
            step_sq = float(delta @ gram_delta)  # |step|^2
            scale = max(1.0, median_norm + math.sqrt(max(center_sq, 0.0)))
            beta += delta
            gram_beta += gram_delta
            center_sq = float(beta @ gram_beta)
            if step_sq <= (1e-7 * scale) ** 2:
                break
        # blame: clipped at the last center the loop measured, and far beyond the others
        distances = distances.tolist()  # n floats: Python's median and comparisons are cheap
        typical = self.outlier_factor * statistics.median(distances)
        stands_out = [d > tau and d > typical for d in distances]
        combination = torch.tensor(beta.tolist(), dtype=inputs.dtype)
        return median + combination @ offsets, stands_out


# the inputs' dtype for the weights' normalisation; float64 for any other (half) dtype
_NUMPY_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


@dataclass(frozen=True)
class TrimmedMean(AggregationRule):
    """``TrimmedMean(trim=1)``: drop the ``trim`` largest and smallest values of each
    coordinate (at most ``(n - 1) // 2`` each way; with fewer inputs, the median)."""

    trim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        non_negative_int("trim", self.trim)

    @property
    def tag(self) -> str:
        return f"trimmed_mean(trim={self.trim}{self._quorum_tag})"

    def aggregate(
        self, inputs: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool]]:
        self._check(inputs, weights)
        n = inputs.shape[0]
        trim = min(self.trim, (n - 1) // 2)
        kept = torch.stack(sorted_rows(inputs)[trim : n - trim])
        result = kept.mean(dim=0)
        if trim == 0:
            return result, [False] * n
        # an input stands out where most of its coordinates lie beyond the kept values
        # by more than their spread (the extremes that every trim cuts do not)
        low, high = kept[0], kept[-1]
        spread = (high - low).clamp_min(1e-12)
        outside = (inputs < low - spread) | (inputs > high + spread)
        return result, (outside.float().mean(dim=1) > 0.5).tolist()
