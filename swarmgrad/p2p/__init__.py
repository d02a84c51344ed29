"""hivemind's ``hivemind.p2p`` on swarmgrad's transport: ``P2P`` handles with protobuf (or
msgpack) handlers, servicers and stubs, for programs that define their own protocols.

See :mod:`swarmgrad.p2p.p2p_daemon` for what maps to what."""

from swarmgrad.p2p.datastructures import (
    InvalidMessageMarker,
    P2PContext,
    P2PDaemonError,
    P2PHandlerError,
    PeerID,
    PeerInfo,
    RPCError,
    StreamInfo,
)
from swarmgrad.p2p.p2p_daemon import P2P
from swarmgrad.p2p.servicer import ServicerBase, StubBase

__all__ = [
    "InvalidMessageMarker",
    "P2P",
    "P2PContext",
    "P2PDaemonError",
    "P2PHandlerError",
    "PeerID",
    "PeerInfo",
    "RPCError",
    "ServicerBase",
    "StreamInfo",
    "StubBase",
]
