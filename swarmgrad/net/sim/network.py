"""A simulated network in memory that speaks the asyncio transport interface.

:class:`SimNetwork` connects hosts named by plain strings. A connection is a pair of
:class:`SimTransport` objects that implement ``asyncio.Transport`` and drive ordinary
``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` objects, so the protocol code that
runs over TCP (framing, multiplexing, RPC, the DHT...) runs here unmodified. Time is the
event loop's clock: on a :class:`~swarmgrad.net.sim.VirtualClockEventLoop` a simulation
of thousands of peers runs in seconds and the same seed gives the same run; on a normal
loop everything works too, in real time.

Link model
    Every directed link ``src -> dst`` has a latency (seconds), a bandwidth (bytes per
    second, ``None`` for unlimited) and a drop probability. Values come from the network
    defaults, then from per-host settings (:meth:`SimNetwork.set_host`: a setting applies
    to every link of the host, and when both ends have one the worse value wins: the
    larger latency, the smaller bandwidth, the larger drop probability), then from
    per-pair settings (:meth:`SimNetwork.set_link`), which win over both.

    Bytes leave the sender's write buffer in chunks of up to ``chunk_size`` bytes. On a
    link with a bandwidth, chunks are serialized one after another at that rate, in one
    queue per directed link that all connections on the link share round-robin; each
    chunk arrives one latency after its last byte was sent. Order within a connection is
    always preserved. Each connection has a TCP-like receive window (``receive_window``
    bytes): bytes sent but not yet consumed by the receiving protocol count against it,
    and consumed bytes free it again one reverse-link latency later. A receiver that
    pauses reading therefore stops the sender, whose write buffer then grows and calls
    ``pause_writing()``: backpressure is end to end. Even with unlimited bandwidth a
    connection moves at most ``receive_window`` bytes per round trip, as TCP does.

    ``drop_probability`` is loss on a reliable byte stream: every chunk sent has that
    probability of resetting the connection instead, when it would have arrived (both
    sides get ``connection_lost(ConnectionResetError)``). Handshake, end-of-file and
    reset signals are never lost.

Connection timing (one-way latencies ``L(a->b)``)
    ``connect(a, b, f)`` sends a SYN that reaches ``b`` after ``L(a->b)``. If ``b``
    listens, its protocol is created and gets ``connection_made`` then; the client's
    protocol is created and gets ``connection_made``, and ``connect`` returns, when the
    answer arrives, one round trip ``L(a->b) + L(b->a)`` after the call. Anything the
    server writes in ``connection_made`` arrives right after. If nothing listens on
    ``b`` (never listened, listener closed, crashed) the connect fails after the same
    round trip with :class:`~swarmgrad.utils.errors.PeerUnreachable` ("refused"). If the
    SYN cannot get through (partition) nothing answers: the connect fails with
    ``PeerUnreachable`` after ``connect_timeout`` seconds, unless the caller's own timeout
    cancels it first.

Closing
    ``close()`` stops reading at once, sends what is still buffered, then an end of
    file; the closing side gets ``connection_lost(None)`` when its buffer is empty and
    the peer gets ``eof_received()`` after the data, then (unless ``eof_received``
    returns true) closes too. ``abort()`` drops the buffer: the local protocol gets
    ``connection_lost(None)`` at once and a reset reaches the peer one latency later
    (``connection_lost(ConnectionResetError)``). Data that reaches an endpoint that has
    already closed is answered with a reset, as TCP does.

Faults
    :meth:`~SimNetwork.partition` / :meth:`~SimNetwork.heal`, :meth:`~SimNetwork.crash`
    / :meth:`~SimNetwork.restart` and :meth:`~SimNetwork.disconnect` reset the
    connections concerned at once, on both sides.

Determinism
    All randomness comes from ``SimNetwork.random``, a ``random.Random(seed)``; nothing
    iterates over a set or depends on object addresses. With ``trace=True`` the network
    records ``(time, event)`` pairs in ``SimNetwork.trace``.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from swarmgrad.utils.errors import PeerUnreachable, ValidationError

__all__ = ["LinkSettings", "SimListener", "SimNetwork", "SimTransport"]

logger = logging.getLogger(__name__)

ProtocolFactory = Callable[[], asyncio.BaseProtocol]

_DEFAULT_HIGH_WATER = 64 * 1024


class _Unset(enum.Enum):
    UNSET = enum.auto()


_UNSET = _Unset.UNSET


class _Signal(enum.Enum):
    """Non-data items travelling on a connection, in order with its data."""

    SYN_ACK = "syn-ack"  # the server accepted: the client side is established on arrival
    EOF = "eof"  # the sender closed gracefully
    RST = "rst"  # the sender reset the connection
    LOSS = "loss"  # a chunk was lost in transit: the connection resets on both sides


@dataclass(frozen=True)
class LinkSettings:
    """The effective settings of one directed link."""

    latency: float
    bandwidth: float | None
    drop_probability: float


def _check_latency(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(f"latency must be a number of seconds, got {value!r}")
    if not (0 <= value < math.inf):
        raise ValidationError(f"latency must be finite and >= 0 seconds, got {value!r}")
    return float(value)


def _check_bandwidth(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValidationError(f"bandwidth must be None or bytes per second > 0, got {value!r}")
    return None if value == math.inf else float(value)


def _check_drop_probability(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValidationError(f"drop_probability must be within [0, 1], got {value!r}")
    return float(value)


def _check_address(address: Any) -> str:
    if not isinstance(address, str) or not address:
        raise ValidationError(f"a simulated host address must be a non-empty str, got {address!r}")
    return address


class _Host:
    __slots__ = (
        "address",
        "bandwidth",
        "drop_probability",
        "latency",
        "listener",
        "transports",
        "up",
    )

    def __init__(self, address: str) -> None:
        self.address = address
        self.listener: SimListener | None = None
        self.up = True
        # an ordered set: iteration order must not depend on object addresses
        self.transports: dict[SimTransport, None] = {}
        self.latency: float | _Unset = _UNSET
        self.bandwidth: float | _Unset | None = _UNSET
        self.drop_probability: float | _Unset = _UNSET


class _Link:
    """One directed link: its current settings and its transmit queue."""

    __slots__ = (
        "bandwidth",
        "busy",
        "drop_probability",
        "dst",
        "latency",
        "network",
        "queue",
        "src",
        "version",
    )

    def __init__(self, network: SimNetwork, src: str, dst: str) -> None:
        self.network = network
        self.src = src
        self.dst = dst
        self.version = -1
        self.latency = 0.0
        self.bandwidth: float | None = None
        self.drop_probability = 0.0
        self.queue: deque[SimTransport] = deque()  # connections waiting to send a chunk
        self.busy = False  # a chunk is being serialized, or a transmit step is scheduled
        self.refresh()

    def refresh(self) -> None:
        if self.version != self.network._settings_version:
            settings = self.network.link_settings(self.src, self.dst)
            self.latency = settings.latency
            self.bandwidth = settings.bandwidth
            self.drop_probability = settings.drop_probability
            self.version = self.network._settings_version

    def enqueue(self, transport: SimTransport) -> None:
        transport._queued = True
        self.queue.append(transport)
        if not self.busy:
            self.busy = True
            # start on the next loop step, so writes made together travel together and
            # no protocol callback runs inside write()
            transport._loop.call_soon(self._transmit_next)

    def _transmit_next(self) -> None:
        self.busy = False
        self.refresh()
        queue = self.queue
        while queue:
            transport = queue.popleft()
            transport._queued = False
            bandwidth = self.bandwidth
            if bandwidth is None:  # the link was made unlimited while this one waited
                transport._pump()
                continue
            chunk = transport._take_chunk()
            if chunk is None:
                continue
            loop = transport._loop
            done = loop.time() + len(chunk) / bandwidth
            transport._transmit(chunk, done + self.latency)
            if transport._send_buf:
                transport._queued = True
                queue.append(transport)
            self.busy = True
            loop.call_at(done, self._transmit_next)
            transport._after_send()
            return


class SimListener:
    """A host listening for connections on a :class:`SimNetwork`; ``close()`` stops
    accepting new ones (existing connections stay, as with ``asyncio.Server``)."""

    def __init__(self, network: SimNetwork, address: str, protocol_factory: ProtocolFactory):
        self._network = network
        self._address = address
        self.protocol_factory = protocol_factory
        self._serving = True

    @property
    def address(self) -> str:
        return self._address

    @property
    def network(self) -> SimNetwork:
        return self._network

    def is_serving(self) -> bool:
        return self._serving

    def close(self) -> None:
        if not self._serving:
            return
        self._serving = False
        host = self._network._hosts.get(self._address)
        if host is not None and host.listener is self:
            host.listener = None
        self._network._record("%s stops listening", self._address)

    async def wait_closed(self) -> None:
        """Present for symmetry with ``asyncio.Server``; closing is immediate."""

    def __repr__(self) -> str:
        state = "serving" if self._serving else "closed"
        return f"<SimListener {self._address!r} {state}>"


class _ConnectAttempt:
    __slots__ = ("client", "dst", "future", "loop", "network", "protocol_factory", "src", "timers")

    def __init__(
        self,
        network: SimNetwork,
        loop: asyncio.AbstractEventLoop,
        src: str,
        dst: str,
        protocol_factory: ProtocolFactory,
    ) -> None:
        self.network = network
        self.loop = loop
        self.src = src
        self.dst = dst
        self.protocol_factory = protocol_factory
        self.future: asyncio.Future[tuple[SimTransport, asyncio.BaseProtocol]]
        self.future = loop.create_future()
        self.timers: list[asyncio.TimerHandle] = []
        self.client: SimTransport | None = None  # exists once the server accepted

    def finish(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()
        self.network._attempts.pop(self, None)

    def fail(self, exc: BaseException, event: str | None = None) -> None:
        self.finish()
        client, self.client = self.client, None
        if client is not None:
            client._attempt = None
            client._force_close(None, reset_peer=True)
        if not self.future.done():
            if event is not None:
                self.network._record("%s->%s %s", self.src, self.dst, event)
            self.future.set_exception(exc)

    def abandon(self) -> None:
        """The caller of connect() went away (cancelled): undo whatever exists."""
        future = self.future
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result()[0].abort()
        else:
            self.fail(asyncio.CancelledError())


class SimTransport(asyncio.Transport):
    """One end of a simulated connection; implements ``asyncio.Transport``.

    ``get_extra_info`` knows ``'peername'`` and ``'sockname'`` (the host addresses) and
    ``'sim_network'``. Writing after ``close()`` or after the connection was lost is
    silently ignored. ``write_eof`` is not supported (``can_write_eof()`` is false).
    """

    __slots__ = (
        "_acks",
        "_arrival_timer",
        "_attempt",
        "_bounced",
        "_buffered",
        "_closing",
        "_deliver_handle",
        "_high",
        "_id",
        "_inflight",
        "_last_ack",
        "_last_arrival",
        "_link",
        "_local",
        "_loop",
        "_lost",
        "_low",
        "_made",
        "_network",
        "_peer",
        "_protocol",
        "_queued",
        "_reading_paused",
        "_remote",
        "_rx",
        "_rx_offset",
        "_rx_size",
        "_send_buf",
        "_unacked",
        "_window_blocked",
        "_window_timer",
        "_writing_paused",
    )

    def __init__(
        self,
        network: SimNetwork,
        loop: asyncio.AbstractEventLoop,
        connection_id: int,
        local: str,
        remote: str,
        link: _Link,
    ) -> None:
        super().__init__({"peername": remote, "sockname": local, "sim_network": network})
        self._network = network
        self._loop = loop
        self._id = connection_id
        self._local = local
        self._remote = remote
        self._link = link  # outgoing: local -> remote
        self._peer: SimTransport = self
        self._protocol: asyncio.BaseProtocol | None = None
        self._buffered = False
        self._made = False  # connection_made was called
        self._closing = False  # close(), abort() or a reset happened
        self._lost = False  # gone: connection_lost is scheduled or done
        self._attempt: _ConnectAttempt | None = None  # client side, until established
        # sending
        self._send_buf = bytearray()  # written, not yet sent
        self._high = _DEFAULT_HIGH_WATER
        self._low = _DEFAULT_HIGH_WATER // 4
        self._writing_paused = False
        self._queued = False  # waiting in the link's transmit queue
        self._unacked = 0  # sent and not yet consumed by the peer, as far as we know
        self._acks: deque[tuple[float, int]] = deque()  # window updates on their way
        self._last_ack = -math.inf
        self._window_blocked = False
        self._window_timer: asyncio.TimerHandle | None = None
        self._bounced = False  # a reset was sent back for data reaching a closed end
        # receiving
        self._inflight: deque[tuple[float, bytes | _Signal]] = deque()
        self._arrival_timer: asyncio.TimerHandle | None = None
        self._last_arrival = -math.inf
        self._rx: deque[bytes | _Signal] = deque()  # arrived, not yet delivered
        self._rx_offset = 0  # bytes of _rx[0] already delivered
        self._rx_size = 0
        self._reading_paused = False
        self._deliver_handle: asyncio.Handle | None = None

    def __repr__(self) -> str:
        state = "lost" if self._lost else "closing" if self._closing else "open"
        return f"<SimTransport #{self._id} {self._local}->{self._remote} {state}>"

    # ----------------------------------------------------------------- asyncio API

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[return-value]

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return not self._reading_paused and not self._closing

    def pause_reading(self) -> None:
        if not self._closing:
            self._reading_paused = True

    def resume_reading(self) -> None:
        if self._closing or not self._reading_paused:
            return
        self._reading_paused = False
        if self._rx and self._deliver_handle is None:
            self._deliver_handle = self._loop.call_soon(self._deliver)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = _DEFAULT_HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high = high
        self._low = low
        self._check_write_pressure()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        return len(self._send_buf)

    def can_write_eof(self) -> bool:
        return False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data must be a bytes-like object, not {type(data).__name__!r}")
        if self._closing or not data:
            return
        self._send_buf += data  # copies: the caller may reuse its buffer right away
        self._pump()
        self._check_write_pressure()

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        buffers = list(list_of_data)
        for data in buffers:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise TypeError(f"data must be a bytes-like object, not {type(data).__name__!r}")
        if self._closing:
            return
        for data in buffers:
            self._send_buf += data
        if self._send_buf:
            self._pump()
            self._check_write_pressure()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._rx.clear()  # like a socket transport, stop reading at once
        self._rx_size = self._rx_offset = 0
        self._network._record("#%s %s->%s close", self._id, self._local, self._remote)
        if not self._send_buf:
            self._finish_close()
        # else: the send path calls _finish_close once the buffer is empty

    def abort(self) -> None:
        if not self._lost:
            self._network._record("#%s %s->%s abort", self._id, self._local, self._remote)
        self._force_close(None, reset_peer=True)

    # ------------------------------------------------------------------ sending

    def _check_write_pressure(self) -> None:
        size = len(self._send_buf)
        if not self._writing_paused:
            if size > self._high and not self._lost:
                self._writing_paused = True
                try:
                    self._protocol.pause_writing()  # type: ignore[union-attr]
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self._report(exc, "protocol.pause_writing() failed")
        elif size <= self._low:
            self._loop.call_soon(self._after_send)  # never call back inside write()

    def _pump(self) -> None:
        """Send what the link and the receive window allow now."""
        if self._lost or not self._send_buf:
            return
        link = self._link
        link.refresh()
        if link.bandwidth is None:
            arrival = self._loop.time() + link.latency
            while (chunk := self._take_chunk()) is not None:
                self._transmit(chunk, arrival)
        elif not self._queued:
            if self._window_open():
                link.enqueue(self)
            else:
                self._wait_for_window()

    def _take_chunk(self) -> bytes | None:
        buf = self._send_buf
        if self._lost or not buf:
            return None
        if not self._window_open():
            self._wait_for_window()
            return None
        size = self._network._chunk_size
        if len(buf) <= size:
            chunk = bytes(buf)
            buf.clear()
        else:
            chunk = bytes(buf[:size])
            del buf[:size]
        return chunk

    def _transmit(self, chunk: bytes, arrival: float) -> None:
        drop_probability = self._link.drop_probability
        if drop_probability and self._network.random.random() < drop_probability:
            self._network._record("#%s %s->%s chunk lost", self._id, self._local, self._remote)
            self._send_item(_Signal.LOSS, arrival)
        else:
            self._unacked += len(chunk)
            self._send_item(chunk, arrival)

    def _send_item(self, item: bytes | _Signal, arrival: float) -> None:
        peer = self._peer
        if not peer._lost:
            peer._arrive(arrival, item)
        elif type(item) is bytes and not self._bounced and not self._lost:
            # the other end is closed for good: like TCP, it answers with a reset
            self._bounced = True
            back = peer._link
            back.refresh()
            self._arrive(arrival + back.latency, _Signal.RST)

    def _after_send(self) -> None:
        """Bookkeeping after bytes left the buffer; runs as a loop callback."""
        if self._lost:
            return
        if self._writing_paused and len(self._send_buf) <= self._low:
            self._writing_paused = False
            try:
                self._protocol.resume_writing()  # type: ignore[union-attr]
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._report(exc, "protocol.resume_writing() failed")
        if self._closing and not self._send_buf and not self._lost:
            self._finish_close()

    def _finish_close(self) -> None:
        link = self._link
        link.refresh()
        self._send_item(_Signal.EOF, self._loop.time() + link.latency)
        self._force_close(None, reset_peer=False)

    # receive window -----------------------------------------------------------

    def _window_open(self) -> bool:
        acks = self._acks
        if acks:
            now = self._loop.time()
            while acks and acks[0][0] <= now:
                self._unacked -= acks.popleft()[1]
        return self._unacked < self._network._receive_window

    def _wait_for_window(self) -> None:
        self._window_blocked = True
        if self._window_timer is None and self._acks:
            self._window_timer = self._loop.call_at(self._acks[0][0], self._on_window_timer)

    def _add_ack(self, when: float, nbytes: int) -> None:
        if self._lost:
            return
        when = max(when, self._last_ack)
        self._last_ack = when
        self._acks.append((when, nbytes))
        if self._window_blocked and self._window_timer is None:
            self._window_timer = self._loop.call_at(when, self._on_window_timer)

    def _on_window_timer(self) -> None:
        self._window_timer = None
        self._window_blocked = False
        self._pump()
        self._after_send()

    # ---------------------------------------------------------------- receiving

    def _arrive(self, when: float, item: bytes | _Signal) -> None:
        if when < self._last_arrival:  # keep the connection's order if latency dropped
            when = self._last_arrival
        self._last_arrival = when
        self._inflight.append((when, item))
        if self._arrival_timer is None:
            self._arrival_timer = self._loop.call_at(when, self._on_arrival)

    def _on_arrival(self) -> None:
        self._arrival_timer = None
        now = self._loop.time()
        inflight = self._inflight
        got_something = False
        while inflight and inflight[0][0] <= now and not self._lost:
            item = inflight.popleft()[1]
            if type(item) is bytes:
                if self._closing:
                    # closed locally and nobody reads any more: answer with a reset
                    if not self._bounced:
                        self._bounced = True
                        self._link.refresh()
                        self._send_item(_Signal.RST, now + self._link.latency)
                    continue
                self._rx.append(item)
                self._rx_size += len(item)
                got_something = True
            elif item is _Signal.SYN_ACK:
                self._establish()
            elif item is _Signal.EOF:
                if not self._closing:
                    self._rx.append(item)
                    got_something = True
            elif item is _Signal.RST:
                self._network._record(
                    "#%s %s->%s reset by peer", self._id, self._local, self._remote
                )
                self._force_close(self._reset_error("the peer reset it"), reset_peer=False)
            else:  # _Signal.LOSS
                self._network._reset_connection(self, "a chunk was lost in transit")
        if inflight and not self._lost:
            self._arrival_timer = self._loop.call_at(inflight[0][0], self._on_arrival)
        if got_something and self._made and not self._reading_paused:
            self._deliver()

    def _deliver(self) -> None:
        """Hand received bytes to the protocol until it pauses or closes."""
        self._deliver_handle = None
        rx = self._rx
        consumed = 0
        try:
            while rx and not self._reading_paused and not self._closing:
                item = rx[0]
                if type(item) is not bytes:  # end of file
                    rx.popleft()
                    self._on_eof()
                    return
                protocol = self._protocol
                offset = self._rx_offset
                remaining = len(item) - offset
                if self._buffered:
                    try:
                        buf = protocol.get_buffer(remaining)  # type: ignore[union-attr]
                        view = memoryview(buf).cast("B")
                        nbytes = min(view.nbytes, remaining)
                        if nbytes == 0:
                            raise RuntimeError("get_buffer() returned an empty buffer")
                        view[:nbytes] = memoryview(item)[offset : offset + nbytes]
                    except (SystemExit, KeyboardInterrupt):
                        raise
                    except BaseException as exc:
                        self._fatal_error(exc, "protocol.get_buffer() call failed")
                        return
                    if nbytes == remaining:
                        rx.popleft()
                        self._rx_offset = 0
                    else:
                        self._rx_offset = offset + nbytes
                    self._rx_size -= nbytes
                    consumed += nbytes
                    try:
                        protocol.buffer_updated(nbytes)  # type: ignore[union-attr]
                    except (SystemExit, KeyboardInterrupt):
                        raise
                    except BaseException as exc:
                        self._fatal_error(exc, "protocol.buffer_updated() call failed")
                        return
                else:
                    rx.popleft()
                    self._rx_offset = 0
                    data = item[offset:] if offset else item
                    self._rx_size -= remaining
                    consumed += remaining
                    try:
                        protocol.data_received(data)  # type: ignore[union-attr]
                    except (SystemExit, KeyboardInterrupt):
                        raise
                    except BaseException as exc:
                        self._fatal_error(exc, "protocol.data_received() call failed")
                        return
        finally:
            if consumed and not self._peer._lost:
                # the window update travels back to the sender
                self._link.refresh()
                self._peer._add_ack(self._loop.time() + self._link.latency, consumed)

    def _on_eof(self) -> None:
        self._network._record("#%s %s->%s eof received", self._id, self._local, self._remote)
        try:
            keep_open = self._protocol.eof_received()  # type: ignore[union-attr]
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, "protocol.eof_received() call failed")
            return
        if not keep_open:
            self.close()

    # ------------------------------------------------------------- life cycle

    def _make(self, protocol: asyncio.BaseProtocol) -> None:
        self.set_protocol(protocol)
        self._made = True
        try:
            protocol.connection_made(self)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._report(exc, "protocol.connection_made() failed")

    def _establish(self) -> None:
        """The client side: the server's answer arrived."""
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            return
        attempt.client = None
        attempt.finish()
        if attempt.future.done():  # the caller gave up meanwhile
            self._force_close(None, reset_peer=True)
            return
        try:
            protocol = attempt.protocol_factory()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._force_close(None, reset_peer=True)
            attempt.future.set_exception(exc)
            return
        self._network._record("#%s %s->%s established", self._id, self._local, self._remote)
        self._make(protocol)
        attempt.future.set_result((self, protocol))

    def _reset_error(self, reason: str) -> ConnectionResetError:
        return ConnectionResetError(
            errno.ECONNRESET, f"connection {self._local!r} -> {self._remote!r} was reset: {reason}"
        )

    def _report(self, exc: BaseException, message: str) -> None:
        self._loop.call_exception_handler(
            {"message": message, "exception": exc, "transport": self, "protocol": self._protocol}
        )

    def _fatal_error(self, exc: BaseException, message: str) -> None:
        self._report(exc, message)
        self._force_close(exc, reset_peer=True)

    def _force_close(self, exc: BaseException | None, *, reset_peer: bool) -> None:
        """End this side now; the protocol gets connection_lost(exc) on the next step."""
        if self._lost:
            return
        if reset_peer and not self._peer._lost:
            self._link.refresh()
            self._send_item(_Signal.RST, self._loop.time() + self._link.latency)
        self._lost = self._closing = True
        self._send_buf.clear()
        self._rx.clear()
        self._rx_size = self._rx_offset = 0
        self._inflight.clear()
        self._acks.clear()
        for timer in (self._arrival_timer, self._window_timer, self._deliver_handle):
            if timer is not None:
                timer.cancel()
        self._arrival_timer = self._window_timer = self._deliver_handle = None
        if self._queued:
            self._queued = False
            self._link.queue.remove(self)
        self._network._forget(self)
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.client = None
            attempt.fail(
                PeerUnreachable(
                    f"connection from {self._local!r} to {self._remote!r} was reset "
                    f"during the handshake"
                ),
                event="reset during handshake",
            )
        if self._made:
            self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.connection_lost(exc)


