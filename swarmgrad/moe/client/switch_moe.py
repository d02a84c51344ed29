"""``RemoteSwitchMixtureOfExperts``: Switch-Transformer routing over remote experts.

Each sample goes to its single best expert (by default); the output is the expert's
answer scaled by its routing probability (the product over grid dimensions of the
softmax of the gate scores), plus the input (a residual connection, as in hivemind). To
keep experts evenly used, the layer tracks how often each coordinate of each grid
dimension is used (an exponential moving average) and returns a balancing loss that grows
when the gate prefers coordinates that are already busy. During training, the gate reads
its input with multiplicative jitter and may drop whole grid coordinates for a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmgrad.utils.errors import ValidationError

from .moe import RemoteMixtureOfExperts, _gating_input, _weighted_sum

__all__ = ["RemoteSwitchMixtureOfExperts"]


class RemoteSwitchMixtureOfExperts(RemoteMixtureOfExperts):
    """hivemind's switch layer: ``forward`` returns ``(output, balancing_loss)``.

    :param utilization_alpha: weight of the past in the utilization moving average
    :param grid_dropout: probability of *keeping* each grid coordinate for a training
        batch (1.0: no dropout); at least one coordinate per dimension is always kept
    :param jitter_eps: the gate's input is multiplied by U(1 - eps, 1 + eps) in training
    Other parameters as :class:`RemoteMixtureOfExperts`; the defaults route each sample
    to one expert and give zeros (so the output is the input) when it does not answer.
    """

    def __init__(
        self,
        *,
        grid_size: Sequence[int],
        utilization_alpha: float = 0.9,
        grid_dropout: float = 1.0,
        jitter_eps: float = 1e-2,
        k_best: int = 1,
        k_min: int = 0,
        backward_k_min: int = 0,
        allow_zero_outputs: bool = True,
        **kwargs: Any,
    ):
        super().__init__(
            grid_size=grid_size,
            k_best=k_best,
            k_min=k_min,
            backward_k_min=backward_k_min,
            allow_zero_outputs=allow_zero_outputs,
            **kwargs,
        )
        if not 0.0 <= utilization_alpha <= 1.0 or not 0.0 < grid_dropout <= 1.0:
            raise ValidationError(
                f"need 0 <= utilization_alpha <= 1 and 0 < grid_dropout <= 1, got "
                f"{utilization_alpha} and {grid_dropout}"
            )
        if jitter_eps < 0:
            raise ValidationError(f"jitter_eps must be non-negative, got {jitter_eps}")
        self.utilization_alpha, self.grid_dropout, self.jitter_eps = (
            utilization_alpha,
            grid_dropout,
            jitter_eps,
        )
        sizes = self.beam_search.grid_size
        uniform = torch.cat([torch.full((n,), 1.0 / n) for n in sizes])
        self.register_buffer("grid_utilization", uniform)

    def forward(self, input: torch.Tensor, *args: torch.Tensor) -> tuple[Any, torch.Tensor]:
        sizes = self.beam_search.grid_size
        gating_input = _gating_input(input, self.proj.in_features)
        if self.training and self.jitter_eps > 0:
            eps = self.jitter_eps
            gating_input = gating_input * torch.empty_like(gating_input).uniform_(1 - eps, 1 + eps)
        grid_scores = list(self.proj(gating_input).split(sizes, dim=-1))
        if self.training and self.grid_dropout < 1.0:
            grid_scores = [self._drop_coordinates(scores) for scores in grid_scores]
        grid_probs = [torch.softmax(scores, dim=-1) for scores in grid_scores]

        mask, coords, outputs = self.call_experts(grid_scores, (input, *args))
        if self.training:
            self._update_utilization(mask, coords)
        probs = torch.ones_like(mask, dtype=grid_probs[0].dtype)
        for dim_probs, dim_coords in zip(grid_probs, coords, strict=True):
            probs = probs * dim_probs.gather(1, dim_coords)
        probs = probs * mask
        mixed = [_weighted_sum(probs, tensor) for tensor in outputs]
        if mixed[0].shape != input.shape:
            raise ValidationError(
                f"the switch layer adds its input to the experts' first output, so their "
                f"shapes must match: input {list(input.shape)}, output {list(mixed[0].shape)}"
            )
        mixed[0] = mixed[0] + input

        utilization = self.grid_utilization.split(sizes)
        balancing_loss = sum(
            (dim_probs.mean(dim=0) * dim_use).mean() * size**2
            for dim_probs, dim_use, size in zip(grid_probs, utilization, sizes, strict=True)
        )
        return self._pack(mixed), balancing_loss

    def _drop_coordinates(self, scores: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(scores.shape[-1], device=scores.device) < self.grid_dropout
        if not bool(keep.any()):
            keep[torch.randint(len(keep), (1,))] = True
        return torch.where(keep, scores, float("-inf"))

    @torch.no_grad()
    def _update_utilization(self, mask: torch.Tensor, coords: torch.Tensor) -> None:
        """Moving average of the share of answered (sample, expert) pairs per coordinate."""
        parts = []
        for dim_coords, size in zip(coords, self.beam_search.grid_size, strict=True):
            counts = torch.zeros(size, device=mask.device)
            counts.index_add_(0, dim_coords[mask], torch.ones(int(mask.sum()), device=mask.device))
            parts.append(counts / counts.sum().clamp_min(1.0))
        batch = torch.cat(parts).to(self.grid_utilization)
        alpha = self.utilization_alpha
        self.grid_utilization.mul_(alpha).add_((1 - alpha) * batch)
