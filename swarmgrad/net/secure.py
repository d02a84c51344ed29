"""TLS 1.3 between a byte transport and the protocol above it, driven by ``ssl.MemoryBIO``.

Why not asyncio's built-in ``ssl=`` transports: they copy every record several times
and reached about a fifth of raw socket speed here, and they cannot run over a relayed
stream. :class:`TLSLayer` is one small driver for both cases: it is the *protocol* of the
lower transport (a TCP socket, or a stream relayed through another peer) and the
*transport* of the upper protocol (the multiplexed :class:`~swarmgrad.net.mux.Connection`).
Decryption writes straight into the buffer the upper protocol offers, so payload bytes land
where they belong without another copy.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from swarmgrad.net.tls import peer_id_from_certificate
from swarmgrad.utils.errors import HandshakeError

logger = logging.getLogger(__name__)

_RX_BUFFER = 1024 * 1024
_HIGH_WATER = 4 * 1024 * 1024  # outgoing ciphertext buffered in the lower transport
_LOW_WATER = 1024 * 1024
# Writes smaller than this are corked: gathered and encrypted as one record at the end of
# the event-loop iteration, so an RPC's OPEN, DATA and FIN frames cost one record and one
# syscall instead of three.
_CORK_LIMIT = 64 * 1024


class TLSLayer(asyncio.BufferedProtocol):
    """Encrypts the upper protocol's writes and decrypts the lower transport's bytes.

    The upper protocol's ``connection_made`` is called only after the TLS handshake has
    finished (if it fails, only ``connection_lost`` is called, with a HandshakeError);
    ``get_extra_info("tls_peer_id")`` then gives the PeerID proven by the remote
    certificate (dialer side), and ``"peername"`` is forwarded from below.
    """

    def __init__(
        self,
        context: ssl.SSLContext,
        upper: asyncio.BaseProtocol,
        *,
        server_side: bool,
    ):
        self._context = context
        self._upper = upper
        if hasattr(upper, "carrier"):
            upper.carrier = self  # lets the upper protocol abort us before it is connected
        self._server_side = server_side
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._lower: Any = None
        self._rx = bytearray(_RX_BUFFER)
        self._rx_view = memoryview(self._rx)
        self._handshaken = False
        self._closing = False
        self._upper_lost = False
        self._extra: dict[str, Any] = {}
        self._upper_paused = False
        self._corked: list[bytes | bytearray | memoryview] = []
        self._corked_size = 0
        self._flush_scheduled = False

    # ---------------------------------------------------------------- lower protocol side

    def connection_made(self, transport: Any) -> None:
        self._lower = transport
        self._extra["peername"] = transport.get_extra_info("peername")
        self._extra["sockname"] = transport.get_extra_info("sockname")
        self._extra["socket"] = transport.get_extra_info("socket")
        if hasattr(transport, "set_write_buffer_limits"):
            transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)
        self._step_handshake()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._rx_view

    def buffer_updated(self, nbytes: int) -> None:
        self._incoming.write(self._rx_view[:nbytes])
        if not self._handshaken:
            self._step_handshake()
            if not self._handshaken:
                return
        self._decrypt()

    def eof_received(self) -> bool:
        self._incoming.write_eof()
        if self._handshaken:
            self._decrypt()
        self._lose_upper(None)
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._handshaken:
            self._fail_handshake(exc or ConnectionResetError("connection closed during TLS"))
        self._lose_upper(exc)

    def pause_writing(self) -> None:
        self._upper_paused = True
        if self._handshaken and not self._upper_lost:
            self._upper.pause_writing()

    def resume_writing(self) -> None:
        self._upper_paused = False
        if self._handshaken and not self._upper_lost:
            self._upper.resume_writing()

    # ---------------------------------------------------------------- upper transport side

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writelines((data,))

    def writelines(self, buffers: Any) -> None:
        if self._closing:
            return
        for data in buffers:
            size = len(data)
            if size < _CORK_LIMIT and self._corked_size + size <= _CORK_LIMIT:
                self._corked.append(bytes(data))
                self._corked_size += size
                continue
            self._encrypt_corked()
            if size < _CORK_LIMIT:
                self._corked.append(bytes(data))
                self._corked_size = size
            else:
                self._encrypt(data)
        if self._corked and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_corked)
        elif not self._corked:
            self._flush()

    def _encrypt(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._ssl.write(data)
        except ssl.SSLError as e:
            self._abort_with(e)

    def _encrypt_corked(self) -> None:
        if self._corked:
            data = self._corked[0] if len(self._corked) == 1 else b"".join(self._corked)
            self._corked.clear()
            self._corked_size = 0
            self._encrypt(data)

    def _flush_corked(self) -> None:
        self._flush_scheduled = False
        if not self._closing:
            self._encrypt_corked()
            self._flush()

    def close(self) -> None:
        if self._closing:
            return
        if self._handshaken:
            self._encrypt_corked()
            self._flush()
        self._closing = True
        if self._handshaken:
            try:
                self._ssl.unwrap()  # queue close_notify
            except (ssl.SSLError, ssl.SSLWantReadError):
                pass
            self._flush()
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
        return self._lower.get_write_buffer_size()

    # ---------------------------------------------------------------- internals

    def _flush(self) -> None:
        if self._outgoing.pending and self._lower is not None and not self._lower.is_closing():
            self._lower.write(self._outgoing.read())

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
        self._flush()
        self._handshaken = True
        if not self._server_side:
            der = self._ssl.getpeercert(binary_form=True)
            try:
                self._extra["tls_peer_id"] = peer_id_from_certificate(der)
            except HandshakeError as e:
                self._fail_handshake(e)
                self._lower.abort()
                return
        self._extra["ssl_object"] = self._ssl
        self._extra["cipher"] = self._ssl.cipher()
        self._upper.connection_made(self)
        if self._upper_paused:
            self._upper.pause_writing()
        if self._incoming.pending:
            self._decrypt()

    def _decrypt(self) -> None:
        """Decrypt everything buffered into the upper protocol's buffers.

        ``SSLObject.read`` returns at most one record (16 KiB) per call, so each buffer the
        upper protocol offers is filled by several reads before it is told once: the
        per-record cost stays a C call, not a trip through the protocol's Python code."""
        upper = self._upper
        ssl_object = self._ssl
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
        self._flush()  # TLS 1.3 may answer key updates or send session tickets

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
        logger.debug("TLS error with %s: %s", self._extra.get("peername"), exc)
        self._lose_upper(exc)
        self.abort()

    def _lose_upper(self, exc: BaseException | None) -> None:
        if self._upper_lost:
            return
        self._upper_lost = True
        self._upper.connection_lost(exc)
