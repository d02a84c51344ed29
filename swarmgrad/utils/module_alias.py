"""``hivemind`` as another name of ``swarmgrad``, submodules included.

``import swarmgrad`` puts :class:`HivemindAliasFinder` on ``sys.meta_path``. It maps
``hivemind.X`` to ``swarmgrad.X`` only while ``sys.modules["hivemind"]`` *is* swarmgrad,
so a real hivemind in the same interpreter is never shadowed; after
``swarmgrad.install_hivemind_alias()`` (or ``sys.modules["hivemind"] = swarmgrad`` by
hand) ``import hivemind.utils.networking`` and
``from hivemind.optim.state_averager import LRSchedulerBase`` give swarmgrad's modules
(a few from another place: :data:`RELOCATED`).

Without the finder, the ``sys.modules`` line alone would let Python load
``swarmgrad/utils/__init__.py`` a second time under the name ``hivemind.utils``: two
copies of every class, ``isinstance`` between them failing. The finder hands back the one
module object instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

ALIAS = "hivemind"
TARGET = "swarmgrad"

# hivemind modules whose swarmgrad counterpart lives elsewhere: swarmgrad keeps each in
# the layer its contents belong to (multiaddrs in net, RSA keys with the DHT's records,
# the codec enum with the codecs), named here as strings so that this bottom-layer module
# depends on none of them
RELOCATED = {
    "hivemind.utils.multiaddr": "swarmgrad.net.multiaddr",
    "hivemind.utils.crypto": "swarmgrad.dht.crypto",
    "hivemind.proto": "swarmgrad.compression.proto",
}


def target_name(fullname: str) -> str:
    """The swarmgrad module that ``hivemind.X`` names."""
    for alias, target in RELOCATED.items():
        if fullname == alias or fullname.startswith(alias + "."):
            return target + fullname[len(alias) :]
    return TARGET + fullname[len(ALIAS) :]


__all__ = ["HivemindAliasFinder", "install_finder", "install_hivemind_alias"]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``hivemind.X`` as the already imported ``swarmgrad.X``."""

    def __init__(self, module: types.ModuleType):
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system has just set the alias' spec on the module: give its own back
        module.__spec__ = self._spec


class HivemindAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``hivemind.X`` to ``swarmgrad.X`` while ``hivemind`` is swarmgrad."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        if TARGET not in sys.modules or sys.modules.get(ALIAS) is not sys.modules[TARGET]:
            return None
        module = importlib.import_module(target_name(fullname))
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(module), is_package=hasattr(module, "__path__")
        )


def install_finder() -> None:
    """Put the finder on ``sys.meta_path`` once. Inert until ``hivemind`` is aliased."""
    if not any(isinstance(f, HivemindAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, HivemindAliasFinder())


def install_hivemind_alias() -> types.ModuleType:
    """Make ``import hivemind`` and every ``import hivemind.X`` give swarmgrad's modules.

    Refuses, naming it, when a real hivemind is already imported in this interpreter:
    mixing the two would hand one library's objects to the other.
    """
    swarmgrad = importlib.import_module(TARGET)
    current = sys.modules.get(ALIAS)
    if current is not None and current is not swarmgrad:
        raise ImportError(
            f"a real hivemind is already imported ({getattr(current, '__file__', current)}); "
            "install the swarmgrad alias before anything imports hivemind"
        )
    install_finder()
    sys.modules[ALIAS] = swarmgrad
    return swarmgrad
