"""``RemoteMixtureOfExperts``: a layer whose experts live on other peers.

For a batch, a product-key gate scores every coordinate of the expert grid; the beam
search finds each sample's ``k_best`` live experts; the samples go to their experts as one
sub-batch per expert (:mod:`swarmgrad.moe.client.dispatch`); the answers are averaged with
softmax weights over the gate scores of the experts that answered, so the gate learns. All
networking runs on the process's event loop thread; the layer is called from ordinary
synchronous training code, and its backward pass sends one backward request per expert.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from swarmgrad.moe.expert_uid import UID_DELIMITER, ExpertInfo
from swarmgrad.moe.protocol import check_batch
from swarmgrad.utils.errors import DeadlineExceeded, ValidationError
from swarmgrad.utils.loop_thread import run_coroutine

from .beam_search import MoEBeamSearcher
from .caller import DEFAULT_TIMEOUT, ExpertSchema
from .dispatch import (
    Answer,
    CallerPool,
    NoExpertsAnswered,
    backward_from_experts,
    forward_to_experts,
)
from .expert import DUMMY, to_device, to_host

__all__ = ["RemoteMixtureOfExperts"]


class RemoteMixtureOfExperts(nn.Module):
    """A mixture-of-experts layer over the experts ``uid_prefix`` x ``grid_size`` that
    servers declared in the DHT (hivemind's parameters).

    :param in_features: the last dimension of the input (the gate reads the input averaged
        over any dimensions between the batch and the last)
    :param grid_size: the expert grid, e.g. ``(32, 32)`` for experts ``prefix.i.j``
    :param dht: a running ``DHT``; its peer calls the experts
    :param uid_prefix: the grid's name, such as ``"expert."``
    :param k_best: experts chosen per sample by the beam search
    :param k_min: answers per sample to wait for before cutting stragglers
    :param forward_timeout: seconds for the whole forward pass, beam search included
        (None: each expert call may take up to a minute)
    :param timeout_after_k_min: seconds to wait for more answers once every sample has
        ``k_min`` (None: until the forward deadline)
    :param backward_k_min: like ``k_min``, for backward calls
    :param backward_timeout: seconds for the whole backward pass
    :param detect_anomalies: drop answers and gradients with NaN or infinite values
    :param allow_zero_outputs: a sample no expert answered gets zeros instead of an error
    :param max_attempts: rounds of ``k_best`` experts a sample tries when all the experts
        of its previous round failed (the next best ones of its beam)
    :param dht_kwargs: passed to :class:`MoEBeamSearcher` (``num_workers``,
        ``negative_caching``, ``cache_expiration``, ``prefix_cache_ttl``)
    """

    def __init__(
        self,
        *,
        in_features: int,
        grid_size: Sequence[int],
        dht: Any,
        uid_prefix: str,
        k_best: int,
        k_min: int = 1,
        forward_timeout: float | None = None,
        timeout_after_k_min: float | None = None,
        backward_k_min: int = 1,
        backward_timeout: float | None = None,
        detect_anomalies: bool = False,
        allow_zero_outputs: bool = False,
        max_attempts: int = 3,
        **dht_kwargs: Any,
    ):
        super().__init__()
        if k_best < 1 or not 0 <= k_min <= k_best or backward_k_min < 0:
            raise ValidationError(
                f"need k_best >= 1, 0 <= k_min <= k_best and backward_k_min >= 0; got "
                f"k_best={k_best}, k_min={k_min}, backward_k_min={backward_k_min}"
            )
        for name, value in [
            ("forward_timeout", forward_timeout),
            ("timeout_after_k_min", timeout_after_k_min),
            ("backward_timeout", backward_timeout),
        ]:
            if value is not None and value < 0:
                raise ValidationError(f"{name} must be non-negative or None, got {value}")
        self.dht = dht
        self.beam_search = MoEBeamSearcher(dht, uid_prefix, grid_size, **dht_kwargs)
        self.k_best, self.k_min, self.backward_k_min = k_best, k_min, backward_k_min
        self.forward_timeout, self.backward_timeout = forward_timeout, backward_timeout
        self.timeout_after_k_min = timeout_after_k_min
        self.detect_anomalies, self.allow_zero_outputs = detect_anomalies, allow_zero_outputs
        self.max_attempts = max(max_attempts, 1)
        self.proj = nn.Linear(in_features, sum(self.beam_search.grid_size))
        self._schema: ExpertSchema | None = None
        self._callers = CallerPool(dht, timeout=DEFAULT_TIMEOUT)

    # ------------------------------------------------------------------ forward

    def forward(self, input: torch.Tensor, *args: torch.Tensor) -> Any:
        """Average the answers of each sample's best live experts. ``input`` is
        batch-first with ``in_features`` last; ``args`` are further expert arguments
        (batch-first). Returns a tensor, or a tuple when experts have several outputs."""
        gating_input = _gating_input(input, self.proj.in_features)
        grid_scores = self.proj(gating_input).split(self.beam_search.grid_size, dim=-1)
        mask, coords, outputs = self.call_experts(grid_scores, (input, *args))
        logits = self.compute_scores(grid_scores, coords)
        empty_rows = torch.where(mask.any(dim=1, keepdim=True), float("-inf"), 0.0)
        weights = torch.softmax(torch.where(mask, logits, empty_rows), dim=1) * mask
        return self._pack([_weighted_sum(weights, tensor) for tensor in outputs])

    def call_experts(
        self, grid_scores: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Find experts for ``grid_scores`` and run them on ``inputs``. Returns a
        ``[batch, slots]`` mask of answers, the ``[grid dims, batch, slots]`` coordinates
        of the expert in each slot, and each output as ``[batch, slots, ...]`` (zeros
        where the mask is False), differentiable through the experts."""
        if not inputs or inputs[0].ndim < 2:
            raise ValidationError("the input must be batch-first with at least 2 dimensions")
        scores = [s.detach().cpu().numpy() for s in grid_scores]
        host = to_host(inputs)  # one copy to the host: for the wire and for autograd
        detached = [t.detach() for t in host]
        outcome, schema = run_coroutine(self._forward_async(scores, detached))
        plan = _Plan(outcome.answers, len(detached[0]), schema, len(scores))
        device = inputs[0].device
        outputs = _RemoteMixtureCall.apply(DUMMY, plan, self, *host)
        return plan.mask.to(device), plan.coords.to(device), list(to_device(outputs, device))

    def compute_scores(self, grid_scores: Sequence[torch.Tensor], coords: torch.Tensor):
        """Each slot's expert score, the sum of its coordinates' gate scores: ``[batch,
        slots]``, differentiable with respect to ``grid_scores``."""
        return sum(g.gather(1, c) for g, c in zip(grid_scores, coords, strict=True))

    def compute_expert_scores(
        self, grid_scores: Sequence[torch.Tensor], batch_experts: Sequence[Sequence[Any]]
    ) -> torch.Tensor:
        """hivemind's helper: scores of given experts (anything with a ``uid``) per sample,
        ``[batch, max experts]``, padded with -inf."""
        width = max((len(experts) for experts in batch_experts), default=0)
        dims = len(self.beam_search.grid_size)
        coords = torch.zeros(dims, len(batch_experts), max(width, 1), dtype=torch.long)
        mask = torch.zeros(len(batch_experts), max(width, 1), dtype=torch.bool)
        for s, experts in enumerate(batch_experts):
            for j, expert in enumerate(experts):
                coords[:, s, j] = torch.tensor(_grid_coords(expert.uid, dims))
                mask[s, j] = True
        scores = self.compute_scores(grid_scores, coords.to(grid_scores[0].device))
        return torch.where(mask.to(scores.device), scores, float("-inf"))[:, :width]

    @property
    def info(self) -> dict[str, Any]:
        """The experts' schema (hivemind's ``info``), learned from one expert of the grid."""
        if self._schema is None:
            run_coroutine(self._find_schema_anywhere())
        return self._schema.to_info()

    def _pack(self, tensors: list[torch.Tensor]) -> Any:
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    # ------------------------------------------------------------------ on the loop

    async def _forward_async(self, scores: list[np.ndarray], inputs: list[torch.Tensor]):
        loop = asyncio.get_running_loop()
        deadline = None if self.forward_timeout is None else loop.time() + self.forward_timeout
        num_results = self.k_best * self.max_attempts
        try:
            async with asyncio.timeout_at(deadline):
                ranked = await self.beam_search.search(scores, self.k_best, num_results)
                candidates = [[info for _, info in sample] for sample in ranked]
                schema = self._schema or await self._find_schema(candidates)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the beam search over {self.beam_search.uid_prefix!r} did not finish within "
                f"forward_timeout={self.forward_timeout} s"
            ) from None
        check_batch(
            inputs,
            schema.args_schema,
            f"inputs of {type(self).__name__} (expert schema from {schema.uid!r})",
        )
        outcome = await forward_to_experts(
            candidates,
            inputs,
            self._callers,
            schema,
            k_best=self.k_best,
            k_min=self.k_min,
            deadline=deadline,
            timeout_after_k_min=self.timeout_after_k_min,
            detect_anomalies=self.detect_anomalies,
            max_attempts=self.max_attempts,
        )
        missing = outcome.unanswered()
        if missing and not self.allow_zero_outputs:
            raise NoExpertsAnswered(
                f"{len(missing)} of {len(candidates)} samples got no answer from any of "
                f"their experts under {self.beam_search.uid_prefix!r}: "
                f"{outcome.describe_failures(missing)}"
            )
        return outcome, schema

    async def _find_schema(self, candidates: list[list[ExpertInfo]]) -> ExpertSchema:
        """Ask experts of this batch for the grid's schema, best first, until one answers."""
        errors = []
        seen = set()
        for info in (info for sample in candidates for info in sample):
            if info.uid in seen:
                continue
            seen.add(info.uid)
            try:
                self._schema = await self._callers.get(info).get_schema()
                return self._schema
            except Exception as e:  # any failure of that expert: try another one
                errors.append(f"{info.uid}: {type(e).__name__}: {e}")
            if len(errors) >= 8:
                break
        if not errors:
            raise NoExpertsAnswered(
                f"the beam search found no live expert under {self.beam_search.uid_prefix!r} "
                f"in the grid {self.beam_search.grid_size}: check uid_prefix and grid_size "
                f"against the running servers"
            )
        raise NoExpertsAnswered("no expert answered moe.info: " + "; ".join(errors))

    async def _find_schema_anywhere(self) -> ExpertSchema:
        scores = [np.random.randn(1, size) for size in self.beam_search.grid_size]
        ranked = await self.beam_search.search(scores, self.k_best, self.k_best * 4)
        return await self._find_schema([[info for _, info in sample] for sample in ranked])

    async def _backward_async(self, jobs: list, num_samples: int, schema: ExpertSchema):
        loop = asyncio.get_running_loop()
        timeout = self.backward_timeout
        results, failures = await backward_from_experts(
            jobs,
            num_samples,
            schema,
            k_min=self.backward_k_min,
            deadline=None if timeout is None else loop.time() + timeout,
            timeout_after_k_min=self.timeout_after_k_min,
            detect_anomalies=self.detect_anomalies,
        )
        if jobs and not results and not self.allow_zero_outputs:
            raise NoExpertsAnswered(
                f"backward: none of the {len(jobs)} experts answered: " + "; ".join(failures[:4])
            )
        return results


