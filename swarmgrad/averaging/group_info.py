"""What matchmaking hands to all-reduce: who is in the group, in which order, with what.

Matchmaking (:mod:`swarmgrad.averaging.matchmaking.driver`) produces a :class:`GroupInfo`; the
all-reduce (:mod:`swarmgrad.averaging.allreduce`) consumes it. Every member holds the
same GroupInfo: the same ``group_id``, the same member order (which decides who reduces
which span), and every member's gathered metadata (msgpack bytes: bandwidth, mode,
weight, user ``gather`` data), in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError

__all__ = ["GroupInfo"]


@dataclass(frozen=True)
class GroupInfo:
    group_id: bytes
    peer_ids: tuple[PeerID, ...]
    gathered: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if len(self.peer_ids) != len(self.gathered):
            raise ValidationError(
                f"group {self.group_id.hex()[:12]}: {len(self.peer_ids)} members but "
                f"{len(self.gathered)} gathered entries"
            )
        if len(set(self.peer_ids)) != len(self.peer_ids):
            raise ValidationError(f"group {self.group_id.hex()[:12]} lists a member twice")

    @property
    def group_size(self) -> int:
        return len(self.peer_ids)
