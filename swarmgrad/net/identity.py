"""Peer identities: ed25519 key pairs and libp2p-format PeerIDs.

A peer is known by its :class:`PeerID`, derived from its ed25519 public key exactly as
libp2p does it, so ids look the same as in hivemind and every libp2p tool
(``12D3KooW...``):

* the public key is wrapped in the protobuf message
  ``PublicKey { KeyType Type = 1; bytes Data = 2; }`` with ``Ed25519 = 1``;
* the encoded message (36 bytes for ed25519) is short enough to be embedded verbatim in an
  *identity* multihash: ``0x00, varint(length), message``;
* the multihash is shown in base58 (bitcoin alphabet).

Larger keys (RSA) are hashed instead (a sha2-256 multihash, ``Qm...``): such ids can be
parsed, compared and printed, but their key cannot be recovered from them.

:class:`Identity` holds the private key. It is stored on disk in libp2p's private key
format (``PrivateKey { KeyType Type = 1; bytes Data = 2; }``, ed25519 data being the
32-byte seed followed by the 32-byte public key), so identity files move freely between
swarmgrad and other libp2p software that uses ed25519 keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import base58
import nacl.bindings
import nacl.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from swarmgrad.utils.errors import IdentityFileError, ValidationError

__all__ = ["Identity", "PeerID", "verify_signature"]

logger = logging.getLogger(__name__)

# multihash function codes (https://github.com/multiformats/multicodec)
_MULTIHASH_IDENTITY = 0x00
_MULTIHASH_SHA2_256 = 0x12
# libp2p embeds a public key verbatim when its encoding is at most this long
_MAX_INLINE_KEY_LENGTH = 42
# libp2p KeyType enum
_KEY_TYPE_NAMES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}
_ED25519 = 1
_ED25519_KEY_SIZE = 32
_ED25519_SIGNATURE_SIZE = 64
# long enough for any multihash we accept; bounds the work done on untrusted strings
_MAX_BASE58_LENGTH = 128


# --- tiny protobuf / varint helpers (only what the two key messages need) ---------------


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Read an unsigned LEB128 varint at ``pos``; return ``(value, next_pos)``."""
    value = 0
    for shift in range(0, 64, 7):
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise ValueError("varint longer than 64 bits")


def _encode_key_message(key_type: int, key_data: bytes) -> bytes:
    """Canonical encoding of libp2p's ``PublicKey``/``PrivateKey`` message."""
    return b"\x08" + _encode_varint(key_type) + b"\x12" + _encode_varint(len(key_data)) + key_data


def _decode_key_message(data: bytes) -> tuple[int, bytes]:
    """Parse a ``PublicKey``/``PrivateKey`` message into ``(key_type, key_data)``.

    Raises ValueError describing what is wrong. Unknown fields are skipped, as protobuf
    parsers do; both known fields are required (they are ``required`` in the schema).
    """
    key_type: int | None = None
    key_data: bytes | None = None
    pos = 0
    while pos < len(data):
        tag, pos = _decode_varint(data, pos)
        field, wire_type = tag >> 3, tag & 0x07
        if wire_type == 0:
            value, pos = _decode_varint(data, pos)
            if field == 1:
                key_type = value
        elif wire_type == 2:
            length, pos = _decode_varint(data, pos)
            if pos + length > len(data):
                raise ValueError(f"field {field} announces {length} bytes, fewer remain")
            if field == 2:
                key_data = bytes(data[pos : pos + length])
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type} (field {field})")
        if pos > len(data):
            raise ValueError(f"field {field} is truncated")
    if key_type is None:
        raise ValueError("the key type field is missing")
    if key_data is None:
        raise ValueError("the key data field is missing")
    return key_type, key_data


def _key_type_name(key_type: int) -> str:
    return _KEY_TYPE_NAMES.get(key_type, f"unknown key type {key_type}")


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- PeerID ---------------------------------------------------------------------------


_BASE58_CACHE: dict[bytes, str] = {}  # validated id bytes -> base58 text
_PARSED_CACHE: dict[str, PeerID] = {}  # base58 text -> parsed id
_VALIDATED: set[bytes] = set()  # id bytes that passed __post_init__
_INTERNED: dict[bytes, PeerID] = {}  # id bytes -> the PeerID object made for them


