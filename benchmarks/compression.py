"""Codec throughput and error on 10 million N(0, 1) float32 values.

Run with no arguments. For every codec it times serialize + deserialize (the payload is
handed to the decoder in a fresh bytearray, as a transport would, outside the timing) and
reports the median of several repetitions, throughput in GB/s of float32 input, payload
bytes and mean squared error. References measured in the same run:

* memcpy: ``tensor.numpy().tobytes()`` then ``np.frombuffer`` -> torch, one plain copy;
* hivemind: only if the environment variable HIVEMIND_PYTHON names a Python interpreter
  that can ``import hivemind``: hivemind's own serialize/deserialize on the same data, run
  in that interpreter as a subprocess.

"vs memcpy" is memcpy's time divided by the codec's (above 1: faster than one plain copy),
"speedup" hivemind's time divided by ours. The last line printed is JSON:
{"codecs": {name: {"gb_per_s", "mse", "bytes", "ms"}}, "memcpy": ..., "hivemind": ...}.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

from swarmgrad.compression import (
    CompressionType,
    SerializedTensor,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)

NUMEL = 10_000_000
SEED = 0
REPEATS = 9
HIVEMIND_REPEATS = 5
HIVEMIND_TIMEOUT = 180
CODECS = [
    ("none", CompressionType.NONE),
    ("float16", CompressionType.FLOAT16),
    ("bfloat16", CompressionType.BFLOAT16),
    ("meanstd_16bit", CompressionType.MEANSTD_16BIT),
    ("uniform_8bit", CompressionType.UNIFORM_8BIT),
    ("quantile_8bit", CompressionType.QUANTILE_8BIT),
    ("blockwise_8bit", CompressionType.BLOCKWISE_8BIT),
]
HIVEMIND_NAMES = {
    "none": "NONE",
    "float16": "FLOAT16",
    "meanstd_16bit": "MEANSTD_16BIT",
    "uniform_8bit": "UNIFORM_8BIT",
    "quantile_8bit": "QUANTILE_8BIT",
    "blockwise_8bit": "BLOCKWISE_8BIT",
}

# Runs in the hivemind interpreter: the same data, hivemind's public API only.
HIVEMIND_SCRIPT = r"""
import json, statistics, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from hivemind.compression import serialize_torch_tensor, deserialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

numel, seed, repeats, names = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
data = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
results = {}
for name in names:
    try:
        kind = CompressionType.Value(name)
        times, kept = [], []
        for _ in range(repeats + 1):
            kept.clear()  # results die outside the timed region, as for ours
            start = time.perf_counter()
            payload = serialize_torch_tensor(data, kind)
            restored = deserialize_torch_tensor(payload)
            times.append(time.perf_counter() - start)
            kept.extend((payload, restored))
        mse = (restored.double() - data.double()).square().mean().item()
        results[name] = {"ms": statistics.median(times[1:]) * 1e3, "mse": mse,
                         "bytes": len(payload.buffer)}
    except Exception as error:  # e.g. blockwise without bitsandbytes
        results[name] = {"error": f"{type(error).__name__}: {error}"[:200]}
print(json.dumps(results))
"""


def median_ms(run, repeats: int = REPEATS) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        times.append(run())
    return statistics.median(times) * 1e3


def measure_codec(data: torch.Tensor, compression: CompressionType) -> dict:
    kept = []  # results die outside the timed region, so freeing them is not timed

    def run() -> float:
        kept.clear()
        start = time.perf_counter()
        serialized = serialize_torch_tensor(data, compression)
        encoded = time.perf_counter() - start
        received = SerializedTensor.from_header(serialized.header(), bytearray(serialized.buffer))
        start = time.perf_counter()
        restored = deserialize_torch_tensor(received)
        elapsed = encoded + time.perf_counter() - start
        kept.extend((serialized, received, restored))
        return elapsed

    ms = median_ms(run)
    payload, _, restored = kept
    mse = (restored.double() - data.double()).square().mean().item()
    return {
        "ms": ms,
        "gb_per_s": data.numel() * 4 / 1e9 / (ms / 1e3),
        "mse": mse,
        "bytes": payload.nbytes,
    }


def measure_memcpy(data: torch.Tensor) -> dict:
    kept = []

    def run() -> float:
        kept.clear()
        start = time.perf_counter()
        copy = torch.from_numpy(np.frombuffer(data.numpy().tobytes(), dtype=np.float32))
        elapsed = time.perf_counter() - start
        kept.append(copy)
        return elapsed

    with warnings.catch_warnings():  # torch warns that the bytes-backed array is read-only
        warnings.simplefilter("ignore", UserWarning)
        ms = median_ms(run)
    return {"ms": ms, "gb_per_s": data.numel() * 4 / 1e9 / (ms / 1e3), "bytes": data.numel() * 4}


def measure_hivemind() -> dict | None:
    python = os.environ.get("HIVEMIND_PYTHON")
    if not python:
        return None
    command = [python, "-c", HIVEMIND_SCRIPT, str(NUMEL), str(SEED), str(HIVEMIND_REPEATS)]
    command += list(HIVEMIND_NAMES.values())
    try:
        finished = subprocess.run(
            command, capture_output=True, text=True, timeout=HIVEMIND_TIMEOUT, check=True
        )
        by_hivemind_name = json.loads(finished.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
        print(f"hivemind reference failed: {error}", file=sys.stderr)
        return None
    return {ours: by_hivemind_name.get(theirs, {}) for ours, theirs in HIVEMIND_NAMES.items()}


def main() -> None:
    data = torch.randn(NUMEL, generator=torch.Generator().manual_seed(SEED))
    memcpy = measure_memcpy(data)
    codecs = {name: measure_codec(data, compression) for name, compression in CODECS}
    hivemind = measure_hivemind()

    print(
        f"{NUMEL:,} float32 values, N(0, 1); serialize + deserialize, median of {REPEATS}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}"
    )
    header = f"{'codec':<15} {'ms':>8} {'GB/s':>8} {'bytes':>11} {'MSE':>10} {'vs memcpy':>10}"
    if hivemind is not None:
        header += f" {'hivemind ms':>12} {'speedup':>8} {'hivemind MSE':>13}"
    print(header)
    print(f"{'memcpy':<15} {memcpy['ms']:>8.1f} {memcpy['gb_per_s']:>8.2f} {memcpy['bytes']:>11,}")
    for name, result in codecs.items():
        line = (
            f"{name:<15} {result['ms']:>8.1f} {result['gb_per_s']:>8.2f} {result['bytes']:>11,} "
            f"{result['mse']:>10.3e} {memcpy['ms'] / result['ms']:>9.2f}x"
        )
        reference = (hivemind or {}).get(name)
        if reference and "ms" in reference:
            line += (
                f" {reference['ms']:>12.1f} {reference['ms'] / result['ms']:>7.2f}x"
                f" {reference['mse']:>13.3e}"
            )
        elif hivemind is not None:
            line += f" {'n/a':>12}"
        print(line)
    print(
        json.dumps(
            {
                "codecs": codecs,
                "memcpy": memcpy,
                "hivemind": hivemind,
                "numel": NUMEL,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
