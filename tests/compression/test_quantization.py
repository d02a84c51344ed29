"""8-bit codecs: uniform, quantile and blockwise — error bounds and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from swarmgrad.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    CompressionType,
    deserialize_torch_tensor,
    quantization,
    serialize_torch_tensor,
)
from swarmgrad.compression._chunks import random_sample_indices
from swarmgrad.compression.quantization import BLOCKWISE_CODE, assign_nearest, fit_codebook

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow],
)
EIGHT_BIT = [
    CompressionType.UNIFORM_8BIT,
    CompressionType.QUANTILE_8BIT,
    CompressionType.BLOCKWISE_8BIT,
]
#: Largest gap between neighbouring blockwise code values (at +-1), as a fraction of absmax.
BLOCKWISE_MAX_GAP = float((BLOCKWISE_CODE[1:] - BLOCKWISE_CODE[:-1]).max())


def setup_function():
    torch.manual_seed(0)  # data drawn without an explicit generator is the same every run


def round_trip(tensor: torch.Tensor, codec) -> torch.Tensor:
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, codec))


def relative_mse(restored: torch.Tensor, original: torch.Tensor) -> float:
    error = (restored.double() - original.double()).square().mean()
    return (error / original.double().var()).item()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def normal_data() -> torch.Tensor:
    return torch.randn(1 << 20, generator=generator(0))


@pytest.mark.parametrize(
    ("codec", "bound"),
    [
        (CompressionType.UNIFORM_8BIT, 1.1e-4),
        (CompressionType.QUANTILE_8BIT, 5e-5),
        (CompressionType.BLOCKWISE_8BIT, 5.5e-5),
    ],
    ids=str,
)
def test_relative_mse_on_standard_normal_data_is_within_documented_bound(normal_data, codec, bound):
    assert relative_mse(round_trip(normal_data, codec), normal_data) < bound


@pytest.mark.parametrize("codec", EIGHT_BIT, ids=str)
def test_payload_is_one_byte_per_element_plus_small_metadata(normal_data, codec):
    nbytes = serialize_torch_tensor(normal_data, codec).nbytes
    assert normal_data.numel() <= nbytes <= normal_data.numel() * 1.002


@pytest.mark.parametrize("codec", EIGHT_BIT, ids=str)
def test_encoding_is_deterministic(codec):
    tensor = torch.randn(100_000, generator=generator(1))
    first = serialize_torch_tensor(tensor, codec)
    second = serialize_torch_tensor(tensor.clone(), codec)
    assert first.header() == second.header() and bytes(first.buffer) == bytes(second.buffer)


@pytest.mark.parametrize("codec", EIGHT_BIT, ids=str)
@pytest.mark.parametrize("fill", [0.0, 3.25, -1e-30, 1e30])
def test_constant_tensors_come_back_exactly(codec, fill):
    tensor = torch.full((5000,), fill)
    assert torch.equal(round_trip(tensor, codec), tensor)


@pytest.mark.parametrize("codec", EIGHT_BIT, ids=str)
@pytest.mark.parametrize("numel", [1, 2, 3, 255, 256, 257])
def test_tiny_tensors_round_trip_closely(codec, numel):
    tensor = torch.randn(numel, generator=generator(numel))
    error = (round_trip(tensor, codec) - tensor).abs().max().item()
    assert error <= 0.01 * tensor.abs().max().item()


@pytest.mark.parametrize("codec", EIGHT_BIT, ids=str)
def test_non_finite_values_do_not_raise(codec):
    tensor = torch.randn(10_000, generator=generator(2))
    tensor[[5, 500, 5000]] = torch.tensor([math.nan, math.inf, -math.inf])
    restored = round_trip(tensor, codec)
    assert restored.shape == tensor.shape
    if codec != CompressionType.BLOCKWISE_8BIT:  # blockwise: their block is lost
        finite = torch.isfinite(tensor)
        assert bool(torch.isfinite(restored).all())
        assert relative_mse(restored[finite], tensor[finite]) < 1e-3


@pytest.mark.parametrize("codec", EIGHT_BIT, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_other_float_dtypes_are_restored(codec, dtype):
    tensor = torch.randn(70_000, generator=generator(3)).to(dtype)
    restored = round_trip(tensor, codec)
    assert restored.dtype == dtype
    assert relative_mse(restored, tensor) < 2e-4


# --- uniform -----------------------------------------------------------------------------

finite_floats = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)
float_arrays = arrays(
    np.float32, array_shapes(min_dims=1, max_dims=2, max_side=120), elements=finite_floats
)


def min_max_squared_error(tensor: torch.Tensor) -> float:
    values = tensor.double()
    low, high = values.min(), values.max()
    step = (high - low) / 255 if high > low else 1.0
    restored = low + ((values - low) / step).round() * step
    return (restored - values).square().sum().item()


@DETERMINISTIC
@given(values=float_arrays)
def test_uniform_is_never_worse_than_plain_min_max_quantization(values):
    tensor = torch.from_numpy(values)
    restored = round_trip(tensor, CompressionType.UNIFORM_8BIT)
    error = (restored.double() - tensor.double()).square().sum().item()
    scale = tensor.double().abs().max().item()
    assert error <= min_max_squared_error(tensor) * 1.001 + (scale * 1e-6) ** 2 * tensor.numel()


def test_uniform_error_is_at_most_half_a_step_within_the_chosen_range():
    tensor = torch.randn(100_000, generator=generator(4)) * 10 - 3
    serialized = serialize_torch_tensor(tensor, CompressionType.UNIFORM_8BIT)
    low, step = serialized.params["lo"], serialized.params["step"]
    inside = (tensor >= low) & (tensor <= low + 255 * step)
    assert inside.float().mean().item() > 0.998
    error = (deserialize_torch_tensor(serialized) - tensor).abs()
    assert error[inside].max().item() <= step / 2 * 1.0001


def test_uniform_clips_tails_when_that_lowers_the_error():
    uniform = torch.rand(2, 1 << 18, generator=generator(11))
    tensor = uniform[0].log() - uniform[1].log()  # Laplace(0, 1)
    serialized = serialize_torch_tensor(tensor, CompressionType.UNIFORM_8BIT)
    assert serialized.params["step"] * 255 < (tensor.max() - tensor.min()).item()
    error = (deserialize_torch_tensor(serialized) - tensor).square().sum().item()
    assert error < min_max_squared_error(tensor) / 1.2


def test_uniform_on_very_heavy_tails_is_not_worse_than_min_max():
    normal = torch.randn(1 << 18, generator=generator(12))
    tensor = normal / torch.rand(1 << 18, generator=generator(13)).log().neg().sqrt()  # t(2)
    error = (round_trip(tensor, CompressionType.UNIFORM_8BIT) - tensor).square().sum().item()
    assert error <= min_max_squared_error(tensor) * 1.01


def test_uniform_keeps_a_lone_huge_outlier_when_clipping_it_costs_more():
    tensor = torch.randn(1 << 18, generator=generator(5))
    tensor[1234] = 1e6
    restored = round_trip(tensor, CompressionType.UNIFORM_8BIT)
    assert restored[1234].item() == pytest.approx(1e6, rel=1e-3)


def _whole_sample_choice(flat: torch.Tensor) -> tuple[float, float]:
    """The range the uniform search picked before it was cut down: every candidate's
    error from quantizing the whole sample (plus the exact extremes)."""
    sample = quantization.sorted_finite_sample(flat)
    low, high, _ = quantization._finite_range(flat, sample)
    candidates = [(low, high)]
    for fraction in quantization._CLIP_FRACTIONS:
        rank = int(fraction * sample.size)
        if rank < sample.size - 1 - rank:
            candidate = (max(float(sample[rank]), low), min(float(sample[-1 - rank]), high))
            if candidate[0] < candidate[1] and candidate not in candidates:
                candidates.append(candidate)

    def error(values: np.ndarray, lo: float, hi: float) -> float:
        step = (hi - lo) / 255
        restored = np.rint((np.clip(values, lo, hi) - lo) / step) * step + lo
        return float(np.square(restored - values).sum())

    extremes = np.array([low, high])
    scale = (flat.numel() - 2) / sample.size
    errors = [error(sample, lo, hi) * scale + error(extremes, lo, hi) for lo, hi in candidates]
    return candidates[int(np.argmin(errors))]


@pytest.mark.parametrize("shape", ["normal", "laplace", "t2", "outlier", "uniform"])
def test_uniform_range_search_picks_what_the_whole_sample_picks(shape):
    """The search quantizes the sample's tails whole and its middle by every 8th sorted
    value (a few times cheaper per all-reduce part); on parts of the all-reduce's size
    it must choose the range that quantizing the whole sample chose."""
    numel = 1 << 19
    g = generator(21)
    tensor = {
        "normal": lambda: torch.randn(numel, generator=g),
        "laplace": lambda: (
            torch.rand(numel, generator=g).log() - torch.rand(numel, generator=g).log()
        ),
        "t2": lambda: (
            torch.randn(numel, generator=g) / torch.rand(numel, generator=g).log().neg().sqrt()
        ),
        "outlier": lambda: torch.cat([torch.randn(numel - 1, generator=g), torch.tensor([40.0])]),
        "uniform": lambda: torch.rand(numel, generator=g) * 2 - 1,
    }[shape]()
    flat = tensor.view(-1)
    sample = quantization.sorted_finite_sample(flat)
    low, high, _ = quantization._finite_range(flat, sample)
    chosen = quantization._choose_uniform_range(sample, low, high, numel)
    assert chosen == _whole_sample_choice(flat)


def test_sample_indices_are_drawn_once_per_size_and_cannot_be_changed():
    first = random_sample_indices(1 << 20, 1 << 16)
    assert random_sample_indices(1 << 20, 1 << 16) is first
    assert not first.flags.writeable
    with pytest.raises(ValueError):
        first[0] = 0
    assert np.array_equal(random_sample_indices(10, 1 << 16), np.arange(10))


# --- quantile ----------------------------------------------------------------------------


@DETERMINISTIC
@given(values=float_arrays)
def test_quantile_decodes_within_the_input_range(values):
    tensor = torch.from_numpy(values)
    restored = round_trip(tensor, CompressionType.QUANTILE_8BIT)
    assert bool((restored >= tensor.min()).all()) and bool((restored <= tensor.max()).all())


@pytest.mark.parametrize("distinct", [2, 3, 17])
def test_quantile_represents_few_distinct_values_exactly(distinct):
    values = torch.linspace(-4, 9, distinct)
    tensor = values[torch.randint(distinct, (20_000,), generator=generator(distinct))]
    assert torch.equal(round_trip(tensor, CompressionType.QUANTILE_8BIT), tensor)


def test_quantile_adapts_to_heavy_tails_better_than_uniform():
    generator_ = generator(6)
    tensor = torch.randn(1 << 18, generator=generator_).exp()  # log-normal
    quantile = relative_mse(round_trip(tensor, CompressionType.QUANTILE_8BIT), tensor)
    uniform = relative_mse(round_trip(tensor, CompressionType.UNIFORM_8BIT), tensor)
    assert quantile < uniform / 10


def test_codebook_is_ascending_and_within_the_sample_range():
    sample = torch.sort(torch.randn(5000, generator=generator(7)) ** 3).values
    codebook = fit_codebook(sample)
    assert codebook.shape == (256,)
    assert bool((codebook[1:] >= codebook[:-1]).all())
    assert codebook[0] >= sample[0] and codebook[-1] <= sample[-1]


def test_lookup_assignment_is_within_one_cell_of_the_nearest_code():
    tensor = torch.randn(200_000, generator=generator(8)) * 3
    codebook = fit_codebook(torch.sort(tensor[:65536]).values)
    codes = torch.empty(tensor.numel(), dtype=torch.uint8)
    assign_nearest(tensor, codebook, codes)
    boundaries = (codebook[1:] + codebook[:-1]) / 2
    nearest = torch.bucketize(tensor, boundaries)
    cell = (boundaries[-1] - boundaries[0]).item() / 65534
    chosen_error = (codebook[codes.long()] - tensor).abs()
    best_error = (codebook[nearest] - tensor).abs()
    assert bool((chosen_error <= best_error + cell * 1.01).all())
    assert (codes.long() == nearest).float().mean().item() > 0.99


# --- blockwise ---------------------------------------------------------------------------


@DETERMINISTIC
@given(values=float_arrays, block_size=st.sampled_from([1, 7, 64, 4096]))
def test_blockwise_error_is_at_most_half_a_code_gap_of_the_block_maximum(values, block_size):
    tensor = torch.from_numpy(values).reshape(-1)
    codec = BlockwiseQuantization(block_size)
    restored = codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))
    padded = -(-tensor.numel() // block_size) * block_size
    blocks = torch.nn.functional.pad(tensor, (0, padded - tensor.numel())).view(-1, block_size)
    absmax = blocks.abs().amax(dim=1).repeat_interleave(block_size)[: tensor.numel()]
    error = (restored - tensor).abs()
    # (plus half the smallest subnormal: decoding rounds to float32)
    assert bool((error <= absmax * (BLOCKWISE_MAX_GAP / 2 + 1e-6) + 1e-45).all())


def test_blockwise_code_is_symmetric_with_exact_zero_and_unit():
    assert BLOCKWISE_CODE[128] == 0 and BLOCKWISE_CODE[255] == 1 and BLOCKWISE_CODE[1] == -1
    assert torch.equal(BLOCKWISE_CODE[1:128], -BLOCKWISE_CODE[129:].flip(0))
    assert bool((BLOCKWISE_CODE[2:] > BLOCKWISE_CODE[1:-1]).all())  # code 0 is unused


def test_blockwise_keeps_each_block_maximum_and_zeros_exact():
    tensor = torch.randn(3 * 4096 + 100, generator=generator(9))
    tensor[::10] = 0
    tensor[4096:8192] *= 1e-3  # a quiet block keeps its own resolution
    restored = round_trip(tensor, CompressionType.BLOCKWISE_8BIT)
    for start in range(0, tensor.numel(), 4096):
        block, decoded = tensor[start : start + 4096], restored[start : start + 4096]
        peak = block.abs().argmax()
        assert decoded[peak] == block[peak]
        assert (decoded - block).abs().max() <= block.abs().max() * BLOCKWISE_MAX_GAP / 2
    assert bool((restored[::10] == 0).all())


def test_blockwise_outlier_only_affects_its_own_block():
    tensor = torch.randn(4 * 4096, generator=generator(10))
    tensor[5] = 1e4
    restored = round_trip(tensor, CompressionType.BLOCKWISE_8BIT)
    assert relative_mse(restored[4096:], tensor[4096:]) < 6e-5
