"""A benchmark run with no arguments leaves ``git status`` clean: figures go to the
ignored ``benchmarks/results/`` unless ``SWARMGRAD_UPDATE_DOCS=1`` asks for ``docs/``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from _results import figure_path  # noqa: E402


def test_figures_go_to_the_results_folder_unless_docs_are_asked_for(monkeypatch):
    monkeypatch.delenv("SWARMGRAD_UPDATE_DOCS", raising=False)
    assert figure_path("x.png") == REPO / "benchmarks" / "results" / "x.png"
    monkeypatch.setenv("SWARMGRAD_UPDATE_DOCS", "1")
    assert figure_path("x.png") == REPO / "docs" / "x.png"


def test_the_results_folder_is_ignored_by_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    probe = "benchmarks/results/probe.png"
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO, check=False)
    assert ignored.returncode == 0, f"{probe} is not ignored by git"
    assert subprocess.run(["git", "check-ignore", "-q", ".venv/x"], cwd=REPO).returncode == 0


@pytest.mark.parametrize(
    "script",
    sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "_results.py"),
    ids=lambda p: p.name,
)
def test_no_benchmark_names_a_path_inside_docs(script):
    """A literal ``docs`` path in a benchmark would write into the committed docs by
    default; figures must come from ``figure_path``."""
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [n.value for n in (node.left, node.right) if isinstance(n, ast.Constant)]
            assert "docs" not in parts, f"{script.name}:{node.lineno} builds a path in docs/"
