"""swarmgrad.Optimizer end to end: peers in one process (each with its own DHT peer and
identity) train a small model together over loopback, in every mode, with bad input."""

from __future__ import annotations

import inspect
import logging
import time

import pytest
import torch

import swarmgrad
from swarmgrad.averaging.allreduce import AveragingMode, GroupMismatch
from swarmgrad.compression import NoCompression
from swarmgrad.optim import Optimizer
from swarmgrad.utils.errors import ValidationError
from tests.helpers.optim import (
    RUN,
    Trainer,
    dht_swarm,
    join,
    local_step,
    make_model,
    make_optimizer,
    max_difference,
    snapshot,
    start_together,
    train_together,
    wait_until,
)

pytestmark = pytest.mark.slow


def shutdown_all(*opts: Optimizer) -> None:
    for opt in opts:
        opt.shutdown()


def test_two_peers_average_gradients_and_stay_identical():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts, models, strict=True)]
        try:
            train_together(opts, models, until_epoch=3)
            assert all(o.local_epoch >= 3 for o in opts)
            # both peers applied the same averaged gradient at each epoch
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
            assert opts[0].grad_averager.last_result is not None
            assert opts[0].tracker.global_progress.num_peers == 2
        finally:
            shutdown_all(*opts)


@pytest.mark.parametrize("scales", [None, (2.0**16, 2.0**8)], ids=["unscaled", "grad_scalers"])
def test_averaged_update_equals_large_batch_sgd(scales):
    """The first epoch of two peers with different data equals one SGD step on the mean
    gradient of all the samples they computed in it (synchronous mode is large-batch
    training). Also when each peer scales its loss with a GradScaler of its own scale
    (default accumulators): each averages true gradients."""
    from swarmgrad.optim import GradScaler

    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(d, m, target_batch_size=48) for d, m in zip(dhts, models, strict=True)
        ]
        try:
            scalers = (
                [None, None]
                if scales is None
                else [GradScaler("cpu", init_scale=s) for s in scales]
            )
            trainers = [
                Trainer(o, m, seed=i, until_epoch=1, pause=0.05, grad_scaler=scalers[i])
                for i, (o, m) in enumerate(zip(opts, models, strict=True))
            ]
            start_together(trainers)
            for t in trainers:
                t.result()
            assert opts[0].grad_averager.last_result is not None
            xs = torch.cat([x for t in trainers for epoch, x, _ in t.batches if epoch == 0])
            ys = torch.cat([y for t in trainers for epoch, _, y in t.batches if epoch == 0])
            assert len(xs) >= 48
            reference = make_model(0)
            torch.nn.functional.mse_loss(reference(xs), ys).backward()
            with torch.no_grad():
                for p in reference.parameters():
                    p -= 0.05 * p.grad
            for t in trainers:
                assert max_difference(t.params_at_epoch[1], snapshot(reference)) < 1e-5
        finally:
            shutdown_all(*opts)


def test_joiner_downloads_state_and_is_in_sync_at_first_update(caplog):
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts, models, strict=True)]
        late_opt = None
        try:
            trainers = [
                Trainer(o, m, seed=i, until_epoch=6)
                for i, (o, m) in enumerate(zip(opts, models, strict=True))
            ]
            start_together(trainers)
            wait_until(lambda: opts[0].local_epoch >= 2, 60, "epoch 2")
            late_model = make_model(seed=123)  # other initial weights: must be replaced
            late_opt = make_optimizer(join(dhts), late_model)
            late = Trainer(late_opt, late_model, seed=7, until_epoch=6)
            late.start()
            for t in (*trainers, late):
                t.result()
            joined_at = min(e for e in late.params_at_epoch if e > 0)
            assert joined_at >= 2, "the joiner starts at the swarm's epoch, not at 0"
            for epoch, params in late.params_at_epoch.items():
                if epoch > joined_at and epoch in trainers[0].params_at_epoch:
                    assert max_difference(params, trainers[0].params_at_epoch[epoch]) < 1e-6
            assert max_difference(snapshot(late_model), snapshot(models[0])) < 1e-6
        finally:
            shutdown_all(*opts, *([late_opt] if late_opt else []))


def test_peer_that_fell_behind_loads_state_before_its_next_update():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        # while peer 1 pauses, each of peer 0's epochs waits for it up to averaging_timeout
        opts = [
            make_optimizer(d, m, averaging_timeout=3.0) for d, m in zip(dhts, models, strict=True)
        ]
        try:
            first = Trainer(opts[0], models[0], seed=0, until_epoch=2)
            second = Trainer(opts[1], models[1], seed=1, until_epoch=2)
            start_together([first, second])
            first.result(), second.result()
            # peer 1 pauses while peer 0 trains alone for three more epochs
            Trainer(opts[0], models[0], seed=0, until_epoch=5).start()
            wait_until(lambda: opts[0].local_epoch >= 5, 60, "peer 0 at epoch 5")
            assert opts[1].local_epoch == 2
            wait_until(lambda: opts[1].tracker.global_epoch >= 5, 30, "peer 1 seeing epoch 5")
            assert not opts[1].is_synchronized_with_peers()
            # its next step notices and downloads the state instead of updating
            from tests.helpers.optim import local_step

            local_step(models[1], torch.Generator().manual_seed(5))
            opts[1].step()
            assert opts[1].local_epoch >= 5
            assert max_difference(snapshot(models[1]), snapshot(models[0])) < 1e-6
        finally:
            shutdown_all(*opts)


