"""How much of hivemind 1.1.12's public API a hivemind program finds in swarmgrad.

Reads ``benchmarks/data/hivemind_1.1.12_api.json`` (written from an installed hivemind by
``scripts/hivemind_names.py``; hivemind is not needed here), aliases ``hivemind`` to
swarmgrad (``swarmgrad.install_hivemind_alias()``) and checks, through the alias:

- **names**: each public name resolves at its hivemind path (``hivemind.utils.X``
  imported as a hivemind program would), a module where hivemind has a module, something
  callable where hivemind has a class or function, and an enum with all of hivemind's
  members;
- **signatures**: each hivemind parameter is accepted by ours under the same name, with a
  compatible kind (a positional parameter at the same position; a keyword-only one as
  keyword-only or positional-or-keyword; ``*args``/``**kwargs`` where hivemind has them),
  and the same default (compared by ``repr``) where hivemind gives one;
- **members**: each public method, property and attribute of the central classes is
  present on ours (on the class, or assigned to ``self`` in the class' own source).

Prints a table of the gaps, then one JSON line with the three fractions and
``albert_epochs``, the global epoch the ALBERT-like programs reached
(``benchmarks/results/albert_epochs.json``, written by ``tests/hivemind/test_hivemind_programs.py``;
``null`` when that test has not run). Targets: names >= 0.98, signatures >= 0.95,
members >= 0.95. ``--markdown FILE`` also writes the per-name status table that
``docs/hivemind.md`` includes.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import pathlib
import re
import sys
import textwrap
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent
DATA = ROOT / "data" / "hivemind_1.1.12_api.json"
ALBERT = ROOT / "results" / "albert_epochs.json"
TARGETS = {"names": 0.98, "signatures": 0.95, "members": 0.95}

_MISSING = object()


def resolve(module: str, name: str) -> Any:
    """``from <module> import <name>`` through the alias; raises what the import raises."""
    mod = importlib.import_module(module)
    value = getattr(mod, name, _MISSING)
    if value is _MISSING:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return value


def check_name(entry: dict) -> str | None:
    """None when the name resolves as hivemind's does, else why not."""
    try:
        value = resolve(entry["module"], entry["name"])
    except Exception as e:  # any import-time failure is a gap, reported by type
        return f"{type(e).__name__}: {e}"
    kind = entry["kind"]
    if kind == "module" and not inspect.ismodule(value):
        return f"a module in hivemind, here {type(value).__name__}"
    if kind in ("class", "function") and not callable(value):
        return f"a {kind} in hivemind, here {type(value).__name__}"
    if kind == "enum":
        missing = [v for v in entry.get("values", ()) if not hasattr(value, v)]
        if missing:
            return f"enum lacks {', '.join(missing)}"
    return None


def _call_signature(value: Any) -> inspect.Signature:
    """What calling ``value`` accepts: a class' ``__init__`` without ``self`` (or a declared
    ``__signature__``, as pydantic models have), rather than a ``__new__`` that only
    dispatches."""
    if (
        inspect.isclass(value)
        and getattr(value, "__signature__", None) is None
        and value.__init__ is not object.__init__  # a NamedTuple's fields come from __new__
    ):
        init = inspect.signature(value.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])
    return inspect.signature(value)


def _params(value: Any) -> list[inspect.Parameter] | None:
    try:
        params = list(_call_signature(value).parameters.values())
    except (TypeError, ValueError):
        return None
    return [p for p in params if not p.name.startswith("_")]


# defaults that are spelled differently but mean the same: hivemind's protobuf enum
# CompressionType.NONE is the integer 0, ours is the enum member
EQUIVALENT_DEFAULTS = {"0": {"CompressionType.NONE"}}


def _normalize_default(text: str) -> str:
    """``hivemind.NoCompression()`` and ``NoCompression()`` are the same default; an enum
    member compares by class and member name (``<TensorRole.UNSPECIFIED: 5>``)."""
    text = re.sub(r"\b(hivemind|swarmgrad)(\.\w+)*\.(?=[A-Z])", "", text)
    match = re.fullmatch(r"<(\w+\.\w+): .*>", text)
    return match.group(1) if match else text


def _default_repr(value: Any) -> str:
    text = repr(value)
    return f"<{type(value).__name__}>" if " at 0x" in text else text


def same_default(theirs: str, mine: Any) -> bool:
    a, b = _normalize_default(theirs), _normalize_default(_default_repr(mine))
    return a == b or b in EQUIVALENT_DEFAULTS.get(a, ())


