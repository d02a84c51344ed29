"""``RemotePipeline``: a model whose stages run on swarms of stage servers.

A trainer calls it like a local module. Each call is one micro-batch; it goes through
one server per stage, chosen afresh for every micro-batch by the stage's
:class:`~swarmgrad.pipeline.routing.StageRouter` (stochastic wiring), and autograd sends
the backward pass back through the same servers, last stage first.

Faults are handled per hop, never by failing the micro-batch while time remains:

- a server that is unreachable, refuses, or misses the hop's adaptive deadline is
  banned for a while and the hop is retried on another server of the stage. Its late
  answer, if any, is dropped by the RPC layer: each hop's result is applied once;
- a server whose activations (or input gradients) have the wrong shape or dtype is
  refused with an error naming them, blamed (a long ban) and the hop retried elsewhere;
- a backward hop whose forward server is gone goes to another server of the stage,
  which recomputes the forward from the same inputs;
- a stage with no servers: the call waits, logging what it waits for, and fails with
  :class:`~swarmgrad.utils.errors.DeadlineExceeded` after ``options.timeout``.

Activations and their gradients travel 8-bit compressed with
``options.compression="uniform_8bit"`` (any codec of :mod:`swarmgrad.compression`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from swarmgrad.compression.serialized import CompressionType
from swarmgrad.net.identity import PeerID
from swarmgrad.pipeline import protocol
from swarmgrad.pipeline.protocol import (
    BackwardAnswer,
    BackwardRequest,
    ForwardAnswer,
    ForwardRequest,
    InfoRequest,
    StageInfo,
    StageRecord,
    check_outputs,
)
from swarmgrad.pipeline.routing import RoutingOptions, ServerLoad, StageRouter
from swarmgrad.utils.checks import positive_int, positive_seconds
from swarmgrad.utils.errors import (
    DeadlineExceeded,
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)
from swarmgrad.utils.loop_thread import run_coroutine

__all__ = ["PipelineCaller", "PipelineOptions", "RemotePipeline"]

logger = logging.getLogger(__name__)

DUMMY = torch.empty(0, requires_grad=True)  # makes autograd call backward in any case


@dataclass(frozen=True)
class PipelineOptions:
    """``timeout``: seconds one hop may take, retries and waiting for servers included;
    ``refresh_period``: seconds between reads of a stage's servers from the DHT;
    ``compression``: the codec of activations and their gradients;
    ``max_attempts``: servers tried per hop before the micro-batch is dropped."""

    timeout: float = 300.0
    refresh_period: float = 5.0
    compression: CompressionType | str = CompressionType.NONE
    max_attempts: int = 16
    routing: RoutingOptions = field(default_factory=RoutingOptions)

    def __post_init__(self) -> None:
        positive_seconds("timeout", self.timeout)
        positive_seconds("refresh_period", self.refresh_period)
        positive_int("max_attempts", self.max_attempts)
        try:
            object.__setattr__(self, "compression", CompressionType(self.compression))
        except ValueError:
            raise ValidationError(
                f"unknown compression {self.compression!r}; expected one of "
                f"{[c.value for c in CompressionType]}"
            ) from None
        if not isinstance(self.routing, RoutingOptions):
            raise ValidationError("routing must be RoutingOptions")


class _Retry(Exception):
    """This server failed the hop; try another."""


class PipelineCaller:
    """The async core of :class:`RemotePipeline` (use on the peer's event loop)."""

    def __init__(
        self,
        dht: Any,
        pipeline: str,
        num_stages: int,
        options: PipelineOptions | None = None,
        *,
        rng: random.Random | None = None,
    ):
        protocol.check_pipeline_name(pipeline)
        positive_int("num_stages", num_stages)
        self.options = options or PipelineOptions()
        if not isinstance(self.options, PipelineOptions):
            raise ValidationError("options must be PipelineOptions")
        self.dht, self.pipeline, self.num_stages = dht, pipeline, num_stages
        rng = rng or random.Random()
        self.routers = [
            StageRouter(self.options.routing, random.Random(rng.random()))
            for _ in range(num_stages)
        ]
        self.infos: list[StageInfo | None] = [None] * num_stages
        self.stats: Counter[str] = Counter()
        # the server of each stage's latest forward hop (for logs, demos and tests)
        self.last_route: list[PeerID | None] = [None] * num_stages
        self._servers: list[dict[PeerID, StageRecord]] = [{} for _ in range(num_stages)]
        self._read_at = [-float("inf")] * num_stages

    @property
    def peer(self) -> Any:
        return self.dht.peer

    # ------------------------------------------------------------------ servers

    async def refresh(self, stage: int) -> dict[PeerID, StageRecord]:
        """Read the stage's servers from the DHT now."""
        found = await self.dht.node.get(protocol.stage_key(self.pipeline, stage), latest=True)
        servers: dict[PeerID, StageRecord] = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                try:
                    peer_id = PeerID.from_base58(subkey)
                    record = StageRecord.decode(entry.value)
                except Exception as e:  # a malformed record from a buggy or hostile peer
                    logger.debug("skipping a stage record under %r: %r", subkey, e)
                    continue
                if peer_id == self.peer.peer_id:
                    continue  # a peer cannot call itself
                for maddr in record.maddrs:
                    try:
                        self.peer.add_addresses(peer_id, [maddr])
                    except ValidationError:
                        pass
                servers[peer_id] = record
        self._servers[stage] = servers
        self._read_at[stage] = asyncio.get_running_loop().time()
        self.routers[stage].forget(servers)
        return servers

    async def servers(self, stage: int, deadline: float) -> dict[PeerID, StageRecord]:
        """The stage's servers, re-read when stale; waits (until ``deadline``, loop time)
        while the stage has none."""
        loop = asyncio.get_running_loop()
        warned = False
        while True:
            if (
                loop.time() - self._read_at[stage] >= self.options.refresh_period
                or not (self._servers[stage])
            ):
                await self.refresh(stage)
            if self._servers[stage]:
                return self._servers[stage]
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.stats["no_servers"] += 1
                raise DeadlineExceeded(
                    f"pipeline {self.pipeline!r}: stage {stage} has no servers in the DHT; "
                    f"gave up after waiting {self.options.timeout:g} s (options.timeout)"
                )
            if not warned:
                logger.warning(
                    "pipeline %r: stage %d has no servers; waiting up to %.0f s for one",
                    self.pipeline, stage, remaining,
                )  # fmt: skip
                warned = True
            await asyncio.sleep(min(remaining, max(0.2, self.options.refresh_period / 5)))

    async def stage_info(self, stage: int, server: PeerID, timeout: float) -> StageInfo:
        if self.infos[stage] is None:
            reply = await self.peer.call(
                server, protocol.INFO, InfoRequest(self.pipeline, stage).encode(), timeout=timeout
            )
            info = StageInfo.decode(reply)
            if info.stage != stage or info.num_stages != self.num_stages:
                raise ProtocolViolation(
                    f"server {server} describes stage {info.stage} of {info.num_stages}, but "
                    f"stage {stage} of {self.num_stages} was asked for"
                )
            self.infos[stage] = info
        return self.infos[stage]

    # ------------------------------------------------------------------ hops

    async def forward(
        self, stage: int, inputs: Sequence[torch.Tensor]
    ) -> tuple[tuple[torch.Tensor, ...], PeerID]:
        """The stage's outputs for ``inputs`` and the server that computed them."""
        batch_size = inputs[0].shape[0]

        async def attempt(server: PeerID, timeout: float) -> tuple[torch.Tensor, ...]:
            info = await self.stage_info(stage, server, timeout)
            protocol.check_batch(inputs, info.args_schema, self._what("inputs", stage))
            if batch_size > info.max_batch_size:  # every server of the stage would refuse it
                raise ValidationError(
                    f"{self._what('a micro-batch', stage)} has {batch_size} samples, more than "
                    f"the stage's max_batch_size of {info.max_batch_size}; send smaller ones"
                )
            request = ForwardRequest(self.pipeline, stage, tuple(inputs), self.options.compression)
            reply = await self.peer.call(
                server, protocol.FORWARD, request.encode(), timeout=timeout
            )
            outputs = ForwardAnswer.decode(reply).outputs
            what = f"outputs of stage {stage} from server {server}"
            check_outputs(outputs, info.outputs_schema, batch_size, what)
            return outputs

        outputs, server = await self._hop(stage, "forward", attempt, batch_size)
        self.last_route[stage] = server
        return outputs, server

    async def backward(
        self,
        stage: int,
        server: PeerID | None,
        inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """Input gradients of the stage; ``server`` (the forward's) is tried first."""
        batch_size = inputs[0].shape[0]

        async def attempt(peer_id: PeerID, timeout: float) -> tuple[torch.Tensor, ...]:
            request = BackwardRequest(
                self.pipeline, stage, tuple(inputs), tuple(grad_outputs), self.options.compression
            )
            reply = await self.peer.call(
                peer_id, protocol.BACKWARD, request.encode(), timeout=timeout
            )
            grads = BackwardAnswer.decode(reply).grad_inputs
            if len(grads) != len(inputs):
                raise ProtocolViolation(
                    f"server {peer_id} returned {len(grads)} input gradients for stage {stage}, "
                    f"expected {len(inputs)}"
                )
            for i, (grad, x) in enumerate(zip(grads, inputs, strict=True)):
                if grad.shape != x.shape or grad.dtype != x.dtype:
                    raise ProtocolViolation(
                        f"grad_inputs[{i}] of stage {stage} from server {peer_id}: expected "
                        f"shape {list(x.shape)} and dtype {x.dtype}, got {list(grad.shape)} "
                        f"and {grad.dtype}"
                    )
            return grads

        grads, _ = await self._hop(stage, "backward", attempt, batch_size, first=server)
        return grads

    async def _hop(self, stage: int, kind: str, attempt: Any, batch_size: int, first=None):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.timeout
        router = self.routers[stage]
        tried: set[PeerID] = set()
        errors: list[str] = []
        late_tries = 0
        for _ in range(self.options.max_attempts):
            servers = await self.servers(stage, deadline)
            now = loop.time()
            if first is not None and first in servers and not router.is_banned(first, now):
                server, first = first, None
            else:
                first = None
                loads = [ServerLoad(p, r.throughput, r.queue) for p, r in servers.items()]
                server = router.choose(loads, now, batch_size=batch_size, exclude=tried)
                if server is None:  # every server was tried once: try them again
                    tried.clear()
                    server = router.choose(loads, now, batch_size=batch_size)
            tried.add(server)
            remaining = deadline - now
            if remaining <= 0:
                break
            hop_timeout = min(router.hop_deadline(late_tries), remaining)
            started = loop.time()
            try:
                result = await attempt(server, hop_timeout)
            except DeadlineExceeded:
                router.report_failure(server, loop.time())
                self.stats["late"] += 1
                late_tries += 1
                errors.append(f"{server}: no answer within {hop_timeout:.3g} s")
                logger.info(
                    "stage %d %s: server %s missed the %.3g s deadline; retrying elsewhere",
                    stage, kind, server, hop_timeout,
                )  # fmt: skip
                continue
            except ProtocolViolation as e:
                router.blame(server, loop.time())
                self.stats["blamed"] += 1
                errors.append(f"{server}: {e}")
                logger.warning("stage %d %s: refused the answer of %s: %s", stage, kind, server, e)
                continue
            except (OSError, SwarmgradError) as e:  # a handshake, a remote error, a dropped link
                if isinstance(e, ValidationError) and not isinstance(e, RemoteError):
                    raise  # our own request is wrong: every server would refuse it
                router.report_failure(server, loop.time())
                self.stats["failed"] += 1
                errors.append(f"{server}: {type(e).__name__}: {e}")
                logger.info("stage %d %s: server %s failed: %r", stage, kind, server, e)
                continue
            router.report_success(server, loop.time() - started, loop.time())
            self.stats[f"{kind}_hops"] += 1
            if errors:
                self.stats["retried_hops"] += 1
            return result, server
        self.stats["dropped"] += 1
        raise DeadlineExceeded(
            f"pipeline {self.pipeline!r}: the {kind} hop of stage {stage} failed on every try "
            f"({len(errors)} tries): " + "; ".join(errors[-4:])
        )

    def _what(self, name: str, stage: int) -> str:
        return f"{name} of stage {stage} of pipeline {self.pipeline!r}"


class RemotePipeline(nn.Module):
    """Pipeline ``pipeline`` of ``num_stages`` stages served by stage servers, used as a
    local module: ``loss = criterion(pipeline(x), y); loss.backward()``.

    Stages take and return tensors with the batch first; a stage returning several
    tensors passes them all to the next stage. One output comes back as a tensor."""

    def __init__(
        self,
        dht: Any,
        pipeline: str,
        num_stages: int,
        options: PipelineOptions | None = None,
        *,
        rng: random.Random | None = None,
    ):
        super().__init__()
        self.caller = PipelineCaller(dht, pipeline, num_stages, options, rng=rng)

    @property
    def stats(self) -> Counter[str]:
        """Counters: hops done, retried hops, late answers dropped, blamed servers,
        dropped micro-batches."""
        return self.caller.stats

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
            raise ValidationError("RemotePipeline takes one or more tensors positionally")
        if inputs[0].ndim == 0 or inputs[0].shape[0] == 0:
            raise ValidationError(
                f"inputs[0] needs a non-empty batch dimension, got {list(inputs[0].shape)}"
            )
        self.caller.stats["micro_batches"] += 1
        outputs = tuple(inputs)
        for stage in range(self.caller.num_stages):
            outputs = _StageHop.apply(DUMMY, self.caller, stage, *outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def extra_repr(self) -> str:
        return f"pipeline={self.caller.pipeline!r}, num_stages={self.caller.num_stages}"


class _StageHop(torch.autograd.Function):
    """One stage: forward on a server now, backward on the same server later."""

    @staticmethod
    def forward(
        ctx, dummy: torch.Tensor, caller: PipelineCaller, stage: int, *inputs: torch.Tensor
    ):
        inputs = tuple(x.detach() for x in inputs)
        outputs, server = run_coroutine(caller.forward(stage, inputs))
        ctx.caller, ctx.stage, ctx.server = caller, stage, server
        ctx.save_for_backward(*inputs)
        device = inputs[0].device
        outputs = tuple(t.to(device) for t in outputs)
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        inputs = ctx.saved_tensors
        info = ctx.caller.infos[ctx.stage]
        grads_out = tuple(
            g if g is not None else d.make_zeros(inputs[0].shape[0])
            for g, d in zip(grad_outputs, info.outputs_schema, strict=True)
        )
        grads = run_coroutine(ctx.caller.backward(ctx.stage, ctx.server, inputs, grads_out))
        needs = ctx.needs_input_grad[3:]
        pairs = zip(grads, inputs, needs, strict=True)
        return (None, None, None, *(g.to(x.device) if need else None for g, x, need in pairs))
