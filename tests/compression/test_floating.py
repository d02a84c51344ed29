"""16-bit codecs: float16, bfloat16, mean-std scaled float16 — error bounds and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from swarmgrad.compression import (
    CompressionType,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
FP16_MAX = 65504.0


def setup_function():
    torch.manual_seed(0)  # data drawn without an explicit generator is the same every run


def round_trip(tensor: torch.Tensor, codec: CompressionType) -> torch.Tensor:
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, codec))


def relative_mse(restored: torch.Tensor, original: torch.Tensor) -> float:
    error = (restored.double() - original.double()).square().mean()
    return (error / original.double().var()).item()


@pytest.fixture(scope="module")
def normal_data() -> torch.Tensor:
    return torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("codec", "bound"),
    [
        (CompressionType.FLOAT16, 4.5e-8),
        (CompressionType.BFLOAT16, 3e-6),
        (CompressionType.MEANSTD_16BIT, 4.3e-8),
    ],
    ids=str,
)
def test_relative_mse_on_standard_normal_data_is_within_documented_bound(normal_data, codec, bound):
    assert relative_mse(round_trip(normal_data, codec), normal_data) < bound


finite_floats = st.floats(
    min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32
)


@DETERMINISTIC
@given(
    values=arrays(
        np.float32, array_shapes(min_dims=0, max_dims=3, max_side=8), elements=finite_floats
    )
)
def test_float16_error_is_within_half_a_float16_ulp_or_the_clamp(values):
    tensor = torch.from_numpy(values)
    restored = round_trip(tensor, CompressionType.FLOAT16)
    clamped = tensor.clamp(-FP16_MAX, FP16_MAX).double()
    error = (restored.double() - clamped).abs()
    assert bool((error <= clamped.abs() * 2.0**-11 + 2.0**-25).all())


@DETERMINISTIC
@given(
    values=arrays(
        np.float32, array_shapes(min_dims=0, max_dims=3, max_side=8), elements=finite_floats
    )
)
def test_bfloat16_relative_error_is_at_most_two_to_the_minus_eight(values):
    tensor = torch.from_numpy(values)
    restored = round_trip(tensor, CompressionType.BFLOAT16)
    error = (restored.double() - tensor.double()).abs()
    assert bool((error <= tensor.double().abs() * 2.0**-8 + 1e-38).all())


@DETERMINISTIC
@given(
    values=arrays(
        np.float32, array_shapes(min_dims=1, max_dims=3, max_side=100), elements=finite_floats
    ),
)
def test_meanstd_error_is_small_next_to_the_largest_value(values):
    tensor = torch.from_numpy(values)
    restored = round_trip(tensor, CompressionType.MEANSTD_16BIT)
    error = (restored.double() - tensor.double()).abs().max().item()
    assert error <= 2e-3 * tensor.double().abs().max().item() + 1e-30


def test_float16_clamps_to_its_range_and_keeps_nan():
    tensor = torch.tensor([1e6, -1e9, math.inf, -math.inf, math.nan, 3.0])
    restored = round_trip(tensor, CompressionType.FLOAT16)
    assert restored[:4].tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, -FP16_MAX]
    assert math.isnan(restored[4]) and restored[5] == 3.0


def test_float16_sends_a_float16_tensor_without_copying():
    tensor = torch.randn(100).half()
    serialized = serialize_torch_tensor(tensor, CompressionType.FLOAT16)
    assert np.frombuffer(serialized.buffer, dtype=np.uint8).ctypes.data == tensor.data_ptr()


def test_float16_input_is_never_modified():
    tensor = torch.tensor([1e6, 2.0])
    round_trip(tensor, CompressionType.FLOAT16)
    assert tensor.tolist() == [1e6, 2.0]


def test_bfloat16_keeps_float32_range():
    tensor = torch.tensor([1e30, -1e-30, 3.0e38])
    restored = round_trip(tensor, CompressionType.BFLOAT16)
    assert torch.allclose(restored, tensor, rtol=2**-8)


def test_meanstd_keeps_precision_for_values_near_a_large_mean():
    tensor = 1000 + torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    assert relative_mse(round_trip(tensor, CompressionType.MEANSTD_16BIT), tensor) < 5e-8
    assert relative_mse(round_trip(tensor, CompressionType.FLOAT16), tensor) > 1e-2


def test_meanstd_keeps_precision_for_tiny_values():
    tensor = 1e-7 * torch.randn(1 << 16, generator=torch.Generator().manual_seed(2))
    assert relative_mse(round_trip(tensor, CompressionType.MEANSTD_16BIT), tensor) < 5e-8
    assert relative_mse(round_trip(tensor, CompressionType.FLOAT16), tensor) > 1e-3


def test_meanstd_uses_separate_statistics_per_row():
    rows = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    rows *= torch.tensor([[1e-6], [1.0], [1e4], [0.0]])
    rows[3] += 5.0
    serialized = serialize_torch_tensor(rows, CompressionType.MEANSTD_16BIT)
    assert serialized.params == {"rows": 4}
    restored = deserialize_torch_tensor(serialized)
    for row, original in zip(restored, rows, strict=True):
        scale = original.abs().max().item()
        assert (row - original).abs().max().item() <= 2e-3 * scale


def test_meanstd_treats_short_rows_and_vectors_as_one_row():
    for shape in [(1000,), (100, 10), (2, 3, 4)]:
        serialized = serialize_torch_tensor(torch.randn(shape), CompressionType.MEANSTD_16BIT)
        assert serialized.params == {"rows": 1}


def test_meanstd_keeps_exact_zeros_of_sparse_data():
    generator = torch.Generator().manual_seed(4)
    tensor = torch.randn(4096, generator=generator) * (torch.rand(4096, generator=generator) > 0.9)
    restored = round_trip(tensor, CompressionType.MEANSTD_16BIT)
    assert torch.equal(restored == 0, tensor == 0)


@pytest.mark.parametrize("fill", [0.0, 7.5, -1e-20])
def test_meanstd_handles_constant_rows(fill):
    tensor = torch.full((3, 100), fill)
    assert torch.allclose(round_trip(tensor, CompressionType.MEANSTD_16BIT), tensor, rtol=1e-3)


def test_meanstd_with_non_finite_values_does_not_raise():
    tensor = torch.tensor([[1.0, math.nan] * 40, [1.0, 2.0] * 40])
    restored = round_trip(tensor, CompressionType.MEANSTD_16BIT)
    assert torch.allclose(restored[1], tensor[1], rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_meanstd_handles_other_float_dtypes(dtype):
    tensor = (3 + torch.randn(8, 128, generator=torch.Generator().manual_seed(5))).to(dtype)
    restored = round_trip(tensor, CompressionType.MEANSTD_16BIT)
    assert restored.dtype == dtype
    assert torch.allclose(restored.double(), tensor.double(), rtol=1e-2, atol=1e-2)


def test_meanstd_keeps_tiny_values_whose_squares_underflow_float32():
    tensor = torch.tensor([6.302427694635731e-25, 0.0])  # found by hypothesis
    restored = round_trip(tensor, CompressionType.MEANSTD_16BIT)
    error = (restored.double() - tensor.double()).abs().max().item()
    assert error <= 2e-3 * 6.302427694635731e-25