def compare_signature(theirs: list[dict], value: Any) -> list[str]:
    """The differences that would break a call written for hivemind's signature."""
    ours = _params(value)
    if ours is None:
        return ["no inspectable signature"]
    by_name = {p.name: p for p in ours}
    P = inspect.Parameter
    positional = [p.name for p in ours if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    has_var = {p.kind for p in ours} & {P.VAR_POSITIONAL, P.VAR_KEYWORD}
    problems = []
    their_positional = [
        p["name"] for p in theirs if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    ]
    for p in theirs:
        name, kind = p["name"], p["kind"]
        if kind == "VAR_POSITIONAL":
            if P.VAR_POSITIONAL not in has_var:
                problems.append(f"*{name} missing")
            continue
        if kind == "VAR_KEYWORD":
            if P.VAR_KEYWORD not in has_var:
                problems.append(f"**{name} missing")
            continue
        mine = by_name.get(name)
        if mine is None:
            problems.append(f"{name} missing")
            continue
        if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            index = their_positional.index(name)
            if mine.kind == mine.KEYWORD_ONLY:
                problems.append(f"{name} keyword-only here (positional #{index} in hivemind)")
            elif index >= len(positional) or positional[index] != name:
                problems.append(f"{name} not at position #{index}")
            elif kind == "POSITIONAL_OR_KEYWORD" and mine.kind == mine.POSITIONAL_ONLY:
                problems.append(f"{name} positional-only here")
        elif kind == "KEYWORD_ONLY" and mine.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
            problems.append(f"{name} not accepted by keyword")
        if "default" in p:
            if mine.default is inspect.Parameter.empty:
                problems.append(f"{name} has no default (hivemind: {p['default']})")
            elif not same_default(p["default"], mine.default):
                ours_default = _default_repr(mine.default)
                problems.append(f"{name} default {ours_default} (hivemind: {p['default']})")
    return problems


def _self_attributes(cls: type) -> set[str]:
    """Names the class' own source (and its bases') assigns to ``self.X``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "swarmgrad":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)  # dataclass fields
    return names


def check_member(entry: dict, classes: dict[str, Any]) -> str | None:
    path = entry["class"]
    if path not in classes:
        module, _, name = path.rpartition(".")
        try:
            classes[path] = resolve(module, name)
        except Exception as e:
            classes[path] = e
    cls = classes[path]
    if isinstance(cls, Exception):
        return f"class missing ({type(cls).__name__})"
    name = entry["name"]
    try:  # static lookup: an attribute that raises when read (naming its replacement) is present
        value = inspect.getattr_static(cls, name)
    except AttributeError:
        value = _MISSING
    if value is not _MISSING or name in _self_attributes(cls):
        if entry["kind"] == "method" and not callable(getattr(cls, name, None)):
            return "a method in hivemind, not callable here"
        return None
    return "missing"


def raises_instead(entry: dict, classes: dict[str, Any]) -> str | None:
    """What a member marked by ``swarmgrad.utils.compat.unsupported`` says to use."""
    cls = classes.get(entry["class"])
    if cls is None or isinstance(cls, Exception):
        return None
    try:
        raw = inspect.getattr_static(cls, entry["name"])
    except AttributeError:
        return None
    func = raw.fget if isinstance(raw, property) else raw
    return getattr(func, "__hivemind_unsupported__", None)


def measure(data: dict) -> dict:
    import swarmgrad

    swarmgrad.install_hivemind_alias()
    name_gaps, signature_gaps, member_gaps = [], [], []
    rows = []  # (path, kind, status) for the docs table
    signatures_checked = 0
    for entry in data["names"]:
        path = f"{entry['module']}.{entry['name']}"
        why = check_name(entry)
        status = "ok" if why is None else f"missing: {why}"
        if why is not None:
            name_gaps.append((path, why))
        if "signature" in entry:
            signatures_checked += 1
            if why is not None:
                signature_gaps.append((path, "name missing"))
                status_sig = "-"
            else:
                problems = compare_signature(
                    entry["signature"], resolve(entry["module"], entry["name"])
                )
                if problems:
                    signature_gaps.append((path, "; ".join(problems)))
                status_sig = "ok" if not problems else "; ".join(problems)
        else:
            status_sig = ""
        rows.append((path, entry["kind"], status, status_sig))
    classes: dict[str, Any] = {}
    member_rows = []
    member_errors = []  # present, but an explanatory error instead of hivemind's behaviour
    for entry in data["members"]:
        why = check_member(entry, classes)
        path = f"{entry['class']}.{entry['name']}"
        if why is not None:
            member_gaps.append((path, why))
            status = why
        else:
            instead = raises_instead(entry, classes)
            status = "ok" if instead is None else f"raises, says: {instead}"
            if instead is not None:
                member_errors.append((path, instead))
        member_rows.append((path, entry["kind"], status))

    # the fractions leaving hivemind.p2p out (swarmgrad/p2p/ came from another branch),
    # kept so that runs on trees without that package compare with earlier ones
    def is_p2p(path: str) -> bool:
        return path == "hivemind.p2p" or path.startswith("hivemind.p2p.")

    def without_p2p(gaps: list, total: list) -> float:
        kept = [p for p in total if not is_p2p(p)]
        return round(1 - sum(not is_p2p(p) for p, _ in gaps) / max(1, len(kept)), 4)

    name_paths = [f"{e['module']}.{e['name']}" for e in data["names"]]
    signature_paths = [f"{e['module']}.{e['name']}" for e in data["names"] if "signature" in e]
    member_paths = [f"{e['class']}.{e['name']}" for e in data["members"]]
    albert = None
    if ALBERT.exists():
        written = json.loads(ALBERT.read_text())
        albert = written.get("albert_epochs", written.get("epochs"))
    n_names, n_members = len(data["names"]), len(data["members"])
    return {
        "result": {
            "names": round(1 - len(name_gaps) / n_names, 4),
            "signatures": round(1 - len(signature_gaps) / max(1, signatures_checked), 4),
            "members": round(1 - len(member_gaps) / max(1, n_members), 4),
            "albert_epochs": albert,
            "counts": {
                "names": n_names,
                "signatures": signatures_checked,
                "members": n_members,
                "name_gaps": len(name_gaps),
                "signature_gaps": len(signature_gaps),
                "member_gaps": len(member_gaps),
                "members_raising_instead": len(member_errors),
            },
            "without_p2p": {
                "names": without_p2p(name_gaps, name_paths),
                "signatures": without_p2p(signature_gaps, signature_paths),
                "members": without_p2p(member_gaps, member_paths),
            },
            "hivemind_version": data["hivemind_version"],
        },
        "name_gaps": name_gaps,
        "signature_gaps": signature_gaps,
        "member_gaps": member_gaps,
        "member_errors": member_errors,
        "rows": rows,
        "member_rows": member_rows,
    }


def markdown_table(report: dict) -> str:
    lines = ["| hivemind name | kind | status | signature |", "|---|---|---|---|"]
    for path, kind, status, sig in report["rows"]:
        lines.append(f"| `{path}` | {kind} | {status} | {sig} |")
    lines += ["", "| member of a central class | kind | status |", "|---|---|---|"]
    for path, kind, status in report["member_rows"]:
        lines.append(f"| `{path}` | {kind} | {status} |")
    return "\n".join(lines).replace("\\", "\\\\") + "\n"


START, END = "<!-- api-table:start -->", "<!-- api-table:end -->"


def update_docs(path: pathlib.Path, report: dict) -> None:
    """Put the status table between the markers of ``path`` (ValueError if absent)."""
    text = path.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{path} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    result = report["result"]
    summary = (
        f"Measured by `benchmarks/hivemind_api.py` against hivemind "
        f"{result['hivemind_version']}: names {result['names']:.1%}, signatures "
        f"{result['signatures']:.1%}, members {result['members']:.1%} "
        f"({result['counts']['members_raising_instead']} of the members present raise an "
        "error naming the replacement).\n\n"
    )
    path.write_text(f"{head}{START}\n{summary}{markdown_table(report)}{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DATA), help="the JSON list of hivemind's API")
    parser.add_argument("--markdown", help="also write the per-name status table here")
    parser.add_argument(
        "--update-docs",
        metavar="FILE",
        help="replace the status table between the api-table markers of FILE (docs/hivemind.md)",
    )
    args = parser.parse_args()
    data = json.loads(pathlib.Path(args.data).read_text())
    report = measure(data)
    for title, gaps in (
        ("names not found at hivemind's path", report["name_gaps"]),
        ("signatures that differ", report["signature_gaps"]),
        ("members missing from the central classes", report["member_gaps"]),
        ("members present as an error naming the replacement", report["member_errors"]),
    ):
        print(f"\n{title} ({len(gaps)}):")
        for path, why in gaps:
            print(f"  {path:<60} {why}")
    result = report["result"]
    print()
    for key, target in TARGETS.items():
        mark = "met" if result[key] >= target else "NOT met"
        print(f"{key:<11} {result[key]:.4f} (target >= {target}: {mark})")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown_table(report))
    if args.update_docs:
        update_docs(pathlib.Path(args.update_docs), report)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
