"""The house rules of the library's shape, checked on its source (nothing is imported).

- **Layers** (``../shared/ARCHITECTURE.md``, ``docs/design-notes.md``): a package imports
  only from packages at its own layer or below, in the order of :data:`LAYERS`. Imports
  inside functions count too (they are how an upward dependency hides); imports under
  ``if TYPE_CHECKING:`` do not, since they never run.
- **No import-time cycle between packages**: the graph of module-level imports between
  packages (``swarmgrad.dht``, ``swarmgrad.moe.server``, ...) has no cycle, so any package
  can be imported first.
- **Size**: no library module over :data:`MAX_LINES` lines.

The layer table and the limit are the constants below: a package added to the library
gets its place in :data:`LAYERS` (the test names any package that has none), and a file
that must stay large for a while is visible here, failing, rather than quietly exempt.
Each failure names the file and line.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = "swarmgrad"

#: lowest first: each package may import from its own layer and the ones before it
LAYERS: tuple[str, ...] = (
    "utils",
    "net",
    "compression",
    "dht",
    "p2p",
    "moe",
    "averaging",
    "optim",
    "pipeline",
    "monitor",
    "integrations",
    "cli",
)
#: modules of the top package (``swarmgrad/__init__.py`` gathers the public API,
#: ``__main__.py`` runs the CLI): above every layer
TOP = "<top>"
MAX_LINES = 800
#: the only imports of a higher layer allowed, each made inside the one function that needs
#: it and named here with its reason: (importing file, imported package)
LAZY_UPWARD: frozenset[tuple[str, str]] = frozenset(
    {
        # hivemind's DHT.replicate_p2p() returns the compat P2P handle, which wraps the
        # DHT's own peer and sits above the DHT (its is_identity_taken probes the DHT)
        ("swarmgrad/dht/dht.py", "p2p"),
    }
)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    path: Path
    line: int
    target: str  # the imported module (or ``package.name`` of a from-import), dotted
    at_import_time: bool  # module level (class bodies included), not inside a function


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name a relative ``from`` import refers to."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every import of the library made by the module at ``path`` (under ``root``)."""
    module = module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node: ast.AST, at_import_time: bool) -> Iterator[Import]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from visit(child, at_import_time)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, path, node.lineno, alias.name, at_import_time)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                # ``from swarmgrad import dht`` imports the package swarmgrad.dht; from a
                # module, ``name`` is an attribute and the module is what is imported
                yield Import(module, path, node.lineno, f"{base}.{alias.name}", at_import_time)
        inside_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, at_import_time and not inside_function)

    for statement in tree.body:
        yield from visit(statement, True)


def library_files(root: Path = ROOT, library: str = LIBRARY) -> list[Path]:
    return sorted((root / library).rglob("*.py"))


def package_of(module: str, library: str = LIBRARY) -> str:
    """The top-level package a dotted module belongs to (TOP for the library's own
    ``__init__``/``__main__`` and for names imported from the top package)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != library:
        return TOP
    if len(parts) == 2 and parts[1] in ("__main__", "__init__"):
        return TOP
    return parts[1]


def _known_packages(root: Path, library: str) -> set[str]:
    return {p.name for p in (root / library).iterdir() if (p / "__init__.py").exists()}


def _target_package(target: str, known: set[str], library: str) -> str | None:
    """The package an import reaches, None if it is not the library's."""
    parts = target.split(".")
    if parts[0] != library:
        return None
    if len(parts) == 1 or parts[1] not in known:
        return TOP  # ``import swarmgrad`` / ``from swarmgrad import DHT``: the top package
    return parts[1]


def unknown_packages(root: Path = ROOT, library: str = LIBRARY, layers=LAYERS) -> list[str]:
    return sorted(_known_packages(root, library) - set(layers))


def upward_imports(root: Path = ROOT, library: str = LIBRARY, layers=LAYERS) -> list[str]:
    """One line per import of a higher layer: file, line, what and from where."""
    rank = {name: i for i, name in enumerate(layers)}
    rank[TOP] = len(layers)
    known = _known_packages(root, library)
    found = []
    for path in library_files(root, library):
        for imp in imports_of(path, root):
            source = package_of(imp.module, library)
            target = _target_package(imp.target, known, library)
            if target is None or source == TOP or target == source:
                continue
            lazy = not imp.at_import_time and layers is LAYERS
            if lazy and (str(path.relative_to(root)), target) in LAZY_UPWARD:
                continue
            if rank.get(target, len(layers)) > rank.get(source, -1):
                when = "" if imp.at_import_time else " (inside a function)"
                found.append(
                    f"{path.relative_to(root)}:{imp.line}: {source} imports {imp.target}"
                    f"{when}, from the higher layer {target}"
                )
    return found


