"""``swarmgrad train`` for real runs: devices, precision, modes and their knobs, the fp16
overflow case, models split across devices, and checkpoints written in the background
and atomically (a full disk keeps the last good one)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from swarmgrad.cli import train_checkpoint, train_command
from swarmgrad.cli.model_module import load_model_module
from swarmgrad.cli.train_checkpoint import (
    CheckpointError,
    CheckpointWriter,
    checkpoint_paths,
    load_checkpoint,
)
from swarmgrad.cli.train_setup import check_model_device, resolve_device
from swarmgrad.utils.errors import ValidationError

MODULE = """
import torch

_w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
SCHEDULER_STEPS = []

def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

def make_dataset():
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(3))
    return torch.utils.data.TensorDataset(x, x @ _w)

def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)

class _Counted(torch.optim.lr_scheduler.LambdaLR):
    def step(self, *args, **kwargs):
        SCHEDULER_STEPS.append(1)
        return super().step(*args, **kwargs)

def make_scheduler(optimizer):
    return _Counted(optimizer, lambda epoch: 1.0)
"""


def write(tmp_path: Path, text: str = MODULE, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def settings_for(module: Path, *argv: str) -> dict:
    return train_command.resolve_settings(
        parse("--model-module", str(module), "--run-id", f"run-{time.monotonic_ns()}",
              "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--metrics-period", "0",
              "--matchmaking-time", "0.5", "--averaging-timeout", "5", *argv)
    )  # fmt: skip


# ---------------------------------------------------------------------- bad input


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_a_gpu_is_refused_before_joining(tmp_path):
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "train", "--model-module",
         str(write(tmp_path)), "--run-id", "r", "--device", "cuda",
         "--initial-peers", "/ip4/127.0.0.1/tcp/9"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--device cuda: torch sees no CUDA device" in result.stderr
    assert "Training" not in result.stdout and "join" not in result.stderr
    assert time.monotonic() - began < 60


def test_device_values_are_checked():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValidationError, match="--device must be auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ValidationError, match="--device must be auto"):
        resolve_device("cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match="--device cuda:1: torch sees no CUDA"):
            resolve_device("cuda:1")


def test_model_on_two_devices_is_refused_naming_them():
    model = torch.nn.Linear(4, 4)
    model.register_buffer("table", torch.zeros(3, device="meta"))
    with pytest.raises(ValidationError, match=r"several devices: cpu \(e\.g\. 'weight'\), "
                                              r"meta \(e\.g\. 'table'\)"):  # fmt: skip
        check_model_device(model, "model module 'm.py'")
    assert check_model_device(torch.nn.Linear(2, 2), "m") == torch.device("cpu")


def test_model_split_across_devices_exits_with_usage_code(tmp_path):
    split = MODULE.replace(
        "def make_model():\n",
        "def make_model():\n    m = torch.nn.Linear(8, 1)\n"
        "    m.register_buffer('b', torch.zeros(1, device='meta'))\n    return m\n",
    )
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "train", "--model-module",
         str(write(tmp_path, split)), "--run-id", "r", "--epochs", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "several devices: cpu (e.g. 'weight'), meta (e.g. 'b')" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--inner-steps", "50"], "--inner-steps applies to --mode diloco or streaming"),
        (["--outer-compression", "8bit"], "--outer-compression applies to --mode diloco"),
        (["--mode", "diloco", "--powersgd-rank", "2"], "--powersgd-rank has no meaning with"),
        (["--mode", "streaming", "--offload"], "--offload has no meaning with --mode streaming"),
        (["--mode", "streaming", "--fragments", "1"], "needs --fragments of 2 or more"),
        (["--mode", "diloco", "--fragments", "3"], "means streaming: use --mode streaming"),
        (["--mode", "local", "--grad-compression", "8bit"], "--mode local averages parameters"),
        (["--mode", "diloco", "--use-local-updates"], "contradicts --mode diloco"),
        (["--mode", "diloco", "--precision", "fp16"], "use --precision bf16"),
        (["--grad-accumulation", "0"], "--grad-accumulation must be a positive int"),
        (["--clip-grad-norm", "-1"], "--clip-grad-norm must be a finite number > 0"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be a positive int"),
        (["--delay", "--no-offload"], "cannot go with --no-offload"),
    ],
)
def test_options_that_cannot_work_together_are_refused_by_name(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("-", r"\-")):
        settings_for(tmp_path / "m.py", *argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "local", "--offload"],
        ["--mode", "local", "--delay"],
        ["--precision", "fp16", "--clip-grad-norm", "1"],
    ],
)
def test_options_the_optimizer_now_supports_are_accepted(tmp_path, argv):
    """Once refused as workarounds: local steps on an offloaded copy (which nothing
    filled) and fp16 with clipping in sync mode (which needed the gradients accumulated
    in .grad, where a step's own gradient is not kept apart)."""
    s = settings_for(tmp_path / "m.py", *argv)
    assert s["offload"] is True or "--clip-grad-norm" in argv


def test_config_file_takes_the_new_options(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text(
        'mode = "streaming"\nfragments = 3\ninner-steps = 20\nouter-compression = "4bit"\n'
        'precision = "bf16"\ndevice = "cpu"\nkeep_checkpoints = 5\n'
    )
    s = train_command.resolve_settings(
        parse("--config", str(config), "--model-module", "m.py", "--run-id", "r")
    )
    assert (s["mode"], s["fragments"], s["inner_steps"], s["outer_compression"]) == (
        "streaming", 3, 20, "4bit")  # fmt: skip
    assert (s["precision"], s["device"], s["keep_checkpoints"]) == ("bf16", "cpu", 5)
    config.write_text("offload = false\n")
    s = train_command.resolve_settings(
        parse("--config", str(config), "--model-module", "m.py", "--run-id", "r")
    )
    assert s["offload"] is False


def test_mode_defaults_are_filled_in(tmp_path):
    assert settings_for(tmp_path / "m.py", "--mode", "streaming")["fragments"] == 4
    assert settings_for(tmp_path / "m.py", "--mode", "diloco")["fragments"] == 1
    assert settings_for(tmp_path / "m.py", "--use-local-updates")["mode"] == "local"


# ---------------------------------------------------------------------- training runs


def train_in_process(module_path: Path, *argv: str, wrap_loss=None) -> tuple[int, object]:
    settings = settings_for(module_path, *argv)
    module = load_model_module(module_path)
    if wrap_loss is not None:
        module = dataclasses.replace(module, loss_fn=wrap_loss(module.loss_fn))
    trainer = train_command.Trainer(module, settings, threading.Event())
    return trainer.run(), trainer


def mean_loss(module_path: Path, state: dict | None) -> float:
    module = load_model_module(module_path)
    torch.manual_seed(0)
    model = module.make_model()
    if state is not None:
        model.load_state_dict(state)
    x, y = module.make_dataset().tensors
    with torch.no_grad():
        return float(module.loss_fn(model, (x, y)))


@pytest.mark.parametrize(
    "argv",
    [
        ["--precision", "bf16", "--grad-accumulation", "2", "--clip-grad-norm", "1.0"],
        ["--mode", "sync", "--powersgd-rank", "2", "--grad-compression", "fp16", "--no-offload"],
        ["--mode", "local", "--precision", "fp16"],
        ["--mode", "local", "--delay", "--precision", "fp16"],
        ["--mode", "sync", "--delay", "--precision", "fp16"],
        ["--mode", "sync", "--precision", "fp16", "--clip-grad-norm", "1.0"],
        [
            "--mode",
            "streaming",
            "--fragments",
            "2",
            "--inner-steps",
            "4",
            "--outer-compression",
            "8bit",
        ],
    ],
    ids=[
        "bf16-accumulation-clip",
        "powersgd",
        "local-fp16",
        "local-delay-fp16",
        "delay-fp16",
        "fp16-clip",
        "streaming-8bit",
    ],
)
def test_one_peer_trains_in_each_mode_and_its_checkpoint_loads(tmp_path, argv):
    path = write(tmp_path)
    code, trainer = train_in_process(
        path, "--target-batch-size", "64", "--batch-size", "16", "--epochs", "4",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
        "--keep-checkpoints", "2", *argv,
    )  # fmt: skip
    assert code == 0
    final = load_checkpoint(tmp_path / "ckpt")
    assert final["epoch"] >= 4
    assert len(checkpoint_paths(tmp_path / "ckpt")) == 2  # --keep-checkpoints 2
    assert all(torch.isfinite(t).all() for t in final["model"].values())
    assert mean_loss(path, final["model"]) < mean_loss(path, None)
    assert trainer.module.make_model.__globals__["SCHEDULER_STEPS"]  # make_scheduler's was used


def test_fp16_overflow_every_step_lowers_the_scale_and_sends_nothing(tmp_path, caplog):
    """Inf gradients at every step for 50 steps: the scale falls at each, the gradients
    are dropped (the swarm is told of no progress, the weights never change) and the
    peer says why it makes no progress."""
    path = write(tmp_path)
    calls = []
    trainer_box = {}

    def wrap(loss_fn):
        def overflowing(model, batch):
            calls.append(1)
            if len(calls) >= 50:
                trainer_box["stop"].set()
            return loss_fn(model, batch) * float("inf")

        return overflowing

    settings = settings_for(path, "--precision", "fp16", "--device", "cpu",
                            "--target-batch-size", "64", "--batch-size", "16")  # fmt: skip
    module = load_model_module(path)
    module = dataclasses.replace(module, loss_fn=wrap(module.loss_fn))
    stop = threading.Event()
    trainer_box["stop"] = stop
    trainer = train_command.Trainer(module, settings, stop)
    seen = {}
    original = train_command.Trainer._make_optimizer

    def keep(self, dht, model):
        seen["model"] = model
        seen["initial"] = {k: v.clone() for k, v in model.state_dict().items()}
        seen["opt"] = original(self, dht, model)
        return seen["opt"]

    with caplog.at_level(logging.INFO, logger="swarmgrad"):
        train_command.Trainer._make_optimizer = keep
        try:
            assert trainer.run() == 0
        finally:
            train_command.Trainer._make_optimizer = original
    assert len(calls) == 50
    scaler = trainer.precision.scaler
    assert scaler.get_scale() < 65536.0 * 0.5**40  # halved at each of the 50 steps
    assert trainer.precision.overflow_steps == 50
    for key, value in seen["model"].state_dict().items():
        assert torch.equal(value, seen["initial"][key]), key  # no step was taken
    opt = seen["opt"]
    assert opt.local_epoch == 0 and opt.tracker.local_progress.samples_accumulated == 0
    assert opt.grad_averager.local_samples_accumulated == 0
    warnings = [r.getMessage() for r in caplog.records if "overflowed" in r.getMessage()]
    assert warnings and "contributes no progress to the swarm" in warnings[-1]
    assert "in the last 50 steps" in warnings[-1]


# ---------------------------------------------------------------------- checkpoints


class Fake:
    """What the writer needs of a model and an optimizer."""

    def __init__(self, epoch: int, size: int = 1000):
        self.local_epoch = epoch
        self.weight = torch.full((size,), float(epoch))

    def state_dict(self) -> dict:
        return {"w": self.weight, "nested": [self.weight[:3]]}


def test_save_returns_before_the_write_and_snapshots_the_tensors(tmp_path, monkeypatch):
    written = threading.Event()
    real = train_checkpoint._serialize

    def slow(state, file):
        time.sleep(1.5)
        real(state, file)
        written.set()

    monkeypatch.setattr(train_checkpoint, "_serialize", slow)
    writer = CheckpointWriter(tmp_path, keep=3)
    model = Fake(1)
    began = time.monotonic()
    writer.save(model, model, samples=7)
    assert time.monotonic() - began < 1.0 and not written.is_set()  # training goes on
    model.weight.fill_(99.0)  # changed while the write runs: the snapshot is unaffected
    path = writer.wait()
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == 1 and state["samples"] == 7
    assert torch.equal(state["model"]["w"], torch.full((1000,), 1.0))


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2)
    for epoch in (1, 2, 3, 4):
        model = Fake(epoch)
        writer.save(model, model)
    writer.wait()
    assert [p.name for p in checkpoint_paths(tmp_path)] == [
        "checkpoint-00000004.pt", "checkpoint-00000003.pt"]  # fmt: skip
    assert load_checkpoint(tmp_path)["epoch"] == 4


def test_a_full_disk_names_the_directory_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    writer = CheckpointWriter(directory, keep=2)
    good = Fake(1)
    writer.save(good, good)
    good_path = writer.wait()

    def disk_full(state, file):
        file.write(b"\0" * 4096)  # part of the file made it to the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_checkpoint, "_serialize", disk_full)
    for epoch in (2, 3):  # not once: the writer keeps working and keeps failing cleanly
        model = Fake(epoch)
        writer.save(model, model)
        with pytest.raises(CheckpointError) as failure:
            writer.wait()
        message = str(failure.value)
        assert repr(str(directory)) in message and "No space left on device" in message
        assert f"the last good checkpoint is kept: {good_path}" in message
    assert sorted(p.name for p in directory.iterdir()) == [good_path.name]  # no partial file
    state = load_checkpoint(directory)
    assert state["epoch"] == 1 and torch.equal(state["model"]["w"], torch.full((1000,), 1.0))


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    writer = CheckpointWriter(tmp_path, keep=3)
    for epoch in (1, 2):
        model = Fake(epoch)
        writer.save(model, model)
    writer.wait()
    (tmp_path / "checkpoint-00000002.pt").write_bytes(b"torn")
    assert load_checkpoint(tmp_path)["epoch"] == 1
    (tmp_path / "checkpoint-00000001.pt").write_bytes(b"torn too")
    with pytest.raises(ValidationError, match=r"no usable checkpoint: .*checkpoint-00000002"):
        load_checkpoint(tmp_path)


def test_a_partial_file_left_by_a_crash_is_cleaned_up(tmp_path):
    (tmp_path / ".checkpoint-abc.part").write_bytes(b"half")
    CheckpointWriter(tmp_path)
    assert not list(tmp_path.glob("*.part"))


# ---------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch sees no GPU)"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_peer_trains_on_cuda_and_its_checkpoint_loads_on_cpu(tmp_path, precision):
    path = write(tmp_path)
    code, trainer = train_in_process(
        path, "--device", "cuda", "--precision", precision, "--target-batch-size", "64",
        "--batch-size", "16", "--epochs", "4", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "1",
    )  # fmt: skip
    assert code == 0 and trainer.device.type == "cuda"
    final = load_checkpoint(tmp_path / "ckpt")
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in final["model"].values())
    assert mean_loss(path, final["model"]) < mean_loss(path, None)


