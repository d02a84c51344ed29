"""The averager's options, written once and validated once.

:class:`AveragerOptions` is built by the public constructor
(:class:`~swarmgrad.averaging.averager.DecentralizedAverager`, which keeps hivemind's
signature) or from keyword arguments (:meth:`AveragerOptions.from_kwargs`, for
:class:`~swarmgrad.averaging.averager_core.AsyncDecentralizedAverager` used on its own),
and passed down as one frozen object: the engine, the matchmaking and the state transfer
read their settings from it instead of repeating a signature each. Every check lives in
``__post_init__``, through the shared checkers of :mod:`swarmgrad.utils.checks`, and
names the option that is wrong. The group sizes are checked by
:class:`~swarmgrad.averaging.matchmaking.rules.MatchmakingRules`, which matchmaking used
on its own needs as well.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.allreduce.partition import DEFAULT_PART_SIZE_BYTES, check_tensor_infos
from swarmgrad.averaging.allreduce.round_plan import check_aggregate_tag
from swarmgrad.averaging.allreduce.types import AveragingMode
from swarmgrad.averaging.robust.rules import AggregationRule
from swarmgrad.averaging.state.chunks import resolve_state_compression
from swarmgrad.compression import CompressionBase, CompressionInfo, CompressionType, get_codec
from swarmgrad.utils.checks import (
    check_peer_role,
    fraction,
    non_negative_int,
    optional_positive_seconds,
    positive_int,
    positive_number,
    positive_seconds,
)
from swarmgrad.utils.errors import ValidationError

__all__ = ["DEFAULT_MAX_GROUP_SIZE", "AveragerOptions"]

DEFAULT_MAX_GROUP_SIZE = 256  # target_group_size=None: as many as matchmaking gathers


@dataclass(frozen=True)
class AveragerOptions:
    """What an averager is asked to do; see
    :class:`~swarmgrad.averaging.averager.DecentralizedAverager` for each option's meaning.
    Values are the checked, canonical ones (floats for seconds, a resolved
    ``allow_state_sharing`` and ``state_compression``)."""

    prefix: str
    # matchmaking
    target_group_size: int | None = None
    min_group_size: int = 2
    initial_group_bits: str = ""
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    max_gather_bytes: int = 1 << 20
    rotate_group_bits: bool = True
    # all-reduce
    averaging_alpha: float = 1.0
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
    allreduce_timeout: float | None = None
    next_chunk_timeout: float | None = None
    sender_timeout: float | None = None
    reducer_timeout: float | None = None
    compression: CompressionBase | CompressionType | str = CompressionType.NONE
    bandwidth: float | None = None
    min_vector_size: int = 0
    timeouts: AdaptiveTimeouts | None = None
    # hivemind's tensor_infos: one CompressionInfo per averaged tensor (key, role) for the
    # codec; checked against the tensors by the engine, which knows them
    tensor_infos: tuple[CompressionInfo, ...] | None = None
    # roles
    auxiliary: bool = False
    client_mode: bool = False
    # state sharing and download
    allow_state_sharing: bool | None = None  # None: unless client or auxiliary
    declare_state_period: float = 30.0
    state_compression: CompressionBase | CompressionType | str | None = None
    state_sharing_options: Mapping[str, Any] | None = None
    state_download_options: Mapping[str, Any] | None = None
    # custom and robust aggregation, accountability
    aggregate: Callable[..., Awaitable[None]] | None = None
    aggregate_tag: str | None = None
    aggregation: AggregationRule | None = None
    ban_after: int | None = None
    ban_window: int | None = None
    ban_duration: float = 600.0
    rng: random.Random | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # frozen: store the canonical value
            object.__setattr__(self, name, value)

        if not isinstance(self.prefix, str):
            raise ValidationError(f"prefix must be a str, got {self.prefix!r}")
        check_peer_role(client_mode=self.client_mode, auxiliary=self.auxiliary)
        put("client_mode", bool(self.client_mode))
        put("auxiliary", bool(self.auxiliary))
        for name in ("min_matchmaking_time", "request_timeout", "declare_state_period"):
            put(name, positive_seconds(name, getattr(self, name)))
        for name in (
            "allreduce_timeout",
            "next_chunk_timeout",
            "sender_timeout",
            "reducer_timeout",
        ):
            put(name, optional_positive_seconds(name, getattr(self, name)))
        put("averaging_alpha", fraction("averaging_alpha", self.averaging_alpha, low_open=True))
        positive_int("part_size_bytes", self.part_size_bytes)
        positive_int("max_gather_bytes", self.max_gather_bytes)
        non_negative_int("min_vector_size", self.min_vector_size)
        if self.bandwidth is not None:
            put("bandwidth", positive_number("bandwidth", self.bandwidth))
        get_codec(self.compression)  # an unknown codec fails here, not in every round
        put("state_compression", resolve_state_compression(self.state_compression))
        if self.allow_state_sharing is None:
            put("allow_state_sharing", not self.client_mode and not self.auxiliary)
        elif self.allow_state_sharing and self.client_mode:
            raise ValidationError("a client-mode peer cannot share its state (nobody can call it)")
        self._check_aggregation()
        if self.tensor_infos is not None:
            put("tensor_infos", check_tensor_infos(self.tensor_infos, len(self.tensor_infos)))
        if self.timeouts is not None and not isinstance(self.timeouts, AdaptiveTimeouts):
            raise ValidationError(f"timeouts must be an AdaptiveTimeouts, got {self.timeouts!r}")

    def _check_aggregation(self) -> None:
        aggregate, tag = self.aggregate, self.aggregate_tag
        if aggregate is not None and not callable(aggregate):
            raise ValidationError(f"aggregate must be a coroutine function, got {aggregate!r}")
        if (aggregate is None) != (tag is None):
            # a hook without a tag would average with peers that run another one (or none)
            raise ValidationError(
                "aggregate and aggregate_tag go together: the tag tells peers how this one "
                f"combines its tensors (got aggregate={aggregate!r}, aggregate_tag={tag!r})"
            )
        if tag is not None and not check_aggregate_tag(tag):
            raise ValidationError("aggregate_tag must not be empty")
        if self.aggregation is not None and not isinstance(self.aggregation, AggregationRule):
            raise ValidationError(
                f"aggregation must be an AggregationRule (CenteredClip(...), TrimmedMean(...)), "
                f"got {self.aggregation!r}"
            )
        if self.ban_after is not None:
            try:
                positive_int("ban_after", self.ban_after)
            except ValidationError:
                raise ValidationError(
                    f"ban_after must be a positive int or None, got {self.ban_after!r}"
                ) from None
        window = self.ban_window
        if window is not None and (
            isinstance(window, bool)
            or not isinstance(window, int)
            or window < (self.ban_after or 1)
        ):
            raise ValidationError(
                f"ban_window must be an int >= ban_after ({self.ban_after}) or None, got {window!r}"
            )
        object.__setattr__(
            self, "ban_duration", positive_seconds("ban_duration", self.ban_duration)
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> AveragerOptions:
        """The options from keyword arguments; unknown names are refused, named."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValidationError(f"unknown averager options {unknown}")
        return cls(**kwargs)

    # ------------------------------------------------------------------ derived values

    @property
    def mode(self) -> AveragingMode:
        if self.client_mode:
            return AveragingMode.CLIENT
        return AveragingMode.AUX if self.auxiliary else AveragingMode.NODE

    @property
    def max_group_size(self) -> int:
        """The largest group matchmaking forms (``target_group_size``, or 256 for None)."""
        if self.target_group_size is None:
            return DEFAULT_MAX_GROUP_SIZE
        return self.target_group_size

    @property
    def combined_tag(self) -> str:
        """What members compare before averaging: the custom hook's tag and the robust
        rule's, joined ("" with neither)."""
        rule = self.aggregation.tag if self.aggregation is not None else None
        return "+".join(t for t in (self.aggregate_tag, rule) if t)

    @property
    def effective_sender_timeout(self) -> float | None:
        """``sender_timeout``, or ``next_chunk_timeout`` where it is not given."""
        return self.sender_timeout if self.sender_timeout is not None else self.next_chunk_timeout

    def as_dict(self) -> dict[str, Any]:
        """The options by name (shallow: codecs, rules and hooks are the same objects)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
