"""Tensors in RPC messages: round trips over a real peer pair and malformed inputs."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.compression import (
    CompressionType,
    serialize_torch_tensor,
    serialized_from_message,
    serialized_to_message,
    tensors_from_message,
    tensors_to_message,
)
from swarmgrad.net import Peer
from swarmgrad.utils.errors import CodecError


def test_tensors_round_trip_through_an_rpc_between_two_peers(arun):
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(0, 4)]

    async def main():
        async with await Peer.create() as server, await Peer.create() as client:

            async def echo(request, context):
                decoded = tensors_from_message(request)
                return tensors_to_message([t * 2 for t in decoded])

            server.add_handler("echo", echo)
            reply = await client.call(
                server.get_visible_maddrs()[0], "echo", tensors_to_message(tensors)
            )
            return tensors_from_message(reply)

    for got, sent in zip(arun(main), tensors, strict=True):
        assert torch.equal(got, sent * 2)


def test_per_tensor_codecs_and_lossy_round_trip():
    tensors = [torch.randn(100), torch.randn(100)]
    message = tensors_to_message(tensors, [CompressionType.NONE, CompressionType.FLOAT16])
    first, second = tensors_from_message(message)
    assert torch.equal(first, tensors[0])
    assert torch.allclose(second, tensors[1], atol=1e-2)
    assert message[1]["h"]["codec"] == "float16"


def test_codec_count_mismatch_is_refused():
    with pytest.raises(CodecError, match="2 codecs given for 1 tensors"):
        tensors_to_message([torch.zeros(2)], ["none", "none"])


@pytest.mark.parametrize(
    "message, match",
    [
        ("junk", "expected a list"),
        (["junk"], r"inputs\[0\]: expected a tensor message"),
        ([{"h": 1, "b": b""}], r"inputs\[0\]: malformed"),
    ],
)
def test_malformed_messages_name_the_tensor(message, match):
    what = "inputs" if isinstance(message, list) else "tensors"
    with pytest.raises(CodecError, match=match):
        tensors_from_message(message, what)


def test_payload_length_disagreeing_with_header_is_refused():
    message = serialized_to_message(serialize_torch_tensor(torch.zeros(4)))
    message["b"] = bytes(8)
    with pytest.raises(CodecError, match=r"grad_in: .*must have 16 bytes, got 8"):
        serialized_from_message(message, "grad_in")
