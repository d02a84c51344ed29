"""The :class:`~.optimizer.Optimizer`'s arguments, checked, and its averagers, built.

Kept apart from the optimizer so that ``optimizer.py`` reads as what happens in an
epoch. Every refusal names the argument and what would work instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmgrad.compression import CompressionBase
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.grad_averager import GradientAverager, GradientAveragerFactory
from swarmgrad.optim.optimizer_state import optimizer_parameters
from swarmgrad.optim.state_averager import TrainingStateAverager
from swarmgrad.utils.checks import check_peer_role, optional_positive_seconds, positive_int
from swarmgrad.utils.errors import ValidationError

__all__ = ["check_arguments", "check_modes", "make_gradient_averager", "make_state_averager"]


def check_arguments(
    *,
    dht: DHT,
    run_id: Any,
    target_batch_size: Any,
    batch_size_per_step: Any,
    average_state_every: Any,
    timeouts: Mapping[str, Any],
) -> None:
    """Each number and name on its own (:func:`check_modes` checks combinations)."""
    positive_int("target_batch_size", target_batch_size)
    if batch_size_per_step is not None:
        positive_int("batch_size_per_step", batch_size_per_step)
    positive_int("average_state_every", average_state_every)
    for name, value in timeouts.items():
        optional_positive_seconds(name, value)
    if not isinstance(run_id, str) or not run_id:
        raise ValidationError(f"run_id must be a non-empty str, got {run_id!r}")
    if dht.peer is None:
        raise ValidationError("the DHT is not running: start it before the Optimizer")


def check_modes(
    *,
    client_mode: bool,
    auxiliary: bool,
    batch_size_per_step: int | None,
    use_local_updates: bool,
    reuse_grad_buffers: bool,
    delay_grad_averaging: bool,
    delay_optimizer_step: bool,
    offload_optimizer: bool,
    grad_averager_factory: Any,
    optimizer: Any,
    params: Any,
    scheduler: Any,
) -> None:
    """Refuse combinations that cannot work, each by name."""
    check_peer_role(client_mode=client_mode, auxiliary=auxiliary)
    if auxiliary and batch_size_per_step is not None:
        raise ValidationError(
            "auxiliary=True conflicts with batch_size_per_step: it trains nothing"
        )
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValidationError("delay_grad_averaging=True needs delay_optimizer_step=True")
    if use_local_updates:
        for name, value in (
            ("reuse_grad_buffers", reuse_grad_buffers),
            ("delay_grad_averaging", delay_grad_averaging),
            ("grad_averager_factory", grad_averager_factory is not None),
        ):
            if value:
                raise ValidationError(
                    f"use_local_updates=True conflicts with {name}: with local updates "
                    "gradients are neither accumulated nor averaged"
                )
    if delay_optimizer_step and not offload_optimizer:
        raise ValidationError(
            "delay_optimizer_step=True needs offload_optimizer=True (and so an optimizer "
            "factory with params): a delayed step on the model's own parameters would race "
            "with the next forward and backward passes"
        )
    factory = callable(optimizer) and not hasattr(optimizer, "param_groups")
    if factory:
        if params is None:
            raise ValidationError("optimizer is a factory: pass params=model.parameters() too")
        if scheduler is not None and not callable(scheduler):
            raise ValidationError(
                "with an optimizer factory, scheduler must be a factory too: "
                "callable(optimizer) -> scheduler"
            )
        if scheduler is not None and hasattr(scheduler, "state_dict"):
            raise ValidationError(
                "with an optimizer factory, pass scheduler=lambda opt: Scheduler(opt, ...), "
                "not a scheduler built on another optimizer"
            )
    elif hasattr(optimizer, "param_groups") and hasattr(optimizer, "step"):
        if params is not None:
            raise ValidationError("params were given with a ready optimizer: pass only one")
        if offload_optimizer:
            raise ValidationError(
                "offload_optimizer=True needs optimizer=lambda params: ... with params=..."
            )
    else:
        raise ValidationError(
            "optimizer must be a factory (optimizer=lambda params: torch.optim.Adam(params), "
            f"with params=model.parameters()) or a torch optimizer, got {type(optimizer).__name__}"
        )


def make_state_averager(
    *,
    dht: DHT,
    run_id: str,
    optimizer: Any,
    params: Any,
    scheduler: Any,
    offload_optimizer: bool,
    custom_gradients: bool,
    delta_rule_averaging: bool,
    state_averaging_compression: CompressionBase,
    load_state_compression: CompressionBase,
    average_opt_statistics: Sequence[str],
    extra_tensors: Sequence[torch.Tensor],
    performance_ema_alpha: float,
    matchmaking_time: float,
    allreduce_timeout: float,
    next_chunk_timeout: float | None,
    shutdown_timeout: float,
    status_loglevel: int,
    client_mode: bool,
    auxiliary: bool,
    averager_opts: dict,
) -> TrainingStateAverager:
    """The averager of parameters and optimizer state (it owns the optimizer).
    ``custom_gradients``: the gradient averager fills the offloaded copy's ``.grad``
    (gradient averaging); without it (local updates) each step copies the model's."""
    return TrainingStateAverager(
        dht=dht,
        prefix=f"{run_id}_state_averager",
        optimizer=optimizer,
        params=params,
        scheduler=scheduler,
        offload_optimizer=offload_optimizer,
        custom_gradients=custom_gradients,
        delta_rule_averaging=delta_rule_averaging,
        compression=state_averaging_compression,
        state_compression=load_state_compression,
        average_opt_statistics=average_opt_statistics,
        extra_tensors=extra_tensors,
        performance_ema_alpha=performance_ema_alpha,
        min_matchmaking_time=matchmaking_time,
        allreduce_timeout=allreduce_timeout,
        next_chunk_timeout=next_chunk_timeout,
        shutdown_timeout=shutdown_timeout,
        status_loglevel=status_loglevel,
        client_mode=client_mode,
        auxiliary=auxiliary,
        start=True,
        **averager_opts,
    )


def make_gradient_averager(
    factory: GradientAveragerFactory | None,
    state_averager: TrainingStateAverager,
    *,
    dht: DHT,
    run_id: str,
    offload_optimizer: bool,
    matchmaking_time: float,
    allreduce_timeout: float,
    next_chunk_timeout: float | None,
    shutdown_timeout: float,
    client_mode: bool,
    auxiliary: bool,
    reuse_grad_buffers: bool,
    compression: CompressionBase,
    averager_opts: dict,
) -> GradientAverager:
    """The gradient averager over the model's parameters (``factory``: another class
    with GradientAverager's arguments, e.g. PowerSGD's)."""
    factory = factory if factory is not None else GradientAverager
    averaged_grads = None
    if offload_optimizer:
        # the offloaded master copy's .grad buffers receive the average directly
        averaged_grads = [p.grad for p in optimizer_parameters(state_averager.optimizer)]
    try:
        return factory(
            state_averager.main_parameters,
            dht=dht,
            prefix=f"{run_id}_grad_averager",
            min_matchmaking_time=matchmaking_time,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            shutdown_timeout=shutdown_timeout,
            client_mode=client_mode,
            auxiliary=auxiliary,
            averaged_grads=averaged_grads,
            reuse_grad_buffers=reuse_grad_buffers,
            compression=compression,
            start=True,
            **averager_opts,
        )
    except ValidationError:
        raise
    except Exception as e:
        raise ValidationError(f"grad_averager_factory raised {type(e).__name__}: {e}") from e
