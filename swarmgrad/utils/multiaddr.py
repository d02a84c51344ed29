"""``hivemind.utils.multiaddr``: multiaddrs live in :mod:`swarmgrad.net.multiaddr`; this
module only names them at hivemind's path, importing the net layer on first use."""

__all__ = [*("Multiaddr",)]  # resolved by __getattr__


def __getattr__(name: str):
    if name != "Multiaddr":
        raise AttributeError(f"module 'swarmgrad.utils.multiaddr' has no attribute {name!r}")
    from swarmgrad.net.multiaddr import Multiaddr

    return Multiaddr
