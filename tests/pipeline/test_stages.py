"""The stage-module convention: splitting a model into stages and refusing ones that
don't chain, naming the boundary; building stage backends; loading stage modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from swarmgrad.pipeline.stages import (
    StageModuleError,
    load_stage_module,
    make_stage_backend,
    split_stages,
)
from swarmgrad.utils.errors import ValidationError

MODULE = Path(__file__).parents[1] / "helpers" / "pipeline_stage_module.py"


def test_stages_that_chain_are_described_by_their_schemas():
    specs = split_stages(
        [nn.Embedding(10, 4), nn.Linear(4, 6), nn.Linear(6, 2)], torch.zeros(3, 5, dtype=torch.long)
    )
    assert [s.args_schema[0].instance_shape for s in specs] == [(5,), (5, 4), (5, 6)]
    assert specs[0].args_schema[0].dtype == torch.int64
    assert specs[-1].outputs_schema[0].instance_shape == (5, 2)
    backend = make_stage_backend("p.1", specs[1])
    assert backend.args_schema == specs[1].args_schema and backend.optimizer is not None


def test_stages_that_do_not_chain_are_refused_naming_the_boundary():
    stages = [nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(5, 2)]
    with pytest.raises(
        ValidationError,
        match=r"stages 1 and 2 do not chain: stage 2 failed on the outputs of stage 1 "
        r"\(\[2, 3\] float32\)",
    ):
        split_stages(stages, torch.zeros(2, 4))
    with pytest.raises(
        ValidationError, match=r"stage 0 failed on sample_input\(\) \(\[2, 5\] float32\)"
    ):
        split_stages(stages, torch.zeros(2, 5))


class Squash(nn.Module):
    def forward(self, x):
        return x.sum(0, keepdim=True)


class Tupled(nn.Module):
    def forward(self, x):
        return x, "not a tensor"


@pytest.mark.parametrize(
    "stages, named",
    [
        ([], "non-empty list"),
        ([nn.Linear(4, 4), "layer"], "stage 1 is a str"),
        ([nn.Linear(4, 4), Squash()], "stage 1 turned a batch of 2 into one of 1"),
        ([Tupled()], r"the output of stage 0\[1\] is a str"),
    ],
)
def test_bad_splits_are_refused_naming_them(stages, named):
    with pytest.raises(ValidationError, match=named):
        split_stages(stages, torch.zeros(2, 4))


def test_a_stage_module_builds_the_same_checked_stages_on_every_peer():
    module = load_stage_module(MODULE)
    first, second = module.build(), module.build()
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert torch.equal(p, q)
    assert isinstance(
        make_stage_backend("x.0", first[0], module.make_optimizer).optimizer, torch.optim.SGD
    )


def test_broken_stage_modules_are_refused_naming_file_and_function(tmp_path):
    with pytest.raises(StageModuleError, match="does not exist"):
        load_stage_module(tmp_path / "missing.py")
    no_sample = tmp_path / "no_sample.py"
    no_sample.write_text("def make_stages():\n    return []\n")
    with pytest.raises(StageModuleError, match=r"no_sample.py.*defines no sample_input\(\)"):
        load_stage_module(no_sample)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(StageModuleError, match="failed to import: RuntimeError: boom"):
        load_stage_module(broken)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.run(
        [sys.executable, "-m", "swarmgrad", "serve-stage", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_stage_refuses_a_split_that_does_not_chain_before_joining(tmp_path):
    bad = tmp_path / "bad_stages.py"
    bad.write_text(
        "import torch\nfrom torch import nn\n"
        "def make_stages():\n    return [nn.Linear(4, 8), nn.Linear(6, 2)]\n"
        "def sample_input(batch_size):\n    return torch.zeros(batch_size, 4)\n"
    )
    done = run_cli("--module", str(bad), "--pipeline", "p", "--stage", "0")
    assert done.returncode == 2, done.stderr
    assert "stages 0 and 1 do not chain" in done.stderr
    done = run_cli("--module", str(MODULE), "--pipeline", "p", "--stage", "3")
    assert done.returncode == 2 and "--stage must be in [0, 3), got 3" in done.stderr
    done = run_cli(
        "--module", str(MODULE), "--pipeline", "p", "--stage", "0", "--activation-cache-mb", "-1"
    )  # fmt: skip
    assert done.returncode == 2 and "--activation-cache-mb must be 0 or more" in done.stderr


def test_serve_stage_options_reach_the_peer_options():
    import argparse

    from swarmgrad.cli import serve_stage_command

    parser = argparse.ArgumentParser()
    serve_stage_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve-stage", "--module", "m.py", "--pipeline", "p", "--stage", "0",
         "--averaging-mode", "diloco", "--activation-cache-mb", "0", "--average-period", "5",
         "--rebalance-interval", "7"]
    )  # fmt: skip
    options = serve_stage_command._options(args)
    assert options.training.mode == "diloco" and options.training.average_period == 5
    assert options.server.activation_cache_bytes == 0
    assert options.rebalance.interval == 7
    args.average_period = 0
    assert serve_stage_command._options(args).training is None
    args = parser.parse_args(
        ["serve-stage", "--module", "m.py", "--pipeline", "p", "--stage", "0",
         "--averaging-mode", "gradients"]
    )  # fmt: skip
    assert serve_stage_command._options(args).training.mode == "gradients"
