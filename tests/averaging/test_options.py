"""options.py: the averager's options are checked once, by name, and passed down whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmgrad.averaging.allreduce.types import AveragingMode
from swarmgrad.averaging.options import DEFAULT_MAX_GROUP_SIZE, AveragerOptions
from swarmgrad.averaging.robust.rules import CenteredClip
from swarmgrad.compression import CompressionInfo, Float16Compression
from swarmgrad.utils.errors import ValidationError


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_matchmaking_time": 0}, "min_matchmaking_time must be a positive number of seconds"),
        ({"request_timeout": "3"}, "request_timeout must be a positive number of seconds"),
        ({"declare_state_period": float("inf")}, "declare_state_period must be a positive"),
        ({"allreduce_timeout": -1}, "allreduce_timeout must be a positive number of seconds or"),
        ({"sender_timeout": True}, "sender_timeout must be a positive number of seconds or"),
        ({"averaging_alpha": 0}, r"averaging_alpha must be a number in \(0, 1\]"),
        ({"averaging_alpha": 1.5}, r"averaging_alpha must be a number in \(0, 1\]"),
        ({"part_size_bytes": 0}, "part_size_bytes must be a positive int"),
        ({"max_gather_bytes": 1.0}, "max_gather_bytes must be a positive int"),
        ({"min_vector_size": -1}, "min_vector_size must be an int >= 0"),
        ({"bandwidth": float("nan")}, "bandwidth must be a finite number > 0"),
        ({"compression": "float17"}, "unknown compression 'float17'"),
        ({"client_mode": True, "auxiliary": True}, "auxiliary=True needs client_mode=False"),
        ({"client_mode": True, "allow_state_sharing": True}, "client-mode peer cannot share"),
        ({"aggregate": lambda r: None}, "aggregate and aggregate_tag go together"),
        ({"aggregate": 3, "aggregate_tag": "x"}, "aggregate must be a coroutine function"),
        ({"aggregation": "centered_clip"}, "aggregation must be an AggregationRule"),
        ({"ban_after": 0}, "ban_after must be a positive int or None"),
        ({"ban_after": 3, "ban_window": 2}, "ban_window must be an int >= ban_after"),
        ({"ban_duration": 0}, "ban_duration must be a positive number of seconds"),
        ({"timeouts": 5}, "timeouts must be an AdaptiveTimeouts"),
        ({"tensor_infos": [1]}, r"tensor_infos\[0\] is a int"),
        ({"prefix": 5}, "prefix must be a str"),
    ],
)
def test_each_bad_option_is_refused_naming_it(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        AveragerOptions(**{"prefix": "run", **kwargs})


def test_values_are_stored_in_their_canonical_form_and_derived_ones_follow():
    options = AveragerOptions(
        prefix="run", min_matchmaking_time=2, averaging_alpha=1, sender_timeout=None,
        next_chunk_timeout=4, auxiliary=True, aggregation=CenteredClip(tau=1.0),
        state_compression="none",
    )  # fmt: skip
    assert options.min_matchmaking_time == 2.0 and isinstance(options.min_matchmaking_time, float)
    assert options.allow_state_sharing is False  # an auxiliary peer shares nothing by default
    assert options.state_compression is None  # exact transfer
    assert options.mode is AveragingMode.AUX
    assert options.max_group_size == DEFAULT_MAX_GROUP_SIZE
    assert options.effective_sender_timeout == 4.0
    assert options.combined_tag == CenteredClip(tau=1.0).tag
    assert AveragerOptions(prefix="run", client_mode=True).mode is AveragingMode.CLIENT
    assert AveragerOptions(prefix="run").allow_state_sharing is True


def test_options_are_frozen_and_a_changed_copy_is_checked_again():
    options = AveragerOptions(prefix="run")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.prefix = "other"
    assert dataclasses.replace(options, initial_group_bits="01").initial_group_bits == "01"
    with pytest.raises(ValidationError, match="request_timeout"):
        dataclasses.replace(options, request_timeout=0)


def test_keyword_options_name_the_unknown_ones():
    assert AveragerOptions.from_kwargs(prefix="run", bandwidth=5).bandwidth == 5.0
    with pytest.raises(ValidationError, match=r"unknown averager options \['target_size'\]"):
        AveragerOptions.from_kwargs(prefix="run", target_size=4)


def test_the_facade_builds_the_options_once_and_passes_them_down():
    from swarmgrad.averaging.averager import DecentralizedAverager
    from swarmgrad.dht import DHT

    tensors = [torch.zeros(4), torch.zeros(2)]
    infos = [
        CompressionInfo.from_tensor(t, key=name) for t, name in zip(tensors, "ab", strict=True)
    ]
    dht = DHT(start=True)
    try:
        with pytest.raises(ValidationError, match="1 entries for 2 averaged tensors"):
            DecentralizedAverager(tensors, dht, start=False, prefix="p", tensor_infos=infos[:1])
        averager = DecentralizedAverager(
            tensors, dht, start=False, prefix="p", tensor_infos=infos,
            compression=Float16Compression(), initial_group_bits="01", min_matchmaking_time=2,
        )  # fmt: skip
        assert averager.options.tensor_infos == tuple(infos)
        assert averager._options["min_matchmaking_time"] == 2.0  # the optimizers' view
        assert averager.get_group_bits() == "01"
        assert averager.get_group_bits(wait=False).result() == "01"
        averager.set_group_bits("10")
        assert averager.options.initial_group_bits == "10"
        averager.run_in_background()
        try:
            core = averager._core
            assert core.options is averager.options  # passed down, not rebuilt
            assert core.tensor_infos == tuple(infos)
            assert core.matchmaking.min_matchmaking_time == 2.0
            assert averager.get_group_bits(wait=False).result() == "10"
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()
