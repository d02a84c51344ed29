"""Protected DHT records: keys and subkeys that only their owner may write.

hivemind protects records with RSA keys; swarmgrad uses the peer's ed25519 identity, with
the same public names and the same idea.

**Owner marker.** A key or subkey is *protected* when its serialized bytes contain an
owner marker::

    b"[owner:" + base64(public_key) + b"]"

``public_key`` is the raw 32-byte ed25519 public key, ``base64`` the standard alphabet
with padding (44 characters, canonical: the last character before ``=`` carries no stray
bits), 52 bytes in all. :attr:`Ed25519SignatureValidator.local_public_key` is the marker
of the local identity; put it anywhere in a key or subkey (``f"...{marker}"`` for a str
key, ``b"..." + marker`` for a bytes key) to make that record writable by this peer only.

**Signature.** The stored value of a protected record is the serialized value followed
by exactly one signature suffix (100 bytes)::

    value + b"[signature:" + base64(signature) + b"]"

where ``signature`` is the 64-byte ed25519 signature (88 base64 characters) of::

    b"swarmgrad/dht-record-signature/v1\\0"
    + u64be(len(key)) + key
    + u64be(len(subkey)) + subkey
    + u64be(len(value)) + value
    + f64be(expiration_time)

(``key`` and ``subkey`` as in the :class:`~swarmgrad.dht.validation.DHTRecord`, ``subkey``
being ``b""`` for a plain value; ``value`` without the suffix; the expiration as an IEEE
754 big-endian double.) The domain tag keeps these signatures apart from every other use
of the identity key, the length prefixes make the encoding unambiguous, and since the key,
the subkey and the expiration are covered, a signature cannot be moved to another key or
subkey or reused with another expiration time.

**What is refused.** For a record whose key or subkey contains ``[owner:``: a marker that
is not exactly the form above (bad or non-canonical base64, wrong length, missing ``]``),
markers naming more than one owner (the same owner's marker repeated is fine), a value
without a well-formed signature suffix, and a signature that does not verify with the
owner's key. Records without any ``[owner:`` are not protected and pass untouched,
whatever their value ends with: their value is never stripped either, so a plain value
that happens to end with signature-like bytes comes back to the reader exactly as written
(anyone may write an unprotected record anyway, so refusing such values would protect
nothing and would only make some values impossible to store).
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import struct
import threading

from swarmgrad.dht.validation import DHTRecord, RecordValidatorBase
from swarmgrad.net.identity import Identity, verify_signature
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.rsa import PrivateKey, PublicKey, RSAPrivateKey, RSAPublicKey

__all__ = [
    "Ed25519SignatureValidator",
    "PrivateKey",
    "PublicKey",
    "RSAPrivateKey",
    "RSAPublicKey",
    "RSASignatureValidator",
    "owner_marker",
    "record_signing_payload",
]

logger = logging.getLogger(__name__)

OWNER_MARKER_PREFIX = b"[owner:"
SIGNATURE_MARKER_PREFIX = b"[signature:"
_MARKER_END = b"]"
_PUBLIC_KEY_SIZE = 32
_SIGNATURE_SIZE = 64
_PUBLIC_KEY_B64_LENGTH = 44  # 4 * ceil(32 / 3)
_SIGNATURE_B64_LENGTH = 88  # 4 * ceil(64 / 3)
OWNER_MARKER_LENGTH = len(OWNER_MARKER_PREFIX) + _PUBLIC_KEY_B64_LENGTH + len(_MARKER_END)
SIGNATURE_SUFFIX_LENGTH = len(SIGNATURE_MARKER_PREFIX) + _SIGNATURE_B64_LENGTH + len(_MARKER_END)
SIGNATURE_DOMAIN = b"swarmgrad/dht-record-signature/v1\x00"


class _Malformed(Exception):
    """An owner marker or a signature suffix is not in the exact expected form."""


def owner_marker(public_key_bytes: bytes) -> bytes:
    """The owner marker of a raw 32-byte ed25519 public key."""
    if not isinstance(public_key_bytes, bytes) or len(public_key_bytes) != _PUBLIC_KEY_SIZE:
        raise ValidationError("an owner marker needs a raw 32-byte ed25519 public key")
    return OWNER_MARKER_PREFIX + base64.b64encode(public_key_bytes) + _MARKER_END


def record_signing_payload(record: DHTRecord) -> bytes:
    """The bytes an owner signs for ``record`` (whose value holds no signature suffix)."""
    expiration_time = float(record.expiration_time)  # TypeError / ValueError if not a number
    parts = [SIGNATURE_DOMAIN]
    for field in (record.key, record.subkey, record.value):
        field = bytes(field) if isinstance(field, bytearray | memoryview) else field
        if not isinstance(field, bytes):
            raise TypeError(f"record fields are bytes, got {type(field).__name__}")
        parts.append(struct.pack(">Q", len(field)))
        parts.append(field)
    parts.append(struct.pack(">d", expiration_time))
    return b"".join(parts)


def _decode_canonical_b64(text: bytes, size: int) -> bytes:
    """Decode standard padded base64 that must encode exactly ``size`` bytes, in the one
    canonical spelling (so a key or signature has a single textual form)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _Malformed("invalid base64") from None
    if len(raw) != size or base64.b64encode(raw) != text:
        raise _Malformed(f"base64 of {len(raw)} bytes or non-canonical, expected {size} bytes")
    return raw


