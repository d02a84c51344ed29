"""What each member announces during matchmaking, and the all-reduce plan derived from it.

Matchmaking passes opaque bytes around (``GroupInfo.gathered``); the averager fills them
with a :class:`MemberInfo` (msgpack map, version ``v``; unknown fields are ignored)::

    {"v": 1, "mode": 0 | 1 | 2, "bw": float | None, "w": float,
     "sd": bytes (SHA-256 of the tensor schema and the aggregate tag), "nt": int,
     "ne": int, "schema": [[dtype, shape], ...] | None, "agg": str (optional),
     "maddrs": [str], "gather": any}

``agg`` names a custom aggregation (the averager's ``aggregate_tag``, e.g. PowerSGD of
some rank): members that combine their tensors differently cannot average together even
when the tensors match, so the tag is part of the digest and they are kept apart exactly
like members with other tensors. A peer that does not know the field still compares the
digest.

Every member of a group receives the same GroupInfo, so every member derives the same
:class:`RoundPlan` from it, without another message: who takes part (members whose
tensors match ours; a member whose gathered data is malformed or whose tensor schema
differs is left out by all of those who agree with each other), which mode each has, and
how many elements each one reduces (:func:`~.load_balancing.load_balance_peers` on the
announced bandwidths; client-mode members reduce nothing, auxiliary members send
nothing). Members with different tensors thus split into sub-groups that never talk to
each other, instead of failing the round for everyone.

A member that finds itself alone with its schema while at least two others agree on a
different one is the odd one out: :func:`plan_round` raises
:class:`~.types.GroupMismatch` naming the first differing tensor, since retrying
cannot help. When no schema has a majority (two members, two schemas) nobody can tell
who is wrong: the round fails with a warning and the step may retry with other peers.

Why the full schema travels only when small: the digest decides, the schema is there to
name the difference in the error. A model with tens of thousands of tensors would
otherwise make every join request large.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers
from swarmgrad.averaging.allreduce.types import AveragingMode, GroupMismatch
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

__all__ = [
    "MemberInfo",
    "RoundPlan",
    "decode_member_info",
    "encode_member_info",
    "plan_round",
    "schema_digest",
]

INFO_VERSION = 1
MAX_SCHEMA_BYTES = 16 * 1024  # a full schema larger than this travels as its digest only
MAX_MADDRS = 8
MAX_TAG_CHARS = 200
_SUBGROUP_TAG = b"swarmgrad.averaging.subgroup:"


def schema_digest(schema: Sequence[Sequence[Any]], aggregate_tag: str = "") -> bytes:
    return _digest(msgpack.packb(schema, use_bin_type=True), aggregate_tag)


def _digest(packed_schema: bytes, aggregate_tag: str) -> bytes:
    digest = hashlib.sha256(packed_schema)
    if aggregate_tag:  # plain averaging keeps the digest it always had
        digest.update(b"\0aggregate:" + aggregate_tag.encode())
    return digest.digest()


@dataclass(frozen=True)
class MemberInfo:
    """One member's announcement (see the module docstring)."""

    peer_id: PeerID
    mode: AveragingMode
    bandwidth: float | None
    weight: float
    schema_digest: bytes
    num_tensors: int
    numel: int
    schema: list | None = None
    maddrs: tuple[Multiaddr, ...] = ()
    gather: Any = None
    aggregate_tag: str = ""  # "": plain averaging

    def describe_tensors(self) -> str:
        return f"{self.num_tensors} tensors of {self.numel} elements in all"

    def describe_aggregation(self) -> str:
        return repr(self.aggregate_tag) if self.aggregate_tag else "plain averaging"


def encode_member_info(
    *,
    mode: AveragingMode,
    bandwidth: float | None,
    weight: float,
    schema: Sequence[Sequence[Any]],
    numel: int,
    maddrs: Sequence[Any] = (),
    gather: Any = None,
    aggregate_tag: str = "",
) -> bytes:
    """This member's gathered bytes. ValidationError if ``gather`` is not msgpack-able."""
    schema = [list(entry) for entry in schema]
    packed_schema = msgpack.packb(schema, use_bin_type=True)
    check_aggregate_tag(aggregate_tag)
    body = {
        "v": INFO_VERSION,
        "mode": mode.value,
        "bw": None if bandwidth is None else float(bandwidth),
        "w": float(weight),
        "sd": _digest(packed_schema, aggregate_tag),
        "nt": len(schema),
        "ne": int(numel),
        "schema": schema if len(packed_schema) <= MAX_SCHEMA_BYTES else None,
        "maddrs": [str(m) for m in maddrs][:MAX_MADDRS],
        "gather": gather,
    }
    if aggregate_tag:
        body["agg"] = aggregate_tag
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValidationError(
            f"gather must be msgpack-serializable (numbers, str, bytes, lists, dicts): {e}"
        ) from None


