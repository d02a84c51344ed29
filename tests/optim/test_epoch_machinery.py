"""The epoch machinery that Optimizer and DiLoCoOptimizer share: the one rule for when a
peer loads the swarm's state, tested as a function, on a machinery driven by a stand-in
tracker, and on real optimizers (a peer restored ahead of the swarm keeps its epoch)."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.optim.epoch_machinery import EpochMachinery, must_load_state
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.optim import dht_swarm, make_model, make_optimizer

epochs = st.integers(min_value=0, max_value=10**6)


@given(local=epochs, swarm=epochs, fresh=st.booleans())
def test_a_peer_loads_state_only_when_behind_never_when_ahead(local, swarm, fresh):
    decision = must_load_state(local, swarm, fresh_read=fresh)
    if local >= swarm:
        assert not decision  # ahead or level: nothing newer to download
    elif fresh:
        assert decision  # a read of this epoch: any epoch behind is behind
    else:
        assert decision == (local < swarm - 1)  # the others may have just moved


def test_the_rule_at_the_boundaries():
    assert must_load_state(3, 4, fresh_read=True)
    assert not must_load_state(3, 4, fresh_read=False)
    assert must_load_state(2, 4, fresh_read=False)
    assert not must_load_state(5, 4, fresh_read=True)  # `!=` would have sent it back


class _Tracker:
    """The part of ProgressTracker the machinery reads, with the swarm's epoch and the
    answers of reads set by the test."""

    def __init__(self, global_epoch: int = 0, peers_ahead: int = 0):
        self.global_epoch = global_epoch
        self.peers_ahead = peers_ahead
        self.fetched_global_progress_this_epoch = threading.Event()
        self.global_progress = SimpleNamespace(num_peers=2)
        self.published: list[int] = []
        self.distrusted: list[int] = []

    @contextlib.contextmanager
    def pause_updates(self):
        yield

    def update_epoch(self, new_epoch: int) -> int:
        self.published.append(new_epoch)
        self.global_epoch = max(self.global_epoch, new_epoch)
        self.fetched_global_progress_this_epoch.clear()
        return new_epoch

    def peers_ahead_of(self, epoch: int, timeout=None, *, refresh=True) -> int:
        return self.peers_ahead

    def distrust_epochs_above(self, epoch: int) -> None:
        self.distrusted.append(epoch)
        self.global_epoch = epoch


class _StateAverager:
    def __init__(self, local_epoch: int = 0, donor_epoch: int | None = None):
        self.local_epoch = local_epoch
        self.donor_epoch = donor_epoch
        self.state_sharing_priority = None
        self.scheduler_updates = 0

    def load_state_from_peers(self, timeout=None, **kwargs):
        if self.donor_epoch is None:
            return None
        self.local_epoch = self.donor_epoch
        return ({}, [])

    def _update_scheduler(self) -> None:
        self.scheduler_updates += 1


def _machinery(tracker, averager, *, catch_up=True, client_mode=False) -> EpochMachinery:
    return EpochMachinery(
        run_id="run",
        tracker=tracker,
        state_averager=averager,
        client_mode=client_mode,
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        load_state_timeout=0.5,
        catch_up_without_state=catch_up,
    )


def test_one_epoch_behind_counts_on_the_first_fresh_read_of_an_epoch_only():
    tracker, averager = _Tracker(global_epoch=4), _StateAverager(local_epoch=3)
    machinery = _machinery(tracker, averager)
    assert not machinery.should_load_state()  # no read of this epoch yet
    tracker.fetched_global_progress_this_epoch.set()
    assert machinery.should_load_state()  # the once-per-epoch check
    assert not machinery.should_load_state()  # used up until the next epoch
    machinery.enter_epoch(3)
    tracker.fetched_global_progress_this_epoch.set()
    assert machinery.should_load_state()  # armed again by the epoch move


def test_a_round_that_found_the_others_gone_ahead_asks_for_state_at_once():
    tracker, averager = _Tracker(global_epoch=3), _StateAverager(local_epoch=3)
    machinery = _machinery(tracker, averager)
    machinery.mark_left_behind()
    assert machinery.should_load_state() and machinery.left_behind
    machinery.load_state()  # no donor, nobody ahead: gives up at once
    assert not machinery.left_behind and not machinery.should_load_state()


def test_a_download_one_epoch_old_catches_up_only_where_the_optimizer_allows_it():
    for catch_up, expected in ((True, 5), (False, 4)):
        tracker, averager = _Tracker(global_epoch=5), _StateAverager(1, donor_epoch=4)
        machinery = _machinery(tracker, averager, catch_up=catch_up)
        machinery.load_state()
        assert machinery.local_epoch == expected
        assert tracker.published[-1] == expected
        assert averager.state_sharing_priority == expected  # offered to joiners
        assert averager.scheduler_updates == (1 if catch_up else 0)
        assert tracker.distrusted == []


def test_claims_no_donor_can_back_are_distrusted_and_client_peers_offer_nothing():
    tracker, averager = _Tracker(global_epoch=9), _StateAverager(1, donor_epoch=4)
    machinery = _machinery(tracker, averager, client_mode=True)
    machinery.load_state()
    assert tracker.distrusted == [4] and machinery.local_epoch == 4
    assert averager.state_sharing_priority is None


def test_load_state_gives_up_after_its_timeout_while_peers_stay_ahead():
    tracker, averager = _Tracker(global_epoch=2, peers_ahead=1), _StateAverager(0)
    machinery = _machinery(tracker, averager, catch_up=False)
    calls = []
    machinery.load_state(after=lambda: calls.append(averager.local_epoch))
    assert calls == [0] and machinery.local_epoch == 0
    assert tracker.distrusted == [0]  # two epochs ahead and no donor: not backed


def test_a_peer_restored_ahead_of_the_swarm_keeps_its_epoch_and_publishes_it():
    """load_state_dict of a later checkpoint: the tracker counts the restored epoch at
    once, and the peer is not sent back to the swarm's older state (the `!=` rule did)."""
    with dht_swarm(1) as (dht,):
        model = make_model(seed=0)
        opt = make_optimizer(dht, model, run_id="restored")
        try:
            saved = opt.state_dict()
            saved["state"]["local_epoch"] = 5
            opt.load_state_dict(saved)
            assert opt.local_epoch == 5 and opt.tracker.global_epoch == 5
            assert opt.tracker.local_progress.epoch == 5
            opt.tracker.refresh(timeout=5)
            assert opt.tracker.fetched_global_progress_this_epoch.is_set()
            assert not opt.epochs.should_load_state()
            assert opt.is_synchronized_with_peers()
        finally:
            opt.shutdown()