def test_local_updates_mode_averages_parameters_each_epoch():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(1)]
        opts = [
            make_optimizer(d, m, use_local_updates=True, delay_state_averaging=False)
            for d, m in zip(dhts, models, strict=True)
        ]
        try:
            assert opts[0].use_local_updates and opts[0].grad_averager is None
            before = snapshot(models[0])
            train_together(opts, models, until_epoch=3)
            assert max_difference(before, snapshot(models[0])) > 0
            # different initial weights were pulled together by parameter averaging
            initial_gap = max_difference(snapshot(make_model(0)), snapshot(make_model(1)))
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < initial_gap / 2
        finally:
            shutdown_all(*opts)


def test_delayed_updates_overlap_and_keep_peers_identical():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(d, m, delay_optimizer_step=True, delay_grad_averaging=True)
            for d, m in zip(dhts, models, strict=True)
        ]
        try:
            assert opts[0].offload_optimizer
            train_together(opts, models, until_epoch=4)
            for o in opts:
                o.state_averager.step(wait_for_delayed_updates=True)
            assert max_difference(snapshot(models[0]), snapshot(make_model(0))) > 0
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            shutdown_all(*opts)


def test_scheduler_steps_once_per_global_epoch():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(
                d, m, scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
            )
            for d, m in zip(dhts, models, strict=True)
        ]
        try:
            train_together(opts, models, until_epoch=3)
            for o in opts:
                assert o.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**o.local_epoch)
        finally:
            shutdown_all(*opts)


def test_client_mode_is_honoured_and_client_trains_with_the_swarm():
    """hivemind drops client_mode=True given to the Optimizer; here it is kept."""
    with dht_swarm(3) as dhts:
        models = [make_model(0) for _ in range(3)]
        opts = [
            make_optimizer(d, m, client_mode=(i == 2))
            for i, (d, m) in enumerate(zip(dhts, models, strict=True))
        ]
        try:
            assert opts[2].client_mode and opts[2].tracker.client_mode
            assert opts[2].grad_averager.mode is AveragingMode.CLIENT
            assert opts[2].state_averager.mode is AveragingMode.CLIENT
            train_together(opts, models, until_epoch=3)
            assert max_difference(snapshot(models[2]), snapshot(models[0])) < 1e-6
            assert opts[0].tracker.global_progress.num_clients == 1
        finally:
            shutdown_all(*opts)


def test_auxiliary_peer_helps_averaging_without_data():
    with dht_swarm(3) as dhts:
        models = [make_model(0) for _ in range(3)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts[:2], models[:2], strict=True)]
        aux = make_optimizer(dhts[2], models[2], auxiliary=True, batch_size_per_step=None)
        try:
            assert aux.grad_averager.mode is AveragingMode.AUX
            with pytest.raises(ValidationError, match="auxiliary"):
                aux.step(batch_size=4)
            trainers = [
                Trainer(o, m, seed=i, until_epoch=3)
                for i, (o, m) in enumerate(zip(opts, models[:2], strict=True))
            ]
            start_together(trainers)
            import time

            while any(t.is_alive() for t in trainers):
                aux.step()
                time.sleep(0.05)
            for t in trainers:
                t.result()
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
            # it kept up with the epochs and reduced a part of the trainers' last round
            last_round = opts[0].grad_averager.last_result.group_id
            assert aux.local_epoch >= 2 and aux.grad_averager.last_result.group_id == last_round
        finally:
            shutdown_all(*opts, aux)


def test_two_optimizers_in_one_process_keep_separate_signed_records():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts, models, strict=True)]
        try:
            keys = {o.tracker._local_public_key for o in opts}
            assert len(keys) == 2, "each peer signs with its own identity"
            for i, o in enumerate(opts):
                o.tracker.report_local_progress(0, 8 * (i + 1))

            def both_visible():
                found = dhts[0].get(f"{RUN}_progress", latest=True)
                if found is None:
                    return False
                samples = {v.value["samples_accumulated"] for v in found.value.values()}
                return samples == {8, 16}

            wait_until(both_visible, 20, "both records")
        finally:
            shutdown_all(*opts)


def test_forged_progress_record_for_another_peer_is_refused():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts, models, strict=True)]
        try:
            victim_key = opts[0].tracker._local_public_key
            opts[0].tracker.report_local_progress(0, 8)
            forged = opts[0].local_progress.model_dump() | {"samples_accumulated": 10**6}
            from swarmgrad.utils.timeutils import get_dht_time

            stored = dhts[1].store(
                f"{RUN}_progress", forged, get_dht_time() + 30, subkey=victim_key
            )
            assert stored is False  # nobody accepts an unsigned write under another's key

            def victim_record_read() -> bool:
                opts[1].tracker.refresh(timeout=5)
                record = opts[1].tracker._last_records.get(victim_key)
                return record is not None and record.samples_accumulated > 0

            wait_until(victim_record_read, 20, "the victim's record")
            assert opts[1].tracker._last_records[victim_key].samples_accumulated == 8
        finally:
            shutdown_all(*opts)