@dataclass(frozen=True, order=True, init=False)
class PeerID:
    """A peer's id: a multihash of its public key, in libp2p's format.

    ``PeerID(raw_bytes)`` validates the multihash; ``str(peer_id)`` is its base58 form.
    Peer ids are immutable, hashable and ordered by their bytes.
    """

    _bytes: bytes

    def __init__(self, peer_id_bytes: bytes):  # hivemind's parameter name
        object.__setattr__(self, "_bytes", peer_id_bytes)
        self.__post_init__()

    def __post_init__(self) -> None:
        raw = self._bytes
        if isinstance(raw, bytearray | memoryview):
            raw = bytes(raw)
            object.__setattr__(self, "_bytes", raw)
        if not isinstance(raw, bytes):
            raise ValidationError(f"PeerID expects bytes, got {type(raw).__name__}")
        if raw in _VALIDATED:  # seen (and validated) before: ids recur in every message
            return
        try:
            code, pos = _decode_varint(raw, 0)
            length, pos = _decode_varint(raw, pos)
        except ValueError as e:
            raise ValidationError(f"PeerID bytes {_short(raw)} are not a multihash: {e}") from None
        if len(raw) - pos != length:
            raise ValidationError(
                f"PeerID bytes {_short(raw)} are not a multihash: the header announces a "
                f"{length}-byte digest, {len(raw) - pos} bytes follow"
            )
        if code == _MULTIHASH_IDENTITY:
            if not 0 < length <= _MAX_INLINE_KEY_LENGTH:
                raise ValidationError(
                    f"PeerID bytes {_short(raw)}: an identity multihash holds 1 to "
                    f"{_MAX_INLINE_KEY_LENGTH} bytes of encoded public key, not {length}"
                )
        elif code == _MULTIHASH_SHA2_256:
            if length != 32:
                raise ValidationError(
                    f"PeerID bytes {_short(raw)}: a sha2-256 multihash holds 32 bytes, not {length}"
                )
        else:
            raise ValidationError(
                f"PeerID bytes {_short(raw)}: unsupported multihash code {code:#x} "
                "(expected identity 0x00 or sha2-256 0x12)"
            )
        if len(_VALIDATED) > 65536:
            _VALIDATED.clear()
        _VALIDATED.add(raw)

    # Hand-written rather than generated: a generated __hash__ builds a tuple on every call,
    # and peer ids are dictionary keys on every hot path (routing, connections, the DHT);
    # bytes cache their own hash.
    def __hash__(self) -> int:
        return hash(self._bytes)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is PeerID:
            return self._bytes == other._bytes  # type: ignore[attr-defined]
        return NotImplemented

    @classmethod
    def intern(cls, raw: bytes) -> PeerID:
        """``PeerID(raw)``, reusing the object made for the same bytes before: decoding a
        DHT answer meets the same few dozen ids again and again."""
        known = _INTERNED.get(raw)
        if known is None:
            known = cls(bytes(raw))
            if len(_INTERNED) > 65536:
                _INTERNED.clear()
            _INTERNED[bytes(raw)] = known
        return known

    # construction

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        """Parse the usual string form (``12D3KooW...`` or ``Qm...``)."""
        known = _PARSED_CACHE.get(text) if isinstance(text, str) else None
        if known is not None:
            return known
        peer_id = cls._parse_base58(text)
        if len(_PARSED_CACHE) > 65536:
            _PARSED_CACHE.clear()
        _PARSED_CACHE[text] = peer_id
        return peer_id

    @classmethod
    def _parse_base58(cls, text: str) -> PeerID:
        if not isinstance(text, str):
            raise ValidationError(f"PeerID.from_base58 expects str, got {type(text).__name__}")
        if not text or len(text) > _MAX_BASE58_LENGTH or not text.isascii():
            raise ValidationError(f"{_short(text)} is not a base58 PeerID")
        try:
            raw = base58.b58decode(text)
        except ValueError as e:
            raise ValidationError(f"{_short(text)} is not a base58 PeerID: {e}") from None
        if base58.b58encode(raw).decode("ascii") != text:  # e.g. surrounding whitespace
            raise ValidationError(f"{_short(text)} is not a base58 PeerID")
        try:
            return cls(raw)
        except ValidationError as e:
            raise ValidationError(f"{_short(text)} is not a valid PeerID: {e}") from None

    @classmethod
    def from_public_key(cls, public_key: bytes | Ed25519PublicKey) -> PeerID:
        """The PeerID of an ed25519 public key (raw 32 bytes or a cryptography object)."""
        if isinstance(public_key, Ed25519PublicKey):
            public_key = public_key.public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        if not isinstance(public_key, bytes | bytearray) or len(public_key) != 32:
            raise ValidationError(
                f"an ed25519 public key is 32 raw bytes, got {_short(public_key)}"
            )
        message = _encode_key_message(_ED25519, bytes(public_key))
        return cls(bytes([_MULTIHASH_IDENTITY]) + _encode_varint(len(message)) + message)

    # conversion

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        return self._base58

    def to_string(self) -> str:
        """Same as :meth:`to_base58` (hivemind's name)."""
        return self._base58

    def pretty(self) -> str:
        """Same as :meth:`to_base58` (hivemind's name)."""
        return self._base58

    @property
    def _base58(self) -> str:
        # Cached: ids are formatted into every log line and error message, and base58 of
        # 38 bytes costs ~20 us in pure Python.
        text = _BASE58_CACHE.get(self._bytes)
        if text is None:
            if len(_BASE58_CACHE) > 65536:
                _BASE58_CACHE.clear()
            text = _BASE58_CACHE[self._bytes] = base58.b58encode(self._bytes).decode("ascii")
        return text

    def __str__(self) -> str:
        return self._base58

    def __repr__(self) -> str:
        text = self._base58
        return f"<PeerID {text[:8]}...{text[-6:]}>" if len(text) > 16 else f"<PeerID {text}>"

    def __reduce__(self):
        return (PeerID, (self._bytes,))

    # the key inside

    def public_key_bytes(self) -> bytes:
        """The raw 32-byte ed25519 public key embedded in this id.

        Raises ValidationError when the id hashes its key (sha2-256 ids of RSA peers) or
        embeds a key of another type.
        """
        raw = self._bytes
        code, pos = _decode_varint(raw, 0)
        _, pos = _decode_varint(raw, pos)  # the digest length, checked in __post_init__
        if code != _MULTIHASH_IDENTITY:
            raise ValidationError(
                f"PeerID {self} is a sha2-256 hash of its public key (a large key such as "
                "RSA): the key cannot be recovered from the id, and swarmgrad needs Ed25519"
            )
        try:
            key_type, key_data = _decode_key_message(raw[pos:])
        except ValueError as e:
            raise ValidationError(f"PeerID {self} embeds a malformed public key: {e}") from None
        if key_type != _ED25519:
            raise ValidationError(
                f"PeerID {self} holds a {_key_type_name(key_type)} key; swarmgrad needs Ed25519"
            )
        if len(key_data) != _ED25519_KEY_SIZE:
            raise ValidationError(
                f"PeerID {self} embeds an ed25519 key of {len(key_data)} bytes, expected 32"
            )
        return key_data

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True if ``signature`` is this peer's ed25519 signature of ``data``.

        False for a wrong signature and for ids whose key is not an embedded ed25519 key:
        a signature that cannot be checked is not accepted.
        """
        try:
            public_key = self.public_key_bytes()
        except ValidationError:
            return False
        return verify_signature(public_key, signature, data)


def verify_signature(public_key_bytes: bytes, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` is a valid ed25519 signature of ``data`` by that raw key.

    Malformed keys or signatures give False, never an exception: they usually come from
    remote peers. Every ed25519 check of the library comes here (handshake proofs, TLS
    certificates, access tokens, DHT records). It uses libsodium (PyNaCl), which checks a
    signature in 39 us where OpenSSL takes 63 us on this project's machine, two of them on
    the path of every connection set-up, and which is the stricter of the two: it also
    refuses keys and signature points of small order, which no honest signer produces.
    """
    if len(public_key_bytes) != _ED25519_KEY_SIZE or len(signature) != _ED25519_SIGNATURE_SIZE:
        return False
    try:
        nacl.bindings.crypto_sign_open(bytes(signature) + bytes(data), bytes(public_key_bytes))
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError, ValueError):
        return False
    return True


