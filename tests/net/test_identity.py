import logging
import os
import pickle
import stat
import sys
import threading

import base58
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.net.identity import Identity, PeerID, verify_signature
from swarmgrad.utils.errors import IdentityFileError, ValidationError

# Test vector of the libp2p peer-ids spec: an ed25519 PrivateKey and PublicKey message.
SPEC_PRIVATE_KEY = bytes.fromhex(
    "080112407e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d"
    "1ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
SPEC_PUBLIC_KEY = bytes.fromhex(
    "080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
# Its PeerID: base58btc of 0x00 0x24 + SPEC_PUBLIC_KEY (also used as a vector elsewhere).
SPEC_PEER_ID = "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"
# Secp256k1 private key of the same spec.
SPEC_SECP256K1_PRIVATE_KEY = bytes.fromhex(
    "0802122053DADF1D5A164D6B4ACDB15E24AA4C5B1D3461BDBD42ABEDB0A4404D56CED8FB"
)
# A sha2-256 PeerID (an RSA peer), the example of the spec.
RSA_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

seeds = st.binary(min_size=32, max_size=32)
public_keys = st.binary(min_size=32, max_size=32)


# --- PeerID ---------------------------------------------------------------------------


def test_spec_vector_gives_the_expected_peer_id_and_public_key():
    identity = Identity.from_protobuf(SPEC_PRIVATE_KEY)
    assert identity.to_protobuf() == SPEC_PRIVATE_KEY
    assert identity.public_key_bytes == SPEC_PUBLIC_KEY[4:]
    assert str(identity.peer_id) == SPEC_PEER_ID
    assert identity.peer_id.to_bytes() == b"\x00\x24" + SPEC_PUBLIC_KEY
    assert PeerID.from_base58(SPEC_PEER_ID).public_key_bytes() == SPEC_PUBLIC_KEY[4:]


@given(seeds)
def test_ed25519_peer_id_layout_from_any_seed(seed):
    identity = Identity.from_seed(seed)
    raw = identity.peer_id.to_bytes()
    assert raw == b"\x00\x24\x08\x01\x12\x20" + identity.public_key_bytes
    text = identity.peer_id.to_base58()
    assert text.startswith("12D3KooW")
    assert len(text) == 52


@given(public_keys)
def test_peer_id_round_trips_through_bytes_base58_and_key(key):
    peer_id = PeerID.from_public_key(key)
    assert PeerID(peer_id.to_bytes()) == peer_id
    assert PeerID.from_base58(peer_id.to_base58()) == peer_id
    assert PeerID.from_base58(str(peer_id)) == peer_id
    assert peer_id.public_key_bytes() == key
    assert pickle.loads(pickle.dumps(peer_id)) == peer_id


@given(st.binary(min_size=32, max_size=32))
def test_sha256_peer_ids_round_trip_but_hold_no_key(digest):
    peer_id = PeerID(b"\x12\x20" + digest)
    assert str(peer_id).startswith("Qm")
    assert PeerID.from_base58(str(peer_id)) == peer_id
    with pytest.raises(ValidationError, match="sha2-256"):
        peer_id.public_key_bytes()
    assert not peer_id.verify(b"\x00" * 64, b"data")


@given(public_keys, public_keys)
def test_peer_ids_are_ordered_and_hashed_like_their_bytes(a, b):
    pa, pb = PeerID.from_public_key(a), PeerID.from_public_key(b)
    assert (pa < pb) == (pa.to_bytes() < pb.to_bytes())
    assert (pa == pb) == (a == b)
    if a == b:
        assert hash(pa) == hash(pb)
    assert sorted([pb, pa]) == sorted([pa, pb])


def test_peer_id_is_frozen_and_has_a_short_repr():
    peer_id = PeerID.from_base58(SPEC_PEER_ID)
    with pytest.raises(AttributeError):
        peer_id._bytes = b""
    assert len(repr(peer_id)) < 40
    assert repr(peer_id).startswith("<PeerID 12D3KooW")
    assert peer_id != SPEC_PEER_ID  # no silent equality with strings
    assert {peer_id: 1}[PeerID.from_base58(SPEC_PEER_ID)] == 1


def test_rsa_peer_id_parses_and_explains_missing_key():
    peer_id = PeerID.from_base58(RSA_PEER_ID)
    assert str(peer_id) == RSA_PEER_ID
    with pytest.raises(ValidationError, match="cannot be recovered"):
        peer_id.public_key_bytes()


def test_identity_multihash_of_another_key_type_is_reported():
    secp_public = b"\x08\x02\x12\x21" + b"\x02" + bytes(32)
    peer_id = PeerID(b"\x00" + bytes([len(secp_public)]) + secp_public)
    with pytest.raises(ValidationError, match="Secp256k1"):
        peer_id.public_key_bytes()


@pytest.mark.parametrize(
    "text",
    ["", "0OIl", "12D3KooW", " " + SPEC_PEER_ID, SPEC_PEER_ID + "\n", "é", "1" * 500, "abc"],
)
def test_malformed_base58_is_a_validation_error_naming_the_input(text):
    with pytest.raises(ValidationError) as info:
        PeerID.from_base58(text)
    assert repr(text)[:20] in str(info.value)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\x00", b"\x00\x05abc", b"\x12\x10" + bytes(16), b"\x13\x20" + bytes(32), b"\xff"],
)
def test_malformed_bytes_are_a_validation_error(raw):
    with pytest.raises(ValidationError, match="PeerID"):
        PeerID(raw)


def test_non_bytes_input_is_a_validation_error():
    with pytest.raises(ValidationError):
        PeerID("12D3KooW")
    with pytest.raises(ValidationError):
        PeerID.from_base58(b"12D3")
    with pytest.raises(ValidationError):
        PeerID.from_public_key(bytes(31))


@given(st.binary(max_size=64))
def test_arbitrary_bytes_either_parse_or_raise_validation_error(raw):
    try:
        peer_id = PeerID(raw)
    except ValidationError:
        return
    assert PeerID.from_base58(str(peer_id)) == peer_id


@given(st.text(max_size=80))
def test_arbitrary_text_either_parses_or_raises_validation_error(text):
    try:
        peer_id = PeerID.from_base58(text)
    except ValidationError:
        return
    assert str(peer_id) == text


# --- signatures -----------------------------------------------------------------------


@given(seeds, st.binary(max_size=256))
def test_signatures_verify_only_for_the_signed_data_and_signer(seed, data):
    identity = Identity.from_seed(seed)
    signature = identity.sign(data)
    assert identity.peer_id.verify(signature, data)
    assert verify_signature(identity.public_key_bytes, signature, data)
    assert not identity.peer_id.verify(signature, data + b"x")
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not identity.peer_id.verify(tampered, data)
    other = Identity.from_seed(bytes(b ^ 0xFF for b in seed))
    assert not other.peer_id.verify(signature, data)


def test_verify_signature_rejects_malformed_inputs_without_raising():
    identity = Identity.generate()
    signature = identity.sign(b"data")
    assert not verify_signature(b"short", signature, b"data")
    assert not verify_signature(identity.public_key_bytes, signature[:10], b"data")
    assert not verify_signature(b"\xff" * 32, signature, b"data")


def test_a_key_of_small_order_signs_nothing():
    """The neutral point as a public key, with R = neutral point and S = 0, passes the
    plain ed25519 equation for every message (OpenSSL, through cryptography, accepts it):
    a PeerID made from such a key could be impersonated by anyone. Ours refuses it."""
    neutral = bytes([1]) + bytes(31)
    signature = neutral + bytes(32)
    for message in (b"", b"any message", os.urandom(64)):
        assert not verify_signature(neutral, signature, message)
        assert not PeerID.from_public_key(neutral).verify(signature, message)


# --- identity files -------------------------------------------------------------------


def test_save_writes_libp2p_format_with_mode_0600_and_load_round_trips(tmp_path):
    identity = Identity.generate()
    path = tmp_path / "id.key"
    identity.save(path)
    data = path.read_bytes()
    assert data[:4] == b"\x08\x01\x12\x40"
    assert data[4:] == identity._seed() + identity.public_key_bytes
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).peer_id == identity.peer_id
    assert [p.name for p in tmp_path.iterdir()] == ["id.key"]  # no temporary file left


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "id.key"
    Identity.generate().save(path)
    second = Identity.generate()
    second.save(path)
    assert Identity.load(path).peer_id == second.peer_id


