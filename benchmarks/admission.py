"""What admission costs: connection set-up with access tokens against an open swarm.

The listener peers (one per variant) run in a process of their own, so that the two
sides of a handshake work in parallel as on two machines; the dialer in this process
times, on a fresh loopback connection each trial, the first call: dial, TLS 1.3, the
identity handshake and one small echo. Variants:

* ``open``: no authority (the reference: today's swarm);
* ``tokens``: both peers present tokens and check the other's, each token's signature
  verified on every connection (the verified-token cache disabled on both sides): what a
  first connection between two peers costs;
* ``tokens-cached``: the same with the cache on (default): what reconnecting costs, since
  a peer presents the same token on every connection until it renews.

Trials take the variants in turn (so drift in machine load hits all alike); a run is 200
trials of each, and gives each variant's median; the figures are medians over 5 runs.
Prints a table, then one JSON line whose ``admission_overhead`` is the relative extra
set-up time of ``tokens`` over ``open`` (0.05 = 5% more), ``admission_overhead_cached``
the same for ``tokens-cached``.
Usage: ``python benchmarks/admission.py [--runs 5] [--rounds 10] [--per-round 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from swarmgrad.net.admission import Admission, Authority
from swarmgrad.net.identity import Identity
from swarmgrad.net.peer import Peer

VARIANTS = ("open", "tokens", "tokens-cached")


def _admission(variant: str, authority: Authority, identity: Identity) -> Admission | None:
    if variant == "open":
        return None
    cache = 0 if variant == "tokens" else 4096
    token = authority.issue(identity.peer_id, "trainer", "1d")
    return Admission(authority.public_key, token, verified_cache_size=cache)


async def _echo(request, context):
    return request


def _listeners(authority_seed: bytes, pipe) -> None:
    """One process hosts the listener of every variant (trials never overlap)."""

    async def serve() -> None:
        authority = Authority(Identity.from_seed(authority_seed))
        peers = {}
        for variant in VARIANTS:
            identity = Identity.generate()
            admission = _admission(variant, authority, identity)
            peers[variant] = await Peer.create(identity=identity, admission=admission)
            peers[variant].add_handler("echo", _echo)
        pipe.send({v: str(p.get_visible_maddrs()[0]) for v, p in peers.items()})
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # until told
        for peer in peers.values():
            await peer.shutdown()

    asyncio.run(serve())


async def _trial(dialer: Peer, address: str) -> float:
    started = time.perf_counter()
    await dialer.call(address, "echo", b"x" * 100)
    elapsed = time.perf_counter() - started
    for conn in list(dialer._all_connections):
        conn.close("trial over")
    await asyncio.sleep(0.002)  # let both sides drop the connection before the next one
    return elapsed


async def measure(addresses: dict[str, str], authority: Authority, rounds: int, per_round: int):
    dialers = {}
    for variant in VARIANTS:
        identity = Identity.generate()
        dialers[variant] = await Peer.create(
            identity=identity, admission=_admission(variant, authority, identity)
        )
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for variant in VARIANTS:  # warm-up: contexts, caches, code paths
            for _ in range(5):
                await _trial(dialers[variant], addresses[variant])
        for index in range(rounds):
            gc.collect()
            for trial in range(per_round):  # one trial of each variant in turn
                shift = (index * per_round + trial) % len(VARIANTS)
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    samples[variant].append(await _trial(dialers[variant], addresses[variant]))
    finally:
        for dialer in dialers.values():
            await dialer.shutdown()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=20)
    args = parser.parse_args()

    seed = os.urandom(32)
    authority = Authority(Identity.from_seed(seed))
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    listener = context.Process(target=_listeners, args=(seed, theirs), daemon=True)
    listener.start()
    addresses = ours.recv()
    runs = []
    try:
        for _ in range(args.runs):
            samples = asyncio.run(measure(addresses, authority, args.rounds, args.per_round))
            runs.append({v: statistics.median(samples[v]) * 1000 for v in VARIANTS})
    finally:
        ours.send("stop")
        listener.join(30)
        if listener.is_alive():
            listener.kill()

    trials = args.rounds * args.per_round
    print(f"connection set-up + first call on loopback: median of {trials} fresh connections "
          f"per variant and run; {platform.machine()}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'run':<5}" + "".join(f"{v + ' ms':>18}" for v in VARIANTS) + f"{'overhead':>10}"
          f"{'cached':>9}")  # fmt: skip
    overheads, cached = [], []
    for index, run in enumerate(runs):
        overheads.append(run["tokens"] / run["open"] - 1)
        cached.append(run["tokens-cached"] / run["open"] - 1)
        print(f"{index:<5}" + "".join(f"{run[v]:>18.3f}" for v in VARIANTS)
              + f"{overheads[-1]:>+10.1%}{cached[-1]:>+9.1%}")  # fmt: skip
    median = {v: statistics.median(run[v] for run in runs) for v in VARIANTS}
    result = {
        "admission_overhead": round(statistics.median(overheads), 4),
        "admission_overhead_cached": round(statistics.median(cached), 4),
        "open_ms": round(median["open"], 3),
        "tokens_ms": round(median["tokens"], 3),
        "tokens_cached_ms": round(median["tokens-cached"], 3),
        "runs": len(runs),
        "trials_per_run": trials,
    }
    print(
        f"median over runs: tokens {result['admission_overhead']:+.1%}, "
        f"cached tokens {result['admission_overhead_cached']:+.1%} against an open swarm"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
