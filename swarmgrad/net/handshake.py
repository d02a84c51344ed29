"""The swarmgrad handshake: protocol versions, features, and proof of identity.

Runs as the first frames on every connection, whatever carries it (TLS over TCP, TLS over
a relayed stream, or the simulated network). Each side sends HELLO with its PeerID, the
protocol versions it speaks and a fresh 32-byte nonce. Two ways to prove identities:

* **Nonce exchange** (a carrier without TLS: relayed connections on the simulated network,
  whose direct ones simulate TLS; see swarmgrad.net.sim.backend): after reading the
  other's HELLO each side sends AUTH, an ed25519 signature over a domain tag, both PeerIDs
  and both nonces. The signature covers the nonce the *verifier* just drew, so it cannot
  be replayed, and it names both ends, so a peer that receives our signature cannot
  present it to a third party as its own. A first request can leave only with the second
  AUTH: three flights after the carrier is up.
* **Bound to TLS** (every TLS carrier of ours, chosen by ALPN): the listener's identity is
  already proven by TLS (its certificate's key signed the handshake transcript, and the
  dialer pins the PeerID of that key), so only the dialer signs, right away, over a domain
  tag, both PeerIDs, the TLS channel binding and its nonce. The channel binding (the
  dialer's TLS Finished, a MAC over the whole transcript including both sides' fresh
  randoms and key shares) is unique to this TLS session, so the signature can be neither
  replayed nor relayed into another session. The dialer's HELLO, AUTH and first request
  leave together with its TLS Finished: the answer comes back in the next flight.

In a swarm with an admission authority, HELLO also carries the sender's access token
(:mod:`swarmgrad.net.admission`); the connection checks it before AUTH, and a dialer on a
TLS carrier checks the listener's token, carried in its certificate, before it signs.

This module is pure: it builds and checks messages, no I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgpack

from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.utils.errors import HandshakeError, IncompatibleVersion, ProtocolViolation

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
FEATURES: tuple[str, ...] = ("mux/credit", "rpc/1", "relay/1")
_AUTH_TAG = b"swarmgrad-auth-v1"
_BOUND_AUTH_TAG = b"swarmgrad-tls-bound-auth-v1"
NONCE_SIZE = 32


@dataclass(frozen=True)
class Hello:
    peer_id: PeerID
    version: int
    min_version: int
    nonce: bytes
    features: tuple[str, ...]
    initial_window: int
    max_frame: int
    token: bytes | None = None  # the sender's access token (swarmgrad.net.admission), if any

    def encode(self) -> bytes:
        fields = {
            "v": self.version,
            "min_v": self.min_version,
            "id": self.peer_id.to_bytes(),
            "nonce": self.nonce,
            "features": list(self.features),
            "window": self.initial_window,
            "max_frame": self.max_frame,
        }
        if self.token is not None:
            fields["token"] = self.token
        return msgpack.packb(fields)

    @classmethod
    def decode(cls, payload: bytes) -> Hello:
        try:
            raw = msgpack.unpackb(payload, raw=False)
        except Exception as e:
            raise ProtocolViolation(f"HELLO is not valid msgpack: {e}") from None
        if not isinstance(raw, dict):
            raise ProtocolViolation(f"HELLO must be a map, got {type(raw).__name__}")
        try:
            version, min_version = _int_field(raw, "v"), _int_field(raw, "min_v")
            nonce = _bytes_field(raw, "nonce")
            peer_id = PeerID(_bytes_field(raw, "id"))
            features = tuple(str(f) for f in raw.get("features", ()))
            window, max_frame = _int_field(raw, "window"), _int_field(raw, "max_frame")
            token = _bytes_field(raw, "token") if "token" in raw else None
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolViolation(f"HELLO is missing or has a malformed field: {e!r}") from None
        if len(nonce) != NONCE_SIZE:
            raise ProtocolViolation(f"HELLO nonce must be {NONCE_SIZE} bytes, got {len(nonce)}")
        if not (1024 <= window <= 2**31) or not (1024 <= max_frame <= 2**31):
            raise ProtocolViolation(f"HELLO window {window} or max_frame {max_frame} out of range")
        return cls(peer_id, version, min_version, nonce, features, window, max_frame, token)


def _int_field(raw: dict, name: str) -> int:
    """An integer field, by type: int() would also take floats (inf overflows) and strings."""
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name!r} must be an integer, got {type(value).__name__}")
    return value


def _bytes_field(raw: dict, name: str) -> bytes:
    """A binary field, by type: bytes(n) of an integer n would allocate n zero bytes."""
    value = raw[name]
    if not isinstance(value, bytes):
        raise TypeError(f"{name!r} must be bytes, got {type(value).__name__}")
    return value


def make_hello(
    identity: Identity, *, initial_window: int, max_frame: int, token: bytes | None = None
) -> Hello:
    return Hello(
        peer_id=identity.peer_id,
        version=PROTOCOL_VERSION,
        min_version=MIN_PROTOCOL_VERSION,
        nonce=os.urandom(NONCE_SIZE),
        features=FEATURES,
        initial_window=initial_window,
        max_frame=max_frame,
        token=token,
    )


def negotiate_version(ours: Hello, theirs: Hello) -> int:
    """The highest version both speak, or IncompatibleVersion naming both ranges."""
    low, high = max(ours.min_version, theirs.min_version), min(ours.version, theirs.version)
    if low > high:
        raise IncompatibleVersion(
            f"peer {theirs.peer_id} speaks protocol versions {theirs.min_version}..{theirs.version}"
            f", we speak {ours.min_version}..{ours.version}"
        )
    return high


def _auth_message(signer: Hello, verifier: Hello) -> bytes:
    return b"|".join(
        (
            _AUTH_TAG,
            signer.peer_id.to_bytes(),
            verifier.peer_id.to_bytes(),
            verifier.nonce,
            signer.nonce,
        )
    )


def sign_auth(identity: Identity, ours: Hello, theirs: Hello) -> bytes:
    return identity.sign(_auth_message(ours, theirs))


def verify_auth(signature: bytes, ours: Hello, theirs: Hello) -> None:
    """Check the remote's AUTH signature; raise HandshakeError if it does not prove theirs."""
    if not theirs.peer_id.verify(bytes(signature), _auth_message(theirs, ours)):
        raise HandshakeError(
            f"peer claiming to be {theirs.peer_id} failed to prove possession of its key"
        )


def _bound_auth_message(signer: Hello, verifier: PeerID, channel_binding: bytes) -> bytes:
    # msgpack: every field length-prefixed, so no two field lists encode alike
    return msgpack.packb(
        [
            _BOUND_AUTH_TAG,
            signer.peer_id.to_bytes(),
            verifier.to_bytes(),
            channel_binding,
            signer.nonce,
        ]
    )


def sign_bound_auth(
    identity: Identity, ours: Hello, listener: PeerID, channel_binding: bytes
) -> bytes:
    """The dialer's proof of identity on a TLS carrier: needs nothing from the listener's
    HELLO, so it leaves with the dialer's HELLO."""
    return identity.sign(_bound_auth_message(ours, listener, channel_binding))


def verify_bound_auth(
    signature: bytes, dialer: Hello, ours: PeerID, channel_binding: bytes
) -> None:
    """Check the dialer's TLS-bound AUTH; raise HandshakeError if it does not prove its key."""
    message = _bound_auth_message(dialer, ours, channel_binding)
    if not dialer.peer_id.verify(bytes(signature), message):
        raise HandshakeError(
            f"peer claiming to be {dialer.peer_id} failed to prove possession of its key "
            "for this TLS session"
        )
