"""Revocation lists in the DHT and token renewal, on real loopback sockets."""

from __future__ import annotations

import asyncio

import pytest

from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.revocation import REVOCATION_KEY, publish_revocations
from swarmgrad.net.admission import Admission, Authority
from swarmgrad.net.identity import Identity
from swarmgrad.net.peer import RENEW_TOKEN, Peer
from swarmgrad.utils.errors import AdmissionRefused, RemoteError
from swarmgrad.utils.timeutils import get_dht_time

AUTHORITY = Authority.generate()
OTHER_AUTHORITY = Authority.generate()
NOW = 1_700_000_000.0


async def echo(request, context):
    return request


async def admitted_peer(token=None, *, role="trainer", clock=None, **admission_kwargs) -> Peer:
    identity = Identity.generate()
    if token is None:
        issued_at = clock() if clock is not None else None
        token = AUTHORITY.issue(identity.peer_id, role, issued_at=issued_at)
    elif callable(token) and not hasattr(token, "encode"):
        token = token(identity.peer_id)
    if clock is not None:
        admission_kwargs["time_fn"] = clock
    admission = Admission(AUTHORITY.public_key, token, **admission_kwargs)
    peer = await Peer.create(identity=identity, admission=admission)
    peer.add_handler("echo", echo)
    return peer


async def until(condition, what: str, timeout: float = 20.0) -> None:
    """Poll a condition (no fixed sleeps deciding the outcome); fail after a deadline."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():  # noqa: ASYNC110 (polls state others change)
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"not within {timeout} s: {what}")


def test_revocation_published_in_the_dht_shuts_the_peer_out(arun):
    async def main():
        peers = [await admitted_peer(revocation_refresh=0.2) for _ in range(3)]
        nodes = []
        try:
            nodes.append(await DHTNode.create(peers[0]))
            address = peers[0].get_visible_maddrs()[0]
            for peer in peers[1:]:
                nodes.append(await DHTNode.create(peer, [address]))
            a, b, revoked = peers
            for peer in (a, b):
                assert await revoked.call(peer.get_visible_maddrs()[0], "echo", 1) == 1
            # the authority's tooling joins for a moment and publishes the list
            publisher = await admitted_peer(role="server")
            tool = await DHTNode.create(publisher, [address], client_mode=True)
            revocations = AUTHORITY.revocation_list(peers=[revoked.peer_id], serial=1)
            assert await publish_revocations(tool, revocations)
            await tool.shutdown()
            await publisher.shutdown()

            def shut_out() -> bool:
                return all(
                    p.admission.revocations is not None and not p.is_connected(revoked.peer_id)
                    for p in (a, b)
                )

            await until(shut_out, "every peer adopts the list and drops the revoked one")
            with pytest.raises(AdmissionRefused, match="revoked"):
                await revoked.call(a.get_visible_maddrs()[0], "echo", 2, timeout=10)
            assert await a.call(b.get_visible_maddrs()[0], "echo", 3) == 3  # others: fine
        finally:
            for node in nodes:
                await node.shutdown()
            for peer in peers:
                await peer.shutdown()

    arun(main)


def test_dht_keeps_only_the_authoritys_newest_list(arun):
    async def main():
        first, holder = await admitted_peer(), await admitted_peer()
        nodes = [await DHTNode.create(first)]
        try:
            nodes.append(await DHTNode.create(holder, [first.get_visible_maddrs()[0]]))
            honest, liar = nodes
            older = AUTHORITY.revocation_list(peers=[holder.peer_id], serial=1, lifetime="1d")
            newer = AUTHORITY.revocation_list(peers=[holder.peer_id], serial=2, lifetime="2d")
            assert await publish_revocations(honest, newer)
            # a token holder wants the revocation gone: an empty list of its own making,
            # garbage, an old genuine list, or the new one with a longer life: all refused
            foreign = OTHER_AUTHORITY.revocation_list(serial=99)
            far = get_dht_time() + 3 * 86400
            assert not await liar.store(REVOCATION_KEY, foreign.encode(), foreign.expires_at)
            assert not await liar.store(REVOCATION_KEY, b"garbage", far)
            assert not await liar.store(REVOCATION_KEY, newer.encode(), far)
            await liar.store(REVOCATION_KEY, older.encode(), older.expires_at)  # loses
            for node in nodes:
                found = await node.get(REVOCATION_KEY, latest=True)
                assert found is not None and found.value == newer.encode()
        finally:
            for node in nodes:
                await node.shutdown()
                await node.peer.shutdown()

    arun(main)


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_renewed_token_is_presented_on_live_and_new_connections(arun, tmp_path):
    async def main():
        clock = Clock()
        path = tmp_path / "a.token"

        def first_token(peer_id):
            AUTHORITY.issue(peer_id, lifetime=1000, issued_at=NOW).save(path)
            return str(path)

        a = await admitted_peer(first_token, clock=clock, check_interval=3600)
        b = await admitted_peer(clock=clock, check_interval=3600)
        try:
            assert await a.call(b.get_visible_maddrs()[0], "echo", 1) == 1
            clock.now = NOW + 800  # a's token is in the last quarter of its life
            AUTHORITY.issue(a.peer_id, lifetime=1000, issued_at=NOW + 790).save(path)
            await a.admission_tick()
            assert a.admission.renewals == 1
            (conn,) = [c for c in b._all_connections if c.is_alive]
            assert conn.remote_token == a.admission.token  # presented on the live connection
            clock.now = NOW + 1100  # the first token has expired
            assert b.enforce_admission() == 0
            assert await a.call(b.peer_id, "echo", 2) == 2
            # a new peer dials a: a's certificate carries the renewed token
            c = await admitted_peer(clock=clock, check_interval=3600)
            assert await c.call(a.get_visible_maddrs()[0], "echo", 3) == 3
            await c.shutdown()
        finally:
            await a.shutdown()
            await b.shutdown()

    arun(main)


def test_a_token_that_is_not_renewed_ends_its_connections(arun):
    async def main():
        clock = Clock()
        a = await admitted_peer(lambda pid: AUTHORITY.issue(pid, lifetime=100, issued_at=NOW),
                                clock=clock, check_interval=3600)  # fmt: skip
        b = await admitted_peer(clock=clock, check_interval=3600)
        try:
            assert await a.call(b.get_visible_maddrs()[0], "echo", 1) == 1
            (conn,) = [c for c in a._all_connections if c.is_alive]
            clock.now = NOW + 200
            assert b.enforce_admission() == 1
            reason = await conn.closed
            assert isinstance(reason, AdmissionRefused) and reason.reason == "expired"
        finally:
            await a.shutdown()
            await b.shutdown()

    arun(main)


def test_renew_handler_refuses_a_token_for_someone_else(arun):
    async def main():
        a, b = await admitted_peer(), await admitted_peer()
        try:
            stolen = AUTHORITY.issue(Identity.generate().peer_id)
            with pytest.raises(RemoteError, match="issued for"):
                await a.call(b.get_visible_maddrs()[0], RENEW_TOKEN, {"token": stolen.encode()})
            (conn,) = [c for c in b._all_connections if c.is_alive]
            assert conn.remote_token == a.admission.token
        finally:
            await a.shutdown()
            await b.shutdown()

    arun(main)
