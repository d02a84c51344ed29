"""SwarmgradStrategy: two Lightning trainers (each its own peer and DHT, threads of this
process, on loopback) train one tiny model together; bad configurations are refused."""

from __future__ import annotations

import threading

import pytest
import torch

pl = pytest.importorskip(
    "lightning.pytorch", reason="the 'lightning' extra is not installed (swarmgrad[lightning])"
)

from swarmgrad.dht import DHT  # noqa: E402
from swarmgrad.integrations.epoch_scheduler import EpochScheduler  # noqa: E402
from swarmgrad.integrations.lightning import HivemindStrategy, SwarmgradStrategy  # noqa: E402
from swarmgrad.utils.errors import ValidationError  # noqa: E402
from tests.helpers.optim import dht_swarm, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
EPOCHS = 5


class TinyRegression(pl.LightningModule):
    """Learns y = (x0 + x1, x2 - x3) with an MLP; the same start on every peer."""

    def __init__(self, schedule: bool = True, optimizers: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )
        self.schedule, self.optimizer_count = schedule, optimizers
        self.automatic_optimization = optimizers == 1  # Lightning refuses two otherwise

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not self.automatic_optimization:
            return None
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer_count > 1:
            return [torch.optim.SGD(self.parameters(), lr=0.5) for _ in range(self.optimizer_count)]
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        if not self.schedule:
            return opt
        # stepped by Lightning after every batch; the strategy makes it once per epoch
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def regression_data(seed: int, size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=generator)
    return x, torch.stack([x[:, 0] + x[:, 1], x[:, 2] - x[:, 3]], dim=1)


def loader(seed: int) -> torch.utils.data.DataLoader:
    x, y = regression_data(seed)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def held_out_loss(module: TinyRegression) -> float:
    x, y = regression_data(seed=999)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(module.net(x), y))


class MeetThenStop(pl.Callback):
    """After the first batch, wait until the peers see each other (a run that starts
    together); stop once the swarm's epoch ``until`` is reached."""

    def __init__(self, peers: int, until: int):
        self.peers, self.until = peers, until

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        opt = trainer.strategy.optimizers[0]
        if batch_idx == 0 and trainer.current_epoch == 0:

            def all_seen() -> bool:
                opt.tracker.refresh(timeout=5)
                return opt.tracker.global_progress.num_peers >= self.peers

            wait_until(all_seen, 30.0, f"{self.peers} peers seeing each other")
        if opt.local_epoch >= self.until:
            trainer.should_stop = True


def make_trainer(strategy: SwarmgradStrategy, *callbacks: pl.Callback, **options) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=options.pop("max_epochs", 50),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **options,
    )


def fit_peers(strategies: list[SwarmgradStrategy], modules: list[TinyRegression]) -> None:
    errors: list[BaseException] = []

    def fit(index: int) -> None:
        try:
            trainer = make_trainer(strategies[index], MeetThenStop(len(strategies), EPOCHS))
            trainer.fit(modules[index], loader(seed=index))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=fit, args=(i,), daemon=True) for i in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a Lightning trainer did not finish in 120 s"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("offload", [False, True], ids=["wrapped", "offloaded"])
def test_two_lightning_peers_end_with_the_same_model_and_a_lower_loss(offload):
    bootstrap = DHT(start=True, host_maddrs=LOOPBACK)
    try:
        address = [str(a) for a in bootstrap.get_visible_maddrs()]
        modules = [TinyRegression(schedule=not offload) for _ in range(2)]
        before = held_out_loss(modules[0])
        extra = {}
        if offload:  # the optimizer is rebuilt: its schedule comes as a factory
            extra = dict(
                offload_optimizer=True,
                scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.8),
            )
        strategies = [
            SwarmgradStrategy(
                target_batch_size=64,
                run_id=f"lightning_test_{offload}",
                initial_peers=address,
                host_maddrs=LOOPBACK,
                matchmaking_time=1.0,
                averaging_timeout=15.0,
                **extra,
            )
            for _ in modules
        ]
        fit_peers(strategies, modules)
    finally:
        bootstrap.shutdown()

    for strategy in strategies:
        assert strategy.dht is None, "the strategy's own DHT is shut down after fit"
    first, second = (list(m.net.parameters()) for m in modules)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the peers trained on different data: equal models mean they averaged every epoch
    after = held_out_loss(modules[0])
    assert after < 0.7 * before, (before, after)
    if not offload:  # Lightning's scheduler stepped once per global epoch, not per batch
        lr = modules[0].trainer.optimizers[0].param_groups[0]["lr"]
        assert lr == pytest.approx(0.5 * 0.8**EPOCHS)


