"""A custom protocol written the hivemind way (a servicer with unary and streaming rpcs,
protobuf messages, a stub) served and called through swarmgrad.p2p, plus P2P's other
hivemind methods: msgpack handlers, binary streams, replicate, peers and options."""

from __future__ import annotations

import asyncio
import inspect
import pickle
from collections.abc import AsyncIterator

import msgpack
import pytest

from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.p2p import (
    P2P,
    InvalidMessageMarker,
    P2PContext,
    P2PDaemonError,
    P2PHandlerError,
    PeerID,
    PeerInfo,
    RPCError,
    ServicerBase,
    StubBase,
)
from swarmgrad.utils.errors import (
    FrameTooLarge,
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)
from swarmgrad.utils.rsa import RSAPrivateKey

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError:  # the optional ``hivemind`` extra is not installed
    descriptor_pb2 = None


def _message_classes():
    """Two protobuf messages built at test time (no protoc): the equivalent of

    message EchoRequest { string text = 1; int32 repeat = 2; }
    message EchoResponse { string text = 1; int32 index = 2; }
    """
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="swarmgrad_echo_test.proto", package="echo")
    for name, second in (("EchoRequest", "repeat"), ("EchoResponse", "index")):
        message = file.message_type.add(name=name)
        message.field.add(name="text", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
        message.field.add(name=second, number=2, type=field.TYPE_INT32, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"echo.{name}"))
        for name in ("EchoRequest", "EchoResponse")
    )


if descriptor_pb2 is not None:
    EchoRequest, EchoResponse = _message_classes()
else:
    EchoRequest = EchoResponse = None

needs_protobuf = pytest.mark.skipif(
    descriptor_pb2 is None, reason="protobuf (the `hivemind` extra) is not installed"
)


class EchoServicer(ServicerBase):
    """The protocol as a hivemind user writes it: annotations give the message types."""

    def __init__(self):
        self.calls: list[str] = []

    async def rpc_echo(self, request: EchoRequest, context: P2PContext) -> EchoResponse:
        self.calls.append(request.text)
        if request.text == "fail":
            raise ValueError("the servicer refuses 'fail'")
        assert isinstance(context.remote_id, PeerID) and context.local_id != context.remote_id
        return EchoResponse(text=request.text.upper(), index=request.repeat)

    async def rpc_repeat(
        self, request: EchoRequest, context: P2PContext
    ) -> AsyncIterator[EchoResponse]:
        for i in range(request.repeat):
            yield EchoResponse(text=request.text, index=i)

    async def rpc_join(
        self, requests: AsyncIterator[EchoRequest], context: P2PContext
    ) -> EchoResponse:
        texts = [request.text async for request in requests]
        return EchoResponse(text="+".join(texts), index=len(texts))


async def two_p2p(**kwargs) -> tuple[P2P, P2P]:
    server = await P2P.create(**kwargs)
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    return server, client


async def shutdown(*handles: P2P) -> None:
    for handle in handles:
        await handle.shutdown()


@needs_protobuf
def test_servicer_serves_unary_and_streaming_protobuf_rpcs_through_a_stub(arun):
    async def main():
        server, client = await two_p2p()
        try:
            servicer = EchoServicer()
            await servicer.add_p2p_handlers(server)
            stub = EchoServicer.get_stub(client, server.peer_id)
            assert isinstance(stub, StubBase)

            answer = await stub.rpc_echo(EchoRequest(text="hi", repeat=7), timeout=5)
            assert isinstance(answer, EchoResponse)
            assert (answer.text, answer.index) == ("HI", 7)

            stream = await stub.rpc_repeat(EchoRequest(text="x", repeat=4))
            assert [(r.text, r.index) async for r in stream] == [("x", i) for i in range(4)]

            async def requests():
                for text in ("a", "b", "c"):
                    yield EchoRequest(text=text)

            joined = await stub.rpc_join(requests())
            assert (joined.text, joined.index) == ("a+b+c", 3)

            with pytest.raises(P2PHandlerError, match="refuses 'fail'") as info:
                await stub.rpc_echo(EchoRequest(text="fail"))
            assert "EchoServicer.rpc_echo" in str(info.value)
            assert servicer.calls == ["hi", "fail"]

            await servicer.remove_p2p_handlers(server)
            with pytest.raises(P2PHandlerError, match="no handler"):
                await stub.rpc_echo(EchoRequest(text="gone"))
        finally:
            await shutdown(client, server)

    arun(main)


