"""Tensor serialization and compression: codecs, adaptive codec selection, streaming.

Public names follow hivemind 1.1's ``hivemind.compression`` so scripts can switch imports.
See docs/compression.md for the codecs' error bounds and when to use which.
"""

from swarmgrad.compression.adaptive import (
    AdaptiveCompressionBase,
    PerTensorCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
)
from swarmgrad.compression.base import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    TensorDescriptor,
    TensorRole,
)
from swarmgrad.compression.floating import (
    BFloat16Compression,
    Float16Compression,
    ScaledFloat16Compression,
)
from swarmgrad.compression.four_bit import Blockwise4BitQuantization
from swarmgrad.compression.quantization import (
    BlockwiseQuantization,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)
from swarmgrad.compression.serialization import (
    BASE_COMPRESSION_TYPES,
    deserialize_torch_tensor,
    get_codec,
    serialize_torch_tensor,
)
from swarmgrad.compression.serialized import (
    CompressionType,
    SerializedTensor,
    check_header,
)
from swarmgrad.compression.streaming import (
    TensorPart,
    TensorPartAssembler,
    combine_from_streaming,
    deserialize_tensor_stream,
    split_for_streaming,
    split_into_parts,
)
from swarmgrad.compression.wire import (
    serialized_from_message,
    serialized_to_message,
    tensors_from_message,
    tensors_to_message,
)

__all__ = [
    "serialized_from_message",
    "serialized_to_message",
    "tensors_from_message",
    "tensors_to_message",
    "BASE_COMPRESSION_TYPES",
    "AdaptiveCompressionBase",
    "BFloat16Compression",
    "Blockwise4BitQuantization",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionInfo",
    "CompressionType",
    "Float16Compression",
    "NoCompression",
    "PerTensorCompression",
    "Quantile8BitQuantization",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "SerializedTensor",
    "SizeAdaptiveCompression",
    "TensorDescriptor",
    "TensorPart",
    "TensorPartAssembler",
    "TensorRole",
    "Uniform8BitQuantization",
    "check_header",
    "combine_from_streaming",
    "deserialize_tensor_stream",
    "deserialize_torch_tensor",
    "get_codec",
    "serialize_torch_tensor",
    "split_for_streaming",
    "split_into_parts",
]
