"""Run real :class:`~swarmgrad.net.peer.Peer` objects on the simulated network.

The backend gives each peer a host address on the :class:`SimNetwork` and hands the
peer's connections to simulated transports instead of TCP + TLS. Everything above the
transport (handshake with ed25519 proofs, multiplexing, flow control, RPC, relays) is the
production code. TLS itself is left out (the simulated wire cannot be eavesdropped), but
what a TLS session hands the connection is simulated: the listener's PeerID, vouched for by
the simulation as a certificate and its CertificateVerify would be, and a channel binding
unique to the connection. So a direct connection runs the same TLS-bound handshake as on
real sockets (only the dialer signs, its first request leaves with its HELLO); a relayed
one, which has no simulated TLS, runs the nonce exchange.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable
from typing import Any

from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.sim.network import SimListener, SimNetwork

SIM_PORT = 31337


class _SimulatedTLS(asyncio.BaseProtocol):
    """Takes a new simulated connection, adds what TLS would have established, and hands the
    transport to the real protocol (which from then on receives everything directly)."""

    def __init__(
        self, upper: asyncio.BaseProtocol, listener: PeerID | None, token: bytes | None = None
    ):
        self._upper = upper
        self._listener = listener  # the dialer's side: whom it reached
        self._token = token  # the dialer's side: the access token in the listener's cert

    def connection_made(self, transport: Any) -> None:
        extra = transport._extra
        extra["channel_binding"] = hashlib.sha256(
            f"swarmgrad-sim-tls|{id(transport.get_extra_info('sim_network'))}|"
            f"{transport._id}".encode()
        ).digest()
        if self._listener is not None:
            extra["tls_peer_id"] = self._listener
            extra["tls_admission_token"] = self._token
        transport.set_protocol(self._upper)
        self._upper.connection_made(transport)


def _identities(network: SimNetwork) -> dict[str, PeerID]:
    """Host address -> PeerID of the swarmgrad peer listening there."""
    registry = getattr(network, "_swarmgrad_identities", None)
    if registry is None:
        registry = network._swarmgrad_identities = {}  # type: ignore[attr-defined]
    return registry


def _backends(network: SimNetwork) -> dict[str, SimBackend]:
    """Host address -> the backend listening there (for its simulated certificate)."""
    registry = getattr(network, "_swarmgrad_backends", None)
    if registry is None:
        registry = network._swarmgrad_backends = {}  # type: ignore[attr-defined]
    return registry


class SimBackend:
    """One peer's attachment to a :class:`SimNetwork` at host ``ip`` (allocated if None).
    With ``identity``, direct connections get simulated TLS (see the module docstring)."""

    def __init__(
        self, network: SimNetwork, ip: str | None = None, identity: Identity | None = None
    ):
        self.network = network
        self.identity = identity
        if ip is None:
            index = getattr(network, "_swarmgrad_next_host", 1)
            network._swarmgrad_next_host = index + 1
            ip = f"10.{(index >> 16) & 255}.{(index >> 8) & 255}.{index & 255}"
        self.ip = ip
        self.host = f"{ip}:{SIM_PORT}"
        self._listeners: list[SimListener] = []
        # set by a Peer with an admission authority: its current access token, which the
        # simulated certificate carries to dialers (as swarmgrad.net.tls does)
        self.admission_token: Callable[[], bytes | None] | None = None

    async def listen(self, maddr: Multiaddr, upper_factory: Callable[[], Any]) -> list[Multiaddr]:
        factory = upper_factory
        if self.identity is not None:
            _identities(self.network)[self.host] = self.identity.peer_id
            _backends(self.network)[self.host] = self
            factory = lambda: _SimulatedTLS(upper_factory(), None)  # noqa: E731
        self._listeners.append(self.network.listen(self.host, factory))
        return [Multiaddr.from_host_port(self.ip, SIM_PORT)]

    async def dial(self, maddr: Multiaddr, upper: asyncio.BaseProtocol) -> asyncio.BaseProtocol:
        destination = f"{maddr.host}:{maddr.port}"
        listener = _identities(self.network).get(destination)
        backend = _backends(self.network).get(destination)
        source = backend.admission_token if backend is not None else None
        token = source() if source is not None else None
        protocol = upper if listener is None else _SimulatedTLS(upper, listener, token)
        await self.network.connect(self.host, destination, lambda: protocol)
        return upper

    def wrap_relayed(self, upper: asyncio.BaseProtocol, *, server_side: bool) -> Any:
        return upper

    async def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        registry = _identities(self.network)
        if self.identity is not None and registry.get(self.host) == self.identity.peer_id:
            del registry[self.host]  # whoever listens here next is someone else
            _backends(self.network).pop(self.host, None)


def sim_identity(rng: random.Random) -> Identity:
    """A reproducible identity, so that a seeded simulation repeats exactly."""
    return Identity.from_seed(rng.randbytes(32))


async def create_sim_peer(
    network: SimNetwork,
    *,
    rng: random.Random | None = None,
    ip: str | None = None,
    **peer_kwargs: Any,
):
    """Start a :class:`~swarmgrad.net.peer.Peer` on the simulated network."""
    from swarmgrad.net.peer import Peer

    identity = sim_identity(rng) if rng is not None else Identity.generate()
    backend = SimBackend(network, ip, identity)
    return await Peer.create(
        identity=identity, backend=backend, host_maddrs=["/ip4/0.0.0.0/tcp/0"], **peer_kwargs
    )
