"""``GradientRounds``: the Optimizer's gradient round of each epoch, as one object.

A round is scheduled ``matchmaking_time`` before the epoch is due (so that the group is
formed when it ends), released when it ends, waited for, and its result put where the
optimizer reads it; a round that found nobody, or failed, leaves this peer its own
gradient. In synchronous mode the round also carries a digest of each member's state,
so that peers which all hold the same state after it skip the next state round
(:meth:`GradientRounds.left_states_equal`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from swarmgrad.averaging.allreduce import GroupMismatch
from swarmgrad.averaging.step_control import StepControl
from swarmgrad.optim.epoch_machinery import EpochMachinery
from swarmgrad.optim.grad_averager import GradientAverager
from swarmgrad.optim.optimizer_state import optimizer_parameters
from swarmgrad.optim.progress_tracker import ProgressTracker
from swarmgrad.optim.state_averager import TrainingStateAverager

__all__ = ["GradientRounds", "release", "tag_along_with_zero_weight"]

logger = logging.getLogger(__name__)


def tag_along_with_zero_weight(control: StepControl, timeout: float, run_id: str) -> None:
    """Let a scheduled round go ahead without our contribution (cancelling it would
    make the group's other members search again)."""
    if not control.triggered:
        control.weight = 0
        control.allow_allreduce()
    try:
        control.result(timeout)
    except BaseException as e:
        logger.debug("%s: a round we tagged along failed: %r", run_id, e)
        if not control.done():
            control.cancel()


def release(control: StepControl, timeout: float, run_id: str) -> None:
    """A round this peer no longer needs: cancelled if it has no group yet, otherwise
    finished without our contribution."""
    if control.cancel_if_ungrouped() or control.done():
        return
    tag_along_with_zero_weight(control, timeout, run_id)


class GradientRounds:
    """The gradient rounds of one Optimizer (module docstring). ``compare_states``: share
    state digests in the rounds (synchronous mode only: with local updates, delayed
    steps or as an auxiliary peer the states differ anyway)."""

    def __init__(
        self,
        *,
        run_id: str,
        averager: GradientAverager,
        state_averager: TrainingStateAverager,
        tracker: ProgressTracker,
        epochs: EpochMachinery,
        offload_optimizer: bool,
        compare_states: bool,
        matchmaking_time: float,
        averaging_timeout: float,
        status_loglevel: int,
    ):
        self.run_id, self.averager, self.state_averager = run_id, averager, state_averager
        self.tracker, self.epochs = tracker, epochs
        self.offload_optimizer, self.compare_states = offload_optimizer, compare_states
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.status_loglevel = status_loglevel
        self.scheduled: StepControl | None = None
        self.result_before_round: Any = None  # the averager's last result, before ours
        self._group_error: BaseException | None = None
        self._states_equal = False
        self._digest: tuple[tuple[int, int], bytes] | None = None  # ((epoch, version), digest)

    def round_tag(self) -> str:
        """Gradients are averaged only with gradients of the same epoch: a peer that ends
        an epoch after the others moved on would otherwise mix stale gradients into
        their next round."""
        return f"epoch{self.epochs.local_epoch}"

    # ------------------------------------------------------------------ before the end

    def maybe_schedule(self) -> None:
        """If the epoch ends within matchmaking_time, start looking for its group now."""
        due = self.tracker.estimated_next_update_time
        start = self.epochs.round_start(self.scheduled, due, self.averager)
        if start is not None:
            self.scheduled = self.averager.schedule_step(
                scheduled_time=start,
                timeout=self.averaging_timeout,
                round_tag=self.round_tag(),
                gather=self.digest(),
            )

    def drop_scheduled(self, how: str) -> None:
        """Give up the scheduled round: ``"cancel"`` it, ``"tag_along"`` (it goes ahead
        without us) or ``"release"`` (cancel if ungrouped, else tag along)."""
        control, self.scheduled = self.scheduled, None
        if control is None or (how != "release" and control.done()):
            return
        if how == "cancel":
            control.cancel()
        elif how == "tag_along":
            tag_along_with_zero_weight(control, self.averaging_timeout, self.run_id)
        else:
            release(control, self.averaging_timeout, self.run_id)

    # ------------------------------------------------------------------ at the end

    def begin(self) -> StepControl | None:
        """Release this epoch's round (scheduled earlier, or now); None if there is
        nobody to average with."""
        control, self.scheduled = self.scheduled, None
        tag = self.round_tag()
        if control is not None and (control.triggered or control.done()):
            control = None  # used up (e.g. by a state download meanwhile)
        if control is not None and control.round_tag != tag:
            control.cancel()  # scheduled for an epoch this peer has left (a download)
            control = None
        if self.epochs.alone():
            if control is not None:
                control.cancel()
            return None
        self.result_before_round = self.averager.last_result
        fresh = {} if control is not None else {"round_tag": tag, "gather": self.digest()}
        try:
            return self.averager.step(
                control=control,
                reset_accumulators=False,
                wait=False,
                timeout=self.averaging_timeout,
                **fresh,
            )
        except Exception as e:
            logger.warning("%s: could not start averaging gradients: %r", self.run_id, e)
            if control is not None and not control.done():
                control.cancel()
            return None

    def finish(self, control: StepControl) -> None:
        """Wait for the round; on failure use the local gradients. If peers at our epoch
        (or beyond) averaged without us, their state is the swarm's: the machinery is
        told that this peer was left behind."""
        epoch = self.epochs.local_epoch
        # who must have averaged without us for our state to be the odd one out: after
        # a round that found nobody, any peer at our epoch; after one that failed, only
        # peers already past it (the others fell back as we did)
        ahead_of: int | None = epoch - 1
        try:
            gathered = self.epochs.wait_for_round(control, epoch, "gradient round")
        except GroupMismatch as e:
            self._group_error = e  # our tensors are not the run's: the user must know
            gathered, ahead_of = None, None
        except BaseException as e:
            logger.log(self.status_loglevel, "%s: averaging gradients failed: %r", self.run_id, e)
            if not control.done():
                control.cancel()
            gathered, ahead_of = None, epoch
        if gathered:
            logger.log(
                self.status_loglevel,
                "%s: averaged gradients with %d peers", self.run_id, len(gathered),
            )  # fmt: skip
            self._states_equal = self.left_states_equal(gathered)
        else:
            if ahead_of is not None and self._peers_ahead_of(ahead_of, fresh=ahead_of == epoch):
                logger.log(
                    self.status_loglevel,
                    "%s: no group for epoch %d although peers are training: will load "
                    "their state after this update",
                    self.run_id,
                    epoch,
                )
                self.epochs.mark_left_behind()
            # the buffers hold our mean gradient, or whole spans of the average where a
            # failed round got that far: either is a fair gradient (not reloaded from the
            # accumulators, which may hold the next epoch's when this runs in background)
            logger.log(self.status_loglevel, "%s: proceeding with local gradients", self.run_id)
        self.use_averaged()

    def use_local(self) -> None:
        """No round averaged anything: step on this peer's own mean gradient."""
        logger.log(self.status_loglevel, "%s: proceeding with local gradients", self.run_id)
        self.averager.load_accumulators_into_averager_()
        self.use_averaged()

    def use_averaged(self) -> None:
        """Put the averaged gradients where the optimizer reads them."""
        if not self.offload_optimizer:  # else they already are in the optimizer's .grad
            params = optimizer_parameters(self.state_averager.optimizer)
            with torch.no_grad(), self.averager.get_tensors() as averaged:
                for param, grad in zip(params, averaged, strict=True):
                    if param.grad is None:
                        param.grad = grad.clone().to(param.device)
                    else:
                        param.grad.copy_(grad)
        self.averager.notify_used_averaged_gradients()

    def take_states_equal(self) -> bool:
        """Whether the last round left every peer with our state (then read as False)."""
        equal, self._states_equal = self._states_equal, False
        return equal

    def raise_group_error(self) -> None:
        error, self._group_error = self._group_error, None
        if error is not None:
            raise error

    def _peers_ahead_of(self, epoch: int, *, fresh: bool) -> int:
        """Live peers past ``epoch``; after a failed round read the swarm again (within
        matchmaking_time): a stale read misses others that finished a moment ago."""
        if not fresh:
            return self.tracker.peers_ahead_of(epoch, refresh=False)
        try:
            return self.tracker.peers_ahead_of(epoch, timeout=self.matchmaking_time)
        except Exception as e:
            logger.debug("%s: reading progress failed: %r", self.run_id, e)
            return self.tracker.peers_ahead_of(epoch, refresh=False)

    # ------------------------------------------------------------------ equal states

    def digest(self) -> bytes | None:
        """This epoch's state digest, shared in the round's gather (None when states are
        not compared); computed once per epoch and state version, since in synchronous
        mode only an applied state round or download changes the state in an epoch."""
        if not self.compare_states:
            return None
        key = (self.epochs.local_epoch, self.state_averager.state_version)
        if self._digest is None or self._digest[0] != key:
            self._digest = (key, self.state_averager.state_digest())
        return self._digest[1]

    def left_states_equal(self, gathered: dict) -> bool:
        """Do all peers of the swarm hold the same state after this round? Only if every
        one was in it with the digest of our state as it is now, and the round averaged
        every span from every member. A peer that judges wrongly sees different digests
        in the next epoch's round and runs a state round then."""
        mine = self.digest()
        if mine is None or len(gathered) < self.tracker.global_progress.num_peers:
            return False
        if any(digest != mine for digest in gathered.values()):
            return False
        result = self.averager.last_result
        return (
            result is not None
            and result is not self.result_before_round
            and result.fully_averaged
            and not result.deadline_exceeded
        )
