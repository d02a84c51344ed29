"""Access tokens, revocation lists and the admission policy, without any network."""

from __future__ import annotations

import asyncio
import os
import stat

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmgrad.cli.main import main as cli_main
from swarmgrad.net.admission import (
    AccessToken,
    Admission,
    Authority,
    RefusalReason,
    RevocationList,
    Role,
    load_authority_key,
    parse_duration,
)
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import AdmissionRefused, TokenError, ValidationError

AUTHORITY = Authority(Identity.from_seed(b"a" * 32))
OTHER_AUTHORITY = Authority(Identity.from_seed(b"o" * 32))
PEER = Identity.from_seed(b"p" * 32).peer_id
OTHER_PEER = Identity.from_seed(b"q" * 32).peer_id
NOW = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def admission(token=None, clock=None, **kwargs) -> Admission:
    return Admission(AUTHORITY.public_key, token, time_fn=clock or Clock(), **kwargs)


def refusal(policy: Admission, raw: bytes | None, peer=PEER) -> str:
    with pytest.raises(AdmissionRefused) as info:
        policy.check(raw, peer)
    return info.value.reason


# ------------------------------------------------------------------------ tokens


def test_issued_token_round_trips_through_wire_and_text_forms():
    token = AUTHORITY.issue(PEER, "server", "2h", issued_at=NOW)
    assert (token.peer_id, token.role, token.issuer) == (PEER, Role.SERVER, AUTHORITY.public_key)
    assert token.expires_at - token.issued_at == 7200
    assert AccessToken.decode(token.encode()) == token
    assert AccessToken.from_text(token.to_text()) == token
    assert AccessToken.from_text("  " + token.to_text() + "\n") == token
    assert len(token.encode()) < 300


def test_each_token_gets_its_own_id():
    assert AUTHORITY.issue(PEER).token_id != AUTHORITY.issue(PEER).token_id


def test_token_file_round_trip(tmp_path):
    token = AUTHORITY.issue(PEER, issued_at=NOW)
    token.save(tmp_path / "t")
    assert AccessToken.load(tmp_path / "t") == token
    (tmp_path / "bad").write_text("sgt1.!!!")
    with pytest.raises(TokenError, match="bad"):
        AccessToken.load(tmp_path / "bad")
    with pytest.raises(TokenError, match="cannot read"):
        AccessToken.load(tmp_path / "missing")


@pytest.mark.parametrize(
    "text, seconds", [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("7d", 604800)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7y", "-1d", "0", "d", "1.2.3h"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValidationError):
        parse_duration(text)


VALID_WIRE = AUTHORITY.issue(PEER, issued_at=NOW).encode()


@given(st.binary(max_size=2048))
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_malformed_token_bytes_give_token_error_never_a_crash(data):
    try:
        token = AccessToken.decode(data)
    except TokenError as e:
        assert str(e)
    else:  # random bytes that parse must at least be a well-formed token
        assert isinstance(token.role, Role)


@given(st.data())
@settings(max_examples=400)
def test_mutated_tokens_are_refused_with_a_reason(data):
    wire = bytearray(VALID_WIRE)
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(wire) - 1))
        wire[index] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        wire = wire[: data.draw(st.integers(0, len(wire)))]
    policy = admission()
    try:
        token = policy.check(bytes(wire), PEER)
    except AdmissionRefused as e:
        assert e.reason in {r.value for r in RefusalReason}
    else:  # only "mutations" that left the bytes as they were
        assert bytes(wire) == VALID_WIRE == token.encode()


@given(
    st.dictionaries(
        st.sampled_from(["peer", "role", "iat", "exp", "id", "iss", "extra"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**64 - 1),
            st.floats(allow_nan=True),
            st.text(max_size=20),
            st.binary(max_size=60),
            st.lists(st.integers(0, 1000), max_size=3),
        ),
    ),
    st.one_of(st.just(b"\0" * 64), st.binary(max_size=80)),
    st.one_of(st.just(1), st.integers(-(2**63), 2**63), st.text(max_size=3)),
)
@settings(max_examples=300)
def test_well_framed_tokens_with_wrong_fields_give_token_error(body, signature, version):
    wire = msgpack.packb(["swarmgrad-token", version, msgpack.packb(body), signature])
    with pytest.raises(TokenError):
        AccessToken.decode(wire)


