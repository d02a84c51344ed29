"""Matchmaking's wire protocol: one streaming RPC, ``averaging.join_group``, and its messages.

A follower sends one :class:`JoinRequest` to a potential leader; the leader's answer is a
stream of at most two messages:

* :class:`Rejected` — not into this group (a :class:`Rejection` code, a text for the
  logs, and maybe the leader to try instead); the stream ends.
* :class:`Accepted` — in, until the leader's ``ready_by``; then one of
* :class:`Begin` — the group: its id, the member order and every member's gathered
  bytes (zlib-coded when that is smaller), or
* :class:`Disbanded` — no group after all (too few members, the leader began to follow
  someone else: then it names that leader, the one to try next).

Messages are msgpack maps keyed by ``"code"``; unknown fields are ignored, unknown codes
refused. ``decode_*`` check the shape of a message and raise
:class:`~swarmgrad.utils.errors.ProtocolViolation` naming the field that is wrong; what a
message means for the search (whom to follow, whom to accept) is decided in
:mod:`.rules`.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

__all__ = [
    "JOIN_GROUP",
    "MAX_GROUP_ID_BYTES",
    "MAX_HOLD",
    "PROTOCOL_VERSION",
    "Accepted",
    "Begin",
    "Disbanded",
    "JoinRequest",
    "Rejected",
    "Rejection",
    "decode_answer",
    "decode_join_request",
]

JOIN_GROUP = "averaging.join_group"  # the RPC: a join request in, a stream of answers out
PROTOCOL_VERSION = 1  # sent as "v" in a join request
MAX_GROUP_ID_BYTES = 64  # a longer group id in a begin message is refused
MAX_HOLD = 30.0  # seconds a leader keeps an early join request open, at most
MAX_TEXT = 1000  # characters of a rejection's or disbanding's text kept


class Rejection(enum.StrEnum):
    """Why a potential leader refused a join request (sent as the value)."""

    BAD_REQUEST = "bad_request"  # malformed request, or gathered data over the limit
    UNKNOWN_PREFIX = "unknown_prefix"  # no averager with this prefix on that peer
    NOT_LOOKING = "not_looking"  # the peer is not looking for a group (or its group began)
    NOT_A_LEADER = "not_a_leader"  # a client-mode peer, or one that follows another leader
    BAD_GROUP_KEY = "bad_group_key"  # the leader looks under another group key
    BAD_ORDER = "bad_order"  # followers must come after their leader in (ready_by, peer_id)
    GROUP_FULL = "group_full"  # target_group_size reached
    TOO_LATE = "too_late"  # the leader's ready_by has passed: its group is about to begin
    DUPLICATE_PEER_ID = "duplicate_peer_id"  # the requester is already in this group
    BANNED = "banned"  # this peer banned the requester from its groups for a while


def _fail(what: str, field: str, problem: str) -> ProtocolViolation:
    return ProtocolViolation(f"malformed {what}: {field} {problem}")


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _peer_id(raw: bytes, what: str, field: str) -> PeerID:
    try:
        return PeerID(raw)
    except ValidationError as e:
        raise _fail(what, field, f"holds a bad PeerID: {e}") from None


def _text(value: Any) -> str:
    """Free text for the logs: anything else becomes its repr, cut short."""
    return (value if isinstance(value, str) else repr(value))[:MAX_TEXT]


# ---------------------------------------------------------------------------- request


@dataclass(frozen=True)
class JoinRequest:
    """A follower asks a potential leader to take it into its group."""

    prefix: str  # which averager of the leader's peer (several share one handler)
    group_key: str  # the key the follower looks under; must be the leader's
    ready_by: float  # the follower's own declaration time (DHT time)
    client_mode: bool  # a client-mode follower may join any leader, whatever its ready_by
    gather: bytes  # the follower's data_for_gather, handed to every member
    # seconds the leader may keep this request open until its own search starts (a
    # follower that knows who will lead); None: answer now
    hold: float | None = None
    version: int = PROTOCOL_VERSION

    def encode(self) -> dict:
        message = {
            "v": self.version,
            "prefix": self.prefix,
            "group_key": self.group_key,
            "ready_by": self.ready_by,
            "client_mode": self.client_mode,
            "gather": self.gather,
        }
        if self.hold is not None:
            message["hold"] = float(self.hold)
        return message


def decode_join_request(message: Any) -> JoinRequest:
    """The request, or ProtocolViolation naming the bad field. A malformed ``hold`` is
    ignored (the request is answered at once), as peers always did; the version is not
    checked (version 1 is the only one)."""
    what = "join request"
    if not isinstance(message, dict):
        raise ProtocolViolation(f"malformed {what}: a join request must be a map")
    prefix, key = message.get("prefix"), message.get("group_key")
    ready_by, client = message.get("ready_by"), message.get("client_mode")
    gather, hold, version = message.get("gather"), message.get("hold"), message.get("v")
    if not isinstance(prefix, str):
        raise _fail(what, "prefix", "must be a string")
    if not isinstance(key, str):
        raise _fail(what, "group_key", "must be a string")
    if not _number(ready_by):
        raise _fail(what, "ready_by", "must be a number")
    if not isinstance(gather, bytes):
        raise _fail(what, "gather", "must be bytes")
    if not isinstance(client, bool):
        raise _fail(what, "client_mode", "must be a bool")
    if not _number(hold) or not hold > 0:
        hold = None
    return JoinRequest(
        prefix,
        key,
        float(ready_by),
        client,
        gather,
        None if hold is None else float(hold),
        version if isinstance(version, int) and not isinstance(version, bool) else 0,
    )


# ---------------------------------------------------------------------------- answers


def _pack_suggestion(leader: PeerID | None, maddrs: tuple[str, ...]) -> dict:
    """The leader worth trying next and its addresses, as :func:`_suggestion` reads them."""
    return {
        "suggested_leader": leader.to_bytes() if leader else None,
        "suggested_maddrs": list(maddrs),
    }


def _suggestion(message: dict, what: str) -> tuple[PeerID | None, tuple[str, ...]]:
    raw = message.get("suggested_leader")
    if raw is not None and not isinstance(raw, bytes):
        raise _fail(what, "suggested_leader", f"is {type(raw).__name__}, not PeerID bytes")
    maddrs = message.get("suggested_maddrs")
    # addresses are hints: malformed ones are dropped, not refused
    good = tuple(m for m in maddrs if isinstance(m, str)) if isinstance(maddrs, list) else ()
    return (_peer_id(raw, what, "suggested_leader") if raw is not None else None), good


@dataclass(frozen=True)
class Rejected:
    """The leader refused; ``suggested_leader`` (with its addresses) is worth trying next."""

    reason: Rejection | str  # a Rejection; an unknown code from a newer peer stays a string
    message: str
    suggested_leader: PeerID | None = None
    suggested_maddrs: tuple[str, ...] = ()

    def encode(self) -> dict:
        return {
            "code": "rejected",
            "reason": str(self.reason),
            "message": self.message,
            **_pack_suggestion(self.suggested_leader, self.suggested_maddrs),
        }


@dataclass(frozen=True)
class Accepted:
    """The leader took us; its group begins (or is disbanded) by its ``ready_by``."""

    ready_by: float  # the leader's declaration time (DHT time)

    def encode(self) -> dict:
        return {"code": "accepted", "ready_by": self.ready_by}


@dataclass(frozen=True)
class Begin:
    """The group begins: every member gets the same id, order and gathered bytes."""

    group_id: bytes
    peer_ids: tuple[PeerID, ...]
    gathered: tuple[bytes, ...]  # member i's data_for_gather

    def encode(self) -> dict:
        return {
            "code": "begin",
            "group_id": self.group_id,
            "peer_ids": [p.to_bytes() for p in self.peer_ids],
            **_pack_gathered(self.gathered),
        }


@dataclass(frozen=True)
class Disbanded:
    """No group after all; ``suggested_leader``: the leader our leader now follows."""

    message: str
    suggested_leader: PeerID | None = None
    suggested_maddrs: tuple[str, ...] = ()

    def encode(self) -> dict:
        return {
            "code": "disbanded",
            "message": self.message,
            **_pack_suggestion(self.suggested_leader, self.suggested_maddrs),
        }


Answer = Rejected | Accepted | Begin | Disbanded


def _pack_gathered(gathered: tuple[bytes, ...]) -> dict:
    """The members' gathered bytes for a ``begin`` message: zlib-coded when that is
    smaller, as it is for an averager's member infos (the members share their schema and
    most of their addresses: 1.0-1.3 KB became 0.45 KB for 4 members of a streaming
    DiLoCo fragment, sent to each follower at every round)."""
    coded = zlib.compress(msgpack.packb(list(gathered), use_bin_type=True))
    if len(coded) < sum(len(g) for g in gathered):
        return {"gathered_z": coded}
    return {"gathered": list(gathered)}


def _unpack_gathered(message: dict, limit: int) -> Any:
    """The ``gathered`` list of a begin message, decoding at most ``limit`` bytes."""
    coded = message.get("gathered_z")
    if coded is None:
        return message.get("gathered")
    if not isinstance(coded, bytes):
        raise _fail("begin message", "gathered_z", "is not bytes")
    try:
        inflater = zlib.decompressobj()
        packed = inflater.decompress(coded, limit)
        if inflater.unconsumed_tail or not inflater.eof:
            raise _fail("begin message", "gathered_z", f"is over {limit} bytes or cut short")
        return msgpack.unpackb(packed, raw=False)
    except (zlib.error, ValueError, msgpack.UnpackException) as e:
        raise _fail("begin message", "gathered_z", f"is undecodable: {e}") from None


def _decode_begin(message: dict, max_gather_bytes: int) -> Begin:
    what = "begin message"
    group_id, raw_ids = message.get("group_id"), message.get("peer_ids")
    if not isinstance(group_id, bytes) or not 0 < len(group_id) <= MAX_GROUP_ID_BYTES:
        raise _fail(what, "group_id", f"must be 1 to {MAX_GROUP_ID_BYTES} bytes")
    if not isinstance(raw_ids, list) or not all(isinstance(p, bytes) for p in raw_ids):
        raise _fail(what, "peer_ids", "must be a list of PeerID bytes")
    limit = len(raw_ids) * (max_gather_bytes + 16) + 64  # msgpack's framing on top
    gathered = _unpack_gathered(message, limit)
    if not isinstance(gathered, list) or not all(isinstance(g, bytes) for g in gathered):
        raise _fail(what, "gathered", "must be a list of bytes")
    if len(gathered) != len(raw_ids):
        raise _fail(what, "gathered", f"has {len(gathered)} entries for {len(raw_ids)} peers")
    peer_ids = tuple(_peer_id(p, what, "peer_ids") for p in raw_ids)
    return Begin(group_id, peer_ids, tuple(gathered))


def decode_answer(message: Any, *, max_gather_bytes: int) -> Answer:
    """A leader's answer, or ProtocolViolation naming the bad field. ``max_gather_bytes``
    bounds what a begin message's coded gathered data may inflate to."""
    if not isinstance(message, dict):
        raise ProtocolViolation(f"malformed join answer: {message!r:.60} is not a map")
    code = message.get("code")
    if code == "rejected":
        reason = message.get("reason")
        try:
            reason = Rejection(reason)
        except ValueError:
            reason = _text(reason)
        suggested, maddrs = _suggestion(message, "rejection")
        return Rejected(reason, _text(message.get("message")), suggested, maddrs)
    if code == "accepted":
        ready_by = message.get("ready_by")
        if not _number(ready_by):
            raise _fail("acceptance", "ready_by", "must be a number")
        return Accepted(float(ready_by))
    if code == "begin":
        return _decode_begin(message, max_gather_bytes)
    if code == "disbanded":
        suggested, maddrs = _suggestion(message, "disbanding")
        return Disbanded(_text(message.get("message")), suggested, maddrs)
    raise _fail(
        "join answer", "code", f"{code!r:.40} is none of rejected, accepted, begin, disbanded"
    )