def test_goodbye_removes_the_peer_from_the_swarm_count():
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts, models, strict=True)]
        try:
            for o in opts:
                o.tracker.report_local_progress(0, 8)
            opts[0].tracker.request_fetch()
            wait_until(lambda: opts[0].tracker.global_progress.num_peers == 2, 20, "2 peers")
            opts[1].shutdown()
            opts[0].tracker.request_fetch()
            wait_until(lambda: opts[0].tracker.global_progress.num_peers == 1, 20, "goodbye")
        finally:
            shutdown_all(*opts)


def test_a_round_whose_last_partner_left_proceeds_alone_without_waiting_out_the_timeout(
    caplog,
):
    """Peer 1 says goodbye just as peer 0, which still counts it, ends its epoch: peer 0's
    gradient round can no longer form a group. After a matchmaking time it reads the swarm,
    sees nobody else, and steps with its own gradients instead of waiting out
    averaging_timeout (60 s here; a lab run lost 30 s this way)."""
    # no scheduled reads at all during the test (a young tracker would otherwise read
    # within half its age and might see the goodbye before the epoch ends): the only
    # read after the goodbye is the one the stalled round asks for
    slow_reads = {"min_refresh_period": 60, "default_refresh_period": 60, "max_refresh_period": 60}
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(d, m, averaging_timeout=60.0, tracker_opts=slow_reads)
            for d, m in zip(dhts, models, strict=True)
        ]
        try:
            for o in opts:
                o.tracker.report_local_progress(0, 8)
            wait_until(lambda: opts[0].tracker.refresh(timeout=5).num_peers == 2, 20, "2 peers")
            opts[1].shutdown()
            generator = torch.Generator().manual_seed(0)
            began = time.monotonic()
            with caplog.at_level(logging.DEBUG, logger="swarmgrad.optim"):
                while opts[0].local_epoch == 0:
                    local_step(models[0], generator)
                    opts[0].step()
                    opts[0].zero_grad()
                    assert time.monotonic() - began < 30, "the epoch waited for the timeout"
            assert "every other peer left during epoch 0" in caplog.text, caplog.text
            leaving = time.monotonic()
            opts[0].shutdown()  # no state round left waiting for partners either
            assert time.monotonic() - leaving < 10
            assert time.monotonic() - began < 20
        finally:
            shutdown_all(*opts)


def sgd_step_on_mean_loss(batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 0.05):
    """The parameters of make_model(0) after one SGD step on the mean loss over every
    sample of ``batches``, and that gradient (what synchronous large-batch training does)."""
    reference = make_model(0)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    torch.nn.functional.mse_loss(reference(xs), ys).backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    return snapshot(reference), grads


def epoch_batches(trainer: Trainer, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, y) for e, x, y in trainer.batches if e == epoch]


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_gradients_of_one_peer_are_left_out_of_the_average(bad_value):
    """Peer 2's gradients are all NaN (or Inf). The honest peers' first update is one SGD
    step on the mean gradient of their own samples only: the bad peer was left out, and
    the round did average the two honest peers (each alone would step elsewhere)."""
    with dht_swarm(3) as dhts:
        models = [make_model(0) for _ in range(3)]
        opts = [
            make_optimizer(d, m, target_batch_size=48) for d, m in zip(dhts, models, strict=True)
        ]
        try:
            for param in models[2].parameters():
                param.register_hook(lambda grad: torch.full_like(grad, bad_value))
            trainers = [
                Trainer(o, m, seed=i, until_epoch=2, pause=0.05)
                for i, (o, m) in enumerate(zip(opts, models, strict=True))
            ]
            start_together(trainers)
            for t in trainers:
                t.result()
            # the bad peer was in the honest peers' last round, and each left its parts out
            for opt in opts[:2]:
                assert dhts[2].peer_id in opt.grad_averager.last_result.excluded_senders
            honest = [epoch_batches(t, 0) for t in trainers[:2]]
            assert all(honest), "both honest peers computed gradients in epoch 0"
            together, _ = sgd_step_on_mean_loss(honest[0] + honest[1])
            for t in trainers[:2]:
                assert max_difference(t.params_at_epoch[1], together) < 1e-5
            for alone in honest:  # the test would notice a peer that stepped alone
                assert max_difference(sgd_step_on_mean_loss(alone)[0], together) > 1e-4
            for model in models[:2]:
                assert all(torch.isfinite(p).all() for p in model.parameters())
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            shutdown_all(*opts)


class _DoubleHead(torch.nn.Module):
    """make_model(0)'s layers, the last one in float64 (parameters 2 and 3)."""

    def __init__(self):
        super().__init__()
        first, _, last = make_model(0)
        self.first, self.last = first, last.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.first(x)).double()).float()


def _wider_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 2))


