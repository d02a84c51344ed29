"""The tiny GPT and its standard-library corpus, now in the package
(:mod:`swarmgrad.cli.tiny_lm`, which the demo uses); kept here under its old name for the
slow-links benchmark."""

from swarmgrad.cli.tiny_lm import (  # noqa: F401
    VOCAB,
    Block,
    TinyGPT,
    random_windows,
    split,
    stdlib_corpus,
    untrained_loss,
    validation_loss,
)
