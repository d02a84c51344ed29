"""Codecs that pick another codec per tensor: by size, by role, or by key."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Mapping, Sequence

import torch

from swarmgrad.compression.base import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    TensorRole,
)
from swarmgrad.compression.serialization import deserialize_torch_tensor
from swarmgrad.compression.serialized import SerializedTensor
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "AdaptiveCompressionBase",
    "PerTensorCompression",
    "RoleAdaptiveCompression",
    "SizeAdaptiveCompression",
]


def _check_codec(name: str, codec: object) -> CompressionBase:
    if not isinstance(codec, CompressionBase):
        raise ValidationError(f"{name} must be a CompressionBase, got {codec!r}")
    return codec


class AdaptiveCompressionBase(CompressionBase):
    """Delegates each tensor to the codec :meth:`choose_compression` picks for its info.

    Decoding needs no choice: a payload names the codec that produced it.
    """

    @abstractmethod
    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        """The codec to use for the tensor described by ``info``."""

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        return self.choose_compression(info).compress(tensor, info, allow_inplace=allow_inplace)

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        return deserialize_torch_tensor(serialized)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.choose_compression(info).estimate_compression_ratio(info)


class SizeAdaptiveCompression(AdaptiveCompressionBase):
    """``less`` for tensors with fewer than ``threshold`` elements, else ``greater_equal``.

    The whole tensor's size decides (``info.descriptor``), so all parts of a tensor that is
    compressed part by part get the same codec.
    """

    def __init__(self, threshold: int, less: CompressionBase, greater_equal: CompressionBase):
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValidationError(f"threshold must be a non-negative integer, got {threshold!r}")
        self.threshold = threshold
        self.less_compression = _check_codec("less", less)
        self.greater_equal_compression = _check_codec("greater_equal", greater_equal)

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        if info.descriptor.numel() >= self.threshold:
            return self.greater_equal_compression
        return self.less_compression

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold={self.threshold}, less={self.less_compression!r}, "
            f"greater_equal={self.greater_equal_compression!r})"
        )


class RoleAdaptiveCompression(AdaptiveCompressionBase):
    """A codec per :class:`TensorRole`; roles given no codec (and UNSPECIFIED) use ``default``."""

    def __init__(
        self,
        *,
        activation: CompressionBase | None = None,
        parameter: CompressionBase | None = None,
        gradient: CompressionBase | None = None,
        optimizer: CompressionBase | None = None,
        default: CompressionBase | None = NoCompression(),
    ):
        self.default = _check_codec("default", default if default is not None else NoCompression())
        given = {
            TensorRole.ACTIVATION: activation,
            TensorRole.PARAMETER: parameter,
            TensorRole.GRADIENT: gradient,
            TensorRole.OPTIMIZER: optimizer,
        }
        self.role_compressions: dict[TensorRole, CompressionBase] = {
            role: _check_codec(role.value, codec) if codec is not None else self.default
            for role, codec in given.items()
        }
        self.role_compressions[TensorRole.UNSPECIFIED] = self.default

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.role_compressions.get(info.role, self.default)

    def __repr__(self) -> str:
        chosen = ", ".join(
            f"{role.value}={codec!r}" for role, codec in self.role_compressions.items()
        )
        return f"{type(self).__name__}({chosen})"


class PerTensorCompression(AdaptiveCompressionBase):
    """A codec per tensor, looked up by ``info.key``: an index into a sequence or a key of
    a mapping. A key without a codec raises :class:`ValidationError`."""

    def __init__(
        self,
        tensor_compressions: Sequence[CompressionBase] | Mapping[Hashable, CompressionBase],
    ):
        if isinstance(tensor_compressions, Mapping):
            items = dict(tensor_compressions)
        elif isinstance(tensor_compressions, Sequence) and not isinstance(tensor_compressions, str):
            items = dict(enumerate(tensor_compressions))
        else:
            raise ValidationError(
                f"tensor_compressions must be a sequence or a mapping, got "
                f"{type(tensor_compressions).__name__}"
            )
        self.tensor_compressions = {
            key: _check_codec(f"codec for tensor {key!r}", codec) for key, codec in items.items()
        }

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        try:
            return self.tensor_compressions[info.key]
        except (KeyError, TypeError):
            raise ValidationError(f"no codec configured for tensor {info.key!r}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tensor_compressions!r})"
