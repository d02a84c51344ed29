"""DiLoCoOptimizer: fragments, the outer step's arithmetic, peers that sync together,
joiners, NaN pseudo-gradients, streaming and compressed pseudo-gradients, bad input."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import swarmgrad
from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.compression import Blockwise4BitQuantization, Uniform8BitQuantization
from swarmgrad.optim.diloco import DiLoCoOptimizer, split_into_fragments
from swarmgrad.optim.diloco_setup import compression_residuals
from swarmgrad.utils.errors import ValidationError
from tests.helpers.optim import (
    Trainer,
    dht_swarm,
    join,
    local_step,
    make_model,
    max_difference,
    snapshot,
    start_together,
    wait_until,
)

RUN = "diloco_run"


def make_diloco(dht, model, **options) -> DiLoCoOptimizer:
    options.setdefault("run_id", RUN)
    options.setdefault("batch_size", 8)
    options.setdefault("num_inner_steps", 5)
    options.setdefault("inner_optimizer", lambda params: torch.optim.SGD(params, lr=0.05))
    options.setdefault("matchmaking_time", 1.0)
    options.setdefault("averaging_timeout", 15.0)
    if "params" not in options and callable(options["inner_optimizer"]):
        options["params"] = model.parameters()
    return DiLoCoOptimizer(dht=dht, **options)


def shut_down_after_the_last_rounds(opts: list[DiLoCoOptimizer]) -> None:
    """Wait until every streaming round the peers released has ended, then shut them
    down, which merges the rounds that ended after a peer's last step. (Shut down
    earlier, a peer cancels a round still looking for its group, and its partner
    averages that fragment without it.)"""
    wait_until(
        lambda: all(f.running is None or f.running.done() for o in opts for f in o.fragments),
        60,
        "the peers' last rounds",
    )
    for opt in opts:
        opt.shutdown()


# ---------------------------------------------------------------------- fragments


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.integers(1, 40))
def test_fragments_cover_every_parameter_once_in_order(sizes, count):
    if count > len(sizes):
        with pytest.raises(ValidationError, match="at least one"):
            split_into_fragments(sizes, count)
        return
    fragments = split_into_fragments(sizes, count)
    assert len(fragments) == count and all(fragments)
    assert [i for fragment in fragments for i in fragment] == list(range(len(sizes)))


def test_fragments_have_similar_sizes():
    fragments = split_into_fragments([100] * 12, 4)
    assert [len(f) for f in fragments] == [3, 3, 3, 3]


# ---------------------------------------------------------------------- bad input


def test_bad_arguments_are_refused_by_name():
    with dht_swarm(1) as (dht,):
        model = make_model()
        for options, reason in (
            ({"num_inner_steps": 0}, "num_inner_steps must be a positive int"),
            ({"batch_size": -1}, "batch_size must be a positive int"),
            ({"num_fragments": 0}, "num_fragments must be a positive int"),
            ({"num_fragments": 3, "num_inner_steps": 2}, "num_inner_steps=2 is fewer than"),
            ({"num_fragments": 9, "num_inner_steps": 50}, "more than the model's 4"),
            ({"fragment_merge_alpha": 1.0}, r"fragment_merge_alpha must be a number in \[0, 1\)"),
            ({"fragment_pace": 0}, r"fragment_pace must be a number in \(0, 1\]"),
            ({"averaging_timeout": float("inf")}, "averaging_timeout must be a positive number"),
            ({"target_batch_size": 0}, "target_batch_size must be a positive int"),
            ({"matchmaking_time": 0}, "matchmaking_time must be a positive number"),
            ({"outer_optimizer": torch.optim.SGD(model.parameters(), lr=1)}, "must be a factory"),
            ({"inner_optimizer": 3}, "inner_optimizer must be a factory"),
            ({"inner_optimizer": lambda p: 1 / 0}, "factory raised ZeroDivisionError"),
            ({"scheduler": lambda opt: 1 / 0}, "scheduler factory raised ZeroDivisionError"),
            ({"run_id": ""}, "run_id must be a non-empty str"),
        ):
            with pytest.raises(ValidationError, match=reason):
                make_diloco(dht, model, **options)


# ---------------------------------------------------------------------- the outer step


def test_a_lone_peer_applies_nesterov_to_its_own_pseudo_gradient():
    """One peer, H = 3: theta = theta_sync - lr (1 + momentum) (theta_sync - theta_local)
    on the first outer step (Nesterov SGD, lr 0.7, momentum 0.9, the default)."""
    with dht_swarm(1) as (dht,):
        model = make_model(seed=1)
        start = [p.detach().clone() for p in model.parameters()]
        twin = copy.deepcopy(model)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
        opt = make_diloco(dht, model, num_inner_steps=3, batch_size=8)
        try:
            generator = torch.Generator().manual_seed(0)
            for step in range(3):
                x = torch.randn(8, 8, generator=generator)
                for m, o in ((model, opt), (twin, twin_opt)):
                    torch.nn.functional.mse_loss(m(x), x[:, :2]).backward()
                    o.step()
                    o.zero_grad()
                assert opt.local_epoch == (1 if step == 2 else 0)
            params = zip(start, twin.parameters(), model.parameters(), strict=True)
            for synced, local, got in params:
                expected = synced - 0.7 * 1.9 * (synced - local.detach())
                assert torch.allclose(got.detach(), expected, atol=1e-6)
        finally:
            opt.shutdown()


def test_peers_sync_together_and_end_each_epoch_with_equal_parameters():
    with dht_swarm(3) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [make_diloco(dht, m, num_inner_steps=4) for dht, m in zip(dhts, models, strict=True)]
        trainers = [
            Trainer(opt, model, seed=i, until_epoch=4)
            for i, (opt, model) in enumerate(zip(opts, models, strict=True))
        ]
        try:
            start_together(trainers)
            for trainer in trainers:
                trainer.result()
            for epoch in (1, 2, 3, 4):
                reference = trainers[0].params_at_epoch[epoch]
                for trainer in trainers[1:]:
                    assert max_difference(trainer.params_at_epoch[epoch], reference) < 1e-6
            first, last = trainers[0].params_at_epoch[0], trainers[0].params_at_epoch[4]
            assert max_difference(first, last) > 0
            assert sum(trainers[0].losses[-5:]) < sum(trainers[0].losses[:5])
        finally:
            for opt in opts:
                opt.shutdown()


def test_a_joiner_downloads_the_synced_state_and_then_syncs_with_the_others():
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [make_diloco(dht, m) for dht, m in zip(dhts, models, strict=True)]
        trainers = [
            Trainer(opt, model, seed=i, until_epoch=5)
            for i, (opt, model) in enumerate(zip(opts, models, strict=True))
        ]
        late_model = make_model(seed=7)  # other weights: it must take the swarm's
        try:
            start_together(trainers)
            while opts[0].local_epoch < 2:
                trainers[0].join(0.05)
            late_opt = make_diloco(join(dhts), late_model)
            opts.append(late_opt)
            late = Trainer(late_opt, late_model, seed=9, until_epoch=5)
            late.start()
            for trainer in [*trainers, late]:
                trainer.result()
            first_epoch = min(e for e in late.params_at_epoch if e >= 2)
            assert first_epoch >= 2
            assert max_difference(late.params_at_epoch[5], trainers[0].params_at_epoch[5]) < 1e-6
            assert late_opt.outer_optimizer.state_dict()["state"]  # the momentum came along
        finally:
            for opt in opts:
                opt.shutdown()


def test_a_peer_whose_round_found_nobody_because_the_others_moved_on_loads_their_state():
    """Peer 0 made its once-per-epoch check while peer 1 was still in epoch 0; then peer
    1 finished the epoch without it. Peer 0's round for epoch 0 finds nobody (the others
    are past it) and its outer step applies its own pseudo-gradient: at its next step it
    must take the swarm's state, not wait for a gap of two epochs. With epochs of a tenth
    of a second a joiner otherwise stayed a round behind, alone, to the end of the run."""
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [
            make_diloco(dht, m, num_inner_steps=2, matchmaking_time=0.5, averaging_timeout=3.0)
            for dht, m in zip(dhts, models, strict=True)
        ]
        generators = [torch.Generator().manual_seed(i) for i in range(2)]

        def step(i: int) -> None:
            local_step(models[i], generators[i])
            opts[i].step()
            opts[i].zero_grad()

        try:
            wait_until(
                lambda: all(o.tracker.refresh(timeout=5).num_peers == 2 for o in opts),
                15,
                "both peers counted",
            )
            step(0)  # its check for this epoch is made: nobody is ahead
            assert opts[0].local_epoch == 0
            while opts[1].local_epoch == 0:  # alone: its round finds nobody either
                step(1)
            wait_until(
                lambda: opts[0].tracker.refresh(timeout=5).epoch == 1, 10, "peer 1 at epoch 1"
            )
            step(0)  # the swarm is past epoch 0: its outer step, whose round finds nobody
            assert opts[0].local_epoch == 1
            assert max_difference(snapshot(models[0]), snapshot(models[1])) > 1e-3
            step(0)  # loads the swarm's state instead of training on
            assert opts[0].local_epoch == 1
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            for opt in opts:
                opt.shutdown()


def test_a_nan_pseudo_gradient_is_left_out_and_the_peer_takes_the_others_average(caplog):
    with dht_swarm(3) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [
            make_diloco(dht, m, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
            for dht, m in zip(dhts, models, strict=True)
        ]

        def poison(trainer: Trainer) -> None:
            if trainer.opt.local_epoch == 1:
                with torch.no_grad():
                    next(trainer.model.parameters())[0, 0] = float("nan")

        trainers = [
            Trainer(opt, model, seed=i, until_epoch=2, on_step=poison if i == 2 else None)
            for i, (opt, model) in enumerate(zip(opts, models, strict=True))
        ]
        try:
            with caplog.at_level(logging.WARNING, logger="swarmgrad.optim.diloco"):
                start_together(trainers)
                for trainer in trainers:
                    trainer.result()
            assert "NaN or Inf" in caplog.text
            final = [t.params_at_epoch[2] for t in trainers]
            assert all(bool(torch.isfinite(p).all()) for params in final for p in params)
            assert max_difference(final[0], final[2]) < 1e-6
            assert max_difference(final[0], final[1]) < 1e-6
        finally:
            for opt in opts:
                opt.shutdown()


# ---------------------------------------------------------------------- streaming, codecs


def test_streaming_fragments_sync_in_turn_and_keep_the_peers_close():
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [
            make_diloco(dht, m, num_inner_steps=8, num_fragments=2, matchmaking_time=0.5)
            for dht, m in zip(dhts, models, strict=True)
        ]
        hints = [[], []]  # (epoch, leader_hint, fragment 0's last group) of fragment 1's steps
        for opt, seen in zip(opts, hints, strict=True):
            second = opt.fragments[1].averager
            original = second.step

            def recording(*args, _opt=opt, _seen=seen, _original=original, **kwargs):
                first_group = _opt.fragments[0].averager.last_group
                _seen.append((_opt.local_epoch, kwargs.get("leader_hint"), first_group))
                return _original(*args, **kwargs)

            second.step = recording
        trainers = [
            Trainer(opt, model, seed=i, until_epoch=4)
            for i, (opt, model) in enumerate(zip(opts, models, strict=True))
        ]
        try:
            start_together(trainers)
            for trainer in trainers:
                trainer.result()
            assert [f.params for f in opts[0].fragments] == [[0], [1, 2, 3]]  # 128 | 16+32+2
            # fragment 1 of a step joins the leader of that step's fragment-0 group directly
            for seen in hints:
                hinted = [(e, hint) for e, hint, _ in seen if hint is not None]
                assert len(hinted) >= 2, seen
                for epoch, hint, first_group in seen:
                    if hint is not None:
                        assert first_group == (f"outer{epoch}f0", hint)
            # compared once both left (a streaming round may end after its peer's outer
            # step: shutdown merges it) and their last rounds ended (one still looking
            # for its group is cancelled by shutdown, whose partner then has averaged
            # without it): the synced copies are equal; the models keep their own inner
            # steps in the merge, so they differ a little, much less than they moved
            shut_down_after_the_last_rounds(opts)
            masters = [torch.cat([m.detach().flatten() for m in o._masters]) for o in opts]
            assert float((masters[0] - masters[1]).abs().max()) < 1e-6
            final = [[p.detach().clone() for p in model.parameters()] for model in models]
            gap = max_difference(final[0], final[1])
            moved = max_difference(final[0], trainers[0].params_at_epoch[0])
            assert gap < moved / 2, (gap, moved)
            assert sum(trainers[0].losses[-5:]) < sum(trainers[0].losses[:5])
        finally:
            for opt in opts:
                opt.shutdown()


def test_the_epoch_fraction_follows_the_swarms_extrapolated_samples():
    """Streaming fragments are due at fractions of the epoch; counted samples lag behind
    (reports are rare), so the fraction is the further of them and the swarm's samples
    extrapolated at its rate up to now (the same for every peer, whatever time each one
    began its epoch at), against the current target (it grows as peers are found); with
    no rate, counted samples alone."""
    from swarmgrad.utils.timeutils import get_dht_time

    with dht_swarm(1) as dhts:
        opt = make_diloco(dhts[0], make_model(), num_inner_steps=8, num_fragments=4)
        try:
            progress = opt.tracker.global_progress
            target = opt.tracker.target_batch_size
            now = get_dht_time()
            opt._epoch_began = now - 100.0  # this peer's own start plays no part
            progress.samples_accumulated = 0
            progress.samples_per_second = target / 12.0  # a 12-s epoch
            progress.samples_estimated, progress.estimated_at = target / 4, now - 3.0
            assert opt._epoch_fraction() == pytest.approx(0.5, abs=0.02)
            assert opt._due_time(0.75) == pytest.approx(now + 3.0, abs=0.01)
            progress.samples_accumulated = target * 3 // 4
            assert opt._epoch_fraction() == pytest.approx(0.75, abs=0.02)
            # the target doubles (twice the peers): the same samples are half as far
            progress.samples_accumulated = 0
            opt.tracker.target_batch_size = 2 * target
            progress = opt.tracker.global_progress
            progress.samples_per_second = target / 12.0
            progress.samples_estimated, progress.estimated_at = target / 4, now - 3.0
            assert opt._epoch_fraction() == pytest.approx(0.25, abs=0.02)
            assert opt._due_time(0.5) == pytest.approx(now + 6.0, abs=0.01)
            progress.samples_per_second = 0.0
            progress.samples_estimated = 0.0
            assert opt._epoch_fraction() == 0.0
            assert opt._due_time(0.5) == float("inf")
        finally:
            opt.shutdown()


def test_a_fragment_due_while_the_peer_counts_only_itself_looks_again_and_syncs_with_all(
    caplog,
):
    """Peer 0 read the run's progress before peer 1 reported and, with reads far apart,
    still counts only itself when its first fragment is due: it reads once more and
    syncs that fragment with peer 1, instead of alone (after which the copies differ
    and the whole model is re-averaged)."""
    slow_reads = {"min_refresh_period": 60, "max_refresh_period": 60, "default_refresh_period": 60}
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        first = make_diloco(dhts[0], models[0], num_inner_steps=8, num_fragments=2,
                            matchmaking_time=0.5, tracker_opts=slow_reads)  # fmt: skip
        wait_until(lambda: first.tracker.fetched_global_progress_this_epoch.is_set(), 10, "read")
        second = make_diloco(dhts[1], models[1], num_inner_steps=8, num_fragments=2,
                             matchmaking_time=0.5)  # fmt: skip
        opts = [first, second]
        trainers = [
            Trainer(opt, m, seed=i, until_epoch=1)
            for i, (opt, m) in enumerate(zip(opts, models, strict=True))
        ]
        try:
            wait_until(
                lambda: second.tracker.refresh(timeout=5).num_peers == 2, 15, "peer 1 seeing 0"
            )
            assert first.tracker.global_progress.num_peers == 1
            with caplog.at_level(logging.DEBUG, logger="swarmgrad.optim.diloco"):
                for trainer in trainers:
                    trainer.start()
                for trainer in trainers:
                    trainer.result()
                # a streaming round may end after its peer's last step: shutdown merges it
                shut_down_after_the_last_rounds(opts)
            text = caplog.text
            assert "fragment 0 of epoch 0 averaged with nobody" not in text, text
            assert text.count("fragment 0 of epoch 0 averaged with 2 peers") == 2, text
            assert "differ across the group" not in text
        finally:
            for opt in opts:
                opt.shutdown()


@pytest.mark.parametrize("num_fragments", [1, 4])
def test_a_fragment_round_waits_for_late_estimates_and_begins_with_every_peer(num_fragments):
    """Peers' estimates of a fragment's due time differ (seconds apart in epoch 0): a
    streaming fragment's leader keeps its group open half a matchmaking time past its
    own estimate, and begins as soon as every peer the swarm counts has joined. Plain
    DiLoCo's one round blocks the outer step: no extra wait there."""
    from swarmgrad.utils.timeutils import get_dht_time

    with dht_swarm(1) as dhts:
        opt = make_diloco(dhts[0], make_model(), num_inner_steps=8,
                          num_fragments=num_fragments, matchmaking_time=2.0)  # fmt: skip
        calls = []
        try:
            fragment = opt.fragments[0]
            fragment.averager.step = lambda **kwargs: calls.append(kwargs) or "control"
            target = opt.tracker.target_batch_size
            fraction = 0.125 if num_fragments > 1 else 1.0
            with opt.tracker.pause_updates():  # no read replaces the progress set here
                progress = opt.tracker.global_progress
                now = get_dht_time()
                progress.num_peers = 3
                progress.samples_per_second = target / 10.0
                # 1 s before the fragment is due (at an eighth, or at the end)
                progress.samples_estimated = target * (fraction - 0.1)
                progress.estimated_at = now
                progress.eta_next_epoch = now + 10.0 * (1 - fraction + 0.1)
                opt._maybe_schedule(fragment, fraction)
            assert fragment.scheduled == "control" and len(calls) == 1
            slack = 1.0 if num_fragments > 1 else 0.0
            assert calls[0]["scheduled_time"] == pytest.approx(now + 1.0 + slack, abs=0.1)
            assert calls[0]["expected_group_size"] == 3
        finally:
            fragment.scheduled = None
            opt.shutdown()


