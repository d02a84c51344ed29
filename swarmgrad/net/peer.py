"""A peer: one identity, its listeners, a pool of connections, and its RPC handlers.

Every subsystem of a process (DHT, expert server, averagers) registers handlers on the same
:class:`Peer` and calls other peers through it. A peer reaches another by PeerID (over an
existing connection or a known address) or by multiaddr. Concurrent dials to the same
peer share one connection, and a connection opened by either side is reused by both.

With an admission authority (``authority=``, see :mod:`swarmgrad.net.admission`) every
connection is admitted in its handshake and every inbound call is checked against the
caller's role; a background task renews this peer's token and closes connections whose
token expired or was revoked.

The peer runs on any backend: :class:`~swarmgrad.net.tcp.TCPBackend` (real TCP + TLS) or
the simulated network; the protocol code above never knows which.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from swarmgrad.net import relay, rpc
from swarmgrad.net.admission import Admission, make_admission
from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.mux import IDLE_REASON, Connection, Stream
from swarmgrad.utils.checks import optional_positive_seconds
from swarmgrad.utils.errors import (
    ConnectionClosed,
    ConnectionIdleClosed,
    DeadlineExceeded,
    HandshakeError,
    PeerUnreachable,
    ProtocolViolation,
    SwarmgradError,
    ValidationError,
)

logger = logging.getLogger(__name__)

RAW_PROTOCOL_PREFIX = b"\x00raw:"  # stream headers of non-RPC protocols (e.g. relays)
RENEW_TOKEN = "admission.renew"  # a peer presents its renewed token on a live connection
MAX_ADDRESSES_PER_PEER = 16
# Peers whose addresses we keep. A long-lived peer hears of many others (DHT answers,
# averaging groups, expert records), most never again: the book keeps the most recently
# heard-of and never forgets a peer it is connected to.
MAX_KNOWN_PEERS = 10_000
_S = TypeVar("_S", bound=rpc.ServicerBase)


class AdmissionServicer(rpc.ServicerBase):
    """``admission.renew`` (:data:`RENEW_TOKEN`): a peer whose token was renewed presents
    it on each live connection, so the connection outlives the old token's expiry."""

    rpc_prefix = "admission"

    def __init__(self, admission: Admission):
        self.admission = admission

    async def rpc_renew(self, request: Any, context: rpc.RPCContext) -> dict:
        """The caller presents its renewed token for the connection it calls on."""
        raw = request.get("token") if isinstance(request, dict) else None
        if not isinstance(raw, bytes):
            raise ValidationError(f"{RENEW_TOKEN} expects {{'token': <token bytes>}}")
        token = self.admission.check(raw, context.remote_id)
        conn = context.stream.conn
        if conn.remote_token is None or token.expires_at >= conn.remote_token.expires_at:
            conn.remote_token = token
        return {"ok": True}


