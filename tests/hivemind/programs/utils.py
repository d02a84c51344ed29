"""The run's metrics record and its validators, as hivemind's ALBERT example declares them:
a pydantic.v1 schema whose dictionary subkeys must carry the writer's public key, and a
signature validator so that only that writer may change its entry."""

from __future__ import annotations

from pydantic.v1 import BaseModel, StrictFloat, confloat, conint

from swarmgrad.dht.crypto import RSASignatureValidator
from swarmgrad.dht.schema import BytesWithPublicKey, SchemaValidator
from swarmgrad.dht.validation import RecordValidatorBase
from swarmgrad.utils.logging import get_logger

logger = get_logger(__name__)


class LocalMetrics(BaseModel):
    step: conint(ge=0, strict=True)
    samples_per_second: confloat(ge=0.0, strict=True)
    samples_accumulated: conint(ge=0, strict=True)
    loss: StrictFloat
    mini_steps: conint(ge=0, strict=True)


class MetricSchema(BaseModel):
    metrics: dict[BytesWithPublicKey, LocalMetrics]


def make_validators(run_id: str) -> tuple[list[RecordValidatorBase], bytes]:
    signature_validator = RSASignatureValidator()
    validators = [SchemaValidator(MetricSchema, prefix=run_id), signature_validator]
    return validators, signature_validator.local_public_key
