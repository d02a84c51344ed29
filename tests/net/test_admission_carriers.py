"""Admission on every carrier: TLS relayed through a third peer (real loopback sockets), and
the simulated network (its simulated certificates, and the nonce exchange of relayed
connections)."""

from __future__ import annotations

import pytest

from swarmgrad.net.admission import Admission, Authority
from swarmgrad.net.identity import Identity
from swarmgrad.net.peer import Peer
from swarmgrad.net.sim import run_simulation
from swarmgrad.net.sim.backend import SimBackend
from swarmgrad.utils.errors import AdmissionRefused, SwarmgradError

AUTHORITY = Authority.generate()


async def echo(request, context):
    return request


def admission_for(identity: Identity, token_for=None) -> Admission:
    token = AUTHORITY.issue(token_for or identity.peer_id)
    admission = Admission(AUTHORITY.public_key, token)
    if token_for is not None:  # a peer whose token is not its own: skip the start check
        admission.bind = lambda peer_id: setattr(admission, "peer_id", peer_id)
    return admission


async def peer(**kwargs) -> Peer:
    identity = Identity.generate()
    created = await Peer.create(identity=identity, admission=admission_for(identity), **kwargs)
    created.add_handler("echo", echo)
    return created


def test_relayed_connections_are_admitted_end_to_end(arun):
    async def main():
        relay = await peer()
        home = await peer(client_mode=True, relays=relay.get_visible_maddrs())
        caller = await peer()
        outsider = await Peer.create()
        try:
            (relayed,) = home.get_visible_maddrs()
            assert "p2p-circuit" in str(relayed)
            assert await caller.call(relayed, "echo", "via relay", timeout=20) == "via relay"
            with pytest.raises(SwarmgradError, match="no token"):
                await outsider.call(relayed, "echo", "let me in", timeout=20)
        finally:
            for p in (outsider, caller, home, relay):
                await p.shutdown()

    arun(main)


def test_simulated_network_admits_and_refuses_alike():
    async def scenario(network):
        peers = []
        for token_for in (None, None, Identity.generate().peer_id):
            identity = Identity.generate()
            backend = SimBackend(network, None, identity)
            created = await Peer.create(
                identity=identity,
                backend=backend,
                host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                admission=admission_for(identity, token_for),
            )
            created.add_handler("echo", echo)
            peers.append(created)
        a, b, impostor = peers
        results = [await a.call(b.get_visible_maddrs()[0], "echo", "sim", timeout=10)]
        for dialer, listener in ((impostor, a), (a, impostor)):
            try:
                await dialer.call(listener.get_visible_maddrs()[0], "echo", "x", timeout=10)
            except AdmissionRefused as e:
                results.append(e.reason)
        for p in peers:
            await p.shutdown()
        return results

    assert run_simulation(scenario, seed=3, latency=0.01) == [
        "sim",
        "token for another peer",
        "token for another peer",
    ]
