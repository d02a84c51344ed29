"""The multiplexed connection on an in-memory pipe: handshake, flow control, zero copy,
resets and malformed input, without sockets."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from swarmgrad.net import framing
from swarmgrad.net.framing import FrameType
from swarmgrad.net.identity import Identity
from swarmgrad.net.mux import Connection
from swarmgrad.utils.errors import (
    ConnectionClosed,
    FrameTooLarge,
    HandshakeError,
    PeerIDMismatch,
    ProtocolViolation,
    StreamReset,
)


class MemoryTransport:
    """Half of an in-memory pipe that delivers writes on the next loop iteration."""

    def __init__(self, loop, **extra):
        self.loop = loop
        self.extra = {"peername": "memory", **extra}
        self.early: list[bytes] = []
        self.peer: MemoryTransport | None = None
        self.protocol = None
        self.closed = False
        self.written = 0

    def write(self, data):
        if self.closed:
            return
        data = bytes(data)
        self.written += len(data)
        self.loop.call_soon(self.peer._deliver, data)

    def writelines(self, buffers):
        for b in buffers:
            self.write(b)

    def attach(self, protocol):
        """Connect the protocol, then hand it what arrived before (a listener whose TLS
        handshake finishes after the dialer's first bytes are on their way)."""
        self.protocol = protocol
        protocol.connection_made(self)
        early, self.early = self.early, []
        for data in early:
            self._deliver(data)

    def _deliver(self, data):
        if self.protocol is None:
            self.early.append(data)
            return
        view = memoryview(data)
        while len(view) and self.protocol is not None and not self.closed:
            buf = self.protocol.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.protocol.buffer_updated(n)

    def close(self):
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self.protocol.connection_lost, None)
            if self.peer is not None:
                self.loop.call_soon(self.peer._remote_closed)  # after data already sent

    def _remote_closed(self):
        if not self.closed and self.protocol is not None:
            self.closed = True
            self.protocol.connection_lost(None)

    abort = close

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return self.extra.get(name, default)


async def connected_pair(**kwargs):
    loop = asyncio.get_running_loop()
    a_id, b_id = Identity.generate(), Identity.generate()
    accepted = []
    a = Connection(a_id, is_dialer=True, expected_peer_id=b_id.peer_id, **kwargs)
    b = Connection(b_id, is_dialer=False, on_stream=accepted.append, **kwargs)
    ta, tb = MemoryTransport(loop), MemoryTransport(loop)
    ta.peer, tb.peer = tb, ta
    ta.protocol, tb.protocol = a, b
    a.connection_made(ta)
    b.connection_made(tb)
    assert await a.handshake_done == b_id.peer_id
    assert await b.handshake_done == a_id.peer_id
    return a, b, accepted, ta


async def settle():
    for _ in range(10):
        await asyncio.sleep(0)


def test_handshake_authenticates_both_sides(arun):
    async def main():
        a, b, _, _ = await connected_pair()
        assert a.is_alive and b.is_alive and a.version == 1
        a.close()
        await settle()

    arun(main)


def test_dialing_the_wrong_peer_fails_with_mismatch(arun):
    async def main():
        loop = asyncio.get_running_loop()
        a = Connection(
            Identity.generate(), is_dialer=True, expected_peer_id=Identity.generate().peer_id
        )
        b = Connection(Identity.generate(), is_dialer=False)
        ta, tb = MemoryTransport(loop), MemoryTransport(loop)
        ta.peer, tb.peer, ta.protocol, tb.protocol = tb, ta, a, b
        a.connection_made(ta)
        b.connection_made(tb)
        with pytest.raises(PeerIDMismatch, match=r"but .* answered"):
            await a.handshake_done
        await settle()

    arun(main)


def test_streams_carry_data_both_ways_and_end_cleanly(arun):
    async def main():
        a, b, accepted, _ = await connected_pair()
        s = a.open_stream(b"hello-header")
        await s.write(b"ping" * 1000)
        await s.close_write()
        await settle()
        (r,) = accepted
        assert r.header == b"hello-header"
        assert await r.readexactly(4000) == b"ping" * 1000
        assert await r.read() == b""
        await r.write_eof(b"pong")
        assert await s.read() == b"pong"
        assert await s.read() == b""
        assert a.num_streams == 0 and b.num_streams == 0
        a.close()
        await settle()

    arun(main)


