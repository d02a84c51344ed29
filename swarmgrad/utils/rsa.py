"""hivemind's RSA keys (``hivemind.utils.crypto``), for programs that create or pass them.

Re-exported by :mod:`swarmgrad.dht.crypto` (where ``hivemind.utils.crypto`` finds them).

hivemind signs DHT records and names peers with RSA-2048 keys; swarmgrad uses ed25519
identities. Programs written for hivemind still build ``RSAPrivateKey()`` objects, pass
them to ``RSASignatureValidator(private_key=...)``, pickle them to other processes and read
hivemind identity files. This module keeps that surface with the same behaviour
(RSA-PSS/SHA-256 signatures, base64-encoded; public keys in OpenSSH format; private keys
as PKCS#1 DER) and adds the one bridge swarmgrad needs:

:meth:`RSAPrivateKey.ed25519_seed` derives, one-way and deterministically, the seed of the
ed25519 key that stands for this RSA key in swarmgrad (HKDF-SHA256 over the private key's
DER with a fixed domain label). Whoever holds the RSA key gets the same ed25519 key every
time, on any machine; nobody else can compute it, and it reveals nothing about the RSA
key. ``RSASignatureValidator(private_key=k)`` and ``swarmgrad identity import`` both use it,
so a key keeps owning the same records and naming the same peer.
"""

from __future__ import annotations

import base64
import threading
from abc import ABC, abstractmethod

from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarmgrad.utils.errors import ValidationError

__all__ = ["PrivateKey", "PublicKey", "RSAPrivateKey", "RSAPublicKey"]

_RSA_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_RSA_HASH = hashes.SHA256()
_SEED_SALT = b"swarmgrad/rsa-identity-to-ed25519/v1"


class PrivateKey(ABC):
    @abstractmethod
    def sign(self, data: bytes) -> bytes: ...

    @abstractmethod
    def get_public_key(self) -> PublicKey: ...


class PublicKey(ABC):
    @abstractmethod
    def verify(self, data: bytes, signature: bytes) -> bool: ...

    @abstractmethod
    def to_bytes(self) -> bytes: ...

    @classmethod
    @abstractmethod
    def from_bytes(cls, key: bytes) -> PublicKey: ...


class RSAPrivateKey(PrivateKey):
    """An RSA-2048 private key; ``RSAPrivateKey()`` generates a fresh one (as hivemind)."""

    _process_wide_key: RSAPrivateKey | None = None
    _process_wide_key_lock = threading.RLock()

    def __init__(self, private_key: rsa.RSAPrivateKey | None = None):
        if private_key is None:
            private_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if not isinstance(private_key, rsa.RSAPrivateKey):
            raise ValidationError(
                f"RSAPrivateKey wraps an RSA private key, got {type(private_key).__name__}"
            )
        self._private_key = private_key

    @classmethod
    def process_wide(cls) -> RSAPrivateKey:
        """One key per process, created on first use."""
        if cls._process_wide_key is None:
            with cls._process_wide_key_lock:
                if cls._process_wide_key is None:
                    cls._process_wide_key = cls()
        return cls._process_wide_key

    def sign(self, data: bytes) -> bytes:
        """The base64-encoded RSA-PSS (SHA-256) signature of ``data``."""
        return base64.b64encode(self._private_key.sign(bytes(data), _RSA_PADDING, _RSA_HASH))

    def get_public_key(self) -> RSAPublicKey:
        return RSAPublicKey(self._private_key.public_key())

    def to_bytes(self) -> bytes:
        """The key as PKCS#1 DER (what hivemind writes inside its identity files)."""
        return self._private_key.private_bytes(
            encoding=serialization.Encoding.DER,
            format=serialization.PrivateFormat.TraditionalOpenSSL,
            encryption_algorithm=serialization.NoEncryption(),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> RSAPrivateKey:
        """Load a key written by :meth:`to_bytes` (PKCS#1 or PKCS#8 DER, unencrypted)."""
        try:
            key = serialization.load_der_private_key(bytes(data), password=None)
        except (ValueError, TypeError, exceptions.UnsupportedAlgorithm) as e:
            raise ValidationError(f"not an unencrypted DER private key: {e}") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValidationError(f"expected an RSA private key, got {type(key).__name__}")
        return cls(key)

    def ed25519_seed(self) -> bytes:
        """The 32-byte seed of the ed25519 key that stands for this key in swarmgrad
        (see the module docstring)."""
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SEED_SALT, info=b"").derive(
            self.to_bytes()
        )

    def __getstate__(self):
        return {"_private_key": self.to_bytes()}

    def __setstate__(self, state):
        self._private_key = serialization.load_der_private_key(state["_private_key"], None)

    def __repr__(self) -> str:
        return f"RSAPrivateKey({self._private_key.key_size} bits)"


class RSAPublicKey(PublicKey):
    def __init__(self, public_key: rsa.RSAPublicKey):
        self._public_key = public_key

    def verify(self, data: bytes, signature: bytes) -> bool:
        """True if ``signature`` (base64, as :meth:`RSAPrivateKey.sign` makes) is valid."""
        try:
            raw = base64.b64decode(signature, validate=True)
            self._public_key.verify(raw, bytes(data), _RSA_PADDING, _RSA_HASH)
        except (ValueError, TypeError, exceptions.InvalidSignature):
            return False
        return True

    def to_bytes(self) -> bytes:
        """OpenSSH format, ``b"ssh-rsa AAAA..."``."""
        return self._public_key.public_bytes(
            encoding=serialization.Encoding.OpenSSH, format=serialization.PublicFormat.OpenSSH
        )

    def to_der(self) -> bytes:
        """SubjectPublicKeyInfo DER (libp2p's encoding of an RSA public key)."""
        return self._public_key.public_bytes(
            encoding=serialization.Encoding.DER,
            format=serialization.PublicFormat.SubjectPublicKeyInfo,
        )

    @classmethod
    def from_bytes(cls, key: bytes) -> RSAPublicKey:
        try:
            loaded = serialization.load_ssh_public_key(bytes(key))
        except (ValueError, TypeError, exceptions.UnsupportedAlgorithm) as e:
            raise ValueError(f"not an OpenSSH public key: {e}") from None
        if not isinstance(loaded, rsa.RSAPublicKey):
            raise ValueError(f"Expected an RSA public key, got {type(loaded).__name__}")
        return cls(loaded)

    @classmethod
    def from_der(cls, key: bytes) -> RSAPublicKey:
        loaded = serialization.load_der_public_key(bytes(key))
        if not isinstance(loaded, rsa.RSAPublicKey):
            raise ValueError(f"Expected an RSA public key, got {type(loaded).__name__}")
        return cls(loaded)
