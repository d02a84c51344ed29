"""Admission: who may join a swarm, and what each member may do.

An **authority** is an ed25519 key pair kept by whoever runs the collaboration. Its public
half is written like a PeerID (``12D3KooW...``: the identity multihash embeds the key), so
it fits on a command line. The authority signs:

* **access tokens** (:class:`AccessToken`): this PeerID may join, with this
  :class:`Role`, until this time. A token names the authority that issued it and carries a
  random id, so one token can be revoked without revoking the peer;
* **revocation lists** (:class:`RevocationList`): PeerIDs and token ids no longer
  admitted, numbered by a serial so that the newest list wins.

A peer started with ``authority=`` (:class:`Admission`) presents its own token and checks
the other side's once per connection, in the connection handshake (see
:mod:`swarmgrad.net.mux`), before any stream is opened; at every call it checks that the
caller's role allows the handler (:meth:`Admission.allows`).

Wire forms are msgpack: ``[tag, version, body, signature]``, where ``body`` is the msgpack
map that the signature covers (prefixed with a domain tag, so a token signature can never
pass for a revocation list's or a handshake's). Unknown body fields are ignored. The text
form of a token, for files and command lines, is ``sgt1.`` followed by the unpadded
url-safe base64 of the wire form.

This module is pure (no I/O) except for :meth:`Authority.load`/:meth:`Authority.save`
and the token files :class:`Admission` re-reads to renew.
"""

from __future__ import annotations

import base64
import enum
import inspect
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import msgpack

from swarmgrad.net.identity import Identity, PeerID, verify_signature
from swarmgrad.utils.errors import AdmissionRefused, TokenError, ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = [
    "AccessToken",
    "Admission",
    "Authority",
    "RefusalReason",
    "RevocationList",
    "Role",
    "load_authority_key",
    "parse_duration",
]

logger = logging.getLogger(__name__)

TOKEN_TEXT_PREFIX = "sgt1."
_VERSION = 1
MAX_TOKEN_BYTES = 1024
MAX_REVOCATION_BYTES = 768 * 1024  # fits a DHT value (1 MiB by default)
TOKEN_ID_BYTES = 16
_SIGNATURE_BYTES = 64
_VERIFIED_CACHE_SIZE = 4096


class Role(enum.Enum):
    """What a token holder may do. Calls a role does not allow are refused with
    :class:`~swarmgrad.utils.errors.AccessDenied` (see :data:`ROLE_HANDLERS`)."""

    TRAINER = "trainer"  # everything: DHT, averaging, state download, expert calls
    SERVER = "server"  # serves experts: reads and writes the DHT, calls no one's experts
    MONITOR = "monitor"  # only reads the DHT


ROLE_HANDLERS: dict[Role, tuple[str, ...] | None] = {
    Role.TRAINER: None,  # None: every handler
    Role.SERVER: ("dht.", "relay.", "admission."),
    Role.MONITOR: ("dht.ping", "dht.find", "relay.", "admission."),
}
"""Handlers each role may call on others: an exact name, or a prefix ending with ``.``.
Anything not listed (averaging, state sharing, expert calls, handlers of user code) is
for trainers only: a new handler is closed to restricted roles until listed here."""


class RefusalReason(enum.Enum):
    """Why a connection was refused; the value appears in both sides' error messages."""

    NO_TOKEN = "no token"
    MALFORMED = "malformed token"
    EXPIRED = "expired"
    NOT_YET_VALID = "not yet valid"
    WRONG_PEER = "token for another peer"
    WRONG_AUTHORITY = "another authority"
    BAD_SIGNATURE = "forged signature"
    REVOKED = "revoked"


