"""hivemind's libp2p keywords, and what swarmgrad does with each.

hivemind's ``DHT(...)`` and ``P2P.create(...)`` pass their keywords to a Go libp2p
daemon. swarmgrad has no daemon: its transport is its own (TCP + TLS 1.3, ed25519
identities, relays through other peers). A hivemind program still runs unchanged:

- keywords with a swarmgrad meaning are honoured (``HONOURED``): addresses, identity file,
  client mode, timeouts, and the relay options, mapped to swarmgrad's relays
  (``use_relay``/``use_auto_relay``: a client-mode peer reserves a relay among its initial
  peers; ``trusted_relays``: the relays to reserve);
- keywords that only configure libp2p (``LIBP2P_ONLY``) are accepted. hivemind's
  default, or a value that asks for what swarmgrad does anyway (``tls=True``,
  ``use_ipfs=False``), passes silently; any
  other gets one ``UserWarning`` per keyword, naming it and what swarmgrad does instead,
  and the run goes on (Python's warning filters show a repeated warning once per place
  by default);
- anything else is a ``TypeError`` naming the keyword (:func:`check_known`).

One table for the ``DHT`` facade and for ``swarmgrad.p2p.P2P.create``:
:func:`take_libp2p_options` pops these keywords from a call's ``**kwargs`` and returns the
swarmgrad options they map to; :func:`warn_libp2p_only_options` warns about values a call
took by name (``P2P.create``'s signature lists them all).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HONOURED",
    "LIBP2P_ONLY",
    "LIBP2P_ONLY_OPTIONS",
    "Libp2pOption",
    "check_known",
    "take_libp2p_options",
    "warn_libp2p_only_options",
]


@dataclass(frozen=True)
class Libp2pOption:
    """A keyword that only configures libp2p: hivemind's default, the values whose meaning
    swarmgrad already has (no warning) and what swarmgrad does instead."""

    default: Any
    matches: Callable[[Any], bool]
    instead: str


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is v or (v is not None and value == v) for v in values)


LIBP2P_ONLY: Mapping[str, Libp2pOption] = {
    "use_ipfs": Libp2pOption(
        False,
        _is(False, None),
        "swarmgrad peers do not bootstrap through IPFS; pass initial_peers as full "
        "multiaddrs (/ip4/.../tcp/.../p2p/...) of swarmgrad peers",
    ),
    "quic": Libp2pOption(
        None, _is(False, None), "connections are TCP + TLS 1.3; QUIC is not offered"
    ),
    "tls": Libp2pOption(
        True,
        _is(True),
        "connections are always TLS 1.3, authenticated by the peers' ed25519 identities; "
        "tls=False is ignored",
    ),
    "nat_port_map": Libp2pOption(
        True,
        _is(False),
        "no UPnP/NAT-PMP port mapping: a peer behind NAT runs with client_mode=True and is "
        "called through relays (or announce a forwarded port with announce_maddrs)",
    ),
    "auto_nat": Libp2pOption(
        True,
        _is(False),
        "no AutoNAT probing: reachability is what host_maddrs, announce_maddrs and client_mode say",
    ),
    "force_reachability": Libp2pOption(
        None,
        _is(None, "public"),
        "a private (unreachable) peer is client_mode=True, reached through relays",
    ),
    "dht_mode": Libp2pOption(
        "server",
        _is("server"),
        "there is no separate libp2p DHT; the swarm DHT's role is set by client_mode",
    ),
    "conn_manager": Libp2pOption(
        True,
        _is(True),
        "one connection per pair of peers, closed after idle_timeout; there is no libp2p "
        "connection manager to turn off",
    ),
    "relay_hop_limit": Libp2pOption(
        0,
        _is(0, None),
        "relays forward one hop; a public peer relays for others unless allow_relay=False",
    ),
    "use_relay_hop": Libp2pOption(
        None, _is(None), "no effect (deprecated in libp2p too); see allow_relay="
    ),
    "use_relay_discovery": Libp2pOption(
        None, _is(None), "no effect (deprecated in libp2p too); relays come from initial_peers"
    ),
    "persistent_conn_max_msg_size": Libp2pOption(
        4 * 1024 * 1024,
        _is(4 * 1024 * 1024),
        "there is no daemon connection; the limit on one message is max_message_size=",
    ),
    "check_if_identity_free": Libp2pOption(
        True,
        _is(False),
        "an identity already in use is not probed for at start; each process should have "
        "its own identity_path",
    ),
    "no_listen": Libp2pOption(
        False, _is(False), "a peer that opens no listener is client_mode=True"
    ),
}

# keywords with a swarmgrad meaning (the DHT facade and P2P.create take them by name)
HONOURED = frozenset(
    {
        "initial_peers",
        "host_maddrs",
        "announce_maddrs",
        "identity_path",
        "client_mode",
        "startup_timeout",
        "idle_timeout",
        "use_relay",
        "use_auto_relay",
        "trusted_relays",
    }
)

# hivemind's P2P.create defaults and what swarmgrad does instead, by keyword
LIBP2P_ONLY_OPTIONS: Mapping[str, tuple[Any, str]] = {
    name: (option.default, option.instead) for name, option in LIBP2P_ONLY.items()
}


def warn_libp2p_only_options(options: Mapping[str, Any], *, where: str = "P2P.create") -> None:
    """One ``UserWarning`` for each libp2p-only keyword in ``options`` whose value is not
    hivemind's default and asks for something swarmgrad does not do, naming it and what
    swarmgrad does instead. Keywords outside :data:`LIBP2P_ONLY` (honoured ones) are left
    to the caller."""
    for name, value in options.items():
        option = LIBP2P_ONLY.get(name)
        if option is None:
            continue
        try:  # hivemind's default (what a program gets without asking) passes silently too
            matched = option.matches(value) or _is(option.default)(value)
        except Exception:  # an unhashable or odd value: it asks for something else
            matched = False
        if not matched:
            warnings.warn(
                f"{where}: {name}={value!r} only configures libp2p, which swarmgrad does not "
                f"run; it has no effect ({option.instead})",
                UserWarning,
                stacklevel=3,
            )


def take_libp2p_options(kwargs: dict[str, Any], *, owner: str = "DHT") -> dict[str, Any]:
    """Pop hivemind's libp2p keywords from ``kwargs``.

    Returns the swarmgrad options the relay keywords map to: ``use_relay`` (from
    ``use_relay``, or True when ``use_auto_relay=True``) and ``relays`` (from
    ``trusted_relays``), only those given. Libp2p-only keywords are dropped, with a
    warning (:func:`warn_libp2p_only_options`) for a value that asks for something
    swarmgrad does not do. ``owner`` names the caller in the warning.
    """
    mapped: dict[str, Any] = {}
    if "use_relay" in kwargs:
        mapped["use_relay"] = bool(kwargs.pop("use_relay"))
    if "use_auto_relay" in kwargs:
        if kwargs.pop("use_auto_relay"):
            if mapped.get("use_relay") is False:
                raise ValueError(f"{owner}: use_auto_relay=True needs use_relay=True")
            mapped["use_relay"] = True
    if "trusted_relays" in kwargs:
        relays = kwargs.pop("trusted_relays")
        if relays is not None:
            if isinstance(relays, str | bytes) or not isinstance(relays, Iterable):
                raise TypeError(
                    f"{owner}: trusted_relays must be a list of multiaddrs, got "
                    f"{type(relays).__name__}"
                )
            mapped["relays"] = [str(r) for r in relays]
    libp2p_only = {name: kwargs.pop(name) for name in list(kwargs) if name in LIBP2P_ONLY}
    warn_libp2p_only_options(libp2p_only, where=owner)
    return mapped


def check_known(kwargs: Mapping[str, Any], known: Iterable[str], *, owner: str) -> None:
    """``TypeError`` naming the first keyword of ``kwargs`` that is not in ``known``, as
    Python reports an unexpected keyword argument."""
    known = set(known)
    for name in kwargs:
        if name not in known:
            raise TypeError(f"{owner} got an unexpected keyword argument {name!r}")