def test_a_fragment_round_is_paced_over_its_gap_and_never_past_a_quarter_of_the_timeout():
    """A streaming fragment's writes are spread over ``fragment_pace`` of the gap to the
    next fragment (the mean fragment's bytes: its parts out and its span back, 2 (N-1)/N
    of the payload; one rate for fragments of different sizes); an epoch thought far
    longer than it is must not stretch the round past a quarter of ``averaging_timeout``;
    plain DiLoCo and ``fragment_pace=None`` go at full speed."""
    from swarmgrad.utils.timeutils import get_dht_time

    with dht_swarm(1) as dhts:
        model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 32))
        opt = make_diloco(dhts[0], model, num_inner_steps=8, num_fragments=2,
                          fragment_pace=0.5, averaging_timeout=40.0)  # fmt: skip
        try:
            # the fragments differ (16.5k and 4.1k values): the rate is the mean one's
            payload = sum(m.numel() * 4 for m in opt._masters) / 2  # float32
            sent = 2 * (4 - 1) / 4 * payload
            with opt.tracker.pause_updates():
                progress = opt.tracker.global_progress
                progress.num_peers = 4
                opt._epoch_began = get_dht_time()
                progress.eta_next_epoch = opt._epoch_began + 8.0  # gap 4 s, paced over 2 s
                assert opt._fragment_send_rate() == pytest.approx(sent / 2.0, rel=0.01)
                progress.eta_next_epoch = opt._epoch_began + 8000.0
                assert opt._fragment_send_rate() == pytest.approx(sent / 10.0, rel=0.01)
                # once rounds finished, their real bytes per value set the pace (zlib
                # makes them smaller than the codec's estimate), with a 5% margin
                progress.eta_next_epoch = opt._epoch_began + 8.0
                small = opt.fragments[1]
                numel = sum(opt._masters[i].numel() for i in small.params)
                opt._round_bytes.append((numel * 5, numel))  # 5 bytes per value (of 6)
                total = sum(m.numel() for m in opt._masters)
                measured = 1.05 * 5 * total / 2
                assert opt._fragment_send_rate() == pytest.approx(measured / 2.0, rel=0.01)
                # a round that sent nearly nothing halves the mean: the floor holds
                opt._round_bytes.append((1, numel))
                assert opt._fragment_send_rate() == pytest.approx(0.6 * sent / 2.0, rel=0.01)
                opt.fragment_pace = None
                assert opt._fragment_send_rate() is None
        finally:
            opt.shutdown()


