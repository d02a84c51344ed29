"""Write the list of hivemind's public API that ``benchmarks/hivemind_api.py`` checks.

Run it with an interpreter that has hivemind 1.1.12 installed (not swarmgrad's: hivemind
pins its own torch, pydantic and protobuf)::

    python3 -m venv ~/hmvenv && ~/hmvenv/bin/pip install torch==2.13.0 \
        && ~/hmvenv/bin/pip install hivemind==1.1.12 "numpy<2.4"
    ~/hmvenv/bin/python scripts/hivemind_names.py      # or HIVEMIND_PYTHON=... below

It writes ``benchmarks/data/hivemind_1.1.12_api.json``:

- ``names``: every public module-level name of the modules user programs import
  (``MODULES``), with what it is and, for functions and classes, its signature
  (parameter names, kinds, defaults as ``repr``);
- ``members``: the public methods, properties and attributes of the central classes
  (``CENTRAL_CLASSES``), with the signatures of the methods;
- ``excluded``: every name left out, with the reason.

What counts as a module's public name:

- a name bound by the module itself (a ``def``, ``class`` or assignment in its source),
  not starting with ``_``;
- in a package's ``__init__`` (and in any module with ``__all__``), the names it
  re-exports from other hivemind modules too: that is what a package is for; an
  implementation module's incidental imports of other hivemind names are not its API;
- in ``hivemind.proto.runtime_pb2`` only ``CompressionType`` (the generated protobuf
  module is wire format, not API; users pass that enum to servers).

Left out, each with its reason in ``excluded``: names from third-party packages that a
hivemind module happens to import (torch, typing, asyncio, pydantic, ...); stdlib and
third-party modules; ``TypeVar`` objects (typing placeholders, not values); module
loggers (``logger = get_logger(__name__)``: each module's own logger).
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import json
import os
import pathlib
import sys
import types
import typing

MODULES = [
    "hivemind",
    "hivemind.dht",
    "hivemind.dht.schema",
    "hivemind.dht.crypto",
    "hivemind.moe",
    "hivemind.moe.server",
    "hivemind.moe.client",
    "hivemind.averaging",
    "hivemind.averaging.control",
    "hivemind.optim",
    "hivemind.optim.state_averager",
    "hivemind.optim.progress_tracker",
    "hivemind.p2p",
    "hivemind.utils",
    "hivemind.utils.logging",
    "hivemind.utils.networking",
    "hivemind.utils.multiaddr",
    "hivemind.utils.timed_storage",
    "hivemind.utils.crypto",
    "hivemind.utils.mpfuture",
    "hivemind.compression",
    "hivemind.proto.runtime_pb2",
]

ONLY = {"hivemind.proto.runtime_pb2": {"CompressionType"}}

CENTRAL_CLASSES = [
    "hivemind.DHT",
    "hivemind.dht.DHTNode",
    "hivemind.Server",
    "hivemind.ModuleBackend",
    "hivemind.RemoteExpert",
    "hivemind.RemoteMixtureOfExperts",
    "hivemind.RemoteSwitchMixtureOfExperts",
    "hivemind.DecentralizedAverager",
    "hivemind.Optimizer",
    "hivemind.GradScaler",
    "hivemind.optim.progress_tracker.ProgressTracker",
    "hivemind.optim.state_averager.TrainingStateAverager",
    "hivemind.optim.grad_averager.GradientAverager",
    "hivemind.averaging.control.StepControl",
    "hivemind.p2p.P2P",
]

# Members a class inherits from these bases are the bases' API, not hivemind's.
FOREIGN_BASES = ("torch", "builtins", "multiprocessing", "threading", "abc", "typing")


def _source_bindings(module: types.ModuleType) -> tuple[set[str], set[str]]:
    """Names the module's own source binds at top level (def, class, assignment, also
    under a top-level ``if``/``try``), and names it imports from hivemind modules."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set(), set()
    bound: set[str] = set()
    imported: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bound.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                bound.add(node.target.id)
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0 or (node.module or "").split(".")[0] == "hivemind":
                    imported.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", ()):
                    visit(handler.body)

    visit(tree.body)
    return bound, imported


def _is_hivemind(obj: object) -> bool:
    mod = getattr(obj, "__module__", None)
    if isinstance(obj, types.ModuleType):
        mod = obj.__name__
    return isinstance(mod, str) and (mod == "hivemind" or mod.startswith("hivemind."))


def _default_repr(value: object) -> str:
    text = repr(value)
    # objects without a stable repr (``<object at 0x7f...>``) compare by type only
    if " at 0x" in text:
        return f"<{type(value).__name__}>"
    return text


def signature_of(obj: object) -> list[dict] | None:
    """Parameter names, kinds and default reprs; a class' are those of calling it (its
    ``__init__``, or pydantic's field signature), without ``self``; parameters whose names
    start with ``_`` are hivemind-internal and left out."""
    if inspect.isclass(obj) and obj.__init__ is object.__init__:
        return None
    try:
        if inspect.isclass(obj) and getattr(obj, "__signature__", None) is None:
            sig = inspect.signature(obj.__init__)  # not a ``__new__`` that only dispatches
        else:
            sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = []
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and p.name in ("self", "cls"):
            continue
        if p.name.startswith("_"):
            continue
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = _default_repr(p.default)
        params.append(entry)
    return params


