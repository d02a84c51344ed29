"""hivemind's servicers and stubs: a protocol written as a class of ``rpc_*`` methods.

A hivemind servicer declares each RPC as ``async def rpc_x(self, request: Req, context:
P2PContext) -> Resp``; the annotations say the message types, and ``AsyncIterator[...]``
on the request or the return says the call streams that way. ``add_p2p_handlers(p2p)``
serves the methods through :meth:`P2P.add_protobuf_handler`; ``get_stub(p2p, peer)``
returns an object whose ``rpc_x(request, timeout=None)`` calls the remote peer and returns
its answer (for a streaming answer: ``async for x in await stub.rpc_x(request)``).

Handler names are hivemind's: ``"<Servicer>.rpc_x"``, ``"<namespace>::<Servicer>.rpc_x"``
with a namespace. Without type annotations (msgpack-only protocols) a method is unary
unless it is an async generator (stream output).

This class extends :class:`swarmgrad.net.rpc.ServicerBase`, so the same servicer may also
be served with ``Peer.add_servicer`` (then requests arrive as msgpack objects, unparsed).
"""

from __future__ import annotations

import asyncio
import inspect
import typing
from dataclasses import dataclass
from typing import Any

from swarmgrad.net import rpc
from swarmgrad.net.identity import PeerID
from swarmgrad.p2p.p2p_daemon import P2P

__all__ = ["RPCHandler", "ServicerBase", "StubBase"]


@dataclass(frozen=True)
class RPCHandler:
    method_name: str
    request_type: Any
    response_type: Any
    stream_input: bool
    stream_output: bool


class StubBase:
    """Base of the generated stubs: calls to ``rpc_*`` go to ``peer`` through ``p2p``."""

    def __init__(self, p2p: P2P, peer: PeerID, namespace: str | None):
        self._p2p = p2p
        self._peer = peer
        self._namespace = namespace


def _strip_iterator_hint(hint: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(hint)
    if origin is not None and getattr(origin, "__name__", "") in ("AsyncIterator", "AsyncIterable"):
        (inner,) = typing.get_args(hint) or (None,)
        return inner, True
    return hint, False


class ServicerBase(rpc.ServicerBase):
    """hivemind's ``ServicerBase`` (see the module docstring)."""

    @classmethod
    def _collect_rpc_handlers(cls) -> list[RPCHandler]:
        cached = cls.__dict__.get("_p2p_rpc_handlers")
        if cached is not None:
            return cached
        handlers = []
        for method_name, method in inspect.getmembers(cls, predicate=inspect.isfunction):
            if not method_name.startswith("rpc_") or method_name == "rpc_handlers":
                continue
            params = list(inspect.signature(method).parameters)
            if len(params) < 3:
                raise ValueError(
                    f"{cls.__name__}.{method_name} should take (self, request, context): "
                    f"request a message or AsyncIterator of messages, context a P2PContext"
                )
            try:
                hints = typing.get_type_hints(method)
            except Exception:  # annotations naming types not importable here
                hints = {}
            request_type, stream_input = _strip_iterator_hint(hints.get(params[1]))
            if "return" in hints:
                response_type, stream_output = _strip_iterator_hint(hints["return"])
            else:
                response_type, stream_output = None, False
            stream_output = stream_output or inspect.isasyncgenfunction(method)
            handlers.append(
                RPCHandler(method_name, request_type, response_type, stream_input, stream_output)
            )
        cls._p2p_rpc_handlers = handlers
        cls._p2p_stub_type = type(
            f"{cls.__name__}Stub",
            (StubBase,),
            {handler.method_name: cls._make_rpc_caller(handler) for handler in handlers},
        )
        return handlers

    @classmethod
    def _make_rpc_caller(cls, handler: RPCHandler):
        async def caller(self: StubBase, input: Any, timeout: float | None = None) -> Any:
            handle_name = cls._get_handle_name(self._namespace, handler.method_name)
            if not handler.stream_output:
                return await asyncio.wait_for(
                    self._p2p.call_protobuf_handler(
                        self._peer, handle_name, input, handler.response_type
                    ),
                    timeout=timeout,
                )
            if timeout is not None:
                raise ValueError("Timeouts for handlers returning streams are not supported")
            return await self._p2p.iterate_protobuf_handler(
                self._peer, handle_name, input, handler.response_type
            )

        caller.__name__ = caller.__qualname__ = handler.method_name
        return caller

    async def add_p2p_handlers(
        self,
        p2p: P2P,
        wrapper: Any = None,
        *,
        namespace: str | None = None,
        balanced: bool = False,
    ) -> None:
        """Serve every ``rpc_*`` method on ``p2p`` (those of ``wrapper`` if given, an object
        with the same methods, e.g. a proxy that forwards to this servicer)."""
        servicer = self if wrapper is None else wrapper
        for handler in self._collect_rpc_handlers():
            await p2p.add_protobuf_handler(
                self._get_handle_name(namespace, handler.method_name),
                getattr(servicer, handler.method_name),
                handler.request_type,
                stream_input=handler.stream_input,
                stream_output=handler.stream_output,
                balanced=balanced,
            )

    async def remove_p2p_handlers(self, p2p: P2P, *, namespace: str | None = None) -> None:
        for handler in self._collect_rpc_handlers():
            await p2p.remove_protobuf_handler(
                self._get_handle_name(namespace, handler.method_name),
                stream_input=handler.stream_input,
                stream_output=handler.stream_output,
            )

    @classmethod
    def get_stub(cls, p2p: P2P, peer: PeerID, *, namespace: str | None = None) -> StubBase:
        """An object whose ``rpc_*`` methods call ``peer``'s servicer of this class."""
        cls._collect_rpc_handlers()
        return cls._p2p_stub_type(p2p, peer, namespace)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        handle_name = f"{cls.__name__}.{method_name}"
        if namespace is not None:
            handle_name = f"{namespace}::{handle_name}"
        return handle_name