def check_aggregate_tag(tag: Any) -> str:
    """A tag is short printable text; "" means plain averaging."""
    if not isinstance(tag, str) or len(tag) > MAX_TAG_CHARS or not tag.isprintable():
        raise ValidationError(
            f"aggregate_tag must be printable text of at most {MAX_TAG_CHARS} characters, "
            f"got {tag!r:.80}"
        )
    return tag


def _number(value: Any, what: str, who: PeerID) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolViolation(f"{who} announced {what} {value!r:.40}, not a finite number")
    if value < 0:
        raise ProtocolViolation(f"{who} announced a negative {what} {value!r}")
    return float(value)


def decode_member_info(peer_id: PeerID, data: bytes) -> MemberInfo:
    """Parse another member's gathered bytes; ProtocolViolation naming the member and the
    field if they are malformed."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolViolation(f"{peer_id} gathered malformed data: {e}") from None
    if not isinstance(body, dict) or body.get("v") != INFO_VERSION:
        raise ProtocolViolation(
            f"{peer_id} gathered data of an unknown version "
            f"{body.get('v') if isinstance(body, dict) else body!r:.40}"
        )
    try:
        mode = AveragingMode(body.get("mode"))
    except ValueError:
        raise ProtocolViolation(
            f"{peer_id} announced unknown mode {body.get('mode')!r:.20}"
        ) from None
    bandwidth = body.get("bw")
    if bandwidth is not None:
        bandwidth = _number(bandwidth, "bandwidth", peer_id)
    weight = _number(body.get("w"), "weight", peer_id)
    digest, num_tensors, numel = body.get("sd"), body.get("nt"), body.get("ne")
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise ProtocolViolation(f"{peer_id} announced no valid tensor schema digest")
    for name, value in (("tensor count", num_tensors), ("element count", numel)):
        if type(value) is not int or value < 0:
            raise ProtocolViolation(f"{peer_id} announced {name} {value!r:.40}")
    schema = body.get("schema")
    if schema is not None and not isinstance(schema, list):
        raise ProtocolViolation(f"{peer_id} announced a schema that is not a list")
    aggregate_tag = body.get("agg", "")
    try:
        check_aggregate_tag(aggregate_tag)
    except ValidationError:
        raise ProtocolViolation(
            f"{peer_id} announced an aggregate tag that is not short printable text"
        ) from None
    raw_maddrs = body.get("maddrs", [])
    if not isinstance(raw_maddrs, list):
        raise ProtocolViolation(f"{peer_id} announced addresses that are not a list")
    maddrs = []
    for text in raw_maddrs[:MAX_MADDRS]:
        try:
            address = Multiaddr.parse(text)
        except (ValidationError, ValueError, TypeError):
            continue  # an address we cannot use; the others may still work
        if address.peer_id in (None, peer_id):
            maddrs.append(address)
    return MemberInfo(
        peer_id=peer_id,
        mode=mode,
        bandwidth=bandwidth,
        weight=weight,
        schema_digest=digest,
        num_tensors=num_tensors,
        numel=numel,
        schema=schema,
        maddrs=tuple(maddrs),
        gather=body.get("gather"),
        aggregate_tag=aggregate_tag,
    )


@dataclass(frozen=True)
class RoundPlan:
    """Who averages with whom in this round, and how the vector is split among them."""

    group: GroupInfo  # the members taking part (the whole group, or our sub-group)
    members: tuple[MemberInfo, ...]  # in group order
    modes: tuple[AveragingMode, ...]
    span_sizes: tuple[int, ...]
    left_out: dict[PeerID, str] = field(default_factory=dict)  # members not taking part, why

    @property
    def gathered(self) -> dict[PeerID, Any]:
        return {info.peer_id: info.gather for info in self.members}

    def span_sizes_for(self, numel: int, min_vector_size: int = 0) -> tuple[int, ...]:
        """How ``numel`` elements split among the members by the rule of
        :attr:`span_sizes`: for another vector averaged in the same group (every member
        derives the same split, as for the first)."""
        return _span_sizes(self.members, numel, min_vector_size)


class RoundSkipped(ValidationError):
    """This group cannot average anything for us (e.g. nobody else shares our tensors, or
    nobody sends); the step may try another group."""


def plan_round(group: GroupInfo, me: PeerID, *, min_vector_size: int = 0) -> RoundPlan:
    """The plan every member with our tensors derives from ``group`` (module docstring).

    Raises GroupMismatch if we are the odd one out, RoundSkipped if there is nothing to
    average in this group."""
    infos: dict[PeerID, MemberInfo] = {}
    left_out: dict[PeerID, str] = {}
    for peer_id, data in zip(group.peer_ids, group.gathered, strict=True):
        try:
            infos[peer_id] = decode_member_info(peer_id, data)
        except ProtocolViolation as e:
            if peer_id == me:
                raise ValidationError(f"our own gathered data does not parse: {e}") from None
            left_out[peer_id] = str(e)
    mine = infos[me]
    others = [info for peer_id, info in infos.items() if peer_id != me]
    different = [info for info in others if info.schema_digest != mine.schema_digest]
    for info in different:
        left_out[info.peer_id] = f"its tensors differ from ours: {describe_mismatch(mine, info)}"
    taking_part = [p for p in group.peer_ids if p in infos and p not in left_out]
    if len(taking_part) == 1:
        digests = Counter(info.schema_digest for info in different)
        if digests:
            (common, count), *_ = digests.most_common(1)
            if count >= 2:
                example = next(info for info in different if info.schema_digest == common)
                holders = ", ".join(str(i.peer_id) for i in different if i.schema_digest == common)
                raise GroupMismatch(
                    f"this peer's tensors differ from those of the rest of its group "
                    f"({holders}): {describe_mismatch(mine, example)}"
                )
            raise RoundSkipped(
                "nobody in the group shares our tensors: "
                + "; ".join(f"{i.peer_id}: {describe_mismatch(mine, i)}" for i in different)
            )
        raise RoundSkipped(
            "nobody else in the group announced usable data: "
            + "; ".join(f"{p}: {why}" for p, why in left_out.items())
        )
    members = tuple(infos[p] for p in taking_part)
    modes = tuple(info.mode for info in members)
    if all(mode is AveragingMode.AUX for mode in modes):
        raise RoundSkipped("every member is auxiliary: nobody contributes tensors")
    if all(mode is AveragingMode.CLIENT for mode in modes):
        raise RoundSkipped("every member is in client mode: nobody can reduce")
    span_sizes = _span_sizes(members, mine.numel, min_vector_size)
    if len(taking_part) == len(group.peer_ids):
        part_group = group
    else:
        sub_id = hashlib.sha256(_SUBGROUP_TAG + group.group_id + mine.schema_digest).digest()[:20]
        part_group = GroupInfo(
            sub_id,
            tuple(taking_part),
            tuple(group.gathered[group.peer_ids.index(p)] for p in taking_part),
        )
    return RoundPlan(part_group, members, modes, tuple(span_sizes), left_out)


def _span_sizes(members: Sequence[MemberInfo], numel: int, min_vector_size: int) -> tuple[int, ...]:
    bandwidths = [0.0 if info.mode is AveragingMode.CLIENT else info.bandwidth for info in members]
    senders = [info.mode is not AveragingMode.AUX for info in members]
    return tuple(load_balance_peers(numel, bandwidths, min_vector_size, senders=senders))


def describe_mismatch(mine: MemberInfo, theirs: MemberInfo) -> str:
    """The first difference between two members' tensors (or the way they combine
    them), for an error message."""
    if mine.aggregate_tag != theirs.aggregate_tag:
        return (
            f"this peer averages with {mine.describe_aggregation()}, {theirs.peer_id} with "
            f"{theirs.describe_aggregation()}"
        )
    if isinstance(mine.schema, list) and isinstance(theirs.schema, list):
        if len(mine.schema) != len(theirs.schema):
            return f"{len(mine.schema)} tensors here, {len(theirs.schema)} at {theirs.peer_id}"
        for index, (ours, other) in enumerate(zip(mine.schema, theirs.schema, strict=True)):
            if ours != other:
                return (
                    f"tensor {index} is {_entry(ours)} here but {_entry(other)} at {theirs.peer_id}"
                )
    return (
        f"{mine.describe_tensors()} here, {theirs.describe_tensors()} at {theirs.peer_id} "
        f"(the dtypes or shapes differ)"
    )


def _entry(entry: Any) -> str:
    """``float32[3, 4]`` for a schema entry (untrusted when it comes from another peer)."""
    if isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[1], list | tuple):
        return f"{str(entry[0])[:20]}{list(entry[1])[:8]}"
    return repr(entry)[:60]