# ---------------------------------------------------------------------- autograd


class _Plan:
    """Where each answer goes in the ``[batch, slots, ...]`` outputs."""

    def __init__(self, answers: list[Answer], batch_size: int, schema: ExpertSchema, dims: int):
        self.answers, self.batch_size, self.schema = answers, batch_size, schema
        used = [0] * batch_size
        self.places: list[tuple[torch.Tensor, torch.Tensor]] = []
        for answer in answers:
            slots = []
            for s in answer.samples:
                slots.append(used[s])
                used[s] += 1
            self.places.append((torch.tensor(answer.samples), torch.tensor(slots)))
        self.slots = max(max(used, default=0), 1)
        self.mask = torch.zeros(batch_size, self.slots, dtype=torch.bool)
        self.coords = torch.zeros(dims, batch_size, self.slots, dtype=torch.long)
        for answer, (rows, slots) in zip(answers, self.places, strict=True):
            self.mask[rows, slots] = True
            self.coords[:, rows, slots] = torch.tensor(_grid_coords(answer.caller.uid, dims))[
                :, None
            ]

    def outputs(self) -> list[torch.Tensor]:
        result = [
            torch.zeros(self.batch_size, self.slots, *d.instance_shape, dtype=d.dtype)
            for d in self.schema.outputs_schema
        ]
        for answer, (rows, slots) in zip(self.answers, self.places, strict=True):
            for full, part in zip(result, answer.tensors, strict=True):
                full[rows, slots] = part
        return result


