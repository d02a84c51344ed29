"""Serialize a tensor with a named codec, and deserialize whatever codec a payload names."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from swarmgrad.compression import floating, four_bit, quantization
from swarmgrad.compression.base import CompressionBase, CompressionInfo, NoCompression
from swarmgrad.compression.serialized import CompressionType, SerializedTensor
from swarmgrad.utils.errors import CodecError, ValidationError

__all__ = [
    "BASE_COMPRESSION_TYPES",
    "deserialize_torch_tensor",
    "get_codec",
    "serialize_torch_tensor",
]

#: One instance of each basic codec, keyed by :class:`CompressionType` member name
#: (``"NONE"``, ``"FLOAT16"``, ...), as in hivemind.
BASE_COMPRESSION_TYPES: Mapping[str, CompressionBase] = MappingProxyType(
    {
        CompressionType.NONE.name: NoCompression(),
        CompressionType.FLOAT16.name: floating.Float16Compression(),
        CompressionType.BFLOAT16.name: floating.BFloat16Compression(),
        CompressionType.MEANSTD_16BIT.name: floating.ScaledFloat16Compression(),
        CompressionType.UNIFORM_8BIT.name: quantization.Uniform8BitQuantization(),
        CompressionType.QUANTILE_8BIT.name: quantization.Quantile8BitQuantization(),
        CompressionType.BLOCKWISE_8BIT.name: quantization.BlockwiseQuantization(),
        CompressionType.BLOCKWISE_4BIT.name: four_bit.Blockwise4BitQuantization(),
    }
)
_BY_WIRE_NAME = {
    CompressionType[name].value: codec for name, codec in BASE_COMPRESSION_TYPES.items()
}


def get_codec(compression: CompressionType | str | CompressionBase) -> CompressionBase:
    """The codec for a :class:`CompressionType`, its wire name (``"float16"``) or member
    name (``"FLOAT16"``); a codec instance is returned as it is."""
    if isinstance(compression, CompressionBase):
        return compression
    if isinstance(compression, str):
        codec = _BY_WIRE_NAME.get(compression) or BASE_COMPRESSION_TYPES.get(compression)
        if codec is not None:
            return codec
    known = ", ".join(member.value for member in CompressionType)
    raise ValidationError(f"unknown compression {compression!r}; expected one of {known}")


def serialize_torch_tensor(
    tensor: torch.Tensor,
    compression_type: CompressionType | str | CompressionBase = CompressionType.NONE,
    info: CompressionInfo | None = None,
    allow_inplace: bool = False,
    **kwargs: Any,
) -> SerializedTensor:
    """Encode ``tensor`` with the given codec (a :class:`CompressionType`, its name, or any
    codec instance such as an adaptive one). ``info`` defaults to one built from the tensor
    and ``kwargs`` (``key=``, ``role=``: :meth:`CompressionInfo.from_tensor`'s, as in
    hivemind).
    """
    codec = get_codec(compression_type)
    if info is None:
        info = CompressionInfo.from_tensor(tensor, **kwargs)
    elif kwargs:
        raise TypeError(f"give either info= or its fields {sorted(kwargs)}, not both")
    return codec.compress(tensor, info, allow_inplace=allow_inplace)


def deserialize_torch_tensor(serialized_tensor: SerializedTensor) -> torch.Tensor:
    """Decode a payload with the codec it names, restoring dtype, shape and requires_grad."""
    serialized = serialized_tensor
    if not isinstance(serialized, SerializedTensor):
        raise CodecError(f"expected a SerializedTensor, got {type(serialized).__name__}")
    return _BY_WIRE_NAME[serialized.codec].extract(serialized)
