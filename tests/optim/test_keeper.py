"""``StateKeeper``: a peer that trains nothing, takes part in the trainers' gradient rounds
with weight 0 and applies each average as they do, so it holds the swarm's state at the
swarm's epoch (no download lag)."""

from __future__ import annotations

import time

import pytest
import torch

from swarmgrad.optim import StateKeeper
from swarmgrad.utils.errors import ValidationError
from tests.helpers.optim import (
    RUN,
    Trainer,
    dht_swarm,
    make_model,
    make_optimizer,
    snapshot,
    start_together,
)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def make_keeper(dht, model, **options) -> StateKeeper:
    return StateKeeper(
        dht=dht, run_id=RUN, target_batch_size=64, optimizer=adam, params=model.parameters(),
        matchmaking_time=1.0, averaging_timeout=15.0, **options,
    )  # fmt: skip


def two_trainers_and_a_keepers_model(dhts):
    """Three equal models; Adam optimizers for the first two (the trainers, on the first
    two DHTs); the third model is the keeper's."""
    models = [make_model(0) for _ in range(3)]
    opts = [make_optimizer(d, m, optimizer=adam) for d, m in zip(dhts[:2], models[:2], strict=True)]
    return models, opts


def keep_up_while(keeper: StateKeeper, condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while condition():
        assert time.monotonic() < deadline, f"keeper at epoch {keeper.local_epoch}"
        keeper.keep_up()
        time.sleep(0.02)


@pytest.mark.slow
def test_keeper_reaches_every_epoch_in_the_trainers_round_with_their_exact_state():
    with dht_swarm(3) as dhts:
        models, opts = two_trainers_and_a_keepers_model(dhts)
        keeper = make_keeper(dhts[2], models[2])
        try:
            with pytest.raises(ValidationError, match="keep_up"):
                keeper.step(batch_size=8)
            trainers = [Trainer(o, m, seed=i, until_epoch=4) for i, (o, m) in
                        enumerate(zip(opts, models[:2], strict=True))]  # fmt: skip
            start_together(trainers)
            keep_up_while(keeper, lambda: any(t.is_alive() for t in trainers), 120)
            for t in trainers:
                t.result()
            # the trainers' last round ended with them: the keeper applies it at its next look
            keep_up_while(keeper, lambda: keeper.local_epoch < 4, 30)
            assert keeper.local_epoch == opts[0].local_epoch == 4
            # every epoch came from a round (none downloaded), and the state is theirs to
            # the bit: parameters and Adam's moments alike
            assert (keeper.rounds_kept, keeper.downloads) == (4, 0)
            for mine, theirs in zip(snapshot(models[2]), snapshot(models[0]), strict=True):
                assert torch.equal(mine, theirs)
            assert keeper.state_averager.state_digest() == opts[0].state_averager.state_digest()
            # with the keeper's equal digest in each round, the trainers skipped state rounds
            assert not opts[0].state_averager.finished_averaging_round.is_set()
        finally:
            for opt in [*opts, keeper]:
                opt.shutdown()


@pytest.mark.slow
def test_keeper_that_joins_late_downloads_once_then_follows_the_rounds():
    with dht_swarm(3) as dhts:
        models, opts = two_trainers_and_a_keepers_model(dhts)
        keeper = None
        try:
            trainers = [Trainer(o, m, seed=i, until_epoch=6) for i, (o, m) in
                        enumerate(zip(opts, models[:2], strict=True))]  # fmt: skip
            start_together(trainers)
            deadline = time.monotonic() + 60
            while opts[0].local_epoch < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            keeper = make_keeper(dhts[2], models[2])
            keep_up_while(keeper, lambda: any(t.is_alive() for t in trainers), 120)
            for t in trainers:
                t.result()
            keep_up_while(keeper, lambda: keeper.local_epoch < 6, 30)
            assert keeper.downloads == 1 and keeper.rounds_kept >= 1
            assert keeper.local_epoch == 6
            assert keeper.state_averager.state_digest() == opts[0].state_averager.state_digest()
        finally:
            for opt in [*opts, keeper]:
                if opt is not None:
                    opt.shutdown()


@pytest.mark.parametrize(
    "option, match",
    [
        ({"use_local_updates": True}, "use_local_updates"),
        ({"auxiliary": True}, "auxiliary"),
        ({"delay_optimizer_step": True}, "delay_optimizer_step"),
    ],
)
def test_keeper_refuses_modes_in_which_it_cannot_follow_the_trainers(option, match):
    with pytest.raises(ValidationError, match=f"StateKeeper refuses {match}"):
        StateKeeper(dht=None, run_id=RUN, target_batch_size=64, optimizer=adam, **option)
