"""Sites (``SiteOptimizer`` under ``torchrun``) against a flat swarm of the same size.

Runs with no arguments (about 3 minutes here) and prints a table, then one JSON line.
Two runs train the same MLP on scikit-learn's digits with the same global batch (256
samples per epoch, SGD lr 0.5, 60 epochs, four streams of 16-sample batches):

* **flat**: four processes, four swarmgrad peers;
* **sites**: two ``torchrun --nproc-per-node 2`` jobs; in each, the two ranks all-reduce
  their gradients with gloo and rank 0 is the site's swarm peer.

Both repeat ``--repeats`` times (default 3); reported: the median held-out loss of each
and ``site_loss_ratio`` = sites / flat (1.0 = the same training; the target is within
5%). JSON keys: ``site_loss_ratio``, ``site_final_loss``, ``flat_final_loss``,
``site_wall_s``, ``flat_wall_s``, ``site_ranks_identical`` (every rank of every site ended
with the same parameters as the first site's speaker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_site_peer.py")
sys.path.insert(0, str(HERE))


def bootstrap_peer() -> tuple[subprocess.Popen, str]:
    code = (
        "import time, swarmgrad\n"
        "dht = swarmgrad.DHT(start=True)\n"
        "print(dht.get_visible_maddrs()[0], flush=True)\n"
        "time.sleep(3600)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env()
    )
    assert process.stdout is not None
    address = process.stdout.readline().strip()
    if not address:
        process.kill()
        raise RuntimeError("the bootstrap peer did not start")
    return process, address


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))


def run(mode: str, epochs: int, run_id: str) -> tuple[float, float, bool, int]:
    """One run; returns (held-out loss, wall seconds, all final parameters identical,
    samples computed by all workers together)."""
    from _collab_peer import digits_model, digits_split

    bootstrap, address = bootstrap_peer()
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as out:
        common = ["--mode", mode, "--peers", address, "--run-id", run_id, "--out", out]
        common += ["--epochs", str(epochs)]
        began = time.monotonic()
        try:
            if mode == "flat":
                for index in range(4):
                    command = [sys.executable, WORKER, *common, "--index", str(index)]
                    processes.append(subprocess.Popen(command, env=_env()))
            else:
                for site in range(2):
                    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                    command += ["--nproc-per-node", "2", WORKER, *common]
                    processes.append(
                        subprocess.Popen(
                            [*command, "--site-index", str(site)],
                            env=_env(),
                            stderr=subprocess.DEVNULL,
                        )
                    )
            codes = [p.wait(600) for p in processes]
            wall = time.monotonic() - began
        finally:
            for process in [*processes, bootstrap]:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
        if any(codes):
            raise RuntimeError(f"{mode} run failed: exit codes {codes}")
        finals = [torch.load(os.path.join(out, f"{i}.pt")) for i in range(4)]
    assert all(f["epoch"] >= epochs for f in finals), [f["epoch"] for f in finals]
    reference = finals[0]["state"]
    identical = all(torch.equal(reference[k], f["state"][k]) for f in finals[1:] for k in reference)
    model = digits_model()
    model.load_state_dict(reference)
    _, (test_x, test_y) = digits_split()
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(test_x), test_y))
    return loss, wall, identical, sum(f["samples"] for f in finals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    results: dict[str, list[tuple[float, float, bool, int]]] = {"flat": [], "site": []}
    for repeat in range(args.repeats):
        for mode in ("flat", "site"):
            results[mode].append(run(mode, args.epochs, f"{mode}{repeat}"))
            loss, wall, identical, samples = results[mode][-1]
            print(
                f"# {mode:5s} run {repeat}: held-out loss {loss:.4f}, {wall:.1f} s, "
                f"{samples} samples computed, "
                f"final parameters identical on all workers: {identical}",
                file=sys.stderr,
                flush=True,
            )

    flat_loss = statistics.median(r[0] for r in results["flat"])
    site_loss = statistics.median(r[0] for r in results["site"])
    flat_wall = statistics.median(r[1] for r in results["flat"])
    site_wall = statistics.median(r[1] for r in results["site"])
    print(f"{'run':28s} {'held-out loss':>14s} {'wall s':>8s}")
    print(f"{'flat: 4 peers':28s} {flat_loss:14.4f} {flat_wall:8.1f}")
    print(f"{'sites: 2 x 2 ranks (torchrun)':28s} {site_loss:14.4f} {site_wall:8.1f}")
    print(f"site_loss_ratio = {site_loss / flat_loss:.3f} (target: within 5% of 1)")
    summary = {
        "site_loss_ratio": site_loss / flat_loss,
        "site_final_loss": site_loss,
        "flat_final_loss": flat_loss,
        "site_wall_s": site_wall,
        "flat_wall_s": flat_wall,
        "site_ranks_identical": all(r[2] for r in results["site"]),
        "site_samples": statistics.median(r[3] for r in results["site"]),
        "flat_samples": statistics.median(r[3] for r in results["flat"]),
        "epochs": args.epochs,
        "repeats": args.repeats,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
