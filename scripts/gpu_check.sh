#!/usr/bin/env bash
# The GPU checks, as one script for a borrowed GPU machine (CI has none):
#   1. the tests marked `gpu` (they skip, saying why, where torch sees no CUDA), with the
#      CUDA-capable paths of swarmgrad train and the MoE client beside them;
#   2. benchmarks/gpu_training.py at full size (a ~100M-parameter GPT in bf16).
# Results go to $OUT (or ./gpu_check_results): the pytest log, the benchmark's output and
# its JSON line (gpu_training.json), and nvidia-smi's view of the machine.
# Usage: scripts/gpu_check.sh [--quick]   (--quick: the benchmark's throughput part only)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_check_results}"
mkdir -p "$OUT"
status=0

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia-smi.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/torch.txt"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch sees no CUDA device: the gpu tests would only skip" | tee -a "$OUT/torch.txt"
    status=1
fi

echo "== tests marked gpu (and the device-aware CLI tests)"
timeout 900 python -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/moe/test_client_devices.py tests/cli/test_train_run.py tests/optim/test_host_copies.py 2>&1 | tee "$OUT/pytest_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 900 python -m pytest -q -p no:cacheprovider -x -k "device or fp16 or bf16" \
    tests/cli/test_train_run.py 2>&1 | tee "$OUT/pytest_device.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmarks/gpu_training.py"
args=()
[ "${1:-}" = "--quick" ] && args+=(--skip-peers)
timeout 1800 python benchmarks/gpu_training.py "${args[@]}" 2>"$OUT/gpu_training.err" \
    | tee "$OUT/gpu_training.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
tail -n 1 "$OUT/gpu_training.txt" > "$OUT/gpu_training.json"
exit $status