class SimNetwork:
    """A network of simulated hosts in memory. See the module documentation.

    ``latency`` (seconds), ``bandwidth`` (bytes per second or ``None`` for unlimited) and
    ``drop_probability`` are the defaults for every directed link. ``connect_timeout``
    is how long a connect waits for an answer that never comes (partition).
    ``receive_window`` (bytes) bounds what a connection has in flight plus unread at the
    receiver; ``chunk_size`` is the unit of transmission. ``trace=True`` records events
    in :attr:`trace`.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        latency: float = 0.05,
        bandwidth: float | None = None,
        drop_probability: float = 0.0,
        connect_timeout: float = 10.0,
        receive_window: int = 4 * 1024 * 1024,
        chunk_size: int = 64 * 1024,
        trace: bool = False,
    ) -> None:
        self.seed = seed
        self.random = random.Random(seed)
        self._latency = _check_latency(latency)
        self._bandwidth = _check_bandwidth(bandwidth)
        self._drop_probability = _check_drop_probability(drop_probability)
        if not connect_timeout > 0:
            raise ValidationError(f"connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        self._connect_timeout = float(connect_timeout)
        if not (isinstance(receive_window, int) and receive_window > 0):
            raise ValidationError(f"receive_window must be an int > 0, got {receive_window!r}")
        self._receive_window = receive_window
        if not (isinstance(chunk_size, int) and chunk_size > 0):
            raise ValidationError(f"chunk_size must be an int > 0, got {chunk_size!r}")
        self._chunk_size = chunk_size
        self.trace: list[tuple[float, str]] | None = [] if trace else None

        self._hosts: dict[str, _Host] = {}
        self._links: dict[tuple[str, str], _Link] = {}
        self._pair_settings: dict[tuple[str, str], dict[str, Any]] = {}
        self._settings_version = 0
        self._partitions: list[tuple[frozenset[str], frozenset[str]]] = []
        self._transports: dict[SimTransport, None] = {}  # live ones, in creation order
        self._attempts: dict[_ConnectAttempt, None] = {}
        self._next_connection_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def latency(self) -> float:
        return self._latency

    @property
    def bandwidth(self) -> float | None:
        return self._bandwidth

    @property
    def drop_probability(self) -> float:
        return self._drop_probability

    @property
    def connect_timeout(self) -> float:
        return self._connect_timeout

    @property
    def receive_window(self) -> int:
        return self._receive_window

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    # ------------------------------------------------------------------ settings

    def set_host(
        self,
        address: str,
        *,
        latency: float | _Unset = _UNSET,
        bandwidth: float | _Unset | None = _UNSET,
        drop_probability: float | _Unset = _UNSET,
    ) -> None:
        """Settings for every link from or to ``address`` (the worse of two hosts' values
        wins; per-pair settings win over both). Arguments not given stay as they are."""
        host = self._host(address)
        if latency is not _UNSET:
            host.latency = _check_latency(latency)
        if bandwidth is not _UNSET:
            host.bandwidth = _check_bandwidth(bandwidth)
        if drop_probability is not _UNSET:
            host.drop_probability = _check_drop_probability(drop_probability)
        self._settings_version += 1

    def set_link(
        self,
        a: str,
        b: str,
        *,
        latency: float | _Unset = _UNSET,
        bandwidth: float | _Unset | None = _UNSET,
        drop_probability: float | _Unset = _UNSET,
        symmetric: bool = True,
    ) -> None:
        """Settings for the link ``a -> b`` (and ``b -> a`` when ``symmetric``), over the
        host and network defaults. Arguments not given stay as they are. New values apply
        to chunks sent from now on."""
        changes: dict[str, Any] = {}
        if latency is not _UNSET:
            changes["latency"] = _check_latency(latency)
        if bandwidth is not _UNSET:
            changes["bandwidth"] = _check_bandwidth(bandwidth)
        if drop_probability is not _UNSET:
            changes["drop_probability"] = _check_drop_probability(drop_probability)
        pairs = [(_check_address(a), _check_address(b))]
        if symmetric and a != b:
            pairs.append((b, a))
        for pair in pairs:
            self._pair_settings.setdefault(pair, {}).update(changes)
        self._settings_version += 1

    def link_settings(self, src: str, dst: str) -> LinkSettings:
        """The settings the directed link ``src -> dst`` uses now."""
        pair = self._pair_settings.get((src, dst), {})
        ends = [self._hosts.get(src), self._hosts.get(dst)]

        def host_values(name: str, default: Any) -> list[Any]:
            values = [getattr(host, name) if host is not None else _UNSET for host in ends]
            return [default if value is _UNSET else value for value in values]

        if "latency" in pair:
            latency = pair["latency"]
        else:
            latency = max(host_values("latency", self._latency))
        if "bandwidth" in pair:
            bandwidth = pair["bandwidth"]
        else:
            finite = [v for v in host_values("bandwidth", self._bandwidth) if v is not None]
            bandwidth = min(finite) if finite else None
        if "drop_probability" in pair:
            drop_probability = pair["drop_probability"]
        else:
            drop_probability = max(host_values("drop_probability", self._drop_probability))
        return LinkSettings(latency, bandwidth, drop_probability)

    # ------------------------------------------------------------- connections

    def listen(self, address: str, protocol_factory: ProtocolFactory) -> SimListener:
        """Accept connections to ``address``, making a protocol for each with
        ``protocol_factory()``. Listening on a crashed host restarts it."""
        host = self._host(address)
        if host.listener is not None:
            raise OSError(errno.EADDRINUSE, f"{address!r} is already listening")
        if not host.up:
            self.restart(address)
        listener = SimListener(self, address, protocol_factory)
        host.listener = listener
        self._record("%s listens", address)
        return listener

    async def connect(
        self, src: str, dst: str, protocol_factory: ProtocolFactory
    ) -> tuple[SimTransport, asyncio.BaseProtocol]:
        """Open a connection from host ``src`` to host ``dst``; returns the client's
        ``(transport, protocol)`` one round trip later. Raises
        :class:`~swarmgrad.utils.errors.PeerUnreachable` when refused (after a round
        trip), unanswered (after ``connect_timeout``) or reset during the handshake."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        source = self._host(src)
        _check_address(dst)
        if not source.up:
            raise PeerUnreachable(
                f"cannot connect from {src!r} to {dst!r}: {src!r} crashed and was not restarted"
            )
        attempt = _ConnectAttempt(self, loop, src, dst, protocol_factory)
        self._attempts[attempt] = None
        link = self._link(src, dst)
        now = loop.time()
        self._record("%s->%s connect", src, dst)
        attempt.timers.append(loop.call_at(now + link.latency, self._on_syn, attempt))
        attempt.timers.append(
            loop.call_at(now + self._connect_timeout, self._on_connect_timeout, attempt)
        )
        try:
            return await attempt.future
        except BaseException:
            attempt.abandon()
            raise

    def _on_syn(self, attempt: _ConnectAttempt) -> None:
        """The SYN reaches the destination host."""
        if attempt.future.done():
            return
        src, dst, loop = attempt.src, attempt.dst, attempt.loop
        if self._blocked(src, dst):
            self._record("%s->%s syn lost (partition)", src, dst)
            return  # nobody answers: the connect timeout will fire
        back = self._link(dst, src)
        answer_at = loop.time() + back.latency
        host = self._hosts.get(dst)
        listener = host.listener if host is not None and host.up else None
        protocol: asyncio.BaseProtocol | None = None
        if listener is not None:
            try:
                protocol = listener.protocol_factory()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                loop.call_exception_handler(
                    {"message": f"protocol factory of listener {dst!r} failed", "exception": exc}
                )
        if protocol is None:
            error = PeerUnreachable(
                f"connection from {src!r} to {dst!r} refused: nothing listens on {dst!r}"
            )
            attempt.timers.append(loop.call_at(answer_at, attempt.fail, error, "refused"))
            return
        connection_id = self._next_connection_id
        self._next_connection_id += 1
        server = SimTransport(self, loop, connection_id, dst, src, back)
        client = SimTransport(self, loop, connection_id, src, dst, self._link(src, dst))
        server._peer, client._peer = client, server
        client._attempt, attempt.client = attempt, client
        for transport in (client, server):
            self._transports[transport] = None
            self._hosts[transport._local].transports[transport] = None
        self._record("#%s %s->%s accepted", connection_id, src, dst)
        server._send_item(_Signal.SYN_ACK, answer_at)  # before anything the server writes
        server._make(protocol)

    def _on_connect_timeout(self, attempt: _ConnectAttempt) -> None:
        error = PeerUnreachable(
            f"connection from {attempt.src!r} to {attempt.dst!r} timed out: no answer in "
            f"{self._connect_timeout} s"
        )
        attempt.fail(error, "timed out")

    # ------------------------------------------------------------------- faults

    def partition(self, group_a: Iterable[str], group_b: Iterable[str]) -> None:
        """Cut every link between a host of ``group_a`` and a host of ``group_b``, both
        ways: connections across are reset, new ones time out, until :meth:`heal`."""
        if isinstance(group_a, str) or isinstance(group_b, str):
            raise ValidationError("partition() takes two collections of addresses, not strs")
        a, b = frozenset(group_a), frozenset(group_b)
        if a & b:
            raise ValidationError(f"a host cannot be on both sides of a partition: {sorted(a & b)}")
        self._partitions.append((a, b))
        self._record("partition %s | %s", sorted(a), sorted(b))
        for transport in list(self._transports):
            local, remote = transport._local, transport._remote
            if not transport._lost and (
                (local in a and remote in b) or (local in b and remote in a)
            ):
                self._reset_connection(transport, "a network partition cut it")

    def heal(self) -> None:
        """Remove every partition; existing connections stay reset."""
        self._partitions.clear()
        self._record("heal")

    def disconnect(self, a: str, b: str) -> None:
        """Reset every connection between ``a`` and ``b`` now; new ones may be opened."""
        self._record("disconnect %s %s", a, b)
        for transport in list(self._transports):
            if not transport._lost and {transport._local, transport._remote} == {a, b}:
                self._reset_connection(transport, "simulated disconnect")

    def crash(self, address: str) -> None:
        """The host dies: its listener disappears, every connection of it is reset (both
        sides get ``connection_lost(ConnectionResetError)``), its pending connects fail,
        and it can neither connect nor be reached until it listens again or
        :meth:`restart` is called."""
        host = self._host(address)
        self._record("crash %s", address)
        host.up = False
        if host.listener is not None:
            host.listener.close()
        for transport in list(host.transports):
            self._reset_connection(transport, f"{address!r} crashed")
        for attempt in list(self._attempts):  # connects whose SYN is still on its way
            if attempt.src == address:
                attempt.fail(
                    PeerUnreachable(f"{address!r} crashed while connecting to {attempt.dst!r}")
                )

    def restart(self, address: str) -> None:
        """Bring a crashed host back (without a listener; see :meth:`listen`)."""
        host = self._host(address)
        if not host.up:
            host.up = True
            self._record("restart %s", address)

    def close(self) -> None:
        """Tear everything down: listeners close, pending connects fail, open connections
        end with ``connection_lost(ConnectionAbortedError)``."""
        for host in self._hosts.values():
            if host.listener is not None:
                host.listener.close()
        for attempt in list(self._attempts):
            attempt.fail(PeerUnreachable("the simulated network was closed"))
        for transport in list(self._transports):
            transport._force_close(
                ConnectionAbortedError(errno.ECONNABORTED, "the simulated network was closed"),
                reset_peer=False,
            )

    # ------------------------------------------------------------- inspection

    def is_up(self, address: str) -> bool:
        """False while the host is crashed."""
        host = self._hosts.get(address)
        return host is None or host.up

    def transports(self, address: str | None = None) -> list[SimTransport]:
        """Open transports (of one host, or all), in creation order."""
        if address is None:
            return list(self._transports)
        host = self._hosts.get(address)
        return list(host.transports) if host is not None else []

    # ---------------------------------------------------------------- internals

    def _host(self, address: str) -> _Host:
        host = self._hosts.get(address)
        if host is None:
            host = self._hosts[_check_address(address)] = _Host(address)
        return host

    def _link(self, src: str, dst: str) -> _Link:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[src, dst] = _Link(self, src, dst)
        else:
            link.refresh()
        return link

    def _blocked(self, a: str, b: str) -> bool:
        for group_a, group_b in self._partitions:
            if (a in group_a and b in group_b) or (a in group_b and b in group_a):
                return True
        return False

    def _reset_connection(self, transport: SimTransport, reason: str) -> None:
        self._record("#%s %s<->%s %s", transport._id, transport._local, transport._remote, reason)
        for end in (transport, transport._peer):
            end._force_close(end._reset_error(reason), reset_peer=False)

    def _forget(self, transport: SimTransport) -> None:
        self._transports.pop(transport, None)
        host = self._hosts.get(transport._local)
        if host is not None:
            host.transports.pop(transport, None)

    def _record(self, event: str, *args: Any) -> None:
        """Append ``(time, event % args)`` to the trace; formats nothing when off."""
        if self.trace is None:
            return
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self.trace.append((loop.time() if loop is not None else 0.0, event % args))