def test_slow_reader_blocks_only_its_own_stream(arun):
    async def main():
        window = 64 * 1024
        a, b, accepted, ta = await connected_pair(initial_window=window, max_frame=16 * 1024)
        slow = a.open_stream(b"slow")
        fast = a.open_stream(b"fast")
        writer = asyncio.ensure_future(slow.write(bytes(10 * window)))
        await asyncio.sleep(0.05)
        assert not writer.done(), "sender must wait for credit instead of buffering"
        sent_while_blocked = ta.written
        assert sent_while_blocked < 2 * window
        await fast.write_eof(b"x" * 50_000)  # another stream is not blocked
        await settle()
        slow_r, fast_r = accepted
        assert await fast_r.readexactly(50_000) == b"x" * 50_000
        # now drain the slow stream; the writer finishes
        received = await slow_r.readexactly(10 * window)
        await writer
        assert len(received) == 10 * window
        a.close()
        await settle()

    arun(main)


def test_readexactly_into_receives_large_payloads_in_place(arun):
    async def main():
        a, b, accepted, _ = await connected_pair(max_frame=256 * 1024)
        s = a.open_stream()
        await settle()
        (r,) = accepted
        target = bytearray(3 * 1024 * 1024)
        reader = asyncio.ensure_future(r.readexactly_into(target))
        payload = bytes(range(256)) * (len(target) // 256)
        await s.write(payload)
        await reader
        assert target == payload
        a.close()
        await settle()

    arun(main)


def test_readexactly_into_reports_progress_while_the_buffer_fills(arun):
    async def main():
        a, b, accepted, _ = await connected_pair(max_frame=64 * 1024)
        s = a.open_stream()
        await s.write(b"x" * 1000)  # arrives before the reader: copied, then reported
        await settle()
        (r,) = accepted
        target = bytearray(1000 + 512 * 1024)
        seen: list[int] = []
        reader = asyncio.ensure_future(r.readexactly_into(target, progress=seen.append))
        await settle()
        await s.write(b"y" * (512 * 1024))
        await reader
        assert seen[0] == 1000 and seen[-1] == len(target)
        assert seen == sorted(seen) and len(seen) >= 8  # one report per frame at least
        assert bytes(target) == b"x" * 1000 + b"y" * (512 * 1024)
        a.close()
        await settle()

    arun(main)


def test_reset_mid_transfer_fails_the_reader_and_keeps_connection(arun):
    async def main():
        a, b, accepted, _ = await connected_pair()
        s = a.open_stream()
        await s.write(b"partial")
        await settle()
        (r,) = accepted
        reader = asyncio.ensure_future(r.readexactly(100))
        await settle()
        s.reset("changed my mind")
        with pytest.raises(StreamReset, match="changed my mind"):
            await reader
        s2 = a.open_stream()  # the connection keeps serving
        await s2.write_eof(b"ok")
        await settle()
        assert await accepted[1].read() == b"ok"
        a.close()
        await settle()

    arun(main)


@pytest.mark.parametrize(
    "garbage, error",
    [
        (framing.HEADER.pack(0, 1, 77, 0), "unknown frame type"),
        (framing.encode_header(FrameType.DATA, 1, 10 * 1024 * 1024), "exceeds the limit"),
        (framing.encode_header(FrameType.OPEN, 2, 0), "of our parity"),
    ],
)
def test_malformed_frames_drop_only_that_connection(arun, garbage, error):
    async def main():
        a, b, _, ta = await connected_pair()
        other_a, other_b, other_accepted, _ = await connected_pair()
        ta.write(garbage)  # a (dialer) sends a malformed frame to b
        await settle()
        reason = await b.closed
        assert isinstance(reason, ProtocolViolation) and error in str(reason)
        s = other_a.open_stream()  # unrelated connections are unaffected
        await s.write_eof(b"still fine")
        await settle()
        assert await other_accepted[0].read() == b"still fine"
        other_a.close()
        await settle()

    arun(main)


def test_too_large_frame_is_frame_too_large(arun):
    async def main():
        a, b, _, ta = await connected_pair(max_frame=4096)
        ta.write(framing.encode_header(FrameType.DATA, 1, 5000))
        await settle()
        assert isinstance(await b.closed, FrameTooLarge)

    arun(main)


def test_sender_beyond_credit_is_a_protocol_violation(arun):
    async def main():
        a, b, accepted, ta = await connected_pair(initial_window=4096)
        s = a.open_stream()
        await settle()
        ta.write(framing.encode_header(FrameType.DATA, s.stream_id, 5000) + bytes(5000))
        await settle()
        reason = await b.closed
        assert "beyond the credit" in str(reason)

    arun(main)


def test_data_before_handshake_is_refused(arun):
    async def main():
        loop = asyncio.get_running_loop()
        b = Connection(Identity.generate(), is_dialer=False)
        tb = MemoryTransport(loop)
        tb.peer = MemoryTransport(loop)
        tb.protocol = b
        b.connection_made(tb)
        raw = framing.encode_header(FrameType.OPEN, 1, 0)
        buf = b.get_buffer(len(raw))
        buf[: len(raw)] = raw
        b.buffer_updated(len(raw))
        with pytest.raises(ProtocolViolation, match="before the handshake"):
            await b.handshake_done

    arun(main)


def test_closing_connection_fails_pending_reads(arun):
    async def main():
        a, b, accepted, _ = await connected_pair()
        s = a.open_stream()
        await settle()
        reader = asyncio.ensure_future(accepted[0].read())
        await settle()
        a.close()
        with pytest.raises(ConnectionClosed):
            await reader
        with pytest.raises(ConnectionClosed):
            await s.write(b"x")

    arun(main)


def test_a_stream_that_raised_its_connections_error_is_freed_without_the_cyclic_collector(arun):
    """(issue 32) A dead connection's error is kept by each of its streams; raising that
    object itself gave it a traceback whose frames hold the stream: a cycle that kept the
    stream, its connection and its buffers until the collector's next full pass. Each
    raise is a copy: same type and message, and the kept error stays without frames."""

    async def main():
        a, b, accepted, _ = await connected_pair()
        stream = a.open_stream()
        await settle()
        a.close()
        await settle()
        raised = []
        for _ in range(2):
            try:
                await stream.read()
            except ConnectionClosed as e:
                raised.append((type(e), str(e), e is stream._error))
            try:
                await stream.write(b"x")
            except ConnectionClosed as e:
                raised.append((type(e), str(e), e is stream._error))
        kept = stream._error
        assert raised == [(type(kept), str(kept), False)] * 4
        assert kept.__traceback__ is None
        gone = weakref.ref(stream)
        del stream
        assert gone() is None, "the stream outlived its last reference: a reference cycle"

    gc.disable()
    try:
        arun(main)
    finally:
        gc.enable()


def test_a_connection_dropped_for_a_protocol_violation_keeps_its_reason_without_frames(arun):
    """(issue 32) The reason raised inside the receive path is kept in ``closed``: its
    traceback's frames held the connection (a cycle, see above)."""

    async def main():
        a, b, _, ta = await connected_pair()
        ta.write(framing.encode_header(FrameType.OPEN, 2, 0))  # a stream id of b's parity
        await settle()
        reason = await b.closed
        assert isinstance(reason, ProtocolViolation), reason
        assert reason.__traceback__ is None

    arun(main)


def test_incompatible_version_is_a_clear_error_not_a_hang(arun):
    import dataclasses

    from swarmgrad.utils.errors import IncompatibleVersion

    async def main():
        loop = asyncio.get_running_loop()
        a = Connection(Identity.generate(), is_dialer=True)
        b = Connection(Identity.generate(), is_dialer=False)
        b._our_hello = dataclasses.replace(b._our_hello, version=7, min_version=5)
        ta, tb = MemoryTransport(loop), MemoryTransport(loop)
        ta.peer, tb.peer, ta.protocol, tb.protocol = tb, ta, a, b
        a.connection_made(ta)
        b.connection_made(tb)
        for side in (a, b):
            with pytest.raises(IncompatibleVersion, match=r"5\.\.7"):
                await side.handshake_done
        await settle()

    arun(main)


def test_data_frame_that_fills_the_scratch_exactly_is_received(arun):
    """A DATA frame whose header lands at the start of a full scratch buffer (the relay's
    256 KiB pump chunks) must not stall the receiver."""
    from swarmgrad.net.mux import SCRATCH_SIZE

    async def main():
        a, b, accepted, ta = await connected_pair(max_frame=1024 * 1024)
        s = a.open_stream()
        await settle()
        payload = bytes(range(256)) * (SCRATCH_SIZE // 256)
        for _ in range(3):
            await s.write(payload)  # one frame of exactly SCRATCH_SIZE bytes each
        await s.close_write()
        got = await accepted[0].readexactly(3 * len(payload))
        assert got == payload * 3
        a.close()
        await settle()

    arun(main)


def test_tls_certificate_of_another_peer_than_the_hello_is_refused(arun):
    """A relay-style man in the middle: the TLS session is with one identity, the
    handshake claims another."""

    async def main():
        loop = asyncio.get_running_loop()
        a = Connection(Identity.generate(), is_dialer=True)
        b = Connection(Identity.generate(), is_dialer=False)
        # the certificate the dialer saw (no channel binding: the nonce-exchange handshake)
        ta = MemoryTransport(loop, tls_peer_id=Identity.generate().peer_id)
        tb = MemoryTransport(loop)
        ta.peer, tb.peer, ta.protocol, tb.protocol = tb, ta, a, b
        a.connection_made(ta)
        b.connection_made(tb)
        with pytest.raises(PeerIDMismatch, match="TLS certificate"):
            await a.handshake_done
        await settle()

    arun(main)


def test_forged_auth_signature_is_refused(arun):
    from swarmgrad.utils.errors import HandshakeError

    class Forger(Identity):
        def sign(self, data: bytes) -> bytes:
            return bytes(64)  # claims the identity without its key

    async def main():
        loop = asyncio.get_running_loop()
        real = Identity.generate()
        a = Connection(Identity.generate(), is_dialer=True)
        b = Connection(Forger(real.private_key), is_dialer=False)
        ta, tb = MemoryTransport(loop), MemoryTransport(loop)
        ta.peer, tb.peer, ta.protocol, tb.protocol = tb, ta, a, b
        a.connection_made(ta)
        b.connection_made(tb)
        with pytest.raises(HandshakeError, match="failed to prove possession"):
            await a.handshake_done
        await settle()

    arun(main)


# ---------------------------------------------------------------- handshake bound to TLS


def _bound_pair(
    loop, dialer_id, listener_id, *, binding=b"B" * 48, listener_binding=None, **listener_kw
):
    """A dialer and a listener whose carrier says TLS proved listener_id (as TLSLayer does)."""
    a = Connection(dialer_id, is_dialer=True, expected_peer_id=listener_id.peer_id)
    accepted: list = []
    b = Connection(listener_id, is_dialer=False, on_stream=accepted.append, **listener_kw)
    ta = MemoryTransport(loop, channel_binding=binding, tls_peer_id=listener_id.peer_id)
    tb = MemoryTransport(loop, channel_binding=listener_binding or binding)
    ta.peer, tb.peer, ta.protocol = tb, ta, a  # the listener attaches later: tb.attach(b)
    return a, b, ta, tb, accepted


def test_bound_dialer_sends_its_first_request_before_reading_anything(arun):
    """TLS proved the listener: the dialer is ready at once, its HELLO, AUTH and the first
    request leave together, and the listener serves the request."""

    async def main():
        loop = asyncio.get_running_loop()
        dialer, listener = Identity.generate(), Identity.generate()
        a, b, ta, tb, accepted = _bound_pair(loop, dialer, listener)
        a.connection_made(ta)
        assert a.handshake_done.done() and a.handshake_done.result() == listener.peer_id
        stream = a.open_stream(b"echo")
        await stream.write(b"ping", fin=True)
        assert tb.written == 0  # nothing from the listener yet
        tb.attach(b)
        assert await b.handshake_done == dialer.peer_id
        await settle()
        assert [s.header for s in accepted] == [b"echo"]
        assert await accepted[0].read() == b"ping"
        assert a.version == b.version == 1
        a.close()
        await settle()

    arun(main)


def test_bound_auth_from_another_tls_session_is_refused(arun):
    """A dialer's proof names the session's channel binding: replayed or relayed into a
    session with another binding, it proves nothing."""

    async def main():
        loop = asyncio.get_running_loop()
        a, b, ta, tb, accepted = _bound_pair(
            loop, Identity.generate(), Identity.generate(), listener_binding=b"C" * 48
        )
        a.connection_made(ta)
        tb.attach(b)
        stream = a.open_stream(b"echo")
        await stream.write(b"never served", fin=True)
        with pytest.raises(HandshakeError, match="for this TLS session"):
            await b.handshake_done
        await settle()
        assert accepted == [] and not a.is_alive

    arun(main)


def test_bound_dialer_refuses_a_certificate_of_another_peer_at_once(arun):
    async def main():
        loop = asyncio.get_running_loop()
        listener = Identity.generate()
        a, _, ta, _, _ = _bound_pair(loop, Identity.generate(), listener)
        ta.extra["tls_peer_id"] = Identity.generate().peer_id  # an impostor's certificate
        a.connection_made(ta)
        with pytest.raises(PeerIDMismatch, match=f"dialed {listener.peer_id}"):
            await a.handshake_done
        await settle()

    arun(main)


def test_bound_first_write_beyond_the_early_window_finishes_once_hello_arrives(arun):
    from swarmgrad.net.mux import EARLY_WINDOW

    async def main():
        loop = asyncio.get_running_loop()
        a, b, ta, tb, accepted = _bound_pair(loop, Identity.generate(), Identity.generate())
        a.connection_made(ta)
        stream = a.open_stream(b"bulk")
        payload = bytes(range(256)) * (3 * EARLY_WINDOW // 256)
        writer = asyncio.ensure_future(stream.write(payload, fin=True))
        await settle()
        assert not writer.done() and ta.written < EARLY_WINDOW + 4096  # waits for credit
        tb.attach(b)
        await asyncio.wait_for(writer, 5)
        await settle()
        assert await accepted[0].readexactly(len(payload)) == payload
        a.close()
        await settle()

    arun(main)


def test_bound_listener_offering_less_than_the_early_window_is_refused(arun):
    async def main():
        loop = asyncio.get_running_loop()
        a, b, ta, tb, _ = _bound_pair(
            loop, Identity.generate(), Identity.generate(), initial_window=4096
        )
        a.connection_made(ta)
        stream = a.open_stream(b"x")
        tb.attach(b)
        with pytest.raises(ProtocolViolation, match="needs at least"):
            await stream.read()
        await settle()

    arun(main)


def test_bound_version_mismatch_fails_the_first_request_clearly(arun):
    import dataclasses

    from swarmgrad.utils.errors import IncompatibleVersion

    async def main():
        loop = asyncio.get_running_loop()
        a, b, ta, tb, _ = _bound_pair(loop, Identity.generate(), Identity.generate())
        b._our_hello = dataclasses.replace(b._our_hello, version=7, min_version=5)
        a.connection_made(ta)
        stream = a.open_stream(b"x")
        await stream.write(b"request", fin=True)
        tb.attach(b)
        with pytest.raises(IncompatibleVersion, match=r"5\.\.7"):
            await stream.read()
        with pytest.raises(IncompatibleVersion):
            await b.handshake_done
        await settle()

    arun(main)


def test_bound_listener_sending_auth_is_a_protocol_violation(arun):
    """Only the dialer proves itself in a bound handshake; an AUTH from the listener is
    out of order (the listener's proof is its TLS CertificateVerify)."""

    async def main():
        loop = asyncio.get_running_loop()
        a, b, ta, tb, _ = _bound_pair(loop, Identity.generate(), Identity.generate())
        a.connection_made(ta)
        tb.attach(b)
        await b.handshake_done
        stream = a.open_stream(b"x")
        tb.write(framing.encode_header(FrameType.AUTH, 0, 64) + b"s" * 64)
        with pytest.raises(ProtocolViolation, match="AUTH out of order"):
            await stream.read()
        await settle()

    arun(main)
