"""TensorBoard and W&B exporters: of ``swarmgrad train`` (the trainer's figures per
epoch) and of ``swarmgrad monitor`` (each run's figures per swarm epoch); a missing
package is a clear error naming the extra to install."""

from __future__ import annotations

import json
import struct
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from swarmgrad.cli import train_command
from swarmgrad.cli.main import main
from swarmgrad.cli.model_module import load_model_module
from swarmgrad.monitor.exporters import (
    ExporterMissing,
    SnapshotExporter,
    TensorBoardExporter,
    WandbExporter,
    make_exporters,
)

MODULE = """
import time

import torch

_w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))

def make_model():
    return torch.nn.Linear(8, 1)

def make_dataset():
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(3))
    return torch.utils.data.TensorDataset(x, x @ _w)

def loss_fn(model, batch):
    time.sleep(0.03)  # a step takes time, so that the monitor sees the epochs go by
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
"""


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard log directory: tag -> [(step, value)]."""
    accumulator_module = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    accumulator = accumulator_module.EventAccumulator(str(logdir))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_missing_packages_are_named_with_their_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ExporterMissing, match=r"--wandb proj needs the wandb package: "
                                              r"pip install 'swarmgrad\[wandb\]'"):  # fmt: skip
        make_exporters(None, "proj")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ExporterMissing, match=r"--tensorboard tb needs the tensorboard package"):
        make_exporters("tb", None)
    assert make_exporters(None, None) == []


def test_cli_refuses_a_missing_extra_before_joining(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODULE))
    code = main(
        [
            "train",
            "--model-module",
            str(path),
            "--run-id",
            "r",
            "--tensorboard",
            str(tmp_path / "tb"),
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/9",
        ]
    )
    assert code == 2
    assert "pip install 'swarmgrad[tensorboard]'" in capsys.readouterr().err
    code = main(["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/9", "--wandb", "p", "--json"])
    assert code == 2
    assert "not --json" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/9", "--wandb", "p"])
    assert code == 2
    assert "pip install 'swarmgrad[wandb]'" in capsys.readouterr().err


def test_tensorboard_exporter_writes_finite_numbers_only(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    exporter = TensorBoardExporter(str(tmp_path))
    exporter.write(1, {"a": 1.5, "b": None, "c": float("nan"), "d": "text", "e": True})
    exporter.write(2, {"a": 0.5})
    exporter.close()
    assert scalars(tmp_path) == {"a": [(1, 1.5), (2, 0.5)]}


def test_wandb_exporter_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    exporter = WandbExporter("swarmgrad-test", name="peer", config={"batch_size": 16})
    exporter.write(1, {"train/loss": 2.0, "train/peers": 2})
    exporter.write(0, {"train/loss": 1.0})  # a step back is logged at the last step
    exporter.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while not (rows := wandb_history(run)) and time.monotonic() < deadline:
        time.sleep(0.2)  # W&B's writer process may flush after finish() returned
    # one row at step 1: W&B merges what is logged at the same step, the later value wins
    assert [(step, row["train/loss"], row["train/peers"]) for step, row in rows] == [(1, 1, 2)]


def wandb_history(path: Path) -> list[tuple[int, dict]]:
    """The history rows of an offline W&B run file (a LevelDB-style log of protobuf
    records after a 7-byte header): [(step, {key: value})]."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb's record format")
    data, pos, block, pending, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                rows.append((record.history.step.num, items))
    return rows


def test_snapshot_exporter_writes_one_point_per_run_epoch():
    written = []

    class Recorder:
        def write(self, step, values):
            written.append((step, dict(values)))

        def close(self):
            written.append("closed")

    exporter = SnapshotExporter([Recorder()])
    run = {"run_id": "r", "epoch": 3, "num_peers": 2, "loss": 0.5, "samples_per_second": 10.0}
    assert exporter.export({"runs": [run]}) == 1
    assert exporter.export({"runs": [run]}) == 0  # same epoch: nothing new
    assert exporter.export({"runs": [{**run, "epoch": 4, "loss": None}]}) == 1
    assert exporter.export({"runs": [{**run, "epoch": 0, "num_peers": 0}]}) == 0  # all left
    assert exporter.export({"runs": [{**run, "epoch": 2}]}) == 0  # never back in time
    exporter.close()
    assert [w[0] for w in written[:2]] == [3, 4]
    assert written[0][1]["r/loss"] == 0.5 and written[1][1]["r/loss"] is None
    assert written[-1] == "closed"


@pytest.mark.slow
def test_trainer_and_monitor_export_a_real_run_to_tensorboard(tmp_path):
    """A one-peer swarm trained by ``swarmgrad train --tensorboard`` while a Monitor's
    snapshots go through the monitor's exporter: both logs hold the run's epochs."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from swarmgrad.dht import DHT
    from swarmgrad.monitor import Monitor

    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODULE))
    bootstrap = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    watcher = None
    try:
        address = str(bootstrap.get_visible_maddrs()[0])
        parser_args = train_command.resolve_settings(_parse(
            "--model-module", str(path), "--run-id", "exported", "--initial-peers", address,
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--target-batch-size", "128",
            "--batch-size", "16", "--epochs", "6", "--metrics-period", "0.3",
            "--tensorboard", str(tmp_path / "trainer"),
        ))  # fmt: skip
        trainer = train_command.Trainer(load_model_module(path), parser_args, threading.Event())
        result = []
        thread = threading.Thread(target=lambda: result.append(trainer.run()))
        watcher = DHT(initial_peers=[address], client_mode=True, start=True)
        monitor = Monitor(watcher, ["exported"], port=None, poll_interval=0.2)
        exporter = SnapshotExporter(make_exporters(str(tmp_path / "monitor"), None))
        thread.start()
        points = 0
        while thread.is_alive():
            points += exporter.export(monitor.snapshot())
            time.sleep(0.1)
        thread.join()
        time.sleep(1.0)  # the last records reach the DHT
        points += exporter.export(monitor.snapshot())
        exporter.close()
        monitor.shutdown()
        assert result == [0]
    finally:
        if watcher is not None:
            watcher.shutdown()
        bootstrap.shutdown()
    trained = scalars(tmp_path / "trainer")
    assert [step for step, _ in trained["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert trained["train/loss"][-1][1] < trained["train/loss"][0][1]
    watched = scalars(tmp_path / "monitor")
    epochs = [value for _, value in watched["exported/epoch"]]
    assert points >= 2 and len(epochs) == points and epochs[-1] >= 3
    assert epochs == sorted(set(epochs))  # one point per epoch, in order
    assert "exported/num_peers" in watched


def _parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])