@needs_protobuf
def test_namespaces_keep_two_servicers_of_one_class_apart(arun):
    async def main():
        server, client = await two_p2p()
        try:
            first, second = EchoServicer(), EchoServicer()
            await first.add_p2p_handlers(server, namespace="one")
            await second.add_p2p_handlers(server, namespace="two")
            await EchoServicer.get_stub(client, server.peer_id, namespace="two").rpc_echo(
                EchoRequest(text="to-two")
            )
            assert (first.calls, second.calls) == ([], ["to-two"])
            with pytest.raises(P2PHandlerError, match="no handler"):  # no namespace served
                await EchoServicer.get_stub(client, server.peer_id).rpc_echo(EchoRequest())
        finally:
            await shutdown(client, server)

    arun(main)


@needs_protobuf
def test_request_that_does_not_parse_is_an_error_to_the_caller_and_the_server_keeps_serving(
    arun,
):
    async def main():
        server, client = await two_p2p()
        try:
            servicer = EchoServicer()
            await servicer.add_p2p_handlers(server)
            name = EchoServicer._get_handle_name(None, "rpc_echo")
            for garbage in (b"\x0a\xff\xff\xff", {"text": "not bytes"}):
                with pytest.raises(P2PHandlerError, match="EchoRequest") as info:
                    await client.call_protobuf_handler(server.peer_id, name, garbage, EchoResponse)
                assert "rpc_echo" in str(info.value)
            assert servicer.calls == [], "the handler must never see an unparsed request"
            answer = await client.call_protobuf_handler(
                server.peer_id, name, EchoRequest(text="ok"), EchoResponse
            )
            assert answer.text == "OK"
        finally:
            await shutdown(client, server)

    arun(main)


def test_msgpack_handlers_unary_and_streaming_both_ways_without_protobuf_types(arun):
    async def main():
        server, client = await two_p2p()
        try:
            contexts = []

            async def add(request, context):
                contexts.append(context)
                return {"sum": request["a"] + request["b"]}

            async def count(request, context):
                for i in range(request):
                    yield i

            async def total(requests, context):
                return sum([r async for r in requests])

            async def echo_all(requests, context):
                async for r in requests:
                    yield [r, r]

            await server.add_protobuf_handler("add", add, None)
            await server.add_protobuf_handler("count", count, None, stream_output=True)
            await server.add_protobuf_handler("total", total, None, stream_input=True)
            await server.add_protobuf_handler(
                "echo_all", echo_all, None, stream_input=True, stream_output=True
            )

            assert await client.call_protobuf_handler(
                server.peer_id, "add", {"a": 2, "b": 3}, None
            ) == {"sum": 5}
            assert contexts[0] == P2PContext("add", server.peer_id, client.peer_id)
            numbers = await client.iterate_protobuf_handler(server.peer_id, "count", 5, None)
            assert [n async for n in numbers] == [0, 1, 2, 3, 4]

            async def requests():
                for i in (1, 2, 3):
                    yield i

            assert (
                await client.call_protobuf_handler(server.peer_id, "total", requests(), None) == 6
            )
            pairs = await client.iterate_protobuf_handler(
                server.peer_id, "echo_all", requests(), None
            )
            assert [p async for p in pairs] == [[1, 1], [2, 2], [3, 3]]

            with pytest.raises(P2PHandlerError, match="KeyError"):
                await client.call_protobuf_handler(server.peer_id, "add", {"a": 1}, None)
            await server.remove_protobuf_handler("add")
            with pytest.raises(P2PHandlerError, match="no handler named 'add'"):
                await client.call_protobuf_handler(server.peer_id, "add", {"a": 1, "b": 1}, None)
        finally:
            await shutdown(client, server)

    arun(main)