class _Fake:
    """Stands in for a fragment's averager where only ``last_group`` is read."""

    def __init__(self, last_group):
        self.last_group = last_group


def test_each_fragment_round_is_hinted_with_the_latest_groups_leader():
    """A later fragment joins the leader of this epoch's first fragment group; the first
    fragment, the leader of the last epoch's last (or first) one; plain DiLoCo, and a
    peer that knows no group of those epochs, go through the DHT."""
    from swarmgrad.net.identity import Identity

    with dht_swarm(1) as dhts:
        opt = make_diloco(dhts[0], make_model(), num_inner_steps=8, num_fragments=3)
        leaders = [Identity.generate().peer_id for _ in range(3)]
        originals = [f.averager for f in opt.fragments]
        try:
            first, second, third = opt.fragments
            opt.state_averager.local_epoch = 5
            first.averager = _Fake(("outer5f0", leaders[0]))
            second.averager = _Fake(None)
            third.averager = _Fake(("outer4f2", leaders[2]))
            assert opt._leader_hint(second) == leaders[0]
            assert opt._leader_hint(third) == leaders[0]
            assert opt._leader_hint(first) == leaders[2]  # last epoch's last group
            third.averager = _Fake(("outer3f2", leaders[2]))  # too old
            first.averager = _Fake(("outer4f0", leaders[1]))
            assert opt._leader_hint(first) == leaders[1]
            assert opt._leader_hint(second) is None  # this epoch's first group unknown
        finally:
            for fragment, averager in zip(opt.fragments, originals, strict=True):
                fragment.averager = averager
            opt.shutdown()
        plain = make_diloco(dhts[0], make_model(), run_id="plain", num_inner_steps=8)
        try:
            assert plain._leader_hint(plain.fragments[0]) is None
        finally:
            plain.shutdown()