def test_hivemind_name_is_the_same_strategy():
    assert HivemindStrategy is SwarmgradStrategy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(target_batch_size=0), "target_batch_size must be a positive int"),
        (dict(target_batch_size=64, batch_size=-1), "batch_size must be a positive int"),
        (dict(target_batch_size=64, run_id=""), "run_id must be a non-empty str"),
        (dict(target_batch_size=64, scheduler_fn=3), "scheduler_fn must be a factory"),
        (dict(target_batch_size=64, use_lcoal_updates=True), "unknown option 'use_lcoal_updates'"),
        (dict(target_batch_size=64, params=[]), "params is set by SwarmgradStrategy"),
        (dict(target_batch_size=64, initial_peers=[5]), "initial_peers must be multiaddr strings"),
    ],
)
def test_bad_strategy_arguments_are_refused_by_name(options, message):
    with pytest.raises(ValidationError, match=message):
        SwarmgradStrategy(host_maddrs=LOOPBACK, **options)


def test_dht_with_dht_options_is_refused():
    with dht_swarm(1) as (dht,), pytest.raises(ValidationError, match=r"with dht=\.\.\. given"):
        SwarmgradStrategy(target_batch_size=64, dht=dht, initial_peers=["/ip4/1.2.3.4/tcp/1"])


@pytest.mark.parametrize(
    ("module_options", "strategy_options", "trainer_options", "message"),
    [
        ({}, {}, dict(accumulate_grad_batches=2), "accumulate_grad_batches=2"),
        (dict(optimizers=2), {}, {}, "exactly one optimizer"),
        ({}, dict(offload_optimizer=True), {}, "pass\\s+scheduler_fn"),
        (
            {},
            dict(scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)),
            {},
            "scheduler_fn was given too",
        ),
    ],
    ids=["accumulation", "two-optimizers", "scheduler-of-rebuilt-optimizer", "two-schedulers"],
)
def test_configurations_the_swarm_cannot_train_are_refused_at_fit(
    module_options, strategy_options, trainer_options, message
):
    module = TinyRegression(**module_options)
    with dht_swarm(1) as (dht,):
        strategy = SwarmgradStrategy(target_batch_size=64, dht=dht, **strategy_options)
        trainer = make_trainer(strategy, max_epochs=1, **trainer_options)
        with pytest.raises(ValidationError, match=message):
            trainer.fit(module, loader(seed=0))
        assert dht.peer is not None, "a DHT passed in is not the strategy's to shut down"


def test_a_refused_fit_still_shuts_down_the_strategys_own_dht():
    strategy = SwarmgradStrategy(target_batch_size=64, host_maddrs=LOOPBACK)
    trainer = make_trainer(strategy, max_epochs=1, accumulate_grad_batches=4)
    with pytest.raises(ValidationError, match="accumulate_grad_batches=4"):
        trainer.fit(TinyRegression(), loader(seed=0))
    assert strategy.dht is None
    with pytest.raises(ValidationError, match="torn down"):
        _ = strategy.peer_addresses


def test_epoch_scheduler_follows_jumps_and_refuses_explicit_epochs():
    class Clock:
        local_epoch = 0
        param_groups = [{"lr": 1.0}]

    param = torch.nn.Parameter(torch.zeros(1))
    inner = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([param], lr=1.0), 1, 0.5)
    inner.optimizer.step()  # (torch warns about a scheduler stepped before its optimizer)
    clock = Clock()
    scheduler = EpochScheduler(clock, inner)
    scheduler.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0]  # local steps inside one epoch change nothing
    clock.local_epoch = 3  # e.g. a download of the swarm's state
    scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(0.125)]
    restored = EpochScheduler(clock, torch.optim.lr_scheduler.StepLR(inner.optimizer, 1, 0.5))
    restored.load_state_dict(scheduler.state_dict())
    assert restored.epochs_applied == 3
    with pytest.raises(ValidationError, match="without an epoch"):
        scheduler.step(epoch=7)
    with pytest.raises(ValidationError, match="not an EpochScheduler state"):
        scheduler.load_state_dict({"last_epoch": 3})
    with pytest.raises(ValidationError, match="needs a swarmgrad Optimizer"):
        EpochScheduler(inner.optimizer)


def test_the_training_loss_goes_into_the_peers_metrics_record():
    """Lightning steps the optimizer with a closure that returns the loss: the Optimizer
    reports it for swarmgrad monitor by itself."""
    seen: list[tuple[float, float | None]] = []

    class Capture(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            record = trainer.strategy.optimizers[0].metrics.make_record()
            seen.append((float(outputs["loss"]), record.loss))

    strategy = SwarmgradStrategy(
        target_batch_size=64, run_id="lightning_metrics", host_maddrs=LOOPBACK
    )
    make_trainer(strategy, Capture(), max_steps=3).fit(TinyRegression(), loader(seed=0))
    assert len(seen) == 3
    for loss, reported in seen:
        assert reported == pytest.approx(loss)
