"""4-bit blockwise codec: error bound, exact zeros and block maxima, packing, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from swarmgrad.compression import (
    Blockwise4BitQuantization,
    CompressionInfo,
    CompressionType,
    SerializedTensor,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from swarmgrad.compression.four_bit import FOUR_BIT_CODE
from swarmgrad.utils.errors import CodecError, ValidationError

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
#: Largest gap between neighbouring code values (codes 0..14), as a fraction of absmax.
MAX_GAP = float((FOUR_BIT_CODE[1:15] - FOUR_BIT_CODE[:14]).max())

float_arrays = arrays(
    np.float32,
    st.integers(0, 300),
    elements=st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False),
)


def round_trip(tensor: torch.Tensor, codec=CompressionType.BLOCKWISE_4BIT) -> torch.Tensor:
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, codec))


def block_absmax(tensor: torch.Tensor, block: int) -> torch.Tensor:
    padded = -(-tensor.numel() // block) * block
    blocks = torch.nn.functional.pad(tensor, (0, padded - tensor.numel())).view(-1, block)
    return blocks.abs().amax(dim=1).repeat_interleave(block)[: tensor.numel()]


@DETERMINISTIC
@given(values=float_arrays, block_size=st.sampled_from([1, 3, 7, 64, 4096]))
def test_error_is_at_most_half_a_code_gap_of_the_block_maximum(values, block_size):
    tensor = torch.from_numpy(values)
    codec = Blockwise4BitQuantization(block_size)
    serialized = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
    assert serialized.nbytes == -(-tensor.numel() // block_size) * 4 + (tensor.numel() + 1) // 2
    restored = codec.extract(serialized)
    bound = block_absmax(tensor, block_size) * (MAX_GAP / 2 + 1e-6) + 1e-45
    assert bool(((restored - tensor).abs() <= bound).all())


def test_code_is_symmetric_with_exact_zero_and_unit_and_finer_near_zero():
    levels = FOUR_BIT_CODE[:15]
    assert levels[7] == 0 and levels[14] == 1 and levels[0] == -1 and FOUR_BIT_CODE[15] == 0
    assert torch.equal(levels[:7], -levels[8:].flip(0))
    gaps = levels[1:] - levels[:-1]
    assert bool((gaps > 0).all()) and gaps[7] < gaps[13]


def test_zeros_and_each_block_maximum_are_exact():
    tensor = torch.randn(5 * 64 + 9, generator=torch.Generator().manual_seed(1))
    tensor[::5] = 0
    tensor[64:128] *= 1e-4  # a quiet block keeps its own resolution
    restored = round_trip(tensor)
    assert bool((restored[::5] == 0).all())
    for start in range(0, tensor.numel(), 64):
        block, decoded = tensor[start : start + 64], restored[start : start + 64]
        peak = block.abs().argmax()
        assert decoded[peak] == block[peak]


def test_relative_mse_on_standard_normal_data_is_within_documented_bound():
    tensor = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    restored = round_trip(tensor)
    assert ((restored - tensor).square().mean() / tensor.var()).item() < 1e-2


def test_two_codes_per_byte_low_nibble_first():
    tensor = torch.tensor([-1.0, 1.0, 0.0])  # codes 0, 14, 7 with one block of absmax 1
    serialized = serialize_torch_tensor(tensor, Blockwise4BitQuantization(block_size=4))
    payload = bytes(serialized.buffer)
    assert payload[4:] == bytes([0 | 14 << 4, 7])
    assert torch.equal(deserialize_torch_tensor(serialized), tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_and_shapes_are_restored(dtype):
    tensor = torch.randn(3, 5, 7).to(dtype)
    restored = round_trip(tensor)
    assert restored.dtype == dtype and restored.shape == tensor.shape
    bound = tensor.float().abs().max() * MAX_GAP / 2 * 1.01
    assert (restored.float() - tensor.float()).abs().max() <= bound


def test_chunks_larger_than_one_pass_agree_with_a_single_pass():
    tensor = torch.randn((1 << 20) * 2 + 77, generator=torch.Generator().manual_seed(3))
    codec = Blockwise4BitQuantization(block_size=7)  # odd blocks: chunks stay byte-aligned
    whole = codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))
    start = (tensor.numel() // 7 - 11) * 7  # the last blocks, from a block boundary
    tail = tensor[start:]
    alone = codec.extract(codec.compress(tail, CompressionInfo.from_tensor(tail)))
    assert torch.equal(whole[start:], alone)


def test_non_finite_values_do_not_raise():
    tensor = torch.tensor([1.0, float("nan"), 2.0, float("inf")] + [0.5] * 64)
    restored = round_trip(tensor)
    assert restored.shape == tensor.shape
    assert bool(torch.isfinite(restored[64:]).all())  # other blocks are untouched


@pytest.mark.parametrize("bad", [0, -1, 1 << 25, 2.5, True, "64"])
def test_bad_block_sizes_are_refused_by_name(bad):
    with pytest.raises(ValidationError, match="block_size"):
        Blockwise4BitQuantization(bad)


def test_a_payload_of_the_wrong_length_is_refused_before_decoding():
    good = serialize_torch_tensor(torch.randn(100), CompressionType.BLOCKWISE_4BIT)
    with pytest.raises(CodecError, match=r"blockwise_4bit payload .* must have 58 bytes, got 57"):
        SerializedTensor(
            codec="blockwise_4bit",
            dtype="float32",
            shape=(100,),
            requires_grad=False,
            params={"block": 64},
            buffer=bytes(good.buffer)[:-1],
        )
    with pytest.raises(CodecError, match="'block'"):
        SerializedTensor(
            codec="blockwise_4bit",
            dtype="float32",
            shape=(100,),
            requires_grad=False,
            params={"block": 0},
            buffer=bytes(good.buffer),
        )
