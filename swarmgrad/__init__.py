"""swarmgrad: train large neural networks on computers lent over the internet."""

from swarmgrad.net import Identity, Multiaddr, P2PContext, Peer, PeerID, RPCContext
from swarmgrad.utils.errors import (
    ConnectionClosed,
    ConnectionIdleClosed,
    DeadlineExceeded,
    HandshakeError,
    ProtocolViolation,
    RemoteError,
    SwarmgradError,
    ValidationError,
)
from swarmgrad.utils.module_alias import install_finder as _install_alias_finder
from swarmgrad.utils.module_alias import install_hivemind_alias
from swarmgrad.utils.timeutils import get_dht_time

# inert until ``hivemind`` is aliased to swarmgrad (install_hivemind_alias, or by hand)
_install_alias_finder()

__version__ = "0.1.0"

# Names that live in heavier packages (torch, the DHT) are imported on first use, so that
# ``import swarmgrad`` stays cheap and ``swarmgrad.DHT`` etc. work as in hivemind.
_LAZY = {
    "DHT": "swarmgrad.dht",
    "DHTNode": "swarmgrad.dht",
    "Ed25519SignatureValidator": "swarmgrad.dht",
    "RSASignatureValidator": "swarmgrad.dht",
    "SchemaValidator": "swarmgrad.dht",
    "CompressionType": "swarmgrad.compression",
    "CompressionBase": "swarmgrad.compression",
    "NoCompression": "swarmgrad.compression",
    "Float16Compression": "swarmgrad.compression",
    "ScaledFloat16Compression": "swarmgrad.compression",
    "Uniform8BitQuantization": "swarmgrad.compression",
    "Quantile8BitQuantization": "swarmgrad.compression",
    "BlockwiseQuantization": "swarmgrad.compression",
    "SizeAdaptiveCompression": "swarmgrad.compression",
    "RoleAdaptiveCompression": "swarmgrad.compression",
    "PerTensorCompression": "swarmgrad.compression",
    "serialize_torch_tensor": "swarmgrad.compression",
    "deserialize_torch_tensor": "swarmgrad.compression",
    "BatchTensorDescriptor": "swarmgrad.moe.protocol",
    "ExpertInfo": "swarmgrad.moe",
    "declare_experts": "swarmgrad.moe",
    "get_experts": "swarmgrad.moe",
    "MoEBeamSearcher": "swarmgrad.moe",
    "ModuleBackend": "swarmgrad.moe",
    "RemoteExpert": "swarmgrad.moe",
    "RemoteMixtureOfExperts": "swarmgrad.moe",
    "RemoteSwitchMixtureOfExperts": "swarmgrad.moe",
    "Server": "swarmgrad.moe",
    "background_server": "swarmgrad.moe",
    "register_expert_class": "swarmgrad.moe",
    "DecentralizedAverager": "swarmgrad.averaging",
    "GossipAverager": "swarmgrad.averaging",
    "CenteredClip": "swarmgrad.averaging",
    "TrimmedMean": "swarmgrad.averaging",
    "Optimizer": "swarmgrad.optim",
    "DiLoCoOptimizer": "swarmgrad.optim",
    "GradScaler": "swarmgrad.optim",
    "ProgressTracker": "swarmgrad.optim",
    "GradientAverager": "swarmgrad.optim",
    "PowerSGDGradientAverager": "swarmgrad.optim",
    "SiteOptimizer": "swarmgrad.optim",
    "TrainingStateAverager": "swarmgrad.optim",
    "TrainingAverager": "swarmgrad.optim",
}

# subpackages reachable as attributes after a bare ``import swarmgrad``, as in hivemind
# (``hivemind.moe.get_experts(...)``), each imported on first use
_SUBPACKAGES = {
    "averaging",
    "cli",
    "compression",
    "dht",
    "integrations",
    "moe",
    "monitor",
    "net",
    "optim",
    "p2p",
    "utils",
}
# hivemind's hivemind.proto: the codec enum programs take from it lives with the codecs
_RELOCATED_SUBPACKAGES = {"proto": "swarmgrad.compression.proto"}


def __getattr__(name: str):
    import importlib

    if name in _RELOCATED_SUBPACKAGES:
        return importlib.import_module(_RELOCATED_SUBPACKAGES[name])
    if name in _SUBPACKAGES:
        try:
            return importlib.import_module(f"swarmgrad.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"swarmgrad.{name}":
                raise  # the subpackage exists but something it imports is missing
            raise AttributeError(f"module 'swarmgrad' has no attribute {name!r}") from e
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBPACKAGES | set(_RELOCATED_SUBPACKAGES))


__all__ = [
    "ConnectionClosed",
    "ConnectionIdleClosed",
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
    "install_hivemind_alias",
    # ``from swarmgrad import *`` brings these in too, importing their packages then
    *_LAZY,
]
