"""The wire format of a tensor: a msgpack-able header plus one raw byte buffer.

This module is the single place that knows how many bytes each codec's payload has and
how it is laid out, so a receiver can check a payload against its header before decoding
(or, for streamed tensors, before allocating anything). It does no tensor arithmetic.

Payload layouts (``n`` = number of elements, all numbers little-endian as in memory):

==================  ======================================================  =================
codec               buffer                                                  params
==================  ======================================================  =================
``none``            the tensor's own bytes, ``n * itemsize``                ``{}``
``float16``         ``n`` float16                                           ``{}``
``bfloat16``        ``n`` bfloat16                                          ``{}``
``meanstd_16bit``   ``rows`` float32 means, ``rows`` float32 scales,        ``{"rows": int}``
                    ``n`` float16 (row-major, ``n // rows`` per row)
``uniform_8bit``    ``n`` uint8 codes; value = ``lo + code * step``         ``{"lo", "step"}``
``quantile_8bit``   256 float32 codebook entries, then ``n`` uint8 codes    ``{}``
``blockwise_8bit``  ``ceil(n / block)`` float32 block scales, ``n`` uint8   ``{"block": int}``
``blockwise_4bit``  ``ceil(n / block)`` float32 block scales, then          ``{"block": int}``
                    ``ceil(n / 2)`` bytes of two 4-bit codes (low nibble
                    first)
==================  ======================================================  =================

Any lossy codec's payload may travel *deflated* (params ``"deflated": true``): the
buffer is then the zlib stream (RFC 1950) of the layout above, no longer than it; a
receiver reads what the header announces and inflates to exactly the layout's size
(:mod:`swarmgrad.compression.deflate`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from swarmgrad.utils.errors import CodecError

__all__ = [
    "MAX_NDIM",
    "MAX_NUMEL",
    "Buffer",
    "CompressionType",
    "DEFLATED",
    "SERIALIZABLE_DTYPES",
    "SerializedTensor",
    "LOSSY_DTYPES",
    "blockwise_4bit_nbytes",
    "check_header",
    "dtype_from_name",
    "dtype_name",
    "expected_payload_nbytes",
    "is_deflated",
]

Buffer = bytes | bytearray | memoryview

#: A header announcing more dimensions or elements than this is refused as absurd.
MAX_NDIM = 64
MAX_NUMEL = 1 << 48

QUANTILE_CODEBOOK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 24


class CompressionType(enum.StrEnum):
    """The codecs a peer can name on the wire; the value is the wire name."""

    NONE = "none"
    FLOAT16 = "float16"
    MEANSTD_16BIT = "meanstd_16bit"
    UNIFORM_8BIT = "uniform_8bit"
    QUANTILE_8BIT = "quantile_8bit"
    BLOCKWISE_8BIT = "blockwise_8bit"
    BFLOAT16 = "bfloat16"
    BLOCKWISE_4BIT = "blockwise_4bit"

    # hivemind's ``runtime_pb2.CompressionType`` is a protobuf enum: its class methods
    # answer here with hivemind's numbers (the wire keeps swarmgrad's names)

    @classmethod
    def Name(cls, number: int) -> str:
        """The codec name of hivemind's protobuf ``number``."""
        if number not in _HIVEMIND_NUMBERS:
            raise ValueError(f"{number!r} is not a hivemind CompressionType number")
        return _HIVEMIND_NUMBERS[number]

    @classmethod
    def Value(cls, name: str) -> int:
        """hivemind's number of the codec ``name`` (KeyError for swarmgrad-only ones)."""
        numbers = {v: k for k, v in _HIVEMIND_NUMBERS.items()}
        return numbers[cls[name].name]

    @classmethod
    def keys(cls) -> list[str]:
        return list(_HIVEMIND_NUMBERS.values())

    @classmethod
    def items(cls) -> list[tuple[str, int]]:
        return [(name, number) for number, name in _HIVEMIND_NUMBERS.items()]


_HIVEMIND_NUMBERS = {
    0: "NONE",
    1: "MEANSTD_16BIT",
    2: "FLOAT16",
    3: "QUANTILE_8BIT",
    4: "UNIFORM_8BIT",
    5: "BLOCKWISE_8BIT",
}


def _collect_dtypes() -> dict[str, torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "complex128", "complex64", "complex32",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ]  # fmt: skip
    found = {}
    for name in names:
        dtype = getattr(torch, name, None)  # older torch builds lack some of these
        if isinstance(dtype, torch.dtype):
            found[name] = dtype
    return found


