#!/usr/bin/env bash
# Installs swarmgrad and its test tools into the current Python (use a venv if you like).
# Torch: an installed torch >= 2.1 is kept. Otherwise torch 2.13.0 is asked for by exact
# version, which takes a local CPU wheel where pip's find-links has one (as on our build
# machines, which must never download CUDA wheels) and the registry's wheel elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) >= (2, 1) else 1)" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0" || "$PYTHON" -m pip install --quiet "torch>=2.1"
fi
"$PYTHON" -m pip install --quiet -e ".[test,demo]"
# The framework adapters (Lightning, transformers): their tests skip without them. Wheels
# only, never a build (about 18 s here); a failure only costs those tests.
"$PYTHON" -m pip install --quiet --only-binary=:all: -e ".[lightning,transformers]" \
    || echo "setup: lightning/transformers not installed; their integration tests will be skipped" >&2
# hivemind-style protobuf handlers (swarmgrad.p2p) and the metrics exporters (TensorBoard,
# Weights & Biases, offline in tests): wheels only; a failure only skips their tests.
"$PYTHON" -m pip install --quiet --only-binary=:all: -e ".[hivemind,tensorboard,wandb]" \
    || echo "setup: protobuf/tensorboard/wandb not installed; their tests will be skipped" >&2
# The documentation site's tools (mkdocs, mkdocstrings): wheels only, like the above; a
# failure only skips tests/test_docs_build.py.
"$PYTHON" -m pip install --quiet --only-binary=:all: -e ".[docs]" \
    || echo "setup: mkdocs/mkdocstrings not installed; the docs build test will be skipped" >&2

# The network-lab tests (NAT, relays across namespaces) need nft; they skip without it.
if [ "$(id -u)" = 0 ] && ! command -v nft >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq nftables >/dev/null) \
        || echo "setup: nftables not installed; network-lab tests will be skipped" >&2
fi
# The monitor's dashboard test loads the page in a headless chromium; it skips without one.
if [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
        || echo "setup: chromium not installed; the monitor's browser test will be skipped" >&2
fi
echo "swarmgrad is installed: $("$PYTHON" -c 'import swarmgrad; print(swarmgrad.__version__)')"
