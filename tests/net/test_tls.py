import asyncio
import datetime
import os
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from swarmgrad.net.identity import Identity
from swarmgrad.net.tls import (
    FAST_RECORDS_ALPN,
    client_ssl_context,
    make_self_signed_certificate,
    peer_id_from_certificate,
    peer_id_from_ssl_object,
    server_ssl_context,
)
from swarmgrad.utils.errors import HandshakeError

TIMEOUT = 10.0


def _self_signed_der(public_key, signing_key, algorithm) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(signing_key, algorithm)
    )
    return certificate.public_bytes(serialization.Encoding.DER)


def _der_of(identity: Identity) -> bytes:
    cert_pem, _ = make_self_signed_certificate(identity)
    return x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)


async def _serve(identity: Identity, handler):
    server = await asyncio.start_server(
        handler, "127.0.0.1", 0, ssl=server_ssl_context(identity), ssl_handshake_timeout=TIMEOUT
    )
    return server, server.sockets[0].getsockname()[1]


# --- certificates ---------------------------------------------------------------------


def test_certificate_is_self_signed_with_the_identity_key_and_valid_around_now():
    identity = Identity.generate()
    cert_pem, key_pem = make_self_signed_certificate(identity)
    certificate = x509.load_pem_x509_certificate(cert_pem)
    assert certificate.issuer == certificate.subject
    assert certificate.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    ) == (identity.public_key_bytes)
    now = datetime.datetime.now(datetime.UTC)
    assert certificate.not_valid_before_utc <= now - datetime.timedelta(hours=12)
    assert certificate.not_valid_after_utc >= now + datetime.timedelta(days=365 * 5)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    assert peer_id_from_certificate(_der_of(identity)) == identity.peer_id


def test_rsa_and_ecdsa_certificates_are_rejected_naming_the_key_type():
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with pytest.raises(HandshakeError, match=r"RSA-2048.*not an Ed25519"):
        peer_id_from_certificate(_self_signed_der(rsa_key.public_key(), rsa_key, hashes.SHA256()))
    ec_key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(HandshakeError, match=r"ECDSA secp256r1.*not an Ed25519"):
        peer_id_from_certificate(_self_signed_der(ec_key.public_key(), ec_key, hashes.SHA256()))


def test_certificate_signed_by_another_key_is_rejected():
    claimed, signer = Identity.generate(), Identity.generate()
    der = _self_signed_der(claimed.private_key.public_key(), signer.private_key, None)
    with pytest.raises(HandshakeError, match="bad self-signature"):
        peer_id_from_certificate(der)


def test_tampered_certificate_is_rejected():
    der = bytearray(_der_of(Identity.generate()))
    der[-1] ^= 0x01  # last byte of the signature
    with pytest.raises(HandshakeError):
        peer_id_from_certificate(bytes(der))


@pytest.mark.parametrize("der", [None, b"", b"garbage", b"\x30\x03\x02\x01\x01", os.urandom(300)])
def test_missing_or_garbage_certificates_are_handshake_errors(der):
    with pytest.raises(HandshakeError):
        peer_id_from_certificate(der)


def test_contexts_are_tls13_only_without_ca_checks_and_cached():
    identity = Identity.generate()
    for factory in (server_ssl_context, client_ssl_context):
        context = factory(identity)
        assert context.minimum_version == ssl.TLSVersion.TLSv1_3
        assert context.maximum_version == ssl.TLSVersion.TLSv1_3
        assert not context.check_hostname
        assert context.verify_mode == ssl.CERT_NONE
        assert factory(identity) is context
    assert server_ssl_context(identity) is not client_ssl_context(identity)
    assert server_ssl_context(Identity.generate()) is not server_ssl_context(identity)


def test_no_certificate_file_is_left_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    server_ssl_context(Identity.generate())
    assert list(tmp_path.iterdir()) == []


# --- real connections -----------------------------------------------------------------


def test_client_learns_the_server_peer_id_over_tls13():
    server_identity, client_identity = Identity.generate(), Identity.generate()

    async def handler(reader, writer):
        data = await reader.readexactly(5)
        writer.write(data.upper())
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def main():
        server, port = await _serve(server_identity, handler)
        async with server:
            async with asyncio.timeout(TIMEOUT):
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=client_ssl_context(client_identity)
                )
                ssl_object = writer.get_extra_info("ssl_object")
                assert ssl_object.version() == "TLSv1.3"
                assert ssl_object.selected_alpn_protocol() == FAST_RECORDS_ALPN
                assert peer_id_from_ssl_object(ssl_object) == server_identity.peer_id
                writer.write(b"hello")
                assert await reader.readexactly(5) == b"HELLO"
                writer.close()
                await writer.wait_closed()

    asyncio.run(main())


def test_plaintext_client_fails_cleanly_and_the_server_keeps_serving():
    server_identity = Identity.generate()
    handled = []

    async def handler(reader, writer):
        handled.append(True)
        writer.close()
        await writer.wait_closed()

    async def main():
        server, port = await _serve(server_identity, handler)
        async with server:
            async with asyncio.timeout(TIMEOUT):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                try:
                    reply = await reader.read()  # the server aborts: EOF or reset
                except ConnectionResetError:
                    reply = b""
                assert b"HTTP" not in reply
                writer.close()
                try:
                    await writer.wait_closed()
                except ConnectionResetError:
                    pass
                assert handled == []

                _, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=client_ssl_context(Identity.generate())
                )
                peer_id = peer_id_from_ssl_object(writer.get_extra_info("ssl_object"))
                assert peer_id == server_identity.peer_id
                writer.close()
                await writer.wait_closed()

    asyncio.run(main())


def test_tls12_only_client_is_refused():
    async def handler(reader, writer):
        writer.close()

    async def main():
        server, port = await _serve(Identity.generate(), handler)
        async with server:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            context.maximum_version = ssl.TLSVersion.TLSv1_2
            async with asyncio.timeout(TIMEOUT):
                with pytest.raises((ssl.SSLError, ConnectionResetError)):
                    await asyncio.open_connection("127.0.0.1", port, ssl=context)

    asyncio.run(main())