class _RemoteMixtureCall(torch.autograd.Function):
    """Outputs already computed by the experts; backward asks the same experts. Sees CPU
    tensors only, so that its backward never holds autograd's CUDA thread (``to_host``)."""

    @staticmethod
    def forward(ctx, dummy, plan: _Plan, layer: RemoteMixtureOfExperts, *inputs):
        ctx.plan, ctx.layer = plan, layer
        ctx.save_for_backward(*inputs)
        return tuple(plan.outputs())

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        plan: _Plan = ctx.plan
        inputs = [t.detach() for t in ctx.saved_tensors]
        jobs = []
        for answer, (rows, slots) in zip(plan.answers, plan.places, strict=True):
            sub_inputs = [t.index_select(0, rows) for t in inputs]
            sub_grads = [g[rows, slots] for g in grad_outputs]
            jobs.append((answer.caller, answer.samples, sub_inputs, sub_grads))
        results = run_coroutine(ctx.layer._backward_async(jobs, plan.batch_size, plan.schema))
        needs = ctx.needs_input_grad[3:]
        grads = [
            torch.zeros_like(x) if need and x.is_floating_point() else None
            for x, need in zip(inputs, needs, strict=True)
        ]
        for samples, sub_grads in results:
            rows = torch.tensor(samples)
            for grad, part in zip(grads, sub_grads, strict=True):
                if grad is not None:
                    grad.index_add_(0, rows, part.to(grad.dtype))
        return (None, None, None, *grads)