@given(st.text(max_size=300))
@settings(max_examples=200)
def test_malformed_token_text_gives_token_error(text):
    with pytest.raises(TokenError):
        AccessToken.from_text("sgt1." + text if not text.startswith("sgt1.") else text)


def test_token_errors_name_the_problem():
    with pytest.raises(TokenError, match="not valid msgpack"):
        AccessToken.decode(b"\xc1")
    with pytest.raises(TokenError, match="4 fields"):
        AccessToken.decode(msgpack.packb([1, 2]))
    with pytest.raises(TokenError, match="exceeds"):
        AccessToken.decode(b"\0" * 5000)
    with pytest.raises(TokenError, match="must be bytes"):
        AccessToken.decode("text")  # type: ignore[arg-type]
    token = AUTHORITY.issue(PEER, issued_at=NOW)
    body = msgpack.unpackb(token.body)
    body["role"] = "admin"
    wire = msgpack.packb(["swarmgrad-token", 1, msgpack.packb(body), token.signature])
    with pytest.raises(TokenError, match="unknown role 'admin'"):
        AccessToken.decode(wire)


# ------------------------------------------------------------------------ checking


def test_a_valid_token_admits_its_peer():
    token = AUTHORITY.issue(PEER, "monitor", "1d", issued_at=NOW)
    assert admission().check(token.encode(), PEER) == token


def test_no_token_is_refused():
    assert refusal(admission(), None) == RefusalReason.NO_TOKEN.value
    assert refusal(admission(), b"") == RefusalReason.NO_TOKEN.value


def test_expired_token_is_refused_naming_the_time():
    token = AUTHORITY.issue(PEER, lifetime="1h", issued_at=NOW - 7200)
    with pytest.raises(AdmissionRefused, match="expired at 2023-11-14") as info:
        admission().check(token.encode(), PEER)
    assert info.value.reason == RefusalReason.EXPIRED.value


def test_clock_slack_tolerates_small_disagreements():
    token = AUTHORITY.issue(PEER, lifetime="1h", issued_at=NOW - 3600 - 10)
    assert admission(clock_slack=30).check(token.encode(), PEER)
    assert refusal(admission(clock_slack=5), token.encode()) == RefusalReason.EXPIRED.value
    future = AUTHORITY.issue(PEER, lifetime="1h", issued_at=NOW + 600)
    assert refusal(admission(), future.encode()) == RefusalReason.NOT_YET_VALID.value


def test_token_of_another_peer_is_refused():
    token = AUTHORITY.issue(OTHER_PEER, issued_at=NOW)
    with pytest.raises(AdmissionRefused, match=f"issued for {OTHER_PEER}") as info:
        admission().check(token.encode(), PEER)
    assert info.value.reason == RefusalReason.WRONG_PEER.value


def test_token_of_another_authority_is_refused():
    token = OTHER_AUTHORITY.issue(PEER, issued_at=NOW)
    with pytest.raises(AdmissionRefused, match=str(OTHER_AUTHORITY.public_key)) as info:
        admission().check(token.encode(), PEER)
    assert info.value.reason == RefusalReason.WRONG_AUTHORITY.value


def test_forged_signature_is_refused():
    token = AUTHORITY.issue(PEER, "monitor", issued_at=NOW)
    body = msgpack.unpackb(token.body)
    body["role"] = "trainer"  # promote ourselves, keep the old signature
    forged = msgpack.packb(["swarmgrad-token", 1, msgpack.packb(body), token.signature])
    assert refusal(admission(), forged) == RefusalReason.BAD_SIGNATURE.value
    # a token signed by another key that claims our authority as issuer
    body = msgpack.unpackb(token.body)
    signed = OTHER_AUTHORITY.identity.sign(b"swarmgrad-access-token-v1|" + token.body)
    impostor = msgpack.packb(["swarmgrad-token", 1, msgpack.packb(body), signed])
    assert refusal(admission(), impostor) == RefusalReason.BAD_SIGNATURE.value


