"""hivemind's small p2p value types on swarmgrad's identities and addresses."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.utils.errors import RemoteError, SwarmgradError

__all__ = ["P2PContext", "P2PDaemonError", "P2PHandlerError", "PeerID", "PeerInfo", "StreamInfo"]


class P2PDaemonError(SwarmgradError, RuntimeError):
    """The peer could not start (hivemind: the p2pd daemon failed); the message says why."""


class P2PHandlerError(RemoteError):
    """A remote handler failed, or refused the request (hivemind's name for a RemoteError
    raised through :class:`~swarmgrad.p2p.P2P`); the message names the handler and peer."""


@dataclass(frozen=True)
class P2PContext:
    """What a handler registered through :class:`~swarmgrad.p2p.P2P` knows about a call
    (hivemind's shape: the handler's name, our PeerID, the caller's PeerID)."""

    handle_name: str
    local_id: PeerID
    remote_id: PeerID | None = None


@dataclass(frozen=True)
class PeerInfo:
    """A peer this one is connected to and the addresses it is known by."""

    peer_id: PeerID
    addrs: tuple[Multiaddr, ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.peer_id} {','.join(str(a) for a in self.addrs)}"


@dataclass(frozen=True)
class StreamInfo:
    """The far end of a binary stream (hivemind's ``StreamInfo``)."""

    peer_id: PeerID
    addr: Multiaddr | None
    proto: str
