"""Codec interface, CompressionInfo, and NoCompression's zero-copy behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.compression import (
    BASE_COMPRESSION_TYPES,
    BlockwiseQuantization,
    CompressionInfo,
    CompressionType,
    Float16Compression,
    NoCompression,
    SerializedTensor,
    TensorDescriptor,
    TensorRole,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from swarmgrad.compression.base import all_finite
from swarmgrad.utils.errors import CodecError, ValidationError


def setup_function():
    torch.manual_seed(0)  # data drawn without an explicit generator is the same every run


def address_of(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_no_compression_does_not_copy_the_tensor():
    tensor = torch.arange(1000, dtype=torch.float32)
    serialized = serialize_torch_tensor(tensor)
    assert isinstance(serialized.buffer, memoryview)
    assert address_of(serialized.buffer) == tensor.data_ptr()
    tensor[0] = 42.0  # the payload aliases the tensor until it is sent
    assert np.frombuffer(serialized.buffer, dtype=np.float32)[0] == 42.0


def test_deserialize_wraps_a_received_bytearray_without_copying():
    received = bytearray(torch.arange(1000, dtype=torch.int64).numpy().tobytes())
    serialized = SerializedTensor("none", "int64", (10, 100), False, {}, received)
    restored = deserialize_torch_tensor(serialized)
    assert restored.data_ptr() == address_of(received)
    assert restored[3, 7].item() == 307


def test_read_only_payload_is_copied_once_into_a_writable_tensor():
    payload = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    restored = deserialize_torch_tensor(
        SerializedTensor("none", "float32", (8,), False, {}, payload)
    )
    restored += 1  # must not write into the immutable bytes object
    assert payload == torch.arange(8, dtype=torch.float32).numpy().tobytes()
    assert restored.tolist() == [float(i + 1) for i in range(8)]


def test_misaligned_payload_is_copied_to_aligned_memory():
    received = bytearray(1 + 8 * 10)
    received[1:] = torch.arange(10, dtype=torch.float64).numpy().tobytes()
    view = memoryview(received)[1:]
    restored = deserialize_torch_tensor(SerializedTensor("none", "float64", (10,), False, {}, view))
    assert restored.data_ptr() % 8 == 0
    assert restored.tolist() == [float(i) for i in range(10)]


def test_bool_payload_with_bytes_other_than_zero_and_one_is_refused():
    with pytest.raises(CodecError, match="bool"):
        deserialize_torch_tensor(SerializedTensor("none", "bool", (3,), False, {}, b"\x00\x01\x02"))


def test_lossy_codec_decodes_exact_payloads_but_refuses_other_codecs():
    exact = serialize_torch_tensor(torch.arange(5))
    assert Float16Compression().extract(exact).tolist() == [0, 1, 2, 3, 4]
    blockwise = serialize_torch_tensor(torch.randn(5), CompressionType.BLOCKWISE_8BIT)
    with pytest.raises(CodecError, match="blockwise_8bit"):
        Float16Compression().extract(blockwise)
    with pytest.raises(CodecError):
        NoCompression().extract(blockwise)


def test_compression_info_from_tensor_describes_the_whole_tensor():
    tensor = torch.zeros(3, 4, dtype=torch.bfloat16, requires_grad=True)
    info = CompressionInfo.from_tensor(tensor, key="w", role=TensorRole.PARAMETER)
    assert info.key == "w" and info.role == TensorRole.PARAMETER
    assert info.descriptor == TensorDescriptor((3, 4), torch.bfloat16, True)
    assert info.descriptor.numel() == 12 and info.descriptor.size == torch.Size([3, 4])
    part = info.get_part(2, 5)
    assert (part.part_index, part.part_size, part.descriptor) == (2, 5, info.descriptor)
    assert (info.part_index, info.part_size) == (0, None)


@pytest.mark.parametrize(
    ("name", "ratio"),
    [
        ("NONE", 1.0),
        ("FLOAT16", 0.5),
        ("BFLOAT16", 0.5),
        ("MEANSTD_16BIT", 0.5),
        ("UNIFORM_8BIT", 0.25),
        ("QUANTILE_8BIT", 0.25),
        ("BLOCKWISE_8BIT", 0.25),
    ],
)
def test_estimated_compression_ratio_matches_the_actual_payload(name, ratio):
    codec = BASE_COMPRESSION_TYPES[name]
    tensor = torch.randn(256, 1024)
    info = CompressionInfo.from_tensor(tensor)
    estimate = codec.estimate_compression_ratio(info)
    assert estimate == pytest.approx(ratio, rel=0.01)
    actual = codec.compress(tensor, info).nbytes / (tensor.numel() * 4)
    assert estimate == pytest.approx(actual, rel=1e-9)


def test_lossy_codecs_estimate_no_compression_for_integer_tensors():
    info = CompressionInfo.from_tensor(torch.zeros(1000, dtype=torch.int32))
    for codec in BASE_COMPRESSION_TYPES.values():
        assert codec.estimate_compression_ratio(info) == 1.0


def test_blockwise_block_size_is_validated_and_travels_with_the_payload():
    with pytest.raises(ValidationError):
        BlockwiseQuantization(block_size=0)
    with pytest.raises(ValidationError, match="block_size must be an int"):
        BlockwiseQuantization(block_size=64.0)
    with pytest.raises(ValidationError, match="block_size must be in"):
        BlockwiseQuantization(block_size=(1 << 24) + 1)
    codec = BlockwiseQuantization(block_size=64)
    tensor = torch.randn(1000)
    serialized = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
    assert serialized.params == {"block": 64}
    restored = deserialize_torch_tensor(serialized)  # the default instance decodes it
    assert torch.allclose(restored, tensor, atol=0.02 * tensor.abs().max().item())


@given(
    st.lists(
        st.sampled_from(
            [0.0, 1.5, -2.0, 3e38, -3e38, 6e4, float("nan"), float("inf"), -float("inf")]
        ),
        max_size=40,
    ),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_all_finite_agrees_with_the_elementwise_check(values, dtype):
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)  # huge values may overflow
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


def test_all_finite_ignores_integer_tensors():
    assert all_finite(torch.tensor([1, 2, 3]))
