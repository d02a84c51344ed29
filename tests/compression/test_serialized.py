"""The wire format: SerializedTensor headers, payload sizes and validation of bad input."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from swarmgrad.compression import CompressionType, SerializedTensor, check_header
from swarmgrad.compression.serialized import (
    MAX_NDIM,
    MAX_NUMEL,
    dtype_from_name,
    dtype_name,
    expected_payload_nbytes,
)
from swarmgrad.utils.errors import CodecError, ValidationError


def make_header(**overrides):
    header = {
        "codec": "none",
        "dtype": "float32",
        "shape": [2, 3],
        "requires_grad": False,
        "params": {},
        "nbytes": 24,
    }
    header.update(overrides)
    return header


def test_header_survives_msgpack_and_rebuilds_an_equal_tensor():
    original = SerializedTensor(
        codec="uniform_8bit",
        dtype="bfloat16",
        shape=(4, 5),
        requires_grad=True,
        params={"lo": -1.5, "step": 0.01},
        buffer=bytes(range(20)),
    )
    header = msgpack.unpackb(msgpack.packb(original.header()))
    rebuilt = SerializedTensor.from_header(header, bytearray(original.buffer))
    assert rebuilt == original
    assert header["nbytes"] == 20
    assert "buffer" not in header


def test_header_ignores_unknown_keys_from_newer_peers():
    rebuilt = SerializedTensor.from_header(make_header(future_field=[1, 2]), bytes(24))
    assert rebuilt.shape == (2, 3)


def test_check_header_returns_announced_payload_size():
    assert check_header(make_header()) == 24


def test_payload_shorter_than_header_names_expected_and_received_sizes():
    with pytest.raises(CodecError, match=r"24.*23|23.*24"):
        SerializedTensor.from_header(make_header(), bytes(23))


def test_header_nbytes_disagreeing_with_shape_is_refused():
    with pytest.raises(CodecError, match="must have 24 bytes"):
        SerializedTensor.from_header(make_header(nbytes=25), bytes(25))


def test_direct_construction_with_wrong_buffer_length_is_refused():
    with pytest.raises(CodecError, match="must have 24 bytes, got 28"):
        SerializedTensor("none", "float32", (2, 3), False, {}, bytes(28))


def test_unknown_codec_is_refused_with_its_name():
    with pytest.raises(CodecError, match="unknown codec 'zstd'"):
        SerializedTensor.from_header(make_header(codec="zstd"), bytes(24))


def test_unknown_dtype_is_refused_with_its_name():
    with pytest.raises(CodecError, match="unknown dtype 'float128'"):
        SerializedTensor.from_header(make_header(dtype="float128"), bytes(24))


@pytest.mark.parametrize(
    "shape",
    [
        [-1, 3],
        [2, 3.0],
        [True, 6],
        "23",
        [1] * (MAX_NDIM + 1),
        [MAX_NUMEL, 2],
        [0, MAX_NUMEL + 1],
    ],
    ids=["negative", "float", "bool", "string", "too-many-dims", "too-many-elements", "huge-dim"],
)
def test_malformed_or_absurd_shape_is_refused(shape):
    with pytest.raises(CodecError, match="shape"):
        SerializedTensor.from_header(make_header(shape=shape), bytes(24))


def test_header_missing_fields_is_refused_naming_them():
    header = make_header()
    del header["dtype"], header["params"]
    with pytest.raises(CodecError, match="dtype, params"):
        SerializedTensor.from_header(header, bytes(24))


def test_non_mapping_header_is_refused():
    with pytest.raises(CodecError):
        SerializedTensor.from_header([1, 2, 3], bytes(24))


def test_requires_grad_on_integer_dtype_is_refused():
    with pytest.raises(CodecError, match="requires_grad"):
        SerializedTensor.from_header(make_header(dtype="int32", requires_grad=True), bytes(24))


def test_lossy_codec_on_integer_dtype_is_refused():
    with pytest.raises(CodecError, match="int64"):
        SerializedTensor.from_header(
            make_header(codec="float16", dtype="int64", nbytes=12), bytes(12)
        )


@pytest.mark.parametrize(
    ("codec", "params"),
    [
        ("meanstd_16bit", {}),
        ("meanstd_16bit", {"rows": 4}),  # 6 elements do not split into 4 rows
        ("meanstd_16bit", {"rows": 0}),
        ("uniform_8bit", {"lo": 0.0}),
        ("uniform_8bit", {"lo": 0.0, "step": -1.0}),
        ("uniform_8bit", {"lo": math.nan, "step": 1.0}),
        ("uniform_8bit", {"lo": "0", "step": 1.0}),
        ("blockwise_8bit", {"block": 0}),
        ("blockwise_8bit", {"block": 2.5}),
        ("blockwise_8bit", {"block": 1 << 30}),
    ],
)
def test_bad_codec_params_are_refused(codec, params):
    with pytest.raises(CodecError, match=codec):
        expected_payload_nbytes(codec, torch.float32, 6, params)


@pytest.mark.parametrize(
    ("codec", "params", "nbytes"),
    [
        ("none", {}, 24),
        ("float16", {}, 12),
        ("bfloat16", {}, 12),
        ("meanstd_16bit", {"rows": 2}, 2 * 8 + 12),
        ("uniform_8bit", {"lo": 0, "step": 0.5}, 6),
        ("quantile_8bit", {}, 1024 + 6),
        ("blockwise_8bit", {"block": 4}, 2 * 4 + 6),
    ],
)
def test_payload_size_follows_the_documented_layout(codec, params, nbytes):
    assert expected_payload_nbytes(codec, torch.float32, 6, params) == nbytes


def test_every_codec_name_has_a_payload_rule():
    for codec in CompressionType:
        params = {"rows": 1, "lo": 0.0, "step": 1.0, "block": 8}
        assert expected_payload_nbytes(codec.value, torch.float32, 8, params) >= 8


def test_buffer_of_wrong_type_is_refused():
    with pytest.raises(CodecError, match="bytes, bytearray or memoryview"):
        SerializedTensor("none", "float32", (1,), False, {}, [0, 0, 0, 0])


def test_non_contiguous_memoryview_is_refused():
    strided = memoryview(bytes(48))[::2]
    with pytest.raises(CodecError, match="contiguous"):
        SerializedTensor("none", "float32", (2, 3), False, {}, strided)


def test_memoryview_of_wider_items_counts_bytes_not_items():
    floats = memoryview(torch.zeros(6).numpy())
    tensor = SerializedTensor("none", "float32", (2, 3), False, {}, floats)
    assert tensor.nbytes == 24


def test_dtype_names_round_trip_and_unknown_dtype_objects_are_refused():
    for dtype in (torch.float32, torch.bfloat16, torch.complex64, torch.bool, torch.uint64):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    with pytest.raises(CodecError):
        dtype_name(torch.qint8)


def test_codec_error_is_a_validation_error():
    assert issubclass(CodecError, ValidationError)