def test_binary_stream_handler_echoes_bytes_both_ways(arun):
    async def main():
        server, client = await two_p2p()
        try:

            async def shout(info, reader, writer):
                assert info.peer_id == client.peer_id and info.proto == "shout"
                size = int.from_bytes(await reader.readexactly(4), "big")
                data = await reader.readexactly(size)
                writer.write(data.upper())
                await writer.drain()

            await server.add_binary_stream_handler("shout", shout)
            info, reader, writer = await client.call_binary_stream_handler(server.peer_id, "shout")
            assert info.peer_id == server.peer_id
            payload = b"hello hivemind" * 1000
            writer.write(len(payload).to_bytes(4, "big") + payload)
            writer.close()
            await writer.wait_closed()
            assert await reader.read() == payload.upper()
            with pytest.raises(asyncio.IncompleteReadError):
                await reader.readexactly(1)
        finally:
            await shutdown(client, server)

    arun(main)


def test_replicate_is_another_handle_to_the_same_peer_that_outlives_it(arun):
    async def main():
        server, client = await two_p2p()
        try:
            replica = await P2P.replicate(server.daemon_listen_maddr)
            assert replica.peer_id == server.peer_id
            of_peer = await P2P.replicate(server.peer)  # a handle on a swarmgrad Peer
            assert of_peer.peer is server.peer
            await of_peer.shutdown()
            assert server.is_alive

            async def ping(request, context):
                return "pong"

            await replica.add_protobuf_handler("ping", ping, None)  # served by the same peer
            await replica.shutdown()
            assert not replica.is_alive and server.is_alive
            assert await client.call_protobuf_handler(server.peer_id, "ping", None, None) == "pong"
            with pytest.raises(P2PDaemonError, match="no running peer"):
                await P2P.replicate("/unix/tmp/hivemind-p2pd-unknown.sock")
            address = server.daemon_listen_maddr
        finally:
            await shutdown(client, server)
        with pytest.raises(P2PDaemonError, match="no running peer"):
            await P2P.replicate(address)

    arun(main)


def test_peers_addresses_and_libp2p_only_options(arun):
    async def main():
        with pytest.warns(UserWarning) as caught:
            server = await P2P.create(use_ipfs=True, tls=False, dht_mode="client")
        messages = [str(w.message) for w in caught]
        assert len(messages) == 3
        for name in ("use_ipfs=True", "tls=False", "dht_mode='client'"):
            assert any(name in m for m in messages), (name, messages)
        client = None
        try:
            maddrs = await server.get_visible_maddrs()
            assert maddrs and all(isinstance(m, Multiaddr) for m in maddrs)
            assert all(str(m).endswith(f"/p2p/{server.peer_id}") for m in maddrs)
            client = await P2P.create(initial_peers=[str(m) for m in maddrs], no_listen=True)
            await client.wait_for_at_least_n_peers(1, attempts=3, delay=0.1)
            peers = await client.list_peers()
            assert [p.peer_id for p in peers] == [server.peer_id]
            assert isinstance(peers[0], PeerInfo)
            with pytest.raises(ValueError, match="No multiaddrs"):
                await client.get_visible_maddrs()  # no_listen: nothing to dial
            with pytest.raises(RuntimeError, match="Not enough peers"):
                await client.wait_for_at_least_n_peers(2, attempts=2, delay=0.01)
        finally:
            await shutdown(*[h for h in (client, server) if h is not None])

    arun(main)


