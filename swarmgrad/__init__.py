"""swarmgrad: train large neural networks on computers lent over the internet."""

from swarmgrad.net import Identity, Multiaddr, P2PContext, Peer, PeerID, RPCContext
from swarmgrad.utils.errors import (
    ConnectionClosed,
    DeadlineExceeded,
    HandshakeError,
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)
from swarmgrad.utils.timeutils import get_dht_time

__version__ = "0.1.0"
__all__ = [
    "ConnectionClosed",
    "DeadlineExceeded",
    "HandshakeError",
    "Identity",
    "Multiaddr",
    "P2PContext",
    "Peer",
    "PeerID",
    "ProtocolViolation",
    "RPCContext",
    "RemoteError",
    "SwarmgradError",
    "ValidationError",
    "__version__",
    "get_dht_time",
]
