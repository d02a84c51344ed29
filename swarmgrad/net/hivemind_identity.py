"""Moving a hivemind identity file to swarmgrad (``swarmgrad identity import``).

hivemind writes ``identity_path`` as libp2p's ``PrivateKey`` protobuf holding an RSA-2048
key (PKCS#1 DER); its PeerID is the sha2-256 multihash of the RSA public key (``Qm...``).
swarmgrad peers authenticate with ed25519 keys only (the TLS handshake proves an ed25519
key; see :mod:`swarmgrad.net.identity`), so an RSA key cannot be used as it is.

**What the import does.** The new identity is the ed25519 key *derived* from the RSA key
(:meth:`swarmgrad.utils.rsa.RSAPrivateKey.ed25519_seed`): importing the same hivemind
file again, on any machine, gives the same swarmgrad PeerID, and records the program
signs with ``RSASignatureValidator(private_key=<that RSA key>)`` are owned by that same
ed25519 key. So a peer keeps one stable identity through the move, although the key type
(and with it the PeerID's spelling) changes.

**The alias.** Next to the new identity file the import writes
``<identity>.hivemind-alias.json``: the old PeerID, the new one, the RSA public key and
two signatures over ``b"swarmgrad/identity-alias/v1\\0" + old_id + new_id``, one by the
RSA key and one by the new ed25519 key. :func:`verify_alias` checks it, so anyone who
knew the peer by its hivemind PeerID (an allow-list, a leaderboard, a monitor's history)
can confirm that the swarmgrad PeerID is the same peer, and nobody else can claim it.

A libp2p ed25519 identity file is already swarmgrad's format; it is imported as is (same
PeerID, no alias). Anything else (garbage, a truncated file, another key type) is refused
with an error naming the file and what was wrong, and nothing is written.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from swarmgrad.net.identity import (
    Identity,
    PeerID,
    _decode_key_message,
    _encode_key_message,
    _key_type_name,
    _remove_quietly,
    _write_private_temp,
    verify_signature,
)
from swarmgrad.utils.errors import IdentityFileError, ValidationError
from swarmgrad.utils.rsa import RSAPrivateKey, RSAPublicKey

__all__ = [
    "IdentityAlias",
    "identity_for_rsa_key",
    "import_hivemind_identity",
    "read_alias",
    "rsa_peer_id",
    "verify_alias",
]

_RSA, _ED25519 = 0, 1
_ALIAS_DOMAIN = b"swarmgrad/identity-alias/v1\x00"
ALIAS_SUFFIX = ".hivemind-alias.json"
_MAX_IDENTITY_FILE = 64 * 1024


def rsa_peer_id(public_key: RSAPublicKey) -> PeerID:
    """hivemind's (libp2p's) PeerID of an RSA public key: sha2-256 multihash of the
    ``PublicKey{Type: RSA, Data: SubjectPublicKeyInfo DER}`` message."""
    digest = hashlib.sha256(_encode_key_message(_RSA, public_key.to_der())).digest()
    return PeerID(bytes([0x12, 0x20]) + digest)


def identity_for_rsa_key(key: RSAPrivateKey) -> Identity:
    """The swarmgrad identity that stands for ``key`` (the same one every time)."""
    return Identity.from_seed(key.ed25519_seed())


@dataclass(frozen=True)
class IdentityAlias:
    """A signed statement that ``peer_id`` is the peer hivemind knew as
    ``hivemind_peer_id`` (strings and base64 fields, as stored in the JSON file)."""

    hivemind_peer_id: str
    peer_id: str
    rsa_public_key: str  # base64 SubjectPublicKeyInfo DER
    rsa_signature: str  # base64 of the base64 RSA-PSS signature hivemind's keys make
    ed25519_signature: str  # base64

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def _alias_payload(old: PeerID, new: PeerID) -> bytes:
    return _ALIAS_DOMAIN + old.to_bytes() + new.to_bytes()


def make_alias(key: RSAPrivateKey, identity: Identity) -> IdentityAlias:
    old = rsa_peer_id(key.get_public_key())
    payload = _alias_payload(old, identity.peer_id)
    return IdentityAlias(
        hivemind_peer_id=str(old),
        peer_id=str(identity.peer_id),
        rsa_public_key=base64.b64encode(key.get_public_key().to_der()).decode(),
        rsa_signature=base64.b64encode(key.sign(payload)).decode(),
        ed25519_signature=base64.b64encode(identity.sign(payload)).decode(),
    )


def verify_alias(alias: IdentityAlias) -> tuple[PeerID, PeerID]:
    """``(hivemind_peer_id, peer_id)`` if both signatures hold; ValidationError saying
    what does not."""
    try:
        old = PeerID.from_base58(alias.hivemind_peer_id)
        new = PeerID.from_base58(alias.peer_id)
        public_key = RSAPublicKey.from_der(base64.b64decode(alias.rsa_public_key, validate=True))
        rsa_signature = base64.b64decode(alias.rsa_signature, validate=True)
        ed_signature = base64.b64decode(alias.ed25519_signature, validate=True)
    except (ValueError, TypeError) as e:
        raise ValidationError(f"malformed identity alias: {e}") from None
    if rsa_peer_id(public_key) != old:
        raise ValidationError(f"the alias's RSA key is not the key of {old}")
    payload = _alias_payload(old, new)
    if not public_key.verify(payload, rsa_signature):
        raise ValidationError(f"the RSA signature of {old} over the alias does not verify")
    if not verify_signature(new.public_key_bytes(), ed_signature, payload):
        raise ValidationError(f"the ed25519 signature of {new} over the alias does not verify")
    return old, new


def read_alias(path: str | os.PathLike) -> IdentityAlias:
    try:
        fields = json.loads(Path(path).read_text())
        return IdentityAlias(**fields)
    except (OSError, ValueError, TypeError) as e:
        raise ValidationError(f"cannot read identity alias {path}: {e}") from None


def _read_key(source: Path) -> RSAPrivateKey | Identity:
    try:
        data = source.read_bytes()[: _MAX_IDENTITY_FILE + 1]
    except OSError as e:
        raise IdentityFileError(f"cannot read identity file {source}: {e}") from None
    if not data:
        raise IdentityFileError(f"identity file {source} is empty")
    if len(data) > _MAX_IDENTITY_FILE:
        raise IdentityFileError(f"{source} is too large to be an identity file")
    try:
        key_type, key_data = _decode_key_message(data)
    except ValueError as e:
        raise IdentityFileError(
            f"{source} is not a libp2p private key (truncated or garbage protobuf: {e})"
        ) from None
    if key_type == _ED25519:
        return Identity.from_protobuf(data, source=f"identity file {source}")
    if key_type != _RSA:
        raise IdentityFileError(
            f"{source} holds a {_key_type_name(key_type)} private key; `swarmgrad identity "
            f"import` takes hivemind's RSA identity files (or libp2p Ed25519 ones)"
        )
    try:
        return RSAPrivateKey.from_bytes(key_data)
    except ValidationError as e:
        raise IdentityFileError(f"{source} holds RSA key data that does not load: {e}") from None


def import_hivemind_identity(
    source: str | os.PathLike, destination: str | os.PathLike, *, force: bool = False
) -> tuple[Identity, IdentityAlias | None]:
    """Make the swarmgrad identity file ``destination`` from hivemind's ``source`` (see
    the module docstring); returns the identity and the alias (None for an ed25519 file).

    An existing ``destination`` holding another identity is refused unless ``force``.
    Everything is checked before anything is written."""
    source, destination = Path(source), Path(destination)
    key = _read_key(source)
    identity = key if isinstance(key, Identity) else identity_for_rsa_key(key)
    if destination.exists() and not force:
        try:
            existing = Identity.load(destination)
        except IdentityFileError as e:
            raise IdentityFileError(
                f"{destination} exists and is not a swarmgrad identity ({e}); pass --force "
                f"to replace it"
            ) from None
        if existing.peer_id != identity.peer_id:
            raise IdentityFileError(
                f"{destination} already holds another identity ({existing.peer_id}); pass "
                f"--force to replace it"
            )
    alias = None if isinstance(key, Identity) else make_alias(key, identity)
    alias_path = destination.with_name(destination.name + ALIAS_SUFFIX)
    alias_tmp = None
    if alias is not None:
        alias_tmp = _write_private_temp(alias_path, alias.to_json().encode(), "alias file")
    try:
        identity.save(destination)
        if alias_tmp is not None:
            os.replace(alias_tmp, alias_path)
            alias_tmp = None
    finally:
        if alias_tmp is not None:
            _remove_quietly(alias_tmp)
    return identity, alias