def test_identity_path_keeps_the_peer_id_and_a_bad_file_is_a_daemon_error(arun, tmp_path):
    async def main():
        path = tmp_path / "id.key"
        first = await P2P.create(identity_path=str(path))
        peer_id = first.peer_id
        await first.shutdown()
        second = await P2P.create(identity_path=str(path))
        assert second.peer_id == peer_id
        await second.shutdown()
        bad = tmp_path / "bad.key"
        bad.write_bytes(b"not an identity")
        with pytest.raises(P2PDaemonError, match=r"bad\.key"):
            await P2P.create(identity_path=str(bad))
        rsa = tmp_path / "hivemind.key"  # hivemind's RSA identity: convert it first
        der = RSAPrivateKey().to_bytes()
        rsa.write_bytes(b"\x08\x00\x12" + bytes([len(der) & 0x7F | 0x80, len(der) >> 7]) + der)
        with pytest.raises(P2PDaemonError, match="swarmgrad identity import"):
            await P2P.create(identity_path=str(rsa))
        with pytest.raises(TypeError, match="use_quantum_relay"):
            await P2P.create(use_quantum_relay=True)

    arun(main)


def test_dht_replicate_p2p_works_from_the_programs_own_event_loop():
    """hivemind programs get their P2P with ``await dht.replicate_p2p()`` inside their own
    event loop: calls go through the DHT's loop, handlers run in the program's loop."""
    from swarmgrad.dht import DHT
    from swarmgrad.utils.timeutils import get_dht_time

    with DHT(start=True) as first:
        with DHT(start=True, initial_peers=first.get_visible_maddrs()) as second:

            async def main():
                program_loop = asyncio.get_running_loop()
                server, client = await first.replicate_p2p(), await second.replicate_p2p()
                assert server is await first.replicate_p2p()
                assert server.peer_id == first.peer_id
                loops = []

                async def add(request, context):
                    loops.append(asyncio.get_running_loop())
                    await asyncio.sleep(0.01)  # the program's loop runs it
                    return request + 1

                async def count(request, context):
                    for i in range(request):
                        loops.append(asyncio.get_running_loop())
                        yield i

                async def total(requests, context):
                    loops.append(asyncio.get_running_loop())
                    return sum([r async for r in requests])

                await server.add_protobuf_handler("add", add, None)
                await server.add_protobuf_handler("count", count, None, stream_output=True)
                await server.add_protobuf_handler("total", total, None, stream_input=True)

                assert await client.call_protobuf_handler(first.peer_id, "add", 1, None) == 2
                numbers = await client.iterate_protobuf_handler(first.peer_id, "count", 3, None)
                assert [n async for n in numbers] == [0, 1, 2]

                async def requests():
                    for i in (1, 2, 3):
                        await asyncio.sleep(0)  # a generator of the program's loop
                        yield i

                assert (
                    await client.call_protobuf_handler(first.peer_id, "total", requests(), None)
                    == 6
                )
                assert loops and all(loop is program_loop for loop in loops)
                with pytest.raises(P2PHandlerError, match="TypeError"):
                    await client.call_protobuf_handler(first.peer_id, "add", "x", None)
                if EchoRequest is not None:
                    servicer = EchoServicer()
                    await servicer.add_p2p_handlers(server)
                    stub = EchoServicer.get_stub(client, first.peer_id)
                    assert (await stub.rpc_echo(EchoRequest(text="a"))).text == "A"
                    replies = await stub.rpc_repeat(EchoRequest(text="b", repeat=2))
                    assert [r.index async for r in replies] == [0, 1]
                with pytest.raises(P2PDaemonError, match="event loop of the peer"):
                    await client.call_binary_stream_handler(first.peer_id, "nothing")
                await client.shutdown()  # a handle on the DHT's peer: the peer stays

            asyncio.run(main())
            assert second.store("still", "alive", get_dht_time() + 30)
            assert first.get("still").value == "alive"


# ---------------------------------------------------------------------- framing on binary streams


