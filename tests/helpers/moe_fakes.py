"""A small fake expert server speaking :mod:`swarmgrad.moe.protocol`, for client tests.

It hosts plain torch modules under uids, declares them in the DHT, counts every call and
batch, and misbehaves on demand per uid: ``behaviour`` (forward) and
``backward_behaviour`` are one of

- ``"normal"``
- ``"raise"``: the expert raises (the caller gets a RemoteError)
- ``"hang"``: never answers (until the caller's deadline cancels the call)
- ``"slow"``: answers after ``delay`` seconds
- ``"nan"``: answers with NaN everywhere
- ``"die"``: the whole server peer shuts down in the middle of the call
- ``"bad_shape"``: answers with tensors of the wrong shape (a buggy or hostile server)

Behaviours can be changed between calls (``server.experts[uid].behaviour = "hang"``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.dht import DHT
from swarmgrad.dht.node import DHTNode
from swarmgrad.moe.dht_records import declare_experts_on_node
from swarmgrad.moe.protocol import (
    BACKWARD,
    FORWARD,
    INFO,
    BatchTensorDescriptor,
    check_batch,
    schema_to_message,
)
from swarmgrad.moe.server import Server
from swarmgrad.net.peer import Peer
from swarmgrad.utils.loop_thread import run_coroutine

BEHAVIOURS = {"normal", "raise", "hang", "slow", "nan", "die", "bad_shape"}


class FakeExpert:
    def __init__(
        self,
        module: nn.Module,
        args_schema: Sequence[BatchTensorDescriptor],
        *,
        behaviour: str = "normal",
        backward_behaviour: str = "normal",
        delay: float = 0.0,
        lr: float = 0.0,
    ):
        self.module = module
        self.args_schema = tuple(args_schema)
        with torch.no_grad():
            outputs = _as_tuple(module(*(d.make_zeros(1) for d in self.args_schema)))
        self.outputs_schema = tuple(BatchTensorDescriptor.from_tensor(t) for t in outputs)
        self.behaviour, self.backward_behaviour = behaviour, backward_behaviour
        self.delay, self.lr = delay, lr
        self.info_calls = 0
        self.forward_batches: list[int] = []  # batch size of every forward request
        self.backward_batches: list[int] = []

    @property
    def forward_calls(self) -> int:
        return len(self.forward_batches)

    @property
    def backward_calls(self) -> int:
        return len(self.backward_batches)


def _as_tuple(outputs: Any) -> tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


class FakeExpertServer:
    def __init__(self, node: Any, experts: Mapping[str, FakeExpert], max_batch_size: int = 0):
        self.node, self.peer = node, node.peer
        self.experts = dict(experts)
        self.max_batch_size = max_batch_size
        self.dead = False
        self._death: asyncio.Task | None = None

    @classmethod
    async def create(
        cls,
        node: Any,
        experts: Mapping[str, FakeExpert],
        *,
        declare: bool = True,
        ttl: float = 120.0,
        max_batch_size: int = 0,
    ) -> FakeExpertServer:
        server = cls(node, experts, max_batch_size)
        server.peer.add_handler(INFO, server._info)
        server.peer.add_handler(FORWARD, server._forward)
        server.peer.add_handler(BACKWARD, server._backward)
        if declare and server.experts:
            await declare_experts_on_node(node, list(server.experts), node.time_fn() + ttl)
        return server

    @classmethod
    def start(cls, dht: Any, experts: Mapping[str, FakeExpert], **kwargs: Any) -> FakeExpertServer:
        """From synchronous tests: a server on a running ``DHT`` facade's peer."""
        return run_coroutine(cls.create(dht.node, experts, **kwargs), timeout=30)

    @property
    def address(self) -> str:
        return str(self.peer.get_visible_maddrs()[0])

    async def aclose(self) -> None:
        for name in (INFO, FORWARD, BACKWARD):
            self.peer.remove_handler(name)
        if self._death is not None:
            await self._death

    def close(self) -> None:
        run_coroutine(self.aclose(), timeout=30)

    def total_forward_calls(self) -> int:
        return sum(e.forward_calls for e in self.experts.values())

    # ------------------------------------------------------------------ handlers

    def _expert(self, request: Any) -> tuple[str, FakeExpert]:
        uid = request.get("uid") if isinstance(request, dict) else None
        if uid not in self.experts:
            raise KeyError(f"this server hosts no expert {uid!r}")
        return uid, self.experts[uid]

    async def _info(self, request: Any, context: Any) -> dict:
        uid, expert = self._expert(request)
        expert.info_calls += 1
        return {
            "uid": uid,
            "args_schema": schema_to_message(expert.args_schema),
            "outputs_schema": schema_to_message(expert.outputs_schema),
            "max_batch_size": self.max_batch_size,
        }

    async def _misbehave(self, uid: str, behaviour: str, expert: FakeExpert) -> None:
        if behaviour == "raise":
            raise RuntimeError(f"expert {uid} failed on purpose")
        if behaviour == "hang":
            await asyncio.Event().wait()
        if behaviour == "slow":
            await asyncio.sleep(expert.delay)
        if behaviour == "die":
            self.dead = True
            if self._death is None:
                self._death = asyncio.ensure_future(self._shut_down_peer())
            await asyncio.Event().wait()  # cancelled when the peer shuts down

    async def _shut_down_peer(self) -> None:
        if hasattr(self.node, "shutdown"):
            await self.node.shutdown()
        await self.peer.shutdown()

    async def _forward(self, request: Any, context: Any) -> dict:
        uid, expert = self._expert(request)
        inputs = tensors_from_message(request["inputs"], f"inputs of {uid}")
        batch_size = check_batch(inputs, expert.args_schema, f"inputs of expert {uid!r}")
        if self.max_batch_size and batch_size > self.max_batch_size:
            raise ValueError(f"batch of {batch_size} exceeds {self.max_batch_size}")
        expert.forward_batches.append(batch_size)
        await self._misbehave(uid, expert.behaviour, expert)
        with torch.no_grad():
            outputs = _as_tuple(expert.module(*inputs))
        if expert.behaviour == "nan":
            outputs = tuple(torch.full_like(t, float("nan")) for t in outputs)
        if expert.behaviour == "bad_shape":
            outputs = tuple(t.reshape(len(t), -1)[:, 1:] for t in outputs)
        codecs = [d.compression for d in expert.outputs_schema]
        return {"outputs": tensors_to_message(outputs, codecs)}

    async def _backward(self, request: Any, context: Any) -> dict:
        uid, expert = self._expert(request)
        inputs = tensors_from_message(request["inputs"], f"inputs of {uid}")
        grad_outputs = tensors_from_message(request["grad_outputs"], f"grad_outputs of {uid}")
        batch_size = check_batch(inputs, expert.args_schema, f"inputs of expert {uid!r}")
        check_batch(grad_outputs, expert.outputs_schema, f"grad_outputs of {uid!r}", batch_size)
        expert.backward_batches.append(batch_size)
        await self._misbehave(uid, expert.backward_behaviour, expert)
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        with torch.enable_grad():
            outputs = _as_tuple(expert.module(*inputs))
            torch.autograd.backward(outputs, grad_outputs)
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        if expert.backward_behaviour == "nan":
            grads = [torch.full_like(g, float("nan")) for g in grads]
        if expert.lr:
            with torch.no_grad():
                for param in expert.module.parameters():
                    if param.grad is not None:
                        param -= expert.lr * param.grad
        expert.module.zero_grad(set_to_none=True)
        codecs = [d.compression for d in expert.args_schema]
        return {"grad_inputs": tensors_to_message([g.detach() for g in grads], codecs)}