@pytest.mark.parametrize(
    ("make_odd", "named", "mentions"),
    [
        (_wider_model, r"parameter 0|tensor 0", ()),
        # same shapes, the last layer in float64 where the run's is float32
        (_DoubleHead, r"(parameter|tensor) 2 is", ("float32", "float64")),
    ],
    ids=["shape", "dtype"],
)
def test_peer_with_other_parameter_shapes_or_dtypes_is_refused_naming_the_tensor(
    make_odd, named, mentions
):
    """The odd peer gets an error naming the first differing tensor instead of training
    alone, and the two matching peers go on training together."""
    with dht_swarm(3) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts[:2], models, strict=True)]
        odd_opt = None
        try:
            trainers = [
                Trainer(o, m, seed=i, until_epoch=3)
                for i, (o, m) in enumerate(zip(opts, models, strict=True))
            ]
            start_together(trainers)
            wait_until(lambda: opts[0].local_epoch >= 1, 60, "epoch 1")
            odd_model = make_odd()
            odd_opt = make_optimizer(dhts[2], odd_model)
            odd = Trainer(odd_opt, odd_model, seed=3, until_epoch=3)
            odd.start()
            with pytest.raises((ValidationError, GroupMismatch), match=named) as refused:
                odd.result()
            assert all(word in str(refused.value) for word in mentions)
            for t in trainers:
                t.result()
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            shutdown_all(*opts, *([odd_opt] if odd_opt else []))


# ---------------------------------------------------------------------- construction


@pytest.fixture(scope="module")
def one_dht():
    with dht_swarm(1) as dhts:
        yield dhts[0]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"target_batch_size": 0}, "target_batch_size"),
        ({"target_batch_size": -5}, "target_batch_size"),
        ({"use_local_updates": True, "reuse_grad_buffers": True}, "reuse_grad_buffers"),
        (
            {"use_local_updates": True, "delay_grad_averaging": True, "delay_optimizer_step": True},
            "delay_grad_averaging",
        ),
        ({"client_mode": True, "auxiliary": True}, "auxiliary"),
        ({"delay_grad_averaging": True, "delay_optimizer_step": False}, "delay_optimizer_step"),
        ({"offload_optimizer": False, "delay_optimizer_step": True}, "offload_optimizer"),
        ({"average_state_every": 0}, "average_state_every"),
        ({"matchmaking_time": -1}, "matchmaking_time"),
    ],
)
def test_conflicting_or_bad_options_are_refused_by_name(one_dht, options, match):
    with pytest.raises(ValidationError, match=match):
        make_optimizer(one_dht, make_model(), **options)


def test_optimizer_factory_that_raises_is_reported(one_dht):
    def broken(params):
        raise RuntimeError("no such optimizer")

    with pytest.raises(ValidationError, match="optimizer factory raised RuntimeError"):
        make_optimizer(one_dht, make_model(), optimizer=broken)


def test_scheduler_factory_that_raises_is_reported(one_dht):
    def broken(opt):
        raise KeyError("warmup")

    with pytest.raises(ValidationError, match="scheduler factory raised KeyError"):
        make_optimizer(one_dht, make_model(), scheduler=broken)


def test_ready_made_optimizer_is_accepted_and_params_with_it_refused(one_dht):
    model = make_model()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValidationError, match="params"):
        make_optimizer(one_dht, model, optimizer=torch_opt, params=model.parameters())
    opt = make_optimizer(one_dht, model, optimizer=torch_opt, params=None, run_id="ready")
    try:
        assert opt.opt is torch_opt and not opt.offload_optimizer
        assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    finally:
        opt.shutdown()


def test_zero_grad_refused_with_reused_buffers_and_step_needs_a_batch_size(one_dht):
    opt = make_optimizer(
        one_dht, make_model(), reuse_grad_buffers=True, batch_size_per_step=None, run_id="zg"
    )
    try:
        with pytest.raises(ValidationError, match="reuse_grad_buffers"):
            opt.zero_grad()
        with pytest.raises(ValidationError, match="batch_size"):
            opt.step()
        with pytest.raises(ValidationError, match="GradScaler"):
            opt.step(batch_size=4, grad_scaler=torch.amp.GradScaler("cpu"))
    finally:
        opt.shutdown()
    with pytest.raises(ValidationError, match="shut down"):
        opt.step(batch_size=4)


def test_state_dict_round_trip_keeps_the_epoch(one_dht):
    model = make_model()
    opt = make_optimizer(
        one_dht, model, run_id="sd", optimizer=lambda p: torch.optim.Adam(p, lr=1e-3)
    )
    try:
        opt.state_averager.local_epoch = 7
        state = opt.state_dict()
        assert state["state"]["local_epoch"] == 7
        opt.state_averager.local_epoch = 0
        opt.load_state_dict(state)
        assert opt.local_epoch == 7
        with pytest.raises(ValidationError):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        logging.getLogger(__name__).debug("%r", opt)
    finally:
        opt.shutdown()


# ---------------------------------------------------------------------- parts and options


def test_grad_averager_factory_builds_the_gradient_averager():
    from swarmgrad.optim import GradientAverager

    made = []

    class CountingAverager(GradientAverager):
        def accumulate_grads_(self, batch_size):
            made.append(batch_size)
            return super().accumulate_grads_(batch_size)

    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(d, m, grad_averager_factory=CountingAverager)
            for d, m in zip(dhts, models, strict=True)
        ]
        try:
            assert all(isinstance(o.grad_averager, CountingAverager) for o in opts)
            train_together(opts, models, until_epoch=2)
            assert made and max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            shutdown_all(*opts)


