"""Matchmaking's decisions, without I/O: whom to follow, whom to accept, when to begin.

:class:`MatchmakingRules` holds a peer's matchmaking settings and answers the questions
the driver (:mod:`.driver`) asks as events come in: a declaration read from the DHT
(:meth:`~MatchmakingRules.may_follow`), a join request (:meth:`~MatchmakingRules.judge_join`),
a tick of the clock or a new member (:meth:`~MatchmakingRules.time_to_begin`,
:meth:`~MatchmakingRules.enough_to_begin`), a leader's ``begin`` message
(:meth:`~MatchmakingRules.check_group`). Times are DHT times passed in; nothing here reads a
clock, touches the network or the DHT, so the rules are tested directly (like
:mod:`.group_bits`).

The rules that keep matchmaking free of deadlock: potential leaders are totally ordered
by ``(ready_by, peer_id)``; a peer asks only leaders that come before it and a leader
accepts only followers that come after it, so join requests point down one order and no
two peers wait for each other. Client-mode peers never lead and may follow anyone.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.key_manager import Declaration
from swarmgrad.averaging.matchmaking.protocol import (
    MAX_HOLD,
    Begin,
    JoinRequest,
    Rejected,
    Rejection,
)
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.checks import int_at_least, positive_int, positive_seconds
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

__all__ = ["TICK", "LeaderView", "MatchmakingRules"]

# Times closer than this count as reached. asyncio fires a timer that is due within its
# clock resolution without moving the clock; on the simulation's virtual clock, a loop that
# compared times exactly would then wake up forever a hair before its deadline.
TICK = 1e-6


@dataclass(frozen=True)
class LeaderView:
    """What a join request meets: this peer's search as a potential leader."""

    key: str  # the group key we look under
    ready_by: float  # DHT time of our declaration: our group begins then at the latest
    followers: frozenset[PeerID]  # accepted so far
    following: PeerID | None = None  # a leader that accepted us: we no longer lead
    following_maddrs: tuple[str, ...] = ()  # its addresses, to pass on


