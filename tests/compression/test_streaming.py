"""Streaming: splitting payloads into parts and reassembling them, and part-wise compression."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.compression import (
    CompressionInfo,
    CompressionType,
    TensorPart,
    TensorPartAssembler,
    combine_from_streaming,
    deserialize_tensor_stream,
    deserialize_torch_tensor,
    serialize_torch_tensor,
    split_for_streaming,
    split_into_parts,
)
from swarmgrad.compression.streaming import DEFAULT_MAX_NBYTES
from swarmgrad.utils.errors import CodecError, ValidationError

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=60)


def setup_function():
    torch.manual_seed(0)  # data drawn without an explicit generator is the same every run


def address_of(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def over_the_wire(part: TensorPart) -> TensorPart:
    header = msgpack.unpackb(msgpack.packb(part.header()))
    return TensorPart.from_header(header, bytearray(part.buffer))


@pytest.fixture
def serialized():
    tensor = torch.arange(1000, dtype=torch.float32)
    return serialize_torch_tensor(tensor)


@DETERMINISTIC
@given(
    numel=st.integers(0, 3000),
    part_size=st.integers(1, 5000),
    codec=st.sampled_from(list(CompressionType)),
)
def test_parts_reassemble_into_the_same_tensor(numel, part_size, codec):
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    original = serialize_torch_tensor(tensor, codec)
    parts = [over_the_wire(part) for part in split_for_streaming(original, part_size)]
    assert len(parts) == max(1, -(-original.nbytes // part_size))
    assert all(part.nbytes <= part_size for part in parts)
    combined = combine_from_streaming(parts)
    assert combined == original
    assert torch.equal(deserialize_torch_tensor(combined), deserialize_torch_tensor(original))


def test_parts_are_views_of_the_payload_not_copies(serialized):
    parts = list(split_for_streaming(serialized, 1000))
    assert [part.nbytes for part in parts] == [1000] * 4
    base = address_of(serialized.buffer)
    for index, part in enumerate(parts):
        assert isinstance(part.buffer, memoryview)
        assert address_of(part.buffer) == base + 1000 * index


def test_only_the_first_part_carries_the_tensor_header(serialized):
    parts = list(split_for_streaming(serialized, 1500))
    assert parts[0].header()["tensor"] == serialized.header()
    assert parts[0].header()["part_size"] == 1500
    assert all("tensor" not in part.header() for part in parts[1:])


def test_single_part_is_used_without_copying(serialized):
    (part,) = split_for_streaming(serialized, 1 << 20)
    assert combine_from_streaming([part]).buffer is part.buffer


def test_multi_part_payload_is_assembled_into_one_writable_buffer(serialized):
    combined = combine_from_streaming(split_for_streaming(serialized, 999))
    assert isinstance(combined.buffer, bytearray)
    restored = deserialize_torch_tensor(combined)
    assert restored.data_ptr() == address_of(combined.buffer)  # decoded without a copy
    assert restored.tolist() == list(range(1000))


def test_missing_part_is_reported(serialized):
    parts = list(split_for_streaming(serialized, 1000))
    with pytest.raises(CodecError, match="part 1 is missing"):
        combine_from_streaming([parts[0], parts[2], parts[3]])


def test_duplicate_part_is_reported(serialized):
    parts = list(split_for_streaming(serialized, 1000))
    with pytest.raises(CodecError, match="duplicate part 1"):
        combine_from_streaming([parts[0], parts[1], parts[1], parts[2], parts[3]])


def test_out_of_order_parts_are_reported(serialized):
    parts = list(split_for_streaming(serialized, 1000))
    with pytest.raises(CodecError, match="part 1 is missing"):
        combine_from_streaming([parts[0], parts[2], parts[1], parts[3]])
    with pytest.raises(CodecError, match="start with part 0"):
        combine_from_streaming([parts[1], parts[0]])


def test_truncated_stream_is_reported(serialized):
    parts = list(split_for_streaming(serialized, 1000))
    with pytest.raises(CodecError, match="received 3 of 4 parts"):
        combine_from_streaming(parts[:3])
    with pytest.raises(CodecError, match="before its first part"):
        combine_from_streaming([])


def test_surplus_part_is_reported(serialized):
    parts = list(split_for_streaming(serialized, 1000))
    extra = TensorPart(index=4, count=4, buffer=bytes(10))
    with pytest.raises(CodecError, match="more parts than the 4"):
        combine_from_streaming([*parts, extra])


@pytest.mark.parametrize("size", [999, 1001])
def test_part_of_the_wrong_size_is_reported(serialized, size):
    parts = list(split_for_streaming(serialized, 1000))
    wrong = TensorPart(index=1, count=4, buffer=bytes(size))
    with pytest.raises(CodecError, match=f"part 1 of 4 must have 1000 bytes, got {size}"):
        combine_from_streaming([parts[0], wrong, parts[2], parts[3]])


def test_oversized_last_part_is_reported(serialized):
    parts = list(split_for_streaming(serialized, 1500))
    longer = TensorPart(index=2, count=3, buffer=bytes(1500))
    with pytest.raises(CodecError, match="must have 1000 bytes, got 1500"):
        combine_from_streaming([parts[0], parts[1], longer])


def test_part_count_disagreeing_with_sizes_is_reported(serialized):
    first = next(split_for_streaming(serialized, 1000))
    lying = TensorPart(0, 5, first.buffer, first.tensor_header, first.part_size)
    with pytest.raises(CodecError, match="make 4 parts, the stream announces 5"):
        combine_from_streaming([lying])


def test_first_part_without_header_or_part_size_is_refused(serialized):
    first = next(split_for_streaming(serialized, 1000))
    with pytest.raises(CodecError, match="lacks the tensor header"):
        TensorPartAssembler().add(TensorPart(0, 4, first.buffer))
    with pytest.raises(CodecError, match="part_size"):
        TensorPartAssembler().add(TensorPart(0, 4, first.buffer, first.tensor_header, 0))


def test_bad_tensor_header_in_first_part_is_refused_before_any_payload(serialized):
    first = next(split_for_streaming(serialized, 1000))
    header = dict(first.tensor_header, codec="zstd")
    with pytest.raises(CodecError, match="unknown codec"):
        TensorPartAssembler().add(TensorPart(0, 4, first.buffer, header, 1000))


def test_announced_size_above_the_limit_is_refused_before_allocating():
    header = {
        "codec": "none",
        "dtype": "float32",
        "shape": [1 << 40],
        "requires_grad": False,
        "params": {},
        "nbytes": 4 << 40,
    }
    assert 4 << 40 > DEFAULT_MAX_NBYTES
    part = TensorPart(0, (4 << 40) // (1 << 20), bytes(1 << 20), header, 1 << 20)
    with pytest.raises(CodecError, match="more than the limit"):
        TensorPartAssembler().add(part)
    with pytest.raises(CodecError, match="limit of 100"):
        TensorPartAssembler(max_nbytes=100).add(
            next(split_for_streaming(serialize_torch_tensor(torch.zeros(26)), 50))
        )


def test_part_header_disagreeing_with_its_buffer_is_refused():
    with pytest.raises(CodecError, match="announces 10 bytes, got 9"):
        TensorPart.from_header({"index": 1, "count": 2, "nbytes": 10}, bytes(9))
    with pytest.raises(CodecError, match="index"):
        TensorPart.from_header({"index": -1, "count": 2, "nbytes": 0}, b"")


def test_assembler_returns_the_tensor_with_the_last_part(serialized):
    assembler = TensorPartAssembler()
    results = [assembler.add(part) for part in split_for_streaming(serialized, 300)]
    assert results[:-1] == [None] * (len(results) - 1)
    assert results[-1] == serialized and assembler.done


def test_split_for_streaming_refuses_non_positive_part_size(serialized):
    with pytest.raises(ValidationError):
        next(split_for_streaming(serialized, 0))


def test_split_into_parts_gives_flat_views_of_bounded_size():
    tensor = torch.arange(10 * 7, dtype=torch.float32).view(10, 7)
    parts = split_into_parts(tensor, 16)
    assert [part.numel() for part in parts] == [16, 16, 16, 16, 6]
    assert all(part.data_ptr() == tensor.data_ptr() + 16 * 4 * i for i, part in enumerate(parts))
    assert torch.equal(torch.cat(parts).view(10, 7), tensor)
    assert [part.numel() for part in split_into_parts(torch.zeros(0), 4)] == [0]
    with pytest.raises(ValidationError):
        split_into_parts(tensor, 0)


def test_part_wise_compression_round_trips_each_part_independently():
    tensor = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    info = CompressionInfo.from_tensor(tensor, key="grad")
    codec = serialize_torch_tensor  # each part gets its own statistics
    received = [
        deserialize_torch_tensor(codec(part, CompressionType.UNIFORM_8BIT, info.get_part(i, 1024)))
        for i, part in enumerate(split_into_parts(tensor, 1024))
    ]
    restored = torch.cat(received)
    assert torch.allclose(restored, tensor, atol=0.05)


async def batches(items, size):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def test_tensor_stream_decodes_consecutive_tensors_from_batches_of_parts():
    tensors = [torch.arange(300.0), torch.zeros(0), torch.randn(5, 7), torch.tensor(3)]
    parts = [
        over_the_wire(part)
        for tensor in tensors
        for part in split_for_streaming(serialize_torch_tensor(tensor), 256)
    ]
    for batch_size in (1, 2, len(parts)):
        restored = asyncio.run(deserialize_tensor_stream(batches(parts, batch_size)))
        assert len(restored) == len(tensors)
        assert all(torch.equal(a, b) for a, b in zip(restored, tensors, strict=True))


def test_tensor_stream_ending_inside_a_tensor_is_reported():
    parts = list(split_for_streaming(serialize_torch_tensor(torch.arange(300.0)), 256))
    with pytest.raises(CodecError, match="truncated"):
        asyncio.run(deserialize_tensor_stream(batches(parts[:-1], 2)))
