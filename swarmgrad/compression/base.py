"""Codec interface, tensor metadata, exact serialization and the shared lossy-codec logic."""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

import torch

from swarmgrad.compression.deflate import deflate_payload, inflate_payload
from swarmgrad.compression.serialized import (
    LOSSY_DTYPES,
    MAX_BLOCK_SIZE,
    Buffer,
    CompressionType,
    SerializedTensor,
    dtype_name,
)
from swarmgrad.utils.errors import CodecError, ValidationError

__all__ = [
    "all_finite",
    "CompressionBase",
    "CompressionInfo",
    "NoCompression",
    "TensorDescriptor",
    "TensorRole",
]


class TensorRole(enum.Enum):
    """What a tensor is used for; adaptive codecs may compress each role differently."""

    ACTIVATION = "activation"
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER = "optimizer"
    UNSPECIFIED = "unspecified"


@dataclass(frozen=True)
class TensorDescriptor:
    """Shape and dtype of a tensor, enough to choose a codec and estimate its output."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool = False

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDescriptor:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    @property
    def size(self) -> torch.Size:
        """The shape as a ``torch.Size`` (the name hivemind's descriptor uses)."""
        return torch.Size(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class CompressionInfo:
    """What a codec may know about the tensor it compresses besides its values.

    ``key`` names the tensor among those sent together (an index or a name), ``part_index``
    and ``part_size`` locate a part when a large tensor is compressed part by part; the
    descriptor always describes the whole tensor, so every part gets the same codec.
    """

    key: Hashable
    descriptor: TensorDescriptor
    role: TensorRole = TensorRole.UNSPECIFIED
    part_index: int = 0
    part_size: int | None = None

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        key: Hashable = None,
        descriptor: TensorDescriptor | None = None,
        role: TensorRole = TensorRole.UNSPECIFIED,
    ) -> CompressionInfo:
        if descriptor is None:
            descriptor = TensorDescriptor.from_tensor(tensor)
        return cls(key=key, descriptor=descriptor, role=role)

    def get_part(self, part_index: int, part_size: int | None) -> CompressionInfo:
        """The same info for one part of the tensor."""
        return replace(self, part_index=part_index, part_size=part_size)


class CompressionBase(ABC):
    """A way to turn a tensor into a :class:`SerializedTensor` and back."""

    compression_type: CompressionType

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        """Encode ``tensor``. With ``allow_inplace`` the codec may overwrite ``tensor``'s
        memory (none of the codecs here needs to)."""

    @abstractmethod
    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        """Decode into a tensor of the original dtype, shape and ``requires_grad``."""

    @abstractmethod
    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Approximate payload size divided by the tensor's size in memory."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def prepare_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, dense, contiguous CPU tensor with the same values (no copy if possible)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValidationError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValidationError(f"only dense tensors can be serialized, got layout {tensor.layout}")
    dtype_name(tensor.dtype)  # raises for dtypes without a wire name (e.g. quantized)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.resolve_conj().resolve_neg().contiguous()


def all_finite(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` holds no NaN or Inf.

    One summing pass decides the common case (NaN and Inf propagate into the sum); only a
    sum that is not finite, which huge but finite values can also cause, is settled by the
    exact elementwise check, whose mask as large as the tensor costs many times more."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte memoryview over a contiguous CPU tensor's memory, without copying.

    The view keeps the memory alive; writing to the tensor changes the view's contents.
    """
    if tensor.numel() == 0:  # an empty numpy-made tensor may have stride 0: no byte view
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def byte_tensor(buffer: Buffer, align: int = 1) -> torch.Tensor:
    """A uint8 tensor over ``buffer``'s memory, without copying when possible.

    A read-only buffer (``bytes``) or one whose address is not a multiple of ``align`` is
    copied once, so the result is always writable and suitably aligned for ``align``-byte
    elements.
    """
    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        view = memoryview(bytearray(view))
    result = torch.frombuffer(view, dtype=torch.uint8)
    if result.data_ptr() % align:
        result = result.clone()
    return result


class NoCompression(CompressionBase):
    """Exact serialization of any dtype; the payload is the tensor's own memory.

    ``compress`` does not copy a contiguous tensor: the buffer is a memoryview of the
    tensor's memory, so do not modify the tensor until the payload is sent. ``extract``
    wraps a writable buffer (``bytearray``) without copying.
    """

    compression_type = CompressionType.NONE

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> SerializedTensor:
        requires_grad = bool(tensor.requires_grad)
        tensor = prepare_tensor(tensor)
        return SerializedTensor(
            codec=CompressionType.NONE.value,
            dtype=dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
            requires_grad=requires_grad,
            params={},
            buffer=tensor_bytes(tensor),
        )

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        if serialized.codec != CompressionType.NONE:
            raise CodecError(f"NoCompression cannot decode a {serialized.codec!r} payload")
        dtype = serialized.torch_dtype
        if serialized.numel == 0:
            result = torch.empty(serialized.shape, dtype=dtype)
        else:
            raw = byte_tensor(serialized.buffer, align=min(dtype.itemsize, 8))
            if dtype == torch.bool and bool((raw > 1).any()):
                raise CodecError("a bool tensor's payload holds bytes other than 0 and 1")
            result = raw.view(dtype).view(serialized.shape)
        return result.requires_grad_(serialized.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


NO_COMPRESSION = NoCompression()
#: how fast a deflating codec's size estimate follows its payloads (weight of the newest)
_DEFLATE_RATIO_WEIGHT = 0.5


class LossyCompression(CompressionBase):
    """Shared logic of the lossy codecs.

    They apply to float16/bfloat16/float32/float64 tensors with at least one element;
    every other tensor is sent exactly, with codec ``none``. Decoding restores the
    original dtype.

    ``deflate=True`` (keyword, every lossy codec): zlib-code each payload, losslessly
    (:mod:`swarmgrad.compression.deflate`): for slow links. Any codec decodes deflated
    payloads. Its size estimates then follow what zlib achieved on recent payloads.
    """

    deflate: bool = False
    #: deflated / plain size of recent payloads (deflating codecs), for the estimates
    _deflate_ratio: float = 1.0

    def __init__(self, *, deflate: bool = False):
        self._set_deflate(deflate)

    def _set_deflate(self, deflate: bool) -> None:
        if not isinstance(deflate, bool):
            raise ValidationError(f"deflate must be a bool, got {deflate!r}")
        self.deflate = deflate

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_options()})"

    def _repr_options(self, *options: str) -> str:
        return ", ".join([*options, *(["deflate=True"] if self.deflate else [])])

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> SerializedTensor:
        requires_grad = bool(tensor.requires_grad)
        prepared = prepare_tensor(tensor)
        if prepared.dtype not in LOSSY_DTYPES or prepared.numel() == 0:
            return NO_COMPRESSION.compress(tensor)
        params, buffer = self.encode(prepared)
        serialized = SerializedTensor(
            codec=self.compression_type.value,
            dtype=dtype_name(prepared.dtype),
            shape=tuple(prepared.shape),
            requires_grad=requires_grad,
            params=params,
            buffer=buffer,
        )
        if self.deflate:
            deflated = deflate_payload(serialized)
            ratio = deflated.nbytes / serialized.nbytes
            self._deflate_ratio += _DEFLATE_RATIO_WEIGHT * (ratio - self._deflate_ratio)
            serialized = deflated
        return serialized

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        if serialized.codec == CompressionType.NONE:
            return NO_COMPRESSION.extract(serialized)
        if serialized.codec != self.compression_type:
            raise CodecError(f"{type(self).__name__} cannot decode a {serialized.codec!r} payload")
        serialized = inflate_payload(serialized)
        if serialized.numel == 0:
            result = torch.empty(serialized.shape, dtype=serialized.torch_dtype)
        else:
            result = self.decode(serialized).view(serialized.shape)
        return result.requires_grad_(serialized.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        descriptor = info.descriptor
        numel = descriptor.numel()
        if descriptor.dtype not in LOSSY_DTYPES or numel == 0:
            return 1.0
        plain = self.payload_nbytes(descriptor) / (numel * descriptor.dtype.itemsize)
        return plain * self._deflate_ratio if self.deflate else plain

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Buffer]:
        """Encode a contiguous, non-empty tensor of a lossy dtype into (params, buffer)."""

    @abstractmethod
    def decode(self, serialized: SerializedTensor) -> torch.Tensor:
        """Decode a validated, non-empty payload into a flat tensor of the original dtype."""

    @abstractmethod
    def payload_nbytes(self, descriptor: TensorDescriptor) -> int:
        """Payload size for a tensor like ``descriptor``."""


class BlockwiseScaledCompression(LossyCompression):
    """Shared logic of the blockwise codecs (8-bit and 4-bit): each block of
    ``block_size`` values is scaled by its absolute maximum; a payload holds the blocks'
    float32 scales, then the codes."""

    def __init__(self, block_size: int, *, deflate: bool = False):
        self._set_deflate(deflate)
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValidationError(f"block_size must be an int, got {block_size!r}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValidationError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_options(f'block_size={self.block_size}')})"

    @staticmethod
    def split_payload(
        payload: torch.Tensor, numel: int, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scales, codes)`` of a payload for ``numel`` values in blocks of ``block``."""
        blocks = -(-numel // block)
        return payload[: blocks * 4].view(torch.float32), payload[blocks * 4 :]