@dataclass(frozen=True)
class MatchmakingRules:
    """One peer's matchmaking settings and the decisions that follow from them."""

    me: PeerID
    target_group_size: int
    min_group_size: int = 2
    client_mode: bool = False
    max_gather_bytes: int = 1 << 20
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0

    def __post_init__(self) -> None:
        size = int_at_least("target_group_size", self.target_group_size, 2)
        least = self.min_group_size
        if isinstance(least, bool) or not isinstance(least, int) or not 1 <= least <= size:
            raise ValidationError(
                f"min_group_size must be an int in [1, target_group_size={size}], got {least!r}"
            )
        positive_int("max_gather_bytes", self.max_gather_bytes)
        # frozen: the checked values replace the given ones through object.__setattr__
        for name in ("min_matchmaking_time", "request_timeout"):
            object.__setattr__(self, name, positive_seconds(name, getattr(self, name)))
        object.__setattr__(self, "client_mode", bool(self.client_mode))

    # ------------------------------------------------------------------ a search

    def full_at(self, expected_size: int | None) -> int:
        """Members at which a group we lead begins without waiting for its ready_by."""
        if expected_size is None:
            return self.target_group_size
        if type(expected_size) is not int or expected_size < 2:
            raise ValidationError(f"expected_size must be an int >= 2, got {expected_size!r}")
        return min(self.target_group_size, expected_size)

    def next_ready_by(
        self, now: float, remaining: float, scheduled_time: float | None
    ) -> tuple[float, bool]:
        """The ready_by of our next declaration (DHT time ``now``, ``remaining`` seconds
        of search left) and whether it used ``scheduled_time`` (used once: a group that
        does not form then is looked for again at the usual pace)."""
        if scheduled_time is not None and scheduled_time > now:
            return min(scheduled_time, now + remaining), True
        return now + min(self.min_matchmaking_time, remaining), False

    def refresh_period(self) -> float:
        """Seconds between reads of the declarations under our key."""
        return max(0.05, min(self.request_timeout, self.min_matchmaking_time / 4))

    def hint_hold(self, left: float, begin_in: float) -> float:
        """Seconds a hinted leader may hold our request: until we would have begun a group
        of our own (``begin_in``) plus an answer's time, within the ``left`` of our
        search (an answer's time kept for the fallback)."""
        return max(0.0, min(left - self.request_timeout, begin_in + self.request_timeout))

    # ------------------------------------------------------------------ leader side

    def time_to_begin(self, *, members: int, full_at: int, ready_by: float, now: float) -> bool:
        """Does a group we lead begin now? Once full, or once our ready_by has come.
        A client-mode peer never leads."""
        if self.client_mode:
            return False
        return members >= full_at or now >= ready_by - TICK

    def enough_to_begin(self, members: int) -> bool:
        """A group of ``members`` (us included) begins; a smaller one is disbanded."""
        return members >= self.min_group_size

    def judge_join(
        self,
        request: JoinRequest,
        remote: PeerID,
        view: LeaderView | None,
        *,
        now: float,
        banned: bool = False,
    ) -> Rejected | None:
        """None if we take ``remote`` into our group, else the rejection to send.
        ``view``: our search, or None if we are not looking (no search, shut down, or our
        group has begun); ``banned``: we banned ``remote`` for now; ``now``: DHT time."""
        if len(request.gather) > self.max_gather_bytes:
            return Rejected(
                Rejection.BAD_REQUEST,
                f"gathered data of {len(request.gather)} bytes exceeds {self.max_gather_bytes}",
            )
        if banned:
            return Rejected(Rejection.BANNED, f"{remote} is banned from {self.me}'s groups for now")
        if view is None:
            return Rejected(Rejection.NOT_LOOKING, f"{self.me} is not looking")
        if self.client_mode:
            return Rejected(Rejection.NOT_A_LEADER, "a client-mode peer never leads a group")
        if view.following is not None:
            return Rejected(
                Rejection.NOT_A_LEADER,
                f"{self.me} follows {view.following}",
                view.following,
                view.following_maddrs,
            )
        if request.group_key != view.key:
            return Rejected(
                Rejection.BAD_GROUP_KEY,
                f"we look for a group under {view.key!r}, not {request.group_key!r:.80}",
            )
        if remote in view.followers:
            return Rejected(Rejection.DUPLICATE_PEER_ID, f"{remote} is already in this group")
        if not request.client_mode and (request.ready_by, remote) <= (view.ready_by, self.me):
            return Rejected(
                Rejection.BAD_ORDER,
                f"ready_by {request.ready_by} is not after ours ({view.ready_by}): followers "
                "must come after their leader",
            )
        if len(view.followers) + 1 >= self.target_group_size:
            return Rejected(Rejection.GROUP_FULL, f"the group is full ({self.target_group_size})")
        if now >= view.ready_by:
            return Rejected(Rejection.TOO_LATE, "the group is about to begin")
        return None

    def hold(self, request: JoinRequest, *, looking: bool, closed: bool, held: int) -> float:
        """Seconds to keep ``request`` open until our search starts (0: answer now). Only
        asked-for holds, only while we are not looking yet, at most ``target_group_size``
        held at once (``held``: already waiting), each at most MAX_HOLD."""
        if looking or closed or request.hold is None or held >= self.target_group_size:
            return 0.0
        return min(request.hold, MAX_HOLD)

    # ------------------------------------------------------------------ follower side

    def may_follow(
        self, leader: Declaration, *, my_ready_by: float, now: float, banned: bool = False
    ) -> bool:
        """May we ask the peer behind ``leader`` (a declaration under our key) to take us?
        Not ourselves, not a client, not one whose ready_by passed, not a banned one; and,
        unless we are a client, only one that comes before us."""
        if leader.peer_id == self.me or leader.client_mode or leader.ready_by <= now:
            return False
        if banned:
            return False
        if self.client_mode:
            return True
        return (leader.ready_by, leader.peer_id) < (my_ready_by, self.me)

    def check_group(self, begin: Begin, leader: PeerID, my_gather: bytes) -> GroupInfo:
        """A leader's begin message as the GroupInfo we average in; ProtocolViolation if it
        lacks us or the leader, lists a member twice, or altered what we sent."""
        try:
            info = GroupInfo(begin.group_id, begin.peer_ids, begin.gathered)
        except ValidationError as e:
            raise ProtocolViolation(f"leader {leader} sent a bad group: {e}") from None
        if self.me not in info.peer_ids or leader not in info.peer_ids:
            raise ProtocolViolation(
                f"leader {leader} sent group {begin.group_id.hex()[:12]} that lacks "
                f"{'us' if self.me not in info.peer_ids else 'the leader itself'}"
            )
        if info.gathered[info.peer_ids.index(self.me)] != my_gather:
            raise ProtocolViolation(f"leader {leader} altered our gathered data")
        return info