def test_a_short_matchmaking_time_leaves_the_round_waits_adaptive(one_dht):
    """hivemind's default next_chunk_timeout is matchmaking_time: with a 1-s window every
    part had to arrive within 1 s, which excluded each peer on a slow link from every
    round. Unless next_chunk_timeout is given, the waits adapt to the link (deadlines.py)
    and state chunks keep the downloader's own timeout."""
    model = make_model(0)
    opt = make_optimizer(one_dht, model, matchmaking_time=1.0)
    try:
        for averager in (opt.grad_averager, opt.state_averager):
            core = averager._core
            assert core.sender_timeout is None and core.next_chunk_timeout is None
            assert core._timeouts_for_round().sender_timeout is None
            assert "chunk_timeout" not in core._download_options
    finally:
        opt.shutdown()
    opt = make_optimizer(one_dht, make_model(0), run_id="fixed", next_chunk_timeout=7.0)
    try:
        for averager in (opt.grad_averager, opt.state_averager):
            assert averager._core._timeouts_for_round().sender_timeout == 7.0
            assert averager._core._download_options["chunk_timeout"] == 7.0
    finally:
        opt.shutdown()


def test_joiner_downloads_extra_tensors_and_optimizer_state():
    with dht_swarm(2) as dhts:
        model = make_model(0)
        extra = torch.arange(5, dtype=torch.float32)
        donor = make_optimizer(
            dhts[0],
            model,
            extra_tensors=[extra],
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        )
        joiner = None
        try:
            donor_trainer = Trainer(donor, model, seed=0, until_epoch=2)
            donor_trainer.start()
            donor_trainer.result()
            extra.mul_(3)  # changed by the donor since: the joiner must get these values
            joiner_model = make_model(5)
            joiner_extra = torch.zeros(5)
            joiner = make_optimizer(
                dhts[1],
                joiner_model,
                extra_tensors=[joiner_extra],
                optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
            )
            joiner.load_state_from_peers()
            assert joiner.local_epoch == donor.local_epoch == 2
            assert torch.equal(joiner_extra, extra)
            assert max_difference(snapshot(joiner_model), snapshot(model)) < 1e-6
            donor_state, joiner_state = donor.opt.state, joiner.opt.state
            for mine, theirs in zip(
                donor.opt.param_groups[0]["params"],
                joiner.opt.param_groups[0]["params"],
                strict=True,
            ):
                assert torch.equal(
                    donor_state[mine]["exp_avg_sq"], joiner_state[theirs]["exp_avg_sq"]
                )
                assert float(donor_state[mine]["step"]) == float(joiner_state[theirs]["step"]) > 0
        finally:
            shutdown_all(donor, *([joiner] if joiner else []))


def test_grad_scaler_with_reused_buffers_unscales_once_per_epoch(one_dht):
    """A lone peer with reuse_grad_buffers and a GradScaler (scale 1024) ends each epoch
    with the same parameters as without scaling: the accumulated gradients are unscaled
    exactly once."""
    from swarmgrad.optim import GradScaler

    results = []
    for use_scaler in (False, True):
        model = make_model(0)
        opt = make_optimizer(
            one_dht,
            model,
            run_id=f"amp{use_scaler}",
            reuse_grad_buffers=True,
            target_batch_size=32,
            offload_optimizer=False,
        )
        scaler = GradScaler("cpu", init_scale=1024.0) if use_scaler else None
        generator = torch.Generator().manual_seed(0)
        from tests.helpers.optim import batch

        try:
            while opt.local_epoch < 2:
                x, y = batch(generator)
                loss = torch.nn.functional.mse_loss(model(x), y)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
            results.append(snapshot(model))
        finally:
            opt.shutdown()
    assert max_difference(results[0], snapshot(make_model(0))) > 1e-4
    assert max_difference(results[0], results[1]) < 1e-5


