"""A custom protocol written the hivemind way (a servicer with unary and streaming rpcs,
protobuf messages, a stub) served and called through swarmgrad.p2p, plus P2P's other
hivemind methods: msgpack handlers, binary streams, replicate, peers and options."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.p2p import (
    P2P,
    P2PContext,
    P2PDaemonError,
    P2PHandlerError,
    PeerID,
    PeerInfo,
    ServicerBase,
    StubBase,
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
