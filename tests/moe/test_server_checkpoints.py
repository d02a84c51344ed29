"""Expert checkpoints: atomic writes, rotation, restore, fallback past corrupt files."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server.checkpoints import (
    CheckpointSaver,
    list_checkpoints,
    restore_expert,
    save_expert,
)
from swarmgrad.moe.server.module_backend import ModuleBackend
from swarmgrad.moe.server.schedulers import get_linear_schedule_with_warmup


def make_backend(uid: str = "ffn.3") -> ModuleBackend:
    module = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    return ModuleBackend(
        uid,
        module,
        optimizer=optimizer,
        scheduler=get_linear_schedule_with_warmup(optimizer, 1, 100),
        args_schema=BatchTensorDescriptor(4),
    )


def train(backend: ModuleBackend, steps: int = 1) -> None:
    for _ in range(steps):
        backend.backward(torch.randn(2, 4), torch.randn(2, 4))


def weights(backend: ModuleBackend) -> list[torch.Tensor]:
    return [p.detach().clone() for p in backend.module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_save_then_restore_brings_back_weights_optimizer_and_schedule(tmp_path):
    trained = make_backend()
    train(trained, 3)
    path = save_expert(trained, tmp_path)
    assert path.parent == tmp_path / "ffn.3" and path.name.startswith("checkpoint_")
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    fresh = make_backend()
    assert restore_expert(fresh, tmp_path) == path
    assert same(weights(fresh), weights(trained))
    assert fresh.update_count == 3 and fresh.scheduler.last_epoch == 3
    x, g = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(trained.backward(x, g)[0], fresh.backward(x, g)[0])
    assert same(weights(fresh), weights(trained))  # identical Adam state too


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    backend = make_backend()
    paths = []
    for _ in range(7):
        train(backend)
        paths.append(save_expert(backend, tmp_path, keep=3))
    assert list_checkpoints(tmp_path, "ffn.3") == paths[-3:]
    assert paths == sorted(paths)  # names order by time even when written quickly


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, caplog):
    backend = make_backend()
    train(backend)
    good = save_expert(backend, tmp_path)
    good_weights = weights(backend)
    train(backend)
    bad = save_expert(backend, tmp_path)
    bad.write_bytes(bad.read_bytes()[:100])  # truncated, as after a disk error

    fresh = make_backend()
    with caplog.at_level(logging.WARNING, logger="swarmgrad.moe.server.checkpoints"):
        assert restore_expert(fresh, tmp_path) == good
    assert same(weights(fresh), good_weights)
    assert any(bad.name in r.getMessage() and "previous" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_of_another_shape_is_skipped_and_no_checkpoint_means_fresh(tmp_path, caplog):
    other = ModuleBackend("ffn.3", nn.Linear(4, 2), args_schema=BatchTensorDescriptor(4))
    save_expert(other, tmp_path)
    backend = make_backend()
    before = weights(backend)
    with caplog.at_level(logging.WARNING, logger="swarmgrad.moe.server.checkpoints"):
        assert restore_expert(backend, tmp_path) is None
    assert same(weights(backend), before)
    assert any("starting fresh" in r.getMessage() for r in caplog.records)
    assert restore_expert(make_backend("ffn.4"), tmp_path) is None  # nothing saved for it


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    backend = make_backend()
    save_expert(backend, tmp_path)

    def failing_save(obj, file):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_expert(backend, tmp_path)
    assert len(os.listdir(tmp_path / "ffn.3")) == 1


def test_the_saver_thread_writes_periodically_and_stops(tmp_path):
    backends = {"ffn.3": make_backend()}
    saver = CheckpointSaver(backends, tmp_path, interval=0.01, keep=2)
    saver.start()
    try:
        deadline = 200
        while len(list_checkpoints(tmp_path, "ffn.3")) < 2 and deadline:
            saver._stop.wait(0.05)
            deadline -= 1
    finally:
        saver.stop()
    assert len(list_checkpoints(tmp_path, "ffn.3")) == 2
