"""One hosted expert: a torch module, its optimizer, its schemas and its request pools.

``ModuleBackend`` is what the runtime calls: :meth:`forward` answers ``moe.forward``
batches without building a graph; :meth:`backward` recomputes the forward pass with
autograd, backpropagates the clients' output gradients, returns the input gradients, and
then updates the expert's weights with its own optimizer. As in hivemind, every backward
call is one optimizer step.

With an :class:`~swarmgrad.moe.server.activation_cache.ActivationCache` (the server gives
its experts one), forward keeps its graph for a while and a backward of exactly the same
inputs, before any other weight update, reuses it instead of recomputing: same result,
one forward pass less.

A caller that steps the optimizer itself (a pipeline stage averaging gradients with its
peers) sets :attr:`ModuleBackend.gradient_sink`: backward then hands each batch's
parameter gradients to it instead of stepping, and :meth:`apply_gradients` steps later.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from swarmgrad.compression.base import all_finite
from swarmgrad.moe.expert_uid import ExpertUID
from swarmgrad.moe.protocol import BatchTensorDescriptor, check_batch, schema_to_message
from swarmgrad.moe.server.activation_cache import ActivationCache, CachedForward
from swarmgrad.moe.server.task_pool import TaskPool
from swarmgrad.utils.checks import positive_number
from swarmgrad.utils.errors import ValidationError

__all__ = ["ModuleBackend", "derive_outputs_schema"]

logger = logging.getLogger(__name__)

_SAMPLE_BATCH = 2


def _as_schema(schema: Any, what: str) -> tuple[BatchTensorDescriptor, ...]:
    if isinstance(schema, BatchTensorDescriptor):
        return (schema,)
    if isinstance(schema, (list, tuple)) and all(
        isinstance(d, BatchTensorDescriptor) for d in schema
    ):
        return tuple(schema)
    raise ValidationError(
        f"{what} must be a BatchTensorDescriptor or a flat tuple of them, got {schema!r:.120}"
    )


def _as_outputs(outputs: Any, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(outputs, torch.Tensor):
        return (outputs,)
    if isinstance(outputs, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in outputs):
        return tuple(outputs)
    raise ValidationError(
        f"{what} must be a tensor or a flat tuple of tensors, got {type(outputs).__name__}"
    )


def _module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def derive_outputs_schema(
    name: str,
    module: nn.Module,
    args_schema: Sequence[BatchTensorDescriptor],
    compression: Any = "none",
) -> tuple[BatchTensorDescriptor, ...]:
    """Run ``module`` once on zeros shaped like ``args_schema`` and describe its outputs.

    A floating-point output is marked ``requires_grad`` (clients may send gradients for
    it); others are not."""
    device = _module_device(module)
    sample = [d.make_zeros(_SAMPLE_BATCH, device=device) for d in args_schema]
    try:
        with torch.no_grad():
            outputs = _as_outputs(module(*sample), f"the output of expert {name!r}")
    except ValidationError:
        raise
    except Exception as e:
        raise ValidationError(
            f"expert {name!r} failed on a sample input shaped like its args_schema "
            f"{[list(d.shape) for d in args_schema]}: {e!r}"
        ) from e
    schema = []
    for output in outputs:
        if output.ndim == 0 or output.shape[0] != _SAMPLE_BATCH:
            raise ValidationError(
                f"expert {name!r} returned an output of shape {list(output.shape)} for a batch "
                f"of {_SAMPLE_BATCH}: every output needs the batch as its first dimension"
            )
        schema.append(
            BatchTensorDescriptor(
                *output.shape[1:],
                dtype=output.dtype,
                requires_grad=output.is_floating_point(),
                compression=compression,
            )
        )
    return tuple(schema)


class ModuleBackend:
    """An expert the server hosts under ``name`` (its uid).

    :param module: any ``nn.Module`` taking tensors ``[batch, ...]`` positionally and
        returning a tensor or a flat tuple of tensors, each with the batch first.
    :param optimizer: updates ``module``'s parameters after every backward call (None: the
        expert never changes).
    :param scheduler: stepped after every optimizer step.
    :param args_schema: one :class:`BatchTensorDescriptor` per positional argument.
        Floating-point arguments receive gradients in backward; others get zeros.
    :param outputs_schema: derived by running the module on a sample when omitted.
    :param min_batch_size: a batch waits up to ``timeout`` seconds (a keyword for the
        pools, default 0.05) for this many samples.
    :param max_batch_size: the largest batch (and request) the expert accepts.
    :param clip_grad_norm: clip the parameters' gradient norm to this before each step.
    :param activation_cache: keep forward graphs for the matching backward (None: always
        recompute).
    """

    def __init__(
        self,
        name: ExpertUID,
        module: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        args_schema: Any = None,
        outputs_schema: Any = None,
        min_batch_size: int = 1,
        max_batch_size: int = 4096,
        clip_grad_norm: float | None = None,
        activation_cache: ActivationCache | None = None,
        kwargs_schema: dict | None = None,
        **kwargs: Any,
    ):
        if kwargs_schema:
            raise ValidationError(
                f"expert {name!r}: keyword arguments (kwargs_schema) are not supported; "
                "pass every tensor positionally through args_schema"
            )
        if args_schema is None:
            raise ValidationError(f"expert {name!r} needs an args_schema")
        if clip_grad_norm is not None:
            positive_number(f"expert {name!r}: clip_grad_norm", clip_grad_norm)
        self.name = name
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip_grad_norm = clip_grad_norm
        self.activation_cache = activation_cache
        self.args_schema = _as_schema(args_schema, f"args_schema of expert {name!r}")
        if outputs_schema is None:
            outputs_schema = derive_outputs_schema(name, module, self.args_schema)
        self.outputs_schema = _as_schema(outputs_schema, f"outputs_schema of expert {name!r}")
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.update_count = 0  # optimizer steps taken
        # None: every backward batch is one optimizer step. Set: backward calls it with the
        # batch size while the parameters' .grad hold the batch's gradients (under the
        # lock, on the runtime's thread) and does not step; the owner of the sink steps
        # with apply_gradients when it chooses
        self.gradient_sink: Callable[[int], None] | None = None
        self.examples_processed = 0  # samples seen by backward
        # held while this expert computes or its state is read or replaced, so that a
        # checkpoint never sees half an optimizer step
        self.lock = threading.RLock()
        # a CPU expert's cheap batches may run on the server's event loop (see Runtime)
        pool_options = dict(kwargs, lock=self.lock, may_run_inline=self._runs_on_cpu)
        self.forward_pool = TaskPool(
            self.forward, max_batch_size, f"{name}_forward", min_batch_size, **pool_options
        )
        self.backward_pool = TaskPool(
            self.backward, max_batch_size, f"{name}_backward", min_batch_size, **pool_options
        )

    def __repr__(self) -> str:
        return f"ModuleBackend({self.name!r}, {type(self.module).__name__})"

    @property
    def device(self) -> torch.device:
        return _module_device(self.module)

    def _runs_on_cpu(self) -> bool:
        return self.device.type == "cpu"

    # ------------------------------------------------------------------ compute

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs for a batch of inputs. Inputs are trusted to match ``args_schema``
        (the request handler checked them)."""
        cache = self.activation_cache
        with self.lock:
            if cache is None or not self._has_gradients(inputs):
                with torch.no_grad():
                    outputs = self._call_module(inputs)
                return self._checked_outputs(outputs, inputs)
            args = self._leaves(inputs)
            with torch.enable_grad(), cache.measure(self.module) as meter:
                outputs = self._checked_outputs(self._call_module(args), inputs)
            for tensor in (*inputs, *outputs):
                meter.count(tensor)
            cache.put(CachedForward(self, self.update_count, inputs, args, outputs, meter.nbytes))
        return tuple(output.detach() for output in outputs)

    def backward(self, *inputs_and_grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``backward(*inputs, *grad_outputs)``: gradients for every input (zeros for
        non-floating ones), then one optimizer step."""
        num_inputs = len(self.args_schema)
        inputs, grad_outputs = inputs_and_grads[:num_inputs], inputs_and_grads[num_inputs:]
        if len(grad_outputs) != len(self.outputs_schema):
            raise ValidationError(
                f"backward of expert {self.name!r}: expected {len(self.outputs_schema)} output "
                f"gradients, got {len(grad_outputs)}"
            )
        device = self.device
        with self.lock:
            self.module.zero_grad(set_to_none=True)
            cache = self.activation_cache
            cached = None if cache is None else cache.take(self, self.update_count, inputs)
            with torch.enable_grad():
                if cached is not None:
                    args, outputs = cached.args, cached.outputs
                else:
                    args = self._leaves(inputs)
                    outputs = self._checked_outputs(self._call_module(args), inputs)
                pairs = [
                    (output, grad.to(device))
                    for output, grad in zip(outputs, grad_outputs, strict=True)
                    if output.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grad_inputs = tuple(
                (arg.grad if arg.grad is not None else torch.zeros_like(arg)).detach().cpu()
                for arg in args
            )
            self.on_backward(inputs[0].shape[0] if inputs else 0)
        return grad_inputs

    def _call_module(self, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        device = self.device
        outputs = self.module(*(x.to(device) for x in args))
        return _as_outputs(outputs, f"the output of expert {self.name!r}")

    def _leaves(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Graph leaves over the inputs (no copy); floating ones collect gradients."""
        device = self.device
        return [x.detach().to(device).requires_grad_(x.is_floating_point()) for x in inputs]

    def _has_gradients(self, inputs: Sequence[torch.Tensor]) -> bool:
        return any(x.is_floating_point() for x in inputs) or any(
            p.requires_grad for p in self.module.parameters()
        )

    def on_backward(self, batch_size: int) -> None:
        """Apply the accumulated gradients: clip, optimizer step, scheduler step (or hand
        them to :attr:`gradient_sink`).

        Gradients that overflowed to NaN or Inf (finite inputs can do that) would ruin the
        weights for every client: the step is skipped and the batch gets the error."""
        sink = self.gradient_sink
        if self.optimizer is not None or sink is not None:
            self._check_finite_gradients()
        self.examples_processed += batch_size
        if sink is not None:
            sink(batch_size)
        else:
            self.apply_gradients()
        self.module.zero_grad(set_to_none=True)

    def apply_gradients(self) -> None:
        """One optimizer step with the gradients in the parameters' ``.grad`` (clipped to
        ``clip_grad_norm`` first), then the scheduler's; graphs of the old weights leave
        the activation cache. The caller holds :attr:`lock`. Nothing without an
        optimizer."""
        if self.optimizer is None:
            return
        with self.lock:
            if self.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad_norm)
            self.optimizer.step()
            self.update_count += 1
            if self.scheduler is not None:
                self.scheduler.step()
            if self.activation_cache is not None:  # graphs of older weights are useless now
                self.activation_cache.discard(self, keep_version=self.update_count)

    def _check_finite_gradients(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not all(all_finite(g) for g in grads):
            self.module.zero_grad(set_to_none=True)
            raise ValidationError(
                f"backward of expert {self.name!r}: non-finite parameter gradients (NaN or "
                "Inf); the optimizer step was skipped and the weights are unchanged"
            )

    def _checked_outputs(
        self, outputs: tuple[torch.Tensor, ...], inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        batch_size = inputs[0].shape[0] if inputs else None
        check_batch(outputs, self.outputs_schema, f"outputs of expert {self.name!r}", batch_size)
        return outputs

    # ------------------------------------------------------------------ info & state

    def get_info(self) -> dict[str, Any]:
        """The ``moe.info`` answer: uid, schemas and the largest accepted batch."""
        return {
            "uid": self.name,
            "args_schema": schema_to_message(self.args_schema),
            "outputs_schema": schema_to_message(self.outputs_schema),
            "max_batch_size": self.max_batch_size,
        }

    def get_pools(self) -> tuple[TaskPool, TaskPool]:
        return self.forward_pool, self.backward_pool

    def state_dict(self) -> dict[str, Any]:
        """Module, optimizer and scheduler state plus counters (live references: use
        :meth:`checkpoint_state` for a copy that later steps do not change)."""
        state: dict[str, Any] = {
            "module": self.module.state_dict(),
            "update_count": self.update_count,
            "examples_processed": self.examples_processed,
        }
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def checkpoint_state(self) -> dict[str, Any]:
        """A snapshot of :meth:`state_dict`, taken between two batches, on the CPU."""
        with self.lock:
            return _detached_copy(self.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (optimizer and scheduler included)."""
        if not isinstance(state, dict) or "module" not in state:
            raise ValidationError(f"expert {self.name!r}: a state dict needs a 'module' entry")
        with self.lock:
            self.module.load_state_dict(state["module"])
            if self.optimizer is not None and "optimizer" in state:
                self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None and "scheduler" in state:
                self.scheduler.load_state_dict(state["scheduler"])
            self.update_count = int(state.get("update_count", 0))
            self.examples_processed = int(state.get("examples_processed", 0))


def _detached_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _detached_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_detached_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_detached_copy(v) for v in value)
    return copy.deepcopy(value)