class _WaitingTracker(_Tracker):
    def __init__(self, peers_ahead: int = 0, others_left: bool = False):
        super().__init__(peers_ahead=peers_ahead)
        self._others_left = others_left
        self.fetch_requests = 0

    def others_left(self) -> bool:
        return self._others_left

    def request_fetch(self) -> None:
        self.fetch_requests += 1


def _looking(stage: AveragingStage = AveragingStage.LOOKING_FOR_GROUP) -> StepControl:
    control = StepControl(scheduled_time=0.0, weight=1.0, round_tag="epoch3")
    control._set_stage(stage)
    return control


def test_a_round_looking_for_a_group_is_given_up_once_peers_moved_on_or_left():
    for tracker in (_WaitingTracker(peers_ahead=1), _WaitingTracker(others_left=True)):
        machinery = _machinery(tracker, _StateAverager(3))
        control = _looking()
        assert machinery.wait_for_round(control, 3) is None
        assert control.cancelled()


def test_a_peer_ahead_may_still_join_the_round_within_a_matchmaking_time():
    """With delay_grad_averaging a peer enters epoch 4 while its round for epoch 3 looks
    for its group in the background: a round of epoch 3 that sees it ahead keeps looking
    for a matchmaking time from then, and the group that forms meanwhile is averaged
    with. (An ALBERT trainer gave its round up 0.3 s after its partner's began, and, with
    a wait counted from its own start, 0.2 s before their group formed: both rounds
    failed and the next epoch waited out a state round's search, 4.5 s.)"""
    tracker = _WaitingTracker(peers_ahead=1)
    machinery = _machinery(tracker, _StateAverager(3))
    machinery.averaging_timeout, machinery.matchmaking_time = 5.0, 1.0
    control = _looking()
    timer = threading.Timer(0.6, control.set_result, args=({"peer": b"digest"},))
    timer.start()
    assert machinery.wait_for_round(control, 3) == {"peer": b"digest"}
    assert not control.cancelled()

    control = _looking()  # nobody comes: given up after the matchmaking time, well
    began = time.monotonic()  # before the averaging timeout (which would raise)
    assert machinery.wait_for_round(control, 3) is None
    assert control.cancelled()
    assert time.monotonic() - began >= 1.0


