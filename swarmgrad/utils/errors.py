"""The one exception hierarchy of swarmgrad.

Every error the library raises on purpose derives from :class:`SwarmgradError`, so a user
can catch "anything swarmgrad refused" in one clause, and each subclass names what went
wrong. Messages name the peer, key or tensor concerned and what was expected.
"""

from __future__ import annotations


class SwarmgradError(Exception):
    """Root of every error swarmgrad raises on purpose."""


class ValidationError(SwarmgradError, ValueError):
    """An argument or a value failed a check (wrong type, shape, size, range)."""


class ProtocolViolation(SwarmgradError):
    """A remote peer sent something the protocol does not allow (malformed frame, bad
    length, unknown message type, more data than announced)."""


class FrameTooLarge(ProtocolViolation):
    """A frame or message is larger than the configured limit."""


class HandshakeError(SwarmgradError):
    """A connection could not be established securely: TLS failed, the remote peer could
    not prove its identity, it speaks an incompatible protocol version, or it is not the
    peer we dialed."""


class PeerIDMismatch(HandshakeError):
    """The peer that answered proved a different identity than the one we dialed."""


class IncompatibleVersion(HandshakeError):
    """The remote peer speaks a protocol version we do not."""


class PeerUnreachable(SwarmgradError, ConnectionError):
    """No connection to the peer could be made (refused, timed out, no known address)."""


class ConnectionClosed(SwarmgradError, ConnectionError):
    """The connection carrying a stream or call was closed before it finished."""


class ConnectionIdleClosed(ConnectionClosed):
    """The remote closed the connection because no stream had used it for a while. It had
    no stream open when it decided, so a stream that fails this way never reached its
    handlers: a call can safely be sent again over a new connection."""


class StreamReset(ConnectionClosed):
    """The remote side (or the local side) reset the stream mid-transfer."""


class DeadlineExceeded(SwarmgradError, TimeoutError):
    """An operation did not finish before its deadline."""


class RemoteError(SwarmgradError):
    """A remote handler raised; carries the remote exception's type name and message."""

    def __init__(self, message: str, *, remote_type: str = "Exception", peer: object = None):
        super().__init__(message)
        self.remote_type = remote_type
        self.peer = peer

    def __str__(self) -> str:
        where = f" on {self.peer}" if self.peer is not None else ""
        return f"{self.remote_type}{where}: {self.args[0]}"


class UnknownHandler(RemoteError):
    """The remote peer has no handler registered under the requested name."""


class Overloaded(RemoteError):
    """The remote peer refused a call because this peer has too many calls in flight."""


class IdentityFileError(SwarmgradError):
    """An identity file is unreadable, malformed, or holds a key of the wrong type."""


class CodecError(ValidationError):
    """A serialized tensor or codec payload is inconsistent with its header."""


class StorageLimitExceeded(ValidationError):
    """A DHT record was refused because it breaks a storage limit: too large a value or
    subkey, an expiration too far ahead, or too many records from one peer."""


class TokenError(ValidationError):
    """An access token, a revocation list or an authority key is malformed: not the wire
    form swarmgrad writes, a field of the wrong type, or larger than allowed."""


class AdmissionRefused(HandshakeError):
    """A swarm with an admission authority refused a connection: no access token, an
    expired or revoked one, one issued for another PeerID or by another authority, or a
    forged signature. ``reason`` is the :class:`~swarmgrad.net.admission.RefusalReason`
    value when known (the refusing side always knows it; the refused side learns it from
    the refusal message)."""

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class AccessDenied(RemoteError):
    """The remote peer refused a call because the role in our access token does not allow
    it (a monitor storing in the DHT, a server joining an averaging round, ...)."""
