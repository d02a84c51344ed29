"""Relays: reaching peers that cannot accept connections (NAT, firewall, client mode).

A client-mode peer opens no listener. It keeps a *reservation* on one or more public peers:
a stream ``relay.reserve`` that stays open for as long as it wants to be reachable. Its
addresses become ``<relay addr>/p2p/<relay id>/p2p-circuit/p2p/<its id>``.

To call it, another peer opens ``relay.connect`` to the relay naming the target; the relay
opens ``relay.incoming`` to the target over the reserved connection and splices the two
streams. Over that spliced pipe the two ends run a complete connection of their own,
TLS included, so the relay forwards ciphertext it can neither read nor forge. Credit flow
control on both legs keeps the relay's memory bounded whatever the speed of either end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.mux import Stream
from swarmgrad.net.rpc import ServicerBase
from swarmgrad.utils.errors import (
    PeerUnreachable,
    ProtocolViolation,
    SwarmgradError,
    ValidationError,
)

if TYPE_CHECKING:
    from swarmgrad.net.peer import Peer

logger = logging.getLogger(__name__)

RESERVE, CONNECT, INCOMING = "relay.reserve", "relay.connect", "relay.incoming"
_OK = b"\x00"
_REFUSED = b"\x01"
_MAX_REPLY = 1024
_PUMP_CHUNK = 256 * 1024


async def _write_reply(stream: Stream, ok: bool, reason: str = "") -> None:
    body = reason.encode()[:_MAX_REPLY]
    await stream.write((_OK if ok else _REFUSED) + len(body).to_bytes(2, "big") + body)


async def _read_reply(stream: Stream, what: str) -> None:
    head = await stream.readexactly(3)
    reason = (await stream.readexactly(int.from_bytes(head[1:3], "big"))).decode("utf-8", "replace")
    if head[:1] != _OK:
        raise PeerUnreachable(f"{what}: {reason}")


async def _read_peer_id(stream: Stream) -> PeerID:
    size = (await stream.readexactly(1))[0]
    try:
        return PeerID(bytes(await stream.readexactly(size)))
    except ValidationError as e:
        raise ProtocolViolation(f"malformed PeerID in a relay request: {e}") from None


def _encode_peer_id(peer_id: PeerID) -> bytes:
    raw = peer_id.to_bytes()
    return bytes([len(raw)]) + raw


class StreamTransport:
    """An asyncio-style transport over a mux stream, so a whole connection (TLS, mux,
    RPC) can run through a relay. Writes are queued and pumped with the stream's credit;
    the protocol is told to pause writing while more than ``high_water`` bytes wait."""

    def __init__(
        self,
        stream: Stream,
        protocol: Any,
        spawn: Any = asyncio.ensure_future,
        *,
        high_water: int = 4 * 1024 * 1024,
    ):
        self._stream = stream
        self._protocol = protocol
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._queued = 0
        self._high_water = high_water
        self._paused = False
        self._closing = False
        self._lost = False
        self._extra = {"peername": f"relayed:{stream.remote_peer_id}"}
        self._writer = spawn(self._pump_out())
        self._reader = spawn(self._pump_in())
        protocol.connection_made(self)

    def write(self, data: Any) -> None:
        if self._closing:
            return
        chunk = bytes(data)
        self._queued += len(chunk)
        self._queue.put_nowait(chunk)
        if not self._paused and self._queued > self._high_water:
            self._paused = True
            self._protocol.pause_writing()

    def writelines(self, buffers: Any) -> None:
        for data in buffers:
            self.write(data)

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(None)

    def abort(self) -> None:
        self._closing = True
        self._stream.reset("relayed connection aborted")
        self._writer.cancel()
        self._reader.cancel()
        self._lose(ConnectionResetError("relayed connection aborted"))

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def pause_reading(self) -> None:  # flow control is the stream's credit
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self._queued

    async def _pump_out(self) -> None:
        try:
            while True:
                chunk = await self._queue.get()
                if chunk is None:
                    await self._stream.close_write()
                    return
                await self._stream.write(chunk)
                self._queued -= len(chunk)
                if self._paused and self._queued < self._high_water // 4:
                    self._paused = False
                    self._protocol.resume_writing()
        except SwarmgradError as e:
            self._lose(e)

    async def _pump_in(self) -> None:
        protocol = self._protocol
        try:
            while True:
                data = await self._stream.read(_PUMP_CHUNK)
                if not data:
                    break
                view = memoryview(data)
                while len(view) and not self._lost:
                    buffer = protocol.get_buffer(len(view))
                    n = min(len(buffer), len(view))
                    buffer[:n] = view[:n]
                    view = view[n:]
                    protocol.buffer_updated(n)
            if not self._lost:
                protocol.eof_received()
            self._lose(None)
        except SwarmgradError as e:
            self._lose(e)

    def _lose(self, exc: BaseException | None) -> None:
        if not self._lost:
            self._lost = True
            self._closing = True
            self._protocol.connection_lost(exc)
            if exc is not None:
                self._writer.cancel()


async def _splice(a: Stream, b: Stream) -> None:
    """Copy both directions until both ends finish; a failure on either resets both."""

    async def copy(src: Stream, dst: Stream) -> None:
        while data := await src.read(_PUMP_CHUNK):
            await dst.write(data)
        await dst.close_write()

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(copy(a, b))
            group.create_task(copy(b, a))
    except* SwarmgradError as group:
        reason = f"relayed peer went away: {group.exceptions[0]}"
        a.reset(reason)
        b.reset(reason)


class RelayService(ServicerBase):
    """Relaying for others, on a public peer (``allow_relay=False`` refuses everyone).

    Its ``rpc_*`` methods take raw streams: a relayed circuit is a byte pipe, not RPC."""

    rpc_prefix = "relay"

    def __init__(
        self,
        peer: Peer,
        *,
        allow_relay: bool = True,
        max_reservations: int = 1024,
        max_circuits_per_peer: int = 64,
    ):
        self.peer = peer
        self.allow_relay = allow_relay
        self.max_reservations = max_reservations
        self.max_circuits_per_peer = max_circuits_per_peer
        self.reservations: dict[PeerID, Stream] = {}
        self._circuits: dict[PeerID, int] = {}
        peer.add_servicer(self)

    async def rpc_reserve(self, stream: Stream) -> None:
        """``relay.reserve``: a client-mode peer holds this stream open to be reachable."""
        client = stream.remote_peer_id
        if not self.allow_relay:
            await _write_reply(stream, False, f"{self.peer.peer_id} does not relay (--no-relay)")
            await stream.close_write()
            return
        if len(self.reservations) >= self.max_reservations and client not in self.reservations:
            await _write_reply(stream, False, "relay is full")
            await stream.close_write()
            return
        previous = self.reservations.get(client)
        self.reservations[client] = stream
        if previous is not None:
            previous.reset("replaced by a newer reservation")
        await _write_reply(stream, True)
        logger.info("relaying for %s", client)
        try:
            await stream.read()  # the reservation lasts until the client closes it
        except SwarmgradError:
            pass
        finally:
            if self.reservations.get(client) is stream:
                del self.reservations[client]
            with contextlib.suppress(SwarmgradError):
                await stream.aclose()

    async def rpc_connect(self, stream: Stream) -> None:
        """``relay.connect``: splice the caller to a reserved peer named on the stream."""
        source = stream.remote_peer_id
        target = await _read_peer_id(stream)
        reservation = self.reservations.get(target)
        if not self.allow_relay or reservation is None:
            reason = (
                "relaying is disabled" if not self.allow_relay else f"no reservation for {target}"
            )
            await _write_reply(stream, False, reason)
            await stream.close_write()
            return
        if self._circuits.get(source, 0) >= self.max_circuits_per_peer:
            await _write_reply(stream, False, f"{source} has too many relayed connections")
            await stream.close_write()
            return
        self._circuits[source] = self._circuits.get(source, 0) + 1
        try:
            outgoing = reservation.conn.open_stream(b"\x00raw:" + INCOMING.encode())
            await outgoing.write(_encode_peer_id(source))
            await _read_reply(outgoing, f"{target} refused the relayed connection")
            await _write_reply(stream, True)
            await _splice(stream, outgoing)
        finally:
            self._circuits[source] -= 1
            if not self._circuits[source]:
                del self._circuits[source]


class RelayClient(ServicerBase):
    """Dialing through relays (every peer) and keeping reservations (client-mode peers);
    serves ``relay.incoming``, the relayed connections a relay hands to us."""

    rpc_prefix = "relay"

    def __init__(self, peer: Peer, relays: list[Multiaddr], *, retry_period: float = 5.0):
        self.peer = peer
        self.relays = relays
        self.retry_period = retry_period
        self._reservations: dict[Multiaddr, asyncio.Task] = {}
        self._active: dict[Multiaddr, Multiaddr] = {}  # relay -> our relayed address
        self._ready = asyncio.Event()
        self._refused: dict[Multiaddr, str] = {}  # relays that said no, and why
        self._all_refused = asyncio.Event()
        peer.add_servicer(self)

    def start(self) -> None:
        for relay in self.relays:
            self._reservations[relay] = asyncio.ensure_future(self._keep_reservation(relay))

    async def wait_ready(self, timeout: float) -> None:
        """Wait until at least one reservation holds (clear error naming the relays)."""
        ready = asyncio.ensure_future(self._ready.wait())
        refused = asyncio.ensure_future(self._all_refused.wait())
        try:
            await asyncio.wait({ready, refused}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            ready.cancel()
            refused.cancel()
            await asyncio.gather(ready, refused, return_exceptions=True)
        if not self._ready.is_set():
            reasons = ", ".join(f"{r} ({self._refused.get(r, 'no answer')})" for r in self.relays)
            raise PeerUnreachable(f"no relay accepted a reservation within {timeout} s: {reasons}")

    @property
    def relayed_addresses(self) -> list[Multiaddr]:
        return list(self._active.values())

    async def _keep_reservation(self, relay: Multiaddr) -> None:
        while True:
            try:
                stream = await self.peer.open_stream(relay, RESERVE)
                relay_id = stream.remote_peer_id
                await _read_reply(stream, f"relay {relay} refused a reservation")
                address = Multiaddr(
                    f"{relay.without_peer_id()}/p2p/{relay_id}/p2p-circuit/p2p/{self.peer.peer_id}"
                )
                self._active[relay] = address
                self._refused.pop(relay, None)
                self.peer._relayed_addrs = self.relayed_addresses
                self._ready.set()
                logger.info("reachable through relay %s", relay_id)
                await stream.read()  # returns when the relay closes; raises if it dies
            except (SwarmgradError, OSError) as e:
                logger.debug("reservation on %s lost or refused: %s", relay, e)
                self._refused[relay] = str(e)
                if all(r in self._refused for r in self.relays) and not self._active:
                    self._all_refused.set()
            finally:
                self._active.pop(relay, None)
                self.peer._relayed_addrs = self.relayed_addresses
            await asyncio.sleep(self.retry_period)

    async def rpc_incoming(self, stream: Stream) -> None:
        source = await _read_peer_id(stream)
        if stream.remote_peer_id not in {a.relay.peer_id for a in self._active.values()}:
            await _write_reply(stream, False, "not one of our relays")
            await stream.close_write()
            return
        await _write_reply(stream, True)
        conn = self.peer._new_connection(is_dialer=False, expected_peer_id=None)
        self.peer._arm_handshake_watchdog(conn)
        upper = self.peer._backend.wrap_relayed(conn, server_side=True)
        StreamTransport(stream, upper, self.peer._spawn)
        logger.debug("relayed connection from %s via %s", source, stream.remote_peer_id)

    async def close(self) -> None:
        for task in self._reservations.values():
            task.cancel()
        await asyncio.gather(*self._reservations.values(), return_exceptions=True)
        self._reservations.clear()


async def dial_via_relay(peer: Peer, address: Multiaddr, conn: Any) -> None:
    """Open a connection to ``address.peer_id`` through ``address.relay``; ``conn`` is the
    mux Connection that will run over it (its handshake result is awaited by the caller)."""
    if address.peer_id is None or address.relay is None:
        raise ValidationError(f"{address} does not name a relay and a target peer")
    stream = await peer.open_stream(address.relay, CONNECT)
    try:
        await stream.write(_encode_peer_id(address.peer_id))
        await _read_reply(stream, f"relay {address.relay} cannot reach {address.peer_id}")
    except BaseException:
        stream.reset("relay dial abandoned")
        raise
    upper = peer._backend.wrap_relayed(conn, server_side=False)
    StreamTransport(stream, upper, peer._spawn)
