"""``DiLoCoOptimizer``: train across slow links by averaging rarely (DiLoCo, Streaming DiLoCo).

Every peer trains its own copy of the model with an *inner* optimizer (AdamW, say) for
many steps without talking to anyone. At each *outer step* the peers average their
pseudo-gradients, ``theta_sync - theta_local`` (how far each one moved since the last
sync), and an *outer* optimizer (Nesterov SGD by default) applies the average to
``theta_sync``; everyone continues from the result. With H inner steps per sync the
swarm talks H times less often than gradient averaging would (DiLoCo, Douillard et al.
2023; OpenDiLoCo ran it over hivemind).

::

    opt = swarmgrad.DiLoCoOptimizer(
        dht=dht, run_id="lm", batch_size=32, num_inner_steps=500,
        inner_optimizer=lambda params: torch.optim.AdamW(params, lr=4e-4),
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9,
                                                       nesterov=True),
        params=model.parameters())
    for batch in data:
        loss_fn(model, batch).backward()
        opt.step()          # an inner step; every ~500 steps per peer: the outer step
        opt.zero_grad()

**When the swarm syncs.** The epoch clock is the
:class:`~.progress_tracker.ProgressTracker`'s, through the same
:class:`~.epoch_machinery.EpochMachinery` as :class:`~.optimizer.Optimizer` (of which
this is a subclass): the outer step comes when the swarm has processed
``num_inner_steps x batch_size x (number of peers)`` samples since the last one, or
``target_batch_size`` if given, so all peers sync at once.

**Streaming** (``num_fragments=F > 1``, Streaming DiLoCo, Douillard et al. 2025): the
parameters are cut into F fragments synchronised at staggered points of the epoch
(:class:`~.fragment_schedule.FragmentSchedule`), in the background while inner steps go
on, their writes paced (``fragment_pace``) so that the swarm's peak bandwidth is about F
times lower; a finished fragment is merged as ``alpha x local + (1 - alpha) x synced``
(``fragment_merge_alpha``). **Compression**: ``grad_compression`` encodes the
pseudo-gradients, a lossy codec's rounding error is added to the next one (error
feedback). **Joiners and failures**: the synced copy, the outer optimizer's state and the
epoch are shared with joiners; rounds are tagged with epoch and fragment; a round that
fails or finds nobody leaves this peer its own pseudo-gradient; a non-finite one is sent
with weight 0. ``docs/slow-links.md`` and ``docs/design-notes.md`` ("Streaming DiLoCo")
hold the measurements behind these choices.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from swarmgrad.averaging.allreduce.pacing import SendPacer
from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.robust.offenders import without_bans
from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.compression import CompressionBase, NoCompression
from swarmgrad.compression.base import CompressionInfo
from swarmgrad.dht.dht import DHT
from swarmgrad.net.identity import PeerID
from swarmgrad.optim.diloco_setup import (
    check_diloco_arguments,
    compression_residuals,
    default_outer_optimizer,
    make_inner_optimizer,
    make_scheduler,
)
from swarmgrad.optim.fragment_schedule import (
    FragmentSchedule,
    fragment_send_rate,
    split_into_fragments,
)
from swarmgrad.optim.optimizer import Optimizer
from swarmgrad.optim.optimizer_state import optimizer_parameters
from swarmgrad.optim.progress_tracker import ProgressTracker
from swarmgrad.optim.state_averager import TrainingStateAverager
from swarmgrad.optim.tensor_digest import TensorDigest
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["DiLoCoOptimizer", "split_into_fragments"]

logger = logging.getLogger(__name__)

#: rounds that shutdown() finishes: their group formed and this peer released them
_AVERAGING_STAGES = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)


#: replicas a DiLoCo peer's progress read merges (ProgressTracker's read_quorum): its
#: epochs are long, so a slightly older read costs nothing, and full reads were most of
#: a streaming peer's DHT traffic
DILOCO_READ_QUORUM = 2


class _Fragment:
    """One fragment: its parameters, its averager and its round in flight."""

    def __init__(self, index: int, params: list[int], averager: DecentralizedAverager):
        self.index, self.params, self.averager = index, params, averager
        self.residuals: list[torch.Tensor] | None = None  # error feedback
        self.scheduled: StepControl | None = None
        self.running: StepControl | None = None  # launched, not applied yet
        self.running_epoch = -1
        self.synced_epoch = -1  # the last epoch whose round was launched
        self.counted_result: Any = None  # the last round whose paced bytes were counted


class DiLoCoOptimizer(Optimizer):
    """See the module docstring. Arguments: ``dht``, ``run_id`` (peers with the same id
    train together), ``batch_size`` (samples per :meth:`step`), ``num_inner_steps`` (H),
    ``inner_optimizer`` (a factory ``callable(params)`` with ``params``, or a ready
    optimizer over the model's parameters), ``outer_optimizer`` (a factory over the
    synced copy; default Nesterov SGD lr 0.7 momentum 0.9), ``params``, ``scheduler`` (a
    factory ``callable(inner_optimizer)``, stepped at every inner step),
    ``target_batch_size`` (sync every this many swarm samples instead of H x batch x
    peers), ``num_fragments``, ``fragment_merge_alpha`` and ``fragment_pace`` (streaming),
    ``grad_compression`` (pseudo-gradients on the wire), ``error_feedback`` (default:
    when the codec is lossy), ``matchmaking_time``, ``averaging_timeout``,
    ``load_state_timeout``, ``load_state_compression``, ``client_mode`` (default: the
    DHT's), ``averager_opts``, ``tracker_opts``, ``verbose``, ``metrics`` (as for
    :class:`~.optimizer.Optimizer`: this peer's metrics record for ``swarmgrad monitor``;
    the loss goes in with :meth:`report`).
    """

    #: every inner step is a real step: swarmgrad's GradScaler unscales at each one
    _unscale_every_step = True

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        batch_size: int,
        num_inner_steps: int,
        inner_optimizer: Any,
        outer_optimizer: Callable[[Any], torch.optim.Optimizer] = default_outer_optimizer,
        params: Any = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        target_batch_size: int | None = None,
        num_fragments: int = 1,
        fragment_merge_alpha: float = 0.5,
        fragment_pace: float | None = 0.5,
        grad_compression: CompressionBase = NoCompression(),
        error_feedback: bool | None = None,
        matchmaking_time: float = 15.0,
        averaging_timeout: float = 60.0,
        load_state_timeout: float = 600.0,
        load_state_compression: CompressionBase = NoCompression(),
        client_mode: bool | None = None,
        averager_opts: dict | None = None,
        tracker_opts: dict | None = None,
        verbose: bool = False,
        metrics: bool | dict = True,
    ):
        check_diloco_arguments(
            dht=dht,
            run_id=run_id,
            batch_size=batch_size,
            num_inner_steps=num_inner_steps,
            outer_optimizer=outer_optimizer,
            target_batch_size=target_batch_size,
            num_fragments=num_fragments,
            fragment_merge_alpha=fragment_merge_alpha,
            fragment_pace=fragment_pace,
            timeouts={
                "matchmaking_time": matchmaking_time,
                "averaging_timeout": averaging_timeout,
                "load_state_timeout": load_state_timeout,
            },
        )
        self.inner_optimizer = make_inner_optimizer(inner_optimizer, params)
        main_params = optimizer_parameters(self.inner_optimizer)
        self.scheduler = make_scheduler(scheduler, self.inner_optimizer)

        self.dht, self.run_id = dht, run_id
        self.client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self.batch_size, self.num_inner_steps = batch_size, num_inner_steps
        self.fixed_target = target_batch_size
        self.fragment_merge_alpha = float(fragment_merge_alpha)
        self.fragment_pace = None if fragment_pace is None else float(fragment_pace)
        self._pacer: SendPacer | None = None
        self._last_epoch_length = 0.0
        # (bytes written, values averaged) of this peer's last paced rounds
        self._round_bytes: collections.deque[tuple[int, int]] = collections.deque(
            maxlen=num_fragments
        )
        self.matchmaking_time, self.averaging_timeout = float(matchmaking_time), averaging_timeout
        self.load_state_timeout = float(load_state_timeout)
        self.grad_compression = grad_compression
        self.error_feedback = (
            not isinstance(grad_compression, NoCompression)
            if error_feedback is None
            else bool(error_feedback)
        )
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        self.schedule = FragmentSchedule(num_fragments)
        self._restart_epoch_count()
        self._resync = False  # a round showed that synced copies differ across peers
        self._state_offer_pending = False  # the epoch's state is declared once it is whole
        # what the Optimizer's shared methods read: DiLoCo's inner steps are local updates
        self.auxiliary, self.grad_averager, self.shutdown_timeout = False, None, 1.0
        self._parent_pid = os.getpid()

        averager_opts = dict(averager_opts or {})
        self.tracker = ProgressTracker(
            dht,
            run_id,
            self._target(1),
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **{"read_quorum": DILOCO_READ_QUORUM, **(tracker_opts or {})},
        )
        self.fragments: list[_Fragment] = []
        try:
            self.state_averager = TrainingStateAverager(
                dht=dht,
                prefix=f"{run_id}_outer_state",
                optimizer=outer_optimizer,
                params=main_params,
                offload_optimizer=True,
                custom_gradients=True,
                state_compression=load_state_compression,
                min_matchmaking_time=self.matchmaking_time,
                status_loglevel=self.status_loglevel,
                client_mode=self.client_mode,
                start=True,
                **without_bans(averager_opts),  # the fragments' averagers ban
            )
            self._make_fragments(num_fragments, averager_opts)
            self.epochs = self._make_epoch_machinery(catch_up_without_state=False)
            self.epochs.start_metrics(dht, metrics, self._collect_metrics)
        except BaseException:
            self._shutdown_parts()
            raise
        self.main_parameters = tuple(main_params)
        self._masters = tuple(optimizer_parameters(self.state_averager.optimizer))

    def _make_fragments(self, num_fragments: int, averager_opts: dict) -> None:
        """One averager per fragment, over the synced copy's .grad (the pseudo-gradient)."""
        masters = optimizer_parameters(self.state_averager.optimizer)
        sizes = [p.numel() for p in masters]
        for index, members in enumerate(split_into_fragments(sizes, num_fragments)):
            averager = DecentralizedAverager(
                [masters[i].grad for i in members],
                self.dht,
                prefix=f"{self.run_id}_outer_grads{index}",
                compression=self.grad_compression,
                min_matchmaking_time=self.matchmaking_time,
                client_mode=self.client_mode,
                allow_state_sharing=False,
                start=True,
                **averager_opts,
            )
            self.fragments.append(_Fragment(index, members, averager))
            # a re-average of the copies leaves out whoever a fragment's averager banned
            self.state_averager.follow_bans_of(averager)

    # ------------------------------------------------------------------ torch API

    @property
    def param_groups(self) -> list[dict]:
        return self.inner_optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.inner_optimizer.state

    @property
    def defaults(self) -> dict:
        return self.inner_optimizer.defaults

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.state_averager.optimizer

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The inner optimizer (``optimizer=`` in DiLoCo mode)."""
        return self.inner_optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "synced": [m.detach().clone() for m in self._masters],
            "epoch": self.local_epoch,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or not {"inner", "outer", "synced", "epoch"} <= set(
            state_dict
        ):
            raise ValidationError(
                "a DiLoCoOptimizer state_dict has the keys inner, outer, synced and epoch"
            )
        synced = state_dict["synced"]
        if len(synced) != len(self._masters):
            raise ValidationError(
                f"the state_dict has {len(synced)} synced tensors, the model {len(self._masters)}"
            )
        for index, (mine, theirs) in enumerate(zip(self._masters, synced, strict=True)):
            if mine.shape != theirs.shape:
                raise ValidationError(
                    f"parameter {index} is {list(theirs.shape)} in the state_dict but "
                    f"{list(mine.shape)} here"
                )
        self.inner_optimizer.load_state_dict(state_dict["inner"])
        self.outer_optimizer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for mine, theirs in zip(self._masters, synced, strict=True):
                mine.copy_(theirs)
        self.epochs.set_epoch(state_dict["epoch"])

    # ------------------------------------------------------------------ stepping

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None):
        """One inner step; the outer step (or a fragment's sync) when the swarm is due."""
        if self._closed:
            raise ValidationError("this DiLoCoOptimizer was shut down")
        if batch_size is not None:
            positive_int("batch_size", batch_size)
        loss = self.epochs.run_closure(closure)
        self._apply_finished_fragments(wait=False)
        if self._state_offer_pending:
            self._offer_state()
        if self.epochs.should_load_state():
            logger.log(self.status_loglevel, "%s: behind the swarm, loading its state", self.run_id)
            self.load_state_from_peers()
            return loss

        self.inner_optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.samples_since_sync += batch_size or self.batch_size
        self.tracker.report_local_progress(self.local_epoch, self.samples_since_sync)
        self.tracker.target_batch_size = self._target(self.tracker.global_progress.num_peers)

        self._sync_due_fragments()
        if self.tracker.ready_to_update_epoch:
            self._outer_step()
        return loss

    def _launched(self) -> list[int]:
        return [fragment.synced_epoch for fragment in self.fragments]

    def _sync_due_fragments(self) -> None:
        """Launch the fragments the schedule says are due; seek groups for the rest."""
        epoch, progress = self.local_epoch, self._epoch_fraction()
        due = self.schedule.due_now(epoch, progress, self._launched())
        if due and self.epochs.alone() and self.epochs.look_again_if_alone():
            # the target grew with the peers found: the fragments may not be due yet
            self.tracker.target_batch_size = self._target(self.tracker.global_progress.num_peers)
            progress = self._epoch_fraction()
            due = self.schedule.due_now(epoch, progress, self._launched())
        for index in due:
            self._launch(self.fragments[index])
        for index, due_fraction in self.schedule.upcoming(epoch, self._launched()):
            self._maybe_schedule(self.fragments[index], fraction=due_fraction)

    def _target(self, num_peers: int) -> int:
        if self.fixed_target is not None:
            return self.fixed_target
        return self.num_inner_steps * self.batch_size * max(1, num_peers)

    def _restart_epoch_count(self, epoch_length: float | None = None) -> None:
        now = get_dht_time()
        if epoch_length is not None:  # for pacing the next epoch's fragments
            self._last_epoch_length = epoch_length
        self.samples_since_sync = 0
        self._epoch_began = now

    def _epoch_fraction(self) -> float:
        """How much of the epoch is done: the samples counted in the last read, or the
        swarm's extrapolated samples if further (counted samples lag; the extrapolation
        is the same for every reader, unlike the time since this peer's epoch began)."""
        if self.tracker.ready_to_update_epoch:
            return 1.0
        progress = self.tracker.global_progress
        counted = max(progress.samples_accumulated, progress.samples_at(get_dht_time()))
        return min(1.0, counted / max(1, self.tracker.target_batch_size))

    def _due_time(self, fraction: float) -> float:
        """DHT time at which the swarm's extrapolated samples reach ``fraction`` of the
        epoch (inf before any rate is known), computed against the current target, which
        grows as peers are found."""
        progress = self.tracker.global_progress
        if progress.samples_per_second <= 0:
            return math.inf
        missing = fraction * max(1, self.tracker.target_batch_size) - progress.samples_estimated
        return progress.estimated_at + missing / progress.samples_per_second

    def _maybe_schedule(self, fragment: _Fragment, fraction: float) -> None:
        """Start matchmaking ``matchmaking_time`` before the fragment's sync is due."""
        if fragment.scheduled is not None:
            # peers counted since it was scheduled are waited for too
            fragment.scheduled.expected_group_size = self._expected_group_size()
            return
        if fragment.synced_epoch >= self.local_epoch:
            return
        if fragment.running is not None:
            return  # its previous round is still in flight
        progress, target = self.tracker.global_progress, self.tracker.target_batch_size
        now = get_dht_time()
        to_epoch_end = max(0.0, self.tracker.estimated_next_update_time - now)
        remaining = max(0.0, fraction * target - progress.samples_accumulated)
        left_in_epoch = max(1.0, target - progress.samples_accumulated)
        eta = to_epoch_end * min(1.0, remaining / left_in_epoch)  # the swarm's speed is steady
        # the launch goes by extrapolated samples too: matchmaking must not start later
        eta = min(eta, max(0.0, self._due_time(fraction) - now))
        if eta > self.matchmaking_time:
            return
        # peers' estimates of the due time differ: a streaming leader waits half a
        # matchmaking time past its own for the peers it lacks, and begins as soon as it
        # has all the swarm counts (plain DiLoCo's round blocks the outer step: no wait)
        slack = self.matchmaking_time / 2 if len(self.fragments) > 1 else 0.0
        fragment.scheduled = fragment.averager.step(
            scheduled_time=now + max(eta, 0.5) + slack,
            require_trigger=True,
            wait=False,
            timeout=self.averaging_timeout,
            round_tag=self.schedule.round_tag(self.local_epoch, fragment.index),
            gather=self._synced_digest(fragment),
            expected_group_size=self._expected_group_size(),
            leader_hint=self._leader_hint(fragment),
        )

    def _offer_state(self) -> None:
        """Declare this epoch's state to joiners once no round of an earlier epoch is
        still running (a joiner that downloaded before those merged would hold another
        copy of their fragments)."""
        if self.client_mode:
            return
        self._state_offer_pending = any(
            fragment.running is not None and fragment.running_epoch < self.local_epoch
            for fragment in self.fragments
        )
        if not self._state_offer_pending:
            self.state_averager.state_sharing_priority = self.local_epoch

    def _leader_hint(self, fragment: _Fragment) -> PeerID | None:
        """The leader of the latest fragment group this round should join directly
        (:meth:`.FragmentSchedule.leader_sources`), sparing the DHT the control traffic;
        None when no such group is known: then matchmaking goes through the DHT."""
        for index, tag_epoch in self.schedule.leader_sources(self.local_epoch, fragment.index):
            last = self.fragments[index].averager.last_group
            if last is not None and last[0] == self.schedule.round_tag(tag_epoch, index):
                return last[1]
        return None

    def _expected_group_size(self) -> int | None:
        """The peers the swarm counts (None: fewer than 2), for a round to begin with."""
        num_peers = self.tracker.global_progress.num_peers
        return num_peers if num_peers >= 2 else None

    def _launch(self, fragment: _Fragment) -> None:
        """Write this fragment's pseudo-gradient and release its round (in the background)."""
        if fragment.running is not None:
            self._apply_fragment(fragment, fragment.running)
        weight = self._write_pseudo_gradient(fragment)
        control = fragment.scheduled
        fragment.scheduled = None
        tag = self.schedule.round_tag(self.local_epoch, fragment.index)
        if control is not None and (control.done() or control.round_tag != tag):
            control.cancel()
            control = None
        if control is not None:
            control.expected_group_size = self._expected_group_size()
        fragment.synced_epoch = fragment.running_epoch = self.local_epoch
        if self.tracker.global_progress.num_peers <= 1:
            if control is not None:
                control.cancel()
            self._apply_fragment(fragment, control=None)  # alone: our own pseudo-gradient
            return
        if control is None:
            control = fragment.averager.step(
                scheduled_time=get_dht_time() + 0.5,
                require_trigger=True,
                wait=False,
                timeout=self.averaging_timeout,
                round_tag=tag,
                gather=self._synced_digest(fragment),
                expected_group_size=self._expected_group_size(),
                leader_hint=self._leader_hint(fragment),
            )
        control.weight = weight
        rate = self._fragment_send_rate()
        if rate is not None:  # one pacer for all fragments: rounds that overlap share it
            if self._pacer is None:
                self._pacer = SendPacer(rate)
            self._pacer.rate = rate
        control.send_pacer = self._pacer if rate is not None else None
        logger.log(
            self.status_loglevel,
            "%s: fragment %d of epoch %d released, its writes paced to %s",
            self.run_id,
            fragment.index,
            self.local_epoch,
            "full speed" if rate is None else f"{rate / 1e3:.1f} kB/s",
        )
        control.allow_allreduce()
        fragment.running = control

    def _fragment_send_rate(self) -> float | None:
        """Streaming: the rate that spreads a fragment's round over ``fragment_pace`` of
        the time until the next fragment is due (None: full speed), one rate for every
        fragment from the model's mean fragment (:func:`.fragment_send_rate`)."""
        if self.fragment_pace is None or len(self.fragments) == 1:
            return None
        num_peers = self.tracker.global_progress.num_peers
        # the longer of the swarm's estimate and the last epoch (estimates grow later)
        epoch_length = max(
            self.tracker.estimated_next_update_time - self._epoch_began, self._last_epoch_length
        )
        if not 0 < epoch_length < math.inf:  # no swarm ETA yet (epoch 0): our own pace
            own_rate = self.tracker.performance_ema.samples_per_second
            epoch_length = self.num_inner_steps * self.batch_size / own_rate if own_rate else 0
        payload = 0.0
        for index, master in enumerate(self._masters):
            info = CompressionInfo.from_tensor(master, key=index)
            ratio = self.grad_compression.estimate_compression_ratio(info)
            payload += master.numel() * master.element_size() * ratio
        return fragment_send_rate(
            payload_bytes=payload / len(self.fragments),
            num_peers=num_peers,
            window=self.schedule.pacing_window(epoch_length, self.fragment_pace),
            measured_bytes=self._measured_bytes_per_round(),
            timeout=self.averaging_timeout if self.averaging_timeout else 60.0,
        )

    def _measured_bytes_per_round(self) -> float | None:
        """What the mean fragment's round writes through the pacer, per value, from the
        last epoch's worth of rounds (None: none finished yet): the codec's estimate
        cannot know what deflate saves."""
        if not self._round_bytes:
            return None
        sent = sum(b for b, _ in self._round_bytes)
        values = sum(n for _, n in self._round_bytes)
        total = sum(master.numel() for master in self._masters)
        return sent / values * total / len(self.fragments)

    def _count_round_bytes(self, fragment: _Fragment) -> None:
        result = fragment.averager.last_result
        if result is not None and result is not fragment.counted_result and result.paced_bytes:
            fragment.counted_result = result
            numel = sum(self._masters[index].numel() for index in fragment.params)
            self._round_bytes.append((result.paced_bytes, numel))

    def _synced_digest(self, fragment: _Fragment) -> bytes:
        """A hash of this fragment's synced copy, shared in its round: members whose
        copies differ (a round that split the swarm into groups that averaged apart)
        see it and re-average their synced copies (:meth:`_resync_if_needed`)."""
        digest = TensorDigest()
        with torch.no_grad(), self.state_averager.state_lock():
            digest.update_tensors(self._masters[index] for index in fragment.params)
        return digest.digest()

    def _write_pseudo_gradient(self, fragment: _Fragment) -> float:
        """master.grad = synced - local (+ the residual of the last lossy round); returns
        this peer's weight (0 when the pseudo-gradient is not finite)."""
        with torch.no_grad(), fragment.averager.get_tensors() as grads:
            deltas = [
                self._masters[i].detach() - self.main_parameters[i].detach().to("cpu")
                for i in fragment.params
            ]
            if not all(bool(torch.isfinite(d).all()) for d in deltas):
                logger.warning(
                    "%s: this peer's pseudo-gradient has NaN or Inf values: it takes the "
                    "others' average and contributes nothing",
                    self.run_id,
                )
                for grad in grads:
                    grad.zero_()
                return 0.0
            if self.error_feedback and fragment.residuals is not None:
                for delta, residual in zip(deltas, fragment.residuals, strict=True):
                    delta.add_(residual)
            for grad, delta in zip(grads, deltas, strict=True):
                grad.copy_(delta)
            if self.error_feedback:
                fragment.residuals = compression_residuals(
                    self.grad_compression, deltas, fragment.params
                )
        return float(self.samples_since_sync)

    def _apply_finished_fragments(self, wait: bool) -> None:
        for fragment in self.fragments:
            if fragment.running is not None and (wait or fragment.running.done()):
                self._apply_fragment(fragment, fragment.running)

    def _apply_fragment(self, fragment: _Fragment, control: StepControl | None) -> None:
        """Wait for the fragment's round (``control``; None: no round, alone), then the
        outer step on the fragment and the merge into the model."""
        fragment.running = None
        gathered = None
        if control is not None:
            try:
                gathered = self.epochs.wait_for_round(control, fragment.running_epoch)
            except BaseException as e:
                logger.log(self.status_loglevel, "%s: averaging failed: %r", self.run_id, e)
                if not control.done():
                    control.cancel()
            self._count_round_bytes(fragment)
        if gathered:
            logger.log(
                self.status_loglevel,
                "%s: fragment %d of epoch %d averaged with %d peers",
                self.run_id,
                fragment.index,
                fragment.running_epoch,
                len(gathered),
            )
            digests = {
                bytes(d) if isinstance(d, bytes | bytearray) else None for d in gathered.values()
            }
            if len(digests) > 1:
                logger.warning(
                    "%s: the synced copies of fragment %d differ across the group (an "
                    "earlier round split the swarm): re-averaging them after this step",
                    self.run_id,
                    fragment.index,
                )
                self._resync = True
        else:
            logger.log(
                self.status_loglevel,
                "%s: fragment %d of epoch %d averaged with nobody: own pseudo-gradient",
                self.run_id,
                fragment.index,
                fragment.running_epoch,
            )
            if self.tracker.peers_ahead_of(fragment.running_epoch, refresh=False):
                # the others averaged this epoch without us and moved on: load their
                # state now rather than at the next once-per-epoch check
                self.epochs.mark_left_behind()
        members = set(fragment.params)
        with torch.no_grad(), self.state_averager.state_lock():
            saved = [m.grad for m in self._masters]
            for index, master in enumerate(self._masters):
                if index not in members:
                    master.grad = None  # the outer optimizer skips the other fragments
            try:
                self.outer_optimizer.step()
            finally:
                for master, grad in zip(self._masters, saved, strict=True):
                    master.grad = grad
            streaming = len(self.fragments) > 1
            alpha = self.fragment_merge_alpha if streaming else 0.0
            for index in fragment.params:
                main, synced = self.main_parameters[index], self._masters[index]
                merged = synced.to(main.device)
                if alpha:
                    merged = alpha * main.detach() + (1 - alpha) * merged
                main.copy_(merged)

    def _resync_if_needed(self) -> None:
        """Average the synced copies with the peers that saw the same difference in the
        same round, reset the outer optimizer's statistics, and continue from there.
        Every member of that round saw the same gathered digests, so all of them come
        here together."""
        if not self._resync:
            return
        self._resync = False
        self.state_averager.step(
            averaging_round=True,
            delay_averaging=False,
            averaging_opts={"timeout": self.averaging_timeout},
        )
        with torch.no_grad(), self.state_averager.state_lock():
            # the outer optimizer's statistics (Nesterov's momentum) differ as much as
            # the copies did, and would pull them apart again at the next outer step:
            # every member of the re-average starts them afresh
            self.outer_optimizer.state.clear()
            for main, synced in zip(self.main_parameters, self._masters, strict=True):
                main.copy_(synced.to(main.device))

    def _outer_step(self) -> None:
        """The epoch is due: sync the model (streaming: launch any fragment not launched
        yet), wait for the round (plain DiLoCo; streaming's rounds go on in the
        background), and move to the next epoch."""
        began = time.perf_counter()
        # the epoch's length for pacing ends here, before the wait for its rounds (with
        # it, slow rounds made slower pacing and slower rounds again)
        epoch_length = get_dht_time() - self._epoch_began
        self.epochs.look_again_if_alone()
        streaming = self.schedule.streaming
        with self.tracker.pause_updates():
            for index in self.schedule.left_for_outer_step(self.local_epoch, self._launched()):
                self._launch(self.fragments[index])
            # plain DiLoCo's one round is the outer step; streaming's rounds go on
            self._apply_finished_fragments(wait=not streaming)
            self._resync_if_needed()
            self.epochs.enter_epoch(self.local_epoch + 1, offer_state=False)
            self._restart_epoch_count(epoch_length=epoch_length)
            self._offer_state()
        logger.log(
            self.status_loglevel,
            "%s: outer step done in %.2f s, now at epoch %d",
            self.run_id,
            time.perf_counter() - began,
            self.local_epoch,
        )

    # ------------------------------------------------------------------ staying in sync

    def _prepare_for_download(self) -> None:
        """Rounds looking for a group are cancelled, rounds running are finished (the
        download then replaces what they merged). This peer's inner progress since its
        last sync is dropped with the state."""
        for fragment in self.fragments:
            if fragment.scheduled is not None:
                fragment.scheduled.cancel()
                fragment.scheduled = None
            if fragment.running is not None:
                self._apply_fragment(fragment, fragment.running)

    def _continue_after_download(self) -> None:
        self._restart_epoch_count()
        for fragment in self.fragments:
            fragment.residuals = None
            fragment.synced_epoch = self.schedule.after_download(self.local_epoch)

    def _averagers(self) -> list[Any]:
        return [self.state_averager, *(f.averager for f in self.fragments)]

    # ------------------------------------------------------------------ shutting down

    def shutdown(self, finish_rounds: bool = True) -> None:
        """Leave the swarm. Streaming rounds already averaging, or ended since the last
        step, are finished (within ``averaging_timeout``) and merged, since the outer
        step does not wait for them and the last sync would be lost; rounds still looking
        for a group are cancelled. ``finish_rounds=False``: cancel everything at once."""
        if not self.epochs.begin_shutdown():
            return
        for fragment in self.fragments:
            running = fragment.running
            if (
                finish_rounds
                and running is not None
                and (running.done() or running.stage in _AVERAGING_STAGES)
            ):
                try:
                    self._apply_fragment(fragment, running)
                except Exception as e:  # leaving anyway: the round's result is not needed
                    logger.warning("%s: could not finish fragment %d's round: %r",
                                   self.run_id, fragment.index, e)  # fmt: skip
            for control in (fragment.scheduled, fragment.running):
                if control is not None and not control.done():
                    control.cancel()
        self._shutdown_parts()

    def _shutdown_parts(self) -> None:
        epochs = getattr(self, "epochs", None)
        if epochs is not None:
            epochs.say_goodbye(timeout=1.0)
            epochs.close(f.averager for f in self.fragments)
            return
        self.tracker.shutdown(timeout=1.0)  # construction failed half-way
        for fragment in self.fragments:
            fragment.averager.shutdown()
        if getattr(self, "state_averager", None) is not None:
            self.state_averager.shutdown()

    def _shutdown_when_collected(self) -> None:
        self.shutdown(finish_rounds=False)

    def __repr__(self) -> str:
        return (
            f"DiLoCoOptimizer(run_id={self.run_id!r}, epoch={self.local_epoch}, "
            f"H={self.num_inner_steps}, fragments={len(self.fragments)})"
        )
