"""Hostile input against the transport: malformed handshakes, fuzzed frame sequences after
a valid handshake, floods from a peer that never reads, odd RPC headers and requests, and
raw sockets that speak garbage. The attacked side must either keep working or close with a
SwarmgradError naming the problem, and leave no task, socket or thread behind."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swarmgrad.net import framing, rpc
from swarmgrad.net.framing import FrameType
from swarmgrad.net.handshake import make_hello
from swarmgrad.net.identity import Identity
from swarmgrad.net.mux import Connection
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import (
    ProtocolViolation,
    RemoteError,
    StreamReset,
    SwarmgradError,
    ValidationError,
)
from tests.conftest import run_checked
from tests.helpers.peers import shutdown, two_peers
from tests.net.test_mux import MemoryTransport, connected_pair, settle


def frame(kind: int, stream_id: int, payload: bytes = b"", flags: int = 0, length=None) -> bytes:
    size = len(payload) if length is None else length
    return framing.HEADER.pack(size, stream_id, kind, flags) + payload


def feed(conn: Connection, data: bytes, chunk: int | None = None) -> None:
    """Deliver bytes to conn the way a transport does (get_buffer / buffer_updated)."""
    view = memoryview(data)
    while len(view) and not conn._dead:
        buffer = conn.get_buffer(len(view))
        n = min(len(buffer), len(view), chunk or len(view))
        buffer[:n] = view[:n]
        view = view[n:]
        conn.buffer_updated(n)


def listener_and_valid_hello() -> tuple[Connection, dict]:
    """A listening Connection on an in-memory transport, and a valid HELLO (as a map) that
    a test may spoil before feeding it."""
    loop = asyncio.get_running_loop()
    conn = Connection(Identity.generate(), is_dialer=False)
    transport, other_end = MemoryTransport(loop), MemoryTransport(loop)
    transport.peer, transport.protocol = other_end, conn
    conn.connection_made(transport)
    hello = msgpack.unpackb(
        make_hello(Identity.generate(), initial_window=65536, max_frame=65536).encode()
    )
    return conn, hello


def record_loop_errors() -> list[dict]:
    """Exceptions escaping a callback (e.g. from buffer_updated) go to the loop's handler."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    return errors


# ------------------------------------------------------------------ handshake


@pytest.mark.parametrize(
    "field, value",
    [
        ("nonce", 2**40),  # bytes(2**40): MemoryError before the length check
        ("id", 2**62),
        ("nonce", 2**20),  # would allocate a MiB of zeros for a 32-byte field
        ("v", math.inf),  # int(inf): OverflowError
        ("window", math.inf),
        ("max_frame", "4096"),
        ("min_v", True),
    ],
)
def test_hello_field_of_the_wrong_type_is_a_protocol_violation_naming_it(field, value):
    async def main():
        errors = record_loop_errors()
        conn, hello = listener_and_valid_hello()
        hello[field] = value
        feed(conn, frame(FrameType.HELLO, 0, msgpack.packb(hello)))
        await settle()
        reason = conn.closed.result()
        assert isinstance(reason, ProtocolViolation), reason
        assert field in str(reason)
        assert not errors

    run_checked(main)


# ------------------------------------------------------------------ fuzzed frames

