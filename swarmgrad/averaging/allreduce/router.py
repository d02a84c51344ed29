"""Routes each incoming ``averaging.aggregate_part`` stream to the runner of the group
it names."""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from typing import TYPE_CHECKING, Any

from swarmgrad.averaging.allreduce.protocol import (
    AGGREGATE_PART,
    HELLO_TIMEOUT,
    PROTOCOL_VERSION,
    read_message,
    refuse,
)
from swarmgrad.averaging.allreduce.streams import within
from swarmgrad.averaging.allreduce.types import UnknownGroup
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ProtocolViolation, SwarmgradError, ValidationError

if TYPE_CHECKING:
    from swarmgrad.averaging.allreduce.runner import AllReduceRunner

__all__ = ["AllReduceRouter"]

logger = logging.getLogger(__name__)

_FINISHED_GROUPS_REMEMBERED = 1024


class AllReduceRouter:
    """Serves ``averaging.aggregate_part`` on one peer and hands each stream to the runner
    of the group it names. Created by :meth:`for_peer`, once per peer.

    An averager should call :meth:`for_peer` when it starts: a member whose round starts
    a little earlier than ours may then reach us before our runner exists, and its stream
    waits (``unknown_group_grace``) instead of being refused as an unknown protocol."""

    _by_peer: weakref.WeakKeyDictionary[Any, AllReduceRouter] = weakref.WeakKeyDictionary()

    def __init__(self, *, unknown_group_grace: float = 5.0):
        self.unknown_group_grace = unknown_group_grace
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._waiters: dict[bytes, list[asyncio.Future]] = collections.defaultdict(list)
        self._finished: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    @classmethod
    def for_peer(cls, peer: Any) -> AllReduceRouter:
        """The peer's router, registering the protocol on first use. (The router keeps no
        reference to the peer, so the weak map lets both be collected.)"""
        router = cls._by_peer.get(peer)
        if router is None:
            router = cls()
            peer.add_protocol_handler(AGGREGATE_PART, router._serve_stream)
            cls._by_peer[peer] = router
        return router

    def register(self, group_id: bytes, runner: AllReduceRunner) -> None:
        if group_id in self._runners or group_id in self._finished:
            raise ValidationError(f"group {group_id.hex()[:12]} already ran on this peer")
        self._runners[group_id] = runner
        for waiter in self._waiters.pop(group_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    def unregister(self, group_id: bytes) -> None:
        if self._runners.pop(group_id, None) is not None:
            self._finished[group_id] = None
            while len(self._finished) > _FINISHED_GROUPS_REMEMBERED:
                self._finished.popitem(last=False)

    async def _runner_for(self, group_id: bytes, caller: PeerID) -> AllReduceRunner:
        """Wait briefly for the group's runner: members start at slightly different times."""
        runner = self._runners.get(group_id)
        if runner is None and group_id not in self._finished:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[group_id].append(waiter)
            try:
                async with asyncio.timeout(self.unknown_group_grace):
                    await waiter
            except TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(group_id, [])
                if waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[group_id]
            runner = self._runners.get(group_id)
        if runner is None:
            state = "has finished" if group_id in self._finished else "is not running"
            raise UnknownGroup(
                f"{caller} sent parts for group {group_id.hex()[:12]}, which {state} here"
            )
        return runner

    async def _serve_stream(self, stream: Any) -> None:
        """Entry point of every incoming stream; never raises."""
        remote = stream.remote_peer_id
        try:
            hello = await within(read_message(stream), HELLO_TIMEOUT, f"hello from {remote}")
            if not isinstance(hello, dict) or not isinstance(hello.get("g"), bytes):
                raise ProtocolViolation(f"{remote} opened an all-reduce without a group id")
            if hello.get("v") != PROTOCOL_VERSION:
                raise ValidationError(
                    f"all-reduce protocol version {hello.get('v')!r} from {remote} is not "
                    f"supported (this peer speaks {PROTOCOL_VERSION})"
                )
            runner = await self._runner_for(hello["g"], remote)
        except (SwarmgradError, OSError, TimeoutError) as e:
            logger.debug("refused an all-reduce stream from %s: %s", remote, e)
            await refuse(stream, e)
            return
        try:
            await runner._serve_sender(stream, hello)
        except Exception:  # a bug here must not leave the stream or the task dangling
            logger.exception("all-reduce stream from %s failed", remote)
            stream.reset("internal error")
