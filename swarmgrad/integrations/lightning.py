"""PyTorch Lightning strategy: train a ``LightningModule`` with the swarm.

::

    from swarmgrad.integrations.lightning import SwarmgradStrategy

    trainer = lightning.Trainer(
        strategy=SwarmgradStrategy(target_batch_size=4096, run_id="my_run",
                                   initial_peers=["/ip4/.../tcp/31337/p2p/12D3KooW..."]),
        accelerator="cpu", max_epochs=100,
    )
    trainer.fit(model)

The strategy has the shape of Lightning's former ``HivemindStrategy`` (now the
``lightning-hivemind`` package), so ``HivemindStrategy`` is an alias: same parameters,
same behaviour. It starts a DHT when created (and says, through Lightning's info log,
the address others join with), and at the first training batch replaces the module's
optimizer with a :class:`swarmgrad.Optimizer` over it: each Lightning step then counts
one local batch, and the model changes when the swarm has processed
``target_batch_size`` samples together. Learning-rate schedulers returned by
``configure_optimizers`` are wrapped to step once per such global epoch
(:class:`~swarmgrad.integrations.epoch_scheduler.EpochScheduler`).

Install with ``pip install swarmgrad[lightning]``; without it importing this module
raises :class:`~swarmgrad.integrations.MissingExtraError`.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swarmgrad.dht import DHT
from swarmgrad.integrations._extras import missing_extra
from swarmgrad.integrations.epoch_scheduler import EpochScheduler
from swarmgrad.optim import Optimizer
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import rank_zero_info
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as error:
    raise missing_extra("lightning", __name__, error) from error

__all__ = ["HivemindStrategy", "SwarmgradStrategy"]

logger = logging.getLogger(__name__)

# what the strategy passes to Optimizer itself; the rest of **optimizer_kwargs must be
# one of Optimizer's other parameters
_OWN_ARGUMENTS = {"dht", "run_id", "target_batch_size", "batch_size_per_step", "optimizer"}
_OWN_ARGUMENTS |= {"params", "scheduler"}


class SwarmgradStrategy(Strategy):
    """Train with the swarm: one process is one peer (module docstring).

    Parameters as hivemind's strategy: ``target_batch_size`` (samples per global epoch,
    summed over peers), ``run_id`` (peers with the same id train together),
    ``batch_size`` (samples per Lightning step; inferred from the first batch when
    None), ``delay_state_averaging``, ``delay_optimizer_step``, ``delay_grad_averaging``,
    ``offload_optimizer``, ``reuse_grad_buffers`` (then the module's
    ``optimizer_zero_grad`` is disabled during fit), ``scheduler_fn`` (a factory
    ``callable(optimizer) -> scheduler`` stepped per epoch by the swarmgrad Optimizer;
    required for a schedule when the optimizer is rebuilt, i.e. with
    ``offload_optimizer`` or a delayed step), ``matchmaking_time``,
    ``averaging_timeout``, ``verbose``, ``averager_opts``, ``host_maddrs`` (default: all
    interfaces, a free TCP port), ``initial_peers`` (else the ``SWARMGRAD_INITIAL_PEERS``
    environment variable, comma-separated; else this peer starts a swarm) and
    ``**optimizer_kwargs`` for :class:`swarmgrad.Optimizer`. Not in hivemind: ``dht``,
    an already running DHT to use instead of starting one (it is then not shut down).
    """

    INITIAL_PEERS_ENV = "SWARMGRAD_INITIAL_PEERS"

    def __init__(
        self,
        target_batch_size: int,
        run_id: str = "lightning_run",
        batch_size: int | None = None,
        delay_state_averaging: bool = False,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        offload_optimizer: bool | None = None,
        reuse_grad_buffers: bool = False,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        verbose: bool = False,
        averager_opts: dict | None = None,
        host_maddrs: Sequence[str] | None = None,
        initial_peers: str | Sequence[str] | None = None,
        dht: DHT | None = None,
        **optimizer_kwargs: Any,
    ):
        positive_int("target_batch_size", target_batch_size)
        if batch_size is not None:
            positive_int("batch_size", batch_size)
        if not isinstance(run_id, str) or not run_id:
            raise ValidationError(f"run_id must be a non-empty str, got {run_id!r}")
        if scheduler_fn is not None and not callable(scheduler_fn):
            raise ValidationError(
                "scheduler_fn must be a factory callable(optimizer) -> scheduler, "
                f"got {type(scheduler_fn).__name__}"
            )
        _check_optimizer_kwargs(optimizer_kwargs)
        if dht is not None and (initial_peers is not None or host_maddrs is not None):
            raise ValidationError(
                "initial_peers and host_maddrs configure the DHT the strategy starts: "
                "with dht=... given, leave them out"
            )
        super().__init__()
        self._target_batch_size, self._run_id, self._batch_size = (
            target_batch_size,
            run_id,
            batch_size,
        )
        self._scheduler_fn = scheduler_fn
        self._reuse_grad_buffers = reuse_grad_buffers
        # the optimizer is rebuilt from its class and param groups in the modes that
        # need swarmgrad to own it (an offloaded copy to update in the background)
        self._rebuild_optimizer = bool(
            offload_optimizer or delay_optimizer_step or delay_grad_averaging
        )
        self._optimizer_kwargs = dict(
            delay_state_averaging=delay_state_averaging,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            offload_optimizer=offload_optimizer,
            reuse_grad_buffers=reuse_grad_buffers,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            averager_opts=averager_opts,
            verbose=verbose,
            **optimizer_kwargs,
        )
        self._opt: Optimizer | None = None
        self._original_zero_grad: Any = None
        self._initialized = False
        self._fitting = False
        self._owns_dht = dht is None
        if dht is None:
            peers = _initial_peers(initial_peers, os.environ.get(self.INITIAL_PEERS_ENV))
            dht = DHT(
                initial_peers=peers,
                host_maddrs=list(host_maddrs)
                if host_maddrs is not None
                else ["/ip4/0.0.0.0/tcp/0"],
                start=True,
            )
        self.dht: DHT | None = dht
        addresses = ",".join(str(a) for a in dht.get_visible_maddrs())
        rank_zero_info(
            f"swarmgrad: run {run_id!r}; other peers join with "
            f"{self.INITIAL_PEERS_ENV}={addresses} python <your script> "
            f"or SwarmgradStrategy(initial_peers={addresses.split(',')!r})"
        )

    # ------------------------------------------------------------------ what Lightning asks

    @property
    def root_device(self) -> torch.device:
        if self.accelerator is not None and type(self.accelerator).__name__ == "CUDAAccelerator":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def is_global_zero(self) -> bool:
        return True  # every peer is its own rank 0: the swarm is not a process group

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def num_peers(self) -> int:
        """How many peers of the run this one knows of (1 before the first batch)."""
        return self._opt.tracker.global_progress.num_peers if self._opt is not None else 1

    @property
    def peer_addresses(self) -> list[str]:
        """The addresses other peers can pass as ``initial_peers``."""
        if self.dht is None:
            raise ValidationError("this strategy was torn down: its DHT is shut down")
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return tensor

    # ------------------------------------------------------------------ fitting

    def setup(self, trainer: pl.Trainer) -> None:
        # a fit (even one refused below) ends with the DHT shut down; validate/test don't
        self._fitting = self._fitting or trainer.state.fn == TrainerFn.FITTING
        if trainer.accumulate_grad_batches != 1:
            raise ValidationError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with "
                "SwarmgradStrategy: the swarm already accumulates up to target_batch_size; "
                "leave accumulate_grad_batches at 1"
            )
        super().setup(trainer)
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValidationError(
                "SwarmgradStrategy does not support float16 mixed precision with a loss "
                "scaler yet: use precision='32-true' or 'bf16-mixed'"
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._initialized:
            return
        if self.dht is None:
            raise ValidationError(
                "this SwarmgradStrategy was torn down after an earlier fit: create a new one"
            )
        if self._batch_size is None:
            try:
                self._batch_size = extract_batch_size(batch)
            except Exception as e:
                raise ValidationError(
                    "could not infer the batch size from the first batch "
                    f"({type(e).__name__}: {e}): pass SwarmgradStrategy(batch_size=...)"
                ) from e
            logger.info("batch size per step inferred from the first batch: %d", self._batch_size)
        self._start_collaboration()
        self._initialized = True

    def _start_collaboration(self) -> None:
        if len(self.optimizers) != 1:
            raise ValidationError(
                f"SwarmgradStrategy trains with exactly one optimizer; configure_optimizers "
                f"returned {len(self.optimizers)}"
            )
        local = self.optimizers[0]
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        if schedulers and self._scheduler_fn is not None:
            raise ValidationError(
                "configure_optimizers returned a scheduler and scheduler_fn was given too: "
                "use one of them"
            )
        if schedulers and self._rebuild_optimizer:
            raise ValidationError(
                "with offload_optimizer, delay_optimizer_step or delay_grad_averaging the "
                "optimizer is rebuilt inside swarmgrad, so a scheduler from "
                "configure_optimizers would drive a copy nobody uses: pass "
                "scheduler_fn=lambda opt: ... to SwarmgradStrategy instead"
            )
        for scheduler in schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValidationError(
                    "ReduceLROnPlateau is not supported by SwarmgradStrategy (each peer "
                    "would watch its own metric); use a schedule over epochs"
                )
        if self._rebuild_optimizer:
            optimizer_class = type(local)
            optimizer: Any = lambda groups: optimizer_class(groups)  # noqa: E731
            params: Any = local.param_groups  # each group keeps its hyperparameters
        else:
            optimizer, params = local, None
        opt = Optimizer(
            dht=self.dht,
            run_id=self._run_id,
            target_batch_size=self._target_batch_size,
            batch_size_per_step=self._batch_size,
            optimizer=optimizer,
            params=params,
            scheduler=self._scheduler_fn,
            **self._optimizer_kwargs,
        )
        self._opt = opt
        for config in self.lr_scheduler_configs:
            config.scheduler = EpochScheduler(opt, config.scheduler)
        opt.load_state_from_peers()  # a joiner starts from the swarm's model and epoch
        self.optimizers = [opt]
        if self._reuse_grad_buffers:
            self._disable_zero_grad()

    def _disable_zero_grad(self) -> None:
        module = self.lightning_module
        assert module is not None
        if is_overridden("optimizer_zero_grad", module):
            logger.warning(
                "reuse_grad_buffers=True: your optimizer_zero_grad is disabled during fit "
                "(the .grad buffers accumulate the swarm's batch)"
            )
        self._original_zero_grad = module.optimizer_zero_grad
        module.optimizer_zero_grad = lambda *args, **kwargs: None

    def teardown(self) -> None:
        module = self.lightning_module
        if self._original_zero_grad is not None and module is not None:
            module.optimizer_zero_grad = self._original_zero_grad
            self._original_zero_grad = None
        if self._opt is not None:
            self._opt.shutdown()
            self._opt = None
        if self.dht is not None and self._owns_dht and self._fitting:
            self.dht.shutdown()
            self.dht = None
        super().teardown()


HivemindStrategy = SwarmgradStrategy  # the name of the strategy this one replaces


def _initial_peers(given: str | Sequence[str] | None, from_env: str | None) -> list[str]:
    value = given if given is not None else from_env
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    peers = list(value)
    for peer in peers:
        if not isinstance(peer, str):
            raise ValidationError(
                f"initial_peers must be multiaddr strings, got {type(peer).__name__}: {peer!r}"
            )
    return peers


def _check_optimizer_kwargs(kwargs: dict) -> None:
    accepted = set(inspect.signature(Optimizer.__init__).parameters) - {"self"}
    for name in kwargs:
        if name in _OWN_ARGUMENTS:
            raise ValidationError(
                f"{name} is set by SwarmgradStrategy itself; do not pass it as an Optimizer option"
            )
        if name not in accepted:
            raise ValidationError(
                f"unknown option {name!r} for swarmgrad.Optimizer (from SwarmgradStrategy's "
                f"**optimizer_kwargs); accepted: {', '.join(sorted(accepted - _OWN_ARGUMENTS))}"
            )
