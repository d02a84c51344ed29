"""The expert-call protocol: RPC names, message shapes and tensor schemas.

Both the server (:mod:`swarmgrad.moe.server`) and the client (:mod:`swarmgrad.moe.client`)
speak it through this module only. Messages (tensors as in
:mod:`swarmgrad.compression.wire`):

``moe.info``      ``{"uid"}`` -> ``{"uid", "args_schema": [descr], "outputs_schema":
                  [descr], "max_batch_size": int}``
``moe.forward``   ``{"uid", "inputs": [tensor]}`` -> ``{"outputs": [tensor]}``
``moe.backward``  ``{"uid", "inputs": [tensor], "grad_outputs": [tensor]}`` ->
                  ``{"grad_inputs": [tensor]}``

A descriptor is ``{"shape": [instance dims], "dtype": "float32", "requires_grad": bool,
"compression": "none"}``; the leading batch dimension is implicit. Errors travel as the
RPC layer's typed remote errors with a message naming the expert and the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.compression.serialized import CompressionType, dtype_from_name, dtype_name
from swarmgrad.utils.errors import CodecError, ValidationError

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INFO",
    "BatchTensorDescriptor",
    "check_batch",
    "schema_from_message",
    "schema_to_message",
]

INFO = "moe.info"
FORWARD = "moe.forward"
BACKWARD = "moe.backward"


@dataclass(frozen=True, init=False)
class BatchTensorDescriptor:
    """One argument of an expert: every dimension but the leading batch dimension, the
    dtype, whether it needs a gradient, and the codec it travels with.

    ``BatchTensorDescriptor(512)`` describes a ``[batch, 512]`` float32 tensor, as in
    hivemind."""

    instance_shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    compression: CompressionType

    def __init__(
        self,
        *instance_size: int,
        dtype: torch.dtype = torch.float32,
        requires_grad: bool = False,
        compression: CompressionType | str = CompressionType.NONE,
    ):
        if len(instance_size) == 1 and isinstance(instance_size[0], (tuple, list, torch.Size)):
            instance_size = tuple(instance_size[0])
        if not all(isinstance(d, int) and d >= 0 for d in instance_size):
            raise ValidationError(f"instance dimensions must be non-negative ints: {instance_size}")
        object.__setattr__(self, "instance_shape", tuple(instance_size))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "requires_grad", bool(requires_grad))
        object.__setattr__(self, "compression", CompressionType(compression))

    @classmethod
    def from_tensor(
        cls, tensor: torch.Tensor, compression: CompressionType | str = CompressionType.NONE
    ) -> BatchTensorDescriptor:
        """Describe ``tensor`` (its first dimension being the batch)."""
        if tensor.ndim == 0:
            raise ValidationError("a batch tensor needs a leading batch dimension")
        return cls(
            *tensor.shape[1:],
            dtype=tensor.dtype,
            requires_grad=tensor.requires_grad,
            compression=compression,
        )

    @property
    def shape(self) -> tuple[int | None, ...]:
        """The full shape with ``None`` for the batch dimension."""
        return (None, *self.instance_shape)

    def make_zeros(self, batch_size: int, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((batch_size, *self.instance_shape), dtype=self.dtype, **kwargs)

    def to_message(self) -> dict[str, Any]:
        return {
            "shape": list(self.instance_shape),
            "dtype": dtype_name(self.dtype),
            "requires_grad": self.requires_grad,
            "compression": self.compression.value,
        }

    @classmethod
    def from_message(cls, message: Any) -> BatchTensorDescriptor:
        try:
            return cls(
                *message["shape"],
                dtype=dtype_from_name(message["dtype"]),
                requires_grad=message["requires_grad"],
                compression=message.get("compression", "none"),
            )
        except (KeyError, TypeError, ValueError, CodecError) as e:
            raise ValidationError(f"malformed tensor descriptor {message!r:.120}: {e}") from None


def schema_to_message(schema: Sequence[BatchTensorDescriptor]) -> list[dict[str, Any]]:
    return [descriptor.to_message() for descriptor in schema]


def schema_from_message(message: Any) -> tuple[BatchTensorDescriptor, ...]:
    if not isinstance(message, list):
        raise ValidationError(f"a schema must be a list of descriptors, got {message!r:.80}")
    return tuple(BatchTensorDescriptor.from_message(m) for m in message)


def check_batch(
    tensors: Sequence[torch.Tensor],
    schema: Sequence[BatchTensorDescriptor],
    what: str,
    batch_size: int | None = None,
) -> int:
    """Check tensors against a schema; return their common batch size.

    Raises :class:`ValidationError` naming ``what`` (e.g. ``"inputs of expert 'ffn.3'"``),
    the argument index, and the expected and received shape or dtype."""
    if len(tensors) != len(schema):
        raise ValidationError(f"{what}: expected {len(schema)} tensors, got {len(tensors)}")
    for i, (tensor, descriptor) in enumerate(zip(tensors, schema, strict=True)):
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"{what}[{i}]: expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype != descriptor.dtype:
            raise ValidationError(
                f"{what}[{i}]: expected dtype {dtype_name(descriptor.dtype)}, "
                f"got {dtype_name(tensor.dtype)}"
            )
        if tensor.ndim != len(descriptor.shape) or tuple(tensor.shape[1:]) != (
            descriptor.instance_shape
        ):
            expected = ["batch", *descriptor.instance_shape]
            raise ValidationError(
                f"{what}[{i}]: expected shape {expected}, got {list(tensor.shape)}"
            )
        if batch_size is None:
            batch_size = tensor.shape[0]
        elif tensor.shape[0] != batch_size:
            raise ValidationError(
                f"{what}[{i}]: batch size {tensor.shape[0]} differs from {batch_size}"
            )
    return batch_size if batch_size is not None else 0
