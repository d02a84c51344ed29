"""The framework adapters are optional: importing swarmgrad never imports a framework, and
an adapter imported without its extra says which extra to install. Runs whether or not
the extras are installed (a missing framework is simulated in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])

PROBE = r"""
import json, sys
blocked = sys.argv[1:]
for name in blocked:
    sys.modules[name] = None  # what an uninstalled package looks like to import
import swarmgrad, swarmgrad.optim, swarmgrad.integrations
result = {"loaded": sorted(m for m in ("lightning", "transformers", "accelerate")
                           if m in sys.modules and sys.modules[m] is not None)}
if blocked:
    try:
        __import__("swarmgrad.integrations." + sys.argv[1])
    except ImportError as e:
        result["error"] = [type(e).__name__, str(e),
                           isinstance(e, swarmgrad.SwarmgradError)]
print(json.dumps(result))
"""


def probe(*blocked: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *blocked],
        cwd=ROOT,
        env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_swarmgrad_loads_no_framework():
    assert probe()["loaded"] == []


@pytest.mark.parametrize("extra", ["lightning", "transformers"])
def test_an_adapter_without_its_framework_names_the_extra_to_install(extra):
    name, message, is_swarmgrad_error = probe(extra)["error"]
    assert name == "MissingExtraError"
    assert is_swarmgrad_error
    assert f"pip install 'swarmgrad[{extra}]'" in message
    assert f"swarmgrad.integrations.{extra}" in message
