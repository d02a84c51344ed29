"""hivemind's ``hivemind.p2p`` on swarmgrad's transport: ``P2P`` handles with protobuf (or
msgpack) handlers, servicers and stubs, for programs that define their own protocols.

See :mod:`swarmgrad.p2p.p2p_daemon` for what maps to what."""

from swarmgrad.p2p import datastructures
from swarmgrad.p2p.datastructures import *  # noqa: F403 (exactly the names of its __all__)
from swarmgrad.p2p.p2p_daemon import P2P
from swarmgrad.p2p.servicer import ServicerBase, StubBase

# The value types are listed once, in their module's ``__all__``; both forms below are the
# ones type checkers read (PEP 484 re-exports), so ``swarmgrad.p2p.PeerInfo`` stays visible.
__all__ = ["P2P", "ServicerBase", "StubBase"]
__all__ += datastructures.__all__
