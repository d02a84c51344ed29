"""The secure channel under every connection: TLS 1.3 driven through ``ssl.MemoryBIO``.

Why not asyncio's built-in ``ssl=`` transports: they copy every record several times and
reached about a fifth of raw socket speed here, and they cannot run over a relayed stream.
:class:`TLSLayer` is one small driver for both cases: it is the *protocol* of the lower
transport (a TCP socket, or a stream relayed through another peer) and the *transport* of
the upper protocol (the multiplexed :class:`~swarmgrad.net.mux.Connection`).

Two record modes, chosen by ALPN during the TLS handshake:

* ``swarmgrad/4`` (both sides offer it first): as soon as its TLS handshake completes,
  each side sends a 32-byte key share as TLS application data and from then on sends
  AES-256-GCM records keyed from that share (:mod:`swarmgrad.net.records`); it reads the
  other side's records once it has read the other's share. A record per mux frame
  payload, sealed in one C call and opened straight into the buffer the mux offers (a
  tensor's memory when a reader waits), about 3x less CPU per byte than the stdlib's
  record layer. Sending without waiting for the other's share lets the dialer's HELLO
  travel with its TLS Finished: a new connection is ready two flights sooner.
* ``swarmgrad/4-tls``: plain TLS 1.3 records end to end (``SWARMGRAD_TLS_RECORDS=1``, or a
  peer that does not offer ``swarmgrad/4``).

Under both ids the layer offers the upper protocol the session's ``"channel_binding"``, to
which the connection handshake binds the dialer's proof of identity.

Small writes are corked in both modes: an RPC's OPEN, DATA and FIN frames become one record
and one syscall.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import ssl
from typing import Any

from swarmgrad.net import records, workers
from swarmgrad.net.tls import BOUND_HANDSHAKE_ALPNS, FAST_RECORDS_ALPN, certificate_identity
from swarmgrad.utils.errors import HandshakeError, SwarmgradError

logger = logging.getLogger(__name__)

# Receive buffers start small (a DHT peer keeps many mostly idle connections; 64 KiB
# each was 4 MB of a 64-peer swarm member's 34 MB) and grow while a connection is busy,
# up to what the largest record needs.
_INITIAL_RX_BUFFER = 16 * 1024
_MAX_TLS_RX_BUFFER = 1024 * 1024
_MAX_RX_BUFFER = records.MAX_RECORD + records.LENGTH.size  # FAST mode: one largest record
_HIGH_WATER = 4 * 1024 * 1024  # outgoing ciphertext buffered in the lower transport
_LOW_WATER = 1024 * 1024
# Writes smaller than this are corked: gathered and sealed as one record at the end of the
# event-loop iteration.
_CORK_LIMIT = 64 * 1024


class TrafficCounter:
    """Bytes a peer moved through its sockets (TLS records included), for its metrics.

    Counted on the TCP layer only: a relayed connection's bytes already pass through the
    socket to the relay, so they are not counted twice. Plain ints updated on the event
    loop thread; other threads may read them (a torn read is impossible for an int)."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    def __repr__(self) -> str:
        return f"TrafficCounter(sent={self.sent}, received={self.received})"


class _Mode(enum.Enum):
    """What the bytes we receive are (we send AES-GCM records from KEYS on)."""

    HANDSHAKE = 0  # TLS handshake in progress
    KEYS = 1  # the peer's record key share, inside TLS, then its AES-GCM records
    TLS = 2  # plain TLS records
    FAST = 3  # AES-GCM records


