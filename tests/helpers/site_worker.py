"""One rank of a site in tests/optim/test_site.py (run by torchrun or site_launch).

Writes JSON lines to ``OUT/SITE-RANK.jsonl``: ``epoch`` each time the site's epoch
changes (with this rank's parameters), ``mismatch`` if the site refused the model,
``dying`` just before the speaker kills itself, ``done`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from swarmgrad import DHT, DiLoCoOptimizer, Optimizer
from swarmgrad.optim.site import SiteMismatch, SiteOptimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--until", type=int, default=4)
    parser.add_argument("--wide-rank", type=int, default=-1, help="this rank's model differs")
    parser.add_argument("--diloco", action="store_true", help="DiLoCo, inner steps mirrored")
    parser.add_argument("--kill-speaker-at", type=int, default=-1, help="epoch; mid-epoch")
    parser.add_argument(
        "--start-with", type=int, default=0, help="train once this many ranks (all sites) joined"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    log = open(os.path.join(args.out, f"{args.site}-{rank}.jsonl"), "a")

    def say(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    torch.manual_seed(100 + rank)  # ranks start different: the site makes them equal
    width = 9 if rank == args.wide_rank else 8
    model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def inner_optimizer(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.5)

    def swarm_optimizer(dht, params):
        if args.diloco:
            return DiLoCoOptimizer(
                dht=dht,
                run_id="site_test_diloco",
                batch_size=16,
                num_inner_steps=5,
                inner_optimizer=inner_optimizer,
                params=params,
                matchmaking_time=1.0,
                averaging_timeout=5.0,
            )
        return Optimizer(
            dht=dht,
            run_id="site_test",
            target_batch_size=192,
            params=params,
            optimizer=inner_optimizer,
            # generous: a round that fails on a loaded box leaves the sites' steps apart
            # (each steps on its own gradients), and the test checks they are equal
            matchmaking_time=3.0,
            averaging_timeout=30.0,
        )

    try:
        site = SiteOptimizer(
            params=model.named_parameters(),
            batch_size_per_step=8,
            dht_factory=lambda: DHT(initial_peers=[args.peers], start=True),
            swarm_optimizer=swarm_optimizer,
            local_optimizer=inner_optimizer if args.diloco else None,
            heartbeat_interval=0.2,
            heartbeat_timeout=2.0,
            timeout=60.0,
        )
    except SiteMismatch as e:
        say(event="mismatch", message=str(e))
        dist.destroy_process_group()  # a live gloo group at exit may abort the process
        return

    _wait_for_ranks(args.out, f"{args.site}-{rank}", args.start_with)
    generator = torch.Generator().manual_seed(hash(args.site) % 1000 + rank)
    steps, steps_in_epoch, last = 0, 0, -1
    while site.local_epoch < args.until:
        if site.local_epoch != last:
            last, steps_in_epoch = site.local_epoch, 0
            peers = site.swarm.tracker.global_progress.num_peers if site.is_speaker else None
            say(event="epoch", epoch=last, params=_flat(model), members=site.members, peers=peers)
        if rank == 0 and 0 <= args.kill_speaker_at <= last and steps_in_epoch == 3:
            say(event="dying", epoch=last)
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 8, generator=generator)
        y = torch.stack([x[:, 0] + x[:, 1], x[:, 2] - x[:, 3]], dim=1)
        if width == 9:
            x = torch.nn.functional.pad(x, (0, 1))
        torch.nn.functional.mse_loss(model(x), y).backward()
        site.step()
        site.zero_grad()
        steps_in_epoch += 1
        steps += 1
        time.sleep(0.05)
    say(
        event="done",
        epoch=site.local_epoch,
        params=_flat(model),
        members=site.members,
        failovers=site.failovers,
        speaker=site.speaker_rank,
        broadcasts=site.parameter_broadcasts,
        resyncs=site.mirror_resyncs,
        steps=steps,
    )
    site.shutdown()
    dist.destroy_process_group()


def _wait_for_ranks(out: str, me: str, count: int, timeout: float = 90.0) -> None:
    """A start line across sites: on a loaded machine one site may join the swarm seconds
    before the other and train several epochs alone, and the late one then downloads its
    state instead of stepping through every epoch (what the tests check)."""
    if count <= 0:
        return
    with open(os.path.join(out, f"ready-{me}"), "w"):
        pass
    deadline = time.monotonic() + timeout
    while sum(name.startswith("ready-") for name in os.listdir(out)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{me}: fewer than {count} ranks joined within {timeout:.0f} s")
        time.sleep(0.05)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


if __name__ == "__main__":
    main()
