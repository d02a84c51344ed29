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

import math
from dataclasses import dataclass

import torch

from swarmgrad.utils.errors import ValidationError

__all__ = ["AggregationRule", "CenteredClip", "TrimmedMean", "cap_weights"]


def cap_weights(weights: torch.Tensor, max_weight_ratio: float) -> torch.Tensor:
    """``min(w, max_weight_ratio x median(w))`` per input (the lower median for an even
    count); all-zero weights stay zero."""
    if weights.numel() == 0:
        return weights
    median = float(weights.median())
    if median <= 0:
        median = float(weights[weights > 0].median()) if bool((weights > 0).any()) else 0.0
    if median <= 0:
        return weights
    return weights.clamp(max=max_weight_ratio * median)


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
        count = self.min_inputs
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValidationError(f"min_inputs must be an int >= 1, got {count!r}")
        ratio = self.max_weight_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio >= 1:
            raise ValidationError(f"max_weight_ratio must be a number >= 1, got {ratio!r}")
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

    def _check(self, inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if inputs.dim() != 2 or weights.shape != (inputs.shape[0],):
            raise ValidationError(
                f"inputs must be [n, d] with n weights, got {tuple(inputs.shape)} and "
                f"{tuple(weights.shape)}"
            )
        if inputs.shape[0] == 0:
            raise ValidationError("nothing to aggregate: no inputs")
        weights = weights.to(inputs.dtype)
        if bool((weights < 0).any()) or not bool(torch.isfinite(weights).all()):
            raise ValidationError("weights must be finite and >= 0")
        if float(weights.sum()) <= 0:  # all weight 0 (auxiliary-only): equal weights
            weights = torch.ones_like(weights)
        return cap_weights(weights, self.max_weight_ratio)


@dataclass(frozen=True)
class CenteredClip(AggregationRule):
    """``CenteredClip(tau=1.0, n_iters=20)``; ``tau`` in the units of the averaged values
    (a gradient's per-part norm scale), ``n_iters`` the fixed-point iterations."""

    tau: float = 1.0
    n_iters: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.tau, bool) or not isinstance(self.tau, int | float):
            raise ValidationError(f"tau must be a positive number, got {self.tau!r}")
        if not 0 < self.tau < math.inf:
            raise ValidationError(f"tau must be a positive number, got {self.tau!r}")
        if isinstance(self.n_iters, bool) or not isinstance(self.n_iters, int):
            raise ValidationError(f"n_iters must be a positive int, got {self.n_iters!r}")
        if self.n_iters <= 0:
            raise ValidationError(f"n_iters must be a positive int, got {self.n_iters}")

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
        weights = self._check(inputs, weights)
        n = inputs.shape[0]
        w = (weights / weights.sum()).to(torch.float64)
        median = inputs.median(dim=0).values
        offsets = inputs - median  # [n, d]
        gram = (offsets @ offsets.T).to(torch.float64)  # [n, n]
        beta = torch.zeros(n, dtype=torch.float64)
        median_norm = float(median.norm())
        tau = float(self.tau)
        clipped = torch.zeros(n, dtype=torch.bool)
        for _ in range(self.n_iters):
            gram_beta = gram @ beta
            center_sq = float(beta @ gram_beta)  # |c - median|^2
            # |x_i - c|^2 = |y_i|^2 - 2 y_i.(c - median) + |c - median|^2
            squared = gram.diagonal() - 2 * gram_beta + center_sq
            distances = squared.clamp_min(0).sqrt()
            clipped = distances > tau
            pull = w * torch.clamp(tau / distances.clamp_min(1e-30), max=1.0)
            beta = beta * (1 - float(pull.sum())) + pull  # c += sum_i pull_i (x_i - c)
            # |step|^2 = pull^T D pull, D_ij = (x_i - c).(x_j - c) at the old center
            between = gram - gram_beta[:, None] - gram_beta[None, :] + center_sq
            step_sq = float(pull @ between @ pull)
            scale = max(1.0, median_norm + math.sqrt(max(center_sq, 0.0)))
            if step_sq <= (1e-7 * scale) ** 2:
                break
        return median + beta.to(inputs.dtype) @ offsets, clipped.tolist()


@dataclass(frozen=True)
class TrimmedMean(AggregationRule):
    """``TrimmedMean(trim=1)``: drop the ``trim`` largest and smallest values of each
    coordinate (at most ``(n - 1) // 2`` each way; with fewer inputs, the median)."""

    trim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.trim, bool) or not isinstance(self.trim, int) or self.trim < 0:
            raise ValidationError(f"trim must be an int >= 0, got {self.trim!r}")

    @property
    def tag(self) -> str:
        return f"trimmed_mean(trim={self.trim}{self._quorum_tag})"

    def aggregate(
        self, inputs: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool]]:
        self._check(inputs, weights)
        n = inputs.shape[0]
        trim = min(self.trim, (n - 1) // 2)
        ordered = inputs.sort(dim=0).values
        kept = ordered[trim : n - trim]
        result = kept.mean(dim=0)
        if trim == 0:
            return result, [False] * n
        # an input stands out where most of its coordinates lie beyond the kept values
        # by more than their spread (the extremes that every trim cuts do not)
        low, high = kept[0], kept[-1]
        spread = (high - low).clamp_min(1e-12)
        outside = (inputs < low - spread) | (inputs > high + spread)
        return result, (outside.float().mean(dim=1) > 0.5).tolist()