class TLSLayer(asyncio.BufferedProtocol):
    """Secures the upper protocol's bytes over the lower transport.

    The upper protocol's ``connection_made`` is called once the channel is ready; if the
    handshake fails only ``connection_lost`` is called, with a HandshakeError.
    ``get_extra_info("tls_peer_id")`` gives the PeerID proven by the remote certificate
    (dialer side), ``"tls_admission_token"`` the access token its certificate carries (or
    None); ``"peername"`` is forwarded from below; ``"records"`` says which record
    mode was negotiated.
    """

    def __init__(
        self,
        context: ssl.SSLContext,
        upper: asyncio.BaseProtocol,
        *,
        server_side: bool,
        traffic: TrafficCounter | None = None,
    ):
        self._upper = upper
        self._traffic = traffic
        if hasattr(upper, "carrier"):
            upper.carrier = self  # lets the upper protocol abort us before it is connected
        self._server_side = server_side
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._mode = _Mode.HANDSHAKE
        self._lower: Any = None
        self._rx = bytearray(_INITIAL_RX_BUFFER)
        self._rx_view = memoryview(self._rx)
        self._rx_start = 0  # FAST mode: unparsed ciphertext is rx[start:filled]
        self._rx_filled = 0
        self._plain: bytearray | None = None  # FAST mode: records too big for the upper buffer
        self._closing = False
        self._upper_lost = False
        self._upper_paused = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._extra: dict[str, Any] = {}
        self._corked: list[bytes] = []
        self._corked_size = 0
        self._flush_scheduled = False
        self._connected = False  # the upper protocol may write
        self._peer_share = b""
        self._sealer: records.Sealer | None = None
        self._opener: records.Opener | None = None
        # FAST mode, records sealed on worker threads: (job, its future or None when it
        # was sealed inline, the loop future resolved once the job let go of its
        # plaintext), written to the lower transport strictly in this order
        self._sealing: collections.deque[tuple[Any, Any, Any]] = collections.deque()
        self._sealing_bytes = 0
        self._close_when_sealed = False
        # FAST mode, a record opened on a worker thread: its future and plaintext size;
        # no later record is parsed (and the ciphertext stays put) until it is delivered
        self._opening: Any = None
        self._opening_size = 0
        self._paused_for_opening = False

    # ---------------------------------------------------------------- lower protocol side

    def connection_made(self, transport: Any) -> None:
        self._lower = transport
        self._loop = asyncio.get_running_loop()
        for name in ("peername", "sockname", "socket"):
            self._extra[name] = transport.get_extra_info(name)
        if hasattr(transport, "set_write_buffer_limits"):
            transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)
        self._step_handshake()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._mode is _Mode.FAST:
            return self._rx_view[self._rx_filled :]
        return self._rx_view

    def buffer_updated(self, nbytes: int) -> None:
        if self._traffic is not None:
            self._traffic.received += nbytes
        if self._mode is _Mode.FAST:
            self._rx_filled += nbytes
            if self._opening is None:
                self._open_records()
            else:  # a worker opens a record in place: keep the bytes, parse them after
                self._pause_if_full()
            return
        self._incoming.write(self._rx_view[:nbytes])
        if nbytes == len(self._rx) and len(self._rx) < _MAX_TLS_RX_BUFFER:  # busy: grow
            self._rx = bytearray(2 * len(self._rx))
            self._rx_view = memoryview(self._rx)
        if self._mode is _Mode.HANDSHAKE:
            self._step_handshake()
        if self._mode is _Mode.KEYS:
            self._receive_key_share()
        if self._mode is _Mode.TLS:
            self._decrypt()
        elif self._mode is _Mode.FAST:
            self._open_records()

    def eof_received(self) -> bool:
        if self._mode is _Mode.TLS:
            self._incoming.write_eof()
            self._decrypt()
        self._lose_upper(None)
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._mode in (_Mode.HANDSHAKE, _Mode.KEYS):
            self._fail_handshake(exc or ConnectionResetError("connection closed during TLS"))
        self._lose_upper(exc)

    def pause_writing(self) -> None:
        self._upper_paused = True
        if self._ready and not self._upper_lost:
            self._upper.pause_writing()

    def resume_writing(self) -> None:
        self._upper_paused = False
        if self._ready and not self._upper_lost:
            self._upper.resume_writing()

    # ---------------------------------------------------------------- upper transport side

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.write_buffers((data,))

    def writelines(self, buffers: Any) -> None:
        self.write_buffers(buffers)

    def write_buffers(self, buffers: Any) -> asyncio.Future | None:
        """``writelines`` that may seal on a worker thread: returns None when every
        buffer was consumed, else a future that resolves once the worker let go of them
        (the caller must not reuse its buffers before). A buffer of at least the cork
        limit is sealed together with the small writes corked before it (a frame header):
        one write to the socket, no join."""
        if self._closing:
            return None
        released = None
        for data in buffers:
            size = len(data)  # (bytes, or memoryviews cast to bytes: the mux's writes)
            if size < _CORK_LIMIT:
                if self._corked_size + size > _CORK_LIMIT:
                    self._seal_corked()
                self._corked.append(bytes(data))
                self._corked_size += size
            else:
                corked = self._take_corked()
                released = self._seal(*corked, data) or released
        if self._corked:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush_corked)
        else:
            self._flush()
        return released

    def flush(self) -> None:
        """Seal and send corked writes now (the upper protocol finished a message)."""
        if self._corked and not self._closing:
            self._seal_corked()
            self._flush()

    def close(self) -> None:
        if self._closing:
            return
        if self._ready:
            self._seal_corked()
            if self._sealing:  # records still on worker threads: close once written
                self._closing = self._close_when_sealed = True
                return
            if self._sealer is None:
                try:
                    self._ssl.unwrap()  # queue close_notify
                except (ssl.SSLError, ssl.SSLWantReadError):
                    pass
            self._flush()
        self._closing = True
        if self._lower is not None:
            self._lower.close()

    def abort(self) -> None:
        self._closing = True
        if self._lower is not None:
            self._lower.abort()

    def is_closing(self) -> bool:
        return self._closing or self._lower is None or self._lower.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def pause_reading(self) -> None:
        self._lower.pause_reading()

    def resume_reading(self) -> None:
        self._lower.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._lower.get_write_buffer_size() + self._sealing_bytes

    # ---------------------------------------------------------------- sending

    @property
    def _ready(self) -> bool:
        return self._connected

    def _seal(self, *plaintexts: bytes | bytearray | memoryview) -> asyncio.Future | None:
        """Seal and write; a future (see :meth:`write_buffers`) when a worker seals."""
        if self._sealer is not None:
            lower = self._lower
            if lower is None or lower.is_closing():
                return None
            if len(plaintexts) == 1 and len(plaintexts[0]) < records.POOLED_RECORD_MIN:
                # RPC-sized: sealed inline, as cheaply as possible
                record = self._sealer.seal_small(plaintexts[0])
                if self._sealing:  # earlier records are still on worker threads
                    job = records.SealJob(None, len(record))
                    job.buffers.append(record)
                    self._sealing.append((job, None, None))
                    self._sealing_bytes += job.nbytes
                else:
                    self._write_sealed((record,))
                return None
            # buffers of records reserved but not yet written are not free either
            self._sealer.release(lower.get_write_buffer_size() + self._sealing_bytes)
            job = self._sealer.prepare(*plaintexts)
            pool = workers.pool() if job.nbytes >= workers.OFFLOAD_MIN else None
            if pool is not None:
                released = self._loop.create_future()
                try:
                    future = pool.submit(job.run)
                except RuntimeError:  # the pool was shut down (interpreter exit)
                    pool = None
                else:
                    entry = (job, future, released)
                    self._sealing.append(entry)
                    self._sealing_bytes += job.nbytes
                    future.add_done_callback(self._sealed_on_worker)
                    return released
            job.run()
            if self._sealing:  # earlier records are still on worker threads: after them
                self._sealing.append((job, None, None))
                self._sealing_bytes += job.nbytes
            else:
                self._write_sealed(job.buffers)
            return None
        try:
            for data in plaintexts:
                self._ssl.write(data)
        except ssl.SSLError as e:
            self._abort_with(e)
        return None

    def _sealed_on_worker(self, _future: Any) -> None:
        """Worker thread: a job finished; the loop writes what is ready, in order."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to write to
            self._loop.call_soon_threadsafe(self._write_ready)

    def _write_ready(self) -> None:
        """Write the sealed records at the head of the queue, in order; resolve the
        futures of every finished job (its plaintext is free even if not yet written)."""
        for _, future, released in self._sealing:
            if future is not None and future.done() and not released.done():
                released.set_result(None)
        while self._sealing:
            job, future, released = self._sealing[0]
            if future is not None and not future.done():
                break
            self._sealing.popleft()
            if released is not None and not released.done():  # it finished just now
                released.set_result(None)
            self._sealing_bytes -= job.nbytes
            if future is not None and future.exception() is not None:
                self._abort_with(future.exception())
                return
            if self._lower is not None and not self._lower.is_closing():
                self._write_sealed(job.buffers)
        if not self._sealing and self._close_when_sealed:
            self._close_when_sealed = False
            if self._sealer is None:
                with contextlib.suppress(ssl.SSLError, ssl.SSLWantReadError):
                    self._ssl.unwrap()
            self._flush()
            if self._lower is not None:
                self._lower.close()

    def _write_sealed(self, buffers: Any) -> None:
        lower = self._lower
        if self._outgoing.pending:  # our TLS Finished and share go first, together
            buffers = [self._outgoing.read(), *buffers]
        traffic = self._traffic
        for buffer in buffers:  # one by one: the stdlib's writelines joins them (a copy)
            if traffic is not None:
                traffic.sent += len(buffer)
            lower.write(buffer)

    def _take_corked(self) -> list[bytes]:
        if not self._corked:
            return []
        data = self._corked[0] if len(self._corked) == 1 else b"".join(self._corked)
        self._corked.clear()
        self._corked_size = 0
        return [data]

    def _seal_corked(self) -> None:
        if self._corked:
            self._seal(*self._take_corked())

    def _flush_corked(self) -> None:
        self._flush_scheduled = False
        if not self._closing:
            self._seal_corked()
            self._flush()

    def _flush(self) -> None:
        """Hand TLS output (handshake, TLS-mode records) to the lower transport."""
        if self._outgoing.pending and self._lower is not None and not self._lower.is_closing():
            data = self._outgoing.read()
            if self._traffic is not None:
                self._traffic.sent += len(data)
            self._lower.write(data)

    # ---------------------------------------------------------------- handshake

    def _step_handshake(self) -> None:
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, OSError) as e:
            self._flush()
            self._fail_handshake(e)
            self._lower.abort()
            return
        if not self._server_side:
            try:
                peer_id, token = certificate_identity(self._ssl.getpeercert(binary_form=True))
                self._extra["tls_peer_id"] = peer_id
                self._extra["tls_admission_token"] = token
            except HandshakeError as e:
                self._fail_handshake(e)
                self._lower.abort()
                return
        self._extra["ssl_object"] = self._ssl
        self._extra["cipher"] = self._ssl.cipher()
        alpn = self._ssl.selected_alpn_protocol()
        if alpn in BOUND_HANDSHAKE_ALPNS:
            # the dialer's TLS Finished: unique to this session (see swarmgrad.net.handshake)
            self._extra["channel_binding"] = self._ssl.get_channel_binding("tls-unique")
        if alpn == FAST_RECORDS_ALPN:
            # Our last TLS bytes (the dialer's Finished, then our share) wait in the BIO and
            # leave with our first AES-GCM record (the mux's HELLO, written at once), one
            # send for all; the flush scheduled after it catches the case of no record.
            self._mode = _Mode.KEYS
            share = os.urandom(records.SHARE_SIZE)
            self._ssl.write(share)
            key = records.direction_key(share, from_dialer=not self._server_side)
            self._sealer = records.Sealer(key)
            self._extra["records"] = "aes-256-gcm"
            self._connect_upper()
            self._loop.call_soon(self._flush)
            if not self._upper_lost:
                self._receive_key_share()
        else:
            self._flush()
            self._mode = _Mode.TLS
            self._extra["records"] = "tls"
            self._connect_upper()
            self._decrypt()

    def _receive_key_share(self) -> None:
        """Read the peer's share from TLS, then read its AES-GCM records.

        The peer's share is the last TLS record it sends; whatever follows it in the BIO is
        already AES-GCM records, so it is moved to the record buffer untouched."""
        try:
            while len(self._peer_share) < records.SHARE_SIZE:
                self._peer_share += self._ssl.read(records.SHARE_SIZE - len(self._peer_share))
        except ssl.SSLWantReadError:
            return  # (reading makes no TLS output of ours: nothing to flush)
        except ssl.SSLError as e:
            self._fail_handshake(e)
            self._lower.abort()
            return
        key = records.direction_key(self._peer_share, from_dialer=self._server_side)
        self._opener = records.Opener(key)
        leftover = self._incoming.read()
        self._rx = bytearray(max(_INITIAL_RX_BUFFER, len(leftover)))
        self._rx_view = memoryview(self._rx)
        self._rx_view[: len(leftover)] = leftover
        self._rx_start, self._rx_filled = 0, len(leftover)
        self._mode = _Mode.FAST
        self._open_records()

    def _connect_upper(self) -> None:
        self._connected = True
        self._upper.connection_made(self)
        if self._upper_paused:
            self._upper.pause_writing()

    # ---------------------------------------------------------------- receiving

    def _open_records(self) -> None:
        """Open every complete record into the upper protocol's buffers."""
        view, opener, upper = self._rx_view, self._opener, self._upper
        pos, end = self._rx_start, self._rx_filled
        busy = end == len(view)
        needed = records.LENGTH.size  # room the next, incomplete record needs
        try:
            while not self._upper_lost and end - pos >= records.LENGTH.size:
                prefix = view[pos : pos + records.LENGTH.size]
                length = opener.record_length(prefix)
                body = pos + records.LENGTH.size
                if end - body < length:
                    needed = records.LENGTH.size + length
                    break
                size = length - records.TAG_SIZE
                target = memoryview(upper.get_buffer(size))
                if len(target) >= size:  # straight into the reader's memory
                    pool = None
                    if size >= workers.OFFLOAD_MIN and self._extra.get("socket") is not None:
                        # (a socket: its reading can pause while the buffer is pinned)
                        pool = workers.pool()
                    if pool is not None:
                        self._open_on_worker(pool, prefix, view[body : body + length], target)
                        self._rx_start, self._rx_filled = body + length, end
                        self._pause_if_full()
                        return  # the rest waits, in place, until the worker is done
                    opener.open_into(prefix, view[body : body + length], target[:size])
                    upper.buffer_updated(size)
                else:
                    self._open_in_pieces(prefix, view[body : body + length], size)
                pos = body + length
        except SwarmgradError as e:
            self._abort_with(e)
            return
        if pos == end:
            pos = end = 0
        wanted = max(needed, min(2 * len(view), _MAX_RX_BUFFER) if busy else 0)
        if wanted > len(view):  # a bigger record is coming, or the connection is busy
            grown = bytearray(wanted)
            grown[: end - pos] = view[pos:end]
            self._rx, self._rx_view = grown, memoryview(grown)
            pos, end = 0, end - pos
        elif pos + needed > len(view):  # the partial record does not fit where it is
            view[: end - pos] = view[pos:end]
            pos, end = 0, end - pos
        self._rx_start, self._rx_filled = pos, end

    def _open_on_worker(
        self, pool: Any, prefix: memoryview, sealed: memoryview, target: memoryview
    ) -> None:
        """Open one record on a worker thread, straight into the reader's memory. Until
        it is done the record's ciphertext stays where it is (nothing is parsed or moved)
        and the upper protocol hears nothing; the reader is told (``hold_buffer``) to
        keep its buffer until the worker let go of it, even if it gives up reading."""
        size = len(sealed) - records.TAG_SIZE
        number = self._opener.reserve()
        released = self._loop.create_future()
        hold = getattr(self._upper, "hold_buffer", None)
        if hold is not None:
            hold(released)
        future = pool.submit(
            self._opener.open_reserved, number, bytes(prefix), sealed, target[:size]
        )
        self._opening, self._opening_size = (future, released), size
        future.add_done_callback(self._opened_on_worker)

    def _opened_on_worker(self, _future: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._deliver_opened)

    def _deliver_opened(self) -> None:
        """The loop, after a worker opened a record: hand it to the upper protocol (or
        close the connection with the reason it failed), then go on parsing."""
        (future, released), self._opening = self._opening, None
        if not released.done():
            released.set_result(None)
        error = future.exception()
        if error is not None:  # e.g. its tag failed: nothing was delivered to anyone
            self._abort_with(error)
            return
        if self._upper_lost:
            return
        self._upper.buffer_updated(self._opening_size)
        if self._paused_for_opening and self._lower is not None:
            self._paused_for_opening = False
            self._lower.resume_reading()
        if self._opening is None and not self._upper_lost:
            self._open_records()

    def _pause_if_full(self) -> None:
        """While a worker opens a record in place, the receive buffer cannot move or be
        compacted: once it is full, stop reading the socket until the worker is done."""
        if (
            self._opening is not None
            and self._rx_filled == len(self._rx)
            and not self._paused_for_opening
            and self._lower is not None
        ):
            self._paused_for_opening = True
            self._lower.pause_reading()

    def _open_in_pieces(self, prefix: memoryview, sealed: memoryview, size: int) -> None:
        if self._plain is None or len(self._plain) < size:
            self._plain = bytearray(max(size, 256 * 1024))
        plain = memoryview(self._plain)[:size]
        self._opener.open_into(prefix, sealed, plain)
        offset = 0
        while offset < size and not self._upper_lost:
            target = memoryview(self._upper.get_buffer(size - offset))
            n = min(len(target), size - offset)
            if n == 0:
                raise HandshakeError("upper protocol offered an empty buffer")
            target[:n] = plain[offset : offset + n]
            offset += n
            self._upper.buffer_updated(n)

    def _decrypt(self) -> None:
        """TLS mode: decrypt everything buffered into the upper protocol's buffers.

        ``SSLObject.read`` returns at most one record (16 KiB) per call, so each buffer the
        upper protocol offers is filled by several reads before it is told once."""
        upper, ssl_object = self._upper, self._ssl
        while not self._upper_lost:
            if not self._incoming.pending and not ssl_object.pending():
                break
            view = memoryview(upper.get_buffer(-1))
            size, filled, ended = len(view), 0, False
            if size == 0:  # the upper protocol must always offer room; never spin
                self._abort_with(RuntimeError("upper protocol offered an empty buffer"))
                break
            try:
                while filled < size:
                    n = ssl_object.read(size - filled, view[filled:])
                    if n == 0:
                        ended = True
                        break
                    filled += n
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                ended = True
            except ssl.SSLError as e:
                if filled:
                    upper.buffer_updated(filled)
                self._abort_with(e)
                break
            if filled:
                upper.buffer_updated(filled)
            if ended:
                self._lose_upper(None)
                break
            if filled < size:
                break  # the BIO is drained; wait for more ciphertext
        self._flush()  # TLS 1.3 may answer key updates

    # ---------------------------------------------------------------- failures

    def _fail_handshake(self, exc: BaseException) -> None:
        peer = self._extra.get("peername")
        error = (
            exc
            if isinstance(exc, HandshakeError)
            else HandshakeError(f"TLS handshake with {peer} failed: {exc}")
        )
        logger.debug("TLS handshake with %s failed: %s", peer, exc)
        self._lose_upper(error)

    def _abort_with(self, exc: BaseException) -> None:
        logger.debug("secure channel error with %s: %s", self._extra.get("peername"), exc)
        self._lose_upper(exc)
        self.abort()

    def _lose_upper(self, exc: BaseException | None) -> None:
        if self._upper_lost:
            return
        self._upper_lost = True
        self._upper.connection_lost(exc)
