"""An in-process swarm on swarmgrad's simulated network, for the Learning@home benchmarks.

Every peer (expert servers, trainers, pipeline stages) is a real :class:`Peer` with its
own :class:`DHTNode`, living on this process's swarmgrad event loop, attached to one
:class:`~swarmgrad.net.sim.SimNetwork`. The loop is an ordinary one, so the simulated
network runs in real time: a link latency of 0.1 s is 0.1 s of wall time, and compute
(the expert servers' device threads, the pipeline stages' executors) is real compute.
``tc netem`` is not available on this machine; this is how the benchmarks add latency.

A *hop* is one message from one peer to another: its one-way link latency. An expert call
is two hops (request, answer).
"""

from __future__ import annotations

import asyncio
import collections
import random
from types import SimpleNamespace
from typing import Any

from swarmgrad.dht.node import DHTNode
from swarmgrad.moe import protocol
from swarmgrad.moe.server import ModuleBackend, Server
from swarmgrad.moe.server.task_pool import ExpertFailure
from swarmgrad.net.sim import SimNetwork
from swarmgrad.net.sim.backend import SIM_PORT, create_sim_peer
from swarmgrad.utils.loop_thread import run_coroutine


class SimSwarm:
    """Peers on one simulated network; use as a context manager (closes everything)."""

    def __init__(self, seed: int = 0, latency: float = 0.0):
        self.rng = random.Random(seed)
        self.network: SimNetwork = run_coroutine(self._make_network(seed, latency))
        self.hosts: list[str] = []
        self.nodes: list[DHTNode] = []
        self.servers: list[Server] = []
        self.failed_calls: collections.Counter[str] = collections.Counter()  # by RPC name

    @staticmethod
    async def _make_network(seed: int, latency: float) -> SimNetwork:
        return SimNetwork(seed, latency=latency)

    def __enter__(self) -> SimSwarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ peers

    def node(self) -> DHTNode:
        """A new peer with a DHT node, joined through the first peer of the swarm."""
        return run_coroutine(self._node())

    async def _node(self) -> DHTNode:
        index = len(self.hosts) + 1
        ip = f"10.0.{index >> 8}.{index & 255}"
        self.hosts.append(f"{ip}:{SIM_PORT}")
        peer = await create_sim_peer(self.network, rng=self.rng, ip=ip)
        initial = [str(m) for m in self.nodes[0].peer.get_visible_maddrs()] if self.nodes else []
        node = await DHTNode.create(peer, initial)
        self.nodes.append(node)
        return node

    def server(self, backends: dict[str, ModuleBackend], failure_rate: float = 0.0) -> Server:
        """Serve ``backends`` from a new peer with swarmgrad's expert :class:`Server`.
        With ``failure_rate``, that fraction of forward and backward calls fail on the
        server before reaching the expert (see :func:`fail_some_calls`)."""
        return run_coroutine(self._server(backends, failure_rate))

    async def _server(self, backends: dict[str, ModuleBackend], failure_rate: float) -> Server:
        node = await self._node()
        server = Server(SimpleNamespace(peer=node.peer, node=node), backends)
        await server.astart()
        self.servers.append(server)
        if failure_rate > 0:
            rng = random.Random(self.rng.random())
            fail_some_calls(server, node.peer, failure_rate, rng, self.failed_calls)
        return server

    # ------------------------------------------------------------------ network

    def set_latency(self, seconds: float) -> None:
        """One-way latency of every link between the swarm's peers (each hop)."""

        async def apply() -> None:
            for host in self.hosts:
                self.network.set_host(host, latency=seconds)

        run_coroutine(apply())

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                await server.ashutdown(timeout=10.0)
            for node in self.nodes:
                await node.shutdown()
                await node.peer.shutdown()
            self.network.close()
            await asyncio.sleep(0)

        try:
            run_coroutine(stop(), timeout=60)
        finally:
            self.servers, self.nodes = [], []


def fail_some_calls(
    server: Server,
    peer: Any,
    rate: float,
    rng: random.Random,
    counter: collections.Counter[str] | None = None,
) -> None:
    """Make ``rate`` of the expert calls (forward and backward) to ``server`` fail.

    A failed call is refused by the server with an :class:`ExpertFailure` before it reaches
    the expert (no computation, no update), so the caller learns of it one round trip
    later as a ``RemoteError``, as it would from a server that crashed or gave up on the
    request. ``counter`` counts the failed calls by RPC name. Call on the loop thread."""
    handler = server.connection_handler

    def flaky(name: str, fn: Any) -> Any:
        async def call(request: Any, context: Any) -> Any:
            if rng.random() < rate:
                if counter is not None:
                    counter[name] += 1
                raise ExpertFailure(f"{name}: an injected failure (rate {rate})")
            return await fn(request, context)

        return call

    for name, fn in (
        (protocol.FORWARD, handler.rpc_forward),
        (protocol.BACKWARD, handler.rpc_backward),
    ):
        peer.remove_handler(name)
        peer.add_handler(name, flaky(name, fn))
