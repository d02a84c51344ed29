"""Peers that train a tiny model with ``swarmgrad.Optimizer`` in threads of one process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from swarmgrad.dht import DHT
from swarmgrad.optim import Optimizer

RUN = "test_run"


@contextlib.contextmanager
def dht_swarm(count: int, **options: Any) -> Iterator[list[DHT]]:
    """``count`` DHT peers on loopback, the first one the others' bootstrap."""
    dhts: list[DHT] = []
    try:
        first = DHT(start=True)
        dhts.append(first)
        address = [str(a) for a in first.get_visible_maddrs()]
        for _ in range(count - 1):
            dhts.append(DHT(initial_peers=address, start=True, **options))
        yield dhts
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


def join(dhts: list[DHT], **options: Any) -> DHT:
    """One more DHT peer that joins through the first."""
    dht = DHT(initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()], start=True, **options)
    dhts.append(dht)
    return dht


def make_model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def make_optimizer(dht: DHT, model: torch.nn.Module, **options: Any) -> Optimizer:
    options.setdefault("run_id", RUN)
    options.setdefault("target_batch_size", 64)
    options.setdefault("batch_size_per_step", 8)
    options.setdefault("optimizer", lambda params: torch.optim.SGD(params, lr=0.05))
    options.setdefault("matchmaking_time", 1.0)
    options.setdefault("averaging_timeout", 15.0)
    if "params" not in options and callable(options["optimizer"]):
        options["params"] = model.parameters()
    return Optimizer(dht=dht, **options)


def batch(generator: torch.Generator, size: int = 8, width: int = 8):
    x = torch.randn(size, width, generator=generator)
    y = torch.stack([x[:, 0] + x[:, 1], x[:, 2] - x[:, 3]], dim=1)
    return x, y


def local_step(model: torch.nn.Module, generator: torch.Generator, size: int = 8) -> float:
    x, y = batch(generator, size)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return float(loss.detach())


class Trainer(threading.Thread):
    """Trains ``model`` with ``opt`` in a thread until ``until_epoch`` (or stopped),
    recording the parameters it had when each epoch began. With ``grad_scaler`` (a
    swarmgrad GradScaler) the loss is scaled and the scaler handed to ``opt.step``."""

    def __init__(
        self,
        opt: Optimizer,
        model: torch.nn.Module,
        *,
        seed: int,
        until_epoch: int,
        pause: float = 0.02,
        deadline: float = 90.0,
        batch_size: int = 8,
        on_step: Callable[[Trainer], None] | None = None,
        zero_grad: bool = True,
        grad_scaler: Any = None,
    ):
        super().__init__(daemon=True)
        self.opt, self.model, self.until_epoch, self.pause = opt, model, until_epoch, pause
        self.generator = torch.Generator().manual_seed(seed)
        self.deadline = time.monotonic() + deadline
        self.batch_size, self.on_step, self.zero_grad = batch_size, on_step, zero_grad
        self.grad_scaler = grad_scaler
        self.params_at_epoch: dict[int, list[torch.Tensor]] = {}
        self.losses: list[float] = []
        self.batches: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (epoch, x, y)
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while self.opt.local_epoch < self.until_epoch and not self.stop.is_set():
                if time.monotonic() > self.deadline:
                    raise TimeoutError(f"epoch {self.opt.local_epoch} < {self.until_epoch}")
                epoch = self.opt.local_epoch
                if epoch not in self.params_at_epoch:
                    self.params_at_epoch[epoch] = snapshot(self.model)
                x, y = batch(self.generator, self.batch_size)
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                self.losses.append(float(loss.detach()))
                self.batches.append((epoch, x, y))
                if self.grad_scaler is None:
                    loss.backward()
                    self.opt.step(batch_size=self.batch_size)
                else:
                    self.grad_scaler.scale(loss).backward()
                    self.opt.step(batch_size=self.batch_size, grad_scaler=self.grad_scaler)
                    self.grad_scaler.update()
                if self.zero_grad:
                    self.opt.zero_grad()
                if self.on_step is not None:
                    self.on_step(self)
                time.sleep(self.pause)
            self.params_at_epoch.setdefault(self.opt.local_epoch, snapshot(self.model))
        except BaseException as e:
            self.error = e

    def result(self, timeout: float = 120.0) -> Trainer:
        self.join(timeout)
        assert not self.is_alive(), "the trainer did not finish in time"
        if self.error is not None:
            raise self.error
        return self


def start_together(trainers: list[Trainer], timeout: float = 30.0) -> None:
    """Start the trainers once every one of their trackers sees all of them (peers of a
    run that starts together; a peer that sees nobody would train its first epoch alone)."""
    count = len(trainers)

    def all_seen() -> bool:
        for trainer in trainers:
            trainer.opt.tracker.refresh(timeout=5)
        return all(t.opt.tracker.global_progress.num_peers >= count for t in trainers)

    wait_until(all_seen, timeout, f"{count} peers seeing each other")
    for trainer in trainers:
        trainer.start()


def train_together(opts: list[Optimizer], models: list[torch.nn.Module], until_epoch: int):
    """Train peer i (``opts[i]`` on ``models[i]``, data seed i) until ``until_epoch``,
    all started together; returns the finished trainers (raising a trainer's error)."""
    trainers = [
        Trainer(o, m, seed=i, until_epoch=until_epoch)
        for i, (o, m) in enumerate(zip(opts, models, strict=True))
    ]
    start_together(trainers)
    for trainer in trainers:
        trainer.result()
    return trainers


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True))


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
