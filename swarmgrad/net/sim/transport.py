"""The sockets of the simulated network: :class:`SimTransport` (one end of a
connection, an ``asyncio.Transport``), :class:`SimListener` and the state of a connect
in progress.

A transport moves its bytes over a :class:`~swarmgrad.net.sim.links.Link` and honours
the receive window, closing and reset rules described in
:mod:`swarmgrad.net.sim.network`, which creates transports and re-exports these classes.
"""

from __future__ import annotations

import asyncio
import errno
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from swarmgrad.net.sim.links import DEFAULT_HIGH_WATER, Link, Signal
from swarmgrad.utils.errors import PeerUnreachable

if TYPE_CHECKING:
    from swarmgrad.net.sim.network import SimNetwork

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


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


class ConnectAttempt:
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
        link: Link,
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
        self._attempt: ConnectAttempt | None = None  # client side, until established
        # sending
        self._send_buf = bytearray()  # written, not yet sent
        self._high = DEFAULT_HIGH_WATER
        self._low = DEFAULT_HIGH_WATER // 4
        self._writing_paused = False
        self._queued = False  # waiting in the link's transmit queue
        self._unacked = 0  # sent and not yet consumed by the peer, as far as we know
        self._acks: deque[tuple[float, int]] = deque()  # window updates on their way
        self._last_ack = -math.inf
        self._window_blocked = False
        self._window_timer: asyncio.TimerHandle | None = None
        self._bounced = False  # a reset was sent back for data reaching a closed end
        # receiving
        self._inflight: deque[tuple[float, bytes | Signal]] = deque()
        self._arrival_timer: asyncio.TimerHandle | None = None
        self._last_arrival = -math.inf
        self._rx: deque[bytes | Signal] = deque()  # arrived, not yet delivered
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
            high = DEFAULT_HIGH_WATER if low is None else 4 * low
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
                self._call_protocol(self._protocol.pause_writing, fatal=False)  # type: ignore[union-attr]
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
            self._send_item(Signal.LOSS, arrival)
        else:
            self._unacked += len(chunk)
            self._send_item(chunk, arrival)

    def _send_item(self, item: bytes | Signal, arrival: float) -> None:
        peer = self._peer
        if not peer._lost:
            peer._arrive(arrival, item)
        elif type(item) is bytes and not self._bounced and not self._lost:
            # the other end is closed for good: like TCP, it answers with a reset
            self._bounced = True
            back = peer._link
            back.refresh()
            self._arrive(arrival + back.latency, Signal.RST)

    def _after_send(self) -> None:
        """Bookkeeping after bytes left the buffer; runs as a loop callback."""
        if self._lost:
            return
        if self._writing_paused and len(self._send_buf) <= self._low:
            self._writing_paused = False
            self._call_protocol(self._protocol.resume_writing, fatal=False)  # type: ignore[union-attr]
        if self._closing and not self._send_buf and not self._lost:
            self._finish_close()

    def _finish_close(self) -> None:
        link = self._link
        link.refresh()
        self._send_item(Signal.EOF, self._loop.time() + link.latency)
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

    def _arrive(self, when: float, item: bytes | Signal) -> None:
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
                        self._send_item(Signal.RST, now + self._link.latency)
                    continue
                self._rx.append(item)
                self._rx_size += len(item)
                got_something = True
            elif item is Signal.SYN_ACK:
                self._establish()
            elif item is Signal.EOF:
                if not self._closing:
                    self._rx.append(item)
                    got_something = True
            elif item is Signal.RST:
                self._network._record(
                    "#%s %s->%s reset by peer", self._id, self._local, self._remote
                )
                self._force_close(self._reset_error("the peer reset it"), reset_peer=False)
            else:  # Signal.LOSS
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
                    if not self._call_protocol(protocol.buffer_updated, nbytes, fatal=True):  # type: ignore[union-attr]
                        return
                else:
                    rx.popleft()
                    self._rx_offset = 0
                    data = item[offset:] if offset else item
                    self._rx_size -= remaining
                    consumed += remaining
                    if not self._call_protocol(protocol.data_received, data, fatal=True):  # type: ignore[union-attr]
                        return
        finally:
            if consumed and not self._peer._lost:
                # the window update travels back to the sender
                self._link.refresh()
                self._peer._add_ack(self._loop.time() + self._link.latency, consumed)

    def _call_protocol(self, callback: Callable[..., None], *args: Any, fatal: bool) -> bool:
        """Call one of the protocol's callbacks; False if it raised. As in asyncio's
        transports, an error in a callback that takes received data is ``fatal`` to the
        transport; one in a flow-control callback is only reported."""
        try:
            callback(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            if fatal:
                self._fatal_error(exc, f"protocol.{callback.__name__}() call failed")
            else:
                self._report(exc, f"protocol.{callback.__name__}() failed")
            return False
        return True

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
            self._send_item(Signal.RST, self._loop.time() + self._link.latency)
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


__all__ = ["ConnectAttempt", "ProtocolFactory", "SimListener", "SimTransport"]