def _train_alone(opt, model, until_epoch, scaler=None, seed=0, scaler_steps=False):
    """Lone-peer training loop on the helpers' data; with ``scaler``: hivemind's documented
    usage, ``scaler.scale(loss).backward(); opt.step(grad_scaler=scaler)``, or with
    ``scaler_steps`` torch's, ``scaler.step(opt)``."""
    from tests.helpers.optim import batch

    generator = torch.Generator().manual_seed(seed)
    while opt.local_epoch < until_epoch:
        x, y = batch(generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if scaler_steps:
                scaler.step(opt)
            else:
                opt.step(grad_scaler=scaler)
            scaler.update()
        opt.zero_grad()
    return snapshot(model)


@pytest.mark.parametrize("scaler_steps", [False, True])
@pytest.mark.parametrize("offload", [False, True])
def test_grad_scaler_with_separate_accumulators_gives_the_unscaled_run(
    one_dht, offload, scaler_steps
):
    """reuse_grad_buffers=False (the default) with a GradScaler at a large scale, through
    opt.step(grad_scaler=scaler) or scaler.step(opt): each epoch's update is the one of
    the same run without loss scaling. (The accumulated gradients used to reach the
    optimizer still multiplied by the scale: SGD at 2**16 times its step diverged.)"""
    from swarmgrad.optim import GradScaler

    results = []
    for use_scaler in (False, True):
        model = make_model(0)
        opt = make_optimizer(
            one_dht,
            model,
            run_id=f"amp_sep{use_scaler}{offload}{scaler_steps}",
            target_batch_size=32,
            offload_optimizer=offload,
        )
        scaler = GradScaler("cpu", init_scale=2.0**16) if use_scaler else None
        try:
            results.append(
                _train_alone(opt, model, until_epoch=3, scaler=scaler, scaler_steps=scaler_steps)
            )
        finally:
            opt.shutdown()
        if scaler is not None:
            assert scaler.get_scale() >= 2.0**16  # no overflow seen, so no shrinking
    assert max_difference(results[0], snapshot(make_model(0))) > 1e-3  # it trained
    assert max_difference(results[0], results[1]) < 1e-5


@pytest.mark.parametrize(("delay", "use_scaler"), [(False, False), (False, True), (True, False)])
def test_local_updates_with_an_offloaded_optimizer_move_the_model(one_dht, delay, use_scaler):
    """use_local_updates with offload_optimizer: every step updates the model, as without
    offload (the offloaded copy's .grad used to stay empty: the model never changed).
    A delayed step applies one step later, so it only has to move the model."""
    from swarmgrad.optim import GradScaler

    results = {}
    for offload in (False, True):
        model = make_model(0)
        opt = make_optimizer(
            one_dht,
            model,
            run_id=f"local_off{offload}{delay}{use_scaler}",
            target_batch_size=32,
            use_local_updates=True,
            offload_optimizer=offload,
            delay_optimizer_step=delay and offload,
        )
        scaler = GradScaler("cpu", init_scale=2.0**16) if use_scaler and offload else None
        try:
            assert opt.offload_optimizer == offload
            local_step(model, torch.Generator().manual_seed(0))
            opt.step()
            opt.zero_grad()
            opt.state_averager.step(wait_for_delayed_updates=True)  # a delayed one, applied
            assert max_difference(snapshot(model), snapshot(make_model(0))) > 1e-4
            results[offload] = _train_alone(opt, model, until_epoch=2, scaler=scaler, seed=1)
        finally:
            opt.shutdown()
    if not delay:
        assert max_difference(results[False], results[True]) < 1e-5


@pytest.mark.parametrize("same_start", [True, False])
def test_a_state_round_runs_only_when_the_peers_states_differ(same_start):
    """Synchronous peers that start equal stay equal (same averaged gradients): their
    state rounds are skipped, which halves the bytes per epoch. Peers that start apart
    keep their state rounds, which bring them together."""
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0 if same_start else 1)]
        opts = [
            make_optimizer(d, m, delay_state_averaging=False)
            for d, m in zip(dhts, models, strict=True)
        ]
        try:
            equal_digests = opts[0].state_averager.state_digest() == (
                opts[1].state_averager.state_digest()
            )
            assert equal_digests == same_start
            train_together(opts, models, until_epoch=3)
            rounds = [o.state_averager.finished_averaging_round.is_set() for o in opts]
            assert rounds == [not same_start] * 2
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            shutdown_all(*opts)


def test_states_count_as_equal_only_after_a_whole_round_with_fresh_digests():
    """The rule that skips a state round: every peer in the gradient round, all with the
    digest of our state as it is now, and every span averaged. A span kept local (its
    owner died mid-round) leaves each peer with its own gradient there; a digest sent
    before a background state round changed our state says nothing about it now."""
    import dataclasses

    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [make_optimizer(d, m) for d, m in zip(dhts, models, strict=True)]
        try:
            train_together(opts, models, until_epoch=1)
            opt = opts[0]
            result = opt.grad_averager.last_result
            assert result is not None and result.fully_averaged
            mine = opt.rounds.digest()
            gathered = {"a": mine, "b": mine}
            assert opt.rounds.left_states_equal(gathered)

            assert not opt.rounds.left_states_equal({"a": mine, "b": b"other"})
            assert not opt.rounds.left_states_equal({"a": mine})  # a peer was not in it
            opt.rounds.result_before_round = result  # no new round finished
            assert not opt.rounds.left_states_equal(gathered)
            opt.rounds.result_before_round = None
            for partial in (
                dataclasses.replace(result, local_spans=frozenset({1})),
                dataclasses.replace(result, deadline_exceeded=True),
            ):
                opt.grad_averager._core.last_result = partial
                assert not opt.rounds.left_states_equal(gathered)
            opt.grad_averager._core.last_result = result
            assert opt.rounds.left_states_equal(gathered)

            # a background state round (or a download) changes the state after the
            # digest was sent: the digest is recomputed and the old one no longer counts
            with opt.state_averager.state_lock(), torch.no_grad():
                opt.opt.param_groups[0]["params"][0].add_(1.0)  # the master copy
                opt.state_averager.state_version += 1
            assert opt.rounds.digest() != mine
            assert not opt.rounds.left_states_equal(gathered)
        finally:
            shutdown_all(*opts)


