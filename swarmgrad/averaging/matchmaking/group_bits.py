"""Moshpit grid coordinates as DHT group keys, and how they move between rounds.

Moshpit SGD places peers on a d-dimensional grid of side M. In round t, peers whose
coordinates agree on every axis except axis ``t mod d`` form a group and average; each
member then takes a new, distinct coordinate along that axis. After d rounds on a full
grid every peer holds the exact global mean, and on a partly filled grid the error still
falls geometrically.

Matchmaking builds groups dynamically, so nobody knows the whole grid. A peer only keeps
its *group bits*: the coordinates of the last d - 1 axes it averaged along, each
``bits_per_axis = log2(M)`` bits wide, oldest first. Peers that declare under the same
group bits are exactly the peers that agree on those d - 1 axes: the Moshpit group of this
round. After a round, every member appends its new coordinate and drops the oldest one (a
shift register), so the next round groups it along the next axis.

The new coordinate must differ between members of one group, or two of them would meet
again and mix nothing new. Each member takes its rank in the sorted list of member ids,
rotated by an offset that the group id decides: all members compute the same assignment
from the same :class:`~swarmgrad.averaging.group_info.GroupInfo`, ranks are distinct, and
the random rotation spreads the members of groups smaller than M uniformly over all M
buckets (without it, small groups would all crowd the low coordinates). The Moshpit paper's
rule is the unrotated rank; ``rotate=False`` gives it, for comparison.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "bits_per_axis_for",
    "bits_to_coordinates",
    "check_round_tag",
    "coordinate_of_rank",
    "coordinates_to_bits",
    "group_key",
    "member_coordinate",
    "next_group_bits",
    "random_group_bits",
    "rotation",
    "shift_in",
    "tagged_group_key",
    "validate_group_bits",
]

MAX_GROUP_BITS = 256  # keys stay short; 256 bits is far beyond any useful grid


def validate_group_bits(bits: object) -> str:
    """Return ``bits`` if it is a string of '0'/'1' (possibly empty); else ValidationError."""
    if not isinstance(bits, str):
        raise ValidationError(f"group bits must be a str of 0s and 1s, got {type(bits).__name__}")
    if len(bits) > MAX_GROUP_BITS:
        raise ValidationError(f"group bits are limited to {MAX_GROUP_BITS}, got {len(bits)}")
    bad = set(bits) - {"0", "1"}
    if bad:
        raise ValidationError(
            f"group bits {bits[:40]!r} may contain only '0' and '1', found {sorted(bad)}"
        )
    return bits


def group_key(prefix: str, bits: str) -> str:
    """The DHT key under which peers with these group bits look for each other."""
    if not isinstance(prefix, str) or not prefix:
        raise ValidationError(f"the averaging prefix must be a non-empty str, got {prefix!r}")
    return f"{prefix}.0b{validate_group_bits(bits)}"


MAX_ROUND_TAG = 64
_ROUND_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def check_round_tag(tag: object) -> str:
    """Return ``tag`` if it may name a round: up to 64 letters, digits, '_' or '-' (''
    for untagged rounds); else ValidationError naming what is wrong."""
    if not isinstance(tag, str):
        raise ValidationError(f"round_tag must be a str, got {type(tag).__name__}")
    if len(tag) > MAX_ROUND_TAG:
        raise ValidationError(f"round_tag is limited to {MAX_ROUND_TAG} characters, got {len(tag)}")
    bad = set(tag) - _ROUND_TAG_CHARS
    if bad:
        raise ValidationError(
            f"round_tag {tag[:40]!r} may contain only letters, digits, '_' and '-', "
            f"found {sorted(bad)}"
        )
    return tag


def tagged_group_key(key: str, round_tag: str) -> str:
    """The group key of a tagged round: peers meet only peers with the same tag (a
    training epoch, say, so that gradients of different epochs are never averaged)."""
    return f"{key}.{check_round_tag(round_tag)}" if round_tag else key


def bits_per_axis_for(target_group_size: int) -> int:
    """Bits of one grid coordinate: enough for ``target_group_size`` distinct buckets."""
    if not isinstance(target_group_size, int) or target_group_size < 1:
        raise ValidationError(f"target_group_size must be an int >= 1, got {target_group_size!r}")
    return max(1, (target_group_size - 1).bit_length())


def rotation(group_id: bytes, num_buckets: int) -> int:
    """The offset a group's id adds to its members' ranks (same for every member)."""
    digest = hashlib.sha256(b"swarmgrad.moshpit.rotation:" + bytes(group_id)).digest()
    return int.from_bytes(digest[:8], "big") % num_buckets


def coordinate_of_rank(rank: int, group_id: bytes, num_buckets: int, *, rotate: bool = True) -> int:
    """The new coordinate of the member of rank ``rank`` (in sorted id order)."""
    if num_buckets < 1:
        raise ValidationError(f"num_buckets must be >= 1, got {num_buckets}")
    offset = rotation(group_id, num_buckets) if rotate else 0
    return (rank + offset) % num_buckets


def shift_in(bits: str, coordinate: int, bits_per_axis: int) -> str:
    """Append ``coordinate`` (``bits_per_axis`` bits) and drop as many of the oldest bits:
    the length never changes. With fewer bits than one coordinate, the low bits of the
    coordinate are kept (a grid of side ``2 ** len(bits)``); empty bits stay empty (all
    peers in one key: plain group all-reduce without Moshpit)."""
    validate_group_bits(bits)
    if bits_per_axis < 1:
        raise ValidationError(f"bits_per_axis must be >= 1, got {bits_per_axis}")
    if not 0 <= coordinate < 2**bits_per_axis:
        raise ValidationError(f"coordinate {coordinate} does not fit in {bits_per_axis} bits")
    if not bits:
        return bits
    return (bits + format(coordinate, f"0{bits_per_axis}b"))[-len(bits) :]


def member_coordinate(
    group_id: bytes,
    peer_ids: Sequence[PeerID],
    peer_id: PeerID,
    num_buckets: int,
    *,
    rotate: bool = True,
) -> int:
    """The new coordinate (0 <= c < num_buckets) of ``peer_id`` after averaging in a group.

    Members of a group of at most ``num_buckets`` peers get distinct coordinates; every
    member computes the same assignment whatever the order of ``peer_ids``."""
    ranked = sorted(peer_ids)
    try:
        rank = ranked.index(peer_id)
    except ValueError:
        raise ValidationError(f"{peer_id} is not a member of group {group_id.hex()[:12]}") from None
    return coordinate_of_rank(rank, group_id, num_buckets, rotate=rotate)


def next_group_bits(
    bits: str,
    group_id: bytes,
    peer_ids: Sequence[PeerID],
    peer_id: PeerID,
    bits_per_axis: int,
    *,
    rotate: bool = True,
) -> str:
    """Group bits for the next round: drop the oldest coordinate, append the new one
    (see :func:`shift_in`)."""
    validate_group_bits(bits)
    if bits_per_axis < 1:
        raise ValidationError(f"bits_per_axis must be >= 1, got {bits_per_axis}")
    if not bits:
        return bits
    coordinate = member_coordinate(group_id, peer_ids, peer_id, 2**bits_per_axis, rotate=rotate)
    return shift_in(bits, coordinate, bits_per_axis)


def bits_to_coordinates(bits: str, bits_per_axis: int) -> tuple[int, ...]:
    """The grid coordinates in ``bits``, oldest first (len(bits) must be a multiple)."""
    validate_group_bits(bits)
    if bits_per_axis < 1 or len(bits) % bits_per_axis:
        raise ValidationError(
            f"{len(bits)} group bits do not split into coordinates of {bits_per_axis} bits"
        )
    return tuple(int(bits[i : i + bits_per_axis], 2) for i in range(0, len(bits), bits_per_axis))


def coordinates_to_bits(coordinates: Sequence[int], bits_per_axis: int) -> str:
    """Inverse of :func:`bits_to_coordinates`."""
    if bits_per_axis < 1:
        raise ValidationError(f"bits_per_axis must be >= 1, got {bits_per_axis}")
    side = 2**bits_per_axis
    for axis, c in enumerate(coordinates):
        if not isinstance(c, int) or not 0 <= c < side:
            raise ValidationError(f"coordinate {c!r} on axis {axis} is outside [0, {side})")
    return "".join(format(c, f"0{bits_per_axis}b") for c in coordinates)


def random_group_bits(num_bits: int, rng: random.Random | None = None) -> str:
    """Uniformly random initial group bits (a random cell of the grid)."""
    if not isinstance(num_bits, int) or not 0 <= num_bits <= MAX_GROUP_BITS:
        raise ValidationError(f"num_bits must be an int in [0, {MAX_GROUP_BITS}], got {num_bits}")
    rng = rng or random.Random()
    return "".join(rng.choice("01") for _ in range(num_bits))
