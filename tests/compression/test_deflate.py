"""Deflated payloads: lossless, never longer, checked on arrival, decoded by any codec."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.compression import (
    BFloat16Compression,
    Blockwise4BitQuantization,
    BlockwiseQuantization,
    Float16Compression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SerializedTensor,
    Uniform8BitQuantization,
    check_header,
    deserialize_torch_tensor,
)
from swarmgrad.compression.base import CompressionInfo
from swarmgrad.compression.deflate import deflate_payload, inflate_payload
from swarmgrad.compression.serialized import DEFLATED
from swarmgrad.utils.errors import CodecError, ValidationError

CODECS = (
    Float16Compression,
    BFloat16Compression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    Quantile8BitQuantization,
    BlockwiseQuantization,
    Blockwise4BitQuantization,
)


def peaked(numel: int, seed: int = 0) -> torch.Tensor:
    """Values like a pseudo-gradient's: most near zero, a few far out."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    return values**3


@pytest.mark.parametrize("codec_cls", CODECS)
def test_deflated_payloads_decode_to_exactly_the_plain_values(codec_cls):
    tensor = peaked(20_000).view(100, 200)
    plain, deflating = codec_cls(), codec_cls(deflate=True)
    sent = deflating.compress(tensor)
    expected = plain.extract(plain.compress(tensor))
    assert torch.equal(deflating.extract(sent), expected)
    assert torch.equal(plain.extract(sent), expected)  # a receiver that does not deflate
    assert torch.equal(deserialize_torch_tensor(sent), expected)
    if sent.params.get(DEFLATED):
        assert sent.nbytes < plain.compress(tensor).nbytes
        assert check_header(sent.header()) == sent.nbytes


def test_quantized_codes_shrink_and_the_estimate_follows():
    codec = Uniform8BitQuantization(deflate=True)
    info = CompressionInfo.from_tensor(torch.zeros(20_000))
    assert codec.estimate_compression_ratio(info) == 0.25  # nothing deflated yet
    sent = codec.compress(peaked(20_000))
    assert sent.params[DEFLATED] is True and sent.nbytes < 0.8 * 20_000
    assert 0.25 * 0.5 < codec.estimate_compression_ratio(info) < 0.25
    assert repr(codec) == "Uniform8BitQuantization(deflate=True)"
    assert repr(Blockwise4BitQuantization(32, deflate=True)) == (
        "Blockwise4BitQuantization(block_size=32, deflate=True)"
    )
    assert repr(Uniform8BitQuantization()) == "Uniform8BitQuantization()"


def test_a_payload_that_does_not_shrink_travels_plain():
    random_codes = SerializedTensor(
        codec="uniform_8bit",
        dtype="float32",
        shape=(4096,),
        requires_grad=False,
        params={"lo": 0.0, "step": 1.0},
        buffer=torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes(),
    )
    assert deflate_payload(random_codes) is random_codes
    assert inflate_payload(random_codes) is random_codes


@settings(max_examples=60, deadline=None)
@given(
    codec_index=st.integers(0, len(CODECS) - 1),
    numel=st.integers(1, 3000),
    scale=st.floats(1e-6, 1e6),
    seed=st.integers(0, 2**16),
)
def test_deflate_round_trips_any_payload(codec_index, numel, scale, seed):
    codec_cls = CODECS[codec_index]
    tensor = peaked(numel, seed) * scale
    plain = codec_cls().compress(tensor)
    deflated = deflate_payload(plain)
    assert deflated.nbytes <= plain.nbytes
    back = inflate_payload(deflated)
    assert bytes(back.buffer) == bytes(plain.buffer) and back.params == plain.params


def _deflated(tensor_numel: int = 4096) -> SerializedTensor:
    sent = Uniform8BitQuantization(deflate=True).compress(peaked(tensor_numel))
    assert sent.params.get(DEFLATED) is True
    return sent


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b[: len(b) // 2], "truncated|corrupt"),
        (lambda b: b[:10] + bytes(len(b) - 10), "corrupt"),
        (lambda b: b + zlib.compress(b"x"), "bytes after its zlib stream"),
        (lambda b: zlib.compress(bytes(4000), 1), "inflates to 4000 bytes, not 4096"),
        (lambda b: zlib.compress(bytes(5000), 1), "more than the 4096 bytes"),
    ],
)
def test_a_bad_deflated_payload_is_refused_by_name(mangle, message):
    sent = _deflated()
    bad = replace(sent, buffer=mangle(bytes(sent.buffer)))
    with pytest.raises(CodecError, match=message):
        Uniform8BitQuantization().extract(bad)


def test_deflated_sizes_and_flags_are_checked_before_anything_is_read():
    sent = _deflated()
    header = sent.header()
    with pytest.raises(CodecError, match="deflated, must have 1 to 4096 bytes, header announces"):
        check_header({**header, "nbytes": 4097})
    with pytest.raises(CodecError, match="deflated, must have 1 to 4096 bytes"):
        check_header({**header, "nbytes": 0})
    with pytest.raises(CodecError, match="must be true or absent"):
        check_header({**header, "params": {**header["params"], DEFLATED: 1}})
    with pytest.raises(CodecError, match="never deflated"):
        SerializedTensor(
            codec="none",
            dtype="float32",
            shape=(1,),
            requires_grad=False,
            params={DEFLATED: True},
            buffer=b"abc",
        )
    with pytest.raises(ValidationError, match="deflate must be a bool"):
        Uniform8BitQuantization(deflate="yes")
