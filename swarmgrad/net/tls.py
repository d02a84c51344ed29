"""TLS 1.3 credentials bound to a peer's ed25519 identity.

Each peer presents an X.509 certificate self-signed with its identity key. In TLS 1.3 the
server signs the handshake transcript with that key (CertificateVerify), so a dialer
that reads the certificate (:func:`peer_id_from_certificate`) learns a PeerID that the
other side has just proven to hold. There is no certificate authority and no host name
check: the dialer pins the PeerID it expected instead.

The stdlib server cannot ask for a client certificate without also verifying it against
a CA, so the accepting side does not learn the dialer's identity from TLS; the connection
handshake above TLS proves it (a signature naming both peers).

In a swarm with an admission authority the certificate also carries the listener's access
token (a non-critical extension, :data:`ADMISSION_TOKEN_OID`), so that a dialer checks it
as soon as TLS completes, before its own proof and first request leave: no extra round
trip, and nothing sent to a listener the swarm does not admit. TLS 1.3 encrypts
certificates, so the token is not visible on the wire.

SSL contexts are cached per identity (and token): building one (and loading its key) is
slow, and a context can be shared by any number of connections.
"""

from __future__ import annotations

import datetime
import os
import secrets
import ssl
import tempfile
import threading
from collections import OrderedDict

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID, ObjectIdentifier, SignatureAlgorithmOID

from swarmgrad.net.identity import Identity, PeerID, verify_signature
from swarmgrad.utils.errors import HandshakeError

__all__ = [
    "ADMISSION_TOKEN_OID",
    "ALPN_PROTOCOL",
    "BOUND_HANDSHAKE_ALPNS",
    "FAST_RECORDS_ALPN",
    "TLS_RECORDS_ENV",
    "client_ssl_context",
    "certificate_identity",
    "make_self_signed_certificate",
    "peer_id_from_certificate",
    "peer_id_from_ssl_object",
    "server_ssl_context",
]

FAST_RECORDS_ALPN = "swarmgrad/4"
"""ALPN id of TLS 1.3 handshake + AES-GCM bulk records keyed per direction (see
swarmgrad.net.records) + the connection handshake bound to the TLS session (see
swarmgrad.net.handshake). Earlier: /3 the same with the nonce-exchange handshake, /2 records
keyed from both shares."""
ALPN_PROTOCOL = "swarmgrad/4-tls"
"""ALPN id of plain TLS 1.3 records (+ the bound handshake); chosen when either side does
not offer the fast one (was swarmgrad/1, with the nonce-exchange handshake)."""
BOUND_HANDSHAKE_ALPNS = frozenset({FAST_RECORDS_ALPN, ALPN_PROTOCOL})
"""Sessions negotiated under these ids run the connection handshake bound to TLS."""
TLS_RECORDS_ENV = "SWARMGRAD_TLS_RECORDS"
"""Set to 1 to offer only plain TLS records (for audits and comparisons)."""

ADMISSION_TOKEN_OID = ObjectIdentifier("2.25.196985738979373886627733236052287800552")
"""X.509 extension holding the certificate owner's access token (a UUID-derived OID)."""

# Volunteers' clocks disagree: make certificates valid well before and long after now.
_NOT_BEFORE_SLACK = datetime.timedelta(days=1)
_VALIDITY = datetime.timedelta(days=3650)
_CONTEXT_CACHE_SIZE = 32

_cache_lock = threading.Lock()
_context_cache: OrderedDict[tuple[bytes, bool, bool, bytes | None], ssl.SSLContext] = OrderedDict()


def make_self_signed_certificate(
    identity: Identity, admission_token: bytes | None = None
) -> tuple[bytes, bytes]:
    """A certificate for ``identity``, self-signed with its ed25519 key, carrying
    ``admission_token`` (wire bytes) when given.

    Returns ``(cert_pem, key_pem)``; the key is the identity's private key in
    unencrypted PKCS#8 PEM. The subject is the PeerID, for humans reading the cert.
    """
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity.peer_id))])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(secrets.randbits(63) + 1)
        .not_valid_before(now - _NOT_BEFORE_SLACK)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if admission_token is not None:
        extension = x509.UnrecognizedExtension(ADMISSION_TOKEN_OID, bytes(admission_token))
        builder = builder.add_extension(extension, critical=False)
    certificate = builder.sign(identity.private_key, algorithm=None)  # ed25519 hashes inside
    cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
    key_pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert_pem, key_pem


