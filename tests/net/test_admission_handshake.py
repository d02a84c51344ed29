"""Admission in the connection handshake, on real loopback sockets: every bad token is
refused with a clear error on both sides, the refused connection is closed, and the
other peers notice nothing."""

from __future__ import annotations

import logging

import msgpack
import pytest

from swarmgrad.net.admission import AccessToken, Admission, Authority, RefusalReason
from swarmgrad.net.identity import Identity
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import AdmissionRefused, SwarmgradError

AUTHORITY = Authority.generate()
OTHER_AUTHORITY = Authority.generate()


class UncheckedAdmission(Admission):
    """A peer that skips the check of its own token at start (a modified client, or one
    whose token went bad): the swarm must refuse it anyway."""

    def bind(self, peer_id):
        self.peer_id = peer_id


def forged(token: AccessToken, **changes) -> bytes:
    body = msgpack.unpackb(token.body)
    body.update(changes)
    return msgpack.packb(["swarmgrad-token", 1, msgpack.packb(body), token.signature])


class Swarm:
    """Admitted peers with an ``echo`` handler counting the calls it served."""

    def __init__(self):
        self.peers: list[Peer] = []
        self.served: dict = {}

    async def peer(self, token_for=None, *, role="trainer", authority=AUTHORITY, cls=Admission,
                   token=None, trusted=None) -> Peer:  # fmt: skip
        identity = Identity.generate()
        if token is None and token_for != "none":
            token = authority.issue(identity.peer_id if token_for is None else token_for, role)
        if token_for == "none":
            token = None
        admission = cls((trusted or authority).public_key, token)
        peer = await Peer.create(identity=identity, admission=admission)
        return self._add(peer)

    async def open_peer(self) -> Peer:
        return self._add(await Peer.create())

    def _add(self, peer: Peer) -> Peer:
        self.served[peer.peer_id] = 0

        async def echo(request, context):
            self.served[peer.peer_id] += 1
            return request

        peer.add_handler("echo", echo)
        self.peers.append(peer)
        return peer

    async def close(self):
        for peer in self.peers:
            await peer.shutdown()


def addr(peer: Peer):
    return peer.get_visible_maddrs()[0]


async def assert_unaffected(swarm: Swarm, member: Peer, bad: Peer):
    """The member refused ``bad`` and holds no connection to it; another admitted peer
    still reaches the member."""
    assert not member.is_connected(bad.peer_id)
    assert not bad.is_connected(member.peer_id)
    bystander = await swarm.peer()
    assert await bystander.call(addr(member), "echo", "still here") == "still here"
    assert await member.call(addr(bystander), "echo", "and back") == "and back"


def test_admitted_peers_talk_both_ways(arun):
    async def main():
        swarm = Swarm()
        try:
            a, b = await swarm.peer(), await swarm.peer(role="monitor")
            assert await a.call(addr(b), "echo", 1) == 1
            (conn,) = [c for c in b._all_connections if c.is_alive]
            assert conn.remote_token.peer_id == a.peer_id
            (conn,) = [c for c in a._all_connections if c.is_alive]
            assert conn.remote_token.role.value == "monitor"
            assert await a.call(b.peer_id, "echo", 2) == 2
        finally:
            await swarm.close()

    arun(main)


def _refused(excinfo, reason: RefusalReason):
    assert isinstance(excinfo.value, AdmissionRefused), excinfo.value
    assert excinfo.value.reason == reason.value, excinfo.value
    return str(excinfo.value)


async def _dial_refused(swarm, bad, member, reason, caplog, mutual=False) -> str:
    """``bad`` dials ``member``; both sides must say why, and nothing reaches the handler.
    ``mutual``: bad refuses member too (it trusts another authority), maybe first."""
    caplog.clear()
    served = swarm.served[member.peer_id]
    with pytest.raises(SwarmgradError) as excinfo:
        await bad.call(addr(member), "echo", "let me in", timeout=10)
    text = _refused(excinfo, reason)
    assert mutual or "refused us" in text
    assert swarm.served[member.peer_id] == served
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"refused {bad.peer_id}" in m and reason.value in m for m in logged), logged
    await assert_unaffected(swarm, member, bad)
    return text


async def _listen_refused(swarm, member, bad, reason, caplog, mutual=False) -> str:
    """``member`` dials ``bad``: the member refuses before its request leaves."""
    caplog.clear()
    served = swarm.served[bad.peer_id]
    with pytest.raises(SwarmgradError) as excinfo:
        await member.call(addr(bad), "echo", "secret", timeout=10)
    text = _refused(excinfo, reason)
    assert f"refused {bad.peer_id}" in text
    assert swarm.served[bad.peer_id] == served  # our request never reached it
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    refusal_of_member = f"refused {member.peer_id}"
    heard = [m for m in logged if "refused us" in m or (mutual and refusal_of_member in m)]
    assert any(reason.value in m for m in heard), logged  # bad's side knows why too
    await assert_unaffected(swarm, member, bad)
    return text


@pytest.mark.parametrize("direction", ["dial", "listen"])
def test_no_token_is_refused(arun, caplog, direction):
    async def main():
        swarm = Swarm()
        try:
            member = await swarm.peer()
            outsider = await swarm.open_peer()  # an open-swarm peer: presents nothing
            if direction == "dial":
                text = await _dial_refused(swarm, outsider, member, RefusalReason.NO_TOKEN, caplog)
            else:
                text = await _listen_refused(
                    swarm, member, outsider, RefusalReason.NO_TOKEN, caplog
                )
            assert "presented no access token" in text
            # a peer configured with the authority but holding no token fares the same
            tokenless = await swarm.peer("none")
            await _dial_refused(swarm, tokenless, member, RefusalReason.NO_TOKEN, caplog)
        finally:
            await swarm.close()

    arun(main)