# --- Identity -------------------------------------------------------------------------


class Identity:
    """An ed25519 key pair: who this peer is.

    Create one with :meth:`generate`, :meth:`load` or :meth:`load_or_create`. The repr
    shows the PeerID only, never key material.
    """

    def __init__(self, private_key: Ed25519PrivateKey):
        if not isinstance(private_key, Ed25519PrivateKey):
            raise ValidationError(
                f"Identity needs an Ed25519PrivateKey, got {type(private_key).__name__}"
            )
        self._private_key = private_key

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity whose ed25519 private key is this 32-byte seed (for tests and
        deterministic setups; keep real seeds secret)."""
        if not isinstance(seed, bytes | bytearray) or len(seed) != 32:
            raise ValidationError("an ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._private_key

    @cached_property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte ed25519 public key."""
        return self._private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @cached_property
    def peer_id(self) -> PeerID:
        return PeerID.from_public_key(self.public_key_bytes)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte ed25519 signature of ``data``."""
        return self._private_key.sign(bytes(data))

    def __repr__(self) -> str:
        return f"Identity({self.peer_id!r})"

    def __reduce__(self):
        return (Identity.from_protobuf, (self.to_protobuf(),))

    # serialization

    def _seed(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def to_protobuf(self) -> bytes:
        """libp2p's serialized ``PrivateKey`` message (Data = seed || public key)."""
        return _encode_key_message(_ED25519, self._seed() + self.public_key_bytes)

    @classmethod
    def from_protobuf(cls, data: bytes, *, source: str = "identity data") -> Identity:
        """Parse libp2p's serialized ``PrivateKey`` message.

        Ed25519 data may be 64 bytes (seed || public key, the current format), 32 bytes
        (seed only) or 96 bytes (seed || public key || public key, an old libp2p format).
        Raises IdentityFileError naming ``source`` when the data is not such a key.
        """
        try:
            key_type, key_data = _decode_key_message(bytes(data))
        except ValueError as e:
            raise IdentityFileError(
                f"{source} is not a libp2p private key (truncated or garbage protobuf: {e})"
            ) from None
        if key_type == 0:  # RSA: hivemind's identity files
            raise IdentityFileError(
                f"{source} holds a RSA private key (a hivemind identity file?); swarmgrad "
                "needs an Ed25519 key: convert it once with `swarmgrad identity import "
                "<hivemind file> <new file>`, which keeps the peer's identity stable"
            )
        if key_type != _ED25519:
            raise IdentityFileError(
                f"{source} holds a {_key_type_name(key_type)} private key; swarmgrad needs "
                "an Ed25519 key (delete the file or point to another one to get a new "
                "identity)"
            )
        if len(key_data) not in (32, 64, 96):
            raise IdentityFileError(
                f"{source} holds {len(key_data)} bytes of Ed25519 key data; expected 64 "
                "(seed and public key) or 32 (seed)"
            )
        identity = cls(Ed25519PrivateKey.from_private_bytes(key_data[:32]))
        stored_public = key_data[32:64]
        if len(key_data) == 96 and key_data[64:] != stored_public:
            raise IdentityFileError(f"{source}: the two copies of the public key differ")
        if stored_public and stored_public != identity.public_key_bytes:
            raise IdentityFileError(
                f"{source}: the stored public key does not match the private key (the file "
                "is corrupted or was assembled from two different keys)"
            )
        return identity

    def save(self, path: str | os.PathLike) -> None:
        """Write the key to ``path`` atomically, readable by the owner only (mode 0600).

        An existing file is replaced.
        """
        path = Path(path)
        tmp = _write_private_temp(path, self.to_protobuf(), "identity file")
        try:
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        """Read an identity file (libp2p ``PrivateKey`` protobuf with an Ed25519 key).

        Raises IdentityFileError for a missing or unreadable file, a malformed one, or a
        key of another type. Logs a warning if group or others may read the file.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                info = os.fstat(f.fileno())
                data = f.read(64 * 1024 + 1)
        except FileNotFoundError:
            raise IdentityFileError(f"identity file {path} does not exist") from None
        except OSError as e:
            raise IdentityFileError(f"cannot read identity file {path}: {e}") from e
        if len(data) > 64 * 1024:
            raise IdentityFileError(f"{path} is too large to be an identity file")
        if not data:
            raise IdentityFileError(f"identity file {path} is empty")
        identity = cls.from_protobuf(data, source=f"identity file {path}")
        if os.name == "posix" and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                f"Identity file {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); anyone who reads it can "
                f"impersonate peer {identity.peer_id}. Run: chmod 600 {path}"
            )
        return identity

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> Identity:
        """Load the identity at ``path``, or generate one and save it there.

        Safe when several processes race to create the same file: all of them end up
        with the identity that was written first.
        """
        path = Path(path)
        if path.exists():
            return cls.load(path)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise IdentityFileError(f"cannot create the directory of {path}: {e}") from e
        identity = cls.generate()
        tmp = _write_private_temp(path, identity.to_protobuf(), "identity file")
        try:
            os.link(tmp, path)  # fails if another process created the file meanwhile
        except FileExistsError:
            return cls.load(path)
        except OSError:  # no hard links on this filesystem: plain atomic replace
            os.replace(tmp, path)
            tmp = None
        finally:
            if tmp is not None:
                _remove_quietly(tmp)
        logger.info(f"Created a new identity {identity.peer_id} in {path}")
        return identity


# --- key files: written whole next to their place, then moved in ------------------------


def _write_private_temp(path: Path, data: bytes, what: str) -> str:
    """Write ``data`` to a fresh file next to ``path``, readable by its owner only (0600)
    and synced to disk; return its name, for the caller to move into place
    (``os.replace``, ``os.link``) or to remove (:func:`_remove_quietly`). ``what`` names
    the file in the error."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise IdentityFileError(f"cannot write {what} {path}: {e}") from e
    try:
        os.chmod(tmp, 0o600)  # mkstemp already uses 0600; keep it explicit
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