def test_load_accepts_seed_only_and_legacy_96_byte_keys(tmp_path):
    identity = Identity.from_protobuf(SPEC_PRIVATE_KEY)
    seed, public = identity._seed(), identity.public_key_bytes
    for data in (seed, seed + public + public):
        path = tmp_path / f"key{len(data)}"
        path.write_bytes(b"\x08\x01\x12" + bytes([len(data)]) + data)
        assert str(Identity.load(path).peer_id) == SPEC_PEER_ID


def test_load_or_create_creates_once_then_loads(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert path.exists()
    assert Identity.load_or_create(path).peer_id == first.peer_id


def test_load_or_create_racing_threads_agree_on_one_identity(tmp_path):
    path = tmp_path / "identity.key"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(Identity.load_or_create(path).peer_id))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    assert Identity.load(path).peer_id == results[0]
    assert [p.name for p in tmp_path.iterdir()] == ["identity.key"]


def test_missing_file_is_an_identity_file_error(tmp_path):
    with pytest.raises(IdentityFileError, match="does not exist"):
        Identity.load(tmp_path / "nope")


def test_directory_instead_of_file_is_an_identity_file_error(tmp_path):
    with pytest.raises(IdentityFileError, match="cannot read"):
        Identity.load(tmp_path)


def test_unreadable_file_is_an_identity_file_error(tmp_path):
    # A directory cannot be read as a file, even by root (file modes would not stop root).
    path = tmp_path / "id.key"
    path.mkdir()
    with pytest.raises(IdentityFileError, match="cannot read identity file"):
        Identity.load(path)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (SPEC_PRIVATE_KEY[:20], "truncated or garbage"),
        (b"\x08\x01", "key data field is missing"),
        (b"\x12\x01a", "key type field is missing"),
        (b"\xff\xff\xff", "truncated or garbage"),
        (b"hello world, not a key", "truncated or garbage"),
        (b"\x08\x01\x12\x05abcde", "5 bytes of Ed25519 key data"),
    ],
)
def test_garbage_files_are_identity_file_errors(tmp_path, data, match):
    path = tmp_path / "id.key"
    path.write_bytes(data)
    with pytest.raises(IdentityFileError, match=match) as info:
        Identity.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("key_type", "name"), [(0, "RSA"), (2, "Secp256k1"), (3, "ECDSA")])