class Peer:
    """Use :meth:`create` (async) to build one; :meth:`shutdown` closes everything it owns."""

    def __init__(
        self,
        identity: Identity,
        backend: Any,
        *,
        client_mode: bool = False,
        announce_maddrs: Iterable[str | Multiaddr] = (),
        max_message_size: int = rpc.DEFAULT_MAX_MESSAGE_SIZE,
        max_concurrent_calls_per_peer: int = 256,
        handshake_timeout: float = 10.0,
        dial_timeout: float = 15.0,
        max_connections: int = 4096,
        keepalive_interval: float | None = 30.0,
        keepalive_timeout: float = 20.0,
        idle_timeout: float | None = 300.0,
        admission: Admission | None = None,
    ):
        self.identity = identity
        self.admission = admission
        if admission is not None:
            admission.bind(identity.peer_id)  # first: refuses a token that cannot work
        self.peer_id: PeerID = identity.peer_id
        self.client_mode = client_mode
        self.max_message_size = max_message_size
        self.max_concurrent_calls_per_peer = max_concurrent_calls_per_peer
        self.handshake_timeout = handshake_timeout
        self.dial_timeout = dial_timeout
        self.max_connections = max_connections
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.idle_timeout = optional_positive_seconds("idle_timeout", idle_timeout)
        self._backend = backend
        self._announce = [Multiaddr.parse(m) for m in announce_maddrs]
        self._listen_maddrs: list[Multiaddr] = []
        self._handlers: dict[str, rpc.Handler] = {}
        self._raw_protocols: dict[str, Callable[[Stream], Any]] = {}
        self._shared_servicers: dict[type, rpc.ServicerBase] = {}
        self._connections: dict[PeerID, Connection] = {}
        self._all_connections: set[Connection] = set()
        self._dialing: dict[Any, asyncio.Future[Connection]] = {}
        # immutable tuples, replaced on change: callers may cache what they derive from one
        self._addresses: dict[PeerID, tuple[Multiaddr, ...]] = {}
        self.address_book_version = 0  # counts changes of _addresses, for callers' caches
        self._inflight: dict[PeerID, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._relayed_addrs: list[Multiaddr] = []
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._keepalive: asyncio.Task | None = None
        if keepalive_interval is not None or idle_timeout is not None:
            self._keepalive = asyncio.ensure_future(self._keep_connections_alive())
        self.relay_client: relay.RelayClient | None = None  # reservations (client mode)
        self.relay_service: relay.RelayService | None = None  # relaying for others
        self._admission_task: asyncio.Task | None = None
        if admission is not None:
            if hasattr(backend, "admission_token"):
                backend.admission_token = lambda: admission.token_bytes
            self.add_servicer(AdmissionServicer(admission))
            self._admission_task = asyncio.ensure_future(self._maintain_admission())

    # ------------------------------------------------------------------ construction

    @classmethod
    async def create(
        cls,
        *,
        identity: Identity | None = None,
        identity_path: str | None = None,
        host_maddrs: Iterable[str | Multiaddr] = ("/ip4/127.0.0.1/tcp/0",),
        backend: Any = None,
        relays: Iterable[str | Multiaddr] = (),
        allow_relay: bool = True,
        relay_wait_timeout: float = 30.0,
        authority: Any = None,
        access_token: Any = None,
        **kwargs: Any,
    ) -> Peer:
        """Start a peer.

        With ``authority`` (the authority's public key, its file, or an
        :class:`~swarmgrad.net.admission.Admission`) the peer admits only peers presenting
        a valid token from that authority, and presents ``access_token`` (a token file,
        re-read to renew; a callable; a token) itself.

        With ``client_mode=True`` no listener is opened; the peer then keeps reservations on
        ``relays`` (public peers) so that others can call it through them, and waits up to
        ``relay_wait_timeout`` for the first one. A public peer relays for others unless
        ``allow_relay=False``.
        """
        if identity is None:
            identity = (
                Identity.load_or_create(identity_path) if identity_path else Identity.generate()
            )
        if backend is None:
            from swarmgrad.net.tcp import TCPBackend

            backend = TCPBackend(identity)
        admission = make_admission(authority, access_token)
        if admission is not None:
            kwargs["admission"] = admission
        peer = cls(identity, backend, **kwargs)
        try:
            if not peer.client_mode:
                for maddr in host_maddrs:
                    await peer.listen(maddr)
                peer.relay_service = relay.RelayService(peer, allow_relay=allow_relay)
            relay_addrs = [Multiaddr.parse(m) for m in relays]
            if relay_addrs:
                peer.relay_client = relay.RelayClient(peer, relay_addrs)
                peer.relay_client.start()
                await peer.relay_client.wait_ready(relay_wait_timeout)
        except BaseException:
            await peer.shutdown()
            raise
        return peer

    async def listen(self, maddr: str | Multiaddr) -> list[Multiaddr]:
        address = Multiaddr.parse(maddr, allow_port_zero=True)
        bound = await self._backend.listen(address, self._make_inbound_connection)
        self._listen_maddrs.extend(bound)
        logger.debug("%s listening on %s", self.peer_id, bound)
        return bound

    def get_visible_maddrs(self) -> list[Multiaddr]:
        """Addresses other peers can dial to reach us, each ending in /p2p/<our id>."""
        base = self._announce or self._listen_maddrs
        maddrs = [m.with_peer_id(self.peer_id) for m in base]
        return maddrs + list(self._relayed_addrs)

    # ------------------------------------------------------------------ handlers

    def add_handler(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        stream_input: bool = False,
        stream_output: bool = False,
    ) -> None:
        """Register ``async fn(request, context)`` (an async generator if stream_output)."""
        if name in self._handlers:
            raise ValidationError(f"a handler named {name!r} is already registered")
        if inspect.isasyncgenfunction(fn) != stream_output:
            kind = "an async generator" if stream_output else "a coroutine function"
            raise ValidationError(
                f"handler {name!r} must be {kind} (stream_output={stream_output})"
            )
        self._handlers[name] = rpc.Handler(name, fn, stream_input, stream_output)

    def remove_handler(self, name: str) -> None:
        self._handlers.pop(name, None)

    def add_servicer(self, servicer: rpc.ServicerBase, namespace: str | None = None) -> None:
        """Serve every ``rpc_*`` method of ``servicer`` (see :class:`rpc.ServicerBase`)."""
        handlers = servicer.rpc_handlers(namespace)
        registered = self._handlers.keys() | self._raw_protocols.keys()
        taken = [h.name for h in handlers if h.name in registered]
        if taken:
            raise ValidationError(f"handlers named {taken} are already registered")
        for handler in handlers:
            if handler.stream_output == rpc.RAW_STREAM:
                self.add_protocol_handler(handler.name, handler.fn)
            else:
                self.add_handler(
                    handler.name,
                    handler.fn,
                    stream_input=handler.stream_input,
                    stream_output=handler.stream_output,
                )

    def remove_servicer(self, servicer: rpc.ServicerBase, namespace: str | None = None) -> None:
        """Stop serving ``servicer``'s methods (those still registered to it)."""
        for handler in servicer.rpc_handlers(namespace):
            registered = self._handlers.get(handler.name)
            if registered is not None and registered.fn == handler.fn:
                del self._handlers[handler.name]
            if self._raw_protocols.get(handler.name) == handler.fn:
                del self._raw_protocols[handler.name]
        for cls, shared in list(self._shared_servicers.items()):
            if shared is servicer:
                del self._shared_servicers[cls]

    def shared_servicer(self, cls: type[_S], *args: Any, **kwargs: Any) -> _S:
        """This peer's one instance of ``cls``, created and served on first use.

        For protocols that several objects of one peer share: every averager of a peer
        meets others through one ``averaging.join_group`` handler that routes by prefix.
        The instance lives as long as the peer (or until :meth:`remove_servicer`)."""
        servicer = self._shared_servicers.get(cls)
        if servicer is None:
            servicer = cls(*args, **kwargs)
            self.add_servicer(servicer)
            self._shared_servicers[cls] = servicer
        return servicer  # type: ignore[return-value]

    def add_protocol_handler(self, protocol: str, fn: Callable[[Stream], Any]) -> None:
        """A raw stream protocol: ``async fn(stream)`` owns the stream (e.g. the relay)."""
        self._raw_protocols[protocol] = fn

    # ------------------------------------------------------------------ addresses & connections

    def add_addresses(self, peer_id: PeerID, maddrs: Iterable[str | Multiaddr]) -> None:
        """Remember where ``peer_id`` can be dialed. At most MAX_ADDRESSES_PER_PEER are
        kept, the most recently added: a peer that announces a new address on every
        message cannot grow our address book without bound."""
        known = self._addresses.pop(peer_id, ())
        added = list(known)
        for maddr in maddrs:
            address = Multiaddr.parse(maddr)
            if address not in added:
                added.append(address)
        # re-inserted either way: the book's order is "least recently heard of" first
        self._addresses[peer_id] = tuple(added[-MAX_ADDRESSES_PER_PEER:])
        if len(added) != len(known):
            self.address_book_version += 1
            if not known and len(self._addresses) > MAX_KNOWN_PEERS:
                self._forget_least_recent_address()

    def _forget_least_recent_address(self) -> None:
        """Drop the addresses of the peer heard of longest ago that is not connected."""
        for stale in self._addresses:
            if not self.is_connected(stale):
                del self._addresses[stale]
                return

    def addresses_of(self, peer_id: PeerID) -> tuple[Multiaddr, ...]:
        """The addresses known for ``peer_id`` (the same tuple until they change)."""
        return self._addresses.get(peer_id, ())

    def is_connected(self, peer_id: PeerID) -> bool:
        conn = self._connections.get(peer_id)
        return conn is not None and conn.is_alive

    @property
    def bytes_sent(self) -> int:
        """Bytes this peer wrote to its sockets (TLS records included; 0 on the simulated
        network, which does not count)."""
        traffic = getattr(self._backend, "traffic", None)
        return traffic.sent if traffic is not None else 0

    @property
    def bytes_received(self) -> int:
        """Bytes this peer read from its sockets (see :attr:`bytes_sent`)."""
        traffic = getattr(self._backend, "traffic", None)
        return traffic.received if traffic is not None else 0

    @property
    def connected_peers(self) -> list[PeerID]:
        return [pid for pid, conn in self._connections.items() if conn.is_alive]

    async def connect(self, maddr: str | Multiaddr) -> PeerID:
        """Dial an address (reusing a live connection to its PeerID) and return the PeerID."""
        address = Multiaddr.parse(maddr)
        conn = await self._connection_to_address(address)
        return conn.remote_peer_id

    async def _get_connection(self, peer: PeerID | str | Multiaddr) -> Connection:
        if isinstance(peer, PeerID):
            conn = self._connections.get(peer)
            if conn is not None and conn.is_alive:
                return conn
            return await self._dial_peer(peer)
        return await self._connection_to_address(Multiaddr.parse(peer))

    async def _connection_to_address(self, address: Multiaddr) -> Connection:
        if address.peer_id is not None:
            conn = self._connections.get(address.peer_id)
            if conn is not None and conn.is_alive:
                return conn
            self.add_addresses(address.peer_id, [address])
        return await self._coalesced_dial(address.peer_id or address, address)

    async def _dial_peer(self, peer_id: PeerID) -> Connection:
        addresses = list(self._addresses.get(peer_id, ()))
        if not addresses:
            raise PeerUnreachable(f"no connection to {peer_id} and no known address for it")
        return await self._coalesced_dial(peer_id, *addresses)

    async def _coalesced_dial(self, key: Any, *addresses: Multiaddr) -> Connection:
        pending = self._dialing.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._dial_any(addresses))
            self._dialing[key] = pending
            pending.add_done_callback(functools.partial(self._dial_done, key))
        try:
            return await asyncio.shield(pending)
        finally:  # a failed dial's error, kept by the task, has this frame in its traceback
            del pending

    def _dial_done(self, key: Any, dial: asyncio.Future[Connection]) -> None:
        """A coalesced dial ended. Its error is marked as seen: every caller may have
        given up waiting (their own timeouts), and asyncio would report it as never
        retrieved; each caller that still waits gets it all the same."""
        self._dialing.pop(key, None)
        if not dial.cancelled():
            dial.exception()

    async def _dial_any(self, addresses: tuple[Multiaddr, ...]) -> Connection:
        errors: list[BaseException] = []
        for address in addresses:
            try:
                return await self._dial(address)
            except (OSError, SwarmgradError, TimeoutError) as e:
                errors.append(e)
        if len(errors) == 1:
            error = errors.pop()
        else:
            error = PeerUnreachable(
                "could not reach any address: "
                + "; ".join(f"{a}: {e}" for a, e in zip(addresses, errors, strict=True))
            )
            errors.clear()
        try:
            raise error
        finally:  # this frame is in the error's traceback: it must not hold the error
            del error

    async def _dial(self, address: Multiaddr) -> Connection:
        if self._closed:
            raise ConnectionClosed(f"peer {self.peer_id} is shut down")
        if address.peer_id == self.peer_id:
            raise ValidationError(f"{address} is our own address")
        conn = self._new_connection(is_dialer=True, expected_peer_id=address.peer_id)
        try:
            async with asyncio.timeout(self.dial_timeout):
                if address.is_relayed:
                    await relay.dial_via_relay(self, address, conn)
                else:
                    await self._backend.dial(address, conn)
                await conn.handshake_done
        except TimeoutError:
            conn.abort(HandshakeError(f"handshake with {address} timed out"))
            raise PeerUnreachable(
                f"{address} did not answer within {self.dial_timeout} s"
            ) from None
        except OSError as e:
            conn.abort(PeerUnreachable(str(e)))
            raise PeerUnreachable(f"cannot connect to {address}: {e}") from None
        except BaseException as e:
            conn.abort(e if isinstance(e, SwarmgradError) else ConnectionClosed(repr(e)))
            raise
        return conn

    def _new_connection(self, *, is_dialer: bool, expected_peer_id: PeerID | None = None):
        conn = Connection(
            self.identity,
            is_dialer=is_dialer,
            expected_peer_id=expected_peer_id,
            on_stream=self._on_stream,
            on_close=self._on_connection_closed,
            admission=self.admission,
        )
        self._all_connections.add(conn)
        conn.handshake_done.add_done_callback(lambda f: self._on_handshake(conn, f))
        return conn

    def _make_inbound_connection(self) -> Connection:
        """Protocol factory for listeners: a connection with a handshake watchdog."""
        conn = self._new_connection(is_dialer=False)
        if len(self._all_connections) > self.max_connections or self._closed:
            asyncio.get_running_loop().call_soon(
                conn.abort, ConnectionClosed("too many connections")
            )
            return conn
        self._arm_handshake_watchdog(conn)
        return conn

    def _arm_handshake_watchdog(self, conn: Connection) -> None:
        """Drop an inbound connection whose handshake does not finish in time (slowloris)."""
        timer = asyncio.get_running_loop().call_later(
            self.handshake_timeout, self._handshake_deadline, conn
        )
        conn.handshake_done.add_done_callback(lambda _: timer.cancel())

    def _handshake_deadline(self, conn: Connection) -> None:
        if not conn.handshake_done.done():
            logger.debug("inbound handshake from %s timed out", conn.remote_address)
            conn.abort(HandshakeError(f"handshake not finished in {self.handshake_timeout} s"))

    def _on_handshake(self, conn: Connection, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        peer_id = future.result()
        if self._closed:
            conn.close("peer is shutting down")
            return
        self._connections[peer_id] = conn

    def _on_connection_closed(self, conn: Connection) -> None:
        self._all_connections.discard(conn)
        if conn.remote_peer_id is not None and self._connections.get(conn.remote_peer_id) is conn:
            del self._connections[conn.remote_peer_id]

    # ------------------------------------------------------------------ inbound streams

    def _on_stream(self, stream: Stream) -> None:
        self._spawn(self._serve_stream(stream))

    async def _serve_stream(self, stream: Stream) -> None:
        header = stream.header
        if header.startswith(RAW_PROTOCOL_PREFIX):
            name = header[len(RAW_PROTOCOL_PREFIX) :].decode("utf-8", "replace")
            fn = self._raw_protocols.get(name)
            if fn is None:
                stream.reset(f"unknown protocol {name!r}")
                return
            if self.admission is not None:
                denied = self._access_denied(stream, name)
                if denied is not None:
                    stream.reset(f"access denied: {denied}")
                    return
            try:
                await fn(stream)
            except SwarmgradError as e:
                logger.debug("protocol %r with %s failed: %s", name, stream.remote_peer_id, e)
                stream.reset(str(e))
            return
        try:
            name, timeout = rpc.parse_call_header(header)
        except ProtocolViolation as e:
            stream.reset(str(e))
            return
        serve = functools.partial(
            rpc.serve_call,
            stream,
            self._handlers.get(name),
            handler_name=name,
            timeout=timeout,
            max_message_size=self.max_message_size,
        )
        remote = stream.remote_peer_id
        if self.admission is not None:
            denied = self._access_denied(stream, name)
            if denied is not None:
                await serve(refuse_reason=denied, refuse_type="AccessDenied")
                return
        inflight = self._inflight
        in_flight = inflight.get(remote, 0)
        refuse = None
        if in_flight >= self.max_concurrent_calls_per_peer:
            refuse = (
                f"{remote} already has {in_flight} calls in flight on "
                f"{self.peer_id} (limit {self.max_concurrent_calls_per_peer})"
            )
        inflight[remote] = in_flight + 1
        try:
            await serve(refuse_reason=refuse)
        finally:
            left = inflight[remote] - 1
            if left > 0:
                inflight[remote] = left
            else:
                del inflight[remote]

    def _access_denied(self, stream: Stream, name: str) -> str | None:
        """Why the caller's role may not call ``name`` here, or None if it may."""
        token = stream.conn.remote_token
        role = token.role if token is not None else None
        if self.admission.allows(role, name):
            return None
        role_name = role.value if role is not None else "no role"
        logger.warning(
            "admission: refused %r to %s (role %s does not allow it)", name, stream.remote_peer_id,
            role_name,
        )  # fmt: skip
        return (
            f"the {role_name} token of {stream.remote_peer_id} does not allow calling {name!r} "
            f"on {self.peer_id}"
        )

    # ------------------------------------------------------------------ admission upkeep

    async def _maintain_admission(self) -> None:
        while True:
            await asyncio.sleep(self.admission.check_interval)
            try:
                await self.admission_tick()
            except Exception:
                logger.exception("admission upkeep failed; trying again in %s s",
                                 self.admission.check_interval)  # fmt: skip

    async def admission_tick(self) -> None:
        """Renew our token if due (and present the new one on every live connection),
        then close connections whose remote token expired or was revoked. Runs every
        ``check_interval`` seconds; tests call it directly."""
        admission = self.admission
        if admission.needs_renewal() and await admission.renew():
            context = getattr(self._backend, "_server_context", None)
            if context is not None:
                context()  # build the certificate with the new token before it is needed
            request = {"token": admission.token_bytes}
            live = [pid for pid, conn in self._connections.items() if conn.is_alive]
            results = await asyncio.gather(
                *(self.call(pid, RENEW_TOKEN, request, timeout=10.0) for pid in live),
                return_exceptions=True,
            )
            for pid, result in zip(live, results, strict=True):
                if isinstance(result, BaseException):
                    logger.debug("could not present the renewed token to %s: %s", pid, result)
        self.enforce_admission()

    def enforce_admission(self) -> int:
        """Close every connection whose remote token no longer admits it; how many."""
        closed = 0
        for conn in list(self._all_connections):
            token = conn.remote_token
            if token is None or not conn.is_alive:
                continue
            problem = self.admission.problem_with(token)
            if problem is not None:
                reason, message = problem
                logger.warning("admission: closing the connection to %s: %s",
                               conn.remote_peer_id, message)  # fmt: skip
                conn.refuse(reason.value, message)
                closed += 1
        return closed

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ outbound calls

    async def open_stream(self, peer: PeerID | str | Multiaddr, protocol: str) -> Stream:
        """Open a raw stream for a custom protocol registered with add_protocol_handler."""
        conn = await self._get_connection(peer)
        return conn.open_stream(RAW_PROTOCOL_PREFIX + protocol.encode())

    async def call(
        self,
        peer: PeerID | str | Multiaddr,
        name: str,
        request: Any,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Unary call: one request, one response. Raises DeadlineExceeded after timeout
        seconds (the remote handler is cancelled too) and RemoteError subclasses for the
        handler's own errors."""

        async def run() -> Any:
            for attempt in range(2):
                conn = self._connections.get(peer) if isinstance(peer, PeerID) else None
                if conn is None or not conn.is_alive:
                    conn = await self._get_connection(peer)
                stream = conn.open_stream(rpc.call_header(name, timeout))
                try:
                    return await rpc.unary_call(stream, request, name, self.max_message_size)
                except ConnectionIdleClosed:
                    # the remote closed the connection as idle while our request was on
                    # its way: it never saw the request, so send it once more on a new one
                    if attempt:
                        raise
            raise AssertionError("unreachable")

        if timeout is None:
            return await run()
        return await rpc.with_deadline(run(), timeout, f"call {name!r} to {peer}")

    async def iterate(
        self,
        peer: PeerID | str | Multiaddr,
        name: str,
        requests: Any,
        *,
        timeout: float | None = None,
        stream_input: bool | None = None,
    ) -> AsyncIterator[Any]:
        """Streaming call: send ``requests`` and yield the responses as they arrive.

        ``requests`` is one request, or with ``stream_input=True`` an iterable or async
        iterable of them (an async iterable is taken as a stream unless told otherwise)."""
        if stream_input is None:
            stream_input = hasattr(requests, "__aiter__")
        if not stream_input:
            requests = (requests,)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        what = f"call {name!r} to {peer}"
        conn = await rpc.with_deadline(self._get_connection(peer), timeout, what)
        stream = conn.open_stream(rpc.call_header(name, timeout))
        responses = rpc.iterate_responses(stream, requests, max_message_size=self.max_message_size)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        response = await anext(responses)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise DeadlineExceeded(f"{what} did not finish within {timeout} s") from None
                yield response
        finally:
            await responses.aclose()

    # ------------------------------------------------------------------ shutdown

    async def _keep_connections_alive(self) -> None:
        """Close connections no stream used for ``idle_timeout`` seconds, then ping the
        others (each ``keepalive_interval`` seconds) and drop those that neither answer
        nor send anything within ``keepalive_timeout``: a peer that vanished without
        closing its socket (power loss, NAT timeout) must not keep a dead connection in
        the pool, and lookups that met a node once must not keep a connection to it
        forever (memory, and the ``max_connections`` cap that would then refuse
        newcomers)."""
        idle_check = self.idle_timeout / 4 if self.idle_timeout is not None else None
        tick = min(p for p in (self.keepalive_interval, idle_check) if p is not None)
        last_probe = self._loop.time()
        while True:
            await asyncio.sleep(tick)
            now = self._loop.time()
            alive = []
            for conn in [c for c in self._all_connections if c.is_alive]:
                if (
                    self.idle_timeout is not None
                    and conn.num_streams == 0
                    and now - conn.last_active >= self.idle_timeout
                ):
                    conn.close(IDLE_REASON)
                else:
                    alive.append(conn)
            if self.keepalive_interval is None or now - last_probe < self.keepalive_interval:
                continue
            last_probe = now
            results = await asyncio.gather(
                *(self._probe(conn) for conn in alive), return_exceptions=True
            )
            for conn, result in zip(alive, results, strict=True):
                if isinstance(result, TimeoutError):
                    conn.abort(
                        PeerUnreachable(
                            f"{conn.remote_peer_id} did not answer a ping within "
                            f"{self.keepalive_timeout} s"
                        )
                    )

    async def _probe(self, conn: Connection) -> float | None:
        """The ping's round trip; None if it went unanswered while the connection kept
        bringing bytes (on a slow link the answer queues behind the data in flight: a
        20 Mbit/s link shared by five connections takes 16 s to drain the 8 MB that TLS
        and the kernel may hold for one); TimeoutError if nothing at all arrived."""
        received = conn.bytes_received
        try:
            async with asyncio.timeout(self.keepalive_timeout):
                return await conn.ping()
        except TimeoutError:
            if conn.bytes_received != received:
                return None
            raise

    async def shutdown(self) -> None:
        """Close listeners, connections and every task this peer started."""
        if self._closed:
            return
        self._closed = True
        for task in (self._keepalive, self._admission_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.relay_client is not None:
            await self.relay_client.close()
        await self._backend.close()
        for pending in list(self._dialing.values()):
            pending.cancel()
        for conn in list(self._all_connections):
            conn.close("peer is shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._dialing.values(), return_exceptions=True)
        # Let transports deliver their close before the caller tears the loop down.
        for _ in range(3):
            await asyncio.sleep(0)
        self._connections.clear()

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()
