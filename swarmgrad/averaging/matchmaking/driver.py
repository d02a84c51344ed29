"""Matchmaking: peers that share a group key form groups, with no coordinator.

Every peer that looks for a group declares itself under its group key with a time
``ready_by`` (see :mod:`.key_manager`) and is a potential leader until
then. Potential leaders are totally ordered by ``(ready_by, peer_id)``. A peer asks the
potential leaders that come *before* it in that order, earliest first, to let it join
(``averaging.join_group``, a streaming RPC); a leader accepts only peers that come after
it. Join requests therefore only ever point down a total order: no two peers can wait for
each other, so there is no deadlock, whatever the timing.

A leader collects followers until its group has ``target_group_size`` members or its
``ready_by`` arrives. Then, if the group has at least ``min_group_size`` members, it
sends every follower the same :class:`~swarmgrad.averaging.group_info.GroupInfo` (a fresh
random group id, the member order, every member's gathered bytes) over the follower's
open stream; otherwise it disbands the group, and everyone looks again under a new
declaration, until their timeout.

A peer is a leader or a follower, never both at once: while it waits for a leader's
answer, it may still accept followers, but the moment a leader accepts it, it hands its own
followers over (they are told to try its leader next) and refuses new ones. Client-mode
peers never lead; they only join others' groups.

Failures: a follower whose leader dies (the stream breaks, or the group does not begin
shortly after the leader's ``ready_by``) goes on to other leaders; a follower that
vanishes before its group begins is dropped by the leader (its stream breaks). Every wait
has a deadline derived from ``timeout``, ``request_timeout`` and the leaders' declared
times; a peer's bad request is answered with a rejection naming the problem, never raised
locally.

Several averagers of one process share the peer's single ``averaging.join_group``
handler, which routes requests by ``prefix``.

**A known leader.** A caller that already knows who will lead (``leader_hint``: streaming
DiLoCo's later fragments of an outer step reuse the leader of its first fragment's group)
skips the DHT. A follower sends its join request straight to that leader with a ``hold``:
a leader that is not looking yet keeps the request open until its own search starts (a
bounded wait, a bounded number of held requests) instead of refusing it, so nobody polls.
The hinted leader still declares itself, for peers without the hint (a joiner), but reads
no declarations for the first half of its matchmaking time: its followers come to it. Any
failure (the leader gone, a different key, a refusal, the hold running out) falls back to
the search through the DHT. On a 20 Mbit/s link this is what a fragment's round costs in
control traffic: each peer's declaration to the key's replicas and its reads of them,
answered by every replica, landed in the middle of paced data and set the link's peak.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.group_bits import tagged_group_key
from swarmgrad.averaging.matchmaking.key_manager import MAX_MADDRS, Declaration, GroupKeyManager
from swarmgrad.averaging.matchmaking.protocol import (
    JOIN_GROUP,
    Accepted,
    Answer,
    Begin,
    Disbanded,
    JoinRequest,
    Rejected,
    Rejection,
    decode_answer,
    decode_join_request,
)
from swarmgrad.averaging.matchmaking.rules import TICK, LeaderView, MatchmakingRules
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import RPCContext, ServicerBase
from swarmgrad.utils.checks import positive_seconds
from swarmgrad.utils.errors import ProtocolViolation, SwarmgradError, ValidationError

__all__ = ["JOIN_GROUP", "Matchmaking", "Rejection"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- serving by prefix


class JoinServicer(ServicerBase):
    """A peer's one ``averaging.join_group`` handler, routing requests by prefix to the
    matchmaking of each averager (one per peer: :meth:`Peer.shared_servicer`)."""

    rpc_prefix = "averaging"

    def __init__(self) -> None:
        self.by_prefix: dict[str, Matchmaking] = {}

    async def rpc_join_group(self, request: Any, context: RPCContext) -> AsyncIterator[dict]:
        """A join request in; a rejection, or an acceptance then the group, out."""
        prefix = request.get("prefix") if isinstance(request, dict) else None
        matchmaking = self.by_prefix.get(prefix) if isinstance(prefix, str) else None
        if matchmaking is None:
            message = f"no averager with prefix {prefix!r:.80}"
            yield Rejected(Rejection.UNKNOWN_PREFIX, message).encode()
            return
        async for answer in matchmaking._serve_join(request, context):
            yield answer.encode()

    def attach(self, peer: Peer, prefix: str, matchmaking: Matchmaking) -> None:
        if prefix in self.by_prefix:
            raise ValidationError(
                f"peer {peer.peer_id} already runs matchmaking for prefix {prefix!r}"
            )
        self.by_prefix[prefix] = matchmaking

    def detach(self, peer: Peer, prefix: str, matchmaking: Matchmaking) -> None:
        if self.by_prefix.get(prefix) is matchmaking:
            del self.by_prefix[prefix]
            if not self.by_prefix:
                peer.remove_servicer(self)


# ---------------------------------------------------------------------- search state


@dataclass
class _Follower:
    peer_id: PeerID
    gather: bytes
    outcome: asyncio.Future  # the answer to send: Begin or Disbanded


@dataclass
class _Search:
    """One call of look_for_group: our declaration and our role in it."""

    key: str
    data: bytes
    deadline: float  # loop time
    ready_by: float = -math.inf  # DHT time of our current declaration
    followers: dict[PeerID, _Follower] = field(default_factory=dict)
    leader: PeerID | None = None  # a leader that accepted us: we follow it
    joined: PeerID | None = None  # the leader whose group we joined, once it began
    assembled: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    full_at: int = 2**31  # begin a group we lead once it has this many members
    reads_from: float = -math.inf  # loop time: a hinted leader reads no declarations before


class Matchmaking:
    """Forms groups under this peer's group key; see the module docstring.

    ``await look_for_group(data_for_gather=..., timeout=...)`` returns the GroupInfo of a
    group of ``min_group_size`` to ``target_group_size`` peers (and moves this peer's group
    bits to the next Moshpit axis), or None if no group formed within ``timeout``.
    ``min_matchmaking_time`` is how long a leader waits for followers when its group does
    not fill up; ``request_timeout`` bounds each answer from another peer.
    """

    def __init__(
        self,
        peer: Peer,
        dht_node: DHTNode,
        *,
        prefix: str,
        target_group_size: int,
        min_group_size: int = 2,
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        client_mode: bool = False,
        initial_group_bits: str = "",
        max_gather_bytes: int = 1 << 20,
        rotate_group_bits: bool = True,
        rng: random.Random | None = None,
    ):
        self.rules = rules = MatchmakingRules(
            peer.peer_id,
            target_group_size,
            min_group_size,
            client_mode,
            max_gather_bytes,
            min_matchmaking_time,
            request_timeout,
        )
        self.peer, self.dht_node = peer, dht_node
        self.prefix = prefix
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.min_matchmaking_time = rules.min_matchmaking_time
        self.request_timeout = rules.request_timeout
        self.client_mode = rules.client_mode
        self.max_gather_bytes = max_gather_bytes
        self.key_manager = GroupKeyManager(
            dht_node,
            prefix,
            initial_group_bits=initial_group_bits,
            target_group_size=target_group_size,
            rotate=rotate_group_bits,
        )
        self._rng = rng or random.Random()
        self._maddrs_of: dict[PeerID, tuple[str, ...]] = {}  # leaders' declared addresses
        self._search: _Search | None = None
        self._closed = False
        # a local ban (robust averaging's accountability): never lead or follow these
        self.is_banned: Callable[[PeerID], bool] = lambda peer_id: False
        # (round_tag, leader) of the last group this peer was in: a caller's next leader_hint
        self.last_group: tuple[str, PeerID] | None = None
        self._looking = asyncio.Event()  # set while a search runs: held join requests wait
        self._held = 0  # join requests waiting for our search to start
        peer.shared_servicer(JoinServicer).attach(peer, prefix, self)

    # ------------------------------------------------------------------ public API

    def get_group_bits(self) -> str:
        return self.key_manager.group_bits

    def set_group_bits(self, group_bits: str) -> None:
        self.key_manager.group_bits = group_bits

    @property
    def is_looking_for_group(self) -> bool:
        return self._search is not None

    async def look_for_group(
        self,
        *,
        data_for_gather: bytes = b"",
        timeout: float,
        scheduled_time: float | None = None,
        round_tag: str = "",
        expected_size: int | None = None,
        leader_hint: PeerID | None = None,
    ) -> GroupInfo | None:
        """Find a group under the current group key within ``timeout`` seconds.

        ``data_for_gather`` reaches every member in ``GroupInfo.gathered``.
        ``scheduled_time`` (DHT time) is when this peer, as a leader, starts its group;
        default: ``min_matchmaking_time`` from now. ``round_tag`` (see
        :func:`~.group_bits.tagged_group_key`) restricts the group to peers with the same
        tag. ``expected_size``: how many peers the caller expects (e.g. the collaborative
        optimizer's count of live trainers); a group this peer leads begins as soon as
        it has that many members, not only at ``target_group_size`` or its scheduled
        time. A low guess leaves late peers out of this round, a high one costs the
        wait of today. ``leader_hint``: the peer expected to lead this group (see the module
        docstring), or this peer itself. On success the group bits move to the next Moshpit
        axis before the GroupInfo is returned."""
        if self._closed:
            raise SwarmgradError(f"matchmaking for {self.prefix!r} is shut down")
        if self._search is not None:
            raise SwarmgradError(f"{self.peer.peer_id} is already looking for a group")
        timeout = positive_seconds("timeout", timeout)
        if not isinstance(data_for_gather, bytes | bytearray | memoryview):
            raise ValidationError(
                f"data_for_gather must be bytes, got {type(data_for_gather).__name__}"
            )
        data = bytes(data_for_gather)
        if len(data) > self.max_gather_bytes:
            raise ValidationError(
                f"data_for_gather is {len(data)} bytes, over the limit of {self.max_gather_bytes}"
            )
        loop = asyncio.get_running_loop()
        key = tagged_group_key(self.key_manager.current_key, round_tag)
        search = _Search(key, data, loop.time() + timeout)
        search.full_at = self.rules.full_at(expected_size)
        if leader_hint is not None and not isinstance(leader_hint, PeerID):
            raise ValidationError(f"leader_hint must be a PeerID, got {leader_hint!r:.60}")
        self._search = search
        self._looking.set()
        try:
            group = await self._run(search, scheduled_time, leader_hint)
        finally:
            self._search = None
            self._looking.clear()
            self._maddrs_of.clear()
            self._release_followers(search, Disbanded("the leader stopped looking for a group"))
        if group is not None:
            leader = self.peer.peer_id if search.assembled else search.joined
            if leader is not None:
                self.last_group = (round_tag, leader)
            old_bits = self.key_manager.group_bits
            new_bits = self.key_manager.update_group_bits(group, self.peer.peer_id)
            logger.debug(
                "%s: group %s of %d under %s; group bits %r -> %r",
                self.peer.peer_id,
                group.group_id.hex()[:12],
                group.group_size,
                search.key,
                old_bits,
                new_bits,
            )
        return group

    async def shutdown(self) -> None:
        """Stop answering join requests; a running look_for_group returns None soon."""
        self._closed = True
        self._looking.set()  # held join requests: answered (not looking) at once
        self.peer.shared_servicer(JoinServicer).detach(self.peer, self.prefix, self)
        if self._search is not None:
            self._search.wakeup.set()

    # ------------------------------------------------------------------ the search loop

    def _dht_time(self) -> float:
        return self.dht_node.time_fn()

    def _local_time_of(self, dht_time: float) -> float:
        return asyncio.get_running_loop().time() + (dht_time - self._dht_time())

    def set_expected_size(self, expected_size: int | None) -> None:
        """A new ``expected_size`` for the search under way (see :meth:`look_for_group`;
        call on the loop). A diloco round is scheduled before its epoch ends, and a peer
        that joined meanwhile was counted by everyone only at the launch: the groups
        began with the peers counted at scheduling, every epoch, and left it out."""
        full_at = self.rules.full_at(expected_size)
        s = self._search
        if s is None:
            return
        s.full_at = full_at
        if len(s.followers) + 1 >= s.full_at:
            s.wakeup.set()

    def _time_to_begin(self, s: _Search) -> bool:
        return self.rules.time_to_begin(
            members=len(s.followers) + 1,
            full_at=s.full_at,
            ready_by=s.ready_by,
            now=self._dht_time(),
        )

    async def _run(
        self, s: _Search, scheduled_time: float | None, hint: PeerID | None
    ) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        if hint == self.peer.peer_id:
            if not self.client_mode:  # followers come to us
                s.reads_from = loop.time() + self.min_matchmaking_time / 2
        elif hint is not None and not self.is_banned(hint):
            group = await self._follow_hint(s, hint, scheduled_time)
            if group is not None:
                return group
        queue: list[PeerID] = []  # leaders to try next, best first
        known: dict[PeerID, Declaration] = {}
        tried: set[tuple[PeerID, float | None]] = set()
        next_refresh = -math.inf
        refresh_period = self.rules.refresh_period()
        while not self._closed and loop.time() < s.deadline - TICK:
            if s.ready_by > -math.inf and self._time_to_begin(s):
                group = self._begin(s)
                if group is not None:
                    return group
                s.ready_by = -math.inf  # too small or alone: declare again
                s.reads_from = -math.inf  # and look for other leaders, hint or not
            if self._dht_time() >= s.ready_by - TICK:
                remaining = s.deadline - loop.time()
                s.ready_by, used = self.rules.next_ready_by(
                    self._dht_time(), remaining, scheduled_time
                )
                if used:
                    scheduled_time = None
                tried.clear()
                maddrs = () if self.client_mode else map(str, self.peer.get_visible_maddrs())
                declare = self.key_manager.declare(
                    s.ready_by, client_mode=self.client_mode, maddrs=maddrs, key=s.key
                )
                await self._bounded(declare, s)
                next_refresh = -math.inf
            refresh_at = max(next_refresh, s.reads_from)
            if loop.time() >= refresh_at - TICK:
                declarations = await self._bounded(self.key_manager.get_declarations(s.key), s)
                next_refresh = loop.time() + refresh_period
                if declarations is not None:
                    known = {d.peer_id: d for d in declarations}
                    for d in declarations:
                        self._learn_maddrs(d.peer_id, d.maddrs)
                    queue = [d.peer_id for d in declarations if self._may_follow(s, d)]
            leader = None
            while queue and leader is None:
                candidate = queue.pop(0)
                declared = known.get(candidate)
                attempt = (candidate, declared.ready_by if declared else None)
                if attempt not in tried and (declared is None or self._may_follow(s, declared)):
                    tried.add(attempt)
                    leader = candidate
            if leader is not None and not self._time_to_begin(s):
                if not self.client_mode and len(s.followers) + 1 >= s.full_at:
                    continue  # full: begin first
                outcome = await self._try_leader(s, leader)
                if isinstance(outcome, GroupInfo):
                    return outcome
                if isinstance(outcome, PeerID) and outcome != self.peer.peer_id:
                    queue.insert(0, outcome)  # a suggested leader: try it next
                continue
            if self._time_to_begin(s):
                continue
            wake_at = min(refresh_at, s.deadline, self._local_time_of(s.ready_by))
            s.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(max(wake_at, loop.time() + 2 * TICK)):
                    await s.wakeup.wait()
        return None

    def _learn_maddrs(self, peer_id: PeerID, maddrs: Any) -> None:
        """Remember where a potential leader listens (addresses naming another peer and
        malformed ones are ignored: they come from other peers' records)."""
        good = []
        if peer_id == self.peer.peer_id:
            return
        for text in maddrs if isinstance(maddrs, list | tuple) else ():
            try:
                address = Multiaddr.parse(text)
            except (ValidationError, ValueError, TypeError):
                continue
            if address.peer_id in (None, peer_id):
                good.append(text)
                self.peer.add_addresses(peer_id, [address])
        if good:
            self._maddrs_of[peer_id] = tuple(good[:MAX_MADDRS])

    def _take_suggestion(self, answer: Rejected | Disbanded) -> PeerID | None:
        suggested = answer.suggested_leader
        if suggested is not None:
            self._learn_maddrs(suggested, answer.suggested_maddrs)
        return suggested

    def _may_follow(self, s: _Search, d: Declaration) -> bool:
        return self.rules.may_follow(
            d, my_ready_by=s.ready_by, now=self._dht_time(), banned=self.is_banned(d.peer_id)
        )

    async def _bounded(self, coro: Any, s: _Search) -> Any:
        """A DHT call bounded by request_timeout and the search deadline; None on failure."""
        loop = asyncio.get_running_loop()
        limit = min(s.deadline, loop.time() + 2 * self.request_timeout)
        try:
            async with asyncio.timeout_at(limit):
                return await coro
        except (TimeoutError, SwarmgradError, OSError) as e:
            logger.debug("%s: DHT call for %s failed: %r", self.peer.peer_id, s.key, e)
            return None

    def _begin(self, s: _Search) -> GroupInfo | None:
        """Our time has come (or the group is full): assemble it, or disband if too small.
        Synchronous, so nothing can join or leave halfway through."""
        if not self.rules.enough_to_begin(len(s.followers) + 1):
            if s.followers:
                logger.debug(
                    "%s: disbanding a group of %d (< min_group_size=%d)",
                    self.peer.peer_id,
                    len(s.followers) + 1,
                    self.min_group_size,
                )
            self._release_followers(
                s, Disbanded(f"the group was smaller than min_group_size={self.min_group_size}")
            )
            return None
        members = [(self.peer.peer_id, s.data)]
        members += [(f.peer_id, f.gather) for f in s.followers.values()]
        self._rng.shuffle(members)
        group_id = self._rng.randbytes(20)
        info = GroupInfo(group_id, tuple(p for p, _ in members), tuple(g for _, g in members))
        s.assembled = True
        self._release_followers(s, Begin(group_id, info.peer_ids, info.gathered))
        return info

    def _release_followers(self, s: _Search, message: Begin | Disbanded) -> None:
        for follower in s.followers.values():
            if not follower.outcome.done():
                follower.outcome.set_result(message)
        s.followers.clear()

    # ------------------------------------------------------------------ follower side

    async def _follow_hint(
        self, s: _Search, leader: PeerID, scheduled_time: float | None
    ) -> GroupInfo | None:
        """Join the hinted ``leader`` directly, waiting at it until its search starts (at
        most until we would have begun a group ourselves, plus request_timeout). None:
        it did not take us; the caller falls back to the DHT."""
        loop = asyncio.get_running_loop()
        left = s.deadline - loop.time()
        if scheduled_time is None:  # when we would have begun a group of our own
            begin_in = self.min_matchmaking_time
        else:
            begin_in = scheduled_time - self._dht_time()
        hold = self.rules.hint_hold(left, begin_in)
        # Our ready_by only has to order us after the leader: we do not lead meanwhile.
        s.ready_by = self._dht_time() + left
        try:
            outcome = await self._try_leader(s, leader, hold=hold)
        finally:
            s.ready_by = -math.inf
        if isinstance(outcome, GroupInfo):
            return outcome
        logger.debug("%s: hinted leader %s did not take us; searching the DHT",
                     self.peer.peer_id, leader)  # fmt: skip
        return None

    async def _try_leader(
        self, s: _Search, leader: PeerID, hold: float = 0.0
    ) -> GroupInfo | PeerID | None:
        """Ask ``leader`` to take us; a GroupInfo if its group began with us, a PeerID to
        try next if it suggested one, None otherwise. ``hold``: seconds the leader may keep
        the request until its own search starts."""
        loop = asyncio.get_running_loop()
        request = JoinRequest(
            self.prefix,
            s.key,
            s.ready_by,
            self.client_mode,
            s.data,
            float(hold) if hold > 0 else None,
        )
        total = max(s.deadline - loop.time(), 0.0) + self.request_timeout
        responses = self.peer.iterate(leader, JOIN_GROUP, request.encode(), timeout=total)
        try:
            async with asyncio.timeout(min(self.request_timeout + hold, total)):
                first = decode_answer(
                    await anext(responses), max_gather_bytes=self.max_gather_bytes
                )
            if isinstance(first, Rejected):
                logger.debug("%s: %s refused: %s", self.peer.peer_id, leader, first.message)
                return self._take_suggestion(first)
            if not isinstance(first, Accepted):
                raise ProtocolViolation(f"{leader} sent {first!r:.80} instead of an answer")
            s.leader = leader
            # We follow now: our own followers go to our leader instead.
            self._release_followers(
                s,
                Disbanded(f"{self.peer.peer_id} follows", leader, self._maddrs_of.get(leader, ())),
            )
            wait_until = self._local_time_of(first.ready_by) + 2 * self.request_timeout
            async with asyncio.timeout_at(min(wait_until, s.deadline)):
                second = decode_answer(
                    await anext(responses), max_gather_bytes=self.max_gather_bytes
                )
            if isinstance(second, Begin):
                group = self.rules.check_group(second, leader, s.data)
                s.joined = leader
                return group
            if isinstance(second, Disbanded):
                logger.debug("%s: %s disbanded: %s", self.peer.peer_id, leader, second.message)
                return self._take_suggestion(second)
            raise ProtocolViolation(f"{leader} sent {second!r:.80} instead of the group")
        except (TimeoutError, StopAsyncIteration, SwarmgradError, OSError) as e:
            logger.debug("%s: joining %s failed: %r", self.peer.peer_id, leader, e)
            return None
        finally:
            s.leader = None
            await responses.aclose()

    # ------------------------------------------------------------------ leader side

    def _leader_view(self) -> LeaderView | None:
        """Our search as a join request sees it; None while we are not looking."""
        s = self._search
        if s is None or self._closed or s.assembled:
            return None
        following = s.leader
        maddrs = self._maddrs_of.get(following, ()) if following is not None else ()
        return LeaderView(s.key, s.ready_by, frozenset(s.followers), following, maddrs)

    async def _wait_for_search(self, request: JoinRequest) -> None:
        """A join request that asks to be held (``hold``: seconds) waits here, bounded,
        while we are not looking yet: its sender knows we will lead."""
        hold = self.rules.hold(
            request, looking=self._search is not None, closed=self._closed, held=self._held
        )
        if hold <= 0:
            return
        self._held += 1
        try:
            async with asyncio.timeout(hold):
                await self._looking.wait()
        except TimeoutError:
            pass
        finally:
            self._held -= 1

    async def _serve_join(self, raw: Any, context: RPCContext) -> AsyncIterator[Answer]:
        remote = context.remote_id
        try:
            request = decode_join_request(raw)
        except ProtocolViolation as e:
            yield Rejected(Rejection.BAD_REQUEST, str(e))
            return
        await self._wait_for_search(request)
        s, view = self._search, self._leader_view()
        rejection = self.rules.judge_join(
            request, remote, view, now=self._dht_time(), banned=self.is_banned(remote)
        )
        if rejection is not None:
            yield rejection
            return
        assert s is not None
        follower = _Follower(remote, request.gather, asyncio.get_running_loop().create_future())
        s.followers[remote] = follower
        if len(s.followers) + 1 >= s.full_at:
            s.wakeup.set()
        try:
            yield Accepted(s.ready_by)
            # The search loop resolves the outcome by our ready_by (it may be held up by
            # one pending request of its own); past that, something is wrong: let go.
            limit = self._local_time_of(s.ready_by) + 2 * self.request_timeout
            try:
                async with asyncio.timeout_at(limit):
                    outcome = await asyncio.shield(follower.outcome)
            except TimeoutError:
                outcome = Disbanded("the leader did not begin in time")
            yield outcome
        finally:
            if s.followers.get(remote) is follower:  # the follower left before the group began
                del s.followers[remote]