_DTYPES: dict[str, torch.dtype] = _collect_dtypes()
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
#: Every dtype that can be serialized, by wire name (``"float32"``, ``"bool"``, ...).
SERIALIZABLE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(_DTYPES)

#: Dtypes the lossy codecs apply to; every other dtype is always sent exactly.
LOSSY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} cannot be serialized") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype for a wire name; :class:`CodecError` if there is no such dtype."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(
            f"unknown dtype {name!r}; expected one of {', '.join(sorted(_DTYPES))}"
        ) from None


def _int_param(codec: str, params: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = params.get(key)
    if type(value) is not int or not low <= value <= high:
        raise CodecError(
            f"codec {codec!r}: parameter {key!r} must be an integer in [{low}, {high}], "
            f"got {value!r}"
        )
    return value


def _float_param(codec: str, params: Mapping[str, Any], key: str, low: float = -math.inf) -> float:
    value = params.get(key)
    if type(value) not in (int, float) or not math.isfinite(value) or value < low:
        raise CodecError(
            f"codec {codec!r}: parameter {key!r} must be a finite number >= {low}, got {value!r}"
        )
    return float(value)


def expected_payload_nbytes(
    codec: str, dtype: torch.dtype, numel: int, params: Mapping[str, Any]
) -> int:
    """Bytes a payload of ``codec`` must have for ``numel`` elements of ``dtype``.

    Raises :class:`CodecError` for an unknown codec, a codec that does not apply to the
    dtype, or parameters that are missing or out of range.
    """
    if codec == CompressionType.NONE:
        return numel * dtype.itemsize
    if codec not in CompressionType.__members__.values():
        known = ", ".join(member.value for member in CompressionType)
        raise CodecError(f"unknown codec {codec!r}; expected one of {known}")
    if dtype not in LOSSY_DTYPES:
        raise CodecError(
            f"codec {codec!r} applies to float16/bfloat16/float32/float64 tensors, "
            f"not {dtype_name(dtype)}"
        )
    if codec in (CompressionType.FLOAT16, CompressionType.BFLOAT16):
        return numel * 2
    if codec == CompressionType.MEANSTD_16BIT:
        rows = _int_param(codec, params, "rows", 1, max(numel, 1))
        if numel % rows:
            raise CodecError(f"codec {codec!r}: {numel} elements do not split into {rows} rows")
        return rows * 8 + numel * 2
    if codec == CompressionType.UNIFORM_8BIT:
        _float_param(codec, params, "lo")
        _float_param(codec, params, "step", low=0.0)
        return numel
    if codec == CompressionType.QUANTILE_8BIT:
        return QUANTILE_CODEBOOK_SIZE * 4 + numel
    block = _int_param(codec, params, "block", 1, MAX_BLOCK_SIZE)
    if codec == CompressionType.BLOCKWISE_4BIT:
        return blockwise_4bit_nbytes(numel, block)
    # blockwise_8bit
    return -(-numel // block) * 4 + numel


#: the params key that marks a deflated payload
DEFLATED = "deflated"


def is_deflated(codec: str, params: Mapping[str, Any]) -> bool:
    """Whether params mark the payload as deflated (CodecError if they do so wrongly)."""
    flag = params.get(DEFLATED, False)
    if flag is False:
        return False
    if flag is not True:
        raise CodecError(
            f"codec {codec!r}: param {DEFLATED!r} must be true or absent, got {flag!r}"
        )
    if codec == CompressionType.NONE:
        raise CodecError(f"codec {codec!r} payloads are never deflated")
    return True


def _check_nbytes(
    what: str, codec: str, params: Mapping[str, Any], expected: int, got: Any, verb: str = "got"
) -> None:
    """``got`` bytes fit ``expected``: equal, or, deflated, between 1 and ``expected``."""
    deflated = is_deflated(codec, params)
    if type(got) is int and (0 < got <= expected if deflated else got == expected):
        return
    if deflated:
        raise CodecError(f"{what}, deflated, must have 1 to {expected} bytes, {verb} {got!r}")
    raise CodecError(f"{what} must have {expected} bytes, {verb} {got!r}")


def blockwise_4bit_nbytes(numel: int, block: int) -> int:
    """Payload size of ``blockwise_4bit``: float32 block scales, then two codes per byte."""
    return -(-numel // block) * 4 + (numel + 1) // 2


def _buffer_nbytes(buffer: Buffer) -> int:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise CodecError(
            f"a tensor payload must be bytes, bytearray or memoryview, not {type(buffer).__name__}"
        ) from None
    if not view.c_contiguous:
        raise CodecError("a tensor payload must be a contiguous buffer")
    return view.nbytes


@dataclass(frozen=True)
class SerializedTensor:
    """A tensor as it travels: codec metadata plus one raw buffer.

    ``dtype``, ``shape`` and ``requires_grad`` describe the original tensor, which
    decoding restores; ``codec`` and ``params`` say how ``buffer`` encodes its values.
    Construction validates that all of these agree (see :func:`expected_payload_nbytes`),
    so an instance is always safe to decode.
    """

    codec: str
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    params: dict[str, Any]
    buffer: Buffer = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str):
            raise CodecError(f"codec name must be a string, got {self.codec!r}")
        torch_dtype = dtype_from_name(self.dtype)
        shape = _validate_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.params, Mapping):
            raise CodecError(f"codec params must be a mapping, got {type(self.params).__name__}")
        if type(self.requires_grad) is not bool:
            raise CodecError(f"requires_grad must be a bool, got {self.requires_grad!r}")
        if self.requires_grad and not (torch_dtype.is_floating_point or torch_dtype.is_complex):
            raise CodecError(f"requires_grad=True is impossible for a {self.dtype} tensor")
        numel = math.prod(shape)
        expected = expected_payload_nbytes(self.codec, torch_dtype, numel, self.params)
        what = f"{self.codec} payload for a {self.dtype} tensor of shape {list(shape)}"
        _check_nbytes(what, self.codec, self.params, expected, _buffer_nbytes(self.buffer))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Length of the payload buffer in bytes."""
        return memoryview(self.buffer).nbytes

    def header(self) -> dict[str, Any]:
        """Everything but the buffer, as a msgpack-able dict (includes the buffer length)."""
        return {
            "codec": self.codec,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "requires_grad": self.requires_grad,
            "params": dict(self.params),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_header(cls, header: Mapping[str, Any], buffer: Buffer) -> SerializedTensor:
        """Rebuild from :meth:`header` output and the received buffer, validating both.

        Unknown header keys are ignored (newer peers may add some). Raises
        :class:`CodecError` when a field is missing or malformed, or when the buffer
        length disagrees with what the header implies.
        """
        announced = check_header(header)
        arrived = _buffer_nbytes(buffer)
        if announced != arrived:
            raise CodecError(
                f"{header['codec']} payload for a {header['dtype']} tensor of shape "
                f"{list(header['shape'])} must have {announced} bytes, got {arrived}"
            )
        return cls(
            codec=header["codec"],
            dtype=header["dtype"],
            shape=tuple(header["shape"]),
            requires_grad=header["requires_grad"],
            params=header["params"],
            buffer=buffer,
        )


_HEADER_KEYS = ("codec", "dtype", "shape", "requires_grad", "params", "nbytes")


def check_header(header: Mapping[str, Any]) -> int:
    """Validate a tensor header on its own and return the payload size it announces.

    Lets a receiver refuse a bad header before receiving (or allocating room for) the
    payload. Raises :class:`CodecError` naming what is wrong.
    """
    if not isinstance(header, Mapping):
        raise CodecError(f"tensor header must be a mapping, got {type(header).__name__}")
    missing = [key for key in _HEADER_KEYS if key not in header]
    if missing:
        raise CodecError(f"tensor header lacks {', '.join(missing)}")
    codec, dtype = header["codec"], dtype_from_name(header["dtype"])
    if not isinstance(codec, str):
        raise CodecError(f"codec name must be a string, got {codec!r}")
    shape = header["shape"]
    if not isinstance(shape, list | tuple):
        raise CodecError(f"tensor shape must be a list of integers, got {shape!r}")
    shape = _validate_shape(tuple(shape))
    params = header["params"]
    if not isinstance(params, Mapping):
        raise CodecError(f"codec params must be a mapping, got {type(params).__name__}")
    expected = expected_payload_nbytes(codec, dtype, math.prod(shape), params)
    announced = header["nbytes"]
    what = f"{codec} payload for a {header['dtype']} tensor of shape {list(shape)}"
    _check_nbytes(what, codec, params, expected, announced, verb="header announces")
    return announced


def _validate_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, tuple):
        raise CodecError(f"tensor shape must be a tuple of integers, got {shape!r}")
    if len(shape) > MAX_NDIM:
        raise CodecError(f"tensor shape has {len(shape)} dimensions, at most {MAX_NDIM} allowed")
    for size in shape:
        if type(size) is not int or not 0 <= size <= MAX_NUMEL:
            raise CodecError(
                f"tensor shape must hold integers in [0, {MAX_NUMEL}], got {list(shape)}"
            )
    if math.prod(shape) > MAX_NUMEL:
        raise CodecError(f"tensor shape {list(shape)} has more than {MAX_NUMEL} elements")
    return shape
