"""``MetricsPublisher`` and how the collaborative optimizers start it."""

from __future__ import annotations

import logging
import math

import pydantic
import pytest
import torch

from swarmgrad.dht import DHT
from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.schema import BytesWithPublicKey, SchemaValidator
from swarmgrad.optim import Optimizer
from swarmgrad.optim.metrics import MetricsPublisher, PeerMetrics, metrics_key
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.optim import make_model, make_optimizer, wait_until


@pytest.fixture(scope="module")
def dht():
    node = DHT(start=True)
    try:
        yield node
    finally:
        node.shutdown()


def _published(dht: DHT, run_id: str) -> dict:
    found = dht.get(metrics_key(run_id), latest=True)
    if found is None:
        return {}
    return {
        subkey: PeerMetrics.model_validate(entry.value, strict=True)
        for subkey, entry in found.value.items()
        if entry.value is not None
    }


def test_records_carry_the_mean_loss_since_the_previous_one_and_leave_on_shutdown(dht):
    publisher = MetricsPublisher(dht, "pub", lambda: {"epoch": 3}, period=0.2, start=False)
    publisher.report_loss(1.0)
    publisher.report_loss(torch.tensor(2.0))
    publisher.report_loss(math.inf)  # left out
    record = publisher.make_record()
    assert record.loss == 1.5 and record.epoch == 3
    assert record.peer_id == dht.peer_id.to_bytes()
    assert publisher.make_record().loss == 1.5  # nothing new: the last mean stays
    publisher.start()
    try:
        wait_until(lambda: publisher.published >= 2, 30, "two records")
        (stored,) = _published(dht, "pub").values()
        assert stored.epoch == 3 and stored.loss == 1.5
    finally:
        publisher.shutdown()
    assert not publisher.is_alive()
    assert _published(dht, "pub") == {}  # the goodbye hides the record


def test_bad_losses_and_options_are_refused_by_name(dht):
    with pytest.raises(ValidationError, match="period"):
        MetricsPublisher(dht, "x", period=0, start=False)
    with pytest.raises(ValidationError, match="expiration"):
        MetricsPublisher(dht, "x", period=10, expiration=5, start=False)
    with pytest.raises(ValidationError, match="run_id"):
        MetricsPublisher(dht, "", start=False)
    publisher = MetricsPublisher(dht, "x", start=False)
    with pytest.raises(ValidationError, match="scalar loss"):
        publisher.report_loss(torch.ones(3))
    with pytest.raises(ValidationError, match="must be a number"):
        publisher.report_loss("0.5")


def test_a_failing_collect_is_skipped_and_a_record_too_big_loses_its_expert_list(dht, caplog):
    calls = []
    uids = [f"e{i:02d}{'x' * 253}" for i in range(100)]  # 64 listed of 256 characters

    def collect() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return {"role": "server", "experts": uids}

    publisher = MetricsPublisher(dht, "big", collect, period=0.2)
    try:
        wait_until(lambda: publisher.published >= 1, 30, "a record")
        assert publisher.is_alive()
        record = publisher.last_record
        assert record.num_experts == 100 and record.experts == []
    finally:
        publisher.shutdown()
    assert "could not collect" in caplog.text and "without the list of experts" in caplog.text


def test_optimizer_publishes_by_default_reports_the_closures_loss_and_can_opt_out(dht):
    model = make_model()
    opt = make_optimizer(dht, model, run_id="opt", metrics={"period": 0.2})
    try:
        assert isinstance(opt.metrics, MetricsPublisher)

        def closure() -> torch.Tensor:
            loss = model(torch.ones(4, 8)).square().mean()
            loss.backward()
            return loss

        loss = opt.step(closure, batch_size=4)
        wait_until(
            lambda: any(r.loss is not None for r in _published(dht, "opt").values()),
            30,
            "the closure's loss in the record",
        )
        (record,) = _published(dht, "opt").values()
        assert record.loss == pytest.approx(loss.item())
        assert record.role == "trainer" and record.epoch == 0
    finally:
        opt.shutdown()
    silent = make_optimizer(dht, make_model(), run_id="quiet", metrics=False)
    try:
        assert silent.metrics is None
        silent.report(1.0)  # nothing to report to: no error
    finally:
        silent.shutdown()