_MSGPACK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=9), inner),
    max_leaves=12,
)
_HELLO_KEYS = st.sampled_from(["v", "min_v", "id", "nonce", "features", "window", "max_frame"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replacements=st.dictionaries(_HELLO_KEYS, _MSGPACK, max_size=3), drop=st.booleans())
@example(replacements={"v": math.inf}, drop=False)  # int(inf) raised OverflowError
@example(replacements={"id": 2**63}, drop=False)  # bytes(2**63) raised MemoryError
def test_fuzzed_hello_is_accepted_or_refused_with_a_swarmgrad_error(replacements, drop):
    async def main():
        errors = record_loop_errors()
        conn, hello = listener_and_valid_hello()
        hello.update(replacements)
        if drop and replacements:
            del hello[next(iter(replacements))]
        feed(conn, frame(FrameType.HELLO, 0, msgpack.packb(hello)))
        await settle()
        if conn.closed.done():
            assert isinstance(conn.closed.result(), SwarmgradError), conn.closed.result()
        assert not errors, errors
        conn.abort(ProtocolViolation("test over"))
        await settle()

    run_checked(main)


_STREAM_IDS = [0, 1, 2, 3, 4, 5, 7, 2**31, 2**32 - 1]
_LENGTHS = [None, None, None, 0, 4, 2**16, 2**16 + 1, 2**20, 2**20 + 1, 2**32 - 1]
_FRAMES = st.tuples(
    st.integers(0, 12),  # frame types, including unknown ones
    st.sampled_from(_STREAM_IDS),  # both parities, the handshake stream, the extremes
    st.integers(0, 3),  # FIN and an unknown flag
    st.one_of(
        st.binary(max_size=48),
        st.sampled_from([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x80\x00\x00\x00"]),
    ),
    st.sampled_from(_LENGTHS),  # declared length: honest, or at and beyond the limits
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_FRAMES, max_size=12), chunk=st.integers(1, 40))
def test_fuzzed_frames_after_handshake_keep_the_connection_working_or_close_it_clearly(
    frames, chunk
):
    async def main():
        errors = record_loop_errors()
        a, b, accepted, _ = await connected_pair()
        data = b"".join(frame(k, sid, body, flags, n) for k, sid, flags, body, n in frames)
        feed(b, data, chunk)  # as if a had sent it
        await settle()
        if b._dead:
            assert isinstance(b.closed.result(), SwarmgradError), b.closed.result()
        elif not b._payload_left and not b._filled and a.is_alive:
            # Between frames and still up: it must still answer the well-behaved side.
            assert await asyncio.wait_for(b.ping(), 5) >= 0
            a._next_id = itertools.count(1001, 2)  # ids the fuzz (posing as a) did not use
            stream = a.open_stream(b"after the fuzz")
            await stream.write(b"still works", fin=True)
            await settle()
            assert await accepted[-1].read() == b"still works"
        assert not errors, errors
        assert len(b._streams) <= b._max_inbound_streams + 64
        a.close()
        b.close()
        await settle()

    run_checked(main, timeout=20)


def test_window_grants_beyond_2_to_the_32_do_not_break_sending():
    async def main():
        a, b, accepted, _ = await connected_pair()
        stream = a.open_stream(b"x")
        await settle()
        grant = framing.WINDOW_PAYLOAD.pack(2**32 - 1)
        feed(a, frame(FrameType.WINDOW, stream.stream_id, grant) * 5)  # 2**34 bytes of credit
        await stream.write(b"y" * 100_000, fin=True)
        await settle()
        assert len(await accepted[0].readexactly(100_000)) == 100_000
        assert a.is_alive and b.is_alive
        a.close()
        await settle()

    run_checked(main)


# ------------------------------------------------------------------ floods from a non-reader


class StalledTransport(MemoryTransport):
    """The remote stopped reading: writes pile up; pause_writing past a high-water mark."""

    HIGH_WATER = 64 * 1024

    def __init__(self, loop):
        super().__init__(loop)
        self.queued = 0
        self.paused = False

    def write(self, data):
        if self.closed:
            return
        self.queued += len(data)
        if self.queued > self.HIGH_WATER and not self.paused:
            self.paused = True
            self.protocol.pause_writing()


@pytest.mark.parametrize("flood", ["ping", "open"])
def test_ping_or_open_flood_from_a_peer_that_never_reads_is_cut_off(flood):
    async def main():
        errors = record_loop_errors()
        a, b, _, _ = await connected_pair(max_inbound_streams=8)
        stalled = StalledTransport(asyncio.get_running_loop())
        stalled.protocol = b
        b.transport = stalled  # b's replies no longer reach a
        if flood == "ping":
            one = frame(FrameType.PING, 0, b"p" * 1000)
            data = b"".join([one] * 4000)  # 4 MB of PINGs, each asking for a 1 KB PONG
        else:
            data = b"".join(frame(FrameType.OPEN, 2 * i + 1) for i in range(60_000))
        feed(b, data)
        await settle()
        assert stalled.queued < 2 * 1024 * 1024, f"{stalled.queued} bytes queued for a non-reader"
        reason = b.closed.result()
        assert isinstance(reason, ProtocolViolation) and "without reading" in str(reason)
        assert not errors
        a.close()
        await settle()

    run_checked(main)


# ------------------------------------------------------------------ RPC over real peers


def test_overlong_call_header_is_refused_and_not_cached(arun):
    async def main():
        server, client, addr = await two_peers()
        conn = await client._get_connection(addr)
        before = rpc._parse_call_header.cache_info().currsize
        for i in range(20):
            stream = conn.open_stream(msgpack.packb({"h": f"{i}" + "x" * 60_000, "t": 5}))
            with pytest.raises(StreamReset, match=r"call header of \d+ bytes exceeds"):
                await asyncio.wait_for(stream.read(), 5)
        assert rpc._parse_call_header.cache_info().currsize == before
        with pytest.raises(ValidationError, match="too long"):
            await client.call(addr, "y" * 5000, "request")
        assert await client.call(addr, "echo", "fine", timeout=5) == "fine"
        await shutdown(client, server)

    arun(main)


def test_random_bytes_as_requests_are_refused_and_the_server_keeps_serving(arun):
    async def main():
        server, client, addr = await two_peers()
        conn = await client._get_connection(addr)
        rng = random.Random(7)
        valid = b"".join(rpc.encode_message({"x": [1, 2, 3], "b": rpc.Blob(b"z" * 5000)}))
        payloads = [b"", b"\x00\x00\x00", b"\xff\xff\xff\xff", b"\x00\x00\x00\x02\x00\x90"]
        deep = bytes((0, 0x90)) + b"\x91" * 5000 + b"\xc0"  # nesting beyond msgpack's stack
        payloads.append(len(deep).to_bytes(4, "big") + deep)
        payloads += [rng.randbytes(rng.randrange(1, 300)) for _ in range(40)]
        for _ in range(40):  # mutations of a valid message: flipped bytes, truncations
            mutated = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            payloads.append(bytes(mutated[: rng.randrange(1, len(mutated) + 1)]))
        for payload in payloads:
            stream = conn.open_stream(rpc.call_header("echo", 5.0))
            await stream.write(payload, fin=True)
            try:
                async with asyncio.timeout(5):
                    message = await rpc.read_message(stream, 2**20)
            except (StreamReset, ProtocolViolation):
                continue  # refused, with a reason
            assert message is not None  # a mutation that still decodes is echoed back
            stream.reset("done")
        assert await client.call(addr, "echo", "fine", timeout=5) == "fine"
        assert server._inflight == {}
        await shutdown(client, server)

    arun(main)


def test_oversized_message_length_prefixes_are_refused_without_allocating(arun):
    async def main():
        server, client, addr = await two_peers(max_message_size=1 << 20)
        conn = await client._get_connection(addr)
        for head in (b"\xff\xff\xff\xff", (2**24).to_bytes(4, "big")):
            stream = conn.open_stream(rpc.call_header("echo", 5.0))
            await stream.write(head)  # and never anything else
            with pytest.raises(StreamReset, match="exceeds the limit"):
                await asyncio.wait_for(stream.read(), 5)
        blob_claim = msgpack.packb([0, [2**40]]) + msgpack.packb(None)
        stream = conn.open_stream(rpc.call_header("echo", 5.0))
        await stream.write(len(blob_claim).to_bytes(4, "big") + blob_claim)
        with pytest.raises(StreamReset, match="exceeds the limit"):
            await asyncio.wait_for(stream.read(), 5)
        assert await client.call(addr, "echo", "fine", timeout=5) == "fine"
        await shutdown(client, server)

    arun(main)


def test_announced_but_unsent_message_bytes_are_bounded_per_connection(arun, monkeypatch):
    """Attached buffers are allocated before their bytes arrive: a peer announcing many
    large messages and sending nothing may hold at most the connection's budget; further
    messages wait, and other peers are served meanwhile."""
    monkeypatch.setattr(rpc, "RECEIVE_BUDGET_BYTES", 3 << 20)

    async def main():
        server, client, addr = await two_peers()
        other = await Peer.create()
        conn = await client._get_connection(addr)
        claim = msgpack.packb([0, [1 << 20]]) + msgpack.packb(None)  # 1 MiB, never sent
        silent = []
        for _ in range(10):
            stream = conn.open_stream(rpc.call_header("echo", None))
            await stream.write(len(claim).to_bytes(4, "big") + claim)
            silent.append(stream)
        budget = None
        for _ in range(100):  # until the server has read the ten claims
            server_conn = server._connections.get(client.peer_id)
            budget = rpc._budgets.get(server_conn) if server_conn is not None else None
            if budget is not None and budget.reserved == 3 << 20:
                break
            await asyncio.sleep(0.05)
        assert budget is not None and budget.reserved == 3 << 20  # three held, seven wait
        assert await other.call(addr, "echo", "fine", timeout=5) == "fine"
        for stream in silent:
            stream.reset("gave up")
        for _ in range(50):
            if budget.reserved == 0:
                break
            await asyncio.sleep(0.05)
        assert budget.reserved == 0  # abandoned messages give their reservation back
        assert await client.call(addr, "echo", b"x" * (2 << 20), timeout=5) == b"x" * (2 << 20)
        await shutdown(other, client, server)

    arun(main)


def test_caller_that_opens_a_call_and_never_sends_is_cleaned_up_on_disconnect(arun):
    async def main():
        server, client, addr = await two_peers(max_concurrent_calls_per_peer=4)
        conn = await client._get_connection(addr)
        silent = [conn.open_stream(rpc.call_header("echo", None)) for _ in range(4)]
        await asyncio.sleep(0.05)
        assert server._inflight[client.peer_id] == 4
        with pytest.raises(RemoteError, match="calls in flight"):  # only this caller waits
            await client.call(addr, "echo", "x", timeout=5)
        other = await Peer.create()
        assert await other.call(addr, "echo", "fine", timeout=5) == "fine"
        for stream in silent:
            stream.reset("gone")
        await asyncio.sleep(0.05)
        assert client.peer_id not in server._inflight
        await shutdown(other, client, server)

    arun(main)


# ------------------------------------------------------------------ raw sockets


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a ClientHello cut short, then silence
        b"\x16\x03\x03\xff\xff" + bytes(100),  # a record header announcing 64 KiB of nothing
        bytes(range(256)) * 4,
    ],
    ids=["short-client-hello", "huge-record-header", "byte-soup"],
)
def test_raw_socket_sending_garbage_or_stalling_mid_tls_is_dropped(arun, garbage):
    async def main():
        server, client, addr = await two_peers(handshake_timeout=0.3)
        reader, writer = await asyncio.open_connection(addr.host, addr.port)
        writer.write(garbage)
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(reader.read(), 5)  # maybe an alert, then the end
        assert reader.at_eof()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        assert await client.call(addr, "echo", "fine", timeout=5) == "fine"
        assert len(server._all_connections) == 1
        await shutdown(client, server)

    arun(main)