def _running_control(epoch_tag: str) -> StepControl:
    control = StepControl(scheduled_time=0.0, weight=1.0, round_tag=epoch_tag)
    control._set_stage(AveragingStage.RUNNING_ALLREDUCE)
    return control


def test_streaming_rounds_outlive_the_outer_step_and_shutdown_merges_them():
    """Streaming: the outer step leaves a round in flight running (its writes keep their
    pace), offers the new epoch's state only once that round merged, and shutdown
    waits for a round already averaging and merges it instead of dropping it."""
    with dht_swarm(1) as dhts:
        opt = make_diloco(dhts[0], make_model(), num_inner_steps=8, num_fragments=2)
        try:
            declared = []
            opt.state_averager = opt.epochs.state_averager = _Recorder(opt.state_averager, declared)
            late = opt.fragments[1]
            late.running, late.running_epoch = _running_control("outer0f1"), 0
            opt.fragments[0].synced_epoch = late.synced_epoch = 0
            opt._outer_step()
            assert opt.local_epoch == 1
            assert late.running is not None and not late.running.done()  # not waited for
            assert opt._state_offer_pending and declared == []
            late.running.set_result({"peer": b"digest"})
            opt._apply_finished_fragments(wait=False)
            opt._offer_state()
            assert declared == [1] and not opt._state_offer_pending
            # a round already averaging at shutdown is finished and merged, not cancelled
            before = [m.detach().clone() for m in opt._masters]
            for index in late.params:
                opt._masters[index].grad = torch.ones_like(opt._masters[index])
            control = _running_control("outer1f1")
            late.running, late.running_epoch = control, 1
            timer = threading.Timer(0.3, control.set_result, args=({"peer": b"digest"},))
            timer.start()
            opt.shutdown()
            assert control.done() and not control.cancelled()
            moved = [not torch.equal(a, m) for a, m in zip(before, opt._masters, strict=True)]
            assert [moved[i] for i in late.params] == [True] * len(late.params)
        finally:
            opt.shutdown()


