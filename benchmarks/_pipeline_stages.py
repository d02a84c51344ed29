"""The stage module of ``benchmarks/swarm_pipeline.py`` (see docs/pipeline.md for the
convention): the GPT-style model of ``pipeline_convergence.py`` in
``SWARM_PIPELINE_STAGES`` stages (default 4: embedding + block, block, block, block +
head; 2: embedding + block, block + head; the benchmark's smoke run uses 2).

Compute is kept small on purpose: the benchmark's stage servers sleep (``serve-stage
--slowdown``) to stand in for devices of different speeds, so that the machine's two
cores are not what limits a pipeline of eight peers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_convergence import SEQ, VOCAB, Embed, Head, _block


def num_stages() -> int:
    stages = int(os.environ.get("SWARM_PIPELINE_STAGES", "4"))
    if stages < 2:
        raise ValueError(f"SWARM_PIPELINE_STAGES must be at least 2, got {stages}")
    return stages


def make_stages():
    return [Embed(), *(_block() for _ in range(num_stages() - 2)), Head()]


def sample_input(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
