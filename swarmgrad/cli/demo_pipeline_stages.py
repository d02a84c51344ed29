"""The stage module of ``swarmgrad demo pipeline`` (the convention of
:mod:`swarmgrad.pipeline.stages`): the demo's byte-level GPT
(:mod:`swarmgrad.cli.tiny_lm`'s blocks) split into stages of one block each, the first
with the embedding, the last with the output head.

The demo passes its options to the stage servers it starts through the environment:
``SWARMGRAD_DEMO_STAGES`` (default 4), ``SWARMGRAD_DEMO_WIDTH`` (32),
``SWARMGRAD_DEMO_CONTEXT`` (32 bytes) and ``SWARMGRAD_DEMO_LR`` (Adam's, 3e-3).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from swarmgrad.cli.demo_pipeline import HEADS
from swarmgrad.cli.tiny_lm import VOCAB, Block


def options() -> dict[str, float]:
    values = {
        "stages": int(os.environ.get("SWARMGRAD_DEMO_STAGES", "4")),
        "width": int(os.environ.get("SWARMGRAD_DEMO_WIDTH", "32")),
        "context": int(os.environ.get("SWARMGRAD_DEMO_CONTEXT", "32")),
        "lr": float(os.environ.get("SWARMGRAD_DEMO_LR", "3e-3")),
    }
    if values["stages"] < 2 or values["width"] % HEADS or values["context"] < 2:
        raise ValueError(f"bad demo pipeline options (2+ stages, width a multiple of 4): {values}")
    return values


class Embed(nn.Module):
    def __init__(self, width: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.block = Block(width, HEADS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(tokens) + self.position[: tokens.shape[1]])


class Head(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.block, self.norm, self.out = (
            Block(width, HEADS),
            nn.LayerNorm(width),
            nn.Linear(width, VOCAB),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.block(hidden)))


def make_stages() -> list[nn.Module]:
    o = options()
    middle = [Block(o["width"], HEADS) for _ in range(o["stages"] - 2)]
    return [Embed(o["width"], o["context"]), *middle, Head(o["width"])]


def sample_input(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, options()["context"]))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=options()["lr"])
