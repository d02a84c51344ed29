"""``StateKeeper``: a peer that trains nothing and holds the swarm's state at the swarm's
epoch, so that a swarm whose every trainer restarts at once resumes where it was.

::

    keeper = StateKeeper(dht=dht, run_id="my_run", target_batch_size=4096,
                         optimizer=lambda p: torch.optim.AdamW(p), params=model.parameters())
    while running:
        keeper.keep_up()          # one look at the swarm; cheap, call it often
        time.sleep(0.05)

A keeper that *downloads* the state after each epoch (hivemind's ALBERT monitor does)
always lags: the download starts once the epoch is over and takes time, during which the
trainers move on, so at any moment it holds an epoch or two before theirs, and those
epochs are lost if every trainer dies then. This one takes part in each epoch's gradient
round instead, as a member of weight 0 (it adds nothing to the average, and is ready
before the epoch ends, so it never delays the round), receives the swarm's averaged
gradient as the round ends, and applies it with the same optimizer as the trainers: it
reaches epoch ``E + 1`` in the same round as they do, holding their state bit for bit
(synchronous mode: every member of a round gets the same averaged bytes).

It steps only on a round that averaged everything and in which another member held its
state (the round's state digests, see :class:`~.gradient_rounds.GradientRounds`): it
then holds what that trainer holds at the next epoch. After any other round (a member
died mid-round; no member shares its state, e.g. the trainers averaged their states in a
state round, which the keeper takes no part in) it downloads the swarm's state as a
trainer left behind would, and it never claims an epoch whose state it does not hold (no
catching up without the state).

Synchronous mode only: with local updates, delayed steps or DiLoCo the trainers' states
are not a function of the averaged gradient alone; keep a plain :class:`~.optimizer.Optimizer`
there and download (``load_state_from_peers``).
"""

from __future__ import annotations

import logging
from typing import Any

from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.optim.epoch_machinery import EpochMachinery
from swarmgrad.optim.gradient_rounds import release
from swarmgrad.optim.optimizer import Optimizer
from swarmgrad.utils.errors import ValidationError

__all__ = ["StateKeeper"]

logger = logging.getLogger(__name__)

#: Optimizer options a keeper cannot honour: its state must follow the averaged gradient
_REFUSED = {
    "use_local_updates": "with local updates the trainers' states are their own steps",
    "auxiliary": "an auxiliary peer holds no state; a keeper exists to hold it",
    "delay_optimizer_step": "delayed steps apply each average an epoch late",
    "delay_grad_averaging": "delayed steps apply each average an epoch late",
    "grad_averager_factory": "it receives the plain averaged gradient",
    "outer_optimizer": "DiLoCo's state is the outer optimizer's",
}


class StateKeeper(Optimizer):
    """A collaborative :class:`~.optimizer.Optimizer` that holds the swarm's state without
    training (module docstring). It takes the Optimizer's arguments (``batch_size_per_step``
    is not needed) and refuses the modes in which it could not follow the trainers.
    Call :meth:`keep_up` often instead of ``step``. ``rounds_kept`` and ``downloads``
    count the epochs it entered by applying a round and the states it downloaded."""

    def __init__(self, **kwargs: Any):
        for name, why in _REFUSED.items():
            if kwargs.get(name):
                raise ValidationError(f"StateKeeper refuses {name}: {why}")
        self._before_round: Any = None  # the averager's last result when our round began
        self.rounds_kept = 0  # epochs entered by applying a round (not downloaded)
        self.downloads = 0
        super().__init__(**kwargs)

    def _make_epoch_machinery(self, *, catch_up_without_state: bool) -> EpochMachinery:
        # a keeper never claims an epoch whose state it does not hold: that state is what
        # a swarm of restarted trainers would resume from
        return super()._make_epoch_machinery(catch_up_without_state=False)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise ValidationError("a StateKeeper trains nothing: call keep_up() instead of step()")

    # ------------------------------------------------------------------ keeping up

    def keep_up(self) -> bool:
        """One look at the swarm: apply this epoch's round if it ended, download the
        state if this peer fell behind, or join the coming round. True when this peer
        moved to another epoch."""
        if self._closed:
            raise ValidationError("this StateKeeper was shut down")
        assert self.rounds is not None and self.grad_averager is not None
        control = self.rounds.scheduled
        if control is not None and control.done():
            self.rounds.scheduled = None
            if self._apply_round(control):
                return True
            control = None
        if control is not None and control.stage in (
            AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE,
        ):  # fmt: skip
            return False  # the round is under way: its result comes next
        if self.epochs.should_load_state():
            return self._download()
        if control is None:
            self._join_coming_round()
        return False

    def _join_coming_round(self) -> None:
        """Look for the group of the round that ends this epoch, ``matchmaking_time``
        ahead as trainers do, and release our part at once: zeros of weight 0 are known
        now, so the trainers never wait for the keeper."""
        if self.epochs.alone():
            return
        averager = self.grad_averager
        start = self.epochs.round_start(None, self.tracker.estimated_next_update_time, averager)
        if start is None:
            return  # too early to look for the group
        self._before_round = averager.last_result
        control = averager.schedule_step(
            scheduled_time=start,
            timeout=self.averaging_timeout,
            round_tag=self.rounds.round_tag(),
            gather=self.rounds.digest(),
        )
        averager.step(weight=0.0, control=control, reset_accumulators=False, wait=False)
        self.rounds.scheduled = control

    def _apply_round(self, control: StepControl) -> bool:
        """The round ended: step with its average if it is the swarm's update of our
        state; otherwise mark this peer behind (the next look downloads the state)."""
        epoch = self.local_epoch
        try:
            gathered = control.result(0)
        except BaseException as e:
            logger.log(self.status_loglevel, "%s: keeper's round failed: %r", self.run_id, e)
            gathered = None
        result = self.grad_averager.last_result
        mine = self.rounds.digest()
        # our state is a trainer's if another member's digest equals ours: after this
        # average it is what that trainer holds at the next epoch (when the trainers'
        # states differ, they average their states next, in a round the keeper is not in;
        # its next round then shows it alone with its digest, and it downloads)
        complete = (
            bool(gathered)
            and sum(digest == mine for digest in gathered.values()) >= 2
            and result is not None
            and result is not self._before_round
            and result.fully_averaged
            and not result.deadline_exceeded
        )
        if not complete:
            if gathered or self.tracker.peers_ahead_of(epoch, refresh=False):
                logger.log(
                    self.status_loglevel,
                    "%s: keeper's round for epoch %d was not the swarm's whole update of "
                    "its state: downloading the state", self.run_id, epoch,
                )  # fmt: skip
                self.epochs.mark_left_behind()
            return False
        with self.tracker.pause_updates():
            self.rounds.use_averaged()
            self.state_averager.step(increment_epoch=True, optimizer_step=True)
            self.epochs.enter_epoch(self.state_averager.local_epoch)
        self.rounds_kept += 1
        logger.log(
            self.status_loglevel, "%s: keeper applied the round of %d peers, now at epoch %d",
            self.run_id, len(gathered), self.local_epoch,
        )  # fmt: skip
        return True

    def _download(self) -> bool:
        epoch = self.local_epoch
        control, self.rounds.scheduled = self.rounds.scheduled, None
        if control is not None:
            release(control, self.averaging_timeout, self.run_id)
        logger.log(self.status_loglevel, "%s: keeper behind, loading the state", self.run_id)
        self.load_state_from_peers()
        self.downloads += 1
        return self.local_epoch != epoch