def _rpc_error_class():
    """hivemind's ``message RPCError { optional string message = 1; }`` built with protobuf,
    to check that swarmgrad's RPCError writes and reads the same bytes."""
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="swarmgrad_rpc_error_test.proto", package="t")
    message = file.message_type.add(name="RPCError")
    message.field.add(name="message", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    message.field.add(name="code", number=2, type=field.TYPE_INT32, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.RPCError"))


def _reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


@needs_protobuf
def test_hivemind_style_binary_stream_handler_exchanges_framed_protobufs_both_ways(arun):
    """A stream protocol written as hivemind's own stream handlers are: messages framed with
    send_protobuf / receive_protobuf, errors as RPCError, END_OF_STREAM closing each side."""

    async def main():
        server, client = await two_p2p()
        try:
            seen = []

            async def shout(info, reader, writer):
                index = 0
                while True:
                    request, error = await P2P.receive_protobuf(EchoRequest, reader)
                    if error is not None:
                        assert error == P2P.END_OF_STREAM
                        break
                    seen.append(len(request.text))
                    if request.text == "fail":
                        await P2P.send_protobuf(RPCError("the server refuses 'fail'"), writer)
                        continue
                    reply = EchoResponse(text=request.text.upper(), index=index)
                    await P2P.send_protobuf(reply, writer)
                    index += 1
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

            await server.add_binary_stream_handler("shout", shout)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "shout")
            big = "x" * 300_000  # several of send_raw_data's 64 KiB chunks
            for text in ("hi", big, "fail", "bye"):
                await P2P.send_protobuf(EchoRequest(text=text), writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            answers = []
            while True:
                reply, error = await P2P.receive_protobuf(EchoResponse, reader)
                if error == P2P.END_OF_STREAM:
                    break
                answers.append((reply.text, reply.index) if error is None else error.message)
            assert answers == [
                ("HI", 0), (big.upper(), 1), "the server refuses 'fail'", ("BYE", 2)
            ]  # fmt: skip
            assert seen == [2, 300_000, 4, 3]
            writer.close()
            await writer.wait_closed()
            assert await reader.read() == b""  # the handler returned: its side is closed

            # a message that does not parse: the handler's error resets the stream (the
            # reason reaches the caller) and the server goes on serving new streams
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "shout")
            writer.write(P2P.MESSAGE_MARKER)
            await P2P.send_raw_data(b"\xff\xff\xff", writer)
            with pytest.raises(SwarmgradError, match="does not parse as EchoRequest"):
                await P2P.receive_protobuf(EchoResponse, reader)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "shout")
            await P2P.send_protobuf(EchoRequest(text="again"), writer)
            reply, error = await P2P.receive_protobuf(EchoResponse, reader)
            assert error is None and reply.text == "AGAIN"
            writer.close()
        finally:
            await shutdown(client, server)

    arun(main)


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def test_raw_data_and_msgpack_messages_framed_both_ways_on_a_binary_stream(arun):
    async def main():
        server, client = await two_p2p()
        try:

            async def reverse(info, reader, writer):
                data = await P2P.receive_raw_data(reader)
                await P2P.send_raw_data(data[::-1], writer, chunk_size=1000)
                while True:
                    request, error = await P2P.receive_protobuf(None, reader)
                    if error is not None:
                        break
                    await P2P.send_protobuf({"sum": sum(request["numbers"])}, writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

            await server.add_binary_stream_handler("reverse", reverse)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "reverse")
            payload = bytes(range(256)) * 800  # 200 KiB
            await P2P.send_raw_data(payload, writer, chunk_size=4096)
            assert await P2P.receive_raw_data(reader) == payload[::-1]
            for numbers in ([1, 2], [], [10] * 100):
                await P2P.send_protobuf({"numbers": numbers}, writer)
                assert await P2P.receive_protobuf(None, reader) == ({"sum": sum(numbers)}, None)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            assert await P2P.receive_protobuf(None, reader) == (None, P2P.END_OF_STREAM)
            assert await reader.read() == b""

            # a message that is not what the handler expects: its error reaches the caller
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "reverse")
            await P2P.send_raw_data(b"ok", writer)
            assert await P2P.receive_raw_data(reader) == b"ko"
            await P2P.send_protobuf({"no numbers": 1}, writer)
            with pytest.raises(SwarmgradError, match="handler 'reverse' failed: KeyError"):
                await P2P.receive_protobuf(None, reader)
            # a caller that goes away mid-message: the handler's read fails, nothing hangs
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "reverse")
            writer.write((100).to_bytes(8, "big") + b"only part")
            writer.close()
            with pytest.raises(SwarmgradError, match="ended 9 bytes into a 100-byte read"):
                await reader.read()
        finally:
            await shutdown(client, server)

    arun(main)