class _Recorder:
    """Wraps the state averager, recording the epochs it is asked to offer."""

    def __init__(self, inner, declared):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_declared", declared)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name == "state_sharing_priority":
            self._declared.append(value)
        setattr(self._inner, name, value)


@pytest.mark.parametrize(
    "codec", [Uniform8BitQuantization(), Blockwise4BitQuantization()], ids=repr
)
def test_quantized_pseudo_gradients_with_error_feedback_keep_the_peers_equal(codec):
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [
            make_diloco(dht, m, grad_compression=codec) for dht, m in zip(dhts, models, strict=True)
        ]
        trainers = [
            Trainer(opt, model, seed=i, until_epoch=3)
            for i, (opt, model) in enumerate(zip(opts, models, strict=True))
        ]
        try:
            assert opts[0].error_feedback
            start_together(trainers)
            for trainer in trainers:
                trainer.result()
            last = [t.params_at_epoch[3] for t in trainers]
            assert max_difference(*last) < 1e-6
            residuals = opts[0].fragments[0].residuals
            assert residuals is not None and any(float(r.abs().max()) > 0 for r in residuals)
        finally:
            for opt in opts:
                opt.shutdown()


def test_error_feedback_keeps_the_sum_of_4bit_updates_within_one_residual_of_the_truth():
    """What 4 bits lose of each outer gradient is sent with the next one, so over many
    rounds the applied sum stays within one round's error of the true sum; without the
    feedback the errors add up."""
    codec = Blockwise4BitQuantization()
    generator = torch.Generator().manual_seed(0)
    true_sum = torch.zeros(4096)
    with_feedback, without = torch.zeros(4096), torch.zeros(4096)
    residual = torch.zeros(4096)
    for _ in range(50):
        # a consistent drift plus noise: the coordinates' small means are what 4 bits miss
        delta = 0.01 + torch.randn(4096, generator=generator)
        true_sum += delta
        sent = delta + residual
        (residual,) = compression_residuals(codec, [sent], [0])
        with_feedback += sent - residual
        (lost,) = compression_residuals(codec, [delta.clone()], [0])
        without += delta - lost
    assert (with_feedback - true_sum).norm() <= residual.norm() * 1.0001
    assert (without - true_sum).norm() > 3 * (with_feedback - true_sum).norm()