def test_keys_of_other_types_name_their_type(tmp_path, key_type, name):
    path = tmp_path / "id.key"
    path.write_bytes(b"\x08" + bytes([key_type]) + b"\x12\x04abcd")
    with pytest.raises(IdentityFileError, match=f"holds a {name} private key.*needs an Ed25519"):
        Identity.load(path)


def test_spec_secp256k1_key_is_refused_by_name(tmp_path):
    path = tmp_path / "id.key"
    path.write_bytes(SPEC_SECP256K1_PRIVATE_KEY)
    with pytest.raises(IdentityFileError, match="Secp256k1"):
        Identity.load(path)


def test_public_half_not_matching_the_seed_is_refused(tmp_path):
    a, b = Identity.generate(), Identity.generate()
    path = tmp_path / "id.key"
    path.write_bytes(b"\x08\x01\x12\x40" + a._seed() + b.public_key_bytes)
    with pytest.raises(IdentityFileError, match="does not match"):
        Identity.load(path)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_loading_a_group_readable_file_warns(tmp_path, caplog):
    path = tmp_path / "id.key"
    Identity.generate().save(path)
    with caplog.at_level(logging.WARNING, logger="swarmgrad.net.identity"):
        Identity.load(path)
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="swarmgrad.net.identity"):
        Identity.load(path)
    assert "chmod 600" in caplog.text


def test_identity_repr_hides_the_key_and_pickles():
    identity = Identity.generate()
    assert identity._seed().hex() not in repr(identity)
    assert str(identity.peer_id)[:8] in repr(identity)
    assert pickle.loads(pickle.dumps(identity)).peer_id == identity.peer_id


def test_from_seed_is_deterministic_and_validates_length():
    assert Identity.from_seed(bytes(32)).peer_id == Identity.from_seed(bytes(32)).peer_id
    with pytest.raises(ValidationError):
        Identity.from_seed(bytes(31))
    with pytest.raises(ValidationError):
        Identity("not a key")


def test_base58_alphabet_is_bitcoins():
    assert base58.b58encode(b"\x00\x01") == b"12"