def test_revoked_peer_and_revoked_token_are_refused():
    token = AUTHORITY.issue(PEER, issued_at=NOW)
    other = AUTHORITY.issue(PEER, issued_at=NOW)
    policy = admission()
    assert policy.apply_revocations(
        AUTHORITY.revocation_list(token_ids=[token.token_id], serial=1, issued_at=NOW)
    )
    assert refusal(policy, token.encode()) == RefusalReason.REVOKED.value
    assert policy.check(other.encode(), PEER)  # another token of the same peer still works
    assert policy.apply_revocations(
        AUTHORITY.revocation_list(peers=[PEER], serial=2, issued_at=NOW).encode()
    )
    assert refusal(policy, other.encode()) == RefusalReason.REVOKED.value


def test_older_revocation_lists_do_not_replace_newer_ones():
    policy = admission()
    assert policy.apply_revocations(AUTHORITY.revocation_list(peers=[PEER], serial=5))
    assert not policy.apply_revocations(AUTHORITY.revocation_list(serial=4))
    assert PEER in policy.revocations.peers


def test_revocation_lists_of_others_or_forged_are_refused():
    policy = admission()
    with pytest.raises(TokenError, match="not by this swarm's authority"):
        policy.apply_revocations(OTHER_AUTHORITY.revocation_list(serial=1))
    genuine = AUTHORITY.revocation_list(peers=[PEER], serial=1)
    body = msgpack.unpackb(genuine.body)
    body["peers"] = []
    forged = msgpack.packb(["swarmgrad-revocations", 1, msgpack.packb(body), genuine.signature])
    with pytest.raises(TokenError, match="forged"):
        policy.apply_revocations(forged)
    assert policy.revocations is None


@given(st.binary(max_size=1024))
@settings(max_examples=200)
def test_malformed_revocation_lists_give_token_error(data):
    try:
        RevocationList.decode(data)
    except TokenError:
        pass


def test_role_rules():
    policy = admission()
    assert all(policy.allows(Role.TRAINER, n) for n in ("dht.store", "moe.forward", "x"))
    assert policy.allows(Role.SERVER, "dht.store") and policy.allows(Role.SERVER, "relay.connect")
    assert not policy.allows(Role.SERVER, "averaging.join_group")
    assert not policy.allows(Role.SERVER, "moe.forward")
    assert policy.allows(Role.MONITOR, "dht.find") and policy.allows(Role.MONITOR, "dht.ping")
    for name in ("dht.store", "averaging.aggregate_part", "moe.forward", "moe.info", "echo"):
        assert not policy.allows(Role.MONITOR, name)
    assert not policy.allows(None, "dht.find")


# ------------------------------------------------------------------------ own token


def test_bind_refuses_an_own_token_that_cannot_work():
    with pytest.raises(AdmissionRefused, match=r"does not admit it.*issued for"):
        admission(AUTHORITY.issue(OTHER_PEER, issued_at=NOW)).bind(PEER)
    with pytest.raises(AdmissionRefused, match="expired"):
        admission(AUTHORITY.issue(PEER, lifetime=60, issued_at=NOW - 3600)).bind(PEER)
    admission(AUTHORITY.issue(PEER, issued_at=NOW)).bind(PEER)
    admission(None).bind(PEER)  # allowed (with a warning): it will be refused by everyone


def test_token_file_is_reread_to_renew(tmp_path):
    clock = Clock()
    path = tmp_path / "peer.token"
    AUTHORITY.issue(PEER, lifetime=1000, issued_at=NOW).save(path)
    policy = admission(str(path), clock=clock)
    policy.bind(PEER)
    first = policy.token
    assert not policy.needs_renewal()
    clock.now = NOW + 800  # in the last quarter of its lifetime
    assert policy.needs_renewal()
    assert not asyncio.run(policy.renew())  # same file, nothing new
    AUTHORITY.issue(PEER, lifetime=1000, issued_at=NOW + 790).save(path)
    assert asyncio.run(policy.renew())
    assert policy.token != first and policy.token.expires_at == NOW + 1790
    assert not policy.needs_renewal()


