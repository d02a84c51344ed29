#!/usr/bin/env bash
# The data-path benchmarks of issue 33, as one script for a borrowed many-core machine:
#   1. benchmarks/transport.py      bulk GB/s against raw sockets; RPC p50 and calls/s
#   2. benchmarks/allreduce.py      16M float32, 4 and 8 peers, 5 rounds, against gloo;
#                                   and with our 8-bit codec (gloo still sends float32)
#   3. benchmarks/moe_throughput.py 16 ffn experts, 4 clients, against local compute
# each twice in the same run: with the data path's worker threads as configured for the
# machine (swarmgrad.net.workers) and with SWARMGRAD_DATA_THREADS=0 (everything on the
# event-loop thread, as before issue 33), so one run gives the before and after.
# Prints every benchmark's JSON line prefixed by its label ("label {json}"), and keeps
# the logs in $OUT (or ./device_bench_results). Sized to finish within about 6 minutes on
# a 16-core machine; every step has its own time bound.
# Usage: scripts/device_bench.sh [--quick]   (--quick: small sizes, to check it runs)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/device_bench_results}"
mkdir -p "$OUT"
quick=0
[ "${1:-}" = "--quick" ] && quick=1
status=0

if [ "$quick" = 1 ]; then
    transport_args=(--repeats 1 --mib 32 --rpc-calls 300)
    allreduce_args=(--numel 1000000 --rounds 2 --warmup 1)
    peers=(4)
    moe_args=(--num-experts 4 --num-clients 2 --batch-size 64 --batches-per-client 2
              --latency-calls 30 --repeats 1)
    bound=240
else
    transport_args=(--repeats 3)
    allreduce_args=(--numel 16000000 --rounds 5 --warmup 1)
    peers=(4 8)
    moe_args=(--repeats 2)
    bound=150
fi

{
    echo "date $(date -u +%FT%TZ)"
    echo "processors $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
    python -c "import sys, torch, cryptography; print('python', sys.version.split()[0],
        'torch', torch.__version__, 'cryptography', cryptography.__version__)"
    python -c "from swarmgrad.net import workers; print('data threads', workers.configured_threads())"
    git log -1 --format='commit %h %s' 2>/dev/null || true
} | tee "$OUT/machine.txt"

# run LABEL THREADS COMMAND...: THREADS "" keeps the machine's default
run() {
    local label="$1" threads="$2"
    shift 2
    local log="$OUT/$label.log"
    echo "== $label: $*"
    if [ -n "$threads" ]; then
        SWARMGRAD_DATA_THREADS="$threads" timeout "$bound" "$@" > "$log" 2>&1
    else
        timeout "$bound" "$@" > "$log" 2>&1
    fi
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "$label failed (exit $rc); the end of its log:"
        tail -n 15 "$log"
        status=1
        return
    fi
    echo "$label $(grep '^{' "$log" | tail -n 1)"
}

for threads in "" 0; do
    tag="threads-${threads:-default}"
    run "transport-$tag" "$threads" python benchmarks/transport.py "${transport_args[@]}"
    run "allreduce-$tag" "$threads" \
        python benchmarks/allreduce.py --peers "${peers[@]}" "${allreduce_args[@]}"
    run "allreduce-8bit-$tag" "$threads" \
        python benchmarks/allreduce.py --peers "${peers[@]}" "${allreduce_args[@]}" \
        --compression uniform_8bit
    run "moe-$tag" "$threads" python benchmarks/moe_throughput.py "${moe_args[@]}"
done
exit "$status"
