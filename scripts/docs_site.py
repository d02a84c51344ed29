"""Build helpers for the documentation site (mkdocs.yml), used by ``mkdocs build`` only.

* :class:`RestRoles`, a griffe extension: our docstrings use reST inline markup
  (``:class:`~.diloco.DiLoCoOptimizer```, ``::`` before a literal block), which Markdown
  would show verbatim. Before mkdocstrings renders a docstring, each role becomes a code
  span (``~`` keeps the last dotted part, as Sphinx does) and ``::`` becomes ``:`` (the
  indented block after it is already a Markdown code block). The code is untouched.
* :func:`on_config`, an mkdocs hook: a guide in ``docs/`` that the nav does not list yet
  (one just written) is appended to the "Guides" section under its first heading, so a
  new page is never left unreachable, nor fails the strict build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _role_to_code(match: re.Match) -> str:
    shorten, target = match.group(1), match.group(2).lstrip(".")
    if shorten:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def rest_to_markdown(text: str) -> str:
    """Turn the reST inline markup of a docstring into Markdown."""
    text = _ROLE.sub(_role_to_code, text)
    lines = []
    for line in text.split("\n"):
        if line.strip() == "::":
            line = ""
        elif line.endswith("::"):
            line = line[:-1]
        lines.append(line)
    return "\n".join(lines)


try:
    import griffe
except ImportError:  # only mkdocstrings needs the extension, and it brings griffe
    griffe = None
else:

    class RestRoles(griffe.Extension):
        def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
            if obj.docstring is not None:
                obj.docstring.value = rest_to_markdown(obj.docstring.value)


def _nav_files(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_nav_files(value) for value in nav.values()))
    if isinstance(nav, list):
        return set().union(set(), *(_nav_files(item) for item in nav))
    return set()


def on_config(config: Any, **kwargs: Any) -> Any:
    nav = config.get("nav")
    if not nav:
        return config
    listed = _nav_files(nav)
    guides = next(
        (item["Guides"] for item in nav if isinstance(item, dict) and "Guides" in item), None
    )
    if guides is None:
        return config
    for page in sorted(Path(config["docs_dir"]).glob("*.md")):
        if page.name not in listed:
            heading = next(
                (
                    line[2:].strip()
                    for line in page.read_text().splitlines()
                    if line.startswith("# ")
                ),
                page.stem,
            )
            guides.append({heading: page.name})
    return config