def test_exported_at_the_top_level_and_checkpoints_round_trip():
    assert swarmgrad.DiLoCoOptimizer is DiLoCoOptimizer
    with dht_swarm(1) as (dht,):
        model = make_model()
        opt = make_diloco(dht, model, num_inner_steps=2)
        try:
            state = opt.state_dict()
            assert state["epoch"] == 0 and len(state["synced"]) == 4
            state["epoch"] = 3
            opt.load_state_dict(state)
            assert opt.local_epoch == 3
            with pytest.raises(ValidationError, match="keys inner, outer, synced and epoch"):
                opt.load_state_dict({"inner": {}})
            state["synced"] = state["synced"][:1]
            with pytest.raises(ValidationError, match="1 synced tensors"):
                opt.load_state_dict(state)
        finally:
            opt.shutdown()
        with pytest.raises(ValidationError, match="shut down"):
            opt.step()


def test_peers_whose_synced_copies_differ_re_average_them_and_agree_again(caplog):
    """A round that split the swarm into groups leaves each group with its own synced
    copy; averaging pseudo-gradients would never bring them together again. The digests
    in the next round's gather show it, and its members re-average their copies."""
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [make_diloco(dht, m, num_inner_steps=4) for dht, m in zip(dhts, models, strict=True)]
        perturbed = []

        def split_once(trainer: Trainer) -> None:
            # as if peer 1 had averaged epoch 0 in another group: its synced copy moves
            if trainer.opt.local_epoch == 1 and not perturbed:
                perturbed.append(True)
                with torch.no_grad(), trainer.opt.state_averager.state_lock():
                    for master in trainer.opt._masters:
                        master.add_(0.05)
                        state = trainer.opt.outer_optimizer.state.get(master, {})
                        if "momentum_buffer" in state:  # its momentum differs too
                            state["momentum_buffer"].add_(0.05)

        trainers = [
            Trainer(opts[0], models[0], seed=0, until_epoch=4),
            Trainer(opts[1], models[1], seed=1, until_epoch=4, on_step=split_once),
        ]
        try:
            with caplog.at_level(logging.WARNING, logger="swarmgrad.optim.diloco"):
                start_together(trainers)
                for trainer in trainers:
                    trainer.result()
            assert perturbed
            differ = caplog.text.count("synced copies of fragment 0 differ")
            assert differ == 2, "each peer re-averages once, then the copies stay equal"
            masters = [torch.cat([m.detach().flatten() for m in o._masters]) for o in opts]
            assert float((masters[0] - masters[1]).abs().max()) < 1e-6
            assert (
                max_difference(trainers[0].params_at_epoch[3], trainers[1].params_at_epoch[3])
                < 1e-6
            )
        finally:
            for opt in opts:
                opt.shutdown()


