"""hivemind's ``TensorDescriptor`` (``hivemind.utils.TensorDescriptor``): a tensor's size,
dtype, layout, device, ``requires_grad``, pinning and codec, able to make zeros like it.

swarmgrad's codecs use the smaller :class:`swarmgrad.compression.TensorDescriptor` (shape,
dtype, ``requires_grad``: what a codec needs); expert schemas use
:class:`swarmgrad.moe.protocol.BatchTensorDescriptor`. This one keeps hivemind programs
that build or read full descriptors running; ``to_codec_descriptor()`` converts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from swarmgrad.compression.base import TensorDescriptor as CodecDescriptor
from swarmgrad.compression.serialized import CompressionType

__all__ = ["TensorDescriptor"]


@dataclass(frozen=True)
class TensorDescriptor:
    size: tuple
    dtype: torch.dtype | None = None
    layout: torch.layout = torch.strided
    device: torch.device | None = None
    requires_grad: bool = False
    pin_memory: bool = False
    compression: CompressionType = CompressionType.NONE

    def __post_init__(self) -> None:
        if not all(d is None or (isinstance(d, int) and d >= 0) for d in self.size):
            raise ValueError(f"size must be non-negative ints (or None), got {self.size!r}")
        object.__setattr__(self, "size", tuple(self.size))
        object.__setattr__(self, "compression", CompressionType(self.compression))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    def numel(self) -> int:
        return math.prod(self.size)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDescriptor:
        pinned = tensor.device.type == "cpu" and torch.cuda.is_available() and tensor.is_pinned()
        return cls(
            tuple(tensor.shape), tensor.dtype, tensor.layout, tensor.device,
            tensor.requires_grad, pinned,
        )  # fmt: skip

    def make_zeros(self, **kwargs: Any) -> torch.Tensor:
        """``torch.zeros`` of this description (keyword arguments override fields)."""
        properties = asdict(self)
        properties.update(kwargs)
        properties.pop("compression")
        if properties.get("pin_memory") and not torch.cuda.is_available():
            properties["pin_memory"] = False  # pinning needs an accelerator
        return torch.zeros(**properties)

    def to_codec_descriptor(self) -> CodecDescriptor:
        return CodecDescriptor(self.size, self.dtype or torch.float32, self.requires_grad)