def _containing_package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def package_cycles(root: Path = ROOT, library: str = LIBRARY) -> list[str]:
    """Import-time cycles between packages (``swarmgrad.dht``, ``swarmgrad.moe.server``):
    one line per cycle, naming one import (file:line) for each of its edges.

    Imports between a package and its own subpackages are left out: a package's
    ``__init__`` re-exports its subpackages, which use their parent's modules, and Python
    runs the parent first whichever is imported; siblings (``moe.server`` and
    ``moe.client``) and top-level packages count."""
    packages = {module_name(p, root) for p in (root / library).rglob("__init__.py")}
    edges: dict[str, dict[str, str]] = {}  # package -> imported package -> first "file:line"
    for path in library_files(root, library):
        module = module_name(path, root)
        source = _containing_package(module, path)
        for imp in imports_of(path, root):
            if not imp.at_import_time or not imp.target.startswith(library):
                continue
            target = imp.target
            while target and target not in packages:
                target = target.rpartition(".")[0]
            # a package reached through its parent's __init__ is only the parent's import
            if not target or target == source or source.startswith(f"{target}."):
                continue
            if target.startswith(f"{source}."):  # a package importing its own subpackage
                continue
            edges.setdefault(source, {}).setdefault(target, f"{path.relative_to(root)}:{imp.line}")
    return [_describe_cycle(cycle, edges) for cycle in _strongly_connected(edges)]


def _strongly_connected(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's components with more than one package, each in a deterministic order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return components


def _describe_cycle(component: list[str], edges: dict[str, dict[str, str]]) -> str:
    members = set(component)
    links = [
        f"{source} -> {target} ({where})"
        for source in component
        for target, where in sorted(edges.get(source, {}).items())
        if target in members
    ]
    return "import-time cycle between " + ", ".join(component) + ": " + "; ".join(links)


def oversized_modules(
    root: Path = ROOT, library: str = LIBRARY, limit: int = MAX_LINES
) -> list[str]:
    found = []
    for path in library_files(root, library):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root)}: {lines} lines, over {limit}")
    return found


# ------------------------------------------------------------------ the library


def test_every_package_has_a_layer():
    unknown = unknown_packages()
    assert not unknown, f"packages without a place in LAYERS ({__file__}): {unknown}"


def test_no_module_imports_from_a_higher_layer():
    found = upward_imports()
    assert not found, "imports from a higher layer:\n" + "\n".join(found)


def test_no_import_time_cycle_between_packages():
    found = package_cycles()
    assert not found, "\n".join(found)


def test_no_library_module_is_over_the_line_limit():
    found = oversized_modules()
    assert not found, "modules to split along their seams:\n" + "\n".join(found)


# ------------------------------------------------------------------ the checks themselves


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


LOW_HIGH = ("low", "high")


def test_an_upward_import_inside_a_function_is_found_with_its_line(tmp_path):
    root = _tree(
        tmp_path,
        {
            "lib/__init__.py": "",
            "lib/high/__init__.py": "",
            "lib/low/__init__.py": "",
            "lib/low/mod.py": """
                import os


                def helper():
                    from lib.high import thing
                    return thing
            """,
        },
    )
    found = upward_imports(root, "lib", LOW_HIGH)
    assert len(found) == 1
    assert found[0].startswith("lib/low/mod.py:6: low imports lib.high.thing")
    assert "inside a function" in found[0]


def test_imports_under_type_checking_and_downward_imports_pass(tmp_path):
    root = _tree(
        tmp_path,
        {
            "lib/__init__.py": "from lib.high import x\n",  # the top imports anything
            "lib/high/__init__.py": "from lib.low.mod import f\n",
            "lib/low/__init__.py": "",
            "lib/low/mod.py": """
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from lib.high import Thing

                def f(): ...
            """,
        },
    )
    assert upward_imports(root, "lib", LOW_HIGH) == []


def test_relative_and_top_package_imports_are_resolved(tmp_path):
    root = _tree(
        tmp_path,
        {
            "lib/__init__.py": "",
            "lib/high/__init__.py": "",
            "lib/low/__init__.py": "from ..high import thing\n",
            "lib/low/other.py": "import lib\n",
        },
    )
    found = upward_imports(root, "lib", LOW_HIGH)
    assert [f.split(":")[:2] for f in found] == [
        ["lib/low/__init__.py", "1"],
        ["lib/low/other.py", "1"],
    ]
    assert "from the higher layer high" in found[0]
    assert f"from the higher layer {TOP}" in found[1]


def test_a_package_missing_from_the_layer_table_is_named(tmp_path):
    root = _tree(
        tmp_path, {"lib/__init__.py": "", "lib/low/__init__.py": "", "lib/p2p/__init__.py": ""}
    )
    assert unknown_packages(root, "lib", ("low",)) == ["p2p"]


def test_an_import_time_cycle_names_both_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "lib/__init__.py": "",
            "lib/a/__init__.py": "",
            "lib/a/one.py": "from lib.b.two import g\n",
            "lib/b/__init__.py": "",
            "lib/b/two.py": "import os\nfrom lib.a import one\n",
            "lib/c/__init__.py": "",
            "lib/c/late.py": "def f():\n    from lib.a import one\n",  # not at import time
            "lib/a/back.py": "from lib.c import late\n",
        },
    )
    (cycle,) = package_cycles(root, "lib")
    assert cycle.startswith("import-time cycle between lib.a, lib.b:")
    assert "lib.a -> lib.b (lib/a/one.py:1)" in cycle
    assert "lib.b -> lib.a (lib/b/two.py:2)" in cycle


def test_a_module_over_the_limit_is_named_with_its_length(tmp_path):
    root = _tree(tmp_path, {"lib/__init__.py": "", "lib/big.py": "x = 1\n" * 11})
    assert oversized_modules(root, "lib", limit=10) == ["lib/big.py: 11 lines, over 10"]
    assert oversized_modules(root, "lib", limit=11) == []
