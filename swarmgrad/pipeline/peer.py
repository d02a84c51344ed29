"""``StagePeer``: what one peer of a pipeline swarm runs.

It serves a stage (:class:`~swarmgrad.pipeline.server.StageServer`), averages it with the
stage's other peers (:class:`~swarmgrad.pipeline.training.StageAverager`), and, when
rebalancing is on, checks every ``interval`` seconds whether it is the peer that should
move to the bottleneck stage (:mod:`swarmgrad.pipeline.rebalance`). Moving: build the new
stage's module, download its parameters and optimizer state from that stage's peers,
switch the server to it (the old stage's record is withdrawn), and average with the new
stage's peers from then on.

The stage modules come from ``make_backend(stage)``, a function returning a fresh
:class:`~swarmgrad.moe.server.ModuleBackend` for any stage, so a peer can serve any.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.moe.server import ModuleBackend
from swarmgrad.net.identity import PeerID
from swarmgrad.pipeline import protocol
from swarmgrad.pipeline.protocol import StageRecord
from swarmgrad.pipeline.rebalance import Move, RebalanceOptions, Rebalancer, plan_move
from swarmgrad.pipeline.server import StageServer, StageServerOptions
from swarmgrad.pipeline.training import StageAverager, StageTrainingOptions
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["StagePeer", "StagePeerOptions", "read_stage_loads"]

logger = logging.getLogger(__name__)

_RELEASED = ""  # the value of a move claim its peer gave up


@dataclass(frozen=True)
class StagePeerOptions:
    """The peer's parts' options; ``rebalance=None`` keeps the peer on its stage,
    ``training=None`` never averages (a lone server, or inference)."""

    server: StageServerOptions = field(default_factory=StageServerOptions)
    training: StageTrainingOptions | None = field(default_factory=StageTrainingOptions)
    rebalance: RebalanceOptions | None = None
    load_state: bool = True  # download the stage's state from its peers when joining


async def read_stage_loads(node: Any, pipeline: str, num_stages: int) -> list[dict[PeerID, float]]:
    """Per stage, ``{server: throughput}`` from the DHT records (the caller included)."""
    keys = [protocol.stage_key(pipeline, i) for i in range(num_stages)]
    found = await node.get_many(keys, latest=True)
    loads: list[dict[PeerID, float]] = []
    for key in keys:
        record = found.get(key)
        stage: dict[PeerID, float] = {}
        if record is not None and isinstance(record.value, dict):
            for subkey, entry in record.value.items():
                try:
                    stage[PeerID.from_base58(subkey)] = StageRecord.decode(entry.value).throughput
                except Exception:
                    continue  # malformed records do not count
        loads.append(stage)
    return loads


class StagePeer:
    """Serves stage ``stage`` of ``num_stages`` of ``pipeline`` through ``dht``."""

    def __init__(
        self,
        dht: Any,
        pipeline: str,
        num_stages: int,
        stage: int,
        make_backend: Callable[[int], ModuleBackend],
        options: StagePeerOptions | None = None,
    ):
        self.options = options or StagePeerOptions()
        if not isinstance(self.options, StagePeerOptions):
            raise ValidationError("options must be StagePeerOptions")
        if not callable(make_backend):
            raise ValidationError("make_backend must be a function of the stage index")
        self.dht, self.pipeline, self.num_stages = dht, pipeline, num_stages
        self.make_backend = make_backend
        self.server = StageServer(
            dht, pipeline, stage, num_stages, make_backend(stage), self.options.server
        )
        self.averager: StageAverager | None = None
        self.rebalancer = (
            Rebalancer(dht.peer_id, self.options.rebalance) if self.options.rebalance else None
        )
        self.moves: list[Move] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stage(self) -> int:
        return self.server.stage

    def start(self, background: bool = True) -> None:
        """Serve (after taking the stage's state from its peers, if it has any) and
        average; with ``background=False`` rebalancing happens only when the caller
        calls :meth:`check_rebalance`."""
        self.averager = self._join(self.server.stage, self.server.backend)
        self.server.start()
        if self.rebalancer is not None and background:
            self._thread = threading.Thread(target=self._run, name="stage-rebalancer", daemon=True)
            self._thread.start()

    def _join(self, stage: int, backend: ModuleBackend) -> StageAverager | None:
        if self.options.training is None:
            return None
        averager = StageAverager(self.dht, self.pipeline, stage, backend, self.options.training)
        if self.options.load_state and self._stage_has_other_peers(stage):
            loaded = averager.load_state_from_peers()
            logger.info("stage %d: %s", stage, "state loaded" if loaded else "no peer had state")
        averager.start()
        return averager

    def _stage_has_other_peers(self, stage: int) -> bool:
        """Whether someone else serves ``stage``: the first peer of a stage has nobody
        to download from and should not wait for the state timeout."""
        loads = self.dht.run_coroutine(
            lambda _dht, node: read_stage_loads(node, self.pipeline, self.num_stages)
        )
        return any(peer != self.dht.peer_id for peer in loads[stage])

    # ------------------------------------------------------------------ rebalancing

    def check_rebalance(self, now: float | None = None) -> Move | None:
        """One look at the stages' records; moves this peer and returns the move if a
        check is due (or a stage lost a peer) and the plan names this peer."""
        now = time.monotonic() if now is None else now
        if self.rebalancer is None:
            return None
        loads = self.dht.run_coroutine(
            lambda _dht, node: read_stage_loads(node, self.pipeline, self.num_stages)
        )
        me = self.dht.peer_id
        if me not in loads[self.stage]:  # our record has not landed yet: we'd misjudge
            return None
        move = self.rebalancer.decide(now, loads)
        if move is not None and move.from_stage == self.stage:
            # Peers read the DHT at different moments: two of one stage could each see
            # themselves as the one to move. Only the peer whose claim on its stage
            # holds in the DHT moves, and only if fresh records still name it.
            if not self._claim_move(move.from_stage):
                logger.info("rebalancing: another peer of stage %d is moving", move.from_stage)
                return None
            fresh = self.dht.run_coroutine(
                lambda _dht, node: read_stage_loads(node, self.pipeline, self.num_stages)
            )
            options = self.rebalancer.options
            again = plan_move(fresh, options.hysteresis, options.tie_tolerance)
            if again is None or (again.peer, again.from_stage, again.to_stage) != (
                move.peer,
                move.from_stage,
                move.to_stage,
            ):
                logger.info("rebalancing: the planned move changed on fresh records; staying")
                self._release_move(move.from_stage)
                return None
            self.move_to(move.to_stage)
            self.rebalancer.moved(time.monotonic())
            self.moves.append(move)
            return move
        return None

    def _claim_move(self, stage: int) -> bool:
        """Claim the right to leave ``stage`` for a while: a DHT record under
        ``"<pipeline>.moving.<stage>"``; when several peers claim at once, the record
        with the latest expiration wins, and each reads back whether it is its own."""
        key, me = f"{self.pipeline}.moving.{stage}", self.dht.peer_id.to_base58()
        hold = max(30.0, 2 * self.rebalancer.options.interval)
        expiration = get_dht_time() + hold + random.uniform(0.0, 1.0)  # ties are unlikely

        async def claim(_dht: Any, node: Any) -> bool:
            current = await node.get(key, latest=True)
            if current is not None and current.value not in (me, _RELEASED):
                return False  # someone else's claim still holds
            # a released claim is overwritten by a later expiration (the latest one wins)
            floor = -math.inf if current is None else current.expiration_time + 1e-3
            await node.store(key, me, max(expiration, floor))
            await asyncio.sleep(0.5)  # let concurrent claims land, then see who won
            found = await node.get(key, latest=True)
            return found is not None and found.value == me

        return bool(self.dht.run_coroutine(claim))

    def _release_move(self, stage: int) -> None:
        """Give up our claim on ``stage`` when we decide to stay after all: a claim that
        outlived its decision would stop every other peer of the stage from moving for
        the claim's whole hold time."""
        key, me = f"{self.pipeline}.moving.{stage}", self.dht.peer_id.to_base58()

        async def release(_dht: Any, node: Any) -> None:
            current = await node.get(key, latest=True)
            if current is not None and current.value == me:
                await node.store(key, _RELEASED, current.expiration_time + 1e-3)

        self.dht.run_coroutine(release)

    def move_to(self, stage: int) -> None:
        """Serve ``stage`` from now on, with its state taken from its peers."""
        backend = self.make_backend(stage)
        old_averager = self.averager
        self.averager = self._join(stage, backend)
        self.dht.run_coroutine(lambda _dht, _node: self.server.switch_stage(stage, backend))
        if old_averager is not None:
            old_averager.shutdown()

    def _run(self) -> None:
        options = self.options.rebalance
        while not self._stop.wait(min(options.interval, options.look_period)):
            try:
                self.check_rebalance()
            except Exception as e:
                logger.warning("rebalancing check failed: %r", e)

    def shutdown(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(60)
        if self.averager is not None:
            self.averager.shutdown()
        self.server.shutdown()