@pytest.mark.gpu
@needs_cuda
def test_snapshot_of_cuda_tensors_is_a_host_copy():
    from swarmgrad.cli.train_checkpoint import snapshot_to_host

    source = {"w": torch.arange(1000.0, device="cuda"), "n": [torch.ones(3, device="cuda")]}
    copy = snapshot_to_host(source)
    source["w"].zero_()
    assert copy["w"].device.type == "cpu" and torch.equal(copy["w"], torch.arange(1000.0))
    assert torch.equal(copy["n"][0], torch.ones(3))


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str):
    """A real filesystem of ``size`` at ``path`` (root only; unmounted afterwards)."""
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


BIG_MODULE = MODULE.replace(
    "torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)",
    "torch.nn.Linear(8, 8000), torch.nn.Tanh(), torch.nn.Linear(8000, 1)",
)  # 80k parameters: a checkpoint of about 330 kB


def test_a_checkpoint_directory_that_fills_up_keeps_the_last_good_one(tmp_path, capsys):
    """A real full disk (a 900 kB tmpfs: two checkpoints fit, the third's temporary file
    does not): training goes on, the final save fails with exit code 1 naming the
    directory, and the last good checkpoint is intact and loads."""
    path = write(tmp_path, BIG_MODULE)
    with tiny_tmpfs(tmp_path / "disk", "900k") as disk:
        code, _ = train_in_process(
            path, "--target-batch-size", "32", "--batch-size", "16", "--epochs", "5",
            "--checkpoint-dir", str(disk), "--checkpoint-every", "1",
            "--keep-checkpoints", "3",
        )  # fmt: skip
        err = capsys.readouterr().err
        assert code == 1
        assert f"checkpoint not written in {str(disk)!r}" in err
        assert "No space left on device" in err and "the last good checkpoint is kept" in err
        assert not list(disk.glob(".*.part"))  # no partial file left behind
        kept = load_checkpoint(disk)
        assert 1 <= kept["epoch"] < 5
        module = load_model_module(path)
        module.make_model().load_state_dict(kept["model"])
