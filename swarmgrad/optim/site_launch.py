"""Start the ranks of a site so that they outlive each other.

``python -m swarmgrad.optim.site_launch --nproc-per-node 4 train.py ARGS`` starts four
copies of ``train.py`` with the environment ``torchrun`` gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``), so the script's
``torch.distributed.init_process_group()`` works unchanged. The launcher hosts the job's
store itself. Unlike ``torchrun``, it does not stop the other ranks when one dies: the
survivors of a :class:`~swarmgrad.optim.site.SiteOptimizer` elect a new speaker through
that store and train on. It exits when every rank has exited: with 0 if none exited with
an error (ranks killed by a signal count as lost, not as errors), else with the first
error's code. SIGINT and SIGTERM are passed on to the ranks.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

__all__ = ["launch", "main"]


def launch(
    command: list[str], nproc: int, *, host: str = "127.0.0.1", env: dict | None = None
) -> int:
    """Run ``command`` as ``nproc`` ranks of one site; returns the exit code (above)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    base.update(
        MASTER_ADDR=host,
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    processes = [
        subprocess.Popen(command, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(nproc)
    ]

    def forward(signum: int, _frame: object) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.poll() is None for p in processes):
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    errors = [p.returncode for p in processes if p.returncode > 0]
    del store
    return errors[0] if errors else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m swarmgrad.optim.site_launch",
        description="Start the ranks of a swarmgrad site; a rank's death does not stop the others.",
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address of the store")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    sys.exit(launch([sys.executable, args.script, *args.args], args.nproc_per_node, host=args.host))


if __name__ == "__main__":
    main()
