"""The donor side of state transfer: declare the state in the DHT and serve it in chunks.

A :class:`StateSharing` belongs to an averager. While ``allow_state_sharing`` is on it
declares the peer as a donor under ``<prefix>.all_averagers`` (see
:mod:`~swarmgrad.averaging.state.protocol`) and answers three RPCs:

``<prefix>.state.manifest`` ``{"v": 1}``
    Opens a download session on a snapshot of the state and answers
    ``{"status": "ok", "session": bytes, "priority": float, "manifest": {...},
    "metadata": Blob, "idle_timeout": float}``. The snapshot is taken (copied and hashed,
    in a worker thread) when a manifest is asked for, and shared by the sessions opened
    within ``snapshot_reuse_period`` of it, so concurrent joiners cost one copy, not one
    each. A donor refuses with ``{"status": "busy", "reason": ...}`` when it already
    serves ``max_concurrent_downloads`` sessions, and with ``"unavailable"`` when it does
    not share its state now: the downloader then turns to another donor at once.
``<prefix>.state.chunk`` ``{"session": bytes, "index": int}``
    ``{"status": "ok", "parts": [Blob, ...]}``: the chunk's bytes as zero-copy views into
    the snapshot, or ``{"status": "expired"}`` for an unknown or expired session.
``<prefix>.state.release`` ``{"session": bytes}``
    Ends a session early (a finished downloader frees its slot).

With ``state_compression`` (a codec, e.g. ``Float16Compression()``, or its name) the
snapshot's floating-point tensors are encoded with it after they are copied (outside the
owner's lock) and the chunks carry the encoded bytes: a joiner downloads less and decodes
each tensor back to its dtype and shape (see :mod:`~swarmgrad.averaging.state.chunks`).
Other tensors, and any the codec cannot take, are sent exact.

Everything runs on the event loop except the snapshot copy, encoding and hashing and a synchronous
``get_state`` callable, which run in a worker thread: a donor keeps averaging and
answering other RPCs while it serves downloads. Sessions end after ``session_idle_timeout``
seconds without a request and at the latest ``max_session_time`` after they began.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.averaging.state.chunks import (
    DEFAULT_CHUNK_SIZE,
    StateCompression,
    StateSnapshot,
    freeze_state,
    resolve_state_compression,
)
from swarmgrad.averaging.state.protocol import (
    BUSY,
    EXPIRED,
    OK,
    UNAVAILABLE,
    ChunkParts,
    ManifestOffer,
    StateRefusal,
    StateRPC,
    declaration_key,
    decode_chunk_request,
    decode_release_request,
    encode_declaration,
)
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import Blob, RPCContext, ServicerBase
from swarmgrad.utils.errors import ValidationError

__all__ = ["StateSharing"]

logger = logging.getLogger(__name__)

GetState = Callable[[], Any]  # () -> (metadata, tensors), or an awaitable of it
SESSION_ID_BYTES = 16


@dataclass
class _Session:
    peer: PeerID
    snapshot: StateSnapshot
    started: float
    last_used: float
    chunks_served: int = 0


@dataclass(frozen=True)
class _Frozen:
    taken: float  # loop time
    priority: float
    snapshot: StateSnapshot


@dataclass
class SharingStats:
    """Counters for tests, benchmarks and monitoring."""

    manifests_served: int = 0
    refused_busy: int = 0
    chunks_served: int = 0
    bytes_served: int = 0
    snapshots_taken: int = 0


class StateSharing(ServicerBase):
    """Declare and serve this peer's state (see the module docstring).

    ``get_state()`` returns ``(metadata, tensors)``: metadata any msgpack-able object,
    tensors a list of torch tensors. It may be a coroutine function (runs on the loop) or
    a plain function (runs in a worker thread, so it may take locks and be slow).
    ``priority`` is a number or a function returning one, evaluated at every declaration
    and every snapshot; higher priorities are downloaded first.

    A snapshot copies the tensors (``copy_state=False`` serves them as they are, for a
    ``get_state`` that already returns private copies). Pass the owner's tensor lock as
    ``state_lock`` (a ``threading.Lock`` or any context manager): it is held, in a worker
    thread, while ``get_state`` runs and the tensors are copied, so a snapshot never sees
    a half-updated state; hashing follows outside the lock. (A ``get_state`` that takes
    the same lock itself needs a reentrant lock, ``threading.RLock``.)

    ``state_compression`` (default: none) encodes the floating-point tensors of each
    snapshot, after the copy and outside the lock (see the module docstring).

    ``bandwidth``: the link rate the averager announces, declared so that joiners ask
    faster donors first (:func:`~.protocol.order_donors`).

    Call :meth:`start` on the event loop, and ``await shutdown()`` to withdraw.
    """

    def __init__(
        self,
        peer: Peer,
        dht_node: DHTNode,
        *,
        prefix: str,
        get_state: GetState,
        priority: float | Callable[[], float] = 0.0,
        allow_state_sharing: bool = True,
        declare_state_period: float = 30.0,
        chunk_size_bytes: int = DEFAULT_CHUNK_SIZE,
        max_concurrent_downloads: int = 4,
        session_idle_timeout: float = 60.0,
        max_session_time: float = 1800.0,
        snapshot_reuse_period: float = 5.0,
        copy_state: bool = True,
        state_lock: contextlib.AbstractContextManager | None = None,
        state_compression: StateCompression = None,
        bandwidth: float | None = None,
    ):
        if declare_state_period <= 0 or session_idle_timeout <= 0 or max_session_time <= 0:
            raise ValidationError("state sharing periods and timeouts must be positive")
        if max_concurrent_downloads < 1:
            raise ValidationError(
                f"max_concurrent_downloads must be >= 1, got {max_concurrent_downloads}"
            )
        self.peer, self.dht_node, self.prefix = peer, dht_node, prefix
        self.get_state = get_state
        self._priority = priority
        self._allow = bool(allow_state_sharing)
        self.declare_state_period = declare_state_period
        self.chunk_size_bytes = chunk_size_bytes
        self.max_concurrent_downloads = max_concurrent_downloads
        self.session_idle_timeout = session_idle_timeout
        self.max_session_time = max_session_time
        self.snapshot_reuse_period = snapshot_reuse_period
        self.copy_state = copy_state
        self.state_lock = state_lock
        self.state_compression = resolve_state_compression(state_compression)
        self.bandwidth = bandwidth
        self.rpc = StateRPC.for_prefix(prefix)
        self.rpc_prefix = f"{prefix}.state"  # rpc_manifest serves "<prefix>.state.manifest"
        self.key = declaration_key(prefix)
        self.stats = SharingStats()
        self._sessions: dict[bytes, _Session] = {}
        self._opening = 0  # manifest requests waiting for a snapshot (they hold a slot)
        self._snapshot: _Frozen | None = None  # the latest snapshot
        self._building: asyncio.Future[_Frozen] | None = None
        self._declared_until: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Register the RPC handlers and start declaring (call on the event loop)."""
        if self._loop is not None:
            raise ValidationError("this StateSharing has already been started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.peer.add_servicer(self)
        self._tasks = [
            self._loop.create_task(self._declare_loop(), name=f"declare {self.key}"),
            self._loop.create_task(self._expire_loop(), name=f"expire {self.key} sessions"),
        ]

    async def shutdown(self, withdraw_timeout: float = 5.0) -> None:
        """Stop serving, withdraw the declaration (bounded by ``withdraw_timeout``) and
        drop every session and snapshot."""
        if self._closed:
            return
        self._closed = True
        self.peer.remove_servicer(self)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._building is not None and not self._building.done():
            self._building.cancel()
            await asyncio.gather(self._building, return_exceptions=True)
        if self._declared_until is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(withdraw_timeout):
                    await self._withdraw()
        self._sessions.clear()
        self._snapshot = None

    # ------------------------------------------------------------------ settings

    @property
    def allow_state_sharing(self) -> bool:
        return self._allow

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        """Safe from any thread: declaring or withdrawing follows at once."""
        self._allow = bool(value)
        self.declare_now()

    @property
    def priority(self) -> float:
        value = self._priority() if callable(self._priority) else self._priority
        return float(value)

    @priority.setter
    def priority(self, value: float | Callable[[], float]) -> None:
        self._priority = value
        self.declare_now()

    def declare_now(self) -> None:
        """Refresh the declaration now rather than at the next period (any thread)."""
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ declarations

    async def _declare_loop(self) -> None:
        while True:
            try:
                if self._allow:
                    await self._declare()
                elif self._declared_until is not None:
                    await self._withdraw()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT may be briefly unreachable: try next period
                logger.warning("could not update the state declaration under %s: %r", self.key, e)
            assert self._wake is not None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.declare_state_period):
                    await self._wake.wait()
            self._wake.clear()

    async def _declare(self) -> None:
        digest = size = None
        if self._snapshot is not None:
            manifest = self._snapshot.snapshot.manifest
            digest, size = manifest.root_digest, manifest.total_bytes
        maddrs = [str(m) for m in self.peer.get_visible_maddrs()]
        value = encode_declaration(self.priority, maddrs, digest, size, self.bandwidth)
        expiration = self.dht_node.time_fn() + 2 * self.declare_state_period
        if self._declared_until is not None:
            expiration = max(expiration, self._declared_until + 1e-3)
        await self.dht_node.store(self.key, value, expiration, subkey=self.peer.peer_id.to_base58())
        self._declared_until = expiration

    async def _withdraw(self) -> None:
        """Delete our subkey: a tombstone that expires after the last declaration did."""
        if self._declared_until is None:
            return
        expiration = max(self._declared_until, self.dht_node.time_fn()) + 1.0
        await self.dht_node.store(self.key, None, expiration, subkey=self.peer.peer_id.to_base58())
        self._declared_until = None

    # ------------------------------------------------------------------ sessions

    async def _expire_loop(self) -> None:
        period = min(self.session_idle_timeout, self.max_session_time) / 2
        while True:
            await asyncio.sleep(period)
            self._expire_sessions()

    def _expire_sessions(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        for session_id, session in list(self._sessions.items()):
            if (
                now - session.last_used > self.session_idle_timeout
                or now - session.started > self.max_session_time
            ):
                logger.debug("download session of %s expired", session.peer)
                del self._sessions[session_id]
        if self._snapshot is not None and not self._sessions:
            if now - self._snapshot.taken > self.snapshot_reuse_period:
                self._snapshot = None  # nobody downloads it: free the memory
                if self._building is not None and self._building.done():
                    self._building = None  # a finished build's result is that snapshot too

    async def _get_snapshot(self) -> _Frozen:
        assert self._loop is not None
        priority = self.priority
        latest = self._snapshot
        if latest is not None:
            fresh = self._loop.time() - latest.taken <= self.snapshot_reuse_period
            if fresh and latest.priority == priority:
                return latest
        if self._building is None or self._building.done():
            self._building = asyncio.ensure_future(self._take_snapshot(priority))
        return await asyncio.shield(self._building)

    async def _take_snapshot(self, priority: float) -> _Frozen:
        assert self._loop is not None
        if inspect.iscoroutinefunction(self.get_state):
            state = await self.get_state()
            frozen = await asyncio.to_thread(self._freeze, state)
        else:
            frozen = await asyncio.to_thread(self._get_and_freeze)
        snapshot = await asyncio.to_thread(
            StateSnapshot.from_frozen,
            *frozen,
            self.chunk_size_bytes,
            compression=self.state_compression,
        )
        self._snapshot = _Frozen(self._loop.time(), priority, snapshot)
        self.stats.snapshots_taken += 1
        return self._snapshot

    def _get_and_freeze(self) -> tuple[bytes, list[torch.Tensor]]:
        with self.state_lock or contextlib.nullcontext():
            state = self.get_state()
            if inspect.isawaitable(state):
                raise ValidationError("get_state returned an awaitable from a plain function")
            return self._freeze_locked(state)

    def _freeze(self, state: Any) -> tuple[bytes, list[torch.Tensor]]:
        with self.state_lock or contextlib.nullcontext():
            return self._freeze_locked(state)

    def _freeze_locked(self, state: Any) -> tuple[bytes, list[torch.Tensor]]:
        """Copy the state (the caller holds ``state_lock``); hashing happens later,
        outside the lock."""
        if not isinstance(state, list | tuple) or len(state) != 2:
            raise ValidationError(
                f"get_state must return (metadata, tensors), got {type(state).__name__}"
            )
        metadata, tensors = state
        if not isinstance(tensors, list | tuple):
            raise ValidationError(
                f"get_state must return (metadata, tensors), got tensors of type "
                f"{type(tensors).__name__}"
            )
        return freeze_state(metadata, list(tensors), copy=self.copy_state)

    # ------------------------------------------------------------------ handlers

    async def rpc_manifest(self, request: Any, context: RPCContext) -> dict[str, Any]:
        """Open a download session on a snapshot of our state (or say why not)."""
        return (await self._open_session(context)).encode()

    async def _open_session(self, context: RPCContext) -> ManifestOffer | StateRefusal:
        me = self.peer.peer_id
        if not self._allow or self._closed:
            return StateRefusal(UNAVAILABLE, f"{me} does not share its state now")
        self._expire_sessions()
        for session_id, session in list(self._sessions.items()):
            if session.peer == context.remote_id:  # one session per downloader
                del self._sessions[session_id]
        if len(self._sessions) + self._opening >= self.max_concurrent_downloads:
            self.stats.refused_busy += 1
            return StateRefusal(
                BUSY, f"{me} already serves {self.max_concurrent_downloads} downloads"
            )
        self._opening += 1
        try:
            frozen = await self._get_snapshot()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                # shutdown cancelled the snapshot, not this call: answer instead of vanishing
                return StateRefusal(UNAVAILABLE, f"{me} is shutting down")
            raise
        except Exception as e:
            logger.warning("could not snapshot the state for %s: %r", context.remote_id, e)
            return StateRefusal(UNAVAILABLE, f"{me} could not snapshot its state: {e}")
        finally:
            self._opening -= 1
        assert self._loop is not None
        now = self._loop.time()
        session_id = os.urandom(SESSION_ID_BYTES)
        snapshot = frozen.snapshot
        self._sessions[session_id] = _Session(context.remote_id, snapshot, now, now)
        self.stats.manifests_served += 1
        return ManifestOffer(
            session_id,
            frozen.priority,
            snapshot.manifest.to_wire(),
            Blob(snapshot.metadata),
            self.session_idle_timeout,
        )

    async def rpc_chunk(self, message: Any, context: RPCContext) -> dict[str, Any]:
        """One chunk of a session's snapshot."""
        request = decode_chunk_request(message)
        index = request.index
        session = self._sessions.get(request.session) if request.session is not None else None
        if session is None or session.peer != context.remote_id:
            return StateRefusal(EXPIRED, "no such download session (expired?)").encode()
        num_chunks = session.snapshot.manifest.num_chunks
        if type(index) is not int or not 0 <= index < num_chunks:
            raise ValidationError(f"chunk index {index!r} is out of range [0, {num_chunks})")
        assert self._loop is not None
        session.last_used = self._loop.time()
        parts = self._chunk_parts(session.snapshot, index)
        session.chunks_served += 1
        self.stats.chunks_served += 1
        self.stats.bytes_served += sum(len(p) for p in parts)
        return ChunkParts([Blob(p) for p in parts]).encode()

    def _chunk_parts(self, snapshot: StateSnapshot, index: int) -> list[Any]:
        """The bytes of one chunk (a separate method so tests can make a lying donor)."""
        return snapshot.chunk(index)

    async def rpc_release(self, message: Any, context: RPCContext) -> dict[str, Any]:
        """The downloader is done: free its session."""
        session_id = decode_release_request(message).session
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is not None and session.peer == context.remote_id:
            del self._sessions[session_id]
        return {"status": str(OK)}

    # ------------------------------------------------------------------ introspection

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)
