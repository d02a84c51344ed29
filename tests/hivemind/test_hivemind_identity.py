"""hivemind identities and RSA keys: `swarmgrad identity import` of hivemind's RSA identity
files (stable PeerID, signed alias, bad files refused with nothing written), the
RSAPrivateKey surface, and RSASignatureValidator(private_key=...)-owned records."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from swarmgrad.cli.main import main
from swarmgrad.dht.crypto import RSASignatureValidator, owner_marker
from swarmgrad.dht.validation import DHTRecord, serialize
from swarmgrad.net.hivemind_identity import (
    ALIAS_SUFFIX,
    identity_for_rsa_key,
    read_alias,
    rsa_peer_id,
    verify_alias,
)
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import IdentityFileError, ValidationError
from swarmgrad.utils.rsa import RSAPrivateKey, RSAPublicKey


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _libp2p_private_key(key_type: int, data: bytes) -> bytes:
    """libp2p's ``PrivateKey { required KeyType Type = 1; required bytes Data = 2; }``, as
    hivemind's ``P2P.generate_identity`` writes it."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


@pytest.fixture(scope="module")
def rsa_key():
    return RSAPrivateKey()


@pytest.fixture
def hivemind_file(tmp_path, rsa_key):
    path = tmp_path / "hivemind.id"
    path.write_bytes(_libp2p_private_key(0, rsa_key.to_bytes()))
    return path


def test_import_makes_a_stable_identity_and_a_verifiable_alias(
    tmp_path, hivemind_file, rsa_key, capsys
):
    first, second = tmp_path / "a" / "me.id", tmp_path / "me2.id"
    first.parent.mkdir()
    assert main(["identity", "import", str(hivemind_file), str(first)]) == 0
    assert main(["identity", "import", str(hivemind_file), str(second)]) == 0
    identity = Identity.load(first)
    assert (
        identity.peer_id == Identity.load(second).peer_id == identity_for_rsa_key(rsa_key).peer_id
    )
    assert (first.stat().st_mode & 0o777) == 0o600
    out = capsys.readouterr().out
    assert str(identity.peer_id) in out

    alias = read_alias(f"{first}{ALIAS_SUFFIX}")
    old, new = verify_alias(alias)
    assert new == identity.peer_id
    assert old == rsa_peer_id(rsa_key.get_public_key()) and str(old).startswith("Qm")
    assert str(old) in out

    assert main(["identity", "show", str(first)]) == 0
    assert capsys.readouterr().out.strip() == str(identity.peer_id)
    # importing again over the same identity is fine; over another one needs --force
    assert main(["identity", "import", str(hivemind_file), str(first)]) == 0
    other = tmp_path / "other.id"
    Identity.generate().save(other)
    assert main(["identity", "import", str(hivemind_file), str(other)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["identity", "import", "--force", str(hivemind_file), str(other)]) == 0
    assert Identity.load(other).peer_id == identity.peer_id


def test_a_tampered_alias_does_not_verify(tmp_path, hivemind_file):
    destination = tmp_path / "me.id"
    assert main(["identity", "import", str(hivemind_file), str(destination)]) == 0
    alias = read_alias(f"{destination}{ALIAS_SUFFIX}")
    stranger = str(Identity.generate().peer_id)
    with pytest.raises(ValidationError, match="signature of"):
        verify_alias(dataclasses.replace(alias, peer_id=stranger))
    other_key = RSAPrivateKey()
    with pytest.raises(ValidationError, match="not the key of"):
        verify_alias(
            dataclasses.replace(
                alias, hivemind_peer_id=str(rsa_peer_id(other_key.get_public_key()))
            )
        )
    with pytest.raises(ValidationError, match="malformed"):
        verify_alias(dataclasses.replace(alias, rsa_signature="***"))


def test_an_ed25519_libp2p_file_is_imported_as_it_is(tmp_path, capsys):
    source = tmp_path / "libp2p.id"
    identity = Identity.generate()
    source.write_bytes(identity.to_protobuf())
    destination = tmp_path / "me.id"
    assert main(["identity", "import", str(source), str(destination)]) == 0
    assert Identity.load(destination).peer_id == identity.peer_id
    assert not (tmp_path / f"me.id{ALIAS_SUFFIX}").exists()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (b"certainly not a key", "not a libp2p private key"),
        ("truncated", "not a libp2p private key"),
        (_libp2p_private_key(2, b"\x01" * 32), "Secp256k1"),
        (_libp2p_private_key(3, b"\x01" * 64), "ECDSA"),
        (_libp2p_private_key(0, b"\x30\x03\x02\x01\x00"), "RSA key data that does not load"),
        (_libp2p_private_key(1, b"\x01" * 17), "Ed25519 key data"),
    ],
)
def test_a_corrupted_or_wrong_type_file_is_refused_and_nothing_is_written(
    tmp_path, rsa_key, capsys, content, reason
):
    if content == "truncated":
        content = _libp2p_private_key(0, rsa_key.to_bytes())[:-40]
    source = tmp_path / "bad.id"
    source.write_bytes(content)
    destination = tmp_path / "out" / "me.id"
    destination.parent.mkdir()
    assert main(["identity", "import", str(source), str(destination)]) == 1
    err = capsys.readouterr().err
    assert reason in err and "bad.id" in err, err
    assert list(destination.parent.iterdir()) == [], "nothing may be written"