def kind_of(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "enum" if issubclass(obj, enum.Enum) else "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or callable(obj):
        return "function"
    return "value"


def walk_modules() -> tuple[list[dict], list[dict]]:
    names, excluded = [], []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        own, imported = _source_bindings(module)
        is_package = hasattr(module, "__path__")
        exported = set(getattr(module, "__all__", ()))
        only = ONLY.get(module_name)
        for name in sorted(vars(module)):
            if name.startswith("_"):
                continue
            obj = getattr(module, name)
            where = f"{module_name}.{name}"
            if only is not None and name not in only:
                excluded.append({"name": where, "reason": "generated protobuf (wire format)"})
                continue
            if isinstance(obj, types.ModuleType):
                if not _is_hivemind(obj):
                    reason = f"third-party module {obj.__name__}"
                elif obj.__name__ != where:
                    reason = f"alias of module {obj.__name__}"
                elif not any(m == where or m.startswith(where + ".") for m in MODULES):
                    reason = "implementation submodule, not one that user programs import"
                else:
                    names.append({"module": module_name, "name": name, "kind": "module"})
                    continue
                excluded.append({"name": where, "reason": reason})
                continue
            if isinstance(obj, typing.TypeVar):
                excluded.append({"name": where, "reason": "TypeVar (typing placeholder)"})
                continue
            if name == "logger":
                excluded.append({"name": where, "reason": "the module's own logger"})
                continue
            defined_here = name in own or getattr(obj, "__module__", None) == module_name
            reexport = name in exported or (is_package and name in imported)
            if not (defined_here or reexport or only is not None):
                owner = getattr(obj, "__module__", None) or type(obj).__module__
                reason = (
                    f"imported from third-party {owner}"
                    if not _is_hivemind(obj)
                    else f"incidental import of {owner}.{name} by an implementation module"
                )
                excluded.append({"name": where, "reason": reason})
                continue
            entry = {"module": module_name, "name": name, "kind": kind_of(obj)}
            if entry["kind"] in ("class", "function") and _is_hivemind(obj):
                sig = signature_of(obj)
                if sig is not None:
                    entry["signature"] = sig
            if entry["kind"] == "enum":
                entry["values"] = [m.name for m in obj]
            if entry["kind"] == "value":
                entry["type"] = type(obj).__name__
            names.append(entry)
    # protobuf enums are not Python enums: list CompressionType's values by hand
    for entry in names:
        if entry["module"] == "hivemind.proto.runtime_pb2" and entry["name"] == "CompressionType":
            enum_type = importlib.import_module("hivemind.proto.runtime_pb2").CompressionType
            entry["kind"] = "enum"
            entry["values"] = list(enum_type.keys())
            entry.pop("signature", None)
    return names, excluded


def walk_members() -> tuple[list[dict], list[dict]]:
    members, excluded = [], []
    for path in CENTRAL_CLASSES:
        module_name, _, cls_name = path.rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        for name in sorted(dir(cls)):
            if name.startswith("_"):
                continue
            owner = next((c for c in cls.__mro__ if name in vars(c)), None)
            owner_mod = getattr(owner, "__module__", "") or ""
            if owner is None or owner_mod.split(".")[0] in FOREIGN_BASES:
                excluded.append(
                    {"name": f"{path}.{name}", "reason": f"inherited from {owner_mod or '?'}"}
                )
                continue
            raw = inspect.getattr_static(cls, name)
            if isinstance(raw, property | types.GetSetDescriptorType):
                kind = "property"
            elif isinstance(raw, staticmethod | classmethod) or inspect.isfunction(raw):
                kind = "method"
            else:
                kind = "attribute"
            entry = {"class": path, "name": name, "kind": kind}
            if kind == "method":
                func = getattr(cls, name)
                try:
                    sig = inspect.signature(func)
                    params = []
                    for i, p in enumerate(sig.parameters.values()):
                        if (i == 0 and p.name in ("self", "cls")) or p.name.startswith("_"):
                            continue
                        item = {"name": p.name, "kind": p.kind.name}
                        if p.default is not inspect.Parameter.empty:
                            item["default"] = _default_repr(p.default)
                        params.append(item)
                    entry["signature"] = params
                except (TypeError, ValueError):
                    pass
                entry["coroutine"] = inspect.iscoroutinefunction(func)
            members.append(entry)
    return members, excluded


def main() -> None:
    import hivemind

    if hivemind.__version__ != "1.1.12":
        print(f"warning: hivemind {hivemind.__version__} installed, the list names 1.1.12")
    names, excluded_names = walk_modules()
    members, excluded_members = walk_members()
    root = pathlib.Path(__file__).resolve().parent.parent
    out = pathlib.Path(
        os.environ.get("HIVEMIND_API_OUT", root / "benchmarks/data/hivemind_1.1.12_api.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "hivemind_version": hivemind.__version__,
        "python": sys.version.split()[0],
        "modules": MODULES,
        "central_classes": CENTRAL_CLASSES,
        "names": names,
        "members": members,
        "excluded": excluded_names + excluded_members,
    }
    out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(
        f"{len(names)} names, {sum('signature' in n for n in names)} signatures, "
        f"{len(members)} members, {len(data['excluded'])} excluded -> {out}"
    )


if __name__ == "__main__":
    main()
