"""``Optimizer``: train one model across the swarm by swapping the optimizer (DeDLOC).

::

    opt = swarmgrad.Optimizer(dht=dht, run_id="my_run", target_batch_size=4096,
                              batch_size_per_step=32, params=model.parameters(),
                              optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    for batch in data:
        loss_fn(model, batch).backward()
        opt.step()          # accumulate; once the swarm has 4096 samples: average, update
        opt.zero_grad()

Peers report progress (:class:`~.progress_tracker.ProgressTracker`); when the swarm has
processed ``target_batch_size`` samples since the last update, every peer averages its
accumulated gradients with the others (:class:`~.grad_averager.GradientAverager`, a group
scheduled ``matchmaking_time`` ahead so that the all-reduce starts when the epoch is due),
steps its optimizer and moves to the next *epoch*; parameters and optimizer state are
averaged too, every ``average_state_every`` epochs, usually in the background
(:class:`~.state_averager.TrainingStateAverager`). A peer that fell behind downloads the
state. Modes (see ``docs/training.md``):

* synchronous (default): equivalent to large-batch training with the global batch;
* ``delay_optimizer_step`` / ``delay_grad_averaging``: the update (and the all-reduce)
  runs in the background while the next batches are computed: one step of staleness;
* ``use_local_updates``: every step updates the local model; parameters are averaged
  once per epoch instead of gradients;
* ``outer_optimizer=...``: DiLoCo; every step is an inner step, and every
  ``target_batch_size`` samples of the swarm the peers average how far they moved and
  an outer optimizer applies it (a :class:`~.diloco.DiLoCoOptimizer` is returned);
* ``auxiliary``: helps averaging with its bandwidth, computes nothing;
* ``client_mode``: trains, accepts no connections (behind NAT).

Differences from hivemind (its traps, fixed here; ``docs/training.md`` has the list):
``client_mode`` is honoured (hivemind's constructor drops a True value); every peer signs
its progress with its own identity (several peers per process are fine); a peer refused
for tensors unlike the run's gets that error instead of training alone; claims of epochs
that no donor can serve stop triggering downloads; ``delay_optimizer_step`` without an
offloaded optimizer is refused rather than racing with backward.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from swarmgrad.averaging.allreduce import GroupMismatch
from swarmgrad.averaging.offenders import without_bans
from swarmgrad.averaging.step_control import StepControl
from swarmgrad.compression import CompressionBase, NoCompression
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.epoch_machinery import EpochMachinery
from swarmgrad.optim.grad_averager import GradientAverager, GradientAveragerFactory
from swarmgrad.optim.grad_scaler import GradScaler
from swarmgrad.optim.metrics import MetricsPublisher, is_scalar_loss, training_fields
from swarmgrad.optim.optimizer_state import optimizer_parameters
from swarmgrad.optim.performance_ema import PerformanceEMA
from swarmgrad.optim.progress import LocalTrainingProgress
from swarmgrad.optim.progress_tracker import ProgressTracker
from swarmgrad.optim.state_averager import TrainingStateAverager
from swarmgrad.utils.checks import check_peer_role, optional_positive_seconds, positive_int
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["Optimizer"]

logger = logging.getLogger(__name__)


class Optimizer(torch.optim.Optimizer):
    """A torch optimizer that trains one model with the whole swarm (module docstring).

    Arguments are hivemind 1.1's: ``dht``, ``run_id`` (peers with the same id train
    together), ``target_batch_size`` (samples per global epoch), ``batch_size_per_step``
    (samples per local :meth:`step`, or pass ``batch_size`` to each), ``optimizer`` (a
    factory ``callable(params)`` with ``params``, or a ready optimizer), ``scheduler``
    (a factory ``callable(optimizer)``; steps once per epoch), ``matchmaking_time``
    (how early a group is sought before the epoch ends), ``averaging_timeout`` (bound on
    a whole averaging step), ``allreduce_timeout`` (default: averaging_timeout),
    ``next_chunk_timeout`` (a fixed wait for each part of a round and each chunk of a
    state download; default: none, the waits adapt to the link, unlike hivemind's
    default of matchmaking_time), ``load_state_timeout``,
    ``reuse_grad_buffers``, ``offload_optimizer`` (default: when ``params`` is given
    and gradients are averaged), ``delay_optimizer_step`` (default:
    delay_grad_averaging), ``delay_grad_averaging``, ``delay_state_averaging``,
    ``average_state_every``, ``use_local_updates``, ``client_mode`` (default: the DHT's),
    ``auxiliary``, ``grad_compression``, ``grad_averager_factory``,
    ``state_averaging_compression``, ``load_state_compression``,
    ``average_opt_statistics``, ``extra_tensors``, ``averager_opts`` (more options for
    both averagers, e.g. ``bandwidth``, ``target_group_size``; ``ban_after`` and
    ``ban_window`` only for the gradient averager when there is one, whose bans the
    state averager follows, see :func:`~swarmgrad.averaging.offenders.without_bans`),
    ``tracker_opts`` (for the :class:`ProgressTracker`), ``performance_ema_alpha``,
    ``shutdown_timeout``, ``verbose`` (log each epoch at INFO). Not in hivemind:
    ``outer_optimizer`` (a factory over the synced copy) switches to DiLoCo mode and
    returns a :class:`~.diloco.DiLoCoOptimizer` (``optimizer`` is then the inner optimizer, its
    ``scheduler`` steps with it, and ``target_batch_size`` is the swarm's samples per
    outer step); ``diloco_opts`` carries its other options (``diloco_mode.py``).
    ``metrics`` (default True): publish this peer's metrics record for ``swarmgrad
    monitor`` (:class:`~.metrics.MetricsPublisher`; a dict gives its options, e.g.
    ``{"period": 5.0}``; False: none); report the loss with :meth:`report`.
    """

    def __new__(cls, *args: Any, outer_optimizer: Any = None, **kwargs: Any) -> Any:
        # DiLoCo mode: ``Optimizer(..., outer_optimizer=...)`` makes a DiLoCoMode, the
        # DiLoCoOptimizer (a subclass of ours) whose __init__ takes our arguments; Python
        # then calls that __init__ with them. Subclasses construct themselves.
        if outer_optimizer is None or cls is not Optimizer:
            return super().__new__(cls)
        if args:
            raise TypeError("Optimizer takes keyword arguments only")
        from swarmgrad.optim.diloco_mode import DiLoCoMode  # diloco imports this module

        return super().__new__(DiLoCoMode)

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: Any,
        params: Any = None,
        scheduler: Any = None,
        matchmaking_time: float | None = 15.0,
        averaging_timeout: float | None = 60.0,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: CompressionBase = NoCompression(),
        grad_averager_factory: GradientAveragerFactory | None = None,
        state_averaging_compression: CompressionBase = NoCompression(),
        load_state_compression: CompressionBase = NoCompression(),
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: dict | None = None,
        tracker_opts: dict | None = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5,
        verbose: bool = False,
        outer_optimizer: None = None,
        diloco_opts: None = None,
        metrics: bool | dict = True,
    ):
        if diloco_opts is not None:  # (outer_optimizer set: __new__ built a DiLoCoOptimizer)
            raise ValidationError(
                "diloco_opts needs outer_optimizer (DiLoCo mode); without it, leave it out"
            )
        self._parent_pid = os.getpid()
        positive_int("target_batch_size", target_batch_size)
        if batch_size_per_step is not None:
            positive_int("batch_size_per_step", batch_size_per_step)
        positive_int("average_state_every", average_state_every)
        for name, value in (
            ("matchmaking_time", matchmaking_time),
            ("averaging_timeout", averaging_timeout),
            ("allreduce_timeout", allreduce_timeout),
            ("next_chunk_timeout", next_chunk_timeout),
            ("load_state_timeout", load_state_timeout),
            ("shutdown_timeout", shutdown_timeout),
        ):
            optional_positive_seconds(name, value)
        if not isinstance(run_id, str) or not run_id:
            raise ValidationError(f"run_id must be a non-empty str, got {run_id!r}")
        if dht.peer is None:
            raise ValidationError("the DHT is not running: start it before the Optimizer")

        # hivemind reads `client_mode if client_mode is None else dht.client_mode`, which
        # drops an explicit client_mode=True; here an explicit value wins.
        client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        if delay_optimizer_step is None:
            delay_optimizer_step = delay_grad_averaging
        if offload_optimizer is None:
            offload_optimizer = params is not None and not use_local_updates
        matchmaking_time = 15.0 if matchmaking_time is None else float(matchmaking_time)
        averaging_timeout = 60.0 if averaging_timeout is None else float(averaging_timeout)
        allreduce_timeout = averaging_timeout if allreduce_timeout is None else allreduce_timeout
        # next_chunk_timeout stays None unless given: hivemind defaults it to
        # matchmaking_time, which turned a short matchmaking window into a fixed per-part
        # deadline that excluded every peer on a slow link (the averagers' own waits adapt
        # to the throughput they see, see averaging/deadlines.py)
        _check_modes(
            client_mode=client_mode,
            auxiliary=auxiliary,
            batch_size_per_step=batch_size_per_step,
            use_local_updates=use_local_updates,
            reuse_grad_buffers=reuse_grad_buffers,
            delay_grad_averaging=delay_grad_averaging,
            delay_optimizer_step=delay_optimizer_step,
            offload_optimizer=offload_optimizer,
            grad_averager_factory=grad_averager_factory,
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
        )

        self.dht, self.run_id = dht, run_id
        self.client_mode, self.auxiliary = client_mode, auxiliary
        self.batch_size_per_step, self.target_batch_size = batch_size_per_step, target_batch_size
        self.delay_state_averaging, self.average_state_every = (
            delay_state_averaging,
            average_state_every,
        )
        self.matchmaking_time, self.offload_optimizer = matchmaking_time, offload_optimizer
        self.delay_grad_averaging, self.delay_optimizer_step = (
            delay_grad_averaging,
            delay_optimizer_step,
        )
        self.averaging_timeout, self.allreduce_timeout = averaging_timeout, allreduce_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.next_chunk_timeout = next_chunk_timeout
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        self.scheduled_grads: StepControl | None = None
        self.scheduled_state: StepControl | None = None
        self._group_error: BaseException | None = None
        # synchronous mode: a state round among peers whose states are equal is skipped
        self._compare_states = not (use_local_updates or delay_optimizer_step or auxiliary)
        self._state_digest: tuple[tuple[int, int], bytes] | None = None  # (epoch, version)
        self._result_before_round: Any = None  # grad averager's last result, before ours
        self._states_equal = False

        self.tracker = ProgressTracker(
            dht,
            run_id,
            target_batch_size,
            client_mode=client_mode,
            status_loglevel=self.status_loglevel,
            performance_ema_alpha=performance_ema_alpha,
            start=True,
            **(tracker_opts or {}),
        )
        try:
            self._make_averagers(
                optimizer=optimizer,
                params=params,
                scheduler=scheduler,
                use_local_updates=use_local_updates,
                reuse_grad_buffers=reuse_grad_buffers,
                grad_compression=grad_compression,
                grad_averager_factory=grad_averager_factory,
                state_averaging_compression=state_averaging_compression,
                load_state_compression=load_state_compression,
                average_opt_statistics=average_opt_statistics,
                extra_tensors=extra_tensors,
                performance_ema_alpha=performance_ema_alpha,
                averager_opts=dict(averager_opts or {}),
            )
        except BaseException:
            self.tracker.shutdown(timeout=1.0)
            if getattr(self, "state_averager", None) is not None:
                self.state_averager.shutdown()
            raise
        self.epochs = EpochMachinery(
            run_id=run_id,
            tracker=self.tracker,
            state_averager=self.state_averager,
            client_mode=client_mode,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            load_state_timeout=load_state_timeout,
            catch_up_without_state=True,
            status_loglevel=self.status_loglevel,
        )
        self._schema = self._parameter_schema()
        # time from the start of an epoch transition to the state averaging call, so that
        # the state round can be scheduled ahead too
        self.delay_before_state_averaging = PerformanceEMA(alpha=performance_ema_alpha)
        # torch.amp's GradScaler looks at this: with reused buffers it must not unscale
        # the accumulated gradients at every local step (see GradScaler)
        self._step_supports_amp_scaling = reuse_grad_buffers
        try:
            self.epochs.start_metrics(dht, metrics, self._collect_metrics)
        except BaseException:
            self.shutdown()
            raise
        self._initialized = True

    # ------------------------------------------------------------------ construction

    def _make_averagers(
        self,
        *,
        optimizer: Any,
        params: Any,
        scheduler: Any,
        use_local_updates: bool,
        reuse_grad_buffers: bool,
        grad_compression: CompressionBase,
        grad_averager_factory: GradientAveragerFactory | None,
        state_averaging_compression: CompressionBase,
        load_state_compression: CompressionBase,
        average_opt_statistics: Sequence[str],
        extra_tensors: Sequence[torch.Tensor],
        performance_ema_alpha: float,
        averager_opts: dict,
    ) -> None:
        """The state averager and, unless with local updates, the gradient averager."""
        # with a gradient averager, bans act there only (offenders.without_bans)
        state_opts = averager_opts if use_local_updates else without_bans(averager_opts)
        self.state_averager = TrainingStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            delta_rule_averaging=use_local_updates and self.delay_state_averaging,
            compression=state_averaging_compression,
            state_compression=load_state_compression,
            average_opt_statistics=average_opt_statistics,
            extra_tensors=extra_tensors,
            performance_ema_alpha=performance_ema_alpha,
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            next_chunk_timeout=self.next_chunk_timeout,
            shutdown_timeout=self.shutdown_timeout,
            status_loglevel=self.status_loglevel,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **state_opts,
        )
        self.grad_averager: GradientAverager | None = None
        if not use_local_updates:
            self.grad_averager = self._make_gradient_averager(
                grad_averager_factory,
                reuse_grad_buffers=reuse_grad_buffers,
                compression=grad_compression,
                **averager_opts,
            )
            # a peer banned for its gradients does not pull our parameters either
            self.state_averager.follow_bans_of(self.grad_averager)

    def _make_gradient_averager(self, factory: Any, **kwargs: Any) -> GradientAverager:
        factory = factory if factory is not None else GradientAverager
        averaged_grads = None
        if self.offload_optimizer:
            # the offloaded master copy's .grad buffers receive the average directly
            averaged_grads = [p.grad for p in optimizer_parameters(self.state_averager.optimizer)]
        try:
            return factory(
                self.state_averager.main_parameters,
                dht=self.dht,
                prefix=f"{self.run_id}_grad_averager",
                min_matchmaking_time=self.matchmaking_time,
                allreduce_timeout=self.allreduce_timeout,
                next_chunk_timeout=self.next_chunk_timeout,
                shutdown_timeout=self.shutdown_timeout,
                client_mode=self.client_mode,
                auxiliary=self.auxiliary,
                averaged_grads=averaged_grads,
                start=True,
                **kwargs,
            )
        except ValidationError:
            raise
        except Exception as e:
            raise ValidationError(f"grad_averager_factory raised {type(e).__name__}: {e}") from e

    def _parameter_schema(self) -> tuple:
        return tuple(
            (tuple(p.shape), p.dtype) for p in optimizer_parameters(self.state_averager.optimizer)
        )

    # ------------------------------------------------------------------ torch.optim API

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (over the offloaded copy when offloading)."""
        return self.state_averager.optimizer

    @property
    def defaults(self) -> dict:
        return self.state_averager.optimizer.defaults

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's param groups, with the model's own parameters in them."""
        groups, offset = [], 0
        main = self.state_averager.main_parameters
        for group in self.state_averager.optimizer.param_groups:
            count = len(group["params"])
            groups.append({**group, "params": list(main[offset : offset + count])})
            offset += count
        return groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        if getattr(self, "_initialized", False):
            raise ValidationError("param_groups of a swarmgrad Optimizer cannot be replaced")

    @property
    def state(self) -> dict:
        return dict(self.state_averager.optimizer.state, local_epoch=self.local_epoch)

    @state.setter
    def state(self, value: Any) -> None:
        if getattr(self, "_initialized", False):
            raise ValidationError("the state of a swarmgrad Optimizer cannot be replaced")

    def add_param_group(self, param_group: dict) -> None:
        raise ValidationError(
            "a swarmgrad Optimizer cannot add parameter groups after creation (every peer "
            "must average the same tensors): give all groups at construction"
        )

    def state_dict(self) -> dict:
        state_dict = self.state_averager.optimizer.state_dict()
        state_dict["state"]["local_epoch"] = self.local_epoch
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = {**state_dict, "state": dict(state_dict["state"])}
        epoch = state_dict["state"].pop("local_epoch", None)
        self.state_averager.optimizer.load_state_dict(state_dict)
        if epoch is not None:
            self.epochs.set_epoch(epoch)
        self.state_averager._update_scheduler()
        self.state_averager.state_version += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (refused with ``reuse_grad_buffers``: there the
        gradient buffers are the accumulators, cleared at each epoch)."""
        if self.grad_averager is not None and self.grad_averager.reuse_grad_buffers:
            raise ValidationError(
                "with reuse_grad_buffers=True the .grad buffers accumulate across steps: "
                "do not call zero_grad, the Optimizer clears them at each epoch"
            )
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.detach_()
                    param.grad.zero_()

    # ------------------------------------------------------------------ progress

    @property
    def local_epoch(self) -> int:
        """This peer's epoch: the number of global updates it has taken part in or
        caught up with."""
        return self.state_averager.local_epoch

    @property
    def local_progress(self) -> LocalTrainingProgress:
        return self.tracker.local_progress

    @property
    def use_local_updates(self) -> bool:
        return self.grad_averager is None

    @property
    def use_gradient_averaging(self) -> bool:
        return self.grad_averager is not None

    def is_alive(self) -> bool:
        return self.state_averager.is_alive()

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm."""
        return self.epochs.is_synchronized()

    @property
    def metrics(self) -> MetricsPublisher | None:
        """This peer's metrics record for ``swarmgrad monitor`` (None with metrics=False)."""
        epochs = getattr(self, "epochs", None)
        return None if epochs is None else epochs.metrics

    @property
    def _closed(self) -> bool:
        epochs = getattr(self, "epochs", None)
        return True if epochs is None else epochs.closed

    # ------------------------------------------------------------------ step

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: GradScaler | None = None,
    ) -> Any:
        """Account for one local batch (its gradients are in the parameters' ``.grad``)
        and, when the swarm has reached ``target_batch_size``, move to the next epoch:
        average, update, maybe average the state. Returns the closure's loss."""
        if self._closed:
            raise ValidationError(f"this {type(self).__name__} was shut down")
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise ValidationError(
                "grad_scaler must be a swarmgrad.GradScaler (torch's does not know that "
                "gradients are accumulated across steps)"
            )
        if self.auxiliary and (
            closure is not None or batch_size is not None or grad_scaler is not None
        ):
            raise ValidationError(
                "an auxiliary peer computes nothing: call step() without arguments"
            )
        if batch_size is None and not self.auxiliary:
            batch_size = self.batch_size_per_step
            if batch_size is None:
                raise ValidationError(
                    "pass batch_size to step() or batch_size_per_step to the Optimizer"
                )
        elif batch_size is not None:
            positive_int("batch_size", batch_size)
        self._raise_group_error()

        self.state_averager.step(apply_delayed_updates=True)  # a finished background update
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if is_scalar_loss(loss):
                self.epochs.report_loss(loss)

        if not self.auxiliary and self.epochs.should_load_state():
            logger.log(self.status_loglevel, "%s: behind the swarm, loading its state", self.run_id)
            self.load_state_from_peers()
            return loss  # these gradients were computed on stale parameters

        if self.auxiliary and self.tracker.global_epoch > self.local_epoch:
            self._follow_the_swarm()
        if self.use_gradient_averaging:
            if not self.auxiliary and not self._accumulate(batch_size, grad_scaler):
                return loss
            self._maybe_schedule_gradient_averaging()
            self._maybe_schedule_state_averaging()
        elif not self.auxiliary:
            if grad_scaler is not None:
                with grad_scaler.running_global_step():
                    grad_scaler.unscale_(self)
            samples = self.tracker.local_progress.samples_accumulated + batch_size
            self.tracker.report_local_progress(self.local_epoch, samples)
            self._maybe_schedule_state_averaging()
            self.state_averager.step(
                optimizer_step=True,
                delay_optimizer_step=self.delay_optimizer_step,
                grad_scaler=grad_scaler,
            )

        if self.tracker.ready_to_update_epoch:
            self._update_global_epoch(grad_scaler)
        return loss

    def report(self, loss: Any = None) -> None:
        """Tell the swarm's monitor this peer's training loss (a number or a one-element
        tensor); each metrics record carries the mean of the losses reported since the
        previous one. ``step(closure)`` reports the closure's loss itself. Does nothing
        when the Optimizer was made with ``metrics=False``."""
        self.epochs.report_loss(loss)

    def _collect_metrics(self) -> dict[str, Any]:
        """The fields of this peer's metrics record that the optimizer knows (called on
        the event loop thread by the MetricsPublisher)."""
        role = "auxiliary" if self.auxiliary else "client" if self.client_mode else "trainer"
        return training_fields(
            role,
            self.client_mode,
            self.local_epoch,
            self.tracker.performance_ema.samples_per_second,
            self._averagers(),
        )

    def _averagers(self) -> list[Any]:
        """Every averager of this optimizer, the state averager first."""
        return [a for a in (self.state_averager, self.grad_averager) if a is not None]

    def _accumulate(self, batch_size: int, grad_scaler: GradScaler | None) -> bool:
        """Add this batch's gradients; False (and a reset) if they are not finite."""
        assert self.grad_averager is not None
        if grad_scaler is not None and not grad_scaler.are_grads_finite(self):
            logger.log(
                self.status_loglevel, "%s: non-finite fp16 gradients, resetting", self.run_id
            )
            self.tracker.report_local_progress(self.local_epoch, 0)
            self.grad_averager.reset_accumulated_grads_()
            return False
        self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(
            self.local_epoch, self.grad_averager.local_samples_accumulated
        )
        return True

    def _update_global_epoch(self, grad_scaler: GradScaler | None) -> None:
        """Average gradients and/or state, step, and move to the next epoch."""
        if self._parameter_schema() != self._schema:
            raise ValidationError(
                "the optimizer's parameters changed shape or dtype during training; every "
                "peer of a run must keep the same tensors"
            )
        self.epochs.look_again_if_alone()
        began = time.perf_counter()
        with self.tracker.pause_updates():
            wait_for_trigger = None
            if self.use_gradient_averaging:
                logger.log(self.status_loglevel, "%s: epoch %d ends", self.run_id, self.local_epoch)
                if self.delay_optimizer_step:
                    self.state_averager.step(wait_for_delayed_updates=True)
                control = self._begin_averaging_gradients(grad_scaler)
                if control is None:
                    self._load_local_gradients()
                elif self.delay_grad_averaging:
                    wait_for_trigger = partial(self._finish_averaging_gradients, control)
                else:
                    self._finish_averaging_gradients(control)

            next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
            # the count is frozen while the epoch ends; a read since may show the others
            # gone (a state round would then wait out its timeout for nobody)
            swarm_not_empty = (
                self.tracker.global_progress.num_peers > 1 and not self.tracker.others_left()
            )
            if not swarm_not_empty:
                # nor wait below for an earlier epoch's state round still looking for them
                self.state_averager.drop_round_without_group()
            # every peer of the swarm started this epoch with our state and applies the
            # same averaged gradients: a state round would move bytes and change nothing
            states_equal, self._states_equal = self._states_equal, False
            average_state = (
                swarm_not_empty
                and next_epoch % self.average_state_every == 0
                and not self.state_averager.averaging_in_progress
                and not states_equal
            )
            if states_equal:
                logger.debug("%s: states equal across the swarm, no state round", self.run_id)
            state_control = self.scheduled_state if average_state else None
            if state_control is not None and (state_control.triggered or state_control.done()):
                state_control = None
            if average_state:
                self.delay_before_state_averaging.update(
                    task_size=1, interval=time.perf_counter() - began
                )
            optimizer_step = not self.auxiliary and self.use_gradient_averaging
            self.state_averager.step(
                increment_epoch=True,
                wait_for_trigger=wait_for_trigger,
                optimizer_step=optimizer_step,
                delay_optimizer_step=self.delay_optimizer_step and optimizer_step,
                grad_scaler=grad_scaler,
                averaging_round=average_state,
                delay_averaging=self.delay_state_averaging and not self.auxiliary,
                averaging_control=state_control,
                averaging_opts={"timeout": self.averaging_timeout} if average_state else None,
            )
            if self.scheduled_state is not None and self.scheduled_state is not state_control:
                self._release(self.scheduled_state)
            self.scheduled_state = None

            self.epochs.enter_epoch(self.state_averager.local_epoch)
            if self.use_gradient_averaging and not self.auxiliary:
                assert self.grad_averager is not None
                self.grad_averager.reset_accumulated_grads_()
            logger.log(self.status_loglevel, "%s: now at epoch %d", self.run_id, self.local_epoch)
        if self.epochs.left_behind and not self.delay_grad_averaging and not self.auxiliary:
            # our update used our own gradients while the swarm used its average: take
            # the swarm's state now, before the next batch is computed on ours
            self.load_state_from_peers()

    def _begin_averaging_gradients(self, grad_scaler: GradScaler | None) -> StepControl | None:
        """Release this epoch's gradient round (scheduled earlier, or now); None if there
        is nobody to average with."""
        assert self.grad_averager is not None
        if grad_scaler is not None:
            with grad_scaler.running_global_step():
                grad_scaler.unscale_(self)
        control = self.scheduled_grads
        self.scheduled_grads = None
        tag = self._gradient_round_tag()
        if control is not None and (control.triggered or control.done()):
            control = None  # used up (e.g. by a state download meanwhile)
        if control is not None and control.round_tag != tag:
            control.cancel()  # scheduled for an epoch this peer has left (a download)
            control = None
        if self.tracker.global_progress.num_peers <= 1:
            if control is not None:
                control.cancel()
            return None
        self._result_before_round = self.grad_averager.last_result
        try:
            return self.grad_averager.step(
                control=control,
                reset_accumulators=False,
                wait=False,
                timeout=self.averaging_timeout,
                **(
                    {}
                    if control is not None
                    else {
                        "round_tag": tag,
                        "gather": self._digest_of_this_epoch(),
                    }
                ),
            )
        except Exception as e:
            logger.warning("%s: could not start averaging gradients: %r", self.run_id, e)
            if control is not None and not control.done():
                control.cancel()
            return None

    def _finish_averaging_gradients(self, control: StepControl) -> None:
        """Wait for the gradient round; on failure use the local gradients."""
        assert self.grad_averager is not None
        # who must have averaged without us for our state to be the odd one out: after a
        # round that found nobody, any peer at our epoch; after a round that failed (a
        # member died), only peers already past it (the others fell back as we did, and
        # the next state round brings everyone together without a download)
        ahead_of = self.local_epoch - 1
        try:
            gathered = self.epochs.wait_for_round(control, self.local_epoch, "gradient round")
        except GroupMismatch as e:
            self._group_error = e  # our tensors are not the run's: the user must know
            gathered, ahead_of = None, None
        except BaseException as e:
            logger.log(self.status_loglevel, "%s: averaging gradients failed: %r", self.run_id, e)
            if not control.done():
                control.cancel()
            gathered, ahead_of = None, self.local_epoch
        if gathered:
            logger.log(
                self.status_loglevel,
                "%s: averaged gradients with %d peers",
                self.run_id,
                len(gathered),
            )
            self._states_equal = self._round_left_states_equal(gathered)
        else:
            if ahead_of is not None and self._peers_ahead_of(
                ahead_of, fresh=ahead_of == self.local_epoch
            ):
                # peers at our epoch (or beyond) averaged without us: their state is the
                # swarm's; peers behind us (paused, slow) are no reason to go back
                logger.log(
                    self.status_loglevel,
                    "%s: no group for epoch %d although peers are training: will load "
                    "their state after this update",
                    self.run_id,
                    self.local_epoch,
                )
                self.epochs.mark_left_behind()
            # The buffers hold this peer's mean gradient (loaded before the round began),
            # or whole spans of the average where a failed round got that far: either is
            # a fair gradient. Not reloaded from the accumulators, which may already hold
            # the next epoch's gradients when this runs in the background.
            logger.log(self.status_loglevel, "%s: proceeding with local gradients", self.run_id)
        self._use_averaged_gradients()

    def _peers_ahead_of(self, epoch: int, *, fresh: bool) -> int:
        """Live peers past ``epoch``. After a failed round the question is whether the
        others finished our epoch a moment ago, which a stale read would miss (a joiner
        then stepped on its own gradients and began the next epoch apart): read the
        swarm again, within matchmaking_time."""
        if not fresh:
            return self.tracker.peers_ahead_of(epoch, refresh=False)
        try:
            return self.tracker.peers_ahead_of(epoch, timeout=self.matchmaking_time)
        except Exception as e:
            logger.debug("%s: reading progress failed: %r", self.run_id, e)
            return self.tracker.peers_ahead_of(epoch, refresh=False)

    def _round_left_states_equal(self, gathered: dict) -> bool:
        """Do all peers of the swarm hold the same state after this round? Only if every
        one of them was in it with the digest of our state as it is now (a digest sent
        before a background state round changed our state is stale), and the round
        averaged every span from every member (a span kept local differs across peers).
        A peer that judges otherwise runs a state round; peers that judged equal wrongly
        see different digests in the next epoch's round and run one then."""
        mine = self._digest_of_this_epoch()
        if mine is None or len(gathered) < self.tracker.global_progress.num_peers:
            return False
        if any(digest != mine for digest in gathered.values()):
            return False
        result = self.grad_averager.last_result if self.grad_averager is not None else None
        return (
            result is not None
            and result is not self._result_before_round
            and result.fully_averaged
            and not result.deadline_exceeded
        )

    def _use_averaged_gradients(self) -> None:
        """Put the averaged gradients where the optimizer reads them."""
        assert self.grad_averager is not None
        if not self.offload_optimizer:  # else they already are in the optimizer's .grad
            params = optimizer_parameters(self.state_averager.optimizer)
            with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
                for param, grad in zip(params, averaged, strict=True):
                    if param.grad is None:
                        param.grad = grad.clone().to(param.device)
                    else:
                        param.grad.copy_(grad)
        self.grad_averager.notify_used_averaged_gradients()

    def _load_local_gradients(self) -> None:
        """No round averaged anything: step on this peer's own mean gradient."""
        assert self.grad_averager is not None
        logger.log(self.status_loglevel, "%s: proceeding with local gradients", self.run_id)
        self.grad_averager.load_accumulators_into_averager_()
        self._use_averaged_gradients()

    def _maybe_schedule_gradient_averaging(self) -> None:
        """If the epoch ends within matchmaking_time, start looking for its group now."""
        assert self.grad_averager is not None
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if eta > self.matchmaking_time:
            return
        control = self.scheduled_grads
        if control is None or control.triggered or control.done():
            eta = max(eta, self.grad_averager._options["min_matchmaking_time"])
            self.scheduled_grads = self.grad_averager.schedule_step(
                scheduled_time=get_dht_time() + eta,
                timeout=self.averaging_timeout,
                round_tag=self._gradient_round_tag(),
                gather=self._digest_of_this_epoch(),
            )

    def _digest_of_this_epoch(self) -> bytes | None:
        """This epoch's state digest, shared in the gradient round's gather (None when
        states are not compared). In synchronous mode the state changes during an epoch
        only when a background state round or a download is applied (which bumps the
        state version), so it is computed once per epoch and version."""
        if not self._compare_states:
            return None
        key = (self.local_epoch, self.state_averager.state_version)
        if self._state_digest is None or self._state_digest[0] != key:
            self._state_digest = (key, self.state_averager.state_digest())
        return self._state_digest[1]

    def _gradient_round_tag(self) -> str:
        """Gradients of one epoch are averaged only with gradients of the same epoch: a
        peer that ends an epoch after the others moved on (a late joiner, a slow peer)
        would otherwise join their next round and mix stale gradients into it."""
        return f"epoch{self.local_epoch}"

    def _maybe_schedule_state_averaging(self) -> None:
        """Likewise for the state round of the coming epoch, if it averages the state."""
        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        if next_epoch % self.average_state_every != 0:
            return
        if self.state_averager.averaging_in_progress:
            return
        if self.delay_before_state_averaging.num_updates == 0:
            return  # no measurement yet of how long an epoch transition takes
        estimated = (
            self.tracker.estimated_next_update_time
            + self.delay_before_state_averaging.ema_seconds_per_sample
            + self.state_averager.delay_before_averaging.ema_seconds_per_sample
        )
        eta = estimated - get_dht_time()
        if eta > self.matchmaking_time:
            return
        control = self.scheduled_state
        if control is None or control.triggered or control.done():
            eta = max(eta, self.state_averager._options["min_matchmaking_time"])
            self.scheduled_state = self.state_averager.schedule_step(
                scheduled_time=get_dht_time() + eta,
                gather=next_epoch,
                timeout=self.averaging_timeout,
            )

    # ------------------------------------------------------------------ staying in sync

    def _follow_the_swarm(self) -> None:
        """An auxiliary peer has no state worth keeping: it moves to the swarm's epoch,
        so that its rounds carry the epoch the trainers' rounds carry."""
        logger.log(
            self.status_loglevel, "%s: auxiliary, moving to epoch %d", self.run_id,
            self.tracker.global_epoch,
        )  # fmt: skip
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self.scheduled_grads.cancel()
        self.scheduled_grads = None
        with self.tracker.pause_updates():
            self.epochs.enter_epoch(self.tracker.global_epoch, offer_state=False)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Download the freshest state of the run and continue from it (retried until
        ``load_state_timeout``; :meth:`.EpochMachinery.load_state`)."""
        self._prepare_for_download()
        self.epochs.load_state(after=self._continue_after_download, **kwargs)

    def _prepare_for_download(self) -> None:
        """Rounds in flight go ahead without this peer's contribution; a delayed update
        finishes before the state it applies to is replaced."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)

    def _continue_after_download(self) -> None:
        """Gradients accumulated on the old parameters are dropped."""
        self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
        if self.use_gradient_averaging:
            assert self.grad_averager is not None
            self.grad_averager.reset_accumulated_grads_()

    def _tag_along_with_zero_weight(self, control: StepControl) -> None:
        """Let a scheduled round go ahead without our contribution (cancelling it would
        make the group's other members search again)."""
        if not control.triggered:
            control.weight = 0
            control.allow_allreduce()
        try:
            control.result(self.averaging_timeout)
        except BaseException as e:
            logger.debug("%s: a round we tagged along failed: %r", self.run_id, e)
            if not control.done():
                control.cancel()

    def _release(self, control: StepControl) -> None:
        if control.cancel_if_ungrouped() or control.done():
            return
        self._tag_along_with_zero_weight(control)

    def _raise_group_error(self) -> None:
        error, self._group_error = self._group_error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Say goodbye, finish pending work and leave (idempotent)."""
        if not self.epochs.begin_shutdown():
            return
        logger.log(self.status_loglevel, "%s: leaving", self.run_id)
        self.epochs.say_goodbye(self.shutdown_timeout)
        if self.state_averager.drop_round_without_group():
            logger.log(self.status_loglevel, "%s: dropped a state round with no group", self.run_id)
        self.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        for control in (self.scheduled_grads, self.scheduled_state):
            if control is not None:
                self._release(control)
        self.scheduled_grads = self.scheduled_state = None
        self.epochs.close([self.grad_averager])

    def _shutdown_when_collected(self) -> None:
        """What ``__del__`` does with an optimizer nobody shut down."""
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_parent_pid", None) == os.getpid() and not self._closed:
            try:
                self._shutdown_when_collected()
            except Exception:  # interpreter shutdown: nothing left to talk to
                pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_id={self.run_id!r}, epoch={self.local_epoch})"


def _check_modes(
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