# ---------------------------------------------------------------------- helpers


def _gating_input(input: torch.Tensor, in_features: int) -> torch.Tensor:
    """The gate reads the input averaged over any dimensions between batch and features."""
    if not isinstance(input, torch.Tensor) or input.ndim < 2:
        shape = list(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
        raise ValidationError(f"the input must be a batch-first tensor, got {shape}")
    if input.shape[-1] != in_features:  # (torch's matmul error would not say which layer)
        raise ValidationError(
            f"the gate was built for in_features={in_features}, but the input's last "
            f"dimension is {input.shape[-1]} (got shape {list(input.shape)})"
        )
    return input if input.ndim == 2 else input.mean(dim=tuple(range(1, input.ndim - 1)))


def _weighted_sum(weights: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[b, k] * tensor[b, k, ...]`` for any trailing shape."""
    flat = tensor.flatten(start_dim=2) if tensor.ndim > 2 else tensor[..., None]
    mixed = (weights[..., None].to(flat.dtype) * flat).sum(dim=1)
    return mixed.view(tensor.shape[:1] + tensor.shape[2:])


def _grid_coords(uid: str, dims: int) -> list[int]:
    """The last ``dims`` coordinates of a uid: its place in the grid."""
    return [int(c) for c in uid.split(UID_DELIMITER)[-dims:]]
