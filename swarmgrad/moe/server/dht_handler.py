"""Keeping a server's experts visible in the DHT: declare, refresh, withdraw.

Records expire on their own (``expiration`` seconds after each declaration), so a server
that dies silently disappears from the swarm; a live one re-declares every
``update_period`` seconds, well before expiry. On shutdown it writes tombstones so that
clients stop choosing its experts at once instead of after the expiration.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

from swarmgrad.dht.node import DHTNode
from swarmgrad.moe.dht_records import (
    declare_experts_on_node,
    get_experts_info_on_node,
    withdraw_experts_on_node,
)
from swarmgrad.moe.expert_uid import ExpertUID
from swarmgrad.moe.server.expert_pattern import (
    ExpertPattern,
    generate_uids_from_pattern,
    parse_expert_pattern,
    pattern_text,
)
from swarmgrad.utils.checks import positive_seconds
from swarmgrad.utils.errors import SwarmgradError, ValidationError

__all__ = ["ExpertDeclarer", "default_expiration", "generate_free_uids"]

logger = logging.getLogger(__name__)


def default_expiration(update_period: float) -> float:
    """How long a declaration lives: two refresh periods, and at least a minute."""
    return max(2.0 * update_period, 60.0)


class ExpertDeclarer:
    """Declares ``uids`` on ``node`` now and every ``update_period`` seconds after
    :meth:`start`, until :meth:`stop` (which withdraws them). Runs on the node's loop;
    the refresh task belongs to this object and is cancelled and awaited by stop()."""

    def __init__(
        self,
        node: DHTNode,
        uids: Sequence[ExpertUID],
        update_period: float = 30.0,
        expiration: float | None = None,
    ):
        positive_seconds("update_period", update_period)
        self.node = node
        self.uids = list(uids)
        self.update_period = update_period
        self.expiration = default_expiration(update_period) if expiration is None else expiration
        if self.expiration <= update_period:
            logger.warning(
                "expert records expire after %.1f s but are refreshed every %.1f s: experts "
                "will be invisible between expiry and refresh",
                self.expiration, update_period,
            )  # fmt: skip
        self.last_expiration: float | None = None
        self.declarations = 0  # successful declaration rounds
        self._task: asyncio.Task | None = None
        self._stopped = False

    async def declare_once(self) -> dict[ExpertUID, bool]:
        """One declaration round (bounded by update_period); failures are logged."""
        expiration_time = self.node.time_fn() + self.expiration
        try:
            async with asyncio.timeout(max(self.update_period, 5.0)):
                stored = await declare_experts_on_node(self.node, self.uids, expiration_time)
        except (SwarmgradError, TimeoutError, OSError) as e:
            logger.warning("could not declare %d experts in the DHT: %r", len(self.uids), e)
            return {}
        self.last_expiration = expiration_time
        self.declarations += 1
        missing = [uid for uid, ok in stored.items() if not ok]
        if missing:
            logger.warning(
                "%d of %d experts were stored on no DHT node (is this peer alone?), e.g. %s",
                len(missing), len(self.uids), missing[:3],
            )  # fmt: skip
        else:
            logger.debug("declared %d experts until %.0f", len(self.uids), expiration_time)
        return stored

    async def start(self, declare_now: bool = True) -> None:
        """Declare once (when ``declare_now``), then keep refreshing in the background."""
        if self._task is not None or self._stopped:
            raise ValidationError("this declarer is already running or was stopped")
        if declare_now:
            await self.declare_once()
        if not self._stopped:  # stop() may have run while the first declaration was awaited
            self._task = asyncio.ensure_future(self._refresh(wait_first=declare_now))

    async def _refresh(self, wait_first: bool) -> None:
        if not wait_first:
            await self.declare_once()
        while True:
            await asyncio.sleep(self.update_period)
            await self.declare_once()

    async def stop(self, withdraw: bool = True, timeout: float = 10.0) -> None:
        """Stop refreshing and, with ``withdraw``, delete the records (bounded by timeout)."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # we were cancelled ourselves
                    raise
        if not withdraw or not self.uids:
            return
        # the tombstones must outlive every declaration they delete
        expiration_time = self.node.time_fn() + self.expiration
        if self.last_expiration is not None:
            expiration_time = max(expiration_time, self.last_expiration + 1.0)
        try:
            async with asyncio.timeout(timeout):
                await withdraw_experts_on_node(self.node, self.uids, expiration_time)
        except (SwarmgradError, TimeoutError, OSError) as e:
            logger.warning(
                "could not withdraw %d experts from the DHT (they expire on their own): %r",
                len(self.uids), e,
            )  # fmt: skip


async def generate_free_uids(
    node: DHTNode,
    num_experts: int,
    expert_pattern: str | ExpertPattern,
    *,
    attempts: int = 4,
    rng: random.Random | None = None,
) -> list[ExpertUID]:
    """``num_experts`` distinct uids from the pattern, preferring ones no server declared
    yet. When the grid is too crowded to find enough free ones in ``attempts`` rounds, the
    rest are taken uids (several servers may host one uid); a warning says so."""
    pattern = (
        expert_pattern
        if isinstance(expert_pattern, ExpertPattern)
        else parse_expert_pattern(expert_pattern)
    )
    rng = rng or random.Random()
    chosen: list[ExpertUID] = []
    taken: set[ExpertUID] = set()
    for _ in range(attempts):
        needed = num_experts - len(chosen)
        if needed <= 0:
            break
        try:
            candidates = generate_uids_from_pattern(
                needed, pattern, exclude=taken | set(chosen), rng=rng
            )
        except ValidationError:
            break  # not enough untried uids left
        try:
            infos = await get_experts_info_on_node(node, candidates)
        except (SwarmgradError, OSError) as e:
            logger.warning("could not check which experts already exist: %r", e)
            infos = [None] * len(candidates)
        for uid, info in zip(candidates, infos, strict=True):
            if info is None:
                chosen.append(uid)
            else:
                taken.add(uid)
    if len(chosen) < num_experts:
        extra = generate_uids_from_pattern(
            num_experts - len(chosen), pattern, exclude=set(chosen), rng=rng
        )
        logger.warning(
            "pattern %r: only %d free uids found; %d experts share a uid with other servers",
            pattern_text(pattern), len(chosen), len(extra),
        )  # fmt: skip
        chosen.extend(extra)
    return chosen