def _load_identity_into(
    context: ssl.SSLContext, identity: Identity, admission_token: bytes | None
) -> None:
    """``load_cert_chain`` only reads files: write the PEMs to a private temporary
    directory (0700, file 0600) and remove it right after loading."""
    cert_pem, key_pem = make_self_signed_certificate(identity, admission_token)
    with tempfile.TemporaryDirectory(prefix="swarmgrad-tls-") as directory:
        path = os.path.join(directory, "identity.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem + cert_pem)
        try:
            context.load_cert_chain(path)
        finally:
            os.unlink(path)


def _make_context(
    identity: Identity, server_side: bool, admission_token: bytes | None = None
) -> ssl.SSLContext:
    protocol = ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.maximum_version = ssl.TLSVersion.TLSv1_3
    # No CA and no host names: the dialer pins the PeerID proven by the certificate.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    offered = (
        [ALPN_PROTOCOL]
        if os.environ.get(TLS_RECORDS_ENV) == "1"
        else [
            FAST_RECORDS_ALPN,
            ALPN_PROTOCOL,
        ]
    )
    context.set_alpn_protocols(offered)
    if server_side:
        # Peers never resume sessions; tickets would only cost bytes and, when the client
        # closes right after the handshake, spurious connection-reset errors.
        context.num_tickets = 0
    _load_identity_into(context, identity, admission_token)
    return context


def _cached_context(
    identity: Identity, server_side: bool, admission_token: bytes | None = None
) -> ssl.SSLContext:
    key = (
        identity.peer_id.to_bytes(),
        server_side,
        os.environ.get(TLS_RECORDS_ENV) == "1",
        admission_token,
    )
    with _cache_lock:
        context = _context_cache.get(key)
        if context is not None:
            _context_cache.move_to_end(key)
            return context
    context = _make_context(identity, server_side, admission_token)
    with _cache_lock:
        context = _context_cache.setdefault(key, context)
        _context_cache.move_to_end(key)
        while len(_context_cache) > _CONTEXT_CACHE_SIZE:
            _context_cache.popitem(last=False)
    return context


def server_ssl_context(identity: Identity, admission_token: bytes | None = None) -> ssl.SSLContext:
    """TLS 1.3 context for accepting connections as ``identity`` (cached), whose
    certificate carries ``admission_token`` when given."""
    return _cached_context(identity, True, admission_token)


def client_ssl_context(identity: Identity) -> ssl.SSLContext:
    """TLS 1.3 context for dialing as ``identity`` (cached). It does not check the
    server's certificate: call :func:`peer_id_from_certificate` and compare."""
    return _cached_context(identity, server_side=False)


def _describe_key(public_key: object) -> str:
    if isinstance(public_key, rsa.RSAPublicKey):
        return f"an RSA-{public_key.key_size} key"
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return f"an ECDSA {public_key.curve.name} key"
    if isinstance(public_key, ed448.Ed448PublicKey):
        return "an Ed448 key"
    return f"a {type(public_key).__name__} key"


def peer_id_from_certificate(der: bytes | None) -> PeerID:
    """The PeerID proven by a peer's certificate (``getpeercert(binary_form=True)``).

    Checks that the certificate is self-signed with an ed25519 key. Raises
    HandshakeError otherwise: no certificate, garbage, another key type, a signature
    by another key.
    """
    return certificate_identity(der)[0]


def certificate_identity(der: bytes | None) -> tuple[PeerID, bytes | None]:
    """The PeerID proven by a peer's certificate and the access token it carries (None
    if it has none); HandshakeError as for :func:`peer_id_from_certificate`."""
    if not der:
        raise HandshakeError("the peer presented no TLS certificate")
    try:
        certificate = x509.load_der_x509_certificate(bytes(der))
    except ValueError as e:
        raise HandshakeError(f"the peer's TLS certificate is not valid DER: {e}") from None
    try:
        public_key = certificate.public_key()
    except (ValueError, UnsupportedAlgorithm) as e:
        raise HandshakeError(f"cannot read the key of the peer's TLS certificate: {e}") from None
    if not isinstance(public_key, Ed25519PublicKey):
        raise HandshakeError(
            f"the peer's TLS certificate holds {_describe_key(public_key)}, not an Ed25519 "
            "key: it is not a swarmgrad peer"
        )
    if certificate.signature_algorithm_oid != SignatureAlgorithmOID.ED25519:
        raise HandshakeError("the peer's TLS certificate is not signed with Ed25519")
    if certificate.issuer != certificate.subject:
        raise HandshakeError("the peer's TLS certificate is not self-signed")
    key_bytes = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if not verify_signature(key_bytes, certificate.signature, certificate.tbs_certificate_bytes):
        raise HandshakeError(
            "the peer's TLS certificate is not signed by its own key (bad self-signature)"
        )
    try:
        extension = certificate.extensions.get_extension_for_oid(ADMISSION_TOKEN_OID)
        token = bytes(extension.value.value)
    except x509.ExtensionNotFound:
        token = None
    except ValueError as e:  # duplicate or unparsable extensions
        raise HandshakeError(f"the peer's TLS certificate has malformed extensions: {e}") from None
    return PeerID.from_public_key(key_bytes), token


def peer_id_from_ssl_object(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> PeerID:
    """The PeerID proven by the remote side of an established TLS connection, e.g.
    ``writer.get_extra_info("ssl_object")`` on the dialing side."""
    if ssl_object is None:
        raise HandshakeError("the connection is not a TLS connection")
    version = ssl_object.version()
    if version != "TLSv1.3":
        raise HandshakeError(f"the connection uses {version}, swarmgrad needs TLSv1.3")
    return peer_id_from_certificate(ssl_object.getpeercert(binary_form=True))
