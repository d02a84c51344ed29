"""The built-in expert classes: ``ffn``, ``transformer``, ``det_dropout`` and ``nop``."""

from __future__ import annotations

import torch
from torch import nn

from swarmgrad.moe.server.layers.registry import register_expert_class

__all__ = ["DeterministicDropout", "FeedforwardBlock", "NopExpert", "TransformerEncoderBlock"]

#: sequence length of the ``transformer`` expert's sample input (requests must match it)
TRANSFORMER_SEQ_LEN = 128


def _ffn_input(batch_size: int, hidden_dim: int) -> torch.Tensor:
    return torch.empty(batch_size, hidden_dim).requires_grad_()


@register_expert_class("ffn", _ffn_input)
class FeedforwardBlock(nn.Module):
    """A pre-norm residual feed-forward block: ``x + W2 GELU(W1 LayerNorm(x))`` with a
    4x wider hidden layer, the usual transformer FFN. Input and output: ``[batch, h]``."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_dim)
        self.up = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.down = nn.Linear(4 * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _transformer_input(batch_size: int, hidden_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = torch.empty(batch_size, TRANSFORMER_SEQ_LEN, hidden_dim).requires_grad_()
    padding_mask = torch.zeros(batch_size, TRANSFORMER_SEQ_LEN, dtype=torch.bool)
    return hidden, padding_mask


def _num_heads(hidden_dim: int) -> int:
    return next(h for h in (16, 8, 4, 2, 1) if hidden_dim % h == 0)


@register_expert_class("transformer", _transformer_input)
class TransformerEncoderBlock(nn.Module):
    """One transformer encoder layer (self-attention + FFN, pre-norm, GELU).

    Inputs: hidden states ``[batch, 128, h]`` (float32) and a padding mask ``[batch, 128]``
    (bool, True where a position is padding and must not be attended to). The sequence
    length is fixed by the schema at :data:`TRANSFORMER_SEQ_LEN`. Uses 16 attention heads,
    or the largest of 8, 4, 2, 1 that divides ``h``. Output: ``[batch, 128, h]``.
    """

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model=hidden_dim,
            nhead=_num_heads(hidden_dim),
            dim_feedforward=4 * hidden_dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )

    def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        # a row whose every position is padding would make attention NaN: attend to all
        all_padding = padding_mask.all(dim=1, keepdim=True)
        padding_mask = padding_mask & ~all_padding
        return self.layer(hidden, src_key_padding_mask=padding_mask)


def _dropout_input(batch_size: int, hidden_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.empty(batch_size, hidden_dim).requires_grad_()
    mask = torch.ones(batch_size, hidden_dim, dtype=torch.int64)
    return x, mask


@register_expert_class("det_dropout", _dropout_input)
class DeterministicDropout(nn.Module):
    """Dropout whose mask the *client* chooses, then a linear layer.

    The server recomputes the forward pass during backward, so a random mask drawn on the
    server would differ between the two; a mask sent by the client does not. Inputs:
    ``x [batch, h]`` float32 and ``mask [batch, h]`` int64 of 0/1; output
    ``Linear(x * mask / (1 - drop_prob))``. Each row depends only on its own inputs, so
    results do not change with how requests are batched together.
    """

    def __init__(self, hidden_dim: int, drop_prob: float = 0.2):
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"drop_prob must be in [0, 1), got {drop_prob}")
        self.drop_prob = drop_prob
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear(x * mask.to(x.dtype) / (1.0 - self.drop_prob))


@register_expert_class("nop", _ffn_input)
class NopExpert(nn.Module):
    """The identity on ``[batch, h]``, without parameters: measures the server's and the
    network's own latency."""

    def __init__(self, hidden_dim: int):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