def test_a_joiner_whose_outer_optimizer_does_not_fit_the_runs_state_is_refused_by_name():
    """The run's outer state is Nesterov momentum; a joiner built with Adam as its outer
    optimizer must be told so, keep its own state, and the donor keeps serving others."""
    with dht_swarm(1) as dhts:
        model = make_model(seed=0)
        donor = make_diloco(dhts[0], model)
        opts = [donor]
        try:
            trainer = Trainer(donor, model, seed=0, until_epoch=1)
            trainer.start()
            trainer.result()
            assert donor.outer_optimizer.state_dict()["state"]  # there is momentum to serve
            wrong_model = make_model(seed=3)
            wrong = make_diloco(
                join(dhts),
                wrong_model,
                outer_optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
                load_state_timeout=20,
            )
            opts.append(wrong)
            before = [p.detach().clone() for p in wrong_model.parameters()]
            with pytest.raises(ValidationError, match=r"\['momentum_buffer'\] .* ours \['exp_avg"):
                wrong.load_state_from_peers()
            after = list(wrong_model.parameters())
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            right_model = make_model(seed=4)
            right = make_diloco(join(dhts), right_model, load_state_timeout=20)
            opts.append(right)
            right.load_state_from_peers()
            assert right.local_epoch == donor.local_epoch == 1
            assert (
                max_difference(
                    [p.detach() for p in right_model.parameters()],
                    [p.detach() for p in model.parameters()],
                )
                < 1e-6
            )
        finally:
            for opt in opts:
                opt.shutdown()


