"""``TrainingStateAverager``: parameters, optimizer state and extra tensors of one peer,
averaged with the swarm, stepped (now or in the background) and shared with joiners.

What it owns:

* **The optimizer** (created from a factory over ``params``, or given). With
  ``offload_optimizer`` the optimizer works on a CPU master copy of the parameters, whose
  ``.grad`` buffers can receive averaged gradients directly (``custom_gradients``) or,
  without custom gradients, take the model's own gradients at each optimizer step (local
  updates); the model's parameters are refreshed from it after each update.
* **The scheduler**, kept at ``local_epoch`` steps: it steps once per global epoch,
  and a peer that downloads a later epoch fast-forwards it.
* **Averaging** of the parameters, the optimizer statistics named in
  ``average_opt_statistics`` and ``extra_tensors``. A round averages a copy taken when it
  starts; the result is applied with the *delta rule* (``local += average - copy``), so
  whatever the peer did meanwhile (local steps while the round ran in the background) is
  kept. If nothing changed meanwhile this is the average itself.
* **State sharing and download**: parameters, optimizer state (tensors and counters),
  extra tensors and the epoch; param-group hyperparameters (the scheduled lr) travel too.

:meth:`step` does any of: wait for or apply a delayed update, increment the epoch, an
optimizer step, zero_grad, an averaging round, each either now or in one background
thread (``delay_optimizer_step``, ``delay_averaging``). Work done in the background is
applied to the model by the next :meth:`step` that finds it finished: the model then
trains one step behind the optimizer (hivemind's delayed parameter updates).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.host_copies import copy_batch, host_buffer_like
from swarmgrad.optim.optimizer_state import (
    dump_optimizer_state,
    initialize_optimizer_state_,
    load_optimizer_state_,
    optimizer_parameters,
    optimizer_state_tensors,
)
from swarmgrad.optim.performance_ema import PerformanceEMA
from swarmgrad.optim.tensor_digest import TensorDigest
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

# hivemind's name for the base class of torch's LR schedulers (programs subclass it)
LRSchedulerBase = torch.optim.lr_scheduler.LRScheduler

__all__ = ["LRSchedulerBase", "TrainingStateAverager"]

logger = logging.getLogger(__name__)

_EXECUTOR_THREAD_PREFIX = "swarmgrad-state-averager"  # the background work's one thread

_GROUP_POLL_SECONDS = 0.05  # how often a bounded state round looks whether it has a group

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

# more of hivemind.optim.state_averager's names, which programs import
Parameters = Iterable[torch.Tensor]
ParamGroups = Iterable[dict[str, Any]]
TorchOptimizer = torch.optim.Optimizer
ZERO_GRAD_SET_TO_NONE_DEFAULT = True  # torch >= 2 clears gradients to None by default


def load_optimizer_state(optimizer: torch.optim.Optimizer, flat_metadata: Any, flat_tensors: Any):
    """Load a state from :func:`dump_optimizer_state` into ``optimizer`` in place
    (hivemind's name; ValidationError naming the first mismatch, before any change)."""
    load_optimizer_state_(optimizer, flat_metadata, list(flat_tensors))


class TrainingStateAverager(DecentralizedAverager):
    """See the module docstring. Arguments (hivemind's names):

    ``optimizer``: a factory ``callable(params) -> torch.optim.Optimizer`` (then ``params``
    is required: parameters or param-group dicts), or an optimizer made by the caller.
    ``scheduler``: a factory ``callable(optimizer) -> LRScheduler`` or a scheduler.
    ``offload_optimizer`` / ``custom_gradients``: see the module docstring (both need a
    factory). ``delta_rule_averaging``: accepted; the delta rule is always applied.
    ``average_opt_statistics``: names of optimizer state tensors to average too (e.g.
    ``("exp_avg_sq",)``). ``extra_tensors``: more tensors to average and share (e.g.
    batch-norm statistics). ``initialize_optimizer``: create the optimizer state at
    once (default True; needed for averaging statistics and for state download).
    Other keyword arguments go to :class:`DecentralizedAverager`.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        scheduler: SchedulerFactory | Any | None = None,
        initialize_optimizer: bool | None = None,
        offload_optimizer: bool = False,
        custom_gradients: bool = False,
        reuse_tensors: bool | None = None,
        sync_epoch_when_averaging: bool = False,
        delta_rule_averaging: bool = False,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        status_loglevel: int = logging.DEBUG,
        params: Iterable[Any] | None = None,
        parameter_names: Sequence[str] | None = None,
        performance_ema_alpha: float = 0.1,
        **kwargs: Any,
    ):
        if (offload_optimizer or custom_gradients) and not callable(optimizer):
            raise ValidationError(
                "offload_optimizer and custom_gradients need an optimizer factory: pass "
                "optimizer=lambda params: torch.optim.X(params, ...) and params=..."
            )
        if custom_gradients and not offload_optimizer:
            raise ValidationError("custom_gradients=True needs offload_optimizer=True")
        if isinstance(average_opt_statistics, str):
            average_opt_statistics = (average_opt_statistics,)
        self.status_loglevel = status_loglevel
        self.offload_optimizer, self.custom_gradients = bool(offload_optimizer), custom_gradients
        if reuse_tensors is None:  # hivemind's default rule (the flag is informational here)
            reuse_tensors = bool(offload_optimizer) and not delta_rule_averaging
        self.reuse_tensors = reuse_tensors
        self.delta_rule_averaging = delta_rule_averaging
        self.sync_epoch_when_averaging = sync_epoch_when_averaging
        self.average_opt_statistics = tuple(average_opt_statistics)
        self.extra_tensors = tuple(extra_tensors)
        self.local_epoch = 0
        # bumped whenever the state changes other than by an optimizer step (an averaged
        # state applied, a download): a digest taken before such a change is stale
        self.state_version = 0
        self.delay_before_averaging = PerformanceEMA(alpha=performance_ema_alpha)
        self._state_lock = threading.RLock()  # the local state: parameters, optimizer, extras

        self.optimizer, self.main_parameters = self._make_optimizer(optimizer, params)
        self.parameter_names = (
            tuple(parameter_names)
            if parameter_names is not None
            else tuple(f"parameter {i}" for i in range(len(self.main_parameters)))
        )
        if initialize_optimizer is None or initialize_optimizer:
            initialize_optimizer_state_(self.optimizer)
        self.scheduler = self._make_scheduler(scheduler)
        self._local_tensors = self._tensors_to_average()
        averaged = [t.detach().to("cpu", copy=True).contiguous() for t in self._local_tensors]

        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=_EXECUTOR_THREAD_PREFIX
        )
        self._pending: concurrent.futures.Future | None = None
        self._pending_lock = threading.Lock()
        # cleared while a delayed optimizer step of an epoch already counted is to come:
        # a state served meanwhile holds the tensors of the epoch before (get_current_state)
        self._update_applied = threading.Event()
        self._update_applied.set()
        self._round_control: StepControl | None = None  # the background round's, if any
        self.finished_optimizer_step = threading.Event()
        self.finished_averaging_round = threading.Event()
        super().__init__(averaged, dht, **kwargs)

    # ------------------------------------------------------------------ construction

    def _make_optimizer(
        self, optimizer: Any, params: Iterable[Any] | None
    ) -> tuple[torch.optim.Optimizer, tuple[torch.Tensor, ...]]:
        if isinstance(optimizer, torch.optim.Optimizer) or (
            not callable(optimizer) and hasattr(optimizer, "param_groups")
        ):
            if params is not None:
                raise ValidationError(
                    "params were given with an optimizer that already has its parameters: "
                    "pass either optimizer=factory with params, or an optimizer alone"
                )
            return optimizer, tuple(optimizer_parameters(optimizer))
        if not callable(optimizer):
            raise ValidationError(
                f"optimizer must be a torch optimizer or a factory callable(params), got "
                f"{type(optimizer).__name__}"
            )
        if params is None:
            raise ValidationError("an optimizer factory needs params=model.parameters()")
        groups = list(params)
        if not groups:
            raise ValidationError("params is empty: nothing to optimize")
        plain = not isinstance(groups[0], dict)
        if plain:
            groups = [{"params": groups}]
        main_parameters = tuple(p for group in groups for p in group["params"])
        if self.offload_optimizer:
            groups = [
                {**group, "params": [self._offloaded(p) for p in group["params"]]}
                for group in groups
            ]
        try:
            made = optimizer(groups[0]["params"] if plain else groups)
        except Exception as e:
            raise ValidationError(f"the optimizer factory raised {type(e).__name__}: {e}") from e
        if not hasattr(made, "param_groups") or not hasattr(made, "step"):
            raise ValidationError(
                f"the optimizer factory returned a {type(made).__name__}, not an optimizer"
            )
        if len(optimizer_parameters(made)) != len(main_parameters):
            raise ValidationError(
                f"the optimizer factory made an optimizer over {len(optimizer_parameters(made))} "
                f"parameters, but {len(main_parameters)} were given"
            )
        return made, main_parameters

    def _offloaded(self, param: torch.Tensor) -> torch.Tensor:
        """The master copy on the host (pinned for a parameter on a GPU)."""
        master = host_buffer_like(param.detach())
        copy_batch([(param.detach(), master)])
        copy = torch.nn.Parameter(master, requires_grad=param.requires_grad)
        if self.custom_gradients and param.requires_grad:
            copy.grad = torch.zeros_like(copy)
        return copy

    def _make_scheduler(self, scheduler: Any) -> Any:
        if scheduler is None:
            return None
        if callable(scheduler) and not hasattr(scheduler, "state_dict"):
            try:
                return scheduler(self.optimizer)
            except Exception as e:
                raise ValidationError(
                    f"the scheduler factory raised {type(e).__name__}: {e}"
                ) from e
        return scheduler

    def _tensors_to_average(self) -> list[torch.Tensor]:
        tensors = [p for p in optimizer_parameters(self.optimizer)]
        if self.average_opt_statistics:
            wanted = set(self.average_opt_statistics)
            found = [
                t
                for name, t in optimizer_state_tensors(self.optimizer)
                if name.split(" ", 2)[2] in wanted
            ]
            if not found:
                raise ValidationError(
                    f"average_opt_statistics={self.average_opt_statistics} names no tensor "
                    f"of {type(self.optimizer).__name__}'s state"
                )
            tensors.extend(found)
        tensors.extend(self.extra_tensors)
        for index, tensor in enumerate(tensors):
            if not tensor.is_floating_point():
                raise ValidationError(f"averaged state tensor {index} is not floating-point")
        return tensors

    # ------------------------------------------------------------------ the state

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.optimizer

    def state_digest(self) -> bytes:
        """A hash of everything a state round would average plus the optimizer's whole
        state and hyperparameters: peers with equal digests that apply the same averaged
        gradients stay equal, so a state round among them would change nothing."""
        digest = TensorDigest()
        with self._state_lock, torch.no_grad():
            digest.update_tensors(
                [*self._local_tensors, *(t for _, t in optimizer_state_tensors(self.optimizer))]
            )
            for group in self.optimizer.param_groups:
                digest.update_bytes(
                    repr(sorted((k, repr(v)) for k, v in group.items() if k != "params")).encode()
                )
        return digest.digest()

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        """What joiners download: the epoch, the parameters, the optimizer state and the
        extra tensors (copies, taken under the state lock), served at once.

        While the delayed optimizer step of the epoch just counted is still to come, the
        tensors are those of the epoch before, and so is the label. Labelled with the
        new epoch, two ALBERT trainers at start-up passed each other a state no optimizer
        step had reached as "epoch 3". Waiting for the step instead stalled a joiner for
        the whole averaging timeout: the step waited for a gradient round, and the round
        for the joiner. The epoch is read before the flag and the flag is cleared before
        the count (``step``), so a state is never labelled newer than its tensors."""
        with self._state_lock:
            epoch = self.local_epoch
            if not self._update_applied.is_set():
                epoch -= 1
            opt_metadata, opt_tensors = dump_optimizer_state(self.optimizer)
            metadata = {
                "epoch": epoch,
                "group_bits": self.get_group_bits(),
                "optimizer": opt_metadata,
                "num_parameters": len(self.main_parameters),
                "num_extra": len(self.extra_tensors),
            }
            tensors = [
                t.detach().to("cpu", copy=True)
                for t in (
                    *optimizer_parameters(self.optimizer),
                    *opt_tensors,
                    *self.extra_tensors,
                )
            ]
        return metadata, tensors

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        """Download the freshest state of the run and apply it: parameters, optimizer
        state, extra tensors, epoch (and the scheduler, fast-forwarded). Returns the
        loaded epoch, or None if no donor answered within ``timeout``. A state that does
        not fit ours raises ValidationError naming the first differing tensor."""
        if not wait:
            raise ValidationError("TrainingStateAverager.load_state_from_peers needs wait=True")
        loaded = DecentralizedAverager.load_state_from_peers(self, wait=True, timeout=timeout)
        if loaded is None:
            return None
        metadata, tensors = loaded
        self._apply_downloaded_state(metadata, tensors)
        return self.local_epoch

    def _apply_downloaded_state(self, metadata: Any, tensors: list[torch.Tensor]) -> None:
        if not isinstance(metadata, dict) or type(metadata.get("epoch")) is not int:
            raise ValidationError("the downloaded state has no epoch: not a training state")
        params = optimizer_parameters(self.optimizer)
        opt_tensors = [t for _, t in optimizer_state_tensors(self.optimizer)]
        expected = len(params) + len(opt_tensors) + len(self.extra_tensors)
        if metadata.get("num_parameters") == len(params) and len(tensors) != expected:
            theirs, ours = (
                _state_keys(metadata.get("optimizer")),
                _state_keys(dump_optimizer_state(self.optimizer)[0]),
            )
            if theirs != ours:
                raise ValidationError(
                    f"the downloaded optimizer state holds {theirs or 'nothing'} per parameter, "
                    f"ours {ours or 'nothing'}: another layout (is it the same optimizer?)"
                )
        if len(tensors) != expected or metadata.get("num_parameters") != len(params):
            raise ValidationError(
                f"the downloaded state has {len(tensors)} tensors "
                f"({metadata.get('num_parameters')} parameters); ours has {expected} "
                f"({len(params)} parameters)"
            )
        for index, (mine, theirs) in enumerate(zip(params, tensors, strict=False)):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise ValidationError(
                    f"{self.parameter_names[index]} is {theirs.dtype}{list(theirs.shape)} in the "
                    f"downloaded state but {mine.dtype}{list(mine.shape)} here"
                )
        extras = tensors[len(params) + len(opt_tensors) :]
        for index, (mine, theirs) in enumerate(zip(self.extra_tensors, extras, strict=True)):
            if mine.shape != theirs.shape:
                raise ValidationError(
                    f"extra tensor {index} has shape {list(theirs.shape)} in the downloaded "
                    f"state but {list(mine.shape)} here"
                )
        self.step(wait_for_delayed_updates=True, apply_delayed_updates=False)
        with self.lock_averaged_tensors, self._state_lock, torch.no_grad():
            load_optimizer_state_(
                self.optimizer,
                metadata.get("optimizer"),
                tensors[len(params) : len(params) + len(opt_tensors)],
            )
            for mine, theirs in zip(params, tensors, strict=False):
                mine.copy_(theirs)
            for mine, theirs in zip(self.extra_tensors, extras, strict=True):
                mine.copy_(theirs)
            self._copy_offloaded_to_main()
            self.local_epoch = metadata["epoch"]
            self.state_version += 1
            self._update_scheduler()

    def _copy_offloaded_to_main(self) -> None:
        if not self.offload_optimizer:
            return
        with torch.no_grad():
            masters = optimizer_parameters(self.optimizer)
            copy_batch(zip(masters, self.main_parameters, strict=True))

    def _update_scheduler(self) -> None:
        """Step the scheduler until it is at ``local_epoch``."""
        if self.scheduler is None:
            return
        last = getattr(self.scheduler, "last_epoch", None)
        if not isinstance(last, int):
            return
        with warnings_quiet():
            while self.scheduler.last_epoch < self.local_epoch:
                self.scheduler.step()

    # ------------------------------------------------------------------ stepping

    def step(
        self,
        wait_for_delayed_updates: bool | None = None,
        apply_delayed_updates: bool = True,
        increment_epoch: bool = False,
        optimizer_step: bool = False,
        zero_grad: bool = False,
        delay_optimizer_step: bool = False,
        averaging_round: bool = False,
        delay_averaging: bool | None = None,
        averaging_control: StepControl | None = None,
        wait_for_trigger: Callable[[], Any] | None = None,
        grad_scaler: Any = None,
        averaging_opts: dict[str, Any] | None = None,
    ) -> None:
        """Do what the flags say, in this order: finish (wait for) the background work,
        apply it, increment the epoch, then an optimizer step, zero_grad and an averaging
        round, now or (``delay_optimizer_step`` / ``delay_averaging``) in the background
        thread; ``wait_for_trigger`` runs first there (e.g. waiting for averaged
        gradients). Errors of background work are logged and the update skipped; the
        peer carries on with its state as it was. ``averaging_opts``: the round's
        ``timeout`` and ``gather``; ``search_timeout``: give the round up if it has no
        group that long past its scheduled time; ``alone``, a callable true once every
        other peer has left, which ends that search early; and ``wait``, a callable that
        waits for the round's control (instead of ``control.result(timeout)``; the
        Optimizer's gives the round up once every other peer has left)."""
        if delay_averaging is None:
            delay_averaging = delay_optimizer_step
        if wait_for_delayed_updates is None:
            wait_for_delayed_updates = optimizer_step or zero_grad or averaging_round
        if averaging_control is not None and not averaging_round:
            raise ValidationError("averaging_control was given without averaging_round=True")
        if delay_optimizer_step and optimizer_step and not self.offload_optimizer:
            raise ValidationError(
                "delay_optimizer_step needs offload_optimizer=True: a delayed step on the "
                "model's own parameters would race with the forward and backward passes"
            )
        if wait_for_delayed_updates:
            self._wait_for_pending()
        if apply_delayed_updates:
            self._apply_pending_if_done()
        if optimizer_step and self.offload_optimizer and not self.custom_gradients:
            # now, not in the background: the next backward pass overwrites the model's .grad
            self._load_local_grads_into_optimizer()
        delay_update = delay_optimizer_step and (optimizer_step or wait_for_trigger is not None)
        if increment_epoch:
            if delay_update:  # before the count: see get_current_state
                self._update_applied.clear()
            self.local_epoch += 1
            self._update_scheduler()
        if not (optimizer_step or zero_grad or averaging_round or wait_for_trigger):
            return
        started = get_dht_time()

        def update() -> None:
            try:
                if wait_for_trigger is not None:
                    wait_for_trigger()
                if optimizer_step:
                    self._optimizer_step(grad_scaler)
                if zero_grad:
                    self.optimizer.zero_grad(set_to_none=not self.custom_gradients)
            finally:
                self._update_applied.set()

        def average() -> Callable[[], None] | None:
            self.delay_before_averaging.update(task_size=1, interval=get_dht_time() - started)
            averaged = self._averaging_round(averaging_control, averaging_opts or {})
            self.finished_averaging_round.set()
            return averaged

        if not delay_update:
            # the model gets this update now, whatever happens to the averaging round
            update()
            if optimizer_step:
                self._copy_offloaded_to_main()
            if not averaging_round:
                return
            if not delay_averaging:
                apply = average()
                if apply is not None:
                    apply()
                    self._copy_offloaded_to_main()
                return

        def work() -> Callable[[], None]:
            if delay_update:
                update()
            averaged = average() if averaging_round else None

            def apply() -> None:
                if averaged is not None:
                    averaged()
                self._copy_offloaded_to_main()

            return apply

        with self._pending_lock:
            self._pending = self._executor.submit(work)

    def _load_local_grads_into_optimizer(self) -> None:
        """Offloaded without custom gradients: the optimizer's master copy takes the
        model's own gradients (a parameter without one is skipped by the step)."""
        with self._state_lock, torch.no_grad():
            copies = []
            for main, master in zip(
                self.main_parameters, optimizer_parameters(self.optimizer), strict=True
            ):
                if main.grad is None:
                    master.grad = None
                    continue
                if master.grad is None or master.grad.shape != main.grad.shape:
                    master.grad = host_buffer_like(main.grad)
                copies.append((main.grad, master.grad))
            copy_batch(copies)  # from a GPU: one wait for all of them

    def _optimizer_step(self, grad_scaler: Any) -> None:
        with self._state_lock:
            if grad_scaler is not None:
                with grad_scaler.running_global_step():
                    grad_scaler.step(self.optimizer)  # the user's update() follows
            else:
                self.optimizer.step()
        self.finished_optimizer_step.set()

    def _averaging_round(
        self, control: StepControl | None, options: dict[str, Any]
    ) -> Callable[[], None] | None:
        """Average a copy of the state; return how to apply the result (delta rule)."""
        with self.lock_averaged_tensors, self._state_lock, torch.no_grad():
            snapshot = [t.detach().to("cpu", copy=True) for t in self._local_tensors]
            versions = [t._version for t in self._local_tensors]
            for buffer, value in zip(self._averaged_tensors, snapshot, strict=True):
                buffer.copy_(value)
        timeout = options.get("timeout")
        try:
            if control is None:
                control = DecentralizedAverager.step(
                    self,
                    gather=options.get("gather", self.local_epoch),
                    wait=False,
                    timeout=timeout,
                    require_trigger=True,
                )
            self._round_control = control
            control.allow_allreduce()
            search_timeout = options.get("search_timeout")
            alone = options.get("alone")
            if search_timeout is not None and not _grouped_within(control, search_timeout, alone):
                if alone is not None and alone():
                    why = "every other peer left"
                else:
                    why = f"no group within {search_timeout:.1f} s"
                logger.log(self.status_loglevel, "state averaging skipped: %s", why)
                return None
            wait = options.get("wait")  # the optimizer's: gives up once the others left
            gathered = wait(control) if wait is not None else control.result(timeout)
        except (Exception, concurrent.futures.CancelledError) as e:
            logger.log(self.status_loglevel, "state averaging failed: %r", e)
            if control is not None and not control.done():
                control.cancel()
            return None
        if not gathered:
            logger.log(self.status_loglevel, "state averaging found no group")
            return None
        logger.log(self.status_loglevel, "averaged the state with %d peers", len(gathered))

        def apply() -> None:
            with self.lock_averaged_tensors, self._state_lock, torch.no_grad():
                tensors = zip(
                    self._local_tensors, self._averaged_tensors, snapshot, versions, strict=True
                )
                for local, average, before, version in tensors:
                    if local._version == version:
                        local.copy_(average)  # nothing happened meanwhile: exact average
                    else:
                        local.add_(average.to(local.device) - before.to(local.device))
                self.state_version += 1

        return apply

    def state_lock(self) -> contextlib.AbstractContextManager:
        """Hold this while changing the parameters or the optimizer from outside
        :meth:`step` (a joiner's download reads them under the same lock)."""
        return self._state_lock

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        """Begin matchmaking for a state averaging round released by a later
        :meth:`step` (``averaging_control=``)."""
        if scheduled_time is None:
            scheduled_time = get_dht_time() + self._options["min_matchmaking_time"]
        return DecentralizedAverager.step(
            self, scheduled_time=scheduled_time, require_trigger=True, wait=False, **kwargs
        )

    @property
    def averaging_in_progress(self) -> bool:
        pending = self._pending
        return pending is not None and not pending.done()

    def _wait_for_pending(self) -> None:
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result()

    def _apply_pending_if_done(self) -> None:
        with self._pending_lock:
            pending = self._pending
            if pending is None or not pending.done():
                return
            self._pending = None
        try:
            apply = pending.result()
        except Exception as e:
            logger.warning("a delayed update failed and was skipped: %r", e)
            return
        if apply is not None:
            apply()

    def drop_round_without_group(self) -> bool:
        """Cancel the background state round if it is still looking for a group (True if
        one was): a leaving peer would otherwise wait up to its timeout for partners that
        may be gone, and a round without a group changes nobody's state. A round whose
        group formed is left to finish: its members count on this peer's part."""
        control = self._round_control
        return control is not None and control.cancel_if_ungrouped()

    def shutdown(self) -> None:
        """Finish the background work (bounded by ``shutdown_timeout``), then leave."""
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result(self.shutdown_timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._update_applied.set()  # a cancelled update never comes: nobody waits for it
        super().shutdown()


def _grouped_within(
    control: StepControl, search_timeout: float, alone: Callable[[], bool] | None = None
) -> bool:
    """Wait until the released round ``control`` has a group (or ended), at most
    ``search_timeout`` seconds past its scheduled time; cancel it if it is still looking
    then (False). A state round is a correction, not a necessity: a peer whose partners
    are busy elsewhere (in their gradient round, say) must not block its own epoch for the
    whole averaging timeout, or two peers can settle into alternating rounds that never
    meet. ``alone``: True once every other peer has left; the search ends then (a
    partner that said goodbye mid-search cost the last peer the whole search)."""
    deadline = time.monotonic() + max(0.0, control.scheduled_time - get_dht_time())
    deadline += search_timeout
    while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
        if control.done():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0 or (alone is not None and alone()):
            return not control.cancel_if_ungrouped()
        with contextlib.suppress(concurrent.futures.TimeoutError, TimeoutError):
            control.result(min(remaining, _GROUP_POLL_SECONDS))
    return True


@contextlib.contextmanager
def warnings_quiet():
    """torch warns when a scheduler steps before its optimizer; fast-forwarding does."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _state_keys(optimizer_metadata: Any) -> list[str]:
    """The names of the per-parameter state entries in dumped optimizer metadata (e.g.
    ``['momentum_buffer']``), for an error that says which optimizers differ."""
    layout = optimizer_metadata.get("layout") if isinstance(optimizer_metadata, dict) else None
    if not isinstance(layout, list):
        return []
    return sorted({str(e[1]) for e in layout if isinstance(e, list | tuple) and len(e) > 1})
