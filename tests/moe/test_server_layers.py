"""Built-in expert classes, the registry, and custom expert modules."""

from __future__ import annotations

import textwrap

import pytest
import torch

from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server.layers import (
    load_custom_module,
    name_to_block,
    name_to_input,
    register_expert_class,
)
from swarmgrad.moe.server.module_backend import ModuleBackend
from swarmgrad.utils.errors import ValidationError


@pytest.mark.parametrize("name", ["ffn", "transformer", "det_dropout", "nop"])
def test_each_builtin_expert_maps_its_sample_input_to_hidden_sized_outputs(name):
    hidden = 32
    sample = name_to_input[name](3, hidden)
    sample = sample if isinstance(sample, tuple) else (sample,)
    module = name_to_block[name](hidden)
    out = module(*sample)
    assert out.shape == sample[0].shape
    schema = tuple(BatchTensorDescriptor.from_tensor(x) for x in sample)
    assert schema[0].requires_grad  # the hidden states receive gradients
    assert all(not d.requires_grad for d in schema[1:])  # masks do not
    b = ModuleBackend(f"{name}.0", module, args_schema=schema)
    inputs = [
        torch.randn(3, *d.instance_shape) if d.dtype.is_floating_point else d.make_zeros(3)
        for d in schema
    ]
    grads = b.backward(*inputs, torch.ones(3, *b.outputs_schema[0].instance_shape))
    assert grads[0].shape == inputs[0].shape and torch.isfinite(grads[0]).all()


def test_deterministic_dropout_uses_the_clients_mask_and_rows_are_independent():
    module = name_to_block["det_dropout"](8)
    x = torch.randn(4, 8)
    keep_all, drop_all = torch.ones(4, 8, dtype=torch.int64), torch.zeros(4, 8, dtype=torch.int64)
    with torch.no_grad():
        dropped = module(x, drop_all)
        assert torch.allclose(dropped, module.linear.bias.expand(4, 8))
        full = module(x, keep_all)
        assert torch.allclose(full, module.linear(x / 0.8))
        assert torch.allclose(module(x[:2], keep_all[:2]), full[:2])


def test_transformer_ignores_padded_positions():
    torch.manual_seed(0)
    module = name_to_block["transformer"](16).eval()
    hidden, mask = name_to_input["transformer"](2, 16)
    hidden = torch.randn_like(hidden)
    mask[:, 64:] = True
    changed = hidden.clone()
    changed[:, 100] += 10.0  # a padded position
    with torch.no_grad():
        a, b = module(hidden, mask), module(changed, mask)
    assert torch.allclose(a[:, :64], b[:, :64], atol=1e-5)


def test_nop_returns_its_input():
    x = torch.randn(2, 5)
    assert name_to_block["nop"](5)(x) is x


def test_custom_module_file_registers_new_expert_classes(tmp_path):
    path = tmp_path / "my_experts.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        from swarmgrad.moe.server.layers import register_expert_class

        @register_expert_class("test_scaled", lambda batch, hid: torch.empty(batch, hid))
        class Scaled(nn.Module):
            def __init__(self, hidden_dim):
                super().__init__()
                self.scale = nn.Parameter(torch.full((hidden_dim,), 2.0))

            def forward(self, x):
                return x * self.scale
    """)
    )
    try:
        load_custom_module(path)
        assert "test_scaled" in name_to_block
        assert torch.equal(
            name_to_block["test_scaled"](3)(torch.ones(1, 3)), torch.full((1, 3), 2.0)
        )
    finally:
        name_to_block.pop("test_scaled", None)
        name_to_input.pop("test_scaled", None)


def test_broken_custom_modules_are_reported_with_their_path(tmp_path):
    with pytest.raises(ValidationError, match="does not exist"):
        load_custom_module(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    with pytest.raises(ValidationError, match=r"broken\.py.*failed to import.*oops"):
        load_custom_module(broken)
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.exit(3)\n")  # a script-style file: reported, no exit
    with pytest.raises(ValidationError, match=r"script\.py. failed to import: SystemExit: 3"):
        load_custom_module(script)


def test_register_expert_class_checks_its_arguments():
    with pytest.raises(ValidationError, match="non-empty string"):
        register_expert_class("", lambda b, h: torch.empty(b, h))
    with pytest.raises(ValidationError, match="must be callable"):
        register_expert_class("x", None)
