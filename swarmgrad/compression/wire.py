"""Tensors inside RPC messages: a msgpack header plus the payload as an out-of-band Blob.

Every protocol that sends tensors (expert calls, all-reduce parts, state download) uses
these two functions, so the payload bytes are never copied into msgpack and a malformed
tensor from a peer is always reported the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmgrad.compression.base import CompressionBase
from swarmgrad.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from swarmgrad.compression.serialized import CompressionType, SerializedTensor
from swarmgrad.net.rpc import Blob
from swarmgrad.utils.errors import CodecError

__all__ = [
    "serialized_from_message",
    "serialized_to_message",
    "tensors_from_message",
    "tensors_to_message",
]


def serialized_to_message(serialized: SerializedTensor) -> dict[str, Any]:
    """``{"h": header, "b": Blob(payload)}``: the payload travels without a copy."""
    return {"h": serialized.header(), "b": Blob(serialized.buffer)}


def serialized_from_message(message: Any, what: str = "tensor") -> SerializedTensor:
    """Rebuild a :class:`SerializedTensor` from :func:`serialized_to_message` output.

    Raises :class:`CodecError` naming ``what`` when the message is not a tensor message
    or its payload disagrees with its header."""
    if not isinstance(message, dict) or "h" not in message or "b" not in message:
        raise CodecError(f"{what}: expected a tensor message {{'h': header, 'b': payload}}")
    header, buffer = message["h"], message["b"]
    if isinstance(buffer, Blob):  # a message that never left this process
        buffer = buffer.buffer
    if not isinstance(header, dict):
        raise CodecError(f"{what}: malformed tensor header {header!r:.80}")
    try:
        return SerializedTensor.from_header(header, buffer)
    except (CodecError, KeyError, TypeError) as e:
        raise CodecError(f"{what}: {e}") from None


def tensors_to_message(
    tensors: Sequence[torch.Tensor],
    compression: CompressionType | str | CompressionBase | Sequence[Any] = CompressionType.NONE,
) -> list[dict[str, Any]]:
    """Serialize several tensors (one codec for all, or one per tensor)."""
    if isinstance(compression, (str, CompressionBase)):
        codecs = [compression] * len(tensors)
    else:
        codecs = list(compression)
        if len(codecs) != len(tensors):
            raise CodecError(f"{len(codecs)} codecs given for {len(tensors)} tensors")
    return [
        serialized_to_message(serialize_torch_tensor(t.detach(), codec))
        for t, codec in zip(tensors, codecs, strict=True)
    ]


def tensors_from_message(messages: Any, what: str = "tensors") -> list[torch.Tensor]:
    """Decode a list made by :func:`tensors_to_message`; errors name ``what[i]``."""
    if not isinstance(messages, (list, tuple)):
        raise CodecError(f"{what}: expected a list of tensor messages")
    return [
        deserialize_torch_tensor(serialized_from_message(m, f"{what}[{i}]"))
        for i, m in enumerate(messages)
    ]
