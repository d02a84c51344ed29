"""Real network backend: TCP sockets, each wrapped in TLS 1.3 bound to the peer identity."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from swarmgrad.net.identity import Identity
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.secure import TLSLayer, TrafficCounter
from swarmgrad.net.tls import client_ssl_context, server_ssl_context

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


def _dialable_hosts(host: str) -> list[str]:
    """A wildcard listen address (0.0.0.0, ::) stands for this machine's addresses: list
    the ones others can dial (loopback first, then what the host name resolves to)."""
    if host not in ("0.0.0.0", "::"):
        return [host]
    family = socket.AF_INET if host == "0.0.0.0" else socket.AF_INET6
    hosts = ["127.0.0.1" if family == socket.AF_INET else "::1"]
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, family):
            address = info[4][0]
            if address not in hosts and not address.startswith(("127.", "fe80")):
                hosts.append(address)
    except OSError:
        pass
    return hosts


class TCPBackend:
    """Listens and dials with TLS; the upper protocol (a mux Connection) never sees TCP."""

    def __init__(self, identity: Identity):
        self._identity = identity
        self._servers: list[asyncio.base_events.Server] = []
        # set by a Peer with an admission authority: its current access token (wire
        # bytes), put in the certificate of every connection it accepts
        self.admission_token: Callable[[], bytes | None] | None = None
        # bytes through our sockets (relayed connections ride on them: not counted again)
        self.traffic = TrafficCounter()

    def _server_context(self):
        token = self.admission_token() if self.admission_token is not None else None
        return server_ssl_context(self._identity, token)

    async def listen(self, maddr: Multiaddr, upper_factory: ProtocolFactory) -> list[Multiaddr]:
        loop = asyncio.get_running_loop()
        # without admission one context serves all; with it, each connection takes the
        # context whose certificate carries the current (possibly renewed) token
        fixed = server_ssl_context(self._identity) if self.admission_token is None else None

        def factory() -> TLSLayer:
            context = fixed if fixed is not None else self._server_context()
            return TLSLayer(context, upper_factory(), server_side=True, traffic=self.traffic)

        server = await loop.create_server(
            factory, maddr.host, maddr.port, reuse_address=True, backlog=1024
        )
        self._servers.append(server)
        bound = []
        for sock in server.sockets:
            host, port = sock.getsockname()[:2]
            for address in _dialable_hosts(host):
                bound.append(Multiaddr.from_host_port(address, port))
        return list(dict.fromkeys(bound))

    async def dial(self, maddr: Multiaddr, upper: asyncio.BaseProtocol) -> TLSLayer:
        loop = asyncio.get_running_loop()
        layer = TLSLayer(
            client_ssl_context(self._identity), upper, server_side=False, traffic=self.traffic
        )
        await loop.create_connection(lambda: layer, maddr.host, maddr.port)
        return layer

    def wrap_relayed(self, upper: asyncio.BaseProtocol, *, server_side: bool) -> TLSLayer:
        """TLS over a stream relayed by a third peer: the relay sees only ciphertext."""
        context = self._server_context() if server_side else client_ssl_context(self._identity)
        return TLSLayer(context, upper, server_side=server_side)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
