"""SchemaValidator with pydantic.v1 models, the kind hivemind's programs declare (the ALBERT
example's metrics schema): strict as v2 schemas, BytesWithPublicKey subkeys, refusals
logged with their reason, and records refused by a real DHT."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional  # noqa: UP035 - pydantic.v1 models as hivemind writes them

import pytest
from pydantic.v1 import BaseModel, StrictFloat, conbytes, confloat, conint

from swarmgrad.dht import DHT
from swarmgrad.dht.crypto import RSASignatureValidator
from swarmgrad.dht.schema import BytesWithPublicKey, SchemaValidator
from swarmgrad.dht.validation import NO_SUBKEY, DHTRecord, serialize
from swarmgrad.net.identity import Identity
from swarmgrad.utils.timeutils import get_dht_time


class LocalMetrics(BaseModel):
    step: conint(ge=0, strict=True)
    samples_per_second: confloat(ge=0.0, strict=True)
    loss: StrictFloat
    tag: conbytes(max_length=4) = b""


class MetricSchema(BaseModel):
    metrics: Dict[BytesWithPublicKey, Optional[LocalMetrics]]  # noqa: UP006, UP045
    epochs: List[conint(ge=0, strict=True)] = []  # noqa: UP006
    name: str = ""


OWNER = RSASignatureValidator(Identity.generate()).local_public_key


def _record(key, value, subkey=NO_SUBKEY):
    subkey = subkey if subkey is NO_SUBKEY else serialize(subkey)
    return DHTRecord(serialize(key), subkey, serialize(value), get_dht_time() + 60)


GOOD = {"step": 3, "samples_per_second": 12.5, "loss": 2.25}


@pytest.fixture
def schema():
    return SchemaValidator(MetricSchema, allow_extra_keys=False, prefix="run")


def test_v1_schema_accepts_well_typed_records(schema):
    assert schema.validate(_record("run_metrics", GOOD, subkey=OWNER))
    assert schema.validate(_record("run_metrics", {**GOOD, "tag": b"ab"}, subkey=OWNER))
    assert schema.validate(_record("run_metrics", None, subkey=b"x" + OWNER))
    assert schema.validate(_record("run_epochs", [0, 5]))
    assert schema.validate(_record("run_name", "albert"))
    assert schema.schemas == (MetricSchema,)


@pytest.mark.parametrize(
    ("key", "value", "subkey", "reason"),
    [
        ("run_metrics", {**GOOD, "loss": 2}, OWNER, "loss"),  # int for StrictFloat
        ("run_metrics", {**GOOD, "step": "3"}, OWNER, "step"),
        ("run_metrics", {**GOOD, "step": -1}, OWNER, "step"),
        ("run_metrics", {**GOOD, "step": True}, OWNER, "step"),
        ("run_metrics", {**GOOD, "tag": b"toolong"}, OWNER, "tag"),
        ("run_metrics", {"step": 3}, OWNER, "samples_per_second"),  # a field missing
        ("run_metrics", GOOD, b"no owner marker", "owner marker"),
        ("run_metrics", GOOD, "a str subkey", "metrics"),
        ("run_epochs", [1, "2"], NO_SUBKEY, "epochs"),
        ("run_epochs", [1.0], NO_SUBKEY, "epochs"),
        ("run_name", 5, NO_SUBKEY, "conversion"),  # v1 would turn 5 into "5"
        ("run_name", b"albert", NO_SUBKEY, "conversion"),
    ],
)
def test_v1_schema_refuses_wrong_types_and_logs_why(schema, caplog, key, value, subkey, reason):
    with caplog.at_level(logging.DEBUG, logger="swarmgrad.dht.schema"):
        assert not schema.validate(_record(key, value, subkey))
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "MetricSchema." in logged and reason in logged, logged


def test_v1_and_v2_schemas_merge():
    import pydantic

    class Other(pydantic.BaseModel):
        name: int

    merged = SchemaValidator(MetricSchema, allow_extra_keys=False)
    assert merged.merge_with(SchemaValidator(Other, allow_extra_keys=False))
    assert merged.validate(_record("name", "text"))  # the v1 schema's type
    assert merged.validate(_record("name", 3))  # the v2 schema's type
    assert not merged.validate(_record("name", 1.5))


def test_dht_refuses_a_record_of_the_wrong_v1_type_and_keeps_the_good_one(caplog):
    validators = [SchemaValidator(MetricSchema, prefix="run"), RSASignatureValidator()]
    owner = validators[1].local_public_key
    with DHT(start=True, record_validators=validators) as dht:
        expiration = get_dht_time() + 60
        assert dht.store("run_metrics", GOOD, expiration, subkey=owner)
        with caplog.at_level(logging.DEBUG, logger="swarmgrad.dht.schema"):
            bad = {**GOOD, "loss": "high"}
            assert not dht.store("run_metrics", bad, expiration + 1, subkey=owner)
        assert any("loss" in r.getMessage() for r in caplog.records)
        stored = dht.get("run_metrics", latest=True)
        assert stored is not None
        assert stored.value[owner].value == GOOD
