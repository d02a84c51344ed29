"""Remote procedure calls over multiplexed streams.

One call is one stream. The caller opens it with a small header (handler name, timeout),
sends one request message or a stream of them, and closes its writing side; the handler
answers with one message or a stream of them, then FIN. A handler's exception travels
back as an error message and is raised on the caller as a typed :class:`RemoteError`.
Cancelling the caller (or its deadline) resets the stream, which cancels the handler;
a handler that gives up resets the stream, which fails the caller.

Message layout on the stream: ``u32 meta_len | msgpack meta | raw buffers...``. ``meta`` is
``[kind, body, [buffer lengths]]``. :class:`Blob` values anywhere in ``body`` travel as raw
out-of-band buffers, never copied into msgpack and received straight into their own
memory: that is how tensors move. They arrive as writable ``bytearray``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import struct
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmgrad.net.framing import ResetCode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.mux import Stream
from swarmgrad.utils.errors import (
    AccessDenied,
    ConnectionClosed,
    DeadlineExceeded,
    FrameTooLarge,
    Overloaded,
    ProtocolViolation,
    RemoteError,
    UnknownHandler,
    ValidationError,
)

logger = logging.getLogger(__name__)

_META_LEN = struct.Struct(">I")
_BLOB_EXT = 1
MAX_META_SIZE = 16 * 1024 * 1024
# A call header is a handler name and a timeout; parsed headers are cached, so an
# unbounded size would let a caller park 4096 x 64 KiB of names in the cache.
MAX_CALL_HEADER = 4096
DEFAULT_MAX_MESSAGE_SIZE = 1024 * 1024 * 1024
_KIND_MESSAGE, _KIND_ERROR = 0, 1
_SMALL_BLOB = 4096  # blobs below this are inlined into the meta write
_EMPTY_LIST = 0x90  # msgpack fixarray of length 0: a message without blobs


def _plain_default(obj: Any) -> Any:
    if isinstance(obj, PeerID):
        return obj.to_bytes()
    raise TypeError(f"cannot send an object of type {type(obj).__name__} in an RPC message")


def _plain_packer(body: Any) -> bytes:
    return msgpack.packb(body, default=_plain_default, use_bin_type=True)


def _no_blobs(code: int, data: bytes) -> Any:
    raise ProtocolViolation(f"message refers to an out-of-band buffer it does not carry ({code})")


class Blob:
    """Marks a buffer to be sent out-of-band (zero-copy); the receiver gets a bytearray."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: bytes | bytearray | memoryview):
        self.buffer = memoryview(buffer).cast("B")

    def __len__(self) -> int:
        return len(self.buffer)

    def __repr__(self) -> str:
        return f"Blob({len(self.buffer)} bytes)"


# ------------------------------------------------------------------------ message codec


def encode_message(body: Any, kind: int = _KIND_MESSAGE) -> list[bytes | memoryview]:
    """Encode a message into buffers to write in order (Blob contents are not copied)."""
    try:  # fast path: a message of plain values (most small RPCs)
        packed = _plain_packer(body)
    except TypeError:
        pass
    else:
        if len(packed) + 2 <= MAX_META_SIZE:
            meta = bytes((kind, _EMPTY_LIST)) + packed
            return [_META_LEN.pack(len(meta)) + meta]
    blobs: list[memoryview] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Blob):
            blobs.append(obj.buffer)
            return msgpack.ExtType(_BLOB_EXT, _META_LEN.pack(len(blobs) - 1))
        if isinstance(obj, PeerID):
            return obj.to_bytes()
        raise TypeError(f"cannot send an object of type {type(obj).__name__} in an RPC message")

    packed_body = msgpack.packb(body, default=default, use_bin_type=True)
    meta = msgpack.packb([kind, [len(b) for b in blobs]]) + packed_body
    if len(meta) > MAX_META_SIZE:
        raise FrameTooLarge(
            f"message metadata of {len(meta)} bytes exceeds {MAX_META_SIZE}; wrap large "
            f"buffers in Blob so they travel out of band"
        )
    head = _META_LEN.pack(len(meta)) + meta
    if sum(len(b) for b in blobs) <= _SMALL_BLOB:
        return [head + b"".join(blobs)]
    return [head, *blobs]


