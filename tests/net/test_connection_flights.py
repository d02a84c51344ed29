"""Connection life cycle seen from outside: how many one-way trips a fresh connection
needs before its first call is answered, and how idle connections end.

On a slow link each flight costs a one-way delay, so the count is the latency of every
first contact (a DHT lookup meeting a new node, an averaging partner, an expert). A proxy
between two real peers records which way each chunk went; consecutive chunks in the same
direction are one flight.
"""

from __future__ import annotations

import asyncio

from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.mux import IDLE_REASON
from tests.helpers.peers import shutdown, two_peers


async def _recording_proxy(upstream_port: int, log: list[str]):
    async def pump(reader, writer, direction: str) -> None:
        try:
            while data := await reader.read(65536):
                log.append(direction)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(
            pump(reader, up_writer, "to listener"),
            pump(up_reader, writer, "to dialer"),
        )

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _flights(log: list[str]) -> list[str]:
    runs: list[str] = []
    for direction in log:
        if not runs or runs[-1] != direction:
            runs.append(direction)
    return runs


def test_a_fresh_connection_answers_its_first_call_after_four_flights(arun):
    """ClientHello; the listener's TLS flight; the dialer's Finished with its key share,
    HELLO, TLS-bound AUTH and the request; the listener's share and HELLO with the answer.
    (Six with the nonce-exchange handshake, eight before each side keyed its records from
    its own share.)"""

    async def main():
        server, client, address = await two_peers()
        log: list[str] = []
        port = int(address.host_port.rpartition(":")[2])
        proxy = await _recording_proxy(port, log)
        proxy_port = proxy.sockets[0].getsockname()[1]
        target = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{proxy_port}/p2p/{server.peer_id}")
        assert await client.call(target, "echo", b"x" * 100, timeout=10) == b"x" * 100
        flights = _flights(log)
        proxy.close()
        await shutdown(client, server)
        return flights

    flights = arun(main)
    assert flights == ["to listener", "to dialer"] * 2


def test_idle_connections_are_closed_and_calls_redial(arun):
    async def main():
        server, client, address = await two_peers(idle_timeout=0.3, keepalive_interval=None)
        assert await client.call(address, "echo", b"a", timeout=5) == b"a"
        assert client.is_connected(server.peer_id)
        for _ in range(100):  # closed by the server within idle_timeout + a check period
            await asyncio.sleep(0.02)
            if not client.is_connected(server.peer_id):
                break
        closed = not client.is_connected(server.peer_id)
        again = await client.call(address, "echo", b"b", timeout=5)
        await shutdown(client, server)
        return closed, again

    closed, again = arun(main)
    assert closed and again == b"b"


def test_a_call_racing_an_idle_close_is_sent_again_on_a_new_connection(arun):
    """The server closes the connection as idle while the client's request is on its way
    (the server has not read it): the call must succeed over a new connection, and the
    handler must run exactly once."""

    async def main():
        server, client, address = await two_peers(keepalive_interval=None, idle_timeout=None)
        served = []

        async def count(request, context):
            served.append(request)
            return request

        server.add_handler("count", count)
        assert await client.call(address, "echo", b"warm", timeout=5) == b"warm"
        (conn,) = [c for c in server._all_connections if c.is_alive]
        conn.transport.pause_reading()  # the request will wait in the socket
        call = asyncio.ensure_future(client.call(server.peer_id, "count", b"x", timeout=5))
        await asyncio.sleep(0.1)
        assert conn.num_streams == 0  # nothing read: to the server the connection is idle
        conn.close(IDLE_REASON)
        result = await call
        await shutdown(client, server)
        return result, served

    result, served = arun(main)
    assert result == b"x" and served == [b"x"]
