"""Adaptive codecs choose a codec per tensor by size, role or key."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorRole,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from swarmgrad.utils.errors import ValidationError


def setup_function():
    torch.manual_seed(0)  # data drawn without an explicit generator is the same every run


def compress(codec, tensor, **info_fields):
    return codec.compress(tensor, CompressionInfo.from_tensor(tensor, **info_fields))


def test_size_adaptive_uses_less_below_threshold_and_greater_equal_from_it():
    codec = SizeAdaptiveCompression(
        100, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
    )
    assert compress(codec, torch.randn(99)).codec == "float16"
    assert compress(codec, torch.randn(100)).codec == "uniform_8bit"
    assert compress(codec, torch.randn(10, 10)).codec == "uniform_8bit"


def test_size_adaptive_decides_by_the_whole_tensor_for_every_part():
    codec = SizeAdaptiveCompression(1000, less=NoCompression(), greater_equal=Float16Compression())
    tensor = torch.randn(4000)
    info = CompressionInfo.from_tensor(tensor)
    for index, part in enumerate(tensor.split(500)):
        assert codec.compress(part, info.get_part(index, 500)).codec == "float16"


def test_role_adaptive_picks_the_codec_of_each_role_and_default_for_the_rest():
    codec = RoleAdaptiveCompression(
        activation=Float16Compression(),
        gradient=Quantile8BitQuantization(),
        optimizer=BlockwiseQuantization(),
        default=ScaledFloat16Compression(),
    )
    tensor = torch.randn(256)
    expected = {
        TensorRole.ACTIVATION: "float16",
        TensorRole.GRADIENT: "quantile_8bit",
        TensorRole.OPTIMIZER: "blockwise_8bit",
        TensorRole.PARAMETER: "meanstd_16bit",
        TensorRole.UNSPECIFIED: "meanstd_16bit",
    }
    for role, name in expected.items():
        assert compress(codec, tensor, role=role).codec == name


def test_role_adaptive_default_is_no_compression():
    codec = RoleAdaptiveCompression(gradient=Float16Compression())
    assert compress(codec, torch.randn(8), role=TensorRole.PARAMETER).codec == "none"


def test_per_tensor_looks_codecs_up_by_index_or_key():
    by_index = PerTensorCompression([NoCompression(), Float16Compression()])
    assert compress(by_index, torch.randn(4), key=1).codec == "float16"
    by_name = PerTensorCompression({"weight": Uniform8BitQuantization(), "bias": NoCompression()})
    assert compress(by_name, torch.randn(4), key="weight").codec == "uniform_8bit"
    assert compress(by_name, torch.randn(4), key="bias").codec == "none"


def test_per_tensor_refuses_a_key_without_a_codec():
    codec = PerTensorCompression([NoCompression()])
    with pytest.raises(ValidationError, match="tensor 3"):
        compress(codec, torch.randn(4), key=3)
    with pytest.raises(ValidationError, match="tensor 'x'"):
        compress(codec, torch.randn(4), key="x")


def test_adaptive_codecs_extract_whatever_codec_they_chose():
    nested = SizeAdaptiveCompression(
        10,
        less=NoCompression(),
        greater_equal=RoleAdaptiveCompression(gradient=BlockwiseQuantization(block_size=16)),
    )
    tensor = torch.randn(1000)
    info = CompressionInfo.from_tensor(tensor, role=TensorRole.GRADIENT)
    serialized = nested.compress(tensor, info)
    assert serialized.codec == "blockwise_8bit"
    tolerance = 0.02 * tensor.abs().max().item()
    assert torch.allclose(nested.extract(serialized), tensor, atol=tolerance)
    assert torch.allclose(deserialize_torch_tensor(serialized), tensor, atol=tolerance)


def test_adaptive_codecs_estimate_the_ratio_of_their_choice():
    codec = SizeAdaptiveCompression(100, less=NoCompression(), greater_equal=Float16Compression())
    assert codec.estimate_compression_ratio(CompressionInfo.from_tensor(torch.zeros(10))) == 1.0
    assert codec.estimate_compression_ratio(CompressionInfo.from_tensor(torch.zeros(1000))) == 0.5


def test_serialize_torch_tensor_accepts_an_adaptive_codec():
    codec = SizeAdaptiveCompression(5, less=NoCompression(), greater_equal=Float16Compression())
    assert serialize_torch_tensor(torch.randn(10), codec).codec == "float16"


@pytest.mark.parametrize(
    "build",
    [
        lambda: SizeAdaptiveCompression(-1, NoCompression(), NoCompression()),
        lambda: SizeAdaptiveCompression(10, "float16", NoCompression()),
        lambda: RoleAdaptiveCompression(gradient=object()),
        lambda: PerTensorCompression([NoCompression(), None]),
        lambda: PerTensorCompression(NoCompression()),
    ],
)
def test_adaptive_codecs_refuse_malformed_configuration(build):
    with pytest.raises(ValidationError):
        build()