def test_a_background_state_round_is_given_up_only_once_every_other_peer_left():
    """wait_until_alone: slower peers of the epoch may still join a state round, so peers
    that moved on are no reason to give it up; every other peer gone is."""
    machinery = _machinery(_WaitingTracker(others_left=True), _StateAverager(3))
    control = _looking()
    assert machinery.wait_until_alone(control, 3, "state round") is None
    assert control.cancelled()

    machinery = _machinery(_WaitingTracker(peers_ahead=1), _StateAverager(3))
    machinery.averaging_timeout = 1.5
    control = _looking()
    timer = threading.Timer(0.8, control.set_result, args=({"peer": b"digest"},))
    timer.start()
    assert machinery.wait_until_alone(control, 3, "state round") == {"peer": b"digest"}
    assert not control.cancelled()


def test_a_round_already_averaging_is_waited_for_and_its_result_returned():
    tracker = _WaitingTracker(peers_ahead=1)  # peers ahead do not matter any more
    machinery = _machinery(tracker, _StateAverager(3))
    control = _looking(AveragingStage.RUNNING_ALLREDUCE)
    timer = threading.Timer(0.4, control.set_result, args=({"peer": b"digest"},))
    timer.start()
    assert machinery.wait_for_round(control, 3) == {"peer": b"digest"}


def test_a_round_that_outlasts_the_averaging_timeout_raises_and_asks_for_a_read():
    tracker = _WaitingTracker()
    machinery = _machinery(tracker, _StateAverager(3))
    machinery.averaging_timeout, machinery.matchmaking_time = 1.0, 0.3
    control = _looking()
    with pytest.raises(TimeoutError, match=r"gradient round took over 1\.0 s"):
        machinery.wait_for_round(control, 3, "gradient round")
    assert tracker.fetch_requests == 1  # no group within a matchmaking time: read again


def test_a_partial_read_showing_nobody_else_is_no_reason_to_give_a_round_up():
    """DiLoCo reads two replicas: a live peer's record may be missing from such a read."""
    tracker = _WaitingTracker(others_left=True)
    tracker.read_quorum = 2
    machinery = _machinery(tracker, _StateAverager(3))
    machinery.averaging_timeout = 0.6
    control = _looking()
    with pytest.raises(TimeoutError):
        machinery.wait_for_round(control, 3)
    assert not control.cancelled()


def test_a_round_looks_for_its_group_within_matchmaking_time_of_its_due_time_once():
    machinery = _machinery(_Tracker(), _StateAverager())  # matchmaking_time=1.0
    averager = SimpleNamespace(_options={"min_matchmaking_time": 0.5})
    now = get_dht_time()
    assert machinery.round_start(None, now + 30.0, averager) is None  # too early to look
    assert machinery.round_start(None, now + 0.9, averager) == pytest.approx(now + 0.9, abs=0.1)
    # due sooner than the averager needs to find a group: it gets its min_matchmaking_time
    assert machinery.round_start(None, now, averager) == pytest.approx(now + 0.5, abs=0.1)
    waiting = _looking()
    assert machinery.round_start(waiting, now + 0.9, averager) is None  # that round is it
    waiting.cancel()
    assert machinery.round_start(waiting, now + 0.9, averager) is not None  # a new one
