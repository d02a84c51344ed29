"""Lossless zlib coding of a lossy codec's payload, for links slower than zlib.

Quantized codes are far from uniform: most of a pseudo-gradient's 8-bit codes sit near
the middle of its range, and its 4-bit codes near zero. zlib's Huffman stage takes that
redundancy out without changing a single value: measured on the 120k-parameter
language model of ``benchmarks/slow_links.py`` (outer gradients after 50 AdamW steps, cut
in 16 parts as an all-reduce of 4 peers sends them), 8-bit payloads shrink to 0.72-0.78
of their size and 4-bit ones to 0.87, at about 60 MB/s (level 1, one core). That is worth
it below a few hundred Mbit/s per peer, and a loss above, hence opt-in per codec
(``Uniform8BitQuantization(deflate=True)``). Receivers inflate whatever arrives
deflated, whether their own codec deflates or not: peers need not agree on it.

A deflated payload is never longer than the plain one (the plain one is sent when zlib
does not shrink it), and inflating stops at the plain layout's size, so a hostile stream
cannot make a receiver allocate more than the header's tensor needs.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

from swarmgrad.compression.serialized import (
    DEFLATED,
    SerializedTensor,
    expected_payload_nbytes,
    is_deflated,
)
from swarmgrad.utils.errors import CodecError

__all__ = ["deflate_payload", "inflate_payload"]

#: fastest level: on quantized codes higher levels gain 1-3% for 1.5x the time
LEVEL = 1


def deflate_payload(serialized: SerializedTensor) -> SerializedTensor:
    """The same tensor with its payload deflated, or ``serialized`` itself when zlib does
    not make it shorter (or it is not a lossy codec's, or already deflated)."""
    if serialized.codec == "none" or is_deflated(serialized.codec, serialized.params):
        return serialized
    packed = zlib.compress(serialized.buffer, LEVEL)
    if len(packed) >= serialized.nbytes:
        return serialized
    return replace(serialized, params={**serialized.params, DEFLATED: True}, buffer=packed)


def inflate_payload(serialized: SerializedTensor) -> SerializedTensor:
    """The same tensor with a plain payload (``serialized`` itself if it is not deflated);
    CodecError if the stream is corrupt or does not inflate to exactly the layout's size."""
    if not is_deflated(serialized.codec, serialized.params):
        return serialized
    params = {k: v for k, v in serialized.params.items() if k != DEFLATED}
    expected = expected_payload_nbytes(
        serialized.codec, serialized.torch_dtype, serialized.numel, params
    )
    what = f"deflated {serialized.codec} payload of a tensor of shape {list(serialized.shape)}"
    inflater = zlib.decompressobj()
    try:
        plain = inflater.decompress(serialized.buffer, expected)
        if len(plain) == expected and not inflater.eof:
            # the stream's end may still be unread; any further byte is one too many
            if inflater.decompress(inflater.unconsumed_tail, 1):
                raise CodecError(f"{what} inflates to more than the {expected} bytes it must have")
    except zlib.error as e:
        raise CodecError(f"{what} is corrupt: {e}") from None
    if not inflater.eof:
        raise CodecError(f"{what} is truncated: {len(plain)} of {expected} bytes")
    if inflater.unused_data:
        raise CodecError(f"{what} has {len(inflater.unused_data)} bytes after its zlib stream")
    if len(plain) != expected:
        raise CodecError(f"{what} inflates to {len(plain)} bytes, not {expected}")
    return replace(serialized, params=params, buffer=plain)
