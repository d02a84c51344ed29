"""hivemind's ``P2P`` on swarmgrad's transport: custom protocols the hivemind way.

hivemind programs register their own RPCs on a ``P2P`` object (a handle to a libp2p
daemon there). Here the same object is a handle to a :class:`swarmgrad.net.peer.Peer`;
the methods keep hivemind's names, arguments and async shapes:

* ``add_protobuf_handler(name, handler, input_type, stream_input=, stream_output=)`` and
  ``call_protobuf_handler`` / ``iterate_protobuf_handler``: handlers take
  ``(request, P2PContext)`` and return the answer (or are async generators of answers).
  With ``protobuf`` installed (the ``hivemind`` extra) and protobuf message classes given
  as types, messages travel as their serialized bytes and arrive parsed. Without protobuf
  (or with ``None`` as the type) messages are any msgpack-able objects, as in the rest
  of swarmgrad. A request that does not parse is answered with an error (the caller gets
  :class:`P2PHandlerError`); the handler never sees it and the peer keeps serving.
* ``add_binary_stream_handler`` / ``call_binary_stream_handler``: a raw bidirectional
  stream with asyncio-style reader and writer objects, on which ``send_raw_data`` /
  ``receive_raw_data`` and ``send_protobuf`` / ``receive_protobuf`` frame messages as
  hivemind does (an 8-byte big-endian length; a marker byte before a message or an
  ``RPCError``; ``END_OF_STREAM`` ends a direction), byte for byte.

The wire is swarmgrad's (one RPC per multiplexed stream, see :mod:`swarmgrad.net.rpc`),
not libp2p's: a hivemind peer and a swarmgrad peer cannot call each other, programs can.

**create and replicate.** ``P2P.create`` starts a peer (there is no daemon process:
the peer lives in this process's event loop). hivemind's ``P2P.replicate(maddr)`` opens a
second handle to a running daemon, typically from a child process. swarmgrad has no
daemon and no child processes (one process, one peer), so ``replicate`` returns another
handle to the peer started in *this* process under that ``daemon_listen_maddr``: it
shares the peer's handlers and connections, and shutting it down closes only the handle,
never the peer. Asking for a peer of another process is an error that says so.
``DHT.replicate_p2p()`` gives such a handle on a DHT's peer.

**Event loops.** A handle may be used from any event loop, not only the peer's (a DHT's
peer runs in swarmgrad's loop thread, while a hivemind program awaits
``dht.replicate_p2p()`` in its own loop): calls are forwarded to the peer's loop, and a
handler registered from another loop runs in that loop, as hivemind runs handlers in the
program's process; streamed requests and answers cross between the loops one at a time.
Binary streams are the exception: their reader and writer belong to the peer's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import msgpack

from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.net.libp2p_options import warn_libp2p_only_options
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import DEFAULT_MAX_MESSAGE_SIZE, RPCContext
from swarmgrad.p2p.datastructures import (
    InvalidMessageMarker,
    P2PContext,
    P2PDaemonError,
    P2PHandlerError,
    PeerInfo,
    RPCError,
    StreamInfo,
)
from swarmgrad.p2p.streams import StreamReader, StreamWriter
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import (
    FrameTooLarge,
    IdentityFileError,
    RemoteError,
    SwarmgradError,
    ValidationError,
)

logger = logging.getLogger(__name__)

__all__ = ["P2P", "P2PContext", "UnsupportedAttributeError", "is_protobuf_type"]

try:  # the optional ``hivemind`` extra
    from google.protobuf.message import DecodeError as _DecodeError
    from google.protobuf.message import Message as _ProtobufMessage
except ImportError:  # pragma: no cover - exercised where protobuf is absent
    _ProtobufMessage = None
    _DecodeError = None


def is_protobuf_type(cls: Any) -> bool:
    """True for a protobuf message class (when the ``protobuf`` package is installed)."""
    return (
        _ProtobufMessage is not None and isinstance(cls, type) and issubclass(cls, _ProtobufMessage)
    )


def _encode(value: Any) -> Any:
    if _ProtobufMessage is not None and isinstance(value, _ProtobufMessage):
        return value.SerializeToString()
    return value


def _decode(body: Any, message_type: Any, what: str) -> Any:
    if not is_protobuf_type(message_type):
        return body
    if not isinstance(body, bytes | bytearray | memoryview):
        raise ValidationError(
            f"{what} should be a serialized {message_type.__name__}, got a {type(body).__name__}"
        )
    try:
        return message_type.FromString(bytes(body))
    except _DecodeError as e:
        raise ValidationError(f"{what} does not parse as {message_type.__name__}: {e}") from None


class UnsupportedAttributeError(NotImplementedError, AttributeError):
    """Reading a hivemind attribute that swarmgrad does not have; the message says what to
    use instead. Also an ``AttributeError``, so ``hasattr``, ``getattr(..., default)``,
    ``inspect`` and mocks treat the attribute as absent rather than failing."""


class _Unsupported:
    """A class attribute of hivemind's ``P2P`` with no meaning here: reading it (on the
    class or on a handle) raises :class:`UnsupportedAttributeError` saying what to use
    instead. It carries ``__hivemind_unsupported__`` as
    :func:`swarmgrad.utils.compat.unsupported` does, so ``benchmarks/hivemind_api.py``
    lists it as "raises, says: ..."."""

    def __init__(self, instead: str):
        self.__hivemind_unsupported__ = instead
        self._name = "P2P.?"

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = f"{owner.__name__}.{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        raise UnsupportedAttributeError(
            f"{self._name} is hivemind machinery that swarmgrad does not have: "
            f"{self.__hivemind_unsupported__}"
        )


_NO_DAEMON_FLAGS = (
    "it holds the p2pd daemon's command-line flags, and swarmgrad starts no daemon; "
    "P2P.create(dht_mode=..., force_reachability=...) accepts the keywords with a warning, "
    "and a peer that should not be dialed is P2P.create(no_listen=True) "
    "(Peer.create(client_mode=True))"
)

_handles = itertools.count()
# primary handles by daemon_listen_maddr (the peers started by P2P.create in this process)
_primaries: dict[str, P2P] = {}


class P2P:
    """A handle to this process's peer with hivemind's ``P2P`` interface (see the module
    docstring). Build one with :meth:`create`, :meth:`replicate` or :meth:`from_peer`."""

    # hivemind's framing of messages on a binary stream (send_raw_data / send_protobuf):
    # an 8-byte big-endian length before the bytes; a marker byte before a message
    HEADER_LEN = 8
    BYTEORDER = "big"
    MESSAGE_MARKER = b"\x00"
    ERROR_MARKER = b"\x01"
    END_OF_STREAM = RPCError()  # the empty error: "no more messages" on a stream

    DHT_MODE_MAPPING = _Unsupported(_NO_DAEMON_FLAGS)
    FORCE_REACHABILITY_MAPPING = _Unsupported(_NO_DAEMON_FLAGS)

    # hivemind's type aliases for handler signatures
    TInputProtobuf = TypeVar("TInputProtobuf")
    TOutputProtobuf = TypeVar("TOutputProtobuf")
    TInputStream = AsyncIterator[TInputProtobuf]  # type: ignore[valid-type]
    TOutputStream = AsyncIterator[TOutputProtobuf]  # type: ignore[valid-type]

    def __init__(self, peer: Peer, *, owns_peer: bool, daemon_listen_maddr: str):
        self._peer = peer
        self._owns_peer = owns_peer
        self._daemon_listen_maddr = daemon_listen_maddr
        self._alive = True
        self.peer_id: PeerID = peer.peer_id

    @property
    def peer(self) -> Peer:
        """The swarmgrad :class:`~swarmgrad.net.peer.Peer` behind this handle."""
        return self._peer

    # ------------------------------------------------------------------ construction

    @classmethod
    async def create(
        cls,
        initial_peers: Sequence[Multiaddr | str] | None = None,
        *,
        announce_maddrs: Sequence[Multiaddr | str] | None = None,
        auto_nat: bool = True,
        conn_manager: bool = True,
        dht_mode: str = "server",
        force_reachability: str | None = None,
        host_maddrs: Sequence[Multiaddr | str] | None = ("/ip4/127.0.0.1/tcp/0",),
        identity_path: str | None = None,
        idle_timeout: float = 30,
        nat_port_map: bool = True,
        relay_hop_limit: int = 0,
        startup_timeout: float = 15,
        tls: bool = True,
        use_auto_relay: bool = False,
        use_ipfs: bool = False,
        use_relay: bool = True,
        persistent_conn_max_msg_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        quic: bool | None = None,
        use_relay_hop: bool | None = None,
        use_relay_discovery: bool | None = None,
        check_if_identity_free: bool = True,
        no_listen: bool = False,
        trusted_relays: Sequence[Multiaddr | str] | None = None,
    ) -> P2P:
        """Start a peer with hivemind's keywords.

        Honoured: ``initial_peers`` (dialed at start; unreachable ones are logged),
        ``announce_maddrs``, ``host_maddrs``, ``identity_path`` (a swarmgrad identity
        file, created if missing; a hivemind RSA identity file must be converted once
        with ``swarmgrad identity import``), ``no_listen`` (client mode),
        ``trusted_relays`` (relays that keep a reservation for us), ``use_relay_hop``
        (``False``: do not relay for others), ``use_relay`` (``False``: no relays at
        all), ``persistent_conn_max_msg_size`` (largest message) and
        ``startup_timeout``. The libp2p-only options are accepted with a warning each
        (see :data:`swarmgrad.net.libp2p_options.LIBP2P_ONLY_OPTIONS`).
        """
        warn_libp2p_only_options(
            dict(
                auto_nat=auto_nat,
                conn_manager=conn_manager,
                dht_mode=dht_mode,
                force_reachability=force_reachability,
                idle_timeout=idle_timeout,
                nat_port_map=nat_port_map,
                relay_hop_limit=relay_hop_limit,
                tls=tls,
                use_auto_relay=use_auto_relay,
                use_ipfs=use_ipfs,
                quic=quic,
                use_relay_discovery=use_relay_discovery,
                check_if_identity_free=check_if_identity_free,
            )
        )
        if not (isinstance(startup_timeout, int | float) and startup_timeout > 0):
            raise ValidationError(
                f"startup_timeout must be a positive number, got {startup_timeout!r}"
            )
        try:
            identity = Identity.load_or_create(identity_path) if identity_path else None
        except (IdentityFileError, OSError) as e:
            raise P2PDaemonError(
                f"cannot use the identity file {identity_path!r}: {e} (a hivemind identity "
                f"file converts once with `swarmgrad identity import`)"
            ) from e
        relays = list(trusted_relays or ()) if use_relay else []
        options: dict[str, Any] = dict(
            identity=identity,
            host_maddrs=tuple(host_maddrs or ()),
            announce_maddrs=tuple(announce_maddrs or ()),
            client_mode=bool(no_listen),
            relays=relays,
            allow_relay=use_relay and use_relay_hop is not False,
            max_message_size=persistent_conn_max_msg_size,
        )
        try:
            async with asyncio.timeout(startup_timeout):
                peer = await Peer.create(**options)
        except TimeoutError:
            raise P2PDaemonError(
                f"the peer did not start in {startup_timeout:.1f} seconds"
            ) from None
        except (SwarmgradError, OSError) as e:
            raise P2PDaemonError(f"failed to start the peer: {e}") from e
        self = cls(peer, owns_peer=True, daemon_listen_maddr=_new_listen_maddr(peer.peer_id))
        _primaries[self._daemon_listen_maddr] = self
        if initial_peers:
            await self._dial_initial_peers(initial_peers, startup_timeout)
        return self

    async def _dial_initial_peers(self, initial_peers: Sequence[Any], timeout: float) -> None:
        async def dial(maddr: Any) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await self._peer.connect(maddr)
            except (SwarmgradError, OSError, TimeoutError) as e:
                logger.warning(f"Could not reach initial peer {maddr}: {e}")

        await asyncio.gather(*(dial(m) for m in initial_peers))

    @classmethod
    async def replicate(cls, daemon_listen_maddr: Multiaddr | str | Peer) -> P2P:
        """Another handle to the peer that :meth:`create` started in this process under
        ``daemon_listen_maddr`` (see the module docstring); given a swarmgrad
        :class:`~swarmgrad.net.peer.Peer` itself, a handle to that peer."""
        if isinstance(daemon_listen_maddr, Peer):
            return cls.from_peer(daemon_listen_maddr)
        primary = _primaries.get(str(daemon_listen_maddr))
        if primary is None or not primary.is_alive:
            raise P2PDaemonError(
                f"no running peer of this process listens at {daemon_listen_maddr}: swarmgrad "
                f"has no daemon, so P2P.replicate only opens another handle to a peer created "
                f"with P2P.create in the same process"
            )
        return cls(primary._peer, owns_peer=False, daemon_listen_maddr=str(daemon_listen_maddr))

    @classmethod
    def from_peer(cls, peer: Peer) -> P2P:
        """A handle to an existing swarmgrad peer (e.g. the one under a DHT); shutting the
        handle down leaves the peer running."""
        return cls(peer, owns_peer=False, daemon_listen_maddr=_new_listen_maddr(peer.peer_id))

    @classmethod
    async def is_identity_taken(
        cls,
        identity_path: str,
        *,
        initial_peers: Sequence[Multiaddr | str] | None = None,
        tls: bool = True,
        use_auto_relay: bool = False,
        use_ipfs: bool = False,
        use_relay: bool = True,
        timeout: float = 15,
    ) -> bool:
        """Whether a peer with the identity in ``identity_path`` is online in the swarm
        reached through ``initial_peers`` (hivemind asks this before starting a peer with a
        shared identity file).

        A temporary client peer (it cannot be dialed, so it is never mistaken for the
        owner) joins the DHT through ``initial_peers`` and looks up that PeerID's node id;
        the identity is taken when a peer holding it answers. No initial peers: nobody to
        ask, ``False``. None of them answering: :class:`PeerUnreachable` naming them. The
        identity file must be a swarmgrad one (:class:`P2PDaemonError` otherwise: a
        hivemind RSA file converts with ``swarmgrad identity import``). ``tls``,
        ``use_auto_relay`` and ``use_ipfs`` are libp2p options (warned as in
        :meth:`create`); ``timeout`` bounds the whole probe."""
        try:
            peer_id = Identity.load(identity_path).peer_id
        except (IdentityFileError, OSError) as e:
            raise P2PDaemonError(
                f"cannot read the identity file {identity_path!r}: {e} (a hivemind identity "
                f"file converts once with `swarmgrad identity import`)"
            ) from e
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValidationError(f"timeout must be a positive number, got {timeout!r}")
        warn_libp2p_only_options(
            dict(tls=tls, use_auto_relay=use_auto_relay, use_ipfs=use_ipfs),
            where="P2P.is_identity_taken",
        )
        if not initial_peers:
            return False
        from swarmgrad.dht.node import DHTNode  # the DHT sits above this package's imports
        from swarmgrad.dht.routing import DHTID

        probe = await cls.create(no_listen=True, use_relay=use_relay, startup_timeout=timeout)
        node = None
        try:
            async with asyncio.timeout(timeout):
                node = await DHTNode.create(
                    probe.peer,
                    initial_peers=list(initial_peers),
                    client_mode=True,
                    refresh_on_join=False,
                    bootstrap_timeout=timeout,
                )
                if probe.peer.is_connected(peer_id):  # an initial peer holds it
                    return True
                nearest = await node.find_nearest_nodes(DHTID.for_peer(peer_id), k=1)
                if not any(found == peer_id for _, found in nearest):
                    return False
                return probe.peer.is_connected(peer_id) or await node.ping(peer_id)
        except TimeoutError:
            raise P2PDaemonError(
                f"could not tell in {timeout} seconds whether {peer_id} is online"
            ) from None
        finally:
            if node is not None:
                await node.shutdown()
            await probe.shutdown()

    @staticmethod
    def generate_identity(identity_path: str) -> None:
        """Write a new identity (ed25519, mode 0600) to ``identity_path``."""
        Identity.generate().save(identity_path)

    @property
    def daemon_listen_maddr(self) -> str:
        """The name :meth:`replicate` takes to open another handle to this peer."""
        return self._daemon_listen_maddr

    @property
    def is_alive(self) -> bool:
        return self._alive and not self._peer._closed

    # ------------------------------------------------------------------ peers & addresses

    async def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        """Addresses others can dial, each ending in ``/p2p/<peer id>`` (``latest`` is
        accepted for hivemind's signature: the list is always current)."""
        maddrs = self._peer.get_visible_maddrs()
        if not maddrs:
            raise ValueError(f"No multiaddrs found for peer {self.peer_id}")
        return maddrs

    async def list_peers(self) -> list[PeerInfo]:
        """The peers this one is connected to now."""
        return [
            PeerInfo(peer_id, self._peer.addresses_of(peer_id))
            for peer_id in self._peer.connected_peers
        ]

    async def wait_for_at_least_n_peers(
        self, n_peers: int, attempts: int = 3, delay: float = 1
    ) -> None:
        for _ in range(attempts):
            if len(self._peer.connected_peers) >= n_peers:
                return
            await asyncio.sleep(delay)
        raise RuntimeError("Not enough peers")

    # ------------------------------------------------------------------ message handlers

    async def add_protobuf_handler(
        self,
        name: str,
        handler: Callable[..., Any],
        input_protobuf_type: type | None,
        *,
        stream_input: bool = False,
        stream_output: bool = False,
        balanced: bool = False,
    ) -> None:
        """Serve ``handler(request, context)`` under ``name``.

        ``request`` is a parsed ``input_protobuf_type`` (or an async iterator of them with
        ``stream_input``); the handler returns the answer (a protobuf message or a
        msgpack-able object) or, with ``stream_output``, is an async generator of
        answers. ``balanced`` (libp2p load balancing across processes) has no meaning
        for one in-process peer and is ignored."""
        local_id = self.peer_id
        what = f"the request to handler {name!r}"
        home = self._caller_loop()
        if home is not None:  # run the handler in the loop of the code that registered it
            handler = _handler_in_loop(handler, home, stream_input)

        def context_of(rpc_context: RPCContext) -> P2PContext:
            return P2PContext(name, local_id, rpc_context.remote_id)

        async def requests_of(raw: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for body in raw:
                yield _decode(body, input_protobuf_type, what)

        def argument(raw: Any) -> Any:
            return requests_of(raw) if stream_input else _decode(raw, input_protobuf_type, what)

        if stream_output:

            async def serve_stream(raw: Any, rpc_context: RPCContext) -> AsyncIterator[Any]:
                output = handler(argument(raw), context_of(rpc_context))
                if isinstance(output, AsyncIterable):
                    async for item in output:
                        yield _encode(item)
                else:
                    yield _encode(await output)

            self._peer.add_handler(
                name, serve_stream, stream_input=stream_input, stream_output=True
            )
        else:

            async def serve(raw: Any, rpc_context: RPCContext) -> Any:
                return _encode(await handler(argument(raw), context_of(rpc_context)))

            self._peer.add_handler(name, serve, stream_input=stream_input)

    async def remove_protobuf_handler(
        self, name: str, *, stream_input: bool = False, stream_output: bool = False
    ) -> None:
        self._peer.remove_handler(name)

    async def call_protobuf_handler(
        self,
        peer_id: PeerID,
        name: str,
        input: Any,
        output_protobuf_type: type | None,
    ) -> Any:
        """Call ``name`` on ``peer_id`` with one request (or an async iterator of them)
        and return its one answer, parsed as ``output_protobuf_type``. The remote
        handler's failure raises :class:`P2PHandlerError`."""
        home = self._caller_loop()
        if home is not None:
            if isinstance(input, AsyncIterable):
                input = _pull_from(home, input)
            call = self.call_protobuf_handler(peer_id, name, input, output_protobuf_type)
            return await _in_loop(self._peer._loop, call)
        if isinstance(input, AsyncIterable):
            responses = await self.iterate_protobuf_handler(
                peer_id, name, input, output_protobuf_type
            )
            return await _single(responses, name, peer_id)
        try:
            body = await self._peer.call(peer_id, name, _encode(input))
        except RemoteError as e:
            raise _handler_error(name, peer_id, e) from None
        return _decode(body, output_protobuf_type, f"the answer of handler {name!r}")

    async def iterate_protobuf_handler(
        self,
        peer_id: PeerID,
        name: str,
        input: Any,
        output_protobuf_type: type | None,
    ) -> AsyncIterator[Any]:
        """Call ``name`` with one request or an async iterator of them; returns an async
        iterator of the answers (``await`` it, then ``async for``, as in hivemind)."""
        home = self._caller_loop()
        if home is not None:
            if isinstance(input, AsyncIterable):
                input = _pull_from(home, input)
            call = self.iterate_protobuf_handler(peer_id, name, input, output_protobuf_type)
            return _pull_from(self._peer._loop, await _in_loop(self._peer._loop, call))
        if isinstance(input, AsyncIterable):
            requests: Any = _encoded(input)
            stream_input = True
        else:
            requests, stream_input = _encode(input), False
        return self._responses(peer_id, name, requests, stream_input, output_protobuf_type)

    async def _responses(
        self, peer_id: PeerID, name: str, requests: Any, stream_input: bool, output_type: Any
    ) -> AsyncIterator[Any]:
        what = f"an answer of handler {name!r}"
        responses = self._peer.iterate(peer_id, name, requests, stream_input=stream_input)
        try:
            async for body in responses:
                yield _decode(body, output_type, what)
        except RemoteError as e:
            raise _handler_error(name, peer_id, e) from None
        finally:
            await responses.aclose()

    # ------------------------------------------------------------------ binary streams

    async def add_binary_stream_handler(
        self, name: str, handler: Callable[..., Any], balanced: bool = False
    ) -> None:
        """Serve ``async handler(stream_info, reader, writer)`` under ``name``: a raw
        bidirectional byte stream; our side is closed when the handler returns. A handler
        that raises resets the stream with the error's type and message (the caller's next
        read raises it) and is logged; the peer goes on serving."""

        async def serve(stream: Any) -> None:
            info = StreamInfo(stream.remote_peer_id, None, name)
            writer = StreamWriter(stream)
            try:
                await handler(info, StreamReader(stream), writer)
                await writer.drain()
                await writer.wait_closed()
            except SwarmgradError:
                raise  # the peer resets the stream with the error's message
            except Exception as e:  # the handler's own failure, or the caller went away
                if isinstance(e, asyncio.IncompleteReadError):
                    why = f"the stream ended {len(e.partial)} bytes into a {e.expected}-byte read"
                    logger.debug(f"Binary stream {name!r} from {info.peer_id}: {why}")
                else:
                    why = f"{type(e).__name__}: {e}"
                    logger.warning(
                        f"Binary stream handler {name!r} failed for {info.peer_id}: {why}"
                    )
                stream.reset(f"handler {name!r} failed: {why}")
                return
            await stream.close_write()  # the caller's side stays open until it closes it

        self._peer.add_protocol_handler(name, serve)

    async def remove_binary_stream_handler(self, name: str) -> None:
        self._peer._raw_protocols.pop(name, None)

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler_name: str
    ) -> tuple[StreamInfo, StreamReader, StreamWriter]:
        """Open a stream to ``handler_name`` on ``peer_id``: ``(info, reader, writer)``.
        The reader and writer belong to the peer's event loop: call this there."""
        if self._caller_loop() is not None:
            raise P2PDaemonError(
                "binary streams are used in the event loop of the peer (run the code with "
                "dht.run_coroutine, or create the P2P with P2P.create in your own loop)"
            )
        stream = await self._peer.open_stream(peer_id, handler_name)
        info = StreamInfo(stream.remote_peer_id, None, handler_name)
        return info, StreamReader(stream), StreamWriter(stream)

    # ------------------------------------------------------------------ framing on streams

    @staticmethod
    async def send_raw_data(data: bytes, writer: Any, *, chunk_size: int = 2**16) -> None:
        """Write ``data`` as one framed message: its length in ``HEADER_LEN`` bytes
        (``BYTEORDER``), then the bytes, ``chunk_size`` at a time with a ``drain`` after
        each (the stream's flow control applies). ``writer`` is the one a binary stream
        handler gets, or any asyncio-style writer."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValidationError(f"send_raw_data sends bytes, got a {type(data).__name__}")
        positive_int("chunk_size", chunk_size)
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValidationError("send_raw_data sends a contiguous buffer, got a strided view")
        view = view.cast("B")
        writer.write(len(view).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        for offset in range(0, len(view), chunk_size):
            writer.write(view[offset : offset + chunk_size])
            await writer.drain()
        await writer.drain()

    @staticmethod
    async def receive_raw_data(
        reader: Any, *, max_size: int | None = DEFAULT_MAX_MESSAGE_SIZE
    ) -> bytes:
        """Read one message framed by :meth:`send_raw_data`. A length above ``max_size``
        (swarmgrad's message limit, 1 GiB, unless given; ``None``: no limit) is refused
        with :class:`~swarmgrad.utils.errors.FrameTooLarge` before anything is read (the
        stream is then mid-message: close it); a stream that ends early raises
        :class:`asyncio.IncompleteReadError`."""
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if max_size is not None and length > max_size:
            raise FrameTooLarge(
                f"the stream announces a message of {length} bytes, more than "
                f"max_size={max_size} (pass a larger max_size= to receive_raw_data)"
            )
        return await reader.readexactly(length)

    @staticmethod
    async def send_protobuf(protobuf: Any, writer: Any) -> None:
        """Write a marker byte and a framed message: ``ERROR_MARKER`` and the encoded
        error for an :class:`~swarmgrad.p2p.datastructures.RPCError` (``END_OF_STREAM``
        ends a stream of messages), else ``MESSAGE_MARKER`` and the serialized protobuf
        message or, as everywhere in :mod:`swarmgrad.p2p`, a msgpack-able object."""
        if isinstance(protobuf, RPCError):
            marker, data = P2P.ERROR_MARKER, protobuf.SerializeToString()
        elif _ProtobufMessage is not None and isinstance(protobuf, _ProtobufMessage):
            marker, data = P2P.MESSAGE_MARKER, protobuf.SerializeToString()
        else:
            try:
                data = msgpack.packb(protobuf, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as e:
                raise ValidationError(
                    f"send_protobuf sends a protobuf message, an RPCError or a msgpack-able "
                    f"object, got a {type(protobuf).__name__} ({e})"
                ) from None
            marker = P2P.MESSAGE_MARKER
        writer.write(marker)
        await P2P.send_raw_data(data, writer)

    @staticmethod
    async def receive_protobuf(
        input_protobuf_type: type | None, reader: Any
    ) -> tuple[Any | None, RPCError | None]:
        """Read what :meth:`send_protobuf` wrote: ``(message, None)``, parsed as
        ``input_protobuf_type`` (a protobuf class; ``None`` or another class: a msgpack
        object), or ``(None, error)`` for an RPCError. A marker that is neither is an
        :class:`~swarmgrad.p2p.datastructures.InvalidMessageMarker` (a ``TypeError``, as
        in hivemind); bytes that do not parse are a ``ValidationError``."""
        if input_protobuf_type is not None and not isinstance(input_protobuf_type, type):
            raise ValidationError(
                f"receive_protobuf takes a message class (or None for msgpack objects), got "
                f"a {type(input_protobuf_type).__name__} instance"
            )
        marker = await reader.readexactly(1)
        if marker == P2P.MESSAGE_MARKER:
            data = await P2P.receive_raw_data(reader)
            if is_protobuf_type(input_protobuf_type):
                return _decode(data, input_protobuf_type, "a message on the stream"), None
            try:
                return msgpack.unpackb(data, raw=False), None
            except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
                raise ValidationError(
                    f"a message on the stream is not a msgpack object ({e}); pass its "
                    f"protobuf class to receive_protobuf if it is a protobuf message"
                ) from None
        if marker == P2P.ERROR_MARKER:
            return None, RPCError.FromString(await P2P.receive_raw_data(reader))
        raise InvalidMessageMarker(
            f"Invalid Protobuf message type: marker byte {marker!r}, expected "
            f"{P2P.MESSAGE_MARKER!r} (a message) or {P2P.ERROR_MARKER!r} (an RPCError)"
        )

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        """Close this handle; the handle that created the peer also shuts the peer down."""
        if not self._alive:
            return
        self._alive = False
        if self._owns_peer:
            _primaries.pop(self._daemon_listen_maddr, None)
            if self._caller_loop() is None:
                await self._peer.shutdown()
            else:
                await _in_loop(self._peer._loop, self._peer.shutdown())

    def _caller_loop(self) -> asyncio.AbstractEventLoop | None:
        """The running event loop when it is not the peer's (a handle from
        ``DHT.replicate_p2p()`` used in the program's own loop), else None."""
        loop = asyncio.get_running_loop()
        return None if loop is self._peer._loop else loop

    def __repr__(self) -> str:
        return f"P2P({self.peer_id}, alive={self.is_alive})"


def _new_listen_maddr(peer_id: PeerID) -> str:
    return f"/unix/swarmgrad-p2p/{peer_id}/{next(_handles)}"


def _handler_error(name: str, peer_id: PeerID, error: RemoteError) -> P2PHandlerError:
    return P2PHandlerError(
        f"Failed to call handler `{name}` at {peer_id}: {error.args[0]}",
        remote_type=error.remote_type,
        peer=peer_id,
    )


async def _encoded(requests: AsyncIterable[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _encode(request)


async def _single(responses: AsyncIterator[Any], name: str, peer_id: PeerID) -> Any:
    answers = [item async for item in responses]
    if len(answers) != 1:
        raise P2PHandlerError(
            f"handler `{name}` at {peer_id} sent {len(answers)} answers, expected one",
            peer=peer_id,
        )
    return answers[0]


async def _in_loop(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """Await ``coro`` run in ``loop`` (another thread's event loop); cancelling the
    caller cancels it there too."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


_EXHAUSTED = object()


async def _next_or_exhausted(iterator: Any) -> Any:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return _EXHAUSTED


async def _pull_from(
    loop: asyncio.AbstractEventLoop, source: AsyncIterable[Any]
) -> AsyncIterator[Any]:
    """Iterate ``source``, which lives in ``loop``, from the current loop, one item at a
    time (each step of ``source`` runs in its own loop)."""
    iterator = aiter(source)
    try:
        while (item := await _in_loop(loop, _next_or_exhausted(iterator))) is not _EXHAUSTED:
            yield item
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                await _in_loop(loop, aclose())


def _handler_in_loop(
    handler: Callable[..., Any], home: asyncio.AbstractEventLoop, stream_input: bool
) -> Callable[..., Any]:
    """``handler`` as called from the peer's loop but run in ``home``, the loop of the
    program that registered it (hivemind runs handlers in the program's process)."""

    def in_home(request: Any, context: P2PContext) -> Any:
        peer_loop = asyncio.get_running_loop()
        if stream_input:
            request = _pull_from(peer_loop, request)
        output = handler(request, context)
        if isinstance(output, AsyncIterable):
            return _pull_from(home, output)
        return _in_loop(home, output)

    return in_home
