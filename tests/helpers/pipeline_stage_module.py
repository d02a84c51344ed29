"""A stage module for the pipeline tests: a tiny GPT-style model in three stages
(embedding + block, block, block + head), as docs/pipeline.md describes."""

import torch
from torch import nn

VOCAB, DIM, SEQ = 32, 16, 8


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Parameter(torch.zeros(SEQ, DIM))
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, ids):
        return self.block(self.tokens(ids) + self.positions)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, hidden):
        return self.out(self.block(hidden))


def make_stages():
    middle = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
    return [Embed(), middle, Head()]


def sample_input(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