def test_renewal_refuses_unusable_tokens_and_keeps_the_old_one(tmp_path):
    clock = Clock()
    path = tmp_path / "peer.token"
    AUTHORITY.issue(PEER, lifetime=1000, issued_at=NOW).save(path)
    policy = admission(str(path), clock=clock)
    policy.bind(PEER)
    held = policy.token
    clock.now = NOW + 900
    AUTHORITY.issue(OTHER_PEER, lifetime=1000, issued_at=NOW + 890).save(path)
    assert not asyncio.run(policy.renew())
    path.write_text("garbage")
    assert not asyncio.run(policy.renew())
    assert policy.token == held


def test_callback_renews_sync_or_async():
    clock = Clock()
    issued = []

    def fetch():
        issued.append(AUTHORITY.issue(PEER, lifetime=100, issued_at=clock.now))
        return issued[-1].to_text()

    policy = admission(fetch, clock=clock)
    policy.bind(PEER)  # a sync callback gives the first token
    assert policy.token == issued[0]
    clock.now += 90
    assert asyncio.run(policy.renew()) and policy.token == issued[1]

    async def fetch_async():
        return AUTHORITY.issue(PEER, lifetime=100, issued_at=clock.now).encode()

    policy = admission(fetch_async, clock=clock)
    with pytest.raises(ValidationError, match="async token callback cannot give the first"):
        policy.bind(PEER)


# ------------------------------------------------------------------------ keys and CLI


def test_authority_key_forms(tmp_path):
    AUTHORITY.save(tmp_path / "authority.key")
    (tmp_path / "authority.pub").write_text(f"{AUTHORITY.public_key}\n")
    for spec in (
        AUTHORITY.public_key,
        str(AUTHORITY.public_key),
        str(tmp_path / "authority.pub"),
        tmp_path / "authority.key",
        AUTHORITY,
    ):
        assert load_authority_key(spec) == AUTHORITY.public_key
    (tmp_path / "junk").write_bytes(b"\xff\xfe")
    with pytest.raises(TokenError, match="neither an authority public key"):
        load_authority_key(tmp_path / "junk")
    with pytest.raises(TokenError, match="neither an existing file nor a public key"):
        load_authority_key("no-such-file")


def test_cli_init_issue_whoami_revoke(tmp_path, capsys):
    key = tmp_path / "authority.key"
    assert cli_main(["authority", "init", "--key", str(key)]) == 0
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    public = (tmp_path / "authority.pub").read_text().strip()
    assert public in capsys.readouterr().out
    assert cli_main(["authority", "init", "--key", str(key)]) == 1  # no silent overwrite

    identity = tmp_path / "me.id"
    assert cli_main(["authority", "whoami", "--identity-path", str(identity)]) == 0
    peer_id = capsys.readouterr().out.strip()
    assert peer_id == str(Identity.load(identity).peer_id)

    out = tmp_path / "me.token"
    argv = ["authority", "issue", "--key", str(key), "--peer-id", peer_id, "--role", "server"]
    assert cli_main([*argv, "--expires", "12h", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    token = AccessToken.load(out)
    assert AccessToken.from_text(printed) == token
    assert (str(token.peer_id), token.role) == (peer_id, Role.SERVER)
    assert token.expires_at - token.issued_at == 12 * 3600
    assert Admission(tmp_path / "authority.pub", str(out)).check(token.encode(), token.peer_id)
    assert cli_main([*argv[:-2], "--peer-id", "nonsense"]) == 2

    listed = tmp_path / "list.bin"
    revoke = ["authority", "revoke", "--key", str(key), "--output", str(listed)]
    assert cli_main([*revoke, "--token", str(out)]) == 0
    assert cli_main([*revoke, "--peer-id", peer_id]) == 0
    revocations = RevocationList.decode(listed.read_bytes())
    assert revocations.serial == 2
    assert revocations.revokes(token) and token.token_id in revocations.token_ids
    assert "Not published" in capsys.readouterr().out
