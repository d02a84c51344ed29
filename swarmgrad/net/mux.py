"""One connection between two peers, carrying many streams with credit-based flow control.

:class:`Connection` is an ``asyncio.BufferedProtocol``: it sits on top of any asyncio-style
transport (TLS over TCP, TLS over a relayed stream, or a simulated link) and turns the byte
stream into frames (see :mod:`swarmgrad.net.framing`). After the handshake it multiplexes
:class:`Stream` objects.

Flow control: a receiver grants each stream ``initial_window`` bytes of credit and returns
credit only as the application *consumes* data, so a slow reader makes the sender wait
instead of buffering without bound, and only that stream waits.

Zero-copy receive: when a reader waits in :meth:`Stream.readexactly_into`, the payload of the
DATA frame it waits for is received (or decrypted, under TLS) straight into the reader's
buffer, e.g. a tensor's memory. Larger payloads with no reader waiting land in a buffer
allocated once for that payload; only small frames are copied out of the scratch buffer.

A stream's own state and API are in :mod:`swarmgrad.net.stream` (re-exported here, where
callers import it from).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

from swarmgrad.net import framing
from swarmgrad.net.framing import FLAG_FIN, FrameType, ResetCode
from swarmgrad.net.handshake import (
    Hello,
    make_hello,
    negotiate_version,
    sign_auth,
    sign_bound_auth,
    verify_auth,
    verify_bound_auth,
)
from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.net.stream import Stream
from swarmgrad.utils.errors import (
    AdmissionRefused,
    ConnectionClosed,
    ConnectionIdleClosed,
    HandshakeError,
    IncompatibleVersion,
    PeerIDMismatch,
    ProtocolViolation,
    StreamReset,
    SwarmgradError,
)

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 4 * 1024 * 1024
DEFAULT_MAX_FRAME = 1024 * 1024
SCRATCH_SIZE = 256 * 1024  # largest receive scratch buffer of a busy connection
IDLE_REASON = "idle"  # GOAWAY reason of a connection closed for lack of use
_INITIAL_SCRATCH = 4 * 1024  # a DHT peer holds hundreds of mostly idle connections
# With a TLS-bound handshake the dialer sends before it reads the listener's HELLO: until
# then it assumes this window and frame size, which such a listener must offer at least.
EARLY_WINDOW = 256 * 1024
EARLY_MAX_FRAME = 64 * 1024
# Payload bytes at most copied out of the scratch buffer; larger remainders get their own.
_SMALL_PAYLOAD = 16 * 1024
# GOAWAY reasons that start with this are admission refusals (swarmgrad.net.admission)
ADMISSION_REFUSED = "admission refused"
# Bytes of replies the remote provokes (PONG, refusing RESET) we queue while it does not
# read: beyond this, a PING or OPEN flood would grow our write buffer without bound.
_PAUSED_REPLY_LIMIT = 1024 * 1024


class Connection(asyncio.BufferedProtocol):
    """Protocol side of one peer-to-peer connection: handshake, framing, multiplexing.

    Created per transport; ``handshake_done`` resolves with the remote PeerID, and
    ``closed`` with the reason the connection ended. ``on_stream`` is called with every
    stream the remote opens; ``on_close`` once when the connection is gone.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        is_dialer: bool,
        expected_peer_id: PeerID | None = None,
        on_stream: Callable[[Stream], None] | None = None,
        on_close: Callable[[Connection], None] | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        initial_window: int = DEFAULT_WINDOW,
        max_inbound_streams: int = 4096,
        admission: Any = None,
    ):
        self._identity = identity
        self._admission = admission  # swarmgrad.net.admission.Admission, or None: open swarm
        self.is_dialer = is_dialer
        self._expected_peer_id = expected_peer_id
        self._on_stream = on_stream
        self._on_close = on_close
        self._local_max_frame = max_frame
        self._local_window = initial_window
        self._max_inbound_streams = max_inbound_streams
        self._loop = asyncio.get_running_loop()
        self.handshake_done: asyncio.Future[PeerID] = self._loop.create_future()
        self.closed: asyncio.Future[BaseException | None] = self._loop.create_future()
        self.last_active = self._loop.time()  # a stream opened or ended (idle closing)
        # bytes the remote got through to us, on any stream or control frame: a sign of
        # life when a ping's answer waits behind megabytes of data on a slow link
        self.bytes_received = 0
        self.transport: Any = None
        # The layer that will carry us once it is secured (e.g. TLS still handshaking):
        # closing or aborting before connection_made must reach it.
        self.carrier: Any = None
        self.remote_peer_id: PeerID | None = None
        self.remote_address: Any = None
        self.version: int | None = None
        self._our_hello = make_hello(
            identity,
            initial_window=initial_window,
            max_frame=max_frame,
            token=admission.token_bytes if admission is not None else None,
        )
        self.remote_token: Any = None  # the remote's AccessToken, once admitted
        self._their_hello: Hello | None = None
        self._authenticated = False
        self._channel_binding: bytes | None = None  # set: the handshake is bound to TLS
        self._remote_max_frame = DEFAULT_MAX_FRAME
        self._remote_window = DEFAULT_WINDOW
        self._streams: dict[int, Stream] = {}
        self._inbound_count = 0
        self._next_id = itertools.count(1 if is_dialer else 2, 2)
        self._write_paused = False
        self._replies_while_paused = 0
        self._write_waiters: list[asyncio.Future] = []
        self._pings: dict[bytes, asyncio.Future] = {}
        # receive state machine
        self._scratch = bytearray(_INITIAL_SCRATCH)
        self._scratch_view = memoryview(self._scratch)
        self._filled = 0
        self._payload_left = 0  # >0 while receiving the rest of a DATA payload
        self._payload_stream: Stream | None = None
        self._payload_fin = False
        self._payload_buf: bytearray | None = None
        self._payload_buf_filled = 0
        self._payload_direct = False
        self._dead = False

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.remote_address = transport.get_extra_info("peername")
        self._channel_binding = transport.get_extra_info("channel_binding")
        self._send_control(FrameType.HELLO, 0, self._our_hello.encode())
        if self._channel_binding is not None and self.is_dialer:
            try:
                self._open_bound_dialer()
            except SwarmgradError as e:
                self._fail(e)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dead:
            # Bytes still in flight after we failed are dropped, but the transport needs
            # room to put them: a scratch left full by the failed parse would offer none.
            return memoryview(bytearray(_INITIAL_SCRATCH))
        if self._payload_left:
            stream = self._payload_stream
            if self._payload_buf is None and stream is not None and not self._dead:
                target = stream._direct_target()
                if target is not None and len(target):
                    self._payload_direct = True
                    return target[: self._payload_left]
            self._payload_direct = False
            if self._payload_buf is None:
                self._payload_buf = bytearray(self._payload_left)
                self._payload_buf_filled = 0
            return memoryview(self._payload_buf)[self._payload_buf_filled :]
        return self._scratch_view[self._filled :]

    def hold_buffer(self, released: asyncio.Future) -> None:
        """The bytes for the buffer :meth:`get_buffer` just gave are written into it on a
        worker thread until ``released`` resolves: a reader that waits there must not
        let go of its buffer before (see :meth:`Stream.readexactly_into`)."""
        stream = self._payload_stream
        if self._payload_left and self._payload_direct and stream is not None:
            stream._hold_target(released)

    def buffer_updated(self, nbytes: int) -> None:
        if self._dead:
            return
        self.bytes_received += nbytes
        try:
            if self._payload_left:
                self._payload_received(nbytes)
            else:
                self._filled += nbytes
                busy = self._filled == len(self._scratch)
                self._parse_scratch()
                if busy and len(self._scratch) < SCRATCH_SIZE:
                    self._resize_scratch(min(2 * len(self._scratch), SCRATCH_SIZE))
        except SwarmgradError as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self._fail(ConnectionClosed(f"connection to {self._peer_name()} closed by the remote"))
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        reason: BaseException
        if exc is None:
            reason = ConnectionClosed(f"connection to {self._peer_name()} closed")
        elif isinstance(exc, SwarmgradError):
            reason = exc
        else:
            reason = ConnectionClosed(f"connection to {self._peer_name()} lost: {exc!r}")
        self._teardown(reason)
        # the transport is gone for good: let go of it (a TLS layer refers back to us, a
        # cycle that kept both, and its megabytes of buffers, until a full collection)
        self.transport = self.carrier = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._replies_while_paused = 0
        waiters, self._write_waiters = self._write_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------------ public API

    @property
    def is_alive(self) -> bool:
        return not self._dead and self._authenticated

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def open_stream(self, header: bytes = b"") -> Stream:
        """Open a new stream; header (at most 64 KiB) tells the remote what it is for."""
        if self._dead:
            reason = self.closed.result() if self.closed.done() else None
            if isinstance(reason, AdmissionRefused):  # say why, not only that it is closed
                raise AdmissionRefused(str(reason), reason=reason.reason)
            raise ConnectionClosed(f"connection to {self._peer_name()} is closed")
        if not self._authenticated:
            raise ConnectionClosed(f"connection to {self._peer_name()} is not yet established")
        if len(header) > framing.CONTROL_PAYLOAD_LIMIT:
            raise ValueError(f"stream header of {len(header)} bytes exceeds 64 KiB")
        stream_id = next(self._next_id)
        if stream_id > framing.MAX_STREAM_ID:
            raise ConnectionClosed(f"connection to {self._peer_name()} ran out of stream ids")
        stream = Stream(self, stream_id, header, initial_credit=self._remote_window)
        self._streams[stream_id] = stream
        self.last_active = self._loop.time()
        self._send_control(FrameType.OPEN, stream_id, header)
        return stream

    async def ping(self) -> float:
        """Round-trip time in seconds of a PING on this connection."""
        token = os.urandom(8)
        waiter = self._loop.create_future()
        self._pings[token] = waiter
        started = self._loop.time()
        try:
            self._send_control(FrameType.PING, 0, token)
            await waiter
        finally:
            self._pings.pop(token, None)
        return self._loop.time() - started

    def close(self, reason: str = "closing") -> None:
        """Say GOAWAY and close the transport gracefully (pending bytes are flushed)."""
        if self._dead:
            return
        self._send_control(FrameType.GOAWAY, 0, reason.encode()[:1024])
        self._teardown(ConnectionClosed(f"connection to {self._peer_name()} closed: {reason}"))
        transport = self.transport or self.carrier
        if transport is not None:
            transport.close()

    def abort(self, exc: BaseException) -> None:
        self._teardown(exc)
        transport = self.transport or self.carrier
        if transport is not None:
            transport.abort()
        self.carrier = None  # told to abort; it refers back to us (see connection_lost)

    # ------------------------------------------------------------------ sending

    def _send_control(self, frame_type: FrameType, stream_id: int, payload: bytes) -> None:
        if self._dead or self.transport is None:
            return
        header = framing.encode_header(frame_type, stream_id, len(payload))
        self.transport.write(header + payload)

    def _send_reply(self, frame_type: FrameType, stream_id: int, payload: bytes) -> None:
        """A control frame the remote asked for: refuse to queue them without bound while
        the remote is not reading what we already sent."""
        if self._write_paused:
            self._replies_while_paused += framing.HEADER_SIZE + len(payload)
            if self._replies_while_paused > _PAUSED_REPLY_LIMIT:
                raise ProtocolViolation(
                    f"{self._peer_name()} keeps sending {frame_type.name}-provoking frames "
                    f"without reading: {self._replies_while_paused} bytes of replies are waiting"
                )
        self._send_control(frame_type, stream_id, payload)

    def _send_data(
        self, stream_id: int, payload: memoryview | bytes, *, fin: bool
    ) -> asyncio.Future | None:
        """Send one DATA frame; a future when the transport still reads ``payload`` on a
        worker thread (the writer must not reuse its buffer until it resolves)."""
        if self._dead:
            return None
        header = framing.encode_header(FrameType.DATA, stream_id, len(payload), FLAG_FIN * fin)
        if len(payload) <= _SMALL_PAYLOAD:
            self.transport.write(header + bytes(payload))
            return None
        write_buffers = getattr(self.transport, "write_buffers", None)
        if write_buffers is not None:
            return write_buffers((header, payload))
        self.transport.writelines((header, payload))
        return None

    def _end_of_message(self) -> None:
        """A stream finished writing: let a corking transport send now, not next tick."""
        flush = getattr(self.transport, "flush", None)
        if flush is not None:
            flush()

    async def _wait_writable(self) -> None:
        while self._write_paused and not self._dead:
            waiter = self._loop.create_future()
            self._write_waiters.append(waiter)
            await waiter
        if self._dead:
            raise ConnectionClosed(f"connection to {self._peer_name()} is closed")

    # ------------------------------------------------------------------ receiving

    def _parse_scratch(self) -> None:
        view, pos, end = self._scratch_view, 0, self._filled
        unpack, header_size = framing.HEADER.unpack_from, framing.HEADER_SIZE
        max_frame = self._local_max_frame
        while not self._dead and end - pos >= header_size:
            length, stream_id, frame_type, flags = unpack(view, pos)
            body_start = pos + header_size
            if frame_type != FrameType.DATA or length > max_frame or flags > FLAG_FIN:
                # control frames, and anything malformed (decode_header names the problem)
                header = framing.decode_header(view[pos:body_start], max_frame)
                if end - body_start < length:
                    if header_size + length > len(view):  # grow so the frame fits
                        self._compact(pos, end)
                        self._resize_scratch(header_size + length)
                        return
                    break  # control payloads are small; wait for the rest in the scratch
                pos = body_start + length
                self._on_control(header, bytes(view[body_start:pos]))
                continue
            available = min(end - body_start, length)
            stream = self._data_stream(stream_id)
            remainder = length - available
            if remainder and (remainder > _SMALL_PAYLOAD or header_size + length > len(view)):
                # A large payload: take what arrived, receive the rest outside the scratch.
                if stream is not None and available:
                    stream._on_data(memoryview(bytes(view[body_start : body_start + available])))
                self._payload_left = remainder
                self._payload_stream, self._payload_fin = stream, bool(flags & FLAG_FIN)
                self._payload_buf, self._payload_direct = None, False
                pos = body_start + available
                break
            if remainder:
                break  # small remainder: wait for it in the scratch
            pos = body_start + length
            if stream is not None:
                if length:
                    stream._on_data(memoryview(bytes(view[body_start:pos])))
                if flags & FLAG_FIN:
                    stream._on_fin()
                    self._maybe_forget(stream)
        self._compact(pos, end)

    def _compact(self, pos: int, end: int) -> None:
        """Move the unparsed bytes scratch[pos:end] to the front."""
        if pos:
            remaining = end - pos
            self._scratch_view[:remaining] = self._scratch_view[pos:end]
            self._filled = remaining

    def _resize_scratch(self, size: int) -> None:
        grown = bytearray(max(size, self._filled))
        grown[: self._filled] = self._scratch_view[: self._filled]
        self._scratch, self._scratch_view = grown, memoryview(grown)

    def _payload_received(self, nbytes: int) -> None:
        stream = self._payload_stream
        self._payload_left -= nbytes
        if self._payload_direct:
            if stream is not None:
                stream._on_direct_bytes(nbytes)
        else:
            self._payload_buf_filled += nbytes
            if self._payload_left == 0:
                buffer, self._payload_buf = self._payload_buf, None
                if stream is not None:
                    stream._on_data(memoryview(buffer)[: self._payload_buf_filled])
        if self._payload_left == 0:
            if stream is not None and self._payload_fin:
                stream._on_fin()
                self._maybe_forget(stream)
            self._payload_stream = None
            self._payload_direct = False

    def _data_stream(self, stream_id: int) -> Stream | None:
        if not self._authenticated:
            raise ProtocolViolation(f"{self._peer_name()} sent DATA before the handshake")
        stream = self._streams.get(stream_id)
        if stream is not None and (stream._recv_fin or stream._error is not None):
            if stream._recv_fin:
                raise ProtocolViolation(f"{self._peer_name()} sent DATA after FIN on {stream_id}")
            return None  # locally reset: discard what was already in flight
        return stream

    def _on_control(self, header: framing.FrameHeader, payload: bytes) -> None:
        kind, sid = header.type, header.stream_id
        if kind == FrameType.HELLO:
            self._on_hello(payload)
        elif kind == FrameType.AUTH:
            self._on_auth(payload)
        elif not self._authenticated:
            if kind == FrameType.GOAWAY:
                reason = payload.decode("utf-8", "replace")
                if reason.startswith(ADMISSION_REFUSED):
                    logger.warning("admission: %s refused us: %s", self._peer_name(), reason)
                    raise _refusal_from(self._peer_name(), reason)
                error_cls = IncompatibleVersion if "version" in reason else HandshakeError
                raise error_cls(f"{self._peer_name()} refused the handshake: {reason}")
            raise ProtocolViolation(f"{self._peer_name()} sent {kind.name} before the handshake")
        elif kind == FrameType.OPEN:
            self._on_open(sid, payload)
        elif kind == FrameType.WINDOW:
            (grant,) = framing.WINDOW_PAYLOAD.unpack(payload)
            stream = self._streams.get(sid)
            if stream is not None:
                stream._on_credit(grant)
        elif kind == FrameType.RESET:
            stream = self._streams.get(sid)
            if stream is not None:
                code, reason = framing.decode_reset_payload(payload)
                stream._on_error(
                    StreamReset(
                        f"stream {sid} was reset by {self._peer_name()} ({code.name}): {reason}"
                    )
                )
                self._forget(stream)
        elif kind == FrameType.PING:
            self._send_reply(FrameType.PONG, 0, payload)
        elif kind == FrameType.PONG:
            waiter = self._pings.get(payload)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif kind == FrameType.GOAWAY:
            reason = payload.decode("utf-8", "replace")
            if reason.startswith(ADMISSION_REFUSED):
                logger.warning("admission: %s refused us: %s", self._peer_name(), reason)
                self._teardown(_refusal_from(self._peer_name(), reason))
            else:
                error_cls = ConnectionIdleClosed if reason == IDLE_REASON else ConnectionClosed
                self._teardown(error_cls(f"{self._peer_name()} closed the connection: {reason}"))
            self.transport.close()

    def _open_bound_dialer(self) -> None:
        """TLS proved who the listener is: send our proof now and open for streams at once,
        so the first request leaves with our HELLO and the TLS Finished."""
        listener = self.transport.get_extra_info("tls_peer_id")
        if listener is None:
            raise HandshakeError(f"the TLS channel to {self.remote_address} named no identity")
        self._check_remote_identity(listener)
        if self._admission is not None:
            # TLS carried the listener's token in its certificate: check it before our
            # proof and first request leave (see swarmgrad.net.tls)
            self._admit(self.transport.get_extra_info("tls_admission_token"), listener)
        proof = sign_bound_auth(self._identity, self._our_hello, listener, self._channel_binding)
        self._send_control(FrameType.AUTH, 0, proof)
        self._remote_max_frame, self._remote_window = EARLY_MAX_FRAME, EARLY_WINDOW
        self._authenticate(listener)

    def _check_remote_identity(self, peer_id: PeerID) -> None:
        expected = self._expected_peer_id
        if expected is not None and peer_id != expected:
            raise PeerIDMismatch(
                f"dialed {expected} at {self.remote_address} but {peer_id} answered"
            )
        tls_peer = self.transport.get_extra_info("tls_peer_id")
        if tls_peer is not None and tls_peer != peer_id:
            raise PeerIDMismatch(
                f"TLS certificate of {self.remote_address} belongs to {tls_peer}, "
                f"but the handshake claims {peer_id}"
            )
        if peer_id == self._identity.peer_id:
            raise HandshakeError(f"connected to ourselves ({peer_id}) at {self.remote_address}")

    def _on_hello(self, payload: bytes) -> None:
        if self._their_hello is not None:
            raise ProtocolViolation(f"{self._peer_name()} sent HELLO twice")
        hello = Hello.decode(payload)
        try:
            self.version = negotiate_version(self._our_hello, hello)
        except IncompatibleVersion as e:
            self._send_control(FrameType.GOAWAY, 0, f"incompatible protocol version: {e}".encode())
            raise
        self._check_remote_identity(hello.peer_id)
        bound = self._channel_binding is not None
        if self._admission is not None and not (bound and self.is_dialer):
            # the identity claimed here is proven by AUTH, which must come before any stream
            self._admit(hello.token, hello.peer_id)
        if bound and (hello.initial_window < EARLY_WINDOW or hello.max_frame < EARLY_MAX_FRAME):
            raise ProtocolViolation(
                f"{self._peer_name()} offered window {hello.initial_window} and max_frame "
                f"{hello.max_frame}; a TLS-bound handshake needs at least {EARLY_WINDOW} "
                f"and {EARLY_MAX_FRAME}"
            )
        self._their_hello = hello
        extra_credit = hello.initial_window - self._remote_window
        self._remote_max_frame = hello.max_frame
        self._remote_window = hello.initial_window
        if not bound:
            self._send_control(FrameType.AUTH, 0, sign_auth(self._identity, self._our_hello, hello))
        elif self.is_dialer:
            # streams we opened on the assumed early window get the rest of the real one
            for stream in self._streams.values():
                stream._on_credit(extra_credit)

    def _admit(self, token: bytes | None, peer_id: PeerID) -> None:
        """Check the remote's access token; refuse the connection, saying why, if it does
        not admit the remote."""
        try:
            self.remote_token = self._admission.check(token, peer_id)
        except AdmissionRefused as e:
            logger.warning(
                "admission: refused %s at %s (%s): %s", peer_id, self.remote_address, e.reason, e
            )
            message = f"{ADMISSION_REFUSED} ({e.reason}) by {self._identity.peer_id}: {e}"
            self._send_control(FrameType.GOAWAY, 0, message.encode()[:1024])
            raise AdmissionRefused(
                f"refused {peer_id} at {self.remote_address}: {e}", reason=e.reason
            ) from None

    def refuse(self, reason: str, message: str) -> None:
        """Close an admitted connection whose admission ended (its token expired or was
        revoked), telling the remote why; its calls fail with AdmissionRefused."""
        if self._dead:
            return
        text = f"{ADMISSION_REFUSED} ({reason}) by {self._identity.peer_id}: {message}"
        self._send_control(FrameType.GOAWAY, 0, text.encode()[:1024])
        self._teardown(AdmissionRefused(f"closed {self._peer_name()}: {message}", reason=reason))
        transport = self.transport or self.carrier
        if transport is not None:
            transport.close()

    def _on_auth(self, payload: bytes) -> None:
        if self._their_hello is None or self._authenticated:
            raise ProtocolViolation(f"{self._peer_name()} sent AUTH out of order")
        if self._channel_binding is None:
            verify_auth(payload, self._our_hello, self._their_hello)
        else:
            verify_bound_auth(
                payload, self._their_hello, self._identity.peer_id, self._channel_binding
            )
        self._authenticate(self._their_hello.peer_id)

    def _authenticate(self, peer_id: PeerID) -> None:
        self._authenticated = True
        self.remote_peer_id = peer_id
        if not self.handshake_done.done():
            self.handshake_done.set_result(peer_id)

    def _on_open(self, stream_id: int, header: bytes) -> None:
        if stream_id % 2 == (1 if self.is_dialer else 0):
            raise ProtocolViolation(f"{self._peer_name()} opened stream {stream_id} of our parity")
        if stream_id in self._streams:
            raise ProtocolViolation(f"{self._peer_name()} reopened live stream {stream_id}")
        if self._inbound_count >= self._max_inbound_streams or self._on_stream is None:
            self._send_reply(
                FrameType.RESET,
                stream_id,
                framing.encode_reset_payload(ResetCode.REFUSED, "too many open streams"),
            )
            return
        stream = Stream(self, stream_id, header, initial_credit=self._remote_window)
        self._streams[stream_id] = stream
        self.last_active = self._loop.time()
        self._inbound_count += 1
        self._on_stream(stream)

    # ------------------------------------------------------------------ bookkeeping

    def _maybe_forget(self, stream: Stream) -> None:
        if stream._recv_fin and stream._send_fin:
            self._forget(stream)

    def _forget(self, stream: Stream) -> None:
        if self._streams.pop(stream.stream_id, None) is not None:
            self.last_active = self._loop.time()
            if stream.stream_id % 2 == (0 if self.is_dialer else 1):
                self._inbound_count -= 1

    def _peer_name(self) -> str:
        if self.remote_peer_id is not None:
            return str(self.remote_peer_id)
        return f"peer at {self.remote_address}"

    def _fail(self, exc: BaseException) -> None:
        """A protocol error: tell the remote (best effort) and drop the connection."""
        if self._dead:
            return
        logger.debug("dropping connection to %s: %s", self._peer_name(), exc)
        if isinstance(exc, ProtocolViolation) and not isinstance(exc, IncompatibleVersion):
            self._send_control(FrameType.GOAWAY, 0, f"protocol violation: {exc}".encode()[:1024])
        self._teardown(exc)
        if self.transport is not None:
            self.transport.close()

    def _teardown(self, exc: BaseException) -> None:
        if self._dead:
            return
        self._dead = True
        # the reason is kept (``closed``, every stream's error): without its traceback,
        # whose frames (e.g. buffer_updated's) hold this connection, a cycle that kept the
        # connection and its buffers alive until a full pass of the cyclic collector
        exc.__traceback__ = None
        if not self.handshake_done.done():
            self.handshake_done.set_exception(exc)
            self.handshake_done.exception()  # mark retrieved: the owner may have given up
        for stream in list(self._streams.values()):
            stream._on_error(exc)
        self._streams.clear()
        for waiter in self._pings.values():
            if not waiter.done():
                waiter.set_exception(exc)
        self.resume_writing()
        if not self.closed.done():
            self.closed.set_result(exc)
        if self._on_close is not None:
            self._on_close(self)


def _refusal_from(peer_name: str, goaway_reason: str) -> AdmissionRefused:
    """The AdmissionRefused a refused side raises, from the refuser's GOAWAY text
    ``admission refused (<reason>) by <peer>: <details>``."""
    reason = None
    rest = goaway_reason[len(ADMISSION_REFUSED) :]
    if rest.startswith(" (") and ")" in rest:
        reason = rest[2 : rest.index(")")]
    return AdmissionRefused(f"{peer_name} refused us: {goaway_reason}", reason=reason)