def test_framing_is_hivemind_bytes_and_bad_frames_are_clear_errors(arun):
    async def main():
        sent = bytearray()

        class Collect:  # an asyncio-style writer into memory
            def write(self, data):
                sent.extend(data)

            async def drain(self):
                pass

        await P2P.send_protobuf({"a": 1}, Collect())
        await P2P.send_protobuf(RPCError("boom"), Collect())
        body = msgpack.packb({"a": 1})
        error = b"\x0a\x04boom"  # protobuf: field 1, length 4
        assert bytes(sent) == b"\x00" + _frame(body) + b"\x01" + _frame(error)
        reader = _reader_of(bytes(sent))  # and an asyncio.StreamReader reads them back
        assert await P2P.receive_protobuf(None, reader) == ({"a": 1}, None)
        assert await P2P.receive_protobuf(None, reader) == (None, RPCError("boom"))
        assert (P2P.HEADER_LEN, P2P.BYTEORDER) == (8, "big")

        with pytest.raises(InvalidMessageMarker, match=r"marker byte b'\\x07'") as info:
            await P2P.receive_protobuf(None, _reader_of(b"\x07" + _frame(b"")))
        assert isinstance(info.value, TypeError)  # hivemind raises a TypeError here
        with pytest.raises(FrameTooLarge, match="1099511627776 bytes, more than max_size="):
            await P2P.receive_raw_data(_reader_of((2**40).to_bytes(8, "big") + b"abc"))
        with pytest.raises(FrameTooLarge, match="max_size=2"):
            await P2P.receive_raw_data(_reader_of(_frame(b"abc")), max_size=2)
        assert await P2P.receive_raw_data(_reader_of(_frame(b"abc")), max_size=None) == b"abc"
        with pytest.raises(asyncio.IncompleteReadError):
            await P2P.receive_raw_data(_reader_of((10).to_bytes(8, "big") + b"abc"))
        with pytest.raises(ValidationError, match="not a msgpack object"):
            await P2P.receive_protobuf(None, _reader_of(b"\x00" + _frame(b"\xc1")))
        with pytest.raises(ProtocolViolation, match="RPCError"):
            await P2P.receive_protobuf(None, _reader_of(b"\x01" + _frame(b"\x0a\x09ab")))
        with pytest.raises(ValidationError, match="takes a message class"):
            await P2P.receive_protobuf(42, _reader_of(b"\x00" + _frame(body)))
        with pytest.raises(ValidationError, match="sends bytes, got a str"):
            await P2P.send_raw_data("text", Collect())
        with pytest.raises(ValidationError, match="contiguous buffer"):
            await P2P.send_raw_data(memoryview(b"abcdef")[::2], Collect())
        await P2P.send_raw_data(memoryview(bytes(12)).cast("B", (3, 4)), Collect(), chunk_size=5)
        assert await P2P.receive_raw_data(_reader_of(bytes(sent[-20:]))) == bytes(12)
        with pytest.raises(ValidationError, match="chunk_size must be a positive int"):
            await P2P.send_raw_data(b"x", Collect(), chunk_size=0)
        with pytest.raises(ValidationError, match="msgpack-able object, got a object"):
            await P2P.send_protobuf(object(), Collect())
        with pytest.raises(ValidationError, match=r"RPCError\.message must be a str"):
            RPCError(b"bytes")

    arun(main)