def test_a_round_under_another_step_number_never_mixes_into_ours():
    """Rounds are tagged with the epoch: a peer that syncs a fragment under another step
    number (here one that believes it is at epoch 7) meets nobody of ours, so its
    pseudo-gradient (made huge here to show) cannot enter our average."""
    with dht_swarm(2) as dhts:
        models = [make_model(seed=0) for _ in dhts]
        opts = [
            make_diloco(dht, m, averaging_timeout=5.0) for dht, m in zip(dhts, models, strict=True)
        ]
        try:
            for opt in opts:
                opt.tracker.report_local_progress(opt.local_epoch, 8)
            wait_until(
                lambda: all(o.tracker.refresh(timeout=5).num_peers == 2 for o in opts),
                20,
                "both peers in each other's progress",
            )
            opts[1].state_averager.local_epoch = 7  # the wrong step number
            with torch.no_grad():
                for p in models[0].parameters():
                    p.add_(0.01)
                for p in models[1].parameters():
                    p.add_(1000.0)
            before = [p.detach().clone() for p in models[0].parameters()]
            for opt in opts:
                opt._launch(opt.fragments[0])
            for opt in opts:
                opt._apply_finished_fragments(wait=True)
            moved = max_difference([p.detach() for p in models[0].parameters()], before)
            assert moved < 1.0, "peer 0's outer step took the other step number's update"
        finally:
            for opt in opts:
                opt.shutdown()


def test_progress_is_read_from_two_replicas_unless_tracker_opts_say_otherwise():
    with dht_swarm(1) as dhts:
        for options, expected in (({}, 2), ({"tracker_opts": {"read_quorum": None}}, None)):
            opt = make_diloco(dhts[0], make_model(seed=0), **options)
            try:
                assert opt.tracker.read_quorum == expected
            finally:
                opt.shutdown()


def test_a_grad_scaler_stepping_the_inner_optimizer_unscales_every_step():
    """scaler.step(opt) with swarmgrad's GradScaler at 2**16: every inner step is a real
    step, so it unscales at once, and the run ends where the same run without scaling
    does. (The scaler only looked for overflow between the Optimizer's epochs: the inner
    steps took gradients 2**16 times too large.)"""
    results = []
    with dht_swarm(1) as (dht,):
        for use_scaler in (False, True):
            model = make_model(seed=1)
            opt = make_diloco(dht, model, run_id=f"amp{use_scaler}", num_inner_steps=3)
            scaler = swarmgrad.GradScaler("cpu", init_scale=2.0**16) if use_scaler else None
            try:
                generator = torch.Generator().manual_seed(0)
                while opt.local_epoch < 2:
                    x = torch.randn(8, 8, generator=generator)
                    loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
                    if scaler is None:
                        loss.backward()
                        opt.step()
                    else:
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
                    opt.zero_grad()
                results.append(snapshot(model))
            finally:
                opt.shutdown()
    assert max_difference(results[0], snapshot(make_model(seed=1))) > 1e-3
    assert max_difference(results[0], results[1]) < 1e-5
