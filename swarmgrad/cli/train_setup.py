"""What ``swarmgrad train`` decides before and around its loop: the device, the precision,
the collaboration mode and the optimizer it builds from the options.

Kept apart from the loop (``train_command``) so that each decision is checked without a
swarm: every bad combination is refused here, by option name, before the trainer joins.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.cli.train_options import COMPRESSIONS, MODES, PRECISIONS, check_run_options
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "COMPRESSIONS",
    "MODES",
    "PRECISIONS",
    "Precision",
    "check_model_device",
    "check_run_options",
    "keeper_follows_rounds",
    "make_collaborative_optimizer",
    "resolve_device",
    "to_device",
]

logger = logging.getLogger("swarmgrad.cli.train")

# ---------------------------------------------------------------------- devices


def resolve_device(value: str) -> torch.device:
    """``auto`` (CUDA when torch sees a GPU), ``cpu``, ``cuda`` or ``cuda:N``; an
    unavailable GPU is refused here, before the trainer joins the swarm."""
    text = str(value).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise ValidationError(f"--device must be auto, cpu, cuda or cuda:N, got {value!r}") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValidationError(f"--device must be auto, cpu, cuda or cuda:N, got {value!r}")
    if not torch.cuda.is_available():
        raise ValidationError(
            f"--device {value}: torch sees no CUDA device here (torch.cuda.is_available() "
            f"is False; torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValidationError(
            f"--device {value}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})"
        )
    return device if device.index is not None else torch.device("cuda", 0)


def check_model_device(model: torch.nn.Module, where: str) -> torch.device | None:
    """The one device holding the model's parameters and buffers (None for a model with
    none); a model split across devices is refused, naming a tensor on each."""
    found: dict[str, str] = {}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        found.setdefault(str(tensor.device), name)
    if len(found) > 1:
        listed = ", ".join(f"{device} (e.g. {name!r})" for device, name in sorted(found.items()))
        raise ValidationError(
            f"{where}: make_model() returned a model on several devices: {listed}; the "
            "trainer runs a model on one device (--device), so build it on one"
        )
    return tensors[0][1].device if tensors else None


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in tuples, lists and dicts) on ``device``; copies from pinned
    memory do not wait for the GPU."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


# ---------------------------------------------------------------------- precision


@dataclass
class Precision:
    """Autocast and, for fp16, loss scaling with swarmgrad's :class:`GradScaler`: the
    Optimizer unscales each step's gradients as it accumulates them (separate
    accumulators), or once per epoch where the ``.grad`` buffers are the accumulators."""

    name: str
    device: torch.device
    scaler: Any = None
    overflow_steps: int = 0  # consecutive steps whose fp16 gradients overflowed

    @classmethod
    def create(cls, name: str, device: torch.device) -> Precision:
        scaler = None
        if name == "fp16":
            from swarmgrad.optim import GradScaler

            scaler = GradScaler(device=device.type)
        return cls(name, device, scaler)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.name == "fp32":
            yield
            return
        dtype = torch.bfloat16 if self.name == "bf16" else torch.float16
        with torch.autocast(device_type=self.device.type, dtype=dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip(self, params: list[torch.Tensor], max_norm: float) -> None:
        """Clip the local step's gradients to ``max_norm`` (of the unscaled gradients:
        with fp16 the bound is scaled instead, since the step's .grad is still scaled)."""
        if self.scaler is not None:
            max_norm = max_norm * self.scaler.get_scale()
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def step(self, opt: Any, batch_size: int) -> None:
        """The collaborative step (and, for fp16, the scaler's update); zero_grad where
        the gradients are not the accumulators (``reuse_grad_buffers``)."""
        reuse = getattr(getattr(opt, "grad_averager", None), "reuse_grad_buffers", False)
        if self.scaler is None:
            opt.step(batch_size=batch_size)
            opt.zero_grad()
            return
        scale = self.scaler.get_scale()
        if reuse:  # torch's scaler hands itself to the Optimizer (sync mode)
            self.scaler.step(opt, batch_size=batch_size)
        else:
            opt.step(batch_size=batch_size, grad_scaler=self.scaler)
            opt.zero_grad()
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # update() lowers the scale only on overflow
            self.overflow_steps += 1
            if self.overflow_steps in (1, 10) or self.overflow_steps % 50 == 0:
                logger.warning(
                    "fp16 gradients overflowed (Inf/NaN) in the last %d steps; loss scale now "
                    "%.3g. They are dropped, so this peer contributes no progress to the "
                    "swarm until its gradients are finite (try --precision bf16 or a lower "
                    "learning rate)",
                    self.overflow_steps, self.scaler.get_scale(),
                )  # fmt: skip
        elif self.overflow_steps:
            logger.info("fp16 gradients finite again after %d overflows", self.overflow_steps)
            self.overflow_steps = 0


