"""The peer-to-peer network: identities, addresses, secure multiplexed connections, RPC,
relays, and (in :mod:`swarmgrad.net.sim`) a simulated network with a virtual clock."""

from swarmgrad.net.admission import AccessToken, Admission, Authority, RevocationList, Role
from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.mux import Connection, Stream
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import Blob, RPCContext, ServicerBase

P2PContext = RPCContext  # hivemind's name for the handler context

__all__ = [
    "AccessToken",
    "Admission",
    "Authority",
    "Blob",
    "Connection",
    "Identity",
    "Multiaddr",
    "P2PContext",
    "Peer",
    "PeerID",
    "RPCContext",
    "RevocationList",
    "Role",
    "ServicerBase",
    "Stream",
]
