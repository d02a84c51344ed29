"""Routes each incoming ``averaging.aggregate_part`` stream to the runner of the group
it names."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

from swarmgrad.averaging.allreduce.protocol import (
    HELLO_TIMEOUT,
    decode_hello_route,
    read_message,
    refuse,
)
from swarmgrad.averaging.allreduce.streams import within
from swarmgrad.averaging.allreduce.types import UnknownGroup
from swarmgrad.net.identity import PeerID
from swarmgrad.net.rpc import ServicerBase
from swarmgrad.utils.errors import SwarmgradError, ValidationError

if TYPE_CHECKING:
    from swarmgrad.averaging.allreduce.runner import AllReduceRunner
    from swarmgrad.net.mux import Stream

__all__ = ["AllReduceRouter"]

logger = logging.getLogger(__name__)

_FINISHED_GROUPS_REMEMBERED = 1024


class AllReduceRouter(ServicerBase):
    """Serves ``averaging.aggregate_part`` on one peer and hands each stream to the runner
    of the group it names. Created by :meth:`for_peer`, once per peer.

    An averager should call :meth:`for_peer` when it starts: a member whose round starts
    a little earlier than ours may then reach us before our runner exists, and its stream
    waits (``unknown_group_grace``) instead of being refused as an unknown protocol."""

    rpc_prefix = "averaging"  # rpc_aggregate_part serves "averaging.aggregate_part"

    def __init__(self, *, unknown_group_grace: float = 5.0):
        self.unknown_group_grace = unknown_group_grace
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._waiters: dict[bytes, list[asyncio.Future]] = collections.defaultdict(list)
        self._finished: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    @classmethod
    def for_peer(cls, peer: Any) -> AllReduceRouter:
        """The peer's router (one per peer), serving the protocol from the first call."""
        return peer.shared_servicer(cls)

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

    async def rpc_aggregate_part(self, stream: Stream) -> None:
        """Entry point of every incoming all-reduce stream; never raises."""
        remote = stream.remote_peer_id
        try:
            hello = await within(read_message(stream), HELLO_TIMEOUT, f"hello from {remote}")
            runner = await self._runner_for(decode_hello_route(hello, remote), remote)
        except (SwarmgradError, OSError, TimeoutError) as e:
            logger.debug("refused an all-reduce stream from %s: %s", remote, e)
            await refuse(stream, e)
            return
        try:
            await runner._serve_sender(stream, hello)
        except Exception:  # a bug here must not leave the stream or the task dangling
            logger.exception("all-reduce stream from %s failed", remote)
            stream.reset("internal error")
