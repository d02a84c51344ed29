"""``hivemind.utils.crypto``: hivemind's key classes, at hivemind's path.

swarmgrad identities are ed25519 (:class:`swarmgrad.net.Identity`); RSA keys exist for
hivemind records and identity files, in :mod:`swarmgrad.dht.crypto`. The names are looked
up there on first use, so this bottom-layer module imports nothing above it.
"""

_NAMES = ("PrivateKey", "PublicKey", "RSAPrivateKey", "RSAPublicKey")
__all__ = [*_NAMES]


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'swarmgrad.utils.crypto' has no attribute {name!r}")
    from swarmgrad.dht import crypto

    try:
        return getattr(crypto, name)
    except AttributeError:
        raise AttributeError(
            f"swarmgrad.utils.crypto.{name} needs RSA keys in swarmgrad.dht.crypto, which this "
            "installation lacks; swarmgrad's own keys are ed25519: swarmgrad.net.Identity"
        ) from None
