"""Run real :class:`~swarmgrad.net.peer.Peer` objects on the simulated network.

The backend gives each peer a host address on the :class:`SimNetwork` and hands the
peer's connections to simulated transports instead of TCP + TLS. Everything above the
transport (handshake with ed25519 proofs, multiplexing, flow control, RPC, relays) is the
production code. TLS is left out: the simulated wire cannot be eavesdropped, and identity is
still proven by the handshake's signatures.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from swarmgrad.net.identity import Identity
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.sim.network import SimListener, SimNetwork

SIM_PORT = 31337


class SimBackend:
    """One peer's attachment to a :class:`SimNetwork` at host ``ip`` (allocated if None)."""

    def __init__(self, network: SimNetwork, ip: str | None = None):
        self.network = network
        if ip is None:
            index = getattr(network, "_swarmgrad_next_host", 1)
            network._swarmgrad_next_host = index + 1
            ip = f"10.{(index >> 16) & 255}.{(index >> 8) & 255}.{index & 255}"
        self.ip = ip
        self.host = f"{ip}:{SIM_PORT}"
        self._listeners: list[SimListener] = []

    async def listen(self, maddr: Multiaddr, upper_factory: Callable[[], Any]) -> list[Multiaddr]:
        self._listeners.append(self.network.listen(self.host, upper_factory))
        return [Multiaddr.from_host_port(self.ip, SIM_PORT)]

    async def dial(self, maddr: Multiaddr, upper: asyncio.BaseProtocol) -> asyncio.BaseProtocol:
        await self.network.connect(self.host, f"{maddr.host}:{maddr.port}", lambda: upper)
        return upper

    def wrap_relayed(self, upper: asyncio.BaseProtocol, *, server_side: bool) -> Any:
        return upper

    async def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()


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

    backend = SimBackend(network, ip)
    identity = sim_identity(rng) if rng is not None else None
    return await Peer.create(
        identity=identity, backend=backend, host_maddrs=["/ip4/0.0.0.0/tcp/0"], **peer_kwargs
    )
