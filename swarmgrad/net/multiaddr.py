"""Peer addresses: the subset of libp2p multiaddrs that swarmgrad dials.

Accepted forms (the first is canonical and is what ``str()`` gives)::

    /ip4/1.2.3.4/tcp/31337[/p2p/<PeerID>]
    /ip6/2001:db8::1/tcp/31337[/p2p/<PeerID>]
    /dns/example.org/tcp/31337[/p2p/<PeerID>]           (also /dns4 and /dns6)
    <relay address>/p2p/<RELAY ID>/p2p-circuit[/p2p/<TARGET ID>]
    1.2.3.4:31337   [2001:db8::1]:31337   example.org:31337

``/ipfs/<PeerID>`` is read as ``/p2p/<PeerID>``. A relayed address reaches the target
peer through the relay: ``.host`` and ``.port`` are the relay's (that is where to dial),
``.peer_id`` is the target's and ``.relay`` is the relay's own address.

Port 0 ("let the OS choose") is refused unless the caller passes ``allow_port_zero=True``,
as one does for a listen address.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError

__all__ = ["Multiaddr"]

_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")
_KNOWN_HINT = (
    "expected /ip4, /ip6, /dns, /dns4 or /dns6, then /tcp, optionally /p2p and /p2p-circuit"
)
_MAX_ADDRESS_LENGTH = 1024
_MAX_DNS_NAME_LENGTH = 253


class ProtocolRegistry:
    """The multiaddr protocols swarmgrad parses (py-multiaddr's ``registry`` argument,
    which hivemind's ``Multiaddr`` takes, names a pluggable set; swarmgrad's is fixed)."""

    protocols = (*_HOST_PROTOCOLS, "tcp", "p2p", "p2p-circuit")

    def __contains__(self, name: object) -> bool:
        return name in self.protocols


DEFAULT_REGISTRY = ProtocolRegistry()


def _check_ip4(value: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError as e:
        raise ValueError(f"{value!r} is not a valid IPv4 address ({e})") from None


def _check_ip6(value: str) -> str:
    if "%" in value:
        raise ValueError(f"{value!r}: IPv6 zone ids are not supported")
    try:
        return str(ipaddress.IPv6Address(value))
    except ValueError as e:
        raise ValueError(f"{value!r} is not a valid IPv6 address ({e})") from None


def _check_dns_name(value: str) -> str:
    name = value.lower()
    if not name or len(name) > _MAX_DNS_NAME_LENGTH or not name.isascii():
        raise ValueError(f"{value!r} is not a valid DNS name")
    for label in name.split("."):
        if not 0 < len(label) <= 63:
            raise ValueError(f"{value!r} is not a valid DNS name (empty or too long label)")
        if label[0] == "-" or label[-1] == "-":
            raise ValueError(f"{value!r} is not a valid DNS name (label starts or ends with -)")
        if not all(c.isalnum() or c in "-_" for c in label):
            raise ValueError(f"{value!r} is not a valid DNS name (bad character)")
    return name


_HOST_CHECKS = {
    "ip4": _check_ip4,
    "ip6": _check_ip6,
    "dns": _check_dns_name,
    "dns4": _check_dns_name,
    "dns6": _check_dns_name,
}


def _check_port(value: Any, allow_port_zero: bool) -> int:
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit() and len(value) <= 5):
            raise ValueError(f"port {value!r} is not a number in 1..65535")
        port = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        port = value
    else:
        raise ValueError(f"port {value!r} is not a number in 1..65535")
    lowest = 0 if allow_port_zero else 1
    if not lowest <= port <= 65535:
        if port == 0:
            raise ValueError("port 0 is only allowed for listen addresses (allow_port_zero)")
        raise ValueError(f"port {port} is out of range {lowest}..65535")
    return port


def _infer_host(host: str) -> tuple[str, str]:
    """Protocol and canonical form of a bare host: IPv6 (bracketed or not), dotted
    decimal IPv4, or else a DNS name."""
    if host.startswith("[") and host.endswith("]"):
        return "ip6", _check_ip6(host[1:-1])
    if ":" in host:
        return "ip6", _check_ip6(host)
    if host and all(c.isdigit() or c == "." for c in host):
        return "ip4", _check_ip4(host)
    return "dns", _check_dns_name(host)


def _as_peer_id(value: PeerID | str) -> PeerID:
    if isinstance(value, PeerID):
        return value
    if isinstance(value, str):
        return PeerID.from_base58(value)
    raise ValidationError(f"expected a PeerID or its base58 string, got {type(value).__name__}")


class Multiaddr:
    """An immutable, validated peer address.

    ``Multiaddr(text)`` and ``Multiaddr.parse(text)`` read any accepted form and raise
    ValidationError naming the offending part. Equal addresses have equal canonical
    strings; instances are hashable.
    """

    __slots__ = ("host", "peer_id", "port", "protocol", "relay")

    protocol: str
    """``"ip4"``, ``"ip6"``, ``"dns"``, ``"dns4"`` or ``"dns6"``."""
    host: str
    port: int
    peer_id: PeerID | None
    relay: Multiaddr | None

    def __init__(
        self,
        addr: str | Multiaddr,
        *,
        registry: ProtocolRegistry = DEFAULT_REGISTRY,
        allow_port_zero: bool = False,
    ):
        # ``addr`` and ``registry`` are hivemind's names (its Multiaddr is py-multiaddr's)
        address = addr
        if registry is not DEFAULT_REGISTRY:
            raise ValidationError(
                "swarmgrad parses a fixed set of multiaddr protocols "
                f"({', '.join(DEFAULT_REGISTRY.protocols)}); custom registries are not supported"
            )
        if isinstance(address, Multiaddr):
            parsed = address
            if parsed.port == 0 and not allow_port_zero:
                raise ValidationError(
                    f"invalid address {str(parsed)!r}: port 0 is only allowed for listen "
                    "addresses (allow_port_zero)"
                )
        elif isinstance(address, str):
            parsed = _parse(address, allow_port_zero)
        else:
            raise ValidationError(
                f"expected a multiaddr string or Multiaddr, got {type(address).__name__}"
            )
        for name in self.__slots__:
            object.__setattr__(self, name, getattr(parsed, name))

    @classmethod
    def parse(cls, address: str | Multiaddr, *, allow_port_zero: bool = False) -> Multiaddr:
        """Parse ``address``; a Multiaddr is returned as is (after the port check)."""
        if isinstance(address, Multiaddr) and (address.port != 0 or allow_port_zero):
            return address
        return cls(address, allow_port_zero=allow_port_zero)

    @classmethod
    def from_host_port(
        cls,
        host: str,
        port: int,
        peer_id: PeerID | str | None = None,
        *,
        allow_port_zero: bool = False,
    ) -> Multiaddr:
        """Build an address from a host (IPv4, IPv6 or DNS name) and a port."""
        try:
            port = _check_port(port, allow_port_zero)
            if not isinstance(host, str):
                raise ValueError(f"host {host!r} is not a string")
            protocol, canonical = _infer_host(host)
        except ValueError as e:
            raise ValidationError(f"invalid address {host!r} port {port!r}: {e}") from None
        pid = None if peer_id is None else _as_peer_id(peer_id)
        return cls._make(protocol, canonical, port, pid, None)

    @classmethod
    def _make(
        cls,
        protocol: str,
        host: str,
        port: int,
        peer_id: PeerID | None,
        relay: Multiaddr | None,
    ) -> Multiaddr:
        """Assemble from parts that are already validated."""
        self = object.__new__(cls)
        for name, value in (
            ("protocol", protocol),
            ("host", host),
            ("port", port),
            ("peer_id", peer_id),
            ("relay", relay),
        ):
            object.__setattr__(self, name, value)
        return self

    # derived views

    @property
    def is_relayed(self) -> bool:
        return self.relay is not None

    @property
    def host_port(self) -> str:
        """``"host:port"`` (IPv6 in brackets) of the machine to dial."""
        host = f"[{self.host}]" if self.protocol == "ip6" else self.host
        return f"{host}:{self.port}"

    def with_peer_id(self, peer_id: PeerID | str) -> Multiaddr:
        """The same address ending in ``/p2p/<peer_id>`` (the target, for a relayed one)."""
        return Multiaddr._make(
            self.protocol, self.host, self.port, _as_peer_id(peer_id), self.relay
        )

    def without_peer_id(self) -> Multiaddr:
        """The same address without its final ``/p2p/...`` (a relay keeps its own id)."""
        return Multiaddr._make(self.protocol, self.host, self.port, None, self.relay)

    # formatting, comparison

    def __str__(self) -> str:
        text = _TEXT_CACHE.get(self._key())
        if text is None:
            text = self._format()
            if len(_TEXT_CACHE) > 65536:
                _TEXT_CACHE.clear()
            _TEXT_CACHE[self._key()] = text
        return text

    def _format(self) -> str:
        if self.relay is not None:
            text = f"{self.relay}/p2p-circuit"
        else:
            text = f"/{self.protocol}/{self.host}/tcp/{self.port}"
        if self.peer_id is not None:
            text += f"/p2p/{self.peer_id}"
        return text

    def __repr__(self) -> str:
        return f"Multiaddr({str(self)!r})"

    def _key(self) -> tuple:
        return (self.protocol, self.host, self.port, self.peer_id, self.relay)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Multiaddr):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Multiaddr is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Multiaddr is immutable (cannot delete {name!r})")

    def __reduce__(self):
        return (_restore, (str(self),))


def _restore(text: str) -> Multiaddr:
    return Multiaddr(text, allow_port_zero=True)


_TEXT_CACHE: dict[tuple, str] = {}  # addresses are formatted into every DHT answer


@functools.lru_cache(maxsize=8192)  # immutable results: peers re-announce the same strings
def _parse(text: str, allow_port_zero: bool) -> Multiaddr:
    def fail(reason: str) -> ValidationError:
        shown = text if len(text) <= 200 else text[:197] + "..."
        return ValidationError(f"invalid address {shown!r}: {reason}")

    if len(text) > _MAX_ADDRESS_LENGTH:
        raise fail(f"longer than {_MAX_ADDRESS_LENGTH} characters")
    if not text.startswith("/"):
        return _parse_host_port(text, allow_port_zero, fail)

    parts = text[1:].split("/")
    pos = 0

    def take_value(protocol: str) -> str:
        nonlocal pos
        if pos >= len(parts) or parts[pos] == "":
            raise fail(f"'/{protocol}' needs a value")
        value = parts[pos]
        pos += 1
        return value

    def take_peer_id() -> PeerID:
        value = take_value("p2p")
        try:
            return PeerID.from_base58(value)
        except ValidationError as e:
            raise fail(f"bad /p2p value: {e}") from None

    def read_direct() -> Multiaddr:
        nonlocal pos
        protocol = parts[pos] if pos < len(parts) else ""
        if protocol == "":
            raise fail(f"empty component; {_KNOWN_HINT}")
        if protocol not in _HOST_PROTOCOLS:
            raise fail(
                f"unsupported protocol {protocol!r} where a host was expected; {_KNOWN_HINT}"
            )
        pos += 1
        value = take_value(protocol)
        try:
            host = _HOST_CHECKS[protocol](value)
        except ValueError as e:
            raise fail(str(e)) from None
        if pos >= len(parts):
            raise fail(f"missing /tcp/<port> after '/{protocol}/{value}'")
        if parts[pos] != "tcp":
            raise fail(
                f"unsupported protocol {parts[pos]!r} after '/{protocol}/{value}' "
                "(swarmgrad speaks /tcp only)"
            )
        pos += 1
        port_text = take_value("tcp")
        try:
            port = _check_port(port_text, allow_port_zero)
        except ValueError as e:
            raise fail(str(e)) from None
        peer_id = None
        if pos < len(parts) and parts[pos] in ("p2p", "ipfs"):
            pos += 1
            peer_id = take_peer_id()
        return Multiaddr._make(protocol, host, port, peer_id, None)

    address = read_direct()
    if pos < len(parts) and parts[pos] == "p2p-circuit":
        if address.peer_id is None:
            raise fail("/p2p-circuit must follow the relay's /p2p/<PeerID>")
        pos += 1
        target = None
        if pos < len(parts) and parts[pos] in ("p2p", "ipfs"):
            pos += 1
            target = take_peer_id()
        address = Multiaddr._make(address.protocol, address.host, address.port, target, address)
    if pos < len(parts):
        rest = "/" + "/".join(parts[pos:])
        raise fail(f"unexpected {rest!r} after {str(address)!r}")
    return address


def _parse_host_port(text: str, allow_port_zero: bool, fail) -> Multiaddr:
    if text.startswith("["):
        host, sep, port_text = text.partition("]:")
        host += "]"
        if not sep:
            raise fail("expected '[IPv6]:port'")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise fail("expected a multiaddr starting with '/' or 'host:port'")
        if ":" in host:
            raise fail("an IPv6 host needs brackets: '[IPv6]:port'")
    try:
        protocol, canonical = _infer_host(host)
        port = _check_port(port_text, allow_port_zero)
    except ValueError as e:
        raise fail(str(e)) from None
    return Multiaddr._make(protocol, canonical, port, None, None)
