#!/usr/bin/env bash
# The test command: lint, then the whole suite (unit, property, simulated swarms,
# real processes, and the network lab where the machine allows it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check swarmgrad tests benchmarks examples
"$PYTHON" -m pytest -q -p no:cacheprovider "$@"
