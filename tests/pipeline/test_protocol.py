"""Stage protocol messages: round trips, codecs, malformed messages refused naming why."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.pipeline import protocol
from swarmgrad.pipeline.protocol import (
    BackwardAnswer,
    BackwardRequest,
    ForwardAnswer,
    ForwardRequest,
    InfoRequest,
    StageInfo,
    StageRecord,
    check_outputs,
    stage_key,
)
from swarmgrad.utils.errors import ProtocolViolation, ValidationError


def test_rpc_names_and_keys():
    assert (protocol.INFO, protocol.FORWARD, protocol.BACKWARD) == (
        "pipeline.info",
        "pipeline.forward",
        "pipeline.backward",
    )
    assert stage_key("gpt", 3) == "gpt.stage.3"
    with pytest.raises(ValidationError, match="pipeline name"):
        stage_key("has space", 0)


def test_forward_and_backward_requests_round_trip():
    x, ids = torch.randn(3, 5), torch.arange(3)
    request = ForwardRequest("gpt", 2, (x, ids))
    decoded = ForwardRequest.decode(request.encode())
    assert (decoded.pipeline, decoded.stage, decoded.compression) == ("gpt", 2, "none")
    assert torch.equal(decoded.inputs[0], x) and torch.equal(decoded.inputs[1], ids)
    grads = (torch.randn(3, 7),)
    back = BackwardRequest.decode(BackwardRequest("gpt", 1, (x,), grads).encode())
    assert torch.equal(back.inputs[0], x) and torch.equal(back.grad_outputs[0], grads[0])
    assert torch.equal(ForwardAnswer.decode(ForwardAnswer((x,)).encode("none")).outputs[0], x)
    out = BackwardAnswer.decode(BackwardAnswer((x,)).encode("none")).grad_inputs[0]
    assert torch.equal(out, x)


def test_eight_bit_codec_shrinks_activations_but_leaves_integer_tensors_exact():
    x, ids = torch.randn(64, 256), torch.randint(0, 1000, (64, 256))
    plain = msgpack.packb(ForwardRequest("p", 0, (x,)).encode(), default=_blob)
    packed = msgpack.packb(ForwardRequest("p", 0, (x,), "uniform_8bit").encode(), default=_blob)
    assert len(packed) * 3.5 < len(plain)
    decoded = ForwardRequest.decode(ForwardRequest("p", 0, (x, ids), "uniform_8bit").encode())
    assert torch.equal(decoded.inputs[1], ids)  # token ids are never quantized
    assert not torch.equal(decoded.inputs[0], x)
    assert (decoded.inputs[0] - x).abs().mean() < 0.02
    again = ForwardRequest.decode(ForwardRequest("p", 0, (x,), "uniform_8bit").encode())
    assert torch.equal(again.inputs[0], decoded.inputs[0])  # deterministic: backward matches


def _blob(obj):
    return bytes(obj.buffer)  # an out-of-band Blob: count its bytes


def test_stage_info_round_trips_and_a_malformed_one_is_a_protocol_violation():
    info = StageInfo(1, 4, (BatchTensorDescriptor(8),), (BatchTensorDescriptor(16),), 64)
    assert StageInfo.decode(info.encode()) == info
    broken = info.encode()
    broken["max_batch_size"] = -1
    with pytest.raises(ProtocolViolation, match="max_batch_size"):
        StageInfo.decode(broken)
    with pytest.raises(ProtocolViolation, match="args_schema"):
        StageInfo.decode({k: v for k, v in info.encode().items() if k != "args_schema"})


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=40), max_size=4),
    st.floats(0, 1e9, allow_nan=False),
    st.integers(0, 1 << 30),
)
def test_stage_records_round_trip(maddrs, throughput, queue):
    record = StageRecord(tuple(maddrs), throughput, queue)
    message = record.encode()
    message["future_field"] = "ignored"
    assert StageRecord.decode(message) == record


@pytest.mark.parametrize(
    "message, named",
    [
        ({"throughput": 1.0, "queue": 0}, "maddrs"),
        ({"maddrs": [], "throughput": -1.0, "queue": 0}, "throughput"),
        ({"maddrs": [], "throughput": float("inf"), "queue": 0}, "throughput"),
        ({"maddrs": [], "throughput": 1.0, "queue": -3}, "queue"),
        ({"maddrs": [1], "throughput": 1.0, "queue": 0}, "maddrs"),
        ("not a dict", "maddrs"),
    ],
)
def test_malformed_stage_records_are_refused_naming_the_field(message, named):
    with pytest.raises(ValidationError, match=named):
        StageRecord.decode(message)


@pytest.mark.parametrize(
    "mutate, named",
    [
        (lambda m: m.pop("stage"), "stage"),
        (lambda m: m.update(stage=-1), "stage"),
        (lambda m: m.update(stage=True), "stage"),
        (lambda m: m.update(pipeline=3), "pipeline"),
        (lambda m: m.update(compression="zip"), "zip"),
        (lambda m: m.update(inputs=[{"h": 1}]), "inputs"),
    ],
)
def test_malformed_requests_are_refused_naming_the_field(mutate, named):
    message = ForwardRequest("p", 0, (torch.ones(2, 2),)).encode()
    mutate(message)
    with pytest.raises(ValidationError, match=named):
        ForwardRequest.decode(message)
    with pytest.raises(ValidationError, match="stage"):
        InfoRequest.decode({"pipeline": "p"})


def test_answers_without_their_tensors_are_protocol_violations():
    with pytest.raises(ProtocolViolation, match="outputs"):
        ForwardAnswer.decode({"v": 1})
    with pytest.raises(ProtocolViolation, match="grad_inputs"):
        BackwardAnswer.decode({"grad_inputs": [{"h": "x", "b": b""}]})


def test_check_outputs_names_the_tensor_and_what_was_expected():
    schema = (BatchTensorDescriptor(4),)
    check_outputs([torch.zeros(3, 4)], schema, 3, "outputs of stage 1")
    with pytest.raises(ProtocolViolation, match=r"outputs of stage 1\[0\].*shape \['batch', 4\]"):
        check_outputs([torch.zeros(3, 5)], schema, 3, "outputs of stage 1")
    with pytest.raises(ProtocolViolation, match="dtype float32, got float16"):
        check_outputs([torch.zeros(3, 4, dtype=torch.float16)], schema, 3, "outputs")
    with pytest.raises(ProtocolViolation, match="batch size 2 differs from 3"):
        check_outputs([torch.zeros(2, 4)], schema, 3, "outputs")
