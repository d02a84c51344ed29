"""serialize_torch_tensor / deserialize_torch_tensor: round trips for every dtype and codec."""

from __future__ import annotations

import warnings

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from swarmgrad.compression import (
    BASE_COMPRESSION_TYPES,
    CompressionType,
    Float16Compression,
    SerializedTensor,
    deserialize_torch_tensor,
    get_codec,
    serialize_torch_tensor,
)
from swarmgrad.compression.serialized import LOSSY_DTYPES, SERIALIZABLE_DTYPES
from swarmgrad.utils.errors import CodecError, ValidationError

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
ALL_DTYPES = sorted(SERIALIZABLE_DTYPES.values(), key=str)
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
EXACT_ONLY_DTYPES = [dtype for dtype in ALL_DTYPES if dtype not in LOSSY_DTYPES]


def setup_function():
    torch.manual_seed(0)  # data drawn without an explicit generator is the same every run


def over_the_wire(serialized: SerializedTensor) -> SerializedTensor:
    """What a receiver holds: the header through msgpack, the payload in a fresh bytearray."""
    header = msgpack.unpackb(msgpack.packb(serialized.header()))
    return SerializedTensor.from_header(header, bytearray(serialized.buffer))


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)


@st.composite
def raw_tensors(draw, dtypes=ALL_DTYPES):
    """Tensors of any dtype whose memory holds arbitrary bytes (NaN payloads included)."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    numel = int(np.prod(shape))
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    if dtype == torch.bool:
        raw = bytes(byte & 1 for byte in raw)
    return tensor_from_bytes(raw, dtype, shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()


@DETERMINISTIC
@given(tensor=raw_tensors())
def test_no_compression_round_trips_every_dtype_bit_exactly(tensor):
    restored = deserialize_torch_tensor(over_the_wire(serialize_torch_tensor(tensor)))
    assert restored.dtype == tensor.dtype
    assert restored.shape == tensor.shape
    assert same_bytes(restored, tensor)


@DETERMINISTIC
@given(tensor=raw_tensors(EXACT_ONLY_DTYPES), codec=st.sampled_from(list(CompressionType)))
def test_lossy_codecs_send_integer_bool_complex_and_float8_tensors_exactly(tensor, codec):
    serialized = serialize_torch_tensor(tensor, codec)
    assert serialized.codec == "none"
    restored = deserialize_torch_tensor(over_the_wire(serialized))
    assert restored.dtype == tensor.dtype and same_bytes(restored, tensor)


# Worst error per value, as a fraction of the tensor's largest magnitude: half the widest
# gap between neighbouring code points.  The 4-bit code's widest gap (between 6/7 and 1
# of a block's absmax) is 0.204, so its bound is about twice the 8-bit codecs'.
WORST_RELATIVE_ERROR = {codec: 0.05 for codec in CompressionType}
WORST_RELATIVE_ERROR[CompressionType.BLOCKWISE_4BIT] = 0.11


@pytest.mark.parametrize("codec", list(CompressionType), ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(), (0,), (3, 0, 2), (1,), (7,), (5000,), (3, 70), (2, 3, 4)], ids=str
)
def test_every_codec_restores_dtype_shape_and_values_approximately(codec, dtype, shape):
    generator = torch.Generator().manual_seed(7)
    tensor = torch.randn(shape, generator=generator).to(dtype)
    restored = deserialize_torch_tensor(over_the_wire(serialize_torch_tensor(tensor, codec)))
    assert restored.dtype == dtype
    assert restored.shape == tensor.shape
    if tensor.numel():
        error = (restored.double() - tensor.double()).abs().max().item()
        assert error <= WORST_RELATIVE_ERROR[codec] * tensor.double().abs().max().item() + 1e-6


@pytest.mark.parametrize("codec", list(CompressionType), ids=str)
def test_requires_grad_is_restored_without_touching_the_input_graph(codec):
    leaf = torch.randn(100, requires_grad=True)
    tensor = leaf * 2
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, codec))
    assert restored.requires_grad and restored.is_leaf
    assert leaf.grad is None


def test_float16_codec_gives_a_bfloat16_tensor_back_as_bfloat16():
    tensor = torch.randn(1000).to(torch.bfloat16)
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, CompressionType.FLOAT16))
    assert restored.dtype == torch.bfloat16
    assert torch.allclose(restored.float(), tensor.float(), rtol=1e-2)


def test_zero_dim_scalar_round_trips_with_every_codec():
    for codec in CompressionType:
        restored = deserialize_torch_tensor(serialize_torch_tensor(torch.tensor(1.25), codec))
        assert restored.shape == () and abs(restored.item() - 1.25) < 1e-2


@pytest.mark.parametrize("codec", list(CompressionType), ids=str)
def test_non_contiguous_inputs_round_trip(codec):
    base = torch.randn(64, 96)
    for tensor in (base.t(), base[::2, 1::3], base.expand(2, 64, 96)):
        restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, codec))
        assert restored.shape == tensor.shape
        assert torch.allclose(
            restored, tensor, atol=WORST_RELATIVE_ERROR[codec] * base.abs().max().item()
        )


def test_conjugate_and_negative_views_are_resolved():
    complex_tensor = torch.randn(10, dtype=torch.complex64)
    restored = deserialize_torch_tensor(serialize_torch_tensor(complex_tensor.conj()))
    assert torch.equal(restored, complex_tensor.conj().resolve_conj())
    negative = torch._neg_view(complex_tensor)
    assert torch.equal(deserialize_torch_tensor(serialize_torch_tensor(negative)), -complex_tensor)


def test_serialize_accepts_enum_wire_name_member_name_or_codec_instance():
    tensor = torch.randn(10)
    for compression in (CompressionType.FLOAT16, "float16", "FLOAT16", Float16Compression()):
        assert serialize_torch_tensor(tensor, compression).codec == "float16"
    assert get_codec("quantile_8bit") is BASE_COMPRESSION_TYPES["QUANTILE_8BIT"]


def test_unknown_compression_is_refused():
    with pytest.raises(ValidationError, match="unknown compression 'zstd'"):
        serialize_torch_tensor(torch.zeros(3), "zstd")


def test_base_compression_types_cover_every_compression_type():
    assert set(BASE_COMPRESSION_TYPES) == {member.name for member in CompressionType}
    for name, codec in BASE_COMPRESSION_TYPES.items():
        assert codec.compression_type == CompressionType[name]


def test_deserialize_refuses_anything_but_a_serialized_tensor():
    with pytest.raises(CodecError):
        deserialize_torch_tensor(b"\x00" * 16)


def test_sparse_and_quantized_tensors_are_refused():
    with pytest.raises(ValidationError, match="dense"):
        serialize_torch_tensor(torch.eye(3).to_sparse())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still refused
        quantized = torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)
    with pytest.raises(ValidationError):
        serialize_torch_tensor(quantized)


def test_serialized_header_is_msgpack_able_for_every_codec():
    tensor = torch.randn(3, 80)
    for codec in CompressionType:
        serialized = serialize_torch_tensor(tensor, codec)
        packed = msgpack.packb(serialized.header())
        assert SerializedTensor.from_header(msgpack.unpackb(packed), serialized.buffer)
