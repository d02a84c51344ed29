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

from swarmgrad.averaging.robust.offenders import without_bans
from swarmgrad.averaging.step_control import StepControl
from swarmgrad.compression import CompressionBase, NoCompression
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.epoch_machinery import EpochMachinery
from swarmgrad.optim.grad_averager import GradientAverager, GradientAveragerFactory
from swarmgrad.optim.grad_scaler import GradScaler
from swarmgrad.optim.gradient_rounds import GradientRounds, release
from swarmgrad.optim.metrics import MetricsPublisher, training_fields
from swarmgrad.optim.optimizer_setup import (
    check_arguments,
    check_modes,
    make_gradient_averager,
    make_state_averager,
)
from swarmgrad.optim.optimizer_state import optimizer_parameters
from swarmgrad.optim.performance_ema import PerformanceEMA
from swarmgrad.optim.progress import LocalTrainingProgress
from swarmgrad.optim.progress_tracker import ProgressTracker
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError

__all__ = ["Optimizer"]

logger = logging.getLogger(__name__)

#: Optimizer arguments that go to the state averager as they are
_STATE_AVERAGER_OPTIONS = (
    "optimizer",
    "params",
    "scheduler",
    "state_averaging_compression",
    "load_state_compression",
    "average_opt_statistics",
    "extra_tensors",
    "performance_ema_alpha",
)


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
    state averager follows, see :func:`~swarmgrad.averaging.robust.offenders.without_bans`),
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
        check_arguments(
            dht=dht,
            run_id=run_id,
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            average_state_every=average_state_every,
            timeouts={
                "matchmaking_time": matchmaking_time,
                "averaging_timeout": averaging_timeout,
                "allreduce_timeout": allreduce_timeout,
                "next_chunk_timeout": next_chunk_timeout,
                "load_state_timeout": load_state_timeout,
                "shutdown_timeout": shutdown_timeout,
            },
        )
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
        check_modes(
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
        self.scheduled_state: StepControl | None = None

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
        self._make_machinery()
        self._schema = self._parameter_schema()
        # time from the start of an epoch transition to the state averaging call, so that
        # the state round can be scheduled ahead too
        self.delay_before_state_averaging = PerformanceEMA(alpha=performance_ema_alpha)
        # torch.amp's GradScaler looks at this: with reused buffers it must not unscale
        # the accumulated gradients at every local step (see GradScaler)
        self._step_supports_amp_scaling = reuse_grad_buffers
        # ... and without them, its scaler.step(opt) unscales every step (as torch's does;
        # it used to only check, and the accumulators summed scaled gradients)
        self._unscale_every_step = not reuse_grad_buffers
        try:
            self.epochs.start_metrics(dht, metrics, self._collect_metrics)
        except BaseException:
            self.shutdown()
            raise
        self._initialized = True

    # ------------------------------------------------------------------ construction

    def _make_machinery(self) -> None:
        """The epoch machinery and, with a gradient averager, the gradient rounds."""
        self.epochs = self._make_epoch_machinery(catch_up_without_state=True)
        self.rounds: GradientRounds | None = None
        if self.grad_averager is not None:
            self.rounds = GradientRounds(
                run_id=self.run_id,
                averager=self.grad_averager,
                state_averager=self.state_averager,
                tracker=self.tracker,
                epochs=self.epochs,
                offload_optimizer=self.offload_optimizer,
                # synchronous mode: a state round among peers whose states are equal is
                # skipped (with delayed steps or as an auxiliary, states differ anyway)
                compare_states=not (self.delay_optimizer_step or self.auxiliary),
                matchmaking_time=self.matchmaking_time,
                averaging_timeout=self.averaging_timeout,
                status_loglevel=self.status_loglevel,
            )

    def _make_averagers(self, *, use_local_updates: bool, averager_opts: dict, **options: Any):
        """The state averager and, unless with local updates, the gradient averager
        (:mod:`.optimizer_setup`)."""
        common = {
            "dht": self.dht,
            "run_id": self.run_id,
            "matchmaking_time": self.matchmaking_time,
            "allreduce_timeout": self.allreduce_timeout,
            "next_chunk_timeout": self.next_chunk_timeout,
            "shutdown_timeout": self.shutdown_timeout,
            "client_mode": self.client_mode,
            "auxiliary": self.auxiliary,
        }
        # with a gradient averager, bans act there only (offenders.without_bans)
        state_opts = averager_opts if use_local_updates else without_bans(averager_opts)
        self.state_averager = make_state_averager(
            **common,
            offload_optimizer=self.offload_optimizer,
            # with local updates nothing averages into the offloaded .grad: each step
            # copies the model's gradients there
            custom_gradients=self.offload_optimizer and not use_local_updates,
            delta_rule_averaging=use_local_updates and self.delay_state_averaging,
            status_loglevel=self.status_loglevel,
            averager_opts=state_opts,
            **{k: options[k] for k in _STATE_AVERAGER_OPTIONS},
        )
        self.grad_averager: GradientAverager | None = None
        if not use_local_updates:
            self.grad_averager = make_gradient_averager(
                options["grad_averager_factory"],
                self.state_averager,
                **common,
                offload_optimizer=self.offload_optimizer,
                reuse_grad_buffers=options["reuse_grad_buffers"],
                compression=options["grad_compression"],
                averager_opts=averager_opts,
            )
            # a peer banned for its gradients does not pull our parameters either
            self.state_averager.follow_bans_of(self.grad_averager)

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
    def scheduled_grads(self) -> StepControl | None:
        """The gradient round scheduled for this epoch, if any (hivemind's attribute)."""
        rounds = getattr(self, "rounds", None)
        return None if rounds is None else rounds.scheduled

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
        if self.rounds is not None:
            self.rounds.raise_group_error()

        self.state_averager.step(apply_delayed_updates=True)  # a finished background update
        loss = self.epochs.run_closure(closure)

        if not self.auxiliary and self.epochs.should_load_state():
            logger.log(self.status_loglevel, "%s: behind the swarm, loading its state", self.run_id)
            self.load_state_from_peers()
            return loss  # these gradients were computed on stale parameters

        if self.auxiliary and self.tracker.global_epoch > self.local_epoch:
            self._follow_the_swarm()
        if self.use_gradient_averaging:
            if not self.auxiliary and not self._accumulate(batch_size, grad_scaler):
                return loss
            self.rounds.maybe_schedule()
            self._maybe_schedule_state_averaging()
        elif not self.auxiliary:
            # the scaler's part is done here, not in the step: a delayed step runs after
            # the user's scaler.update(), which must find these gradients unscaled
            finite = grad_scaler is None or grad_scaler.unscale_for_step(self)
            samples = self.tracker.local_progress.samples_accumulated + batch_size
            self.tracker.report_local_progress(self.local_epoch, samples)
            self._maybe_schedule_state_averaging()
            self.state_averager.step(
                optimizer_step=finite, delay_optimizer_step=self.delay_optimizer_step
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
        if grad_scaler is not None and not self.grad_averager.reuse_grad_buffers:
            # separate accumulators take each batch's gradient unscaled by the scale it was
            # computed with (hivemind unscales only the .grad buffers at the epoch's step,
            # which left these accumulators scaled: the update was `scale` times too big)
            self.grad_averager.accumulate_grads_(
                batch_size, grad_scale=float(grad_scaler.get_scale())
            )
        else:  # (a grad_averager_factory's class may take batch_size alone, as hivemind's)
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
                if grad_scaler is not None:
                    with grad_scaler.running_global_step():
                        grad_scaler.unscale_(self)
                control = self.rounds.begin()
                if control is None:
                    self.rounds.use_local()
                elif self.delay_grad_averaging:
                    wait_for_trigger = partial(self.rounds.finish, control)
                else:
                    self.rounds.finish(control)

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
            states_equal = self.rounds is not None and self.rounds.take_states_equal()
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
                averaging_opts=self._state_round_options(next_epoch) if average_state else None,
            )
            if self.scheduled_state is not None and self.scheduled_state is not state_control:
                release(self.scheduled_state, self.averaging_timeout, self.run_id)
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

    def _state_round_options(self, epoch: int) -> dict[str, Any]:
        """The state round's options: its timeout; a search for its group bounded by
        twice ``matchmaking_time`` past its scheduled time (room for a partner a little
        late), and by half the ``averaging_timeout``, not the whole timeout (peers busy in
        another round would otherwise hold this peer's next epoch back, until two peers
        alternate rounds for good: see ``TrainingStateAverager``'s ``search_timeout``),
        and ended early once every other peer has left; and a wait that gives the round
        up once every other peer has left (instead of waiting out the timeout for a group
        that can no longer form; a step, or a SIGTERM, waits for this round)."""
        search = min(2 * self.matchmaking_time, self.averaging_timeout / 2)
        return {
            "timeout": self.averaging_timeout,
            "search_timeout": search,
            "alone": self.epochs.others_left,
            "wait": partial(self.epochs.wait_until_alone, epoch=epoch, what="state round"),
        }

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
        start = self.epochs.round_start(self.scheduled_state, estimated, self.state_averager)
        if start is not None:
            self.scheduled_state = self.state_averager.schedule_step(
                scheduled_time=start,
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
        if self.rounds is not None:
            self.rounds.drop_scheduled("cancel")
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
        if self.rounds is not None:
            self.rounds.drop_scheduled("tag_along")
        self.state_averager.step(wait_for_delayed_updates=True)

    def _continue_after_download(self) -> None:
        """Gradients accumulated on the old parameters are dropped."""
        self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
        if self.use_gradient_averaging:
            assert self.grad_averager is not None
            self.grad_averager.reset_accumulated_grads_()

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
        if self.rounds is not None:
            self.rounds.drop_scheduled("release")
        if self.scheduled_state is not None:
            release(self.scheduled_state, self.averaging_timeout, self.run_id)
        self.scheduled_state = None
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

    def _make_epoch_machinery(self, *, catch_up_without_state: bool) -> EpochMachinery:
        """The epoch machinery over this optimizer's tracker and state averager. Only the
        catch-up rule differs between the optimizers: a plain Optimizer that downloaded a
        state one epoch old jumps to the swarm's epoch, DiLoCo loads again (its synced
        copy must equal every other peer's)."""
        return EpochMachinery(
            run_id=self.run_id,
            tracker=self.tracker,
            state_averager=self.state_averager,
            client_mode=self.client_mode,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            load_state_timeout=self.load_state_timeout,
            catch_up_without_state=catch_up_without_state,
            status_loglevel=self.status_loglevel,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_id={self.run_id!r}, epoch={self.local_epoch})"
