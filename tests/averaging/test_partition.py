"""Spans and parts of the flattened tensors (sender side) and the owner's reducer."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.allreduce.partition import (
    TensorPartContainer,
    TensorPartReducer,
    tensor_schema,
)
from swarmgrad.compression import CompressionType
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

dtypes = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@st.composite
def tensors_and_spans(draw):
    shapes = draw(
        st.lists(
            st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=3),
            min_size=1,
            max_size=5,
        )
    )
    tensors = [torch.randn(shape, dtype=torch.float64).to(draw(dtypes)) for shape in shapes]
    total = sum(t.numel() for t in tensors)
    num_spans = draw(st.integers(min_value=1, max_value=5))
    cuts = sorted(
        draw(st.lists(st.integers(0, total), min_size=num_spans - 1, max_size=num_spans - 1))
    )
    spans = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    part_size = draw(st.integers(min_value=1, max_value=64))
    return tensors, spans, part_size


@settings(max_examples=150, deadline=None)
@given(tensors_and_spans())
def test_parts_cover_every_element_once_in_order(case):
    tensors, spans, part_size = case
    container = TensorPartContainer(tensors, spans, part_size_bytes=part_size)
    flat = torch.cat([t.double().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    position = 0
    for span_index, span_size in enumerate(spans):
        span_values = []
        for part_index, spec in enumerate(container.parts[span_index]):
            assert spec.numel > 0
            # a part crosses tensors only to merge pieces that are smaller than a part
            assert len(spec.pieces) == 1 or spec.nbytes <= max(part_size, spec.dtype.itemsize)
            span_values.append(container.local_part(span_index, part_index).double())
        got = torch.cat(span_values) if span_values else torch.zeros(0, dtype=torch.float64)
        assert torch.equal(got, flat[position : position + span_size])
        assert container.part_offsets(span_index)[-1] == container.span_nbytes(span_index)
        position += span_size
    assert position == flat.numel()


@settings(max_examples=100, deadline=None)
@given(tensors_and_spans())
def test_applying_parts_writes_each_element_back_where_it_came_from(case):
    tensors, spans, part_size = case
    container = TensorPartContainer(tensors, spans, part_size_bytes=part_size)
    expected = [t.clone() * 3 for t in tensors]
    for span_index in range(len(spans)):
        for part_index in range(container.num_parts(span_index)):
            part = container.local_part(span_index, part_index)
            container.apply_part(span_index, part_index, part * 3)
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(tensors_and_spans(), st.sampled_from(list(CompressionType)))
def test_serialized_parts_decode_to_the_part(case, codec):
    tensors, spans, part_size = case
    container = TensorPartContainer(tensors, spans, part_size_bytes=part_size, compression=codec)
    for span_index in range(len(spans)):
        for part_index in range(container.num_parts(span_index)):
            message = container.serialize_part(span_index, part_index)
            decoded = container.decode_part(span_index, part_index, message, "peer")
            original = container.local_part(span_index, part_index)
            assert decoded.dtype == original.dtype and decoded.shape == original.shape
            if codec is CompressionType.NONE:
                assert torch.equal(decoded, original)


def test_parts_inside_one_tensor_are_views_not_copies():
    tensor = torch.arange(1000, dtype=torch.float32)
    container = TensorPartContainer([tensor], [400, 600], part_size_bytes=400)
    part = container.local_part(1, 0)
    assert part.data_ptr() == tensor[400:].data_ptr()
    assert [spec.numel for spec in container.parts[1]] == [100] * 6


def test_small_tensors_are_merged_into_one_part():
    tensors = [torch.ones(3), torch.ones(5) * 2, torch.ones(1000)]
    container = TensorPartContainer(tensors, [1008], part_size_bytes=64)  # 16 floats
    first, second = container.parts[0][:2]
    assert [p.tensor_index for p in first.pieces] == [0, 1]
    assert torch.equal(container.local_part(0, 0), torch.tensor([1.0] * 3 + [2.0] * 5))
    assert [p.tensor_index for p in second.pieces] == [2] and second.numel == 16


def test_a_received_part_of_the_wrong_size_or_dtype_is_refused():
    container = TensorPartContainer([torch.zeros(10)], [10], part_size_bytes=1024)
    bad = TensorPartContainer([torch.zeros(11)], [11], part_size_bytes=1024)
    with pytest.raises(ProtocolViolation, match=r"peer X: part 0 of span 0 must be 10 float32"):
        container.decode_part(0, 0, bad.serialize_part(0, 0), "peer X")
    with pytest.raises(ProtocolViolation, match="peer X"):
        container.decode_part(0, 0, {"h": "junk", "b": b""}, "peer X")


def test_averaging_alpha_moves_part_of_the_way():
    tensor = torch.zeros(4)
    container = TensorPartContainer([tensor], [4])
    container.apply_part(0, 0, torch.ones(4), alpha=0.25)
    assert torch.allclose(tensor, torch.full((4,), 0.25))


@pytest.mark.parametrize(
    "tensors, spans, match",
    [
        ([torch.zeros(3, dtype=torch.int64)], [3], "tensor 0 has dtype torch.int64"),
        ([torch.zeros(4, 4).t()], [16], "tensor 0 .* is not contiguous"),
        ([torch.zeros(3)], [2], "span sizes sum to 2 but the tensors hold 3"),
        ([torch.zeros(3)], [-1, 4], "non-negative"),
        (torch.zeros(3), [3], "single tensor"),
        ([torch.zeros(3), "x"], [3], "tensor 1 is a str"),
    ],
)
def test_bad_containers_are_refused_naming_the_problem(tensors, spans, match):
    with pytest.raises(ValidationError, match=match):
        TensorPartContainer(tensors, spans)


def test_tensor_schema_names_dtype_and_shape():
    assert tensor_schema([torch.zeros(2, 3), torch.zeros(4, dtype=torch.float16)]) == [
        ["float32", [2, 3]],
        ["float16", [4]],
    ]


# ---------------------------------------------------------------------------- reducer


def run(coro):
    return asyncio.run(coro)


def test_reducer_computes_the_weighted_average_per_part():
    async def main():
        reducer = TensorPartReducer([(3, torch.float32), (2, torch.float32)], num_senders=3)
        weights = [1.0, 2.0, 5.0]
        for sender, weight in enumerate(weights):
            reducer.accumulate_part(sender, 0, torch.full((3,), float(sender)), weight)
            reducer.accumulate_part(sender, 1, torch.full((2,), float(sender) * 10), weight)
        assert reducer.finished
        expected = sum(w * s for s, w in enumerate(weights)) / sum(weights)
        assert torch.allclose(await reducer.wait_part(0), torch.full((3,), expected))
        assert torch.allclose(await reducer.wait_part(1), torch.full((2,), expected * 10))

    run(main())


def test_reducer_accumulates_into_a_given_buffer_without_touching_the_inputs():
    async def main():
        specs = [(5, torch.float32), (3, torch.float16)]
        buffer = torch.empty(TensorPartReducer.accumulator_nbytes(specs), dtype=torch.uint8)
        reducer = TensorPartReducer(specs, num_senders=2, buffer=buffer)
        inputs = [torch.ones(5), torch.ones(3, dtype=torch.float16)]
        reducer.accumulate_part(0, 0, inputs[0], 1.0)
        reducer.accumulate_part(1, 0, torch.full((5,), 3.0), 1.0)
        reducer.accumulate_part(0, 1, inputs[1], 3.0)
        reducer.accumulate_part(1, 1, torch.zeros(3, dtype=torch.float16), 1.0)
        first = await reducer.wait_part(0)
        assert torch.equal(first, torch.full((5,), 2.0))
        assert first.data_ptr() == buffer.data_ptr()  # the result lives in the buffer
        half = await reducer.wait_part(1)
        assert half.dtype == torch.float16 and torch.allclose(half.float(), torch.full((3,), 0.75))
        assert torch.equal(inputs[0], torch.ones(5))

    run(main())


@pytest.mark.parametrize("with_buffer", [True, False])
@pytest.mark.parametrize("own_weight", [1.0, 2.5])
def test_a_borrowed_input_is_added_with_the_next_one_and_never_written(with_buffer, own_weight):
    async def main():
        specs = [(4, torch.float32), (4, torch.float32), (3, torch.float16)]
        buffer = None
        if with_buffer:
            buffer = torch.empty(TensorPartReducer.accumulator_nbytes(specs), dtype=torch.uint8)
        reducer = TensorPartReducer(specs, num_senders=3, buffer=buffer)
        own = [torch.arange(4.0), torch.arange(4.0) + 10, torch.ones(3, dtype=torch.float16)]
        kept = [t.clone() for t in own]
        for k, part in enumerate(own):
            reducer.accumulate_part(0, k, part, own_weight, borrow=True)
        # part 0: two others deliver; part 1: sender 2 with weight 0 (the plain mean's side);
        # part 2 (float16, summed in float32): one other
        reducer.accumulate_part(1, 0, torch.full((4,), 3.0), 1.0)
        reducer.accumulate_part(2, 0, torch.full((4,), -1.0), 0.5)
        reducer.accumulate_part(2, 1, torch.full((4,), 7.0), 0.0)
        reducer.accumulate_part(1, 2, torch.full((3,), 5.0, dtype=torch.float16), 1.0)
        reducer.on_sender_failed(1)  # part 1: nobody else with a weight, the lent input alone
        reducer.accumulate_part(2, 2, torch.full((3,), 2.0, dtype=torch.float16), 1.0)
        total = own_weight + 1.5
        expected0 = (own_weight * kept[0] + 3.0 - 0.5) / total
        assert torch.allclose(await reducer.wait_part(0), expected0)
        assert torch.allclose(await reducer.wait_part(1), kept[1])
        expected2 = (own_weight * 1.0 + 5.0 + 2.0) / (own_weight + 2.0)
        half = await reducer.wait_part(2)
        assert half.dtype == torch.float16
        assert torch.allclose(half.float(), torch.full((3,), expected2), rtol=1e-3)
        for part, before in zip(own, kept, strict=True):
            assert torch.equal(part, before)  # read, never written
        if with_buffer:
            assert (await reducer.wait_part(0)).data_ptr() == buffer.data_ptr()

    run(main())


@pytest.mark.parametrize("own_weight", [1.0, 2.5])
def test_a_borrowed_input_is_summed_into_a_reusable_next_input_without_a_new_buffer(own_weight):
    async def main():
        reducer = TensorPartReducer([(4, torch.float32)], num_senders=3)
        own = torch.arange(4.0)
        kept = own.clone()
        reducer.accumulate_part(0, 0, own, own_weight, borrow=True)
        received = torch.full((4,), 3.0)
        reducer.accumulate_part(1, 0, received, 0.5, reuse=True)
        reducer.accumulate_part(2, 0, torch.full((4,), -1.0), 1.0)
        result = await reducer.wait_part(0)
        expected = (own_weight * kept + 0.5 * 3.0 - 1.0) / (own_weight + 1.5)
        assert torch.allclose(result, expected)
        assert result.data_ptr() == received.data_ptr()  # the received buffer held the sum
        assert torch.equal(own, kept)  # the borrowed input was only read

    run(main())


def test_a_part_is_either_reused_or_borrowed_not_both():
    async def main():
        reducer = TensorPartReducer([(2, torch.float32)], num_senders=1)
        with pytest.raises(ValidationError, match=r"reused \(ours to overwrite\) or borrowed"):
            reducer.accumulate_part(0, 0, torch.zeros(2), 1.0, reuse=True, borrow=True)

    run(main())


def test_a_sender_excluded_midway_keeps_its_delivered_parts_and_is_not_waited_for():
    async def main():
        reducer = TensorPartReducer([(2, torch.float32)] * 3, num_senders=3)
        for sender in range(3):
            reducer.accumulate_part(sender, 0, torch.full((2,), float(sender)), 1.0)
        reducer.accumulate_part(0, 1, torch.full((2,), 0.0), 1.0)
        reducer.accumulate_part(2, 1, torch.full((2,), 2.0), 1.0)
        assert not reducer.part_future(1).done()
        reducer.on_sender_failed(1)
        assert torch.equal(await reducer.wait_part(0), torch.full((2,), 1.0))  # all three
        assert torch.equal(await reducer.wait_part(1), torch.full((2,), 1.0))  # 0 and 2
        reducer.accumulate_part(0, 2, torch.full((2,), 4.0), 1.0)
        reducer.accumulate_part(2, 2, torch.full((2,), 6.0), 1.0)
        assert torch.equal(await reducer.wait_part(2), torch.full((2,), 5.0))
        with pytest.raises(ProtocolViolation, match="excluded"):
            reducer.accumulate_part(1, 2, torch.zeros(2), 1.0)

    run(main())


def test_zero_weights_fall_back_to_the_plain_mean_and_no_data_gives_none():
    async def main():
        reducer = TensorPartReducer([(2, torch.float32), (2, torch.float32)], num_senders=2)
        reducer.accumulate_part(0, 0, torch.full((2,), 1.0), 0.0)
        reducer.accumulate_part(1, 0, torch.full((2,), 3.0), 0.0)
        assert torch.equal(await reducer.wait_part(0), torch.full((2,), 2.0))
        reducer.on_sender_failed(0)
        reducer.on_sender_failed(1)
        assert await reducer.wait_part(1) is None
        await reducer.wait_all()

    run(main())


@pytest.mark.parametrize(
    "sender, part, tensor, match",
    [
        (0, 5, torch.zeros(2), "only 1 parts"),
        (0, 0, torch.zeros(3), "must be 2 float32 values, got 3"),
        (0, 0, torch.zeros(2, dtype=torch.float64), "got 2 float64"),
        (7, 0, torch.zeros(2), "sender index 7"),
    ],
)
def test_reducer_refuses_parts_that_are_not_in_the_plan(sender, part, tensor, match):
    async def main():
        reducer = TensorPartReducer([(2, torch.float32)], num_senders=2)
        with pytest.raises((ProtocolViolation, ValidationError), match=match):
            reducer.accumulate_part(sender, part, tensor, 1.0)

    run(main())


def test_reducer_refuses_a_part_sent_twice():
    async def main():
        reducer = TensorPartReducer([(2, torch.float32)], num_senders=2)
        reducer.accumulate_part(0, 0, torch.zeros(2), 1.0)
        with pytest.raises(ProtocolViolation, match="sent part 0 twice"):
            reducer.accumulate_part(0, 0, torch.zeros(2), 1.0)

    run(main())


def test_a_reducer_without_senders_is_finished_at_once():
    async def main():
        reducer = TensorPartReducer([(2, torch.float32)], num_senders=0)
        assert reducer.finished and await reducer.wait_part(0) is None

    run(main())


def test_tensor_infos_tell_the_codec_which_tensor_a_part_belongs_to():
    """hivemind's tensor_infos: their keys (and roles) reach the codec, so a per-tensor
    codec keyed by name compresses each tensor its own way."""
    from swarmgrad.compression import (
        CompressionInfo,
        Float16Compression,
        NoCompression,
        PerTensorCompression,
        TensorRole,
    )

    weights, bias = torch.randn(8), torch.randn(4)
    codec = PerTensorCompression({"weights": Float16Compression(), "bias": NoCompression()})
    infos = [
        CompressionInfo.from_tensor(weights, key="weights", role=TensorRole.PARAMETER),
        CompressionInfo.from_tensor(bias, key="bias"),
    ]
    container = TensorPartContainer(
        [weights, bias], [12], part_size_bytes=32, compression=codec, tensor_infos=infos
    )
    codecs = [container.serialize(0, k).codec for k in range(container.num_parts(0))]
    assert codecs == ["float16", "none"]  # part 0 holds the weights, part 1 the bias
    without = TensorPartContainer([weights, bias], [12], part_size_bytes=32, compression=codec)
    with pytest.raises(ValidationError, match="no codec configured for tensor 0"):
        without.serialize(0, 0)


@pytest.mark.parametrize(
    "infos, match",
    [
        ("weights", "a sequence of CompressionInfo"),
        ([1, 2], r"tensor_infos\[0\] is a int"),
        ([None], r"tensor_infos\[0\] is a NoneType"),
    ],
)
def test_bad_tensor_infos_are_refused_by_name(infos, match):
    with pytest.raises(ValidationError, match=match):
        TensorPartContainer([torch.zeros(2), torch.zeros(2)], [4], tensor_infos=infos)


def test_tensor_infos_must_describe_every_tensor():
    from swarmgrad.compression import CompressionInfo

    one = [CompressionInfo.from_tensor(torch.zeros(2), key=0)]
    with pytest.raises(ValidationError, match="1 entries for 2 averaged tensors"):
        TensorPartContainer([torch.zeros(2), torch.zeros(2)], [4], tensor_infos=one)