def test_bans_act_on_the_gradient_averager_and_never_on_synced_parameters():
    """``ban_after`` in ``averager_opts`` reaches the averager of gradients (or of
    pseudo-gradients); the state averager of parameters kept in sync blames but never
    bans (offenders.without_bans); in local-updates mode it is the only averager and
    keeps them."""
    from swarmgrad.averaging import CenteredClip
    from swarmgrad.optim.diloco import DiLoCoOptimizer

    def ban_settings(averager):
        log = averager._core.offenders
        return log.ban_after, log.ban_window

    opts = {"aggregation": CenteredClip(tau=0.5), "ban_after": 4, "ban_window": 6}
    with dht_swarm(1) as dhts:
        model = make_model()
        opt = make_optimizer(dhts[0], model, averager_opts=dict(opts))
        try:
            assert ban_settings(opt.grad_averager) == (4, 6)
            assert ban_settings(opt.state_averager) == (None, 0)
            assert opt.state_averager._core.aggregation == opts["aggregation"]  # still robust
            # ...and it follows the gradient averager's bans: a liar there is left out here
            liar = dhts[0].peer_id
            grad_log = opt.grad_averager._core.offenders
            state_log = opt.state_averager._core.offenders
            assert not state_log.is_banned(liar)
            grad_log._banned_until[liar] = time.monotonic() + 60
            assert state_log.is_banned(liar) and state_log.banned == frozenset()
        finally:
            opt.shutdown()
        local = make_optimizer(
            dhts[0], model, run_id="local", use_local_updates=True, averager_opts=dict(opts)
        )
        try:
            assert ban_settings(local.state_averager) == (4, 6)
        finally:
            local.shutdown()
        diloco = DiLoCoOptimizer(
            dht=dhts[0],
            run_id="diloco",
            batch_size=8,
            num_inner_steps=5,
            inner_optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
            params=model.parameters(),
            averager_opts=dict(opts),
        )
        try:
            assert all(ban_settings(f.averager) == (4, 6) for f in diloco.fragments)
            assert ban_settings(diloco.state_averager) == (None, 0)
            # a peer banned by any fragment's averager is left out of re-averages too
            liar = dhts[0].peer_id
            state_log = diloco.state_averager._core.offenders
            assert not state_log.is_banned(liar)
            diloco.fragments[-1].averager._core.offenders._banned_until[liar] = (
                time.monotonic() + 60
            )
            assert state_log.is_banned(liar)
        finally:
            diloco.shutdown()


def record_state_rounds(opt: Optimizer, before=None) -> list[tuple[int, bool, object]]:
    """Wrap the state averager's rounds: each appends (epoch, whether it averaged with a
    group, ``before()`` called just before the round copies the state)."""
    averager = opt.state_averager
    original = averager._averaging_round
    rounds = []

    def recording(control, options):
        seen = before() if before is not None else None
        apply = original(control, options)
        rounds.append((averager.local_epoch, apply is not None, seen))
        return apply

    averager._averaging_round = recording
    return rounds


def test_state_is_averaged_only_every_average_state_every_epochs():
    """With ``average_state_every=2`` the state rounds run at epochs 2 and 4 only. Each
    peer updates a statistics tensor (like batch-norm's) from its own data, so the peers'
    states differ at every epoch and no round is skipped as one that would change
    nothing."""
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        stats = [torch.zeros(2), torch.zeros(2)]
        opts = [
            make_optimizer(
                d, m, average_state_every=2, delay_state_averaging=False, extra_tensors=[s]
            )
            for d, m, s in zip(dhts, models, stats, strict=True)
        ]
        rounds = [record_state_rounds(o) for o in opts]

        def update_stats(trainer: Trainer) -> None:
            _, _, y = trainer.batches[-1]
            with trainer.opt.state_averager.state_lock():
                trainer.opt.state_averager.extra_tensors[0].add_(y.mean(dim=0))

        try:
            trainers = [
                Trainer(o, m, seed=i, until_epoch=4, on_step=update_stats)
                for i, (o, m) in enumerate(zip(opts, models, strict=True))
            ]
            start_together(trainers)
            for t in trainers:
                t.result()
            for recorded in rounds:
                assert [(epoch, averaged) for epoch, averaged, _ in recorded] == [
                    (2, True),
                    (4, True),
                ]
        finally:
            shutdown_all(*opts)


