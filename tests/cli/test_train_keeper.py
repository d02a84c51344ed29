"""``swarmgrad train --role keeper``: a peer that trains nothing, keeps the swarm's state
on disk every few epochs (as a checkpoint, a plain state_dict and, for ``transformers``
models, the ``save_pretrained`` form) and serves it, so that a swarm whose every
trainer restarts resumes where it was instead of from zero."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from swarmgrad.cli import train_command
from swarmgrad.cli.model_module import load_model_module
from swarmgrad.cli.train_checkpoint import export_model, load_checkpoint
from tests.cli.test_train import TINY_MODULE, Proc, mean_loss, write


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_keeper_needs_a_directory_and_connections():
    with pytest.raises(ValueError, match="--role keeper needs --checkpoint-dir"):
        train_command.resolve_settings(parse("--model-module", "m.py", "--run-id", "r",
                                             "--role", "keeper"))  # fmt: skip
    with pytest.raises(ValueError, match="drop --client-mode"):
        train_command.resolve_settings(parse("--model-module", "m.py", "--run-id", "r",
                                             "--role", "keeper", "--checkpoint-dir", "d",
                                             "--client-mode"))  # fmt: skip
    with pytest.raises(ValueError, match="--keep-every must be positive"):
        train_command.resolve_settings(parse("--model-module", "m.py", "--run-id", "r",
                                             "--role", "keeper", "--checkpoint-dir", "d",
                                             "--keep-every", "0"))  # fmt: skip


def test_exported_model_loads_with_plain_torch_load(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    written = export_model(tmp_path, model)
    assert written == [str(tmp_path / "model.pt")]
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    fresh.load_state_dict(torch.load(tmp_path / "model.pt"))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_transformers_model_is_exported_for_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the transformers extra")
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()  # (no dropout in the comparison)
    export_model(tmp_path, model)
    export_model(tmp_path, model)  # a second export replaces the first
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, loaded(tokens).logits)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_swarm_whose_trainers_all_restart_resumes_from_the_keeper(tmp_path):
    module = write(tmp_path, TINY_MODULE)
    procs: list[Proc] = []
    common = ("--model-module", str(module), "--run-id", "kept", "--host-maddrs",
              "/ip4/127.0.0.1/tcp/0", "--target-batch-size", "128", "--batch-size", "16",
              "--matchmaking-time", "1", "--averaging-timeout", "5",
              "--metadata-expiration", "8", "--progress-json")  # fmt: skip
    try:
        boot = Proc("dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", log=tmp_path / "boot.log")
        procs.append(boot)
        address = boot.first_line_with("--initial-peers", 60).split()[-1]

        def start(name: str, *argv: str) -> Proc:
            proc = Proc("train", *common, "--initial-peers", address, *argv,
                        log=tmp_path / f"{name}-{len(procs)}.log")  # fmt: skip
            procs.append(proc)
            return proc

        keeper = start("keeper", "--role", "keeper", "--keep-every", "1",
                       "--checkpoint-dir", str(tmp_path / "kept"))  # fmt: skip
        keeper.first_line_with('"ready"', 120)
        trainers = [start("a"), start("b")]
        for proc in trainers:
            proc.first_line_with('"ready"', 120)

        def latest(proc: Proc, event: str) -> int | None:
            return next((e["epoch"] for e in reversed(proc.events) if e["event"] == event), None)

        # a moment within an epoch (>= 6) that the keeper has kept: every trainer is there
        deadline = time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline, (keeper.events[-3:], trainers[0].events[-3:])
            at = {latest(proc, "epoch") for proc in trainers}
            kept_epoch = latest(keeper, "kept")
            if len(at) == 1 and kept_epoch is not None and kept_epoch in at and kept_epoch >= 6:
                break
            time.sleep(0.02)
        for proc in trainers:
            proc.popen.kill()  # every trainer dies at once, without saving anything
        for proc in trainers:
            proc.finish(30)  # (every epoch it reported is in its events)
        # the epoch the swarm had reached: the highest any trainer reported (one may have
        # ended the next epoch between the check and the kill: the keeper was in that
        # round too)
        reached = max(e["epoch"] for p in trainers for e in p.events if e["event"] == "epoch")
        time.sleep(10)  # their progress records expire (--metadata-expiration 8): only the
        # keeper's record says where the swarm was
        kept = load_checkpoint(tmp_path / "kept")
        assert kept["epoch"] == reached == latest(keeper, "kept"), keeper.events[-3:]
        # the keeper's exports load with plain torch
        plain = torch.load(tmp_path / "kept" / "model.pt")
        assert plain.keys() == kept["model"].keys()
        untrained = mean_loss(module, None)
        assert mean_loss(module, plain) < 0.5 * untrained

        restarted = [start("a"), start("b")]  # no checkpoints of their own
        for proc in restarted:
            for _ in range(2):
                proc.first_line_with('"epoch"', 180)
        for proc in restarted:
            epochs = [e for e in proc.events if e["event"] == "epoch"]
            # the first epoch event is the download of the kept state (its loss is that of
            # the steps made before it, on fresh weights): the epoch the swarm had reached
            assert epochs[0]["epoch"] == reached, proc.events
            assert epochs[-1]["loss"] < 0.5 * untrained, proc.events  # the kept weights
        keeper.popen.send_signal(signal.SIGTERM)
        assert keeper.finish(60) == 0
    finally:
        for proc in procs:
            proc.stop()


def test_keeper_in_process_keeps_nothing_before_the_swarm_moves(tmp_path):
    """A keeper alone (no trainer): it waits, writes no checkpoint, stops on request."""
    import threading

    path = write(tmp_path, TINY_MODULE)
    settings = train_command.resolve_settings(parse(
        "--model-module", str(path), "--run-id", "lonely", "--role", "keeper",
        "--checkpoint-dir", str(tmp_path / "k"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--metrics-period", "0"))  # fmt: skip
    stop = threading.Event()
    trainer = train_command.Trainer(load_model_module(path), settings, stop)
    threading.Timer(3.0, stop.set).start()
    began = time.monotonic()
    assert trainer.run() == 0
    assert time.monotonic() - began < 30
    assert load_checkpoint(tmp_path / "k") is None