async def write_message(
    stream: Stream, body: Any, kind: int = _KIND_MESSAGE, *, last: bool = False
) -> None:
    """Write one message; ``last=True`` also ends the stream's writing side."""
    parts = encode_message(body, kind)
    for i, part in enumerate(parts):
        await stream.write(part, fin=last and i == len(parts) - 1)


class _ReceiveBudget:
    """Bytes that messages on one connection have announced but not yet delivered.

    A message's attached buffers are allocated in full before their bytes arrive (they
    are received straight into them), so a peer could announce many large messages and
    send nothing, making us hold memory it never pays for. Each connection may have at
    most ``limit`` such bytes outstanding; further messages wait until earlier ones are
    complete or abandoned. A single message larger than ``limit`` (up to the message size
    limit) proceeds once it is alone.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.reserved = 0
        self._changed: asyncio.Event | None = None

    async def acquire(self, nbytes: int) -> int:
        nbytes = min(nbytes, self.limit)
        while self.reserved and self.reserved + nbytes > self.limit:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        self.reserved += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes
        if self._changed is not None:
            self._changed.set()
            self._changed = None


RECEIVE_BUDGET_BYTES = 1024 * 1024 * 1024
_budgets: weakref.WeakKeyDictionary[Any, _ReceiveBudget] = weakref.WeakKeyDictionary()


def _receive_budget(stream: Stream) -> _ReceiveBudget:
    budget = _budgets.get(stream.conn)
    if budget is None:
        budget = _budgets[stream.conn] = _ReceiveBudget(RECEIVE_BUDGET_BYTES)
    return budget


async def read_message(stream: Stream, max_size: int) -> tuple[int, Any] | None:
    """Read one message; None at a clean end of stream."""
    first = await stream.read(_META_LEN.size)
    if not first:
        return None
    if len(first) < _META_LEN.size:
        first += await stream.readexactly(_META_LEN.size - len(first))
    (meta_len,) = _META_LEN.unpack(first)
    limit = min(MAX_META_SIZE, max_size)
    if meta_len > limit:
        raise FrameTooLarge(
            f"message metadata of {meta_len} bytes from {stream.remote_peer_id} exceeds the "
            f"limit of {limit} bytes"
        )
    meta = await stream.readexactly(meta_len)
    if len(meta) >= 2 and meta[0] <= 1 and meta[1] == _EMPTY_LIST:  # no blobs: one unpack
        try:
            return meta[0], msgpack.unpackb(
                memoryview(meta)[2:], raw=False, ext_hook=_no_blobs, strict_map_key=False
            )
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise ProtocolViolation(
                f"malformed RPC message from {stream.remote_peer_id}: {e}"
            ) from e
    buffers: list[bytearray] = []

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _BLOB_EXT or len(data) != _META_LEN.size:
            raise ProtocolViolation(f"unknown msgpack extension type {code} in an RPC message")
        (index,) = _META_LEN.unpack(data)
        if index >= len(buffers):
            raise ProtocolViolation(f"message refers to buffer {index} of {len(buffers)}")
        return buffers[index]

    unpacker = msgpack.Unpacker(
        raw=False, ext_hook=ext_hook, strict_map_key=False, max_buffer_size=meta_len
    )
    unpacker.feed(meta)
    try:
        kind, lengths = unpacker.unpack()
        if not isinstance(lengths, list) or not all(isinstance(n, int) and n >= 0 for n in lengths):
            raise ValueError("buffer lengths must be a list of non-negative integers")
        total = sum(lengths)
        if total + meta_len > max_size:
            raise FrameTooLarge(
                f"message of {total + meta_len} bytes from {stream.remote_peer_id} exceeds "
                f"the limit of {max_size} bytes"
            )
        budget = _receive_budget(stream)
        reserved = await budget.acquire(total)
        try:
            for length in lengths:
                buffer = bytearray(length)
                await stream.readexactly_into(buffer)
                buffers.append(buffer)
        finally:
            budget.release(reserved)
        body = unpacker.unpack()
    except (ValueError, TypeError, msgpack.OutOfData, msgpack.FormatError) as e:
        raise ProtocolViolation(f"malformed RPC message from {stream.remote_peer_id}: {e}") from e
    return kind, body


# ------------------------------------------------------------------------ handlers


@dataclass
class RPCContext:
    """What a handler knows about the call it serves (hivemind calls it P2PContext)."""

    remote_id: PeerID
    handler_name: str
    deadline: float | None  # loop time, or None
    stream: Stream


@dataclass(frozen=True)
class Handler:
    name: str
    fn: Callable[..., Any]
    stream_input: bool
    stream_output: bool


_ERROR_TYPES: dict[str, type[RemoteError]] = {
    "UnknownHandler": UnknownHandler,
    "Overloaded": Overloaded,
    "AccessDenied": AccessDenied,
}


def remote_error(body: Any, peer: PeerID) -> RemoteError:
    if not isinstance(body, dict):
        return RemoteError(f"malformed error reply: {body!r}", peer=peer)
    remote_type = str(body.get("type", "Exception"))
    cls = _ERROR_TYPES.get(remote_type, RemoteError)
    return cls(str(body.get("message", "")), remote_type=remote_type, peer=peer)


async def _incoming_requests(stream: Stream, max_size: int) -> AsyncIterator[Any]:
    while True:
        message = await read_message(stream, max_size)
        if message is None:
            return
        kind, body = message
        if kind != _KIND_MESSAGE:
            raise ProtocolViolation(f"caller {stream.remote_peer_id} sent message kind {kind}")
        yield body


async def serve_call(
    stream: Stream,
    handler: Handler | None,
    *,
    handler_name: str,
    timeout: float | None,
    max_message_size: int,
    refuse_reason: str | None = None,
    refuse_type: str = "Overloaded",
) -> None:
    """Run one inbound call on its stream; never raises (errors go to the caller).
    With ``refuse_reason`` the call is refused with a ``refuse_type`` error."""
    peer = stream.remote_peer_id
    try:
        if handler is None or refuse_reason is not None:
            error_type = refuse_type if refuse_reason is not None else "UnknownHandler"
            message = refuse_reason or f"no handler named {handler_name!r} on this peer"
            body = {"type": error_type, "message": message}
            await write_message(stream, body, _KIND_ERROR, last=True)
            return
        loop = stream.conn._loop
        deadline = None if timeout is None else loop.time() + timeout
        context = RPCContext(peer, handler_name, deadline, stream)
        # The handler runs in this task (no helper task: small calls are the hot path). If
        # the caller resets the stream, this task is cancelled; that one cancellation is
        # absorbed here, any other (peer shutdown) propagates.
        task = asyncio.current_task(loop)
        caller_gone = False

        def on_stream_failure() -> None:
            nonlocal caller_gone
            if not caller_gone:
                caller_gone = True
                task.cancel()

        stream.on_failure(on_stream_failure)
        try:
            if deadline is None:
                await _run_handler(stream, handler, context, max_message_size)
            else:
                async with asyncio.timeout_at(deadline):
                    await _run_handler(stream, handler, context, max_message_size)
        except asyncio.CancelledError:
            if not caller_gone or task.uncancel() > 0:
                raise
        finally:
            caller_gone = True  # a failure after this point must not cancel the task
    except TimeoutError:
        stream.reset(f"handler {handler_name!r} exceeded its deadline of {timeout} s")
    except (ConnectionClosed, ProtocolViolation) as e:
        logger.debug("call %r from %s failed: %s", handler_name, peer, e)
        code = ResetCode.PROTOCOL_ERROR if isinstance(e, ProtocolViolation) else ResetCode.CANCELLED
        stream.reset(str(e), code)
    except Exception as e:
        logger.exception("internal error serving %r for %s", handler_name, peer)
        stream.reset(f"internal error: {e!r}", ResetCode.INTERNAL)


async def _run_handler(
    stream: Stream, handler: Handler, context: RPCContext, max_message_size: int
) -> None:
    if handler.stream_input:
        argument: Any = _incoming_requests(stream, max_message_size)
    else:
        argument = await _single_request(stream, handler.name, max_message_size)
    try:
        if handler.stream_output:
            async for item in handler.fn(argument, context):
                await write_message(stream, item)
            await stream.close_write()
        else:
            await write_message(stream, await handler.fn(argument, context), last=True)
    except (ConnectionClosed, asyncio.CancelledError):
        raise
    except Exception as e:  # the handler's own failure: report it to the caller
        if isinstance(e, ProtocolViolation) and handler.stream_input:
            raise
        logger.debug("handler %r raised for %s: %r", handler.name, context.remote_id, e)
        body = {"type": type(e).__name__, "message": str(e)}
        await write_message(stream, body, _KIND_ERROR, last=True)
    finally:
        if handler.stream_input:
            await argument.aclose()


async def _single_request(stream: Stream, name: str, max_message_size: int) -> Any:
    """The one request of a unary-input call, followed by the end of the stream."""
    message = await read_message(stream, max_message_size)
    if message is None:
        raise ProtocolViolation(f"call {name!r} from {stream.remote_peer_id} sent no request")
    kind, body = message
    if kind != _KIND_MESSAGE:
        raise ProtocolViolation(f"caller {stream.remote_peer_id} sent message kind {kind}")
    if await read_message(stream, max_message_size) is not None:
        raise ProtocolViolation(
            f"unary call {name!r} from {stream.remote_peer_id} sent 2+ requests"
        )
    return body


# ------------------------------------------------------------------------ calling


@functools.lru_cache(maxsize=4096)
def call_header(name: str, timeout: float | None) -> bytes:
    header = msgpack.packb({"h": name, "t": timeout})
    if len(header) > MAX_CALL_HEADER:
        raise ValidationError(
            f"handler name of {len(name)} characters is too long for a call header "
            f"(at most {MAX_CALL_HEADER} bytes)"
        )
    return header


def parse_call_header(header: bytes) -> tuple[str, float | None]:
    if len(header) > MAX_CALL_HEADER:
        raise ProtocolViolation(
            f"call header of {len(header)} bytes exceeds the limit of {MAX_CALL_HEADER} bytes"
        )
    return _parse_call_header(header)


@functools.lru_cache(maxsize=4096)
def _parse_call_header(header: bytes) -> tuple[str, float | None]:
    try:
        raw = msgpack.unpackb(header, raw=False)
        name, timeout = raw["h"], raw.get("t")
        if not isinstance(name, str) or not (
            timeout is None or (isinstance(timeout, int | float) and timeout > 0)
        ):
            raise ValueError(f"bad handler name {name!r} or timeout {timeout!r}")
    except Exception as e:
        raise ProtocolViolation(f"malformed call header: {e}") from None
    return name, float(timeout) if timeout is not None else None


async def _send_requests(stream: Stream, requests: Any) -> None:
    if hasattr(requests, "__aiter__"):
        async for request in requests:
            await write_message(stream, request)
    else:
        for request in requests:
            await write_message(stream, request)
    await stream.close_write()


async def iterate_responses(
    stream: Stream, requests: Any, *, max_message_size: int
) -> AsyncIterator[Any]:
    """Send requests (an iterable or async iterable) and yield each response.

    The stream is reset if the consumer stops early or is cancelled."""
    peer = stream.remote_peer_id
    sender = asyncio.ensure_future(_send_requests(stream, requests))
    finished = False
    try:
        while True:
            if sender.done() and sender.exception() is not None:
                raise sender.exception()
            message = await read_message(stream, max_message_size)
            if message is None:
                finished = True
                break
            kind, body = message
            if kind == _KIND_ERROR:
                finished = True
                raise remote_error(body, peer)
            yield body
        await sender
    finally:
        if not sender.done():
            sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        if not finished or not stream.closed:
            stream.reset("caller stopped reading")


async def unary_call(stream: Stream, request: Any, name: str, max_message_size: int) -> Any:
    """Client side of a unary call on a freshly opened stream (no helper tasks: this is the
    hot path of small RPCs). The stream is reset unless the call completes cleanly."""
    peer = stream.remote_peer_id
    done = False
    try:
        await write_message(stream, request, last=True)
        message = await read_message(stream, max_message_size)
        if message is None:
            raise ProtocolViolation(f"{peer} closed call {name!r} without answering")
        kind, body = message
        if await read_message(stream, max_message_size) is not None:
            raise ProtocolViolation(f"{peer} answered unary call {name!r} with 2+ messages")
        done = True
        if kind == _KIND_ERROR:
            raise remote_error(body, peer)
        return body
    finally:
        if not done:
            stream.reset(f"caller abandoned call {name!r}")


async def with_deadline(awaitable: Awaitable[Any], timeout: float | None, what: str) -> Any:
    try:
        async with asyncio.timeout(timeout):
            return await awaitable
    except TimeoutError:
        raise DeadlineExceeded(f"{what} did not finish within {timeout} s") from None


# ------------------------------------------------------------------------ servicers


class ServicerBase:
    """The one way a protocol is served: a class whose ``rpc_*`` methods are the protocol.

    ``grep "def rpc_"`` over the library lists the whole surface of the swarm. The shape
    of a method says its kind:

    - ``async def rpc_x(self, request, context)``: unary;
    - an ``async def`` generator: stream output;
    - a ``request`` annotated ``AsyncIterator``/``AsyncIterable``: stream input;
    - ``async def rpc_x(self, stream: Stream)``: a raw stream the method owns (bulk
      protocols such as the all-reduce's parts, which manage their own framing).

    Names: a servicer that sets ``rpc_prefix`` (on the class, or per instance when one
    protocol runs under several prefixes) serves ``rpc_x`` as ``"<rpc_prefix>.x"``, the
    house's wire names (``"dht.find"``). Without it, handlers register under
    ``"<namespace>.<ServicerClass>.rpc_x"``, hivemind's naming, so ported servicers keep
    theirs. A protocol that several objects of one peer share (one matchmaking handler
    routing by prefix to many averagers) is one servicer per peer, obtained with
    :meth:`swarmgrad.net.peer.Peer.shared_servicer`.
    """

    rpc_prefix: str | None = None

    def rpc_handlers(self, namespace: str | None = None) -> list[Handler]:
        handlers = []
        for attr in sorted(dir(type(self))):
            if not attr.startswith("rpc_") or attr == "rpc_handlers" or attr == "rpc_prefix":
                continue
            fn = getattr(self, attr)
            if not callable(fn):
                continue
            handlers.append(Handler(self._handler_name(attr, namespace), fn, *_handler_kind(fn)))
        return handlers

    def _handler_name(self, attr: str, namespace: str | None) -> str:
        if namespace is None and self.rpc_prefix:
            return f"{self.rpc_prefix}.{attr[len('rpc_') :]}"
        prefix = f"{namespace}." if namespace else ""
        return f"{prefix}{type(self).__name__}.{attr}"


RAW_STREAM = "raw"


def _handler_kind(fn: Callable[..., Any]) -> tuple[bool, bool | str]:
    """(stream_input, stream_output) from a method's shape; stream_output is
    :data:`RAW_STREAM` for a method that takes the stream itself."""
    params = list(inspect.signature(fn).parameters.values())
    annotation = params[0].annotation if params else inspect.Parameter.empty
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if len(params) == 1 and text.split(".")[-1] == "Stream":
        return False, RAW_STREAM
    stream_output = inspect.isasyncgenfunction(fn)
    stream_input = "AsyncIterator" in str(annotation) or "AsyncIterable" in str(annotation)
    return stream_input, stream_output


__all__ = ["RAW_STREAM", "Blob", "Handler", "RPCContext", "ServicerBase"]
