"""Calls to one remote expert (schema, forward, backward) over any server hosting it.

:class:`ExpertCaller` is the async core shared by :class:`RemoteExpert` (one expert as a
module) and the mixture-of-experts layers (hundreds of concurrent calls per batch). It
keeps the per-call path short because a batch-of-one call through a trivial expert
should cost little more than the RPC itself: the schema is fetched once and cached, the
connection to each server is reused by the peer, and nothing touches the DHT.

Server choice: when several servers host the uid, calls rotate over them, servers that
failed recently (:mod:`swarmgrad.moe.client.health`) last. A connection failure (refused,
reset, the server dying mid-call) moves the call to the next server while time remains;
an error raised by the expert itself is final, since another replica would raise it too.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.compression.serialized import CompressionType
from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.moe.expert_uid import ExpertInfo, ExpertUID, ServerInfo
from swarmgrad.moe.protocol import (
    BACKWARD,
    FORWARD,
    INFO,
    BatchTensorDescriptor,
    check_batch,
    schema_from_message,
)
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import (
    CodecError,
    DeadlineExceeded,
    HandshakeError,
    Overloaded,
    PeerUnreachable,
    ProtocolViolation,
    RemoteError,
    UnknownHandler,
    ValidationError,
)

from .health import SERVER_HEALTH, ServerHealth

__all__ = ["DEFAULT_TIMEOUT", "ExpertCaller", "ExpertSchema", "resolve_peer"]

#: Seconds a call may take when the caller gives no timeout (every wait has a deadline).
DEFAULT_TIMEOUT = 60.0

# Failures of the server or the path to it, not of the expert: worth another server.
_RETRYABLE = (OSError, HandshakeError, UnknownHandler, Overloaded)


def resolve_peer(peer_source: Any) -> Peer:
    """The peer to call from: a :class:`Peer`, or anything with a running ``.peer``
    (the ``DHT`` facade, a ``DHTNode``)."""
    if isinstance(peer_source, Peer):
        return peer_source
    peer = getattr(peer_source, "peer", None)
    if isinstance(peer, Peer):
        return peer
    if peer is None and hasattr(peer_source, "peer"):
        raise ValidationError(
            f"{type(peer_source).__name__} is not running: start it before calling experts"
        )
    raise ValidationError(
        f"expected a Peer or a DHT to call experts through, got {type(peer_source).__name__}"
    )


@dataclass(frozen=True)
class ExpertSchema:
    """What ``moe.info`` says about an expert: its arguments, outputs and batch limit."""

    uid: ExpertUID
    args_schema: tuple[BatchTensorDescriptor, ...]
    outputs_schema: tuple[BatchTensorDescriptor, ...]
    max_batch_size: int = 0  # 0: no limit announced

    @classmethod
    def from_message(cls, uid: ExpertUID, message: Any, server: PeerID) -> ExpertSchema:
        """Parse an info reply; a malformed one is the server's fault (ProtocolViolation)."""
        try:
            if not isinstance(message, dict):
                raise ValidationError(f"expected a dictionary, got {type(message).__name__}")
            args = schema_from_message(message["args_schema"])
            outputs = schema_from_message(message["outputs_schema"])
            max_batch_size = message.get("max_batch_size") or 0
            if not isinstance(max_batch_size, int) or max_batch_size < 0:
                raise ValidationError(f"bad max_batch_size {max_batch_size!r}")
            if not outputs:
                raise ValidationError("an expert must have at least one output")
        except (KeyError, ValidationError) as e:
            raise ProtocolViolation(
                f"server {server} sent a malformed {INFO} reply for expert {uid!r}: {e}"
            ) from None
        return cls(uid, args, outputs, max_batch_size)

    @functools.cached_property
    def input_codecs(self) -> tuple[CompressionType, ...]:
        return tuple(d.compression for d in self.args_schema)

    @functools.cached_property
    def output_codecs(self) -> tuple[CompressionType, ...]:
        return tuple(d.compression for d in self.outputs_schema)

    def to_info(self) -> dict[str, Any]:
        """hivemind's ``RemoteExpert.info`` dictionary (our experts take positional
        arguments only, so ``forward_schema`` is the argument schema)."""
        return {
            "uid": self.uid,
            "args_schema": self.args_schema,
            "forward_schema": self.args_schema,
            "outputs_schema": self.outputs_schema,
            "max_batch_size": self.max_batch_size,
        }


