"""``TrainingAverager``: hivemind's older averager of one optimizer's parameters,
gradients and statistics (``hivemind.TrainingAverager``).

New code should use :class:`~swarmgrad.optim.Optimizer` (or
:class:`~swarmgrad.optim.TrainingStateAverager`); this class keeps programs written for
the older interface running. ``step()`` copies the chosen local tensors into the averaged
buffers, averages them with a group, and applies the *change* the average brought to the
local tensors (so updates the trainer made meanwhile under ``data_lock`` are kept).
``load_state_from_peers()`` downloads parameters, optimizer statistics and extra tensors
from the swarm and loads them into the optimizer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.compression import CompressionInfo, TensorRole
from swarmgrad.optim.optimizer_state import (
    dump_optimizer_state,
    initialize_optimizer_state_,
    load_optimizer_state_,
)
from swarmgrad.utils.errors import ValidationError

__all__ = ["TrainingAverager"]


class TrainingAverager(DecentralizedAverager):
    """Average an optimizer's parameters and/or gradients (and the optimizer statistics
    named in ``average_opt_statistics``, e.g. ``("exp_avg_sq",)``) with peers.

    :param opt: the torch optimizer, its parameters being the model's
    :param average_parameters: average the parameters in :meth:`step`
    :param average_gradients: average the gradients in :meth:`step`
    :param extra_tensors: more tensors averaged and shared with joining peers (batchnorm
      statistics, say), updated outside ``opt.step``
    :param parameter_names: names for the parameters in the order of ``opt.param_groups``
      (default: their indices)
    :param initialize_optimizer: create the optimizer's lazy state first (a step on zero
      gradients whose effect is undone), so all peers' states have the same layout
    :param kwargs: :class:`~swarmgrad.averaging.DecentralizedAverager`'s (``dht``,
      ``prefix``, ``start``, ``target_group_size``, ...)
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        *,
        average_parameters: bool,
        average_gradients: bool,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        parameter_names: Sequence[str] | None = None,
        initialize_optimizer: bool = True,
        **kwargs: Any,
    ):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValidationError(f"opt must be a torch optimizer, got {type(opt).__name__}")
        if not (average_parameters or average_gradients or average_opt_statistics or extra_tensors):
            raise ValidationError(
                "nothing to average: set average_parameters, average_gradients, "
                "average_opt_statistics or extra_tensors"
            )
        if initialize_optimizer:
            initialize_optimizer_state_(opt)
        params = [p for group in opt.param_groups for p in group["params"]]
        if parameter_names is None:
            parameter_names = tuple(range(len(params)))
        if len(parameter_names) != len(params):
            raise ValidationError(
                f"parameter_names has {len(parameter_names)} names for {len(params)} parameters"
            )
        self.opt, self.extra_tensors, self.local_step = opt, tuple(extra_tensors), 0
        self.opt_statistics = tuple(average_opt_statistics)
        self.average_parameters, self.average_gradients = average_parameters, average_gradients
        self.parameter_names = tuple(parameter_names)
        for name in self.opt_statistics:
            missing = [i for i, p in enumerate(params) if name not in opt.state.get(p, {})]
            if missing:
                raise ValidationError(
                    f"optimizer statistic {name!r} is missing for parameters {missing[:5]} "
                    "(initialize_optimizer=True creates it)"
                )
        self.step_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.lock_averager_step = threading.Lock()
        with torch.no_grad():
            averaged = [t.detach().cpu().float().clone() for t in self.local_tensors()]
        infos = list(self.tensor_infos())
        super().__init__(averaged_tensors=averaged, tensor_infos=infos, **kwargs)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    @torch.no_grad()
    def local_tensors(self, replace_none: bool = True) -> Iterator[torch.Tensor]:
        """The local tensors in averaging order: parameters, gradients (zeros in place of
        missing ones when ``replace_none``), statistics, extra tensors."""
        if self.average_parameters:
            yield from self._params()
        if self.average_gradients:
            for param in self._params():
                if param.grad is not None:
                    yield param.grad
                elif replace_none:
                    yield torch.zeros_like(param)
        for name in self.opt_statistics:
            for param in self._params():
                yield self.opt.state[param][name]
        yield from self.extra_tensors

    def tensor_infos(self) -> Iterator[CompressionInfo]:
        """Each averaged tensor's role, so a role-adaptive codec can tell them apart."""
        index = 0

        def infos(tensors: Sequence[torch.Tensor], role: TensorRole) -> Iterator[CompressionInfo]:
            nonlocal index
            for tensor in tensors:
                yield CompressionInfo.from_tensor(tensor, key=index, role=role)
                index += 1

        params = self._params()
        if self.average_parameters:
            yield from infos(params, TensorRole.PARAMETER)
        if self.average_gradients:
            yield from infos(params, TensorRole.GRADIENT)
        for _ in self.opt_statistics:
            yield from infos(params, TensorRole.OPTIMIZER)
        yield from infos(self.extra_tensors, TensorRole.UNSPECIFIED)

    def step(self, data_lock: threading.Lock | None = None, wait: bool = True, **kwargs: Any):
        """Average once: ``{peer_id: gather}`` of the group, or None if no round succeeded.

        ``data_lock`` (held while local tensors are read and changed) lets the trainer
        keep updating the model meanwhile: the average's change is added to the local
        tensors rather than overwriting them. ``wait=False`` returns a future.
        Other keyword arguments go to :meth:`DecentralizedAverager.step`."""
        if not wait:
            return self.step_executor.submit(self.step, data_lock, True, **kwargs)
        lock = data_lock if data_lock is not None else contextlib.nullcontext()
        with self.lock_averager_step, torch.no_grad():
            with lock:
                before = [t.detach().cpu().float().clone() for t in self.local_tensors()]
            with self.get_tensors() as averaged:
                for buffer, local in zip(averaged, before, strict=True):
                    buffer.copy_(local)
            gathered = super().step(wait=True, **kwargs)
            if gathered is not None:
                with lock, self.get_tensors() as averaged:
                    locals_now = list(self.local_tensors(replace_none=False))
                    if len(locals_now) != len(averaged):
                        raise ValidationError(
                            "a parameter lost its gradient during the step; nothing applied"
                        )
                    for local, buffer, old in zip(locals_now, averaged, before, strict=True):
                        local.add_((buffer - old).to(device=local.device, dtype=local.dtype))
            self.local_step += 1
            return gathered

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        """Parameters, optimizer state and extra tensors, for peers that join."""
        with torch.no_grad():
            params = [p.detach().cpu().clone() for p in self._params()]
            metadata, opt_tensors = dump_optimizer_state(self.opt)
            extra = [t.detach().cpu().clone() for t in self.extra_tensors]
        state = {"step": self.local_step, "group_bits": self.get_group_bits(), "opt": metadata}
        tensors = params + [t.detach().cpu().clone() for t in opt_tensors] + extra
        return state, tensors

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None, **kwargs):
        """Download the swarm's state and load it into the parameters, the optimizer and
        the extra tensors. Returns ``(metadata, tensors)`` as downloaded, or None."""
        if not wait:
            return self.step_executor.submit(self.load_state_from_peers, True, timeout)
        loaded = super().load_state_from_peers(wait=True, timeout=timeout)
        if loaded is None:
            return None
        metadata, tensors = loaded
        params = self._params()
        n_params, n_extra = len(params), len(self.extra_tensors)
        if not isinstance(metadata, dict) or len(tensors) < n_params + n_extra:
            raise ValidationError("the downloaded state does not match this optimizer")
        opt_tensors = tensors[n_params : len(tensors) - n_extra]
        with torch.no_grad():
            load_optimizer_state_(self.opt, metadata.get("opt"), list(opt_tensors))
            for local, new in zip(params, tensors[:n_params], strict=True):
                local.copy_(new.to(device=local.device, dtype=local.dtype))
            extra = tensors[len(tensors) - n_extra :]
            for local, new in zip(self.extra_tensors, extra, strict=True):
                local.copy_(new.to(device=local.device, dtype=local.dtype))
        self.local_step = max(self.local_step, int(metadata.get("step", 0)))
        return loaded

    def shutdown(self) -> None:
        super().shutdown()
        self.step_executor.shutdown(wait=False)