def test_diloco_mode_publishes_its_record_too(dht):
    model = make_model()
    opt = Optimizer(
        dht=dht,
        run_id="diloco",
        target_batch_size=64,
        batch_size_per_step=8,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        params=model.parameters(),
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7),
        matchmaking_time=1.0,
        metrics={"period": 0.2},
    )
    try:
        opt.report(0.75)
        wait_until(lambda: _published(dht, "diloco"), 30, "the DiLoCo peer's record")
        wait_until(
            lambda: next(iter(_published(dht, "diloco").values())).loss == 0.75, 30, "its loss"
        )
    finally:
        opt.shutdown()


def test_an_averagers_step_that_finds_nobody_counts_as_a_failed_round(dht):
    from swarmgrad.averaging.averager import DecentralizedAverager

    averager = DecentralizedAverager(
        [torch.zeros(4)], dht, prefix="alone", start=True, min_matchmaking_time=0.2
    )
    try:
        assert averager.step(timeout=1.0) is None
        assert (averager.rounds_succeeded, averager.rounds_failed) == (0, 1)
    finally:
        averager.shutdown()


class _AlbertLocalMetrics(pydantic.BaseModel):
    """hivemind's ALBERT example's per-peer record (its ``utils.py``), which it keeps
    under ``f"{run_id}_metrics"``."""

    step: pydantic.StrictInt
    samples_per_second: pydantic.StrictFloat
    samples_accumulated: pydantic.StrictInt
    loss: pydantic.StrictFloat
    mini_steps: pydantic.StrictInt


class _AlbertMetricSchema(pydantic.BaseModel):
    metrics: dict[BytesWithPublicKey, _AlbertLocalMetrics]


class _Warnings(logging.Handler):
    """Collects swarmgrad's warnings on its own logger (caplog's root handler misses them
    once a CLI test in the same session stopped swarmgrad's records propagating)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_our_records_do_not_clash_with_the_albert_examples_metrics_key():
    """A peer of hivemind's ALBERT example validates ``{run_id}_metrics`` with its own
    schema. Our records live under another key: a trainer next to it stores its record
    without being refused, and the example's own record under its key is unaffected.
    (Both used the same key: every store of ours was refused there, with a warning.)"""
    run_id = "albert"
    albert = DHT(start=True)  # its validators as the example adds them: signatures, schema
    albert_signer = Ed25519SignatureValidator(albert.peer.identity)
    albert.add_validators([albert_signer, SchemaValidator(_AlbertMetricSchema, prefix=run_id)])
    ours = DHT(initial_peers=[str(a) for a in albert.get_visible_maddrs()], start=True)
    publisher = MetricsPublisher(ours, run_id, lambda: {"epoch": 2}, period=0.2, start=False)
    warnings, swarmgrad_logger = _Warnings(), logging.getLogger("swarmgrad")
    swarmgrad_logger.addHandler(warnings)
    try:
        publisher.start()
        wait_until(lambda: publisher.published >= 2, 30, "two records")

        def stored_on_albert() -> bool:
            found = albert.get(metrics_key(run_id), latest=True)
            return found is not None and any(
                e.value is not None and e.value.get("epoch") == 2 for e in found.value.values()
            )

        wait_until(stored_on_albert, 30, "our record on the ALBERT example's peer")
        assert not [m for m in warnings.messages if "refused to store" in m]

        theirs = {"step": 1, "samples_per_second": 2.0, "samples_accumulated": 3, "loss": 4.0,
                  "mini_steps": 1}  # fmt: skip
        mine = albert_signer.local_public_key
        assert albert.store(f"{run_id}_metrics", theirs, get_dht_time() + 60, subkey=mine)
        found = albert.get(f"{run_id}_metrics", latest=True)
        assert found.value[mine].value == theirs
        assert metrics_key(run_id) == "albert_peer_metrics"
    finally:
        swarmgrad_logger.removeHandler(warnings)
        publisher.shutdown()
        ours.shutdown()
        albert.shutdown()
