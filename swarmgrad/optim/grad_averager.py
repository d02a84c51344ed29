"""``GradientAverager``: accumulate gradients over local steps, then average them with peers.

::

    averager = GradientAverager(model.parameters(), dht=dht, prefix="run_grads", start=True)
    for batch in local_batches:
        loss_fn(model, batch).backward()
        averager.accumulate_grads_(batch_size=len(batch))
        model.zero_grad()
    control = averager.schedule_step(scheduled_time=get_dht_time() + 5)  # find a group early
    averager.step(control=control)             # average, weighted by samples
    with averager.use_averaged_gradients():    # the swarm's mean gradient
        ...

Each step's gradient is a mean over its batch, so the accumulator keeps the sum of
``batch_size * grad``; divided by the samples, it is the mean gradient over every sample
this peer saw, and the all-reduce weighs each peer by its samples: the result is the
mean gradient over the swarm's whole batch, as large-batch SGD would compute it. With
``reuse_grad_buffers=True`` the parameters' own ``.grad`` buffers are the accumulators
(no extra memory; the user must not zero them): they hold a sum of per-step gradients,
divided by the number of steps.

Averaged gradients live in their own buffers (or in ``averaged_grads`` given by the caller,
e.g. the ``.grad`` of an offloaded optimizer's master copy, which then receives them
directly). A round that forms no group leaves the local mean there: training falls back
to local gradients, never to nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from swarmgrad.averaging.allreduce import AveragingMode
from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.step_control import StepControl
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.host_copies import copy_batch, host_buffer_like
from swarmgrad.utils.checks import positive_int, positive_number
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["GradientAverager", "GradientAveragerFactory"]

logger = logging.getLogger(__name__)

GradientAveragerFactory = Any  # callable(parameters=..., dht=..., prefix=..., **kw) -> averager


class GradientAverager(DecentralizedAverager):
    """Average the gradients of ``parameters`` with the peers under ``prefix`` (see the
    module docstring). Other keyword arguments go to
    :class:`~swarmgrad.averaging.averager.DecentralizedAverager` (``start``,
    ``min_matchmaking_time``, ``compression``, ``client_mode``, ...).

    ``accumulate_grads_on``: device of the accumulators (default: the parameters').
    ``averaged_grads``: tensors to average in (default: new zero buffers). ``warn``:
    accepted for hivemind compatibility.

    ``worker_momentum`` (swarmgrad's, default 0: off): each peer sends an exponential
    average of its own mean gradients, ``m = beta m + (1 - beta) g``, instead of ``g``
    (worker momentum, Karimireddy, He and Jaggi 2021). Under a robust aggregation rule
    (``aggregation=CenteredClip(...)``) this is what makes the rule work on noisy
    gradients: honest peers' momenta spread several times less than their gradients,
    and a clipped center is biased toward liars by a fraction of that spread. The
    optimizer then applies the averaged momentum, so it should have no momentum of its
    own and a learning rate ``1 / (1 - beta)`` times larger (SGD with momentum 0.9 and lr
    0.3 becomes worker momentum 0.9 and SGD lr 3.0: the same update without liars).
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: torch.device | None = None,
        client_mode: bool | None = None,
        warn: bool = True,
        averaged_grads: Sequence[torch.Tensor] | None = None,
        worker_momentum: float = 0.0,
        **kwargs: Any,
    ):
        if (
            isinstance(worker_momentum, bool)
            or not isinstance(worker_momentum, int | float)
            or not 0 <= worker_momentum < 1
        ):
            raise ValidationError(f"worker_momentum must be in [0, 1), got {worker_momentum!r}")
        self.worker_momentum = float(worker_momentum)
        self._momentum: list[torch.Tensor] | None = None  # created at the first send
        self._folded = False  # the accumulated gradients are in the momentum already
        self.parameters = tuple(parameters)
        if not self.parameters:
            raise ValidationError("GradientAverager needs at least one parameter")
        for index, param in enumerate(self.parameters):
            if not isinstance(param, torch.Tensor) or not param.requires_grad:
                raise ValidationError(
                    f"parameter {index} does not require grad: only trainable parameters "
                    "have gradients to average"
                )
        if reuse_grad_buffers and accumulate_grads_on is not None:
            logger.warning("accumulate_grads_on has no effect with reuse_grad_buffers=True")
        self.reuse_grad_buffers = bool(reuse_grad_buffers)
        self.warn = warn
        self.local_samples_accumulated = 0
        self.local_times_accumulated = 0
        self._accumulators: list[torch.Tensor] | None = None
        self._accumulators_stale = False  # reset, not yet zeroed (see reset_accumulated_grads_)
        if not self.reuse_grad_buffers:
            self._accumulators = [
                torch.zeros_like(
                    p, device=accumulate_grads_on, memory_format=torch.contiguous_format
                )
                for p in self.parameters
            ]
        if averaged_grads is None:  # pinned for a model on a GPU: see host_copies
            averaged_grads = [host_buffer_like(p.detach()) for p in self.parameters]
        averaged_grads = list(averaged_grads)
        if len(averaged_grads) != len(self.parameters):
            raise ValidationError(
                f"averaged_grads has {len(averaged_grads)} tensors for {len(self.parameters)} "
                "parameters"
            )
        for index, (param, buffer) in enumerate(zip(self.parameters, averaged_grads, strict=True)):
            if buffer.shape != param.shape:
                raise ValidationError(
                    f"averaged_grads[{index}] has shape {list(buffer.shape)}, parameter {index} "
                    f"has {list(param.shape)}"
                )
        self._new_averaged_grads = False
        kwargs.setdefault("allow_state_sharing", False)  # gradients are no state to download
        super().__init__(averaged_grads, dht, prefix=prefix, client_mode=client_mode, **kwargs)

    # ------------------------------------------------------------------ accumulation

    def _grads_from_parameters(self) -> Iterator[torch.Tensor | None]:
        for param in self.parameters:
            yield param.grad

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int, *, grad_scale: float = 1.0) -> None:
        """Add the parameters' current gradients, computed on ``batch_size`` samples.
        ``grad_scale``: the loss was multiplied by it (a GradScaler's scale); the
        gradients are divided by it as they are added, so the accumulators hold true
        gradients whatever scale each step used (only with separate accumulators: reused
        ``.grad`` buffers are unscaled once, at the epoch's step)."""
        positive_int("batch_size", batch_size)
        grad_scale = positive_number("grad_scale", grad_scale)
        if grad_scale != 1.0 and self.reuse_grad_buffers:
            raise ValidationError(
                "grad_scale needs separate accumulators: with reuse_grad_buffers=True the "
                ".grad buffers accumulate by themselves, unscale them once at the epoch's step"
            )
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        self._folded = False  # new gradients: the next send folds them into the momentum
        if self.reuse_grad_buffers:
            return  # the .grad buffers accumulate by themselves (backward adds to them)
        assert self._accumulators is not None
        first, self._accumulators_stale = self._accumulators_stale, False
        for grad, accumulator in zip(
            self._grads_from_parameters(), self._accumulators, strict=True
        ):
            if grad is not None:
                grad = grad.to(accumulator.device)
                if first:  # the reset's zeros, written here instead of at the epoch's end
                    torch.mul(grad, batch_size / grad_scale, out=accumulator)
                else:
                    accumulator.add_(grad, alpha=batch_size / grad_scale)
            elif first:
                accumulator.zero_()

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """Forget what was accumulated (new epoch, or gradients found invalid)."""
        self.local_samples_accumulated = self.local_times_accumulated = 0
        if self.reuse_grad_buffers:
            for param in self.parameters:
                if param.grad is not None:
                    param.grad.zero_()
        else:
            # zeroed lazily, by the next accumulate_grads_: the reset comes at the epoch's
            # end, where a pass over every gradient delays the next step (38 MB: 20-30 ms
            # on the 2-core box); nothing reads accumulators that hold no samples
            self._accumulators_stale = True

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """Put the local mean gradient into the averaged buffers (what this peer sends;
        also the fallback when no group forms)."""
        if self.reuse_grad_buffers:
            sources = list(self._grads_from_parameters())
            scale = self.local_times_accumulated
        else:
            assert self._accumulators is not None
            sources, scale = list(self._accumulators), self.local_samples_accumulated
        with self.get_tensors() as averaged_grads:
            pairs = list(zip(sources, averaged_grads, strict=True))
            loaded = [(s, b) for s, b in pairs if s is not None and scale != 0]
            # from a GPU: copied, one wait for all of them, then scaled; on one device
            # scaled as they are written (one pass over the gradients, not two)
            copy_batch((s, b) for s, b in loaded if s.device != b.device)
            for source, buffer in pairs:
                if source is None or scale == 0:
                    buffer.zero_()
                elif source.device != buffer.device:
                    buffer.mul_(1.0 / scale)
                else:
                    torch.mul(source, 1.0 / scale, out=buffer)
            if self.worker_momentum:
                self._send_momentum(averaged_grads)

    def _send_momentum(self, averaged_grads: Sequence[torch.Tensor]) -> None:
        """Fold the mean gradient just loaded into this peer's momentum and send that.
        Loading the same accumulation again (the optimizer's fallback to local gradients
        after a failed round) sends the same momentum, not a second fold."""
        beta = self.worker_momentum
        if self._momentum is None:  # the first gradient is the momentum: no bias to zero
            self._momentum = [buffer.clone() for buffer in averaged_grads]
        elif not self._folded:
            for momentum, buffer in zip(self._momentum, averaged_grads, strict=True):
                momentum.mul_(beta).add_(buffer, alpha=1 - beta)
        self._folded = True
        for momentum, buffer in zip(self._momentum, averaged_grads, strict=True):
            buffer.copy_(momentum)

    # ------------------------------------------------------------------ averaging

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        """Begin matchmaking now for a round that starts at ``scheduled_time`` (DHT time)
        and waits for :meth:`step` (``control=``) to release it."""
        if scheduled_time is None:
            scheduled_time = get_dht_time() + self._options["min_matchmaking_time"]
        return DecentralizedAverager.step(
            self, scheduled_time=scheduled_time, require_trigger=True, wait=False, **kwargs
        )

    def step(
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepControl | None = None,
        timeout: float | None = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Average the accumulated gradients with a group: load them into the averaged
        buffers, weigh them by this peer's samples (``weight`` overrides), optionally
        reset the accumulators, and release the round (``control``: one scheduled
        earlier with :meth:`schedule_step`). Returns the round's result, or the control
        with ``wait=False``."""
        if control is None:
            control = self.schedule_step(timeout=timeout, **kwargs)
        elif kwargs:
            raise ValidationError(f"options {sorted(kwargs)} cannot apply to a scheduled step")
        self.load_accumulators_into_averager_()
        if weight is None:
            weight = (
                0.0 if self.mode is AveragingMode.AUX else float(self.local_samples_accumulated)
            )
        self._new_averaged_grads = True
        if reset_accumulators:
            self.reset_accumulated_grads_()
        control.weight = weight
        control.allow_allreduce()
        if not wait:
            return control
        try:
            return control.result(timeout)
        except BaseException:
            control.cancel()
            raise

    @contextlib.contextmanager
    @torch.no_grad()
    def use_averaged_gradients(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged gradients, locked; hivemind's name."""
        self._new_averaged_grads = False
        with self.get_tensors() as averaged_grads:
            yield averaged_grads

    def notify_used_averaged_gradients(self) -> None:
        """The averaged gradients were consumed (for the stale-gradient warning)."""
        self._new_averaged_grads = False
