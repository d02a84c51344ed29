"""The stage protocol of SWARM pipelines: RPC names, messages and the DHT record.

A pipeline named ``name`` is a model split into ``num_stages`` stages; stage ``i`` is
served by any number of peers. A trainer sends each micro-batch through one server per
stage (:mod:`swarmgrad.pipeline.client`); a stage server (:mod:`swarmgrad.pipeline.server`)
answers three RPCs:

``pipeline.info``      :class:`InfoRequest` -> :class:`StageInfo` (the stage's schemas)
``pipeline.forward``   :class:`ForwardRequest` -> :class:`ForwardAnswer` (activations)
``pipeline.backward``  :class:`BackwardRequest` -> :class:`BackwardAnswer` (input grads;
                       the server also steps its optimizer, as an expert server does)

Every request names the pipeline and the stage it is meant for; a server serving another
stage (it moved, or the caller's record is stale) refuses it, naming both. Tensors travel
as in :mod:`swarmgrad.compression.wire`; the request names the codec (``"none"`` or an
8-bit one, the SWARM paper's choice) for the request's tensors and the answer's.

DHT record: key :func:`stage_key` (``"<name>.stage.<i>"``), subkey the server's PeerID
(base58), value :class:`StageRecord` (addresses, measured throughput, queue), refreshed by
the server before it expires. Messages are versioned; unknown fields are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch

from swarmgrad.compression.serialized import CompressionType
from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.moe.protocol import (
    BatchTensorDescriptor,
    check_batch,
    schema_from_message,
    schema_to_message,
)
from swarmgrad.utils.errors import CodecError, ProtocolViolation, ValidationError

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INFO",
    "PROTOCOL_VERSION",
    "RPC_PREFIX",
    "BackwardAnswer",
    "BackwardRequest",
    "ForwardAnswer",
    "ForwardRequest",
    "InfoRequest",
    "StageInfo",
    "StageRecord",
    "check_outputs",
    "check_pipeline_name",
    "codecs_for",
    "stage_key",
]

RPC_PREFIX = "pipeline"
INFO, FORWARD, BACKWARD = f"{RPC_PREFIX}.info", f"{RPC_PREFIX}.forward", f"{RPC_PREFIX}.backward"
PROTOCOL_VERSION = 1
MAX_STAGES = 4096
_CODECS = tuple(c.value for c in CompressionType)


def codecs_for(tensors: Sequence[torch.Tensor], codec: CompressionType) -> list[CompressionType]:
    """``codec`` for floating-point tensors, none for the others (token ids, masks): lossy
    codecs are for activations. The codecs are deterministic, so the same tensor sent
    twice (forward, then backward) decodes to the same values on the server."""
    codec = _codec(codec, "compression", ValidationError)
    return [codec if t.is_floating_point() else CompressionType.NONE for t in tensors]


def check_pipeline_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 128 or any(c.isspace() for c in name):
        raise ValidationError(
            f"a pipeline name must be a non-empty string of at most 128 characters without "
            f"spaces, got {name!r:.140}"
        )
    return name


def stage_key(pipeline: str, stage: int) -> str:
    """The DHT key under which the servers of ``stage`` announce themselves."""
    return f"{check_pipeline_name(pipeline)}.stage.{int(stage)}"


def _field(message: Any, key: str, what: str, error: type[Exception] = ValidationError) -> Any:
    if not isinstance(message, dict) or key not in message:
        raise error(f"a {what} message must be a dict with a {key!r} field")
    return message[key]


def _int(value: Any, what: str, low: int, high: int, error: type[Exception]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise error(f"{what} must be an integer in [{low}, {high}], got {value!r:.60}")
    return value


def _codec(value: Any, what: str, error: type[Exception]) -> CompressionType:
    if value not in _CODECS:
        raise error(f"{what}: unknown codec {value!r:.60}; expected one of {_CODECS}")
    return CompressionType(value)


def _tensors(message: Any, what: str, error: type[Exception]) -> tuple[torch.Tensor, ...]:
    try:
        return tuple(tensors_from_message(message, what=what))
    except CodecError as e:
        raise error(str(e)) from None


@dataclass(frozen=True)
class _Addressed:
    """The fields every stage request starts with: which pipeline and stage it is for."""

    pipeline: str
    stage: int

    def _head(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "pipeline": self.pipeline, "stage": self.stage}

    @staticmethod
    def _decode_head(message: Any, what: str) -> tuple[str, int]:
        pipeline = _field(message, "pipeline", what)
        if not isinstance(pipeline, str):
            raise ValidationError(f"{what}: the pipeline name must be a string")
        stage = _int(
            _field(message, "stage", what), f"{what}: stage", 0, MAX_STAGES, ValidationError
        )
        return pipeline, stage


@dataclass(frozen=True)
class InfoRequest(_Addressed):
    def encode(self) -> dict[str, Any]:
        return self._head()

    @classmethod
    def decode(cls, message: Any) -> InfoRequest:
        return cls(*cls._decode_head(message, INFO))


@dataclass(frozen=True)
class StageInfo:
    """What a stage takes and returns (batch dimension implicit) and its batch limit."""

    stage: int
    num_stages: int
    args_schema: tuple[BatchTensorDescriptor, ...]
    outputs_schema: tuple[BatchTensorDescriptor, ...]
    max_batch_size: int

    def encode(self) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "stage": self.stage,
            "num_stages": self.num_stages,
            "args_schema": schema_to_message(self.args_schema),
            "outputs_schema": schema_to_message(self.outputs_schema),
            "max_batch_size": self.max_batch_size,
        }

    @classmethod
    def decode(cls, message: Any) -> StageInfo:
        """Parse an answer; a malformed one is the server's fault (ProtocolViolation)."""
        what = f"{INFO} answer"
        try:
            stage = _int(_field(message, "stage", what), "stage", 0, MAX_STAGES, ValidationError)
            num_stages = _int(
                _field(message, "num_stages", what), "num_stages", 1, MAX_STAGES, ValidationError
            )
            args = schema_from_message(_field(message, "args_schema", what))
            outputs = schema_from_message(_field(message, "outputs_schema", what))
            limit = _int(
                _field(message, "max_batch_size", what), "max_batch_size", 1, 1 << 30,
                ValidationError,
            )  # fmt: skip
        except ValidationError as e:
            raise ProtocolViolation(f"malformed {what}: {e}") from None
        return cls(stage, num_stages, args, outputs, limit)


