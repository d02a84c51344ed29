"""The model module that ``swarmgrad demo`` hands to each ``swarmgrad train`` process: a
tiny GPT on Python's standard-library sources (see :mod:`swarmgrad.cli.model_module` for
what a model module defines). Also a working example to copy for one's own model::

    swarmgrad train --model-module "$(python -c 'import swarmgrad.cli.demo_model as m;
    print(m.__file__)')" --run-id my-lm --initial-peers ADDR

Options (``--module-options KEY=VALUE``): ``context``, ``width``, ``layers``, ``heads``
(the model's size), ``lr`` (AdamW's learning rate), ``corpus_bytes`` (how much of the
standard library to read).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from swarmgrad.cli.tiny_lm import TinyGPT, random_windows, split, stdlib_corpus

SETTINGS: dict[str, float] = {
    "context": 64,
    "width": 64,
    "layers": 2,
    "heads": 4,
    "lr": 4e-3,
    "corpus_bytes": 2_000_000,
}
_INTS = ("context", "width", "layers", "heads", "corpus_bytes")


def configure(options: dict[str, str]) -> None:
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown options {unknown}; known: {sorted(SETTINGS)}")
    for key, text in options.items():
        value = int(text) if key in _INTS else float(text)
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {text}")
        SETTINGS[key] = value


def make_model() -> TinyGPT:
    return TinyGPT(
        context=int(SETTINGS["context"]),
        width=int(SETTINGS["width"]),
        layers=int(SETTINGS["layers"]),
        heads=int(SETTINGS["heads"]),
    )


def corpus_split() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held out) bytes; the demo evaluates on the held-out tenth."""
    return split(stdlib_corpus(int(SETTINGS["corpus_bytes"])))


def batches(batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = corpus_split()
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield random_windows(train, batch_size, int(SETTINGS["context"]), generator)


def loss_fn(model: TinyGPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model.loss(*batch)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=SETTINGS["lr"], weight_decay=0.0)
