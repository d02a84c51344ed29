"""Where a benchmark's figures go.

A run with no arguments must leave ``git status`` clean: plots land in
``benchmarks/results/`` (ignored by git). Set ``SWARMGRAD_UPDATE_DOCS=1`` to write them
into ``docs/`` instead, where the committed figures of ``docs/benchmarks.md`` live.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def figure_path(name: str) -> Path:
    """The file a benchmark's figure ``name`` (e.g. ``"slow_links.png"``) is written to."""
    if os.environ.get("SWARMGRAD_UPDATE_DOCS") == "1":
        return REPO / "docs" / name
    return RESULTS / name