@pytest.mark.parametrize("direction", ["dial", "listen"])
def test_expired_token_is_refused(arun, caplog, direction):
    async def main():
        swarm = Swarm()
        try:
            member = await swarm.peer()
            identity = Identity.generate()
            stale = AUTHORITY.issue(identity.peer_id, lifetime=60, issued_at=1_600_000_000)
            admission = UncheckedAdmission(AUTHORITY.public_key, stale)
            bad = swarm._add(await Peer.create(identity=identity, admission=admission))
            check = _dial_refused if direction == "dial" else _listen_refused
            pair = (bad, member) if direction == "dial" else (member, bad)
            text = await check(swarm, *pair, RefusalReason.EXPIRED, caplog)
            assert "expired at 2020-09-13" in text
        finally:
            await swarm.close()

    arun(main)


@pytest.mark.parametrize("direction", ["dial", "listen"])
def test_token_for_another_peer_is_refused(arun, caplog, direction):
    async def main():
        swarm = Swarm()
        try:
            member = await swarm.peer()
            victim = Identity.generate().peer_id  # whose token was copied
            bad = await swarm.peer(victim, cls=UncheckedAdmission)
            check = _dial_refused if direction == "dial" else _listen_refused
            pair = (bad, member) if direction == "dial" else (member, bad)
            text = await check(swarm, *pair, RefusalReason.WRONG_PEER, caplog)
            assert f"issued for {victim}" in text
        finally:
            await swarm.close()

    arun(main)


@pytest.mark.parametrize("direction", ["dial", "listen"])
def test_token_of_another_authority_is_refused(arun, caplog, direction):
    async def main():
        swarm = Swarm()
        try:
            member = await swarm.peer()
            # a member of another swarm: its token and its trusted key are the other's
            bad = await swarm.peer(authority=OTHER_AUTHORITY)
            check = _dial_refused if direction == "dial" else _listen_refused
            pair = (bad, member) if direction == "dial" else (member, bad)
            text = await check(swarm, *pair, RefusalReason.WRONG_AUTHORITY, caplog, mutual=True)
            assert str(OTHER_AUTHORITY.public_key) in text
        finally:
            await swarm.close()

    arun(main)


@pytest.mark.parametrize("direction", ["dial", "listen"])
def test_forged_signature_is_refused(arun, caplog, direction):
    async def main():
        swarm = Swarm()
        try:
            member = await swarm.peer()
            identity = Identity.generate()
            monitor = AUTHORITY.issue(identity.peer_id, "monitor")
            promoted = forged(monitor, role="trainer")  # same signature, better role
            admission = UncheckedAdmission(AUTHORITY.public_key, promoted)
            bad = swarm._add(await Peer.create(identity=identity, admission=admission))
            check = _dial_refused if direction == "dial" else _listen_refused
            pair = (bad, member) if direction == "dial" else (member, bad)
            text = await check(swarm, *pair, RefusalReason.BAD_SIGNATURE, caplog)
            assert "forged signature" in text
        finally:
            await swarm.close()

    arun(main)


@pytest.mark.parametrize("direction", ["dial", "listen"])
def test_revoked_token_is_refused(arun, caplog, direction):
    async def main():
        swarm = Swarm()
        try:
            member = await swarm.peer()
            bad = await swarm.peer()
            token = bad.admission.token
            revocations = AUTHORITY.revocation_list(token_ids=[token.token_id], serial=1)
            member.admission.apply_revocations(revocations)
            check = _dial_refused if direction == "dial" else _listen_refused
            pair = (bad, member) if direction == "dial" else (member, bad)
            text = await check(swarm, *pair, RefusalReason.REVOKED, caplog)
            assert "revoked" in text
        finally:
            await swarm.close()

    arun(main)


def test_revocation_closes_a_live_connection_and_fails_its_calls(arun, caplog):
    async def main():
        swarm = Swarm()
        try:
            member, bad = await swarm.peer(), await swarm.peer()
            assert await bad.call(addr(member), "echo", 1) == 1
            (conn,) = [c for c in bad._all_connections if c.is_alive]
            member.admission.apply_revocations(
                AUTHORITY.revocation_list(peers=[bad.peer_id], serial=1)
            )
            assert member.enforce_admission() == 1
            reason = await conn.closed
            assert isinstance(reason, AdmissionRefused) and reason.reason == "revoked"
            with pytest.raises(AdmissionRefused, match="revoked"):
                await bad.call(member.peer_id, "echo", 2, timeout=10)
            await assert_unaffected(swarm, member, bad)
        finally:
            await swarm.close()

    arun(main)


def test_open_swarm_is_unchanged(arun):
    async def main():
        swarm = Swarm()
        try:
            a, b = await swarm.open_peer(), await swarm.open_peer()
            assert await a.call(addr(b), "echo", "open") == "open"
            assert a.admission is None
            (conn,) = [c for c in a._all_connections if c.is_alive]
            assert conn.remote_token is None
            assert conn.transport.get_extra_info("tls_admission_token") is None
        finally:
            await swarm.close()

    arun(main)


def test_a_peer_refuses_to_start_with_a_token_that_cannot_admit_it(arun):
    async def main():
        identity = Identity.generate()
        token = AUTHORITY.issue(Identity.generate().peer_id)
        with pytest.raises(AdmissionRefused, match="own access token"):
            await Peer.create(identity=identity, authority=AUTHORITY.public_key,
                              access_token=token)  # fmt: skip

    arun(main)