def test_offloaded_master_copy_receives_the_sample_weighted_average_gradient():
    """With ``offload_optimizer=True`` the optimizer steps on a CPU master copy whose
    ``.grad`` receives the averaged gradient: at the first step it is the mean gradient
    over every sample both peers computed in epoch 0, weighted by samples (the peers use
    batches of 8 and 4), and the model gets the master copy's updated values."""
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(d, m, offload_optimizer=True, target_batch_size=48)
            for d, m in zip(dhts, models, strict=True)
        ]
        master_grads: list[list[list[torch.Tensor]]] = [[], []]
        for opt, seen in zip(opts, master_grads, strict=True):
            masters = opt.opt.param_groups[0]["params"]
            assert all(
                m is not p for m, p in zip(masters, opt.param_groups[0]["params"], strict=True)
            )
            original_step = opt.opt.step

            def recording_step(*args, _step=original_step, _masters=masters, _seen=seen, **kw):
                _seen.append([p.grad.clone() for p in _masters])
                return _step(*args, **kw)

            opt.opt.step = recording_step
        try:
            trainers = [
                Trainer(o, m, seed=i, until_epoch=1, pause=0.05, batch_size=8 // (i + 1))
                for i, (o, m) in enumerate(zip(opts, models, strict=True))
            ]
            start_together(trainers)
            for t in trainers:
                t.result()
            assert opts[0].grad_averager.last_result is not None
            batches = [epoch_batches(t, 0) for t in trainers]
            after_step, mean_grad = sgd_step_on_mean_loss(batches[0] + batches[1])
            for seen, trainer, model, opt in zip(master_grads, trainers, models, opts, strict=True):
                assert len(seen) == 1
                for got, want in zip(seen[0], mean_grad, strict=True):
                    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
                assert max_difference(trainer.params_at_epoch[1], after_step) < 1e-5
                assert max_difference(snapshot(model), opt.opt.param_groups[0]["params"]) == 0
            # weighting by peers instead of samples would give another gradient
            per_peer = [sgd_step_on_mean_loss(b)[1] for b in batches]
            unweighted = [(a + b) / 2 for a, b in zip(*per_peer, strict=True)]
            assert max_difference(unweighted, mean_grad) > 1e-4
        finally:
            shutdown_all(*opts)


def test_average_opt_statistics_averages_those_optimizer_statistics_only():
    """Two peers with local updates and Adam, ``average_opt_statistics=("exp_avg_sq",)``:
    after the state round at epoch 1 both hold the mean of their exp_avg_sq from just
    before it, while exp_avg (not listed) stays each peer's own."""
    with dht_swarm(2) as dhts:
        models = [make_model(0), make_model(0)]
        opts = [
            make_optimizer(
                d,
                m,
                optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
                use_local_updates=True,
                delay_state_averaging=False,
                average_opt_statistics=("exp_avg_sq",),
            )
            for d, m in zip(dhts, models, strict=True)
        ]

        def statistics(opt: Optimizer) -> dict[str, list[torch.Tensor]]:
            with opt.state_averager.state_lock():
                params = opt.opt.param_groups[0]["params"]
                return {
                    name: [opt.opt.state[p][name].clone() for p in params]
                    for name in ("exp_avg", "exp_avg_sq")
                }

        rounds = [record_state_rounds(o, before=lambda o=o: statistics(o)) for o in opts]
        try:
            train_together(opts, models, until_epoch=1)
            assert [[(e, ok) for e, ok, _ in r] for r in rounds] == [[(1, True)]] * 2
            before = [r[0][2] for r in rounds]
            after = [statistics(o) for o in opts]

            def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
                pairs = zip(a, b, strict=True)
                return all(torch.allclose(x, y, rtol=1e-5, atol=0) for x, y in pairs)

            # different data, so different statistics: their mean is news to both
            assert not same(before[0]["exp_avg_sq"], before[1]["exp_avg_sq"])
            mean = [(a + b) / 2 for a, b in zip(*(s["exp_avg_sq"] for s in before), strict=True)]
            for got in after:
                assert same(got["exp_avg_sq"], mean)
            for got, had in zip(after, before, strict=True):
                assert max_difference(got["exp_avg"], had["exp_avg"]) == 0
            assert not same(after[0]["exp_avg"], after[1]["exp_avg"])
            assert max_difference(snapshot(models[0]), snapshot(models[1])) < 1e-6
        finally:
            shutdown_all(*opts)


#: hivemind 1.1.12's ``Optimizer.__init__``: keyword-only names and defaults, in order
#: (``...``: required). Ours may add keywords after these, never change them.
_HIVEMIND_1_1_12 = (
    ("dht", ...),
    ("run_id", ...),
    ("target_batch_size", ...),
    ("batch_size_per_step", None),
    ("optimizer", ...),
    ("params", None),
    ("scheduler", None),
    ("matchmaking_time", 15.0),
    ("averaging_timeout", 60.0),
    ("allreduce_timeout", None),
    ("next_chunk_timeout", None),
    ("load_state_timeout", 600.0),
    ("reuse_grad_buffers", False),
    ("offload_optimizer", None),
    ("delay_optimizer_step", None),
    ("delay_grad_averaging", False),
    ("delay_state_averaging", True),
    ("average_state_every", 1),
    ("use_local_updates", False),
    ("client_mode", None),
    ("auxiliary", False),
    ("grad_compression", NoCompression),
    ("grad_averager_factory", None),
    ("state_averaging_compression", NoCompression),
    ("load_state_compression", NoCompression),
    ("average_opt_statistics", ()),
    ("extra_tensors", ()),
    ("averager_opts", None),
    ("tracker_opts", None),
    ("performance_ema_alpha", 0.1),
    ("shutdown_timeout", 5),
    ("verbose", False),
)


def test_the_optimizer_signature_starts_with_hivemind_1_1_12s():
    parameters = list(inspect.signature(swarmgrad.Optimizer.__init__).parameters.values())[1:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    for parameter, (name, default) in zip(parameters, _HIVEMIND_1_1_12, strict=False):
        assert parameter.name == name
        if default is ...:
            assert parameter.default is inspect.Parameter.empty, name
        elif default is NoCompression:
            assert isinstance(parameter.default, NoCompression), name
        else:
            assert parameter.default == default and type(parameter.default) is type(default), name
    added = [p for p in parameters[len(_HIVEMIND_1_1_12) :]]
    assert all(p.default is not inspect.Parameter.empty for p in added)