# ------------------------------------------------------------------------ small helpers


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"2w"``."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        match = _DURATION.match(str(text))
        if match is None:
            raise ValidationError(
                f"cannot read the duration {text!r}: expected a number with an optional "
                "unit s, m, h, d or w (e.g. 7d)"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not seconds > 0:
        raise ValidationError(f"a duration must be positive, got {text!r}")
    return seconds


def _when(timestamp: float) -> str:
    try:
        return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return f"t={timestamp}"


def _unpack_signed(data: Any, tag: str, what: str, max_bytes: int) -> tuple[bytes, bytes, dict]:
    """``(body_bytes, signature, body)`` of a ``[tag, version, body, signature]`` form."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TokenError(f"{what} must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise TokenError(f"{what} of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        outer = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise TokenError(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(outer, list) or len(outer) != 4:
        raise TokenError(f"{what} must be a list of 4 fields [tag, version, body, signature]")
    found_tag, version, body_bytes, signature = outer
    if found_tag != tag:
        raise TokenError(f"{what} has the tag {_short(found_tag)}, expected {tag!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version != _VERSION:
        raise TokenError(f"{what} has version {_short(version)}; this swarmgrad reads {_VERSION}")
    if not isinstance(body_bytes, bytes) or not isinstance(signature, bytes):
        raise TokenError(f"{what}: the body and the signature must be bytes")
    if len(signature) != _SIGNATURE_BYTES:
        raise TokenError(f"{what}: a signature is {_SIGNATURE_BYTES} bytes, got {len(signature)}")
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=False)
    except Exception as e:
        raise TokenError(f"{what}: the body is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(body, dict):
        raise TokenError(f"{what}: the body must be a map, got {type(body).__name__}")
    return body_bytes, signature, body


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field(body: dict, name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    if name not in body:
        raise TokenError(f"{what} lacks the field {name!r}")
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TokenError(f"{what}: field {name!r} has the wrong type {type(value).__name__}")
    return value


def _time_field(body: dict, name: str, what: str) -> float:
    value = float(_field(body, name, (int, float), what))
    if not (0 <= value < 1e11):  # finite, after 1970, before year 5000
        raise TokenError(f"{what}: field {name!r} is not a plausible time: {value!r}")
    return value


def _peer_field(body: dict, name: str, what: str) -> PeerID:
    raw = _field(body, name, bytes, what)
    try:
        return PeerID(raw)
    except ValidationError as e:
        raise TokenError(f"{what}: field {name!r} is not a PeerID: {e}") from None


# ------------------------------------------------------------------------ signed records


class _SignedRecord:
    """What the authority's two records share: a msgpack ``body`` signed under a tag of
    its kind, and the wire form ``[tag, version, body, signature]``."""

    _tag: str  # the first field of the wire form
    _signing_tag: bytes  # what the signature covers before the body
    body: bytes
    signature: bytes

    @property
    def signed_message(self) -> bytes:
        return self._signing_tag + self.body

    def encode(self) -> bytes:
        return msgpack.packb([self._tag, _VERSION, self.body, self.signature])

    @classmethod
    def _sign(cls, identity: Identity, body: bytes) -> bytes:
        """The wire form of ``body`` signed by ``identity``."""
        signature = identity.sign(cls._signing_tag + body)
        return msgpack.packb([cls._tag, _VERSION, body, signature])


@dataclass(frozen=True)
class AccessToken(_SignedRecord):
    """Admission of one PeerID, in one role, from ``issued_at`` until ``expires_at`` (UNIX
    seconds), signed by ``issuer``. :meth:`decode` only parses; :class:`Admission` checks
    the signature, the issuer, the times and revocations."""

    peer_id: PeerID
    role: Role
    issued_at: float
    expires_at: float
    token_id: bytes
    issuer: PeerID
    body: bytes = field(repr=False)
    signature: bytes = field(repr=False)
    _tag: ClassVar[str] = "swarmgrad-token"
    _signing_tag: ClassVar[bytes] = b"swarmgrad-access-token-v1|"

    def to_text(self) -> str:
        return TOKEN_TEXT_PREFIX + base64.urlsafe_b64encode(self.encode()).decode().rstrip("=")

    @property
    def token_id_hex(self) -> str:
        return self.token_id.hex()

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> AccessToken:
        """Parse the wire form; TokenError, naming what is wrong, for anything else."""
        what = "access token"
        body_bytes, signature, body = _unpack_signed(data, cls._tag, what, MAX_TOKEN_BYTES)
        peer_id = _peer_field(body, "peer", what)
        issuer = _peer_field(body, "iss", what)
        role_name = _field(body, "role", str, what)
        try:
            role = Role(role_name)
        except ValueError:
            known = ", ".join(r.value for r in Role)
            raise TokenError(f"{what}: unknown role {_short(role_name)} (known: {known})") from None
        issued_at = _time_field(body, "iat", what)
        expires_at = _time_field(body, "exp", what)
        if expires_at <= issued_at:
            raise TokenError(f"{what} expires ({expires_at}) before it is issued ({issued_at})")
        token_id = _field(body, "id", bytes, what)
        if len(token_id) != TOKEN_ID_BYTES:
            raise TokenError(f"{what}: a token id is {TOKEN_ID_BYTES} bytes, got {len(token_id)}")
        return cls(peer_id, role, issued_at, expires_at, token_id, issuer, body_bytes, signature)

    @classmethod
    def from_text(cls, text: str | bytes) -> AccessToken:
        """Parse the text form (``sgt1....``, surrounding whitespace allowed)."""
        if isinstance(text, bytes | bytearray):
            try:
                text = bytes(text).decode("ascii")
            except UnicodeDecodeError:
                raise TokenError("a token's text form is ASCII") from None
        text = text.strip()
        if not text.startswith(TOKEN_TEXT_PREFIX):
            raise TokenError(f"an access token's text starts with {TOKEN_TEXT_PREFIX!r}")
        payload = text[len(TOKEN_TEXT_PREFIX) :]
        if len(payload) > 2 * MAX_TOKEN_BYTES:
            raise TokenError(f"access token text of {len(payload)} characters is too long")
        try:
            raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        except ValueError as e:
            raise TokenError(f"access token text is not url-safe base64: {e}") from None
        return cls.decode(raw)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AccessToken:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenError(f"cannot read the access token file {str(path)!r}: {e}") from None
        try:
            return cls.from_text(text)
        except TokenError as e:
            raise TokenError(f"access token file {str(path)!r}: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_text() + "\n")

    def describe(self) -> str:
        return (
            f"{self.role.value} token {self.token_id_hex[:8]} for {self.peer_id}, "
            f"valid until {_when(self.expires_at)}"
        )


@dataclass(frozen=True)
class RevocationList(_SignedRecord):
    """PeerIDs and token ids the authority no longer admits. Each list replaces the
    previous one (the higher ``serial`` wins), so it holds every revocation still in
    force."""

    issuer: PeerID
    serial: int
    issued_at: float
    expires_at: float
    peers: frozenset[PeerID]
    token_ids: frozenset[bytes]
    body: bytes = field(repr=False)
    signature: bytes = field(repr=False)
    _tag: ClassVar[str] = "swarmgrad-revocations"
    _signing_tag: ClassVar[bytes] = b"swarmgrad-revocation-list-v1|"

    def revokes(self, token: AccessToken) -> bool:
        return token.peer_id in self.peers or token.token_id in self.token_ids

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> RevocationList:
        what = "revocation list"
        body_bytes, signature, body = _unpack_signed(data, cls._tag, what, MAX_REVOCATION_BYTES)
        issuer = _peer_field(body, "iss", what)
        serial = _field(body, "serial", int, what)
        if not 0 <= serial < 2**63:
            raise TokenError(f"{what}: serial {serial} out of range")
        issued_at = _time_field(body, "iat", what)
        expires_at = _time_field(body, "exp", what)
        peers_raw = _field(body, "peers", list, what)
        tokens_raw = _field(body, "tokens", list, what)
        peers = set()
        for raw in peers_raw:
            if not isinstance(raw, bytes):
                raise TokenError(f"{what}: revoked peers must be PeerID bytes")
            try:
                peers.add(PeerID(raw))
            except ValidationError as e:
                raise TokenError(f"{what}: a revoked peer is not a PeerID: {e}") from None
        if not all(isinstance(t, bytes) and len(t) == TOKEN_ID_BYTES for t in tokens_raw):
            raise TokenError(f"{what}: revoked token ids must be {TOKEN_ID_BYTES} bytes each")
        return cls(
            issuer,
            serial,
            issued_at,
            expires_at,
            frozenset(peers),
            frozenset(tokens_raw),
            body_bytes,
            signature,
        )


# ------------------------------------------------------------------------ the authority


class Authority:
    """The signing side: issues tokens and revocation lists. Keep its key file secret
    (it is written with mode 0600, in the same format as peer identity files)."""

    def __init__(self, identity: Identity):
        self.identity = identity

    @classmethod
    def generate(cls) -> Authority:
        return cls(Identity.generate())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Authority:
        return cls(Identity.load(path))

    def save(self, path: str | os.PathLike) -> None:
        self.identity.save(path)

    @property
    def public_key(self) -> PeerID:
        """The authority's public key, written like a PeerID: what peers pass as
        ``authority=`` / ``--authority-key``."""
        return self.identity.peer_id

    def issue(
        self,
        peer_id: PeerID | str,
        role: Role | str = Role.TRAINER,
        lifetime: float | str = "7d",
        *,
        issued_at: float | None = None,
    ) -> AccessToken:
        """A token admitting ``peer_id`` in ``role`` for ``lifetime`` (seconds or "7d")."""
        if isinstance(peer_id, str):
            peer_id = PeerID.from_base58(peer_id)
        role = Role(role) if isinstance(role, str) else role
        now = time.time() if issued_at is None else float(issued_at)
        body = msgpack.packb(
            {
                "peer": peer_id.to_bytes(),
                "role": role.value,
                "iat": int(now),
                "exp": int(now + parse_duration(lifetime)),
                "id": os.urandom(TOKEN_ID_BYTES),
                "iss": self.public_key.to_bytes(),
            }
        )
        return AccessToken.decode(AccessToken._sign(self.identity, body))

    def revocation_list(
        self,
        *,
        peers: Iterable[PeerID] = (),
        token_ids: Iterable[bytes] = (),
        serial: int,
        lifetime: float | str = "6d",
        issued_at: float | None = None,
    ) -> RevocationList:
        now = time.time() if issued_at is None else float(issued_at)
        body = msgpack.packb(
            {
                "iss": self.public_key.to_bytes(),
                "serial": int(serial),
                "iat": now,
                "exp": now + parse_duration(lifetime),
                "peers": sorted(p.to_bytes() for p in peers),
                "tokens": sorted(bytes(t) for t in token_ids),
            }
        )
        return RevocationList.decode(RevocationList._sign(self.identity, body))


def load_authority_key(spec: PeerID | str | os.PathLike | Authority) -> PeerID:
    """The authority's public key from: a PeerID, its text (``12D3KooW...``), a file
    holding that text (``authority.pub``), or the authority's private key file."""
    if isinstance(spec, PeerID):
        key = spec
    elif isinstance(spec, Authority):
        key = spec.public_key
    else:
        text = str(spec).strip()
        path = Path(text)
        if path.is_file():
            data = path.read_bytes()
            try:
                key = PeerID.from_base58(data.decode("ascii").strip())
            except (UnicodeDecodeError, ValidationError):
                try:
                    key = Identity.load(path).peer_id
                except Exception as e:
                    raise TokenError(
                        f"{text!r} holds neither an authority public key (12D3KooW...) nor "
                        f"an authority key file: {e}"
                    ) from None
        else:
            try:
                key = PeerID.from_base58(text)
            except ValidationError as e:
                raise TokenError(
                    f"the authority key {text!r} is neither an existing file nor a public "
                    f"key such as 12D3KooW...: {e}"
                ) from None
    try:
        key.public_key_bytes()
    except ValidationError as e:
        raise TokenError(f"the authority key must embed an ed25519 key: {e}") from None
    return key


# ------------------------------------------------------------------------ the peer's side

TokenSource = AccessToken | bytes | str | os.PathLike | Callable[[], Any] | None


class Admission:
    """A peer's admission policy: the authority it trusts, the token it presents, and the
    revocations it has heard of.

    ``token`` is where this peer's own token comes from, and how it renews:

    * a path to a token file (the text form, as ``swarmgrad authority issue`` writes it):
      re-read whenever the token held is within ``renew_before`` of expiring, so renewing
      is replacing the file (by the authority's tooling, a cron job, a person);
    * a callable returning a token (:class:`AccessToken`, wire bytes or text), sync or
      async: called at the same moments, e.g. to ask the authority's web service;
    * a fixed :class:`AccessToken`, wire bytes or text: never renewed;
    * None: this peer presents no token (every admitting peer will refuse it).

    ``renew_before`` is a fraction of the token's lifetime (0.25: the last quarter) or,
    if above 1, seconds. Times are UNIX seconds from ``time_fn``; ``clock_slack``
    tolerates clocks that disagree by that much.
    """

    def __init__(
        self,
        authority_key: PeerID | str | os.PathLike | Authority,
        token: TokenSource = None,
        *,
        renew_before: float = 0.25,
        check_interval: float = 10.0,
        revocation_refresh: float = 20.0,
        clock_slack: float = 30.0,
        role_handlers: dict[Role, tuple[str, ...] | None] | None = None,
        verified_cache_size: int = _VERIFIED_CACHE_SIZE,
        time_fn: Callable[[], float] = get_dht_time,
    ):
        self.authority = load_authority_key(authority_key)
        self._authority_key = self.authority.public_key_bytes()
        self.renew_before = float(renew_before)
        self.check_interval = float(check_interval)
        self.revocation_refresh = float(revocation_refresh)
        self.clock_slack = float(clock_slack)
        self.role_handlers = dict(ROLE_HANDLERS if role_handlers is None else role_handlers)
        self.time_fn = time_fn
        self.revocations: RevocationList | None = None
        # tokens whose signature we checked: a peer presents the same token on every
        # connection for days, and a signature check is most of the cost of admission
        self._verified: OrderedDict[bytes, AccessToken] = OrderedDict()
        self.verified_cache_size = verified_cache_size
        self._allowed: dict[tuple[Role, str], bool] = {}
        self._source: Callable[[], Any] | None = None
        self._source_name = "none"
        self._token: AccessToken | None = None
        self.peer_id: PeerID | None = None
        self.renewals = 0
        if token is None:
            pass
        elif isinstance(token, AccessToken):
            self._token = token
            self._source_name = "fixed token"
        elif isinstance(token, bytes | bytearray):
            self._token = AccessToken.decode(token)
            self._source_name = "fixed token"
        elif isinstance(token, str) and token.strip().startswith(TOKEN_TEXT_PREFIX):
            self._token = AccessToken.from_text(token)
            self._source_name = "fixed token"
        elif isinstance(token, str | os.PathLike):
            path = Path(token)
            self._source = lambda: AccessToken.load(path)
            self._source_name = f"token file {str(path)!r}"
            self._token = AccessToken.load(path)
        elif callable(token):
            self._source = token
            self._source_name = f"token callback {getattr(token, '__name__', token)!r}"
        else:
            raise ValidationError(
                f"token must be a path, a token, wire bytes, a callable or None; got "
                f"{type(token).__name__}"
            )

    # ---------------------------------------------------------------- own token

    @property
    def token(self) -> AccessToken | None:
        """The token this peer presents."""
        return self._token

    @property
    def token_bytes(self) -> bytes | None:
        return None if self._token is None else self._token.encode()

    @property
    def role(self) -> Role | None:
        return None if self._token is None else self._token.role

    def bind(self, peer_id: PeerID) -> None:
        """Called by the peer at start: our token must admit us, else AdmissionRefused
        with what to fix. A callable source is called now if no token is held yet."""
        self.peer_id = peer_id
        if self._token is None and self._source is not None:
            self._adopt(_coerce_token(self._call_source_sync()))
        if self._token is None:
            logger.warning(
                "admission: peer %s trusts authority %s but has no access token; every "
                "peer of the swarm will refuse it",
                peer_id,
                self.authority,
            )
            return
        try:
            self.check(self._token.encode(), peer_id)
        except AdmissionRefused as e:
            raise AdmissionRefused(
                f"this peer's own access token ({self._source_name}) does not admit it: {e}",
                reason=e.reason,
            ) from None

    def needs_renewal(self) -> bool:
        token = self._token
        if self._source is None:
            return False
        if token is None:
            return True
        lifetime = token.expires_at - token.issued_at
        margin = self.renew_before * lifetime if self.renew_before <= 1 else self.renew_before
        return self.time_fn() >= token.expires_at - margin

    async def renew(self) -> bool:
        """Fetch a token from the source; adopt it if it admits us for longer. True if a
        new token was adopted. Failures are logged (the old token stays until expiry)."""
        if self._source is None:
            return False
        try:
            result = self._source()
            if inspect.isawaitable(result):
                result = await result
            token = _coerce_token(result)
        except Exception as e:
            logger.warning("admission: cannot renew the access token from %s: %s",
                           self._source_name, e)  # fmt: skip
            return False
        return self._adopt(token)

    def _call_source_sync(self) -> Any:
        result = self._source()
        if inspect.isawaitable(result):
            # bind() runs inside the event loop: an async source must already hold a token
            close = getattr(result, "close", None)
            if close is not None:
                close()
            raise ValidationError(
                "an async token callback cannot give the first token; pass the first token "
                "(or a token file) and let the callback renew it"
            )
        return result

    def _adopt(self, token: AccessToken | None) -> bool:
        if token is None or (self._token is not None and token.encode() == self._token.encode()):
            return False
        if self.peer_id is not None:
            try:
                self.check(token.encode(), self.peer_id)
            except AdmissionRefused as e:
                logger.warning("admission: the renewed token from %s is unusable: %s",
                               self._source_name, e)  # fmt: skip
                return False
        if self._token is not None and token.expires_at <= self._token.expires_at:
            return False
        self._token = token
        self.renewals += 1
        logger.info("admission: renewed this peer's token (%s)", token.describe())
        return True

    # ---------------------------------------------------------------- checking others

    def check(self, raw: bytes | None, peer_id: PeerID) -> AccessToken:
        """The token ``raw`` admits ``peer_id`` now, or AdmissionRefused says why."""
        if not raw:
            raise AdmissionRefused(
                f"{peer_id} presented no access token; this swarm admits only holders of "
                f"tokens from authority {self.authority}",
                reason=RefusalReason.NO_TOKEN.value,
            )
        token = self._verified.get(raw)
        if token is None:
            token = self._verify(raw, peer_id)
            if self.verified_cache_size > 0:
                self._verified[bytes(raw)] = token
                if len(self._verified) > self.verified_cache_size:
                    self._verified.popitem(last=False)
        if token.peer_id != peer_id:
            raise AdmissionRefused(
                f"the access token presented by {peer_id} was issued for {token.peer_id}",
                reason=RefusalReason.WRONG_PEER.value,
            )
        problem = self.problem_with(token)
        if problem is not None:
            reason, message = problem
            raise AdmissionRefused(message, reason=reason.value)
        return token

    def _verify(self, raw: bytes, peer_id: PeerID) -> AccessToken:
        try:
            token = AccessToken.decode(raw)
        except TokenError as e:
            raise AdmissionRefused(
                f"{peer_id} presented a malformed access token: {e}",
                reason=RefusalReason.MALFORMED.value,
            ) from None
        if token.issuer != self.authority:
            raise AdmissionRefused(
                f"the access token of {peer_id} was issued by authority {token.issuer}; "
                f"this swarm trusts {self.authority}",
                reason=RefusalReason.WRONG_AUTHORITY.value,
            )
        if not verify_signature(self._authority_key, token.signature, token.signed_message):
            raise AdmissionRefused(
                f"the access token of {peer_id} carries a forged signature (not made by "
                f"authority {self.authority})",
                reason=RefusalReason.BAD_SIGNATURE.value,
            )
        return token

    def problem_with(self, token: AccessToken) -> tuple[RefusalReason, str] | None:
        """What, if anything, stops an already verified token from admitting its holder
        now: expiry, a start in the future, a revocation."""
        now = self.time_fn()
        if now > token.expires_at + self.clock_slack:
            return RefusalReason.EXPIRED, (
                f"the access token of {token.peer_id} expired at {_when(token.expires_at)}"
            )
        if now < token.issued_at - self.clock_slack:
            return RefusalReason.NOT_YET_VALID, (
                f"the access token of {token.peer_id} is valid only from "
                f"{_when(token.issued_at)} (clocks differ?)"
            )
        revocations = self.revocations
        if revocations is not None and revocations.revokes(token):
            what = "peer" if token.peer_id in revocations.peers else "token"
            return RefusalReason.REVOKED, (
                f"the authority revoked the {what} {token.peer_id} (token "
                f"{token.token_id_hex[:8]}, revocation list {revocations.serial})"
            )
        return None

    def allows(self, role: Role | None, handler: str) -> bool:
        """May a holder of ``role`` call ``handler`` on us?"""
        if role is None:
            return False
        key = (role, handler)
        allowed = self._allowed.get(key)
        if allowed is None:
            patterns = self.role_handlers.get(role, ())
            allowed = patterns is None or any(
                handler == p or (p.endswith(".") and handler.startswith(p)) for p in patterns
            )
            if len(self._allowed) < 4096:
                self._allowed[key] = allowed
        return allowed

    # ---------------------------------------------------------------- revocations

    def apply_revocations(self, data: bytes | RevocationList) -> bool:
        """Adopt a revocation list if the authority signed it and it is newer than ours.
        True if adopted; TokenError for a list that is malformed or not the authority's."""
        revocations = data if isinstance(data, RevocationList) else RevocationList.decode(data)
        self.verify_revocations(revocations)
        current = self.revocations
        if current is not None and revocations.serial <= current.serial:
            return False
        self.revocations = revocations
        logger.info(
            "admission: revocation list %d from authority %s: %d peers, %d tokens revoked",
            revocations.serial,
            self.authority,
            len(revocations.peers),
            len(revocations.token_ids),
        )
        return True

    def verify_revocations(self, revocations: RevocationList) -> None:
        if revocations.issuer != self.authority:
            raise TokenError(
                f"revocation list {revocations.serial} was issued by {revocations.issuer}, "
                f"not by this swarm's authority {self.authority}"
            )
        signed = revocations.signed_message
        if not verify_signature(self._authority_key, revocations.signature, signed):
            raise TokenError(f"revocation list {revocations.serial} carries a forged signature")


def _coerce_token(value: Any) -> AccessToken | None:
    if value is None or isinstance(value, AccessToken):
        return value
    if isinstance(value, bytes | bytearray):
        text = bytes(value)
        if text.strip().startswith(TOKEN_TEXT_PREFIX.encode()):
            return AccessToken.from_text(text)
        return AccessToken.decode(text)
    if isinstance(value, str):
        return AccessToken.from_text(value)
    raise ValidationError(f"a token source returned {type(value).__name__}, not a token")


def make_admission(
    authority: Admission | PeerID | str | os.PathLike | Authority | None,
    access_token: TokenSource = None,
    **kwargs: Any,
) -> Admission | None:
    """What ``authority=`` / ``access_token=`` of Peer and DHT construction mean."""
    if authority is None:
        if access_token is not None:
            raise ValidationError("access_token= needs authority= (the authority's public key)")
        return None
    if isinstance(authority, Admission):
        if access_token is not None or kwargs:
            raise ValidationError(
                "authority= is an Admission already: give the token and options to it"
            )
        return authority
    return Admission(authority, access_token, **kwargs)
