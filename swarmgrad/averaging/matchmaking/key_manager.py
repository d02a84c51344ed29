"""Group keys in the DHT: where peers that look for a group announce themselves.

A peer looking for a group stores a declaration under its group key
``<prefix>.0b<group bits>`` (see :mod:`.group_bits`): the subkey is its
PeerID, the value ``[ready_by, client_mode, maddrs]`` where ``ready_by`` is the DHT time
at which, as a leader, it will start its group, and ``maddrs`` the addresses at which
followers reach it (a peer found in a DHT record is not necessarily one we have met). The
record expires at ``ready_by``, so a leader whose time has come vanishes from the key by
itself. Client-mode peers declare too (other peers can count them) but are never asked to
lead, so they publish no addresses.

Everyone else reads the key to find potential leaders. Records written by other peers are
untrusted input: malformed subkeys or values are skipped (and logged at debug level),
never raised.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.group_bits import (
    bits_per_axis_for,
    group_key,
    next_group_bits,
    validate_group_bits,
)
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError

__all__ = ["Declaration", "GroupKeyManager"]

logger = logging.getLogger(__name__)

MAX_MADDRS = 8  # addresses kept per declaration; more is noise (or an attack)


@dataclass(frozen=True, order=True)
class Declaration:
    """One peer's entry under a group key. Orders by (ready_by, peer_id): the order in
    which followers try leaders and the total order that keeps join requests acyclic."""

    ready_by: float
    peer_id: PeerID
    client_mode: bool = False
    maddrs: tuple[str, ...] = field(default=(), compare=False)


class GroupKeyManager:
    """Declares this peer under its current group key and reads the others' declarations.

    Holds the peer's group bits; :meth:`update_group_bits` moves them along the Moshpit
    grid after a group is assembled."""

    def __init__(
        self,
        dht_node: DHTNode,
        prefix: str,
        *,
        initial_group_bits: str = "",
        target_group_size: int = 32,
        rotate: bool = True,
    ):
        group_key(prefix, "")  # validates the prefix
        self.dht_node = dht_node
        self.prefix = prefix
        self.bits_per_axis = bits_per_axis_for(target_group_size)
        self.rotate = rotate
        self._group_bits = validate_group_bits(initial_group_bits)

    # ------------------------------------------------------------------ group bits

    @property
    def group_bits(self) -> str:
        return self._group_bits

    @group_bits.setter
    def group_bits(self, bits: str) -> None:
        self._group_bits = validate_group_bits(bits)

    @property
    def current_key(self) -> str:
        return group_key(self.prefix, self._group_bits)

    def update_group_bits(self, group_info: GroupInfo, peer_id: PeerID) -> str:
        """Move to the next Moshpit axis after averaging in ``group_info``; returns the new
        bits. Every member of the group lands on a distinct coordinate (groups of at most
        ``2 ** bits_per_axis`` members)."""
        self._group_bits = next_group_bits(
            self._group_bits,
            group_info.group_id,
            group_info.peer_ids,
            peer_id,
            self.bits_per_axis,
            rotate=self.rotate,
        )
        return self._group_bits

    # ------------------------------------------------------------------ DHT records

    async def declare(
        self,
        ready_by: float,
        *,
        client_mode: bool = False,
        maddrs: Iterable[str] = (),
        key: str | None = None,
    ) -> bool:
        """Announce that this peer looks for a group under ``key`` (default: the current
        key) until DHT time ``ready_by``, reachable at ``maddrs``. True if at least one DHT
        node stored it."""
        if not isinstance(ready_by, int | float) or not math.isfinite(ready_by):
            raise ValidationError(f"ready_by must be a finite DHT time, got {ready_by!r}")
        addresses = [str(m) for m in maddrs][:MAX_MADDRS]
        return await self.dht_node.store(
            key or self.current_key,
            [float(ready_by), bool(client_mode), addresses],
            expiration_time=float(ready_by),
            subkey=self.dht_node.peer_id.to_bytes(),
        )

    async def withdraw(self, ready_by: float, *, key: str | None = None) -> bool:
        """Hide our declaration under ``key`` (a delete that outlives the record by a
        moment, since the later expiration wins)."""
        return await self.dht_node.store(
            key or self.current_key,
            None,
            expiration_time=float(ready_by) + 1e-3,
            subkey=self.dht_node.peer_id.to_bytes(),
        )

    async def get_declarations(self, key: str | None = None) -> list[Declaration]:
        """Valid, unexpired declarations under ``key`` (default: the current key), in
        (ready_by, peer_id) order. Our own declaration is included if present."""
        key = key or self.current_key
        found = await self.dht_node.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now = self.dht_node.time_fn()
        return sorted(d for d in _parse_entries(key, found.value.items()) if d.ready_by > now)


def _parse_entries(key: str, entries: Iterable[tuple[object, object]]) -> list[Declaration]:
    declarations = []
    for subkey, entry in entries:
        value = getattr(entry, "value", None)
        try:
            if not isinstance(subkey, bytes):
                raise ValidationError(f"subkey is {type(subkey).__name__}, not PeerID bytes")
            peer_id = PeerID(subkey)
            if not isinstance(value, list | tuple) or len(value) < 2:
                raise ValidationError(f"value {value!r:.60} is not [ready_by, client_mode, ...]")
            ready_by, client_mode = value[0], value[1]
            if isinstance(ready_by, bool) or not isinstance(ready_by, int | float):
                raise ValidationError(f"ready_by {ready_by!r:.40} is not a number")
            if not math.isfinite(ready_by) or not isinstance(client_mode, bool):
                raise ValidationError(f"bad ready_by/client_mode {value!r:.60}")
            maddrs = value[2] if len(value) > 2 else []
            if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
                raise ValidationError(f"maddrs {maddrs!r:.60} is not a list of str")
        except ValidationError as e:
            logger.debug("skipping a malformed declaration under %r: %s", key, e)
            continue
        declarations.append(
            Declaration(float(ready_by), peer_id, client_mode, tuple(maddrs[:MAX_MADDRS]))
        )
    return declarations
