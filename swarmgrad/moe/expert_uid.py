"""Expert uids and where they live.

An expert uid is a name followed by grid coordinates, ``"expert.3.17"``: the name
``expert`` and coordinates (3, 17) in a 2-d grid. Its prefixes ``"expert."`` and
``"expert.3."`` (always with the trailing delimiter) are what the beam search walks.
A uid may be hosted by several servers; :class:`ExpertInfo` lists all live ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "PREFIX_PATTERN",
    "UID_DELIMITER",
    "UID_PATTERN",
    "Coordinate",
    "ExpertInfo",
    "ExpertPrefix",
    "ExpertUID",
    "Score",
    "ServerInfo",
    "check_uid",
    "is_valid_prefix",
    "is_valid_uid",
    "normalize_prefix",
    "split_uid",
    "uid_prefixes",
]

ExpertUID = str
ExpertPrefix = str
Coordinate = int
Score = float

UID_DELIMITER = "."
_COORD = r"(?:0|[1-9][0-9]*)"
#: A name without delimiters or whitespace, then one or more ``.coordinate``.
UID_PATTERN = re.compile(rf"^[^.\s]+(?:\.{_COORD})+$")
#: A name, zero or more ``.coordinate``, then the delimiter.
PREFIX_PATTERN = re.compile(rf"^[^.\s]+(?:\.{_COORD})*\.$")


def is_valid_uid(maybe_uid: str) -> bool:
    return isinstance(maybe_uid, str) and UID_PATTERN.fullmatch(maybe_uid) is not None


def is_valid_prefix(maybe_prefix: str) -> bool:
    return isinstance(maybe_prefix, str) and PREFIX_PATTERN.fullmatch(maybe_prefix) is not None


def check_uid(uid: str) -> ExpertUID:
    if not is_valid_uid(uid):
        raise ValidationError(
            f"{uid!r} is not an expert uid: expected a name and integer grid coordinates "
            f"joined by {UID_DELIMITER!r}, such as 'expert.3.17'"
        )
    return uid


def normalize_prefix(prefix: str) -> ExpertPrefix:
    """Accept a prefix with or without its trailing delimiter (``"expert"`` or
    ``"expert."``) and return it with the delimiter."""
    if isinstance(prefix, str) and not prefix.endswith(UID_DELIMITER):
        prefix += UID_DELIMITER
    if not is_valid_prefix(prefix):
        raise ValidationError(
            f"{prefix!r} is not an expert uid prefix: expected a name and zero or more "
            f"integer coordinates, such as 'expert' or 'expert.3.'"
        )
    return prefix


def split_uid(uid_or_prefix: str) -> tuple[ExpertPrefix, Coordinate]:
    """``"expert.3.17"`` -> (``"expert.3."``, 17); also for a prefix: ``"expert.3."`` ->
    (``"expert."``, 3)."""
    text = uid_or_prefix.removesuffix(UID_DELIMITER)
    head, sep, last = text.rpartition(UID_DELIMITER)
    if not sep or not last.isdigit():
        raise ValidationError(f"{uid_or_prefix!r} has no grid coordinate to split off")
    return head + UID_DELIMITER, int(last)


def uid_prefixes(uid: ExpertUID) -> list[tuple[ExpertPrefix, Coordinate]]:
    """Every (prefix, next coordinate) pair along a uid, shortest prefix first:
    ``"expert.3.17"`` -> [(``"expert."``, 3), (``"expert.3."``, 17)]."""
    check_uid(uid)
    name, *coords = uid.split(UID_DELIMITER)
    pairs, prefix = [], name + UID_DELIMITER
    for coord in coords:
        pairs.append((prefix, int(coord)))
        prefix += coord + UID_DELIMITER
    return pairs


@dataclass(frozen=True)
class ServerInfo:
    """One server hosting an expert: its PeerID and the multiaddrs it announced."""

    peer_id: PeerID
    maddrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertInfo:
    """An expert uid and every live server known to host it (at least one)."""

    uid: ExpertUID
    servers: tuple[ServerInfo, ...]

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValidationError(f"expert {self.uid!r} needs at least one server")

    @property
    def peer_id(self) -> PeerID:
        """The first server (hivemind's ExpertInfo has exactly one)."""
        return self.servers[0].peer_id
