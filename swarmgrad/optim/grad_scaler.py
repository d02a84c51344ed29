"""``GradScaler``: mixed-precision loss scaling for gradients accumulated across steps.

torch's :class:`torch.amp.GradScaler` unscales and checks the gradients at every
``scaler.step(opt)``. With :class:`~swarmgrad.optim.optimizer.Optimizer` and
``reuse_grad_buffers=True`` the ``.grad`` buffers keep accumulating until the epoch
ends, so unscaling them at every local step would divide them again and again. This
scaler is used exactly like torch's::

    scaler = swarmgrad.GradScaler()
    with torch.autocast(...):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(opt)            # opt: a swarmgrad.Optimizer
    scaler.update()

With ``reuse_grad_buffers=True``, between epochs it only checks the gradients for
overflow (an overflow resets the accumulated gradients and lowers the scale); the
unscale and the real optimizer step happen once, when the Optimizer moves to the next
epoch (inside :meth:`running_global_step`), and only then may the scale grow. With
separate accumulators (the default) or local updates, ``scaler.step(opt)`` unscales each
step's gradients as torch's does, and ``opt.step(grad_scaler=scaler)`` has the
Optimizer unscale each batch as it accumulates it: either way the accumulated
gradients are true gradients.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """A :class:`torch.amp.GradScaler` that knows about accumulated gradients (see the
    module docstring). Arguments are torch's (``device="cpu"`` for CPU autocast)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._global_step = False
        self._ready_to_update = False
        self._unscaled_inner_states: dict[int, dict] = {}
        self._states_to_reset: set[int] = set()
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def running_global_step(self) -> Iterator[None]:
        """The Optimizer is taking its epoch's real step: unscale and step for real."""
        with self._lock:
            was, self._global_step = self._global_step, True
            try:
                yield
            finally:
                self._global_step = was

    def unscale_(self, optimizer: Any) -> bool:
        """At the epoch's step: unscale for real (True). Between epochs: only look for
        overflow (False)."""
        with self._lock:
            if not self._global_step and getattr(optimizer, "_unscale_every_step", False):
                # a swarmgrad Optimizer that takes each step's gradients as they are
                # (separate accumulators, or local updates): torch's rule, unscale now;
                # the scale may then change at any step (each was unscaled by its own)
                super().unscale_(optimizer)
                self._ready_to_update = True
                return True
            if self._global_step:
                super().unscale_(optimizer)
                inner = getattr(optimizer, "opt", optimizer)
                # kept apart, so that an overflow found in the next local gradients (and
                # the reset it causes at update()) cannot make us unscale twice
                self._unscaled_inner_states[id(inner)] = copy.deepcopy(
                    self._per_optimizer_states[id(optimizer)]
                )
                return True
            self._check_inf_per_device(optimizer)
            self._states_to_reset.add(id(optimizer))
            return False

    def unscale_for_step(self, optimizer: Any) -> bool:
        """Unscale ``optimizer``'s gradients for a real step that its owner takes itself
        (maybe in the background, after the user's :meth:`update`) and say whether they
        are finite (if not, the step must be skipped). The scale may change at the next
        :meth:`update`. The Optimizer uses it for local updates."""
        with self._lock, self.running_global_step():
            super().unscale_(optimizer)
            self._ready_to_update = True
            return self.are_grads_finite(optimizer, use_cached=True)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._global_step and not getattr(optimizer, "_step_supports_amp_scaling", False):
                # called by the swarmgrad Optimizer on the torch optimizer it wraps
                state = self._unscaled_inner_states.pop(id(optimizer), None)
                if state is not None:
                    self._per_optimizer_states[id(optimizer)] = state
                if self._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
                    super().unscale_(optimizer)
                if self.are_grads_finite(optimizer, use_cached=True):
                    optimizer.step(*args, **kwargs)
                self._ready_to_update = True
                return True
        with warnings.catch_warnings():
            # torch announces it will stop passing itself as grad_scaler= to optimizers
            # that handle scaling; ours takes it, and will read the new attributes then
            warnings.filterwarnings("ignore", "GradScaler is going to stop", FutureWarning)
            result = super().step(optimizer, *args, **kwargs)
        self._states_to_reset.add(id(optimizer))
        return result

    def update(self, new_scale: Any = None) -> bool:
        """Change the scale only after a real step, or to shrink it after an overflow."""
        with self._lock:
            infs = sum(
                float(v.item())
                for state in self._per_optimizer_states.values()
                for v in state["found_inf_per_device"].values()
            )
            if self._ready_to_update or infs:
                super().update(new_scale)
                self._ready_to_update = False
                return True
            for key in self._states_to_reset:
                self._per_optimizer_states[key] = _refresh_per_optimizer_state()
            self._states_to_reset.clear()
            return False

    def _unscale_grads_(self, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool):
        # master weights may be float16 too (fairscale's rule)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def are_grads_finite(self, optimizer: Any, use_cached: bool = False) -> bool:
        """Whether the gradients of ``optimizer`` hold no Inf or NaN."""
        found = (
            self._found_inf_per_device(optimizer)
            if use_cached
            else self._check_inf_per_device(optimizer)
        )
        return not sum(float(v.item()) for v in found.values())
