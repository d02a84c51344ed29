"""``swarmgrad train``: the model module's checks, the settings, and two trainers on
loopback, one of them stopped and restarted from its checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from swarmgrad.cli import train_command
from swarmgrad.cli.model_module import ModelModuleError, load_model_module
from swarmgrad.cli.train_checkpoint import load_checkpoint

#: a complete model module: linear regression on a fixed random problem
TINY_MODULE = """
import time

import torch

_w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))

def make_model():
    return torch.nn.Linear(8, 1)

def make_dataset():
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(3))
    return torch.utils.data.TensorDataset(x, x @ _w)

def loss_fn(model, batch):
    time.sleep(0.01)  # a step takes time, as on real data
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
"""


def write(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------- bad modules


def test_complete_module_loads_with_its_functions(tmp_path):
    module = load_model_module(write(tmp_path, TINY_MODULE))
    assert isinstance(module.make_model(), torch.nn.Module)
    assert module.batches is None and module.make_dataset is not None
    assert module.configure is None


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ModelModuleError, match=r"'.*nowhere\.py' does not exist"):
        load_model_module(tmp_path / "nowhere.py")


def test_module_that_fails_to_import_says_why(tmp_path):
    path = write(tmp_path, "import torch\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ModelModuleError, match="failed to import: RuntimeError: no GPU here"):
        load_model_module(path)
    broken = write(tmp_path, "def make_model(:\n", "broken.py")
    with pytest.raises(ModelModuleError, match=r"broken\.py. failed to import: SyntaxError"):
        load_model_module(broken)


@pytest.mark.parametrize("missing", ["make_model", "loss_fn"])
def test_missing_required_function_is_named(tmp_path, missing):
    text = TINY_MODULE.replace(f"def {missing}(", f"def renamed_{missing}(")
    with pytest.raises(ModelModuleError, match=f"defines no {missing}; expected make_model"):
        load_model_module(write(tmp_path, text))


def test_module_without_data_or_with_both_kinds_is_refused(tmp_path):
    no_data = TINY_MODULE.replace("def make_dataset(", "def data(")
    with pytest.raises(ModelModuleError, match="defines neither batches nor make_dataset"):
        load_model_module(write(tmp_path, no_data))
    both = TINY_MODULE + "\ndef batches(batch_size, seed):\n    yield None\n"
    with pytest.raises(ModelModuleError, match="defines both batches and make_dataset"):
        load_model_module(write(tmp_path, both, "both.py"))


def test_name_that_is_not_a_function_is_refused(tmp_path):
    text = TINY_MODULE + "\nloss_fn = 3\n"
    with pytest.raises(ModelModuleError, match="loss_fn must be a function, got int"):
        load_model_module(write(tmp_path, text))


def test_options_need_configure_and_its_errors_are_reported(tmp_path):
    with pytest.raises(ModelModuleError, match=r"no configure\(options\).*\['width'\]"):
        load_model_module(write(tmp_path, TINY_MODULE), {"width": "8"})
    from swarmgrad.cli import demo_model

    with pytest.raises(ModelModuleError, match=r"configure.*unknown options \['depth'\]"):
        load_model_module(demo_model.__file__, {"depth": "3"})


def test_cli_exits_with_usage_code_naming_the_missing_function(tmp_path):
    path = write(tmp_path, TINY_MODULE.replace("def loss_fn(", "def loss(")).as_posix()
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "train", "--model-module", path,
         "--run-id", "r"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "swarmgrad train: error:" in result.stderr
    assert "defines no loss_fn" in result.stderr


# ---------------------------------------------------------------------- settings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_config_file_fills_options_and_command_line_wins(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text(
        'model-module = "m.py"\nrun_id = "from-file"\nbatch-size = 8\n'
        "[module_options]\nwidth = 32\nlayers = 1\n"
    )
    settings = train_command.resolve_settings(parse("--config", str(config), "--run-id", "cli"))
    assert settings["model_module"] == "m.py"
    assert settings["run_id"] == "cli"
    assert settings["batch_size"] == 8
    assert settings["module_options"] == {"width": "32", "layers": "1"}
    assert settings["target_batch_size"] == train_command.DEFAULTS["target_batch_size"]


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--run-id is required"):
        train_command.resolve_settings(parse("--model-module", "m.py"))
    with pytest.raises(ValueError, match="--batch-size must be positive"):
        train_command.resolve_settings(parse("--model-module", "m.py", "--run-id", "r",
                                             "--batch-size", "0"))  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE items, got 'width'"):
        train_command.resolve_settings(parse("--model-module", "m.py", "--run-id", "r",
                                             "--module-options", "width"))  # fmt: skip
    config = tmp_path / "bad.json"
    config.write_text('{"run_id": "r", "expert_cls": "ffn"}')
    with pytest.raises(ValueError, match=r"unknown options \['expert_cls'\]"):
        train_command.resolve_settings(parse("--config", str(config)))


# ---------------------------------------------------------------------- end to end


class Proc:
    """A swarmgrad command whose stdout JSON events are collected on a thread."""

    def __init__(self, *argv: str, log: Path):
        self.log = open(log, "w")  # closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "swarmgrad.cli.main", *argv],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))
        self.lines.put(None)

    def first_line_with(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            line = self.lines.get(timeout=left)
            if line is None:
                break
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}; log: {Path(self.log.name).read_text()}")

    def finish(self, timeout: float) -> int:
        code = self.popen.wait(timeout)
        self.reader.join(30)  # every line it printed is in self.events
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self.log.close()


def mean_loss(module_path: Path, state: dict | None) -> float:
    module = load_model_module(module_path)
    torch.manual_seed(0)
    model = module.make_model()
    if state is not None:
        model.load_state_dict(state)
    x, y = module.make_dataset().tensors
    with torch.no_grad():
        return float(module.loss_fn(model, (x, y)))


@pytest.mark.slow
def test_two_trainers_train_together_and_one_resumes_from_its_checkpoint(tmp_path):
    module = write(tmp_path, TINY_MODULE)
    procs: list[Proc] = []
    try:
        boot = Proc("dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", log=tmp_path / "boot.log")
        procs.append(boot)
        address = boot.first_line_with("--initial-peers", 60).split()[-1]

        def trainer(name: str, *epochs: str) -> Proc:
            proc = Proc(
                "train", "--model-module", str(module), "--run-id", "e2e",
                "--initial-peers", address, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                "--target-batch-size", "256", "--batch-size", "16", *epochs,
                "--matchmaking-time", "1", "--averaging-timeout", "5",
                "--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", "1",
                "--progress-json", log=tmp_path / f"{name}-{len(procs)}.log",
            )  # fmt: skip
            procs.append(proc)
            return proc

        b = trainer("b")  # until stopped: it is there for both of a's runs
        a = trainer("a", "--epochs", "3")  # started together, so they begin together
        for proc in (b, a):
            proc.first_line_with('"ready"', 120)
        assert a.finish(180) == 0
        first = load_checkpoint(tmp_path / "a")["epoch"]  # 3, or later if it downloaded
        assert first >= 3
        assert any(e.get("peers") == 2 for e in a.events if e["event"] == "epoch"), a.events

        # the same checkpoint directory: it resumes
        again = trainer("a", "--epochs", str(first + 3))
        again.first_line_with('"ready"', 120)
        assert again.events[0]["resumed_epoch"] == first
        assert again.finish(180) == 0
        b.popen.send_signal(signal.SIGTERM)  # stops, saving a checkpoint first
        assert b.finish(60) == 0
        epochs = [e["epoch"] for e in again.events if e["event"] == "epoch"]
        assert epochs and min(epochs) > first, again.events  # never started over from 0
        final_a, final_b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
        assert final_a["epoch"] >= first + 3 and final_b["epoch"] >= final_a["epoch"]
        untrained = mean_loss(module, None)
        assert mean_loss(module, final_a["model"]) < 0.5 * untrained
        assert mean_loss(module, final_b["model"]) < 0.5 * untrained
    finally:
        for proc in procs:
            proc.stop()


def run_solo(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = write(tmp_path, text).as_posix()
    return subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "train", "--model-module", path,
         "--run-id", "solo", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--epochs", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_failures_found_when_training_begins_are_named(tmp_path):
    broken_model = TINY_MODULE.replace(
        "return torch.nn.Linear(8, 1)", "raise MemoryError('model too big')"
    )
    result = run_solo(tmp_path, broken_model)
    assert result.returncode == 2, result.stderr
    assert "make_model() failed: MemoryError: model too big" in result.stderr
    no_data = TINY_MODULE.replace("torch.randn(512, 8,", "torch.randn(4, 8,")
    result = run_solo(tmp_path, no_data)  # 4 samples: not one batch of 32
    assert result.returncode == 2, result.stderr
    assert "its data gave no batch of 32 samples" in result.stderr