def _owners_in(data: bytes, owners: set[bytes]) -> None:
    """Add the public keys of every owner marker in ``data`` to ``owners``; raise
    _Malformed if an ``[owner:`` is not followed by a well-formed marker."""
    start = data.find(OWNER_MARKER_PREFIX)
    while start != -1:
        body_start = start + len(OWNER_MARKER_PREFIX)
        body_end = body_start + _PUBLIC_KEY_B64_LENGTH
        if data[body_end : body_end + len(_MARKER_END)] != _MARKER_END:
            raise _Malformed("an owner marker is truncated or has the wrong length")
        owners.add(_decode_canonical_b64(data[body_start:body_end], _PUBLIC_KEY_SIZE))
        start = data.find(OWNER_MARKER_PREFIX, body_end)


def _record_owners(record: DHTRecord) -> set[bytes]:
    """The distinct owners named in the record's key and subkey (empty: unprotected)."""
    owners: set[bytes] = set()
    for field in (record.key, record.subkey):
        if not isinstance(field, bytes):
            raise _Malformed(f"record key and subkey are bytes, got {type(field).__name__}")
        _owners_in(field, owners)
    return owners


def _split_signature(value: bytes) -> tuple[bytes, bytes]:
    """``(value_without_suffix, signature)``; _Malformed if no well-formed suffix ends it."""
    if not isinstance(value, bytes) or len(value) < SIGNATURE_SUFFIX_LENGTH:
        raise _Malformed("the value is too short to carry a signature")
    suffix_start = len(value) - SIGNATURE_SUFFIX_LENGTH
    if (
        not value.startswith(SIGNATURE_MARKER_PREFIX, suffix_start)
        or value[-len(_MARKER_END) :] != _MARKER_END
    ):
        raise _Malformed("the value does not end with a signature")
    body = value[suffix_start + len(SIGNATURE_MARKER_PREFIX) : -len(_MARKER_END)]
    return value[:suffix_start], _decode_canonical_b64(body, _SIGNATURE_SIZE)


_process_identity: Identity | None = None
_process_identity_lock = threading.Lock()


def _process_wide_identity() -> Identity:
    """One identity per process for validators created without one (hivemind's rule), so
    that they all agree on which records this process owns."""
    global _process_identity
    with _process_identity_lock:
        if _process_identity is None:
            _process_identity = Identity.generate()
        return _process_identity