class Swarm:
    """A bootstrap DHT, server DHTs with fake expert servers, and a client DHT."""

    def __init__(self):
        self.dhts: list[DHT] = []
        self.servers: list[FakeExpertServer] = []
        self.root = self.dht()
        self.client = self.dht(client_mode=True)

    def dht(self, **kwargs) -> DHT:
        initial = [str(self.root.get_visible_maddrs()[0])] if self.dhts else []
        dht = DHT(initial_peers=initial, start=True, **kwargs)
        self.dhts.append(dht)
        return dht

    def server(self, experts: dict, **kwargs) -> FakeExpertServer:
        server = FakeExpertServer.start(self.dht(), experts, **kwargs)
        self.servers.append(server)
        return server

    def close(self):
        for server in self.servers:
            server.close()
        for dht in reversed(self.dhts):
            dht.shutdown()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- a real server, in-process


@contextlib.asynccontextmanager
async def serving(backends: dict, **server_kwargs):
    """A real :class:`Server` on a fresh loopback peer (with a lone DHT node) and a client
    peer: ``(server, client, server address)``; everything is shut down afterwards."""
    peer = await Peer.create()
    node = await DHTNode.create(peer, [])
    server = Server(SimpleNamespace(peer=peer, node=node), backends, **server_kwargs)
    client = await Peer.create()
    try:
        await server.astart()
        yield server, client, peer.get_visible_maddrs()[0]
    finally:
        await server.ashutdown()
        await client.shutdown()
        await node.shutdown()
        await peer.shutdown()


async def until(predicate, timeout: float = 30.0) -> None:
    """Poll state that another thread (the device thread) or the peer's stream handling
    changes: there is no event to await across threads."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def call_forward(client, addr, uid, *tensors, timeout: float = 30.0, **extra):
    """``moe.forward`` by hand (the request as a client sends it); the output tensors."""
    request = {"uid": uid, "inputs": tensors_to_message(tensors), **extra}
    reply = await client.call(addr, FORWARD, request, timeout=timeout)
    return tensors_from_message(reply["outputs"])


async def call_backward(client, addr, uid, inputs, grads, timeout: float = 30.0):
    """``moe.backward`` by hand; the gradients of the inputs."""
    request = {
        "uid": uid,
        "inputs": tensors_to_message(inputs),
        "grad_outputs": tensors_to_message(grads),
    }
    reply = await client.call(addr, BACKWARD, request, timeout=timeout)
    return tensors_from_message(reply["grad_inputs"])