# ---------------------------------------------------------------------- the optimizer


def compression(name: str) -> Any:
    from swarmgrad import compression as c

    return {
        "none": c.NoCompression,
        "fp16": c.Float16Compression,
        "bf16": c.BFloat16Compression,
        "8bit": c.Uniform8BitQuantization,
        "4bit": c.Blockwise4BitQuantization,
    }[name]()


def keeper_follows_rounds(settings: dict[str, Any]) -> bool:
    """Whether a keeper of this run holds the swarm's state by taking part in its
    gradient rounds (a ``StateKeeper``: synchronous mode without delayed steps or
    PowerSGD, where a peer's state is a function of the averaged gradients) rather than
    by downloading it after each epoch (every other mode)."""
    s = settings
    return (
        s["role"] == "keeper"
        and s["mode"] == "sync"
        and not s["delay"]
        and s["powersgd_rank"] is None
    )


def make_collaborative_optimizer(
    settings: dict[str, Any], module: Any, dht: Any, model: torch.nn.Module, metrics: Any
) -> Any:
    """The swarmgrad optimizer for ``--mode``: ``Optimizer`` (sync, local) or
    ``DiLoCoOptimizer`` (diloco, streaming), with the module's optimizer and scheduler.
    A keeper (``--role keeper``) of a plain synchronous run gets a ``StateKeeper``, which
    follows the trainers' gradient rounds (see :func:`keeper_follows_rounds`)."""
    from swarmgrad.optim import DiLoCoOptimizer, Optimizer, PowerSGDGradientAverager, StateKeeper

    s = settings
    factory = module.make_optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
    scheduler = module.make_scheduler
    batch_size = s["batch_size"] * s["grad_accumulation"]
    if s["mode"] in ("diloco", "streaming"):
        target = s["target_batch_size"] if "target_batch_size" in s["_given"] else None
        return DiLoCoOptimizer(
            dht=dht,
            run_id=s["run_id"],
            batch_size=batch_size,
            num_inner_steps=s["inner_steps"],
            inner_optimizer=factory,
            params=model.parameters(),
            scheduler=scheduler,
            target_batch_size=target,
            num_fragments=s["fragments"],
            grad_compression=compression(s["outer_compression"]),
            matchmaking_time=s["matchmaking_time"],
            averaging_timeout=s["averaging_timeout"],
            client_mode=s["client_mode"],
            tracker_opts={"metadata_expiration": s["metadata_expiration"]},
            metrics=metrics,
        )
    extra: dict[str, Any] = {}
    if s["powersgd_rank"] is not None:
        rank = s["powersgd_rank"]

        def powersgd(*args: Any, **kwargs: Any) -> PowerSGDGradientAverager:
            return PowerSGDGradientAverager(*args, averager_rank=rank, **kwargs)

        extra["grad_averager_factory"] = powersgd
    cls = StateKeeper if keeper_follows_rounds(s) else Optimizer
    return cls(
        dht=dht,
        run_id=s["run_id"],
        target_batch_size=s["target_batch_size"],
        batch_size_per_step=batch_size,
        optimizer=factory,
        params=model.parameters(),
        scheduler=scheduler,
        matchmaking_time=s["matchmaking_time"],
        averaging_timeout=s["averaging_timeout"],
        tracker_opts={"metadata_expiration": s["metadata_expiration"]},
        use_local_updates=s["mode"] == "local",
        client_mode=s["client_mode"],
        offload_optimizer=s["offload"],
        delay_optimizer_step=s["delay"] or None,
        delay_grad_averaging=bool(s["delay"]) and s["mode"] == "sync",
        grad_compression=compression(s["grad_compression"]),
        metrics=metrics,
        **extra,
    )