class Ed25519SignatureValidator(RecordValidatorBase):
    """Lets only the owner write records whose key or subkey holds an owner marker.

    ``identity`` is the key this peer signs with; by default one identity generated once
    per process (pass the peer's identity to own records under its PeerID's key). See the
    module docstring for the markers, the signed bytes and what is refused.

    Two signature validators merge into one that can sign for both identities;
    :attr:`local_public_key` stays the first one's.
    """

    PUBLIC_KEY_FORMAT = b"[owner:_key_]"
    SIGNATURE_FORMAT = b"[signature:_value_]"
    # A well-formed marker: canonical base64 of 32 bytes (the last data character of a
    # 32-byte encoding has its two low bits clear) / of 64 bytes (four low bits clear).
    PUBLIC_KEY_REGEX = rb"\[owner:([A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=)\]"
    SIGNATURE_REGEX = rb"\[signature:([A-Za-z0-9+/]{85}[AQgw]==)\]"

    def __init__(self, identity: Identity | None = None):
        if identity is None:
            identity = _process_wide_identity()
        if not isinstance(identity, Identity):
            raise ValidationError(
                f"{type(self).__name__} signs with a swarmgrad Identity (ed25519), got "
                f"{type(identity).__name__}"
            )
        self._identity = identity
        self._local_public_key = owner_marker(identity.public_key_bytes)
        # owner public key -> identity that signs for it (grows by merging)
        self._signers: dict[bytes, Identity] = {identity.public_key_bytes: identity}

    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def local_public_key(self) -> bytes:
        """The owner marker of this validator's identity, ``b"[owner:<base64 key>]"``."""
        return self._local_public_key

    @property
    def priority(self) -> int:
        # The outermost layer: signs after every other validator wrapped the value, and
        # strips the signature before any other validator looks at the value.
        return 10

    def validate(self, record: DHTRecord) -> bool:
        try:
            owners = _record_owners(record)
            if not owners:
                return True
            if len(owners) > 1:
                return _refuse(record, "its key and subkey name different owners")
            (owner,) = owners
            unsigned_value, signature = _split_signature(record.value)
            payload = record_signing_payload(
                DHTRecord(record.key, record.subkey, unsigned_value, record.expiration_time)
            )
        except _Malformed as e:
            return _refuse(record, str(e))
        except Exception as e:  # e.g. a non-numeric expiration time from a remote peer
            return _refuse(record, f"malformed record: {type(e).__name__}: {e}")
        if not verify_signature(owner, signature, payload):
            return _refuse(record, "the signature does not verify with the owner's key")
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        """Append our signature if the record is protected by one of our identities;
        otherwise leave the value as it is (validation then decides, e.g. refusing a
        record protected by someone else)."""
        try:
            owners = _record_owners(record)
        except _Malformed:
            return record.value
        if len(owners) != 1:
            return record.value
        signer = self._signers.get(next(iter(owners)))
        if signer is None:
            return record.value
        try:
            payload = record_signing_payload(record)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValidationError(f"cannot sign the record under key {record.key!r}: {e}") from e
        if not math.isfinite(record.expiration_time):
            raise ValidationError(
                f"cannot sign the record under key {record.key!r}: expiration time "
                f"{record.expiration_time!r} is not finite"
            )
        signature = base64.b64encode(signer.sign(payload))
        return record.value + SIGNATURE_MARKER_PREFIX + signature + _MARKER_END

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value without its signature suffix; unprotected records are untouched."""
        try:
            if not _record_owners(record):
                return record.value
            unsigned_value, _ = _split_signature(record.value)
        except _Malformed:
            return record.value
        return unsigned_value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, Ed25519SignatureValidator):
            return False
        self._signers = {**other._signers, **self._signers}
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._identity.peer_id!r})"


class RSASignatureValidator(Ed25519SignatureValidator):
    """hivemind's name for :class:`Ed25519SignatureValidator`, so that scripts written for
    hivemind keep working after changing the import.

    Records are owned by ed25519 keys (the peer's identity type), with the markers and
    signatures described in :mod:`swarmgrad.dht.crypto`. ``private_key`` may be hivemind's
    :class:`~swarmgrad.utils.rsa.RSAPrivateKey` (``RSASignatureValidator(private_key=k)``):
    the records are then owned by the ed25519 key derived from it
    (:meth:`~swarmgrad.utils.rsa.RSAPrivateKey.ed25519_seed`), the same in every process
    and on every machine that holds ``k``, so a program that pickles its RSA key to helper
    processes or reloads it keeps owning its records. A swarmgrad :class:`Identity` is
    accepted too; without either, the process-wide identity signs.
    """

    def __init__(self, private_key: RSAPrivateKey | Identity | None = None):
        if isinstance(private_key, RSAPrivateKey):
            private_key = Identity.from_seed(private_key.ed25519_seed())
        super().__init__(private_key)


def _refuse(record: DHTRecord, reason: str) -> bool:
    key = repr(getattr(record, "key", None))
    key = key if len(key) <= 80 else key[:77] + "..."
    logger.debug(f"Refusing a protected DHT record under key {key}: {reason}")
    return False
