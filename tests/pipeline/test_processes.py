"""End to end with real processes: two `swarmgrad serve-stage` processes serve stage 0,
one is SIGKILLed between a micro-batch's forward and its backward; the backward goes to
the survivor, and training goes on without a micro-batch lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from swarmgrad.pipeline.stages import load_stage_module, make_stage_backend
from tests.helpers.pipeline import PipelineSwarm

MODULE = Path(__file__).parents[1] / "helpers" / "pipeline_stage_module.py"


def start_stage_process(pipeline: str, stage: int, initial_peers: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    command = [
        sys.executable, "-m", "swarmgrad", "serve-stage", "--module", str(MODULE),
        "--pipeline", pipeline, "--stage", str(stage), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--update-period", "1", "--average-period", "0", "--rebalance-interval", "0",
        "--log-level", "WARNING", "--initial-peers", *initial_peers,
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_serving(process: subprocess.Popen) -> str:
    """The process's PeerID (base58), once it printed that it serves."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("  /"):
            return line.strip().rsplit("/p2p/", 1)[1]
    raise AssertionError(f"the stage process exited: {''.join(lines)} {process.stderr.read()}")


@pytest.mark.timeout(120)
def test_a_stage_server_killed_mid_micro_batch_is_routed_around():
    module = load_stage_module(MODULE)
    specs = module.build()
    with PipelineSwarm() as swarm:
        name = swarm.new_name()
        addrs = [str(a) for a in swarm.addrs]
        processes = [start_stage_process(name, 0, addrs) for _ in range(2)]
        try:
            ids = [wait_serving(p) for p in processes]
            for stage in (1, 2):
                backend = make_stage_backend(f"{name}.{stage}", specs[stage], module.make_optimizer)
                swarm.serve(name, stage, 3, None, None, backend=backend, update_period=1.0)
            pipe = swarm.pipeline(name, 3, timeout=30, routing={"initial_deadline": 10.0})
            loss_fn = nn.CrossEntropyLoss()

            def micro_batch():
                ids_in = torch.randint(0, 32, (4, 8))
                logits = pipe(ids_in)
                return loss_fn(logits.flatten(0, 1), ids_in.flatten())

            for _ in range(3):
                micro_batch().backward()
            loss = micro_batch()
            victim = pipe.caller.last_route[0].to_base58()
            assert victim in ids
            processes[ids.index(victim)].send_signal(signal.SIGKILL)
            processes[ids.index(victim)].wait(10)
            loss.backward()  # goes to the survivor, which recomputes the forward
            assert pipe.stats["failed"] + pipe.stats["late"] >= 1
            assert pipe.stats["backward_hops"] == 12
            for _ in range(6):
                micro_batch().backward()
            assert pipe.stats["dropped"] == 0 and pipe.stats["micro_batches"] == 10
            survivor = next(i for i in ids if i != victim)
            assert pipe.caller.last_route[0].to_base58() == survivor
        finally:
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in processes:
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for process in processes:
                process.stdout.close()
                process.stderr.close()
