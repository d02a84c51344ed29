"""transformers.Trainer with a swarmgrad Optimizer and SwarmgradCallback: two peers (two
processes, tests/helpers/transformers_worker.py, on loopback) train a tiny GPT-2 together; a
checkpoint resumes the epoch; a non-finite model is restored; bad setups are refused."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' extra is not installed (swarmgrad[transformers])"
)
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the extra has it)")

from transformers import Trainer  # noqa: E402

from swarmgrad.dht import DHT  # noqa: E402
from swarmgrad.integrations.transformers import (  # noqa: E402
    SwarmgradCallback,
    collaborative_optimizers,
)
from swarmgrad.utils.errors import ValidationError  # noqa: E402
from tests.helpers.transformers_worker import (  # noqa: E402
    BATCH,
    LOOPBACK,
    counting_sequences,
    held_out_loss,
    make_optimizer,
    tiny_gpt2,
    training_arguments,
)

ROOT = str(Path(__file__).resolve().parents[2])
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "transformers_worker.py")

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def lone_peer(run_id: str):
    dht = DHT(start=True, host_maddrs=LOOPBACK)
    model = tiny_gpt2()
    opt = make_optimizer(dht, model, run_id)
    try:
        yield dht, model, opt
    finally:
        opt.shutdown()
        dht.shutdown()


def test_two_trainer_peers_end_with_the_same_model_and_a_lower_loss(tmp_path):
    epochs = 6
    bootstrap = DHT(start=True, host_maddrs=LOOPBACK)
    address = [str(a) for a in bootstrap.get_visible_maddrs()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    outputs = [tmp_path / f"peer{index}.pt" for index in range(2)]
    peers = [
        subprocess.Popen(
            [
                *(sys.executable, WORKER, "--initial-peers", *address),
                *("--seed", str(index), "--epochs", str(epochs), "--out", str(out)),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index, out in enumerate(outputs)
    ]
    try:
        errors = [peer.communicate(timeout=150)[1] for peer in peers]
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
        bootstrap.shutdown()
    for peer, error in zip(peers, errors, strict=True):
        assert peer.returncode == 0, error[-3000:]

    first, second = (torch.load(out, weights_only=False) for out in outputs)
    assert first["epoch"] == second["epoch"] == epochs
    for a, b in zip(first["parameters"], second["parameters"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the peers saw different data: equal models mean they averaged every epoch
    model = tiny_gpt2()
    before = held_out_loss(model)
    with torch.no_grad():
        for param, trained in zip(model.parameters(), first["parameters"], strict=True):
            param.copy_(trained)
    after = held_out_loss(model)
    assert after < 0.8 * before, (before, after)
    assert [entry["epoch"] for entry in first["history"]] == list(range(1, epochs + 1))
    assert all(entry["peers"] == 2 for entry in first["history"])


def test_trainer_checkpoint_resumes_the_swarm_epoch(tmp_path):
    with lone_peer("transformers_resume") as (_, model, opt):
        args = training_arguments(tmp_path, save_strategy="steps", save_steps=8, max_steps=8)
        callback = SwarmgradCallback(opt, load_state_at_start=False)
        Trainer(
            model=model,
            args=args,
            train_dataset=counting_sequences(seed=0),
            optimizers=collaborative_optimizers(opt),
            callbacks=[callback],
        ).train()
        reached = opt.local_epoch
    assert reached >= 1, "a lone peer still moves to the next epoch"

    with lone_peer("transformers_resume_2") as (_, model, opt):
        callback = SwarmgradCallback(opt, load_state_at_start=False)
        trainer = Trainer(
            model=model,
            args=training_arguments(tmp_path, save_strategy="no", max_steps=8),
            train_dataset=counting_sequences(seed=0),
            optimizers=collaborative_optimizers(opt),
            callbacks=[callback],
        )
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
        assert opt.local_epoch == reached  # restored from the checkpoint, not restarted at 0


def test_non_finite_parameters_are_restored_from_the_backup(tmp_path):
    class Corrupt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

    with lone_peer("transformers_nan") as (_, model, opt):
        callback = SwarmgradCallback(opt, load_state_at_start=False)
        Trainer(
            model=model,
            args=training_arguments(tmp_path, max_steps=6),
            train_dataset=counting_sequences(seed=0),
            optimizers=collaborative_optimizers(opt),
            callbacks=[Corrupt(), callback],
        ).train()
        assert callback.restores == 1
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_batch_size_the_optimizer_counts_must_be_what_the_trainer_feeds(tmp_path):
    dht = DHT(start=True, host_maddrs=LOOPBACK)
    model = tiny_gpt2()
    opt = make_optimizer(dht, model, "transformers_bad_batch", batch_size_per_step=BATCH * 2)
    try:
        trainer = Trainer(
            model=model,
            args=training_arguments(tmp_path, max_steps=2),
            train_dataset=counting_sequences(seed=0),
            optimizers=collaborative_optimizers(opt),
            callbacks=[SwarmgradCallback(opt, load_state_at_start=False)],
        )
        with pytest.raises(ValidationError, match=r"batch_size_per_step=16 .* feeds 8"):
            trainer.train()
    finally:
        opt.shutdown()
        dht.shutdown()


def test_bad_callback_and_optimizer_arguments_are_refused_by_name():
    plain = torch.optim.SGD(tiny_gpt2().parameters(), lr=0.1)
    with pytest.raises(ValidationError, match=r"needs a swarmgrad\.Optimizer, got SGD"):
        collaborative_optimizers(plain)
    with pytest.raises(ValidationError, match=r"needs the swarmgrad\.Optimizer the Trainer uses"):
        SwarmgradCallback(plain)
    with lone_peer("transformers_bad_args") as (_, _, opt):
        with pytest.raises(ValidationError, match="max_epochs must be a positive int"):
            SwarmgradCallback(opt, max_epochs=0)
        with pytest.raises(ValidationError, match="backup_every_epochs must be a positive int"):
            SwarmgradCallback(opt, backup_every_epochs=True)


def test_the_loss_the_trainer_logs_goes_into_the_peers_metrics_record():
    with lone_peer("transformers_metrics") as (_, _, opt):
        callback = SwarmgradCallback(opt)
        callback.on_log(None, None, None, logs={"loss": 2.5, "learning_rate": 0.1})
        callback.on_log(None, None, None, logs={"eval_loss": 9.0})  # not a training loss
        assert opt.metrics.make_record().loss == 2.5
