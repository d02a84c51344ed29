"""A small GPT-style language model and its data: Python's own standard-library sources,
read as bytes (offline, real text, the same on every machine with the same Python).

The demo trains it (through :mod:`swarmgrad.cli.demo_model`) and the slow-links
benchmark uses it; it lives in the package so that ``swarmgrad demo`` needs nothing from
``benchmarks/``. The last tenth of the corpus is held out for validation.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB = 256  # bytes


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's ``.py`` files in a fixed order, as one byte tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"only {total} bytes of standard-library sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def split(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held out): the first nine tenths and the last tenth."""
    cut = len(corpus) * 9 // 10
    return corpus[:cut], corpus[cut:]


def random_windows(
    data: torch.Tensor, batch: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``context`` bytes and the bytes that follow each."""
    starts = torch.randint(len(data) - context - 1, (batch,), generator=generator)
    rows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    """Byte-level, learned positions, pre-norm blocks, output tied to the embedding."""

    def __init__(self, context: int = 64, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        if width % heads:
            raise ValueError(f"TinyGPT: width {width} is not a multiple of heads {heads}")
        self.context = context
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        self.blocks = torch.nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = torch.nn.LayerNorm(width)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        torch.nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.norm(self.blocks(x)) @ self.embed.weight.t()

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def validation_loss(model: TinyGPT, val: torch.Tensor, windows: int = 64) -> float:
    """Mean loss over fixed, evenly spaced held-out windows (the same for every run)."""
    step = (len(val) - model.context - 1) // windows
    starts = [i * step for i in range(windows)]
    rows = torch.stack([val[s : s + model.context + 1] for s in starts])
    was_training = model.training
    model.eval()
    loss = float(model.loss(rows[:, :-1], rows[:, 1:]))
    model.train(was_training)
    return loss


def untrained_loss() -> float:
    """The loss of a model that knows nothing: uniform over the 256 byte values."""
    return math.log(VOCAB)


@torch.no_grad()
def generate(
    model: TinyGPT, prompt: bytes, length: int, generator: torch.Generator, temperature: float = 0.8
) -> bytes:
    """``length`` bytes sampled after ``prompt`` (at least one byte) from the model."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one byte")
    was_training = model.training
    model.eval()
    tokens = list(prompt)
    for _ in range(length):
        window = torch.tensor([tokens[-model.context :]])
        logits = model(window)[0, -1] / temperature
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    model.train(was_training)
    return bytes(tokens[len(prompt) :])