@needs_protobuf
def test_rpc_error_reads_and_writes_the_protobuf_encoding():
    Protobuf = _rpc_error_class()
    for text in ("boom", "ü" * 200):  # 400 bytes: a two-byte length
        assert RPCError(text).SerializeToString() == Protobuf(message=text).SerializeToString()
        assert RPCError.FromString(Protobuf(message=text).SerializeToString()).message == text
    assert RPCError().SerializeToString() == Protobuf().SerializeToString() == b""
    assert RPCError.FromString(Protobuf(message="").SerializeToString()) == RPCError()
    with_unknown = Protobuf(message="m", code=7).SerializeToString()
    assert RPCError.FromString(with_unknown) == RPCError("m")  # unknown fields are ignored
    assert P2P.END_OF_STREAM == RPCError() and not P2P.END_OF_STREAM.HasField("message")


def test_daemon_tables_raise_naming_the_replacement_and_the_type_aliases_exist():
    for name in ("DHT_MODE_MAPPING", "FORCE_REACHABILITY_MAPPING"):
        with pytest.raises(NotImplementedError, match=rf"P2P\.{name} .*no_listen=True"):
            getattr(P2P, name)
        # also an AttributeError: introspection and mocks see the attribute as absent
        assert not hasattr(P2P, name) and getattr(P2P, name, "default") == "default"
    assert "create" in dict(inspect.getmembers(P2P))
    assert P2P.TInputStream == AsyncIterator[P2P.TInputProtobuf]
    assert P2P.TOutputStream == AsyncIterator[P2P.TOutputProtobuf]


def test_p2p_handler_error_is_built_as_hivemind_builds_it():
    assert P2PHandlerError("a", "b").args == ("a", "b")
    assert str(P2PHandlerError()) == "Exception: "
    error = P2PHandlerError("it failed", remote_type="ValueError", peer="QmPeer")
    assert isinstance(error, RemoteError) and str(error) == "ValueError on QmPeer: it failed"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.args, copy.remote_type, copy.peer) == (error.args, "ValueError", "QmPeer")
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*\bcode\b"):
        P2PHandlerError("x", code=3)


def test_is_identity_taken_asks_the_swarm_for_the_identity(arun, tmp_path):
    from swarmgrad.dht.node import DHTNode

    async def main():
        taken_path, free_path = tmp_path / "taken.key", tmp_path / "free.key"
        boot = await P2P.create(identity_path=str(tmp_path / "boot.key"))
        owner = await P2P.create(identity_path=str(taken_path))
        P2P.generate_identity(str(free_path))
        initial = [str(m) for m in await boot.get_visible_maddrs()]
        boot_node = await DHTNode.create(p2p=boot)
        owner_node = await DHTNode.create(p2p=owner, initial_peers=initial)
        try:
            kwargs = dict(tls=True, use_auto_relay=False, use_ipfs=False, use_relay=True)
            taken = P2P.is_identity_taken
            assert await taken(str(taken_path), initial_peers=initial, **kwargs)
            assert await taken(str(tmp_path / "boot.key"), initial_peers=initial, **kwargs)
            assert not await taken(str(free_path), initial_peers=initial, **kwargs)
            assert not await taken(str(taken_path), initial_peers=[], **kwargs)
            await owner_node.shutdown()
            await owner.shutdown()
            assert not await taken(str(taken_path), initial_peers=initial, **kwargs)
            with pytest.warns(UserWarning, match=r"P2P\.is_identity_taken: use_ipfs=True"):
                await taken(str(free_path), initial_peers=initial, **{**kwargs, "use_ipfs": True})
            bad = tmp_path / "bad.key"
            bad.write_bytes(b"not an identity")
            with pytest.raises(P2PDaemonError, match=r"bad\.key"):
                await taken(str(bad), initial_peers=initial, **kwargs)
        finally:
            await owner_node.shutdown()
            await boot_node.shutdown()
            await shutdown(owner, boot)

    arun(main)
