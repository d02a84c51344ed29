"""A stage server: one peer serving one stage of a pipeline.

It reuses the expert server's runtime: the stage's module is a
:class:`~swarmgrad.moe.server.ModuleBackend` (forward without a graph, backward that
recomputes or takes the graph from the activation cache, then one optimizer step), whose
task pools batch concurrent micro-batches on one device thread (``Runtime``). On top it
adds what a pipeline needs:

- the ``pipeline.*`` RPCs (:class:`StageServicer`), which refuse requests meant for
  another pipeline or stage and inputs of the wrong shape or dtype, naming them;
- a small DHT record (:class:`~swarmgrad.pipeline.protocol.StageRecord`) with the
  measured throughput and the queue, refreshed every ``update_period`` seconds, well
  before it expires, and withdrawn at shutdown;
- :meth:`StageServer.switch_stage`, which rebalancing uses to serve another stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from swarmgrad.compression.base import all_finite
from swarmgrad.moe.protocol import check_batch
from swarmgrad.moe.server import ModuleBackend, Runtime
from swarmgrad.moe.server.activation_cache import ActivationCache
from swarmgrad.net.rpc import RPCContext, ServicerBase
from swarmgrad.pipeline import protocol
from swarmgrad.utils.checks import non_negative_int, positive_seconds
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["StageServer", "StageServerOptions", "StageServicer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageServerOptions:
    """``update_period``: seconds between DHT records; ``expiration``: a record's
    lifetime (default ``3 * update_period``, so two refreshes may fail before it lapses);
    ``activation_cache_bytes``: memory for forward graphs kept for their backward (0:
    always recompute); ``throughput_smoothing``: weight of the newest measurement."""

    update_period: float = 10.0
    expiration: float | None = None
    activation_cache_bytes: int = 256 * 1024 * 1024
    throughput_smoothing: float = 0.5

    def __post_init__(self) -> None:
        positive_seconds("update_period", self.update_period)
        if self.expiration is not None:
            positive_seconds("expiration", self.expiration)
            if self.expiration <= self.update_period:
                raise ValidationError(
                    f"expiration={self.expiration} must exceed update_period="
                    f"{self.update_period}, or records lapse between refreshes"
                )
        non_negative_int("activation_cache_bytes", self.activation_cache_bytes)
        if not 0 < self.throughput_smoothing <= 1:
            raise ValidationError(
                f"throughput_smoothing must be in (0, 1], got {self.throughput_smoothing!r}"
            )

    @property
    def record_lifetime(self) -> float:
        return self.expiration if self.expiration is not None else 3 * self.update_period


class StageServicer(ServicerBase):
    """The ``pipeline.*`` handlers of one stage server (on the peer's event loop)."""

    rpc_prefix = protocol.RPC_PREFIX

    def __init__(self, server: StageServer):
        self.server = server

    async def rpc_info(self, request: Any, context: RPCContext) -> dict[str, Any]:
        message = protocol.InfoRequest.decode(request)
        self.server.check_address(message.pipeline, message.stage)
        return self.server.stage_info().encode()

    async def rpc_forward(self, request: Any, context: RPCContext) -> dict[str, Any]:
        message = protocol.ForwardRequest.decode(request)
        backend = self.server.check_address(message.pipeline, message.stage)
        what = f"inputs of stage {message.stage} of pipeline {message.pipeline!r}"
        batch_size = _check_inputs(message.inputs, backend, what)
        outputs = await backend.forward_pool.submit_task(*message.inputs, size=batch_size)
        self.server.forward_requests += 1
        return await _encode(protocol.ForwardAnswer(tuple(outputs)), message.compression)

    async def rpc_backward(self, request: Any, context: RPCContext) -> dict[str, Any]:
        message = protocol.BackwardRequest.decode(request)
        backend = self.server.check_address(message.pipeline, message.stage)
        name = f"stage {message.stage} of pipeline {message.pipeline!r}"
        batch_size = _check_inputs(message.inputs, backend, f"inputs of {name}")
        check_batch(
            message.grad_outputs, backend.outputs_schema, f"grad_outputs of {name}", batch_size
        )
        # one caller's NaN or Inf would reach the shared weights through the step
        for what, tensors in (("inputs", message.inputs), ("grad_outputs", message.grad_outputs)):
            for i, tensor in enumerate(tensors):
                if tensor.is_floating_point() and not all_finite(tensor):
                    raise ValidationError(f"{what} of {name}[{i}]: holds NaN or Inf values")
        weight = batch_size if backend.gradient_sink is not None else 1
        grads = await backend.backward_pool.submit_task(
            *message.inputs, *_scaled(message.grad_outputs, weight), size=batch_size
        )
        grads = _scaled(grads, 1 / weight)
        self.server.backward_requests += 1
        return await _encode(protocol.BackwardAnswer(tuple(grads)), message.compression)


def _scaled(tensors: Any, factor: float) -> tuple:
    """A stage that accumulates gradients for its peers' averaging (``gradients`` mode:
    the backend has a ``gradient_sink``) weighs each micro-batch by its samples: its
    output gradients are multiplied by its size here, the one place that still knows
    where a micro-batch ends (the runtime may merge concurrent ones into one backward),
    and its input gradients divided back. Backward being linear in the output gradients,
    the parameters' gradient of a merged batch is then ``sum(n_i * g_i)`` over its
    micro-batches (``g_i`` the gradient of micro-batch i's mean loss), and the
    accumulated sum over the samples is the mean gradient per sample. Integer tensors
    are left alone."""
    if factor == 1:
        return tuple(tensors)
    return tuple(t * factor if t.is_floating_point() else t for t in tensors)


def _check_inputs(inputs: tuple, backend: ModuleBackend, what: str) -> int:
    batch_size = check_batch(inputs, backend.args_schema, what)
    if batch_size < 1:
        raise ValidationError(f"{what}: an empty batch")
    if batch_size > backend.max_batch_size:
        raise ValidationError(
            f"{what}: {batch_size} samples exceed the stage's max_batch_size of "
            f"{backend.max_batch_size}; send smaller micro-batches"
        )
    return batch_size


async def _encode(
    answer: protocol.ForwardAnswer | protocol.BackwardAnswer, codec: Any
) -> dict[str, Any]:
    """Lossy codecs on big tensors run in an executor so the loop keeps serving."""
    tensors = answer.outputs if isinstance(answer, protocol.ForwardAnswer) else answer.grad_inputs
    if codec == protocol.CompressionType.NONE or sum(t.numel() for t in tensors) < (1 << 16):
        return answer.encode(codec)
    return await asyncio.get_running_loop().run_in_executor(None, answer.encode, codec)


class StageServer:
    """Serves stage ``stage`` (of ``num_stages``) of pipeline ``pipeline`` through ``dht``'s
    peer. ``backend`` holds the stage's module, optimizer and schemas.

    Use :meth:`start` / :meth:`shutdown` from synchronous code (a running ``DHT``
    facade), or :meth:`astart` / :meth:`ashutdown` on the peer's event loop."""

    def __init__(
        self,
        dht: Any,
        pipeline: str,
        stage: int,
        num_stages: int,
        backend: ModuleBackend,
        options: StageServerOptions | None = None,
    ):
        protocol.check_pipeline_name(pipeline)
        _check_stage(stage, num_stages)
        if not isinstance(backend, ModuleBackend):
            raise ValidationError(f"backend must be a ModuleBackend, got {type(backend).__name__}")
        self.options = options or StageServerOptions()
        if not isinstance(self.options, StageServerOptions):
            raise ValidationError("options must be StageServerOptions")
        self.dht = dht
        self.pipeline, self.stage, self.num_stages = pipeline, stage, num_stages
        self.activation_cache = (
            ActivationCache(self.options.activation_cache_bytes)
            if self.options.activation_cache_bytes
            else None
        )
        self.backend = self._adopt(backend)
        self.runtime = Runtime(backend.get_pools(), name=f"swarmgrad-stage-{stage}")
        self.servicer = StageServicer(self)
        self.throughput = 0.0  # samples/s, smoothed
        self.forward_requests = self.backward_requests = 0
        self.records_written = 0
        self._measured = (0, 0.0)  # samples and busy seconds at the last measurement
        self._declarer: asyncio.Task | None = None
        self._state = "new"

    def __repr__(self) -> str:
        return (
            f"StageServer({self.pipeline!r}, stage {self.stage}/{self.num_stages}, {self._state})"
        )

    # ------------------------------------------------------------------ serving

    def check_address(self, pipeline: str, stage: int) -> ModuleBackend:
        """The backend, if a request for (pipeline, stage) is for this server."""
        if pipeline != self.pipeline or stage != self.stage:
            raise ValidationError(
                f"this peer serves stage {self.stage} of pipeline {self.pipeline!r}, not stage "
                f"{stage} of pipeline {pipeline!r:.140}"
            )
        return self.backend

    def stage_info(self) -> protocol.StageInfo:
        b = self.backend
        return protocol.StageInfo(
            self.stage, self.num_stages, b.args_schema, b.outputs_schema, b.max_batch_size
        )

    def record(self) -> protocol.StageRecord:
        """This server's DHT record now (measures throughput since the previous one)."""
        self._measure()
        queue = sum(pool.queued_samples for pool in self.backend.get_pools())
        maddrs = tuple(str(m) for m in self.dht.peer.get_visible_maddrs())
        return protocol.StageRecord(maddrs, self.throughput, queue)

    def _measure(self) -> None:
        forward, backward = self.backend.get_pools()
        samples = max(forward.stats.samples, backward.stats.samples)
        busy = forward.stats.busy_seconds + backward.stats.busy_seconds
        old_samples, old_busy = self._measured
        if samples > old_samples and busy > old_busy:
            rate = (samples - old_samples) / (busy - old_busy)
            alpha = self.options.throughput_smoothing
            self.throughput = (
                rate if self.throughput == 0 else (alpha * rate + (1 - alpha) * self.throughput)
            )
        self._measured = (samples, busy)

    def _adopt(self, backend: ModuleBackend) -> ModuleBackend:
        if self.activation_cache is not None and backend.activation_cache is None:
            backend.activation_cache = self.activation_cache
        return backend

    # ------------------------------------------------------------------ DHT record

    async def declare(self) -> bool:
        """Write this server's record now; True if some DHT node stored it."""
        key = protocol.stage_key(self.pipeline, self.stage)
        stored = await self.dht.node.store(
            key,
            self.record().encode(),
            get_dht_time() + self.options.record_lifetime,
            subkey=self.dht.peer.peer_id.to_base58(),
        )
        self.records_written += 1
        return bool(stored)

    async def _withdraw(self, stage: int) -> None:
        key = protocol.stage_key(self.pipeline, stage)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await self.dht.node.store(
                    key,
                    None,
                    get_dht_time() + self.options.record_lifetime + 1.0,
                    subkey=self.dht.peer.peer_id.to_base58(),
                )

    async def _declare_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.update_period)
            try:
                async with asyncio.timeout(self.options.update_period):
                    await self.declare()
            except Exception as e:  # the DHT is flaky now; the next refresh may work
                logger.warning("stage %d: could not refresh its DHT record: %r", self.stage, e)

    # ------------------------------------------------------------------ life cycle

    async def astart(self) -> None:
        if self._state != "new":
            raise ValidationError(f"this stage server cannot start: it is {self._state}")
        self._state = "started"
        self.runtime.start()
        self.dht.peer.add_servicer(self.servicer)
        try:
            async with asyncio.timeout(30.0):
                await self.declare()
        except Exception as e:
            logger.warning("stage %d: the first DHT record failed: %r", self.stage, e)
        self._declarer = asyncio.create_task(self._declare_forever(), name="stage-declarer")
        logger.info(
            "serving stage %d/%d of pipeline %r", self.stage, self.num_stages, self.pipeline
        )

    async def ashutdown(self) -> None:
        if self._state != "started":
            self._state = "stopped"
            return
        self._state = "stopped"
        self.dht.peer.remove_servicer(self.servicer)
        declarer, self._declarer = self._declarer, None
        if declarer is not None:
            declarer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await declarer
        await self._withdraw(self.stage)
        await asyncio.to_thread(self.runtime.shutdown)

    def start(self) -> None:
        self.dht.run_coroutine(lambda _dht, _node: self.astart())

    def shutdown(self) -> None:
        self.dht.run_coroutine(lambda _dht, _node: self.ashutdown())

    async def switch_stage(self, stage: int, backend: ModuleBackend) -> None:
        """Serve ``stage`` with ``backend`` from now on (rebalancing): the old stage's
        record is withdrawn, requests for it are refused, its queued ones fail."""
        _check_stage(stage, self.num_stages)
        old_stage, old_runtime = self.stage, self.runtime
        runtime = Runtime(self._adopt(backend).get_pools(), name=f"swarmgrad-stage-{stage}")
        runtime.start()
        self.stage, self.backend, self.runtime = stage, backend, runtime
        self.throughput, self._measured = 0.0, (0, 0.0)
        await self._withdraw(old_stage)
        await asyncio.to_thread(old_runtime.shutdown)
        try:
            async with asyncio.timeout(30.0):
                await self.declare()
        except Exception as e:
            logger.warning("stage %d: the first DHT record failed: %r", stage, e)
        logger.info("moved from stage %d to stage %d of %r", old_stage, stage, self.pipeline)


def _check_stage(stage: Any, num_stages: Any) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValidationError(f"num_stages must be a positive int, got {num_stages!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValidationError(f"stage must be an int in [0, {num_stages}), got {stage!r}")