def test_missing_source_is_a_clear_error(tmp_path, capsys):
    assert main(["identity", "import", str(tmp_path / "nope.id"), str(tmp_path / "me.id")]) == 1
    assert "nope.id" in capsys.readouterr().err
    assert not (tmp_path / "me.id").exists()


def test_loading_a_hivemind_file_directly_points_to_the_import(hivemind_file):
    with pytest.raises(IdentityFileError, match="swarmgrad identity import"):
        Identity.load(hivemind_file)


def test_rsa_private_key_signs_serializes_and_pickles(rsa_key):
    public = rsa_key.get_public_key()
    signature = rsa_key.sign(b"data")
    assert public.verify(b"data", signature)
    assert not public.verify(b"other", signature)
    assert not public.verify(b"data", b"not base64!")
    assert public.to_bytes().startswith(b"ssh-rsa ")
    assert RSAPublicKey.from_bytes(public.to_bytes()).verify(b"data", signature)
    restored = RSAPrivateKey.from_bytes(rsa_key.to_bytes())
    assert restored.get_public_key().to_bytes() == public.to_bytes()
    unpickled = pickle.loads(pickle.dumps(rsa_key))
    assert unpickled.ed25519_seed() == rsa_key.ed25519_seed()
    assert RSAPrivateKey.process_wide() is RSAPrivateKey.process_wide()
    with pytest.raises(ValidationError, match="DER"):
        RSAPrivateKey.from_bytes(b"garbage")
    with pytest.raises(ValueError, match="RSA"):
        RSAPublicKey.from_bytes(
            Identity.generate().private_key.public_key().public_bytes(*_openssh())
        )


def _openssh():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH


def test_rsa_signature_validator_with_a_private_key_owns_records_across_processes(rsa_key):
    writer = RSASignatureValidator(private_key=rsa_key)
    # another process that received the key (pickled) owns the same records
    reader = RSASignatureValidator(pickle.loads(pickle.dumps(rsa_key)))
    assert writer.local_public_key == reader.local_public_key
    identity = identity_for_rsa_key(rsa_key)
    assert writer.local_public_key == owner_marker(identity.public_key_bytes)

    record = DHTRecord(serialize("metrics"), serialize(writer.local_public_key), serialize(1), 1e9)
    signed = dataclasses.replace(record, value=reader.sign_value(record))
    assert writer.validate(signed) and RSASignatureValidator().validate(signed)
    forged = dataclasses.replace(
        record, value=RSASignatureValidator(private_key=RSAPrivateKey()).sign_value(record)
    )
    assert not writer.validate(forged)  # a different RSA key cannot sign for it