class ExpertCaller:
    """Async calls to one expert. Use from coroutines on the peer's event loop."""

    def __init__(
        self,
        expert_info: ExpertInfo,
        peer_source: Any,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        health: ServerHealth = SERVER_HEALTH,
    ):
        if not isinstance(expert_info, ExpertInfo):
            raise ValidationError(f"expected an ExpertInfo, got {type(expert_info).__name__}")
        self.expert_info = expert_info
        self.timeout = timeout
        self.health = health
        self.schema: ExpertSchema | None = None
        self._peer_source = peer_source
        self._turn = 0
        self._dialable: set[PeerID] = set()  # servers whose addresses the peer was given

    @property
    def uid(self) -> ExpertUID:
        return self.expert_info.uid

    @property
    def peer(self) -> Peer:
        return resolve_peer(self._peer_source)

    def update(self, expert_info: ExpertInfo) -> None:
        """Take a newer server list for the same uid (the DHT changes, the expert stays)."""
        if expert_info.uid != self.uid:
            raise ValidationError(f"cannot update expert {self.uid!r} with {expert_info.uid!r}")
        self.expert_info = expert_info

    def __repr__(self) -> str:
        return f"ExpertCaller({self.uid!r}, {len(self.expert_info.servers)} server(s))"

    # ------------------------------------------------------------------ calls

    async def get_schema(self, timeout: float | None = None) -> ExpertSchema:
        """The expert's schema, asked from a server once and then cached."""
        if self.schema is None:
            reply, server = await self._call(INFO, {"uid": self.uid}, self._deadline(timeout))
            self.schema = ExpertSchema.from_message(self.uid, reply, server)
        return self.schema

    async def forward(
        self,
        inputs: Sequence[torch.Tensor],
        *,
        timeout: float | None = None,
        schema: ExpertSchema | None = None,
    ) -> list[torch.Tensor]:
        """Outputs of the expert for a batch of inputs (no autograd). ``schema`` lets the
        mixture-of-experts layers use one schema for a whole grid without an info call
        per expert; inputs are expected to match it already."""
        return await self._in_batches(self._forward_once, (inputs,), timeout, schema)

    async def backward(
        self,
        inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        *,
        timeout: float | None = None,
        schema: ExpertSchema | None = None,
    ) -> list[torch.Tensor]:
        """Gradients of the expert's inputs; the server also updates its weights."""
        return await self._in_batches(self._backward_once, (inputs, grad_outputs), timeout, schema)

    async def _in_batches(
        self,
        call: Callable[..., Awaitable[list[torch.Tensor]]],
        batches: tuple[Sequence[torch.Tensor], ...],
        timeout: float | None,
        schema: ExpertSchema | None,
    ) -> list[torch.Tensor]:
        """``call(*batches, schema, deadline)``; a batch larger than the schema's
        ``max_batch_size`` goes as several concurrent requests, their outputs concatenated."""
        deadline = self._deadline(timeout)
        schema = schema or self.schema or await self.get_schema(self._remaining(deadline))
        batch_size = batches[0][0].shape[0] if batches[0] else 0
        limit = schema.max_batch_size
        if not limit or batch_size <= limit:
            return await call(*batches, schema, deadline)
        slices = [slice(i, i + limit) for i in range(0, batch_size, limit)]
        requests = (call(*([t[s] for t in ts] for ts in batches), schema, deadline) for s in slices)
        parts = await asyncio.gather(*requests)
        return [torch.cat(pieces) for pieces in zip(*parts, strict=True)]

    async def _forward_once(
        self, inputs: Sequence[torch.Tensor], schema: ExpertSchema, deadline: float
    ) -> list[torch.Tensor]:
        request = {"uid": self.uid, "inputs": tensors_to_message(inputs, schema.input_codecs)}
        reply, server = await self._call(FORWARD, request, deadline)
        outputs = self._decode(reply, "outputs", server)
        batch_size = inputs[0].shape[0] if inputs else None
        if not _fits(outputs, schema.outputs_schema, batch_size):
            try:  # for its message
                what = f"outputs of expert {self.uid!r} from {server.peer_id}"
                check_batch(outputs, schema.outputs_schema, what, batch_size)
            except ValidationError as e:
                raise ProtocolViolation(str(e)) from None
        return outputs

    async def _backward_once(
        self,
        inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        schema: ExpertSchema,
        deadline: float,
    ) -> list[torch.Tensor]:
        request = {
            "uid": self.uid,
            "inputs": tensors_to_message(inputs, schema.input_codecs),
            "grad_outputs": tensors_to_message(grad_outputs, schema.output_codecs),
        }
        reply, server = await self._call(BACKWARD, request, deadline)
        grads = self._decode(reply, "grad_inputs", server)
        if len(grads) != len(inputs):
            raise ProtocolViolation(
                f"server {server} returned {len(grads)} input gradients for expert "
                f"{self.uid!r}, expected {len(inputs)}"
            )
        for i, (grad, tensor) in enumerate(zip(grads, inputs, strict=True)):
            if grad.shape != tensor.shape:
                raise ProtocolViolation(
                    f"server {server} returned grad_inputs[{i}] of shape {list(grad.shape)} "
                    f"for expert {self.uid!r}, expected {list(tensor.shape)}"
                )
        return grads

    def _decode(self, reply: Any, field: str, server: ServerInfo) -> list[torch.Tensor]:
        try:
            if not isinstance(reply, dict) or field not in reply:
                raise CodecError(f"the reply has no {field!r} field")
            return [t.detach() for t in tensors_from_message(reply[field], field)]
        except CodecError as e:
            raise ProtocolViolation(
                f"server {server.peer_id} sent a malformed reply for expert {self.uid!r}: {e}"
            ) from None

    # ------------------------------------------------------------------ transport

    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)

    @staticmethod
    def _remaining(deadline: float) -> float:
        return deadline - asyncio.get_running_loop().time()

    def _servers_in_order(self, own_id: PeerID) -> list[ServerInfo]:
        servers = self.expert_info.servers
        if len(servers) == 1 and servers[0].peer_id != own_id:
            return list(servers)  # the common case, without the bookkeeping below
        start = self._turn % len(servers)
        self._turn += 1
        rotated = [s for s in servers[start:] + servers[:start] if s.peer_id != own_id]
        if not rotated:
            raise ValidationError(
                f"expert {self.uid!r} is hosted only by this very peer ({own_id}); a peer "
                f"cannot call itself, so use the expert module directly"
            )
        healthy = [s for s in rotated if self.health.is_healthy(s.peer_id)]
        return healthy + [s for s in rotated if s not in healthy]

    async def _call(self, name: str, request: Any, deadline: float) -> tuple[Any, ServerInfo]:
        peer = self.peer
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        for server in self._servers_in_order(peer.peer_id):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if server.peer_id not in self._dialable:
                self._learn_addresses(peer, server)
            try:
                reply = await peer.call(server.peer_id, name, request, timeout=remaining)
            except DeadlineExceeded:
                raise DeadlineExceeded(
                    f"expert {self.uid!r} on server {server.peer_id} did not answer {name} "
                    f"within the remaining {remaining:.3g} s"
                ) from None
            except _RETRYABLE as e:
                self.health.mark_failed(server.peer_id)
                errors.append(f"{server.peer_id}: {type(e).__name__}: {e}")
                continue
            except RemoteError as e:
                self.health.mark_ok(server.peer_id)
                raise RemoteError(
                    f"expert {self.uid!r} failed in {name}: {e.args[0]}",
                    remote_type=e.remote_type,
                    peer=e.peer,
                ) from None
            self.health.mark_ok(server.peer_id)
            return reply, server
        if errors:
            raise PeerUnreachable(
                f"no server of expert {self.uid!r} answered {name}: " + "; ".join(errors)
            )
        raise DeadlineExceeded(f"expert {self.uid!r}: no time left to call {name}")

    def _learn_addresses(self, peer: Peer, server: ServerInfo) -> None:
        for maddr in server.maddrs:
            try:
                peer.add_addresses(server.peer_id, [maddr])
            except ValidationError:
                pass  # a malformed address in a record: the others may still work
        self._dialable.add(server.peer_id)


def _fits(
    tensors: Sequence[torch.Tensor],
    schema: Sequence[BatchTensorDescriptor],
    batch_size: int | None,
) -> bool:
    """The fast yes of :func:`check_batch` (which builds its error messages eagerly)."""
    if len(tensors) != len(schema):
        return False
    for tensor, descriptor in zip(tensors, schema, strict=True):
        shape = tensor.shape
        if (
            not shape
            or tensor.dtype != descriptor.dtype
            or shape[1:] != descriptor.instance_shape
            or (batch_size is not None and shape[0] != batch_size)
        ):
            return False
    return True