@dataclass(frozen=True)
class _TensorRequest(_Addressed):
    """A stage request that carries tensors (the fields named in ``_TENSOR_FIELDS``, in
    this order after the address) and ``compression``, the codec of the tensors both ways."""

    _WHAT: ClassVar[str]
    _TENSOR_FIELDS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        codec = _codec(self.compression, "compression", ValidationError)  # type: ignore[attr-defined]
        object.__setattr__(self, "compression", codec)

    def encode(self) -> dict[str, Any]:
        codec: CompressionType = self.compression  # type: ignore[attr-defined]
        message = {**self._head(), "compression": codec.value}
        for name in self._TENSOR_FIELDS:
            tensors = getattr(self, name)
            message[name] = tensors_to_message(tensors, codecs_for(tensors, codec))
        return message

    @classmethod
    def decode(cls, message: Any) -> Self:
        what = cls._WHAT
        pipeline, stage = cls._decode_head(message, what)
        codec = _codec(message.get("compression", "none"), what, ValidationError)
        tensors = [
            _tensors(_field(message, name, what), name, ValidationError)
            for name in cls._TENSOR_FIELDS
        ]
        return cls(pipeline, stage, *tensors, codec)  # type: ignore[call-arg]


@dataclass(frozen=True)
class ForwardRequest(_TensorRequest):
    inputs: tuple[torch.Tensor, ...]
    compression: CompressionType = CompressionType.NONE

    _WHAT: ClassVar[str] = FORWARD
    _TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("inputs",)


@dataclass(frozen=True)
class BackwardRequest(_TensorRequest):
    inputs: tuple[torch.Tensor, ...]
    grad_outputs: tuple[torch.Tensor, ...]
    compression: CompressionType = CompressionType.NONE

    _WHAT: ClassVar[str] = BACKWARD
    _TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("inputs", "grad_outputs")


@dataclass(frozen=True)
class _TensorAnswer:
    """A stage's answer: one tuple of tensors (the field named ``_TENSOR_FIELD``), sent in
    the codec the request asked for."""

    _WHAT: ClassVar[str]
    _TENSOR_FIELD: ClassVar[str]

    def encode(self, compression: CompressionType) -> dict[str, Any]:
        tensors = getattr(self, self._TENSOR_FIELD)
        return {
            "v": PROTOCOL_VERSION,
            self._TENSOR_FIELD: tensors_to_message(tensors, codecs_for(tensors, compression)),
        }

    @classmethod
    def decode(cls, message: Any) -> Self:
        name = cls._TENSOR_FIELD
        field = _field(message, name, f"{cls._WHAT} answer", ProtocolViolation)
        return cls(_tensors(field, name, ProtocolViolation))  # type: ignore[call-arg]


@dataclass(frozen=True)
class ForwardAnswer(_TensorAnswer):
    outputs: tuple[torch.Tensor, ...]

    _WHAT: ClassVar[str] = FORWARD
    _TENSOR_FIELD: ClassVar[str] = "outputs"


@dataclass(frozen=True)
class BackwardAnswer(_TensorAnswer):
    grad_inputs: tuple[torch.Tensor, ...]

    _WHAT: ClassVar[str] = BACKWARD
    _TENSOR_FIELD: ClassVar[str] = "grad_inputs"


@dataclass(frozen=True)
class StageRecord:
    """A stage server's DHT entry: where to dial it and how fast it serves.

    ``throughput``: samples per second its device processed lately (forward and backward
    together; 0 before it measured any); ``queue``: samples waiting in its pools when it
    wrote the record."""

    maddrs: tuple[str, ...]
    throughput: float
    queue: int

    def encode(self) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "maddrs": list(self.maddrs),
            "throughput": float(self.throughput),
            "queue": int(self.queue),
        }

    @classmethod
    def decode(cls, message: Any) -> StageRecord:
        """Parse a record; raises ValidationError for a malformed one (callers skip it)."""
        maddrs = _field(message, "maddrs", "stage record")
        if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
            raise ValidationError("stage record: maddrs must be a list of strings")
        throughput = _field(message, "throughput", "stage record")
        if isinstance(throughput, bool) or not isinstance(throughput, int | float):
            raise ValidationError(f"stage record: bad throughput {throughput!r:.40}")
        if not 0 <= throughput < float("inf"):
            raise ValidationError(
                f"stage record: throughput must be finite and >= 0, got {throughput}"
            )
        queue = _int(_field(message, "queue", "stage record"), "queue", 0, 1 << 40, ValidationError)
        return cls(tuple(maddrs), float(throughput), queue)


def check_outputs(
    tensors: Sequence[torch.Tensor],
    schema: Sequence[BatchTensorDescriptor],
    batch_size: int,
    what: str,
) -> None:
    """Raise ProtocolViolation naming ``what``, the tensor and the expected and received
    shape or dtype unless ``tensors`` match ``schema`` with ``batch_size`` rows."""
    try:
        check_batch(tensors, schema, what, batch_size)
    except ValidationError as e:
        raise ProtocolViolation(str(e)) from None
