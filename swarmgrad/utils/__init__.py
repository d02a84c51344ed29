"""Bottom layer: errors, time, logging, the loop-thread runtime, nested-structure and
asyncio helpers; also where hivemind programs find ``hivemind.utils``.

The helpers that belong to this layer are imported here. hivemind's ``utils`` also
re-exports a few things that swarmgrad keeps in higher layers (``PerformanceEMA`` in
``optim``, ``TensorDescriptor`` in ``compression``, multiaddrs in ``net``, RSA keys in
``dht``): those are looked up on first use only (``_UPPER``), so importing this package
still imports nothing above it.
"""

from swarmgrad.utils.aio import amap_in_executor, as_aiter, enter_asynchronously, switch_to_uvloop
from swarmgrad.utils.logging import get_logger, use_hivemind_log_handler
from swarmgrad.utils.mpfuture import MPFuture
from swarmgrad.utils.nested import nested_compare, nested_flatten, nested_map, nested_pack
from swarmgrad.utils.serializer import MSGPackSerializer, SerializerBase
from swarmgrad.utils.timed_storage import (
    MAX_DHT_TIME_DISCREPANCY_SECONDS,
    DHTExpiration,
    TimedStorage,
    ValueWithExpiration,
    get_dht_time,
)

# hivemind.utils names whose home is a higher layer: (module, attribute; None for the
# module itself), looked up by name on first access, never at import. The one place
# where this bottom layer names code above it, for hivemind programs only.
_UPPER = {
    "PerformanceEMA": ("swarmgrad.optim.performance_ema", "PerformanceEMA"),
    "TensorDescriptor": ("swarmgrad.compression.tensor_descr", "TensorDescriptor"),
    "multiaddr": ("swarmgrad.net.multiaddr", None),
    "crypto": ("swarmgrad.dht.crypto", None),
}

__all__ = [
    "DHTExpiration",
    "MAX_DHT_TIME_DISCREPANCY_SECONDS",
    "MPFuture",
    "MSGPackSerializer",
    "SerializerBase",
    "TimedStorage",
    "ValueWithExpiration",
    "amap_in_executor",
    "as_aiter",
    "enter_asynchronously",
    "get_dht_time",
    "get_logger",
    "nested_compare",
    "nested_flatten",
    "nested_map",
    "nested_pack",
    "switch_to_uvloop",
    "use_hivemind_log_handler",
    *(name for name, (_, attribute) in _UPPER.items() if attribute is not None),
]


def __getattr__(name: str):
    import importlib

    if name in ("networking", "timed_storage", "mpfuture", "logging"):
        return importlib.import_module(f"swarmgrad.utils.{name}")
    if name not in _UPPER:
        raise AttributeError(f"module 'swarmgrad.utils' has no attribute {name!r}")
    module, attribute = _UPPER[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value
