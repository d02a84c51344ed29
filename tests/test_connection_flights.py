"""How many one-way trips a fresh connection needs before its first call is answered.

On a slow link each flight costs a one-way delay, so the count is the latency of every
first contact (a DHT lookup meeting a new node, an averaging partner, an expert). A proxy
between two real peers records which way each chunk went; consecutive chunks in the same
direction are one flight.
"""

from __future__ import annotations

import asyncio

from peer_helpers import shutdown, two_peers

from swarmgrad.net.multiaddr import Multiaddr


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


def test_a_fresh_connection_answers_its_first_call_after_six_flights(arun):
    """ClientHello; the listener's TLS flight; the dialer's Finished with its key share
    and HELLO; the listener's share, HELLO and AUTH; the dialer's AUTH with the request;
    the answer. (Eight before each side keyed its records from its own share.)"""

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
    assert flights == ["to listener", "to dialer"] * 3
