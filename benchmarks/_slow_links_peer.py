"""One peer of ``benchmarks/slow_links.py``: trains :class:`_tiny_lm.TinyGPT` on the
standard library's sources in one of the modes, until the swarm reaches ``--epochs``
(outer steps, for the DiLoCo modes) or until it processed ``--samples`` samples
(``sync`` and ``powersgd``, whose epochs hold a varying number of samples).

Prints JSON lines: ``ready``, ``epoch`` (time, samples this peer processed, and with
``--evaluate`` the held-out loss of the synced model), ``done``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tiny_lm import TinyGPT, random_windows, split, stdlib_corpus, validation_loss


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def make_optimizer(args, dht, model):
    import swarmgrad
    from swarmgrad.compression import Blockwise4BitQuantization, Uniform8BitQuantization

    adamw = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0)
    common = dict(
        dht=dht,
        run_id=f"slow_{args.mode}",
        params=model.parameters(),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        verbose=bool(os.environ.get("SLOW_VERBOSE")),
    )
    if args.mode in ("sync", "powersgd"):
        extra = {}
        if args.mode == "powersgd":
            extra["grad_averager_factory"] = functools.partial(
                swarmgrad.PowerSGDGradientAverager, averager_rank=args.rank
            )
        return swarmgrad.Optimizer(
            target_batch_size=args.batch_size * args.peers,
            batch_size_per_step=args.batch_size,
            optimizer=adamw,
            **extra,
            **common,
        )
    streaming = args.mode == "streaming"
    return swarmgrad.DiLoCoOptimizer(
        batch_size=args.batch_size,
        num_inner_steps=args.inner_steps,
        inner_optimizer=adamw,
        num_fragments=args.fragments if streaming else 1,
        fragment_pace=1.0,  # each round spread over the whole gap to the next fragment
        # both zlib-coded on top (lossless; the links are far slower than zlib)
        grad_compression=Uniform8BitQuantization(deflate=True)
        if streaming
        else Blockwise4BitQuantization(deflate=True),
        **common,
    )


def count_bytes_per_protocol() -> None:
    """Diagnostics (``SLOW_COUNT_BYTES=1``): the payload bytes this peer writes per RPC or
    protocol name, and the DHT keys it reads, printed to stderr at exit."""
    import atexit
    import collections
    import re

    from swarmgrad.dht import node as dht_node
    from swarmgrad.net import mux

    sent: collections.Counter = collections.Counter()
    writes: collections.Counter = collections.Counter()
    original = mux.Stream.write

    timeline: list = []

    async def counting_write(self, data, *, fin=False):
        name = re.search(rb"[a-z_]+\.[a-z_]+", bytes(self.header[:80]))
        sent[name.group().decode() if name else "other"] += len(data)
        writes[name.group().decode() if name else "other"] += 1
        timeline.append(
            (round(time.time(), 3), name.group().decode() if name else "other", len(data))
        )
        return await original(self, data, fin=fin)

    atexit.register(lambda: print("timeline", json.dumps(timeline), file=sys.stderr))

    mux.Stream.write = counting_write

    gets: collections.Counter = collections.Counter()
    original_get_many = dht_node.DHTNode.get_many

    async def counting_get_many(self, keys, *args, **kwargs):
        for key in keys:
            gets[str(key)[:50]] += 1
        return await original_get_many(self, keys, *args, **kwargs)

    dht_node.DHTNode.get_many = counting_get_many
    stores: collections.Counter = collections.Counter()
    original_store_many = dht_node.DHTNode.store_many

    async def counting_store_many(self, keys, *args, **kwargs):
        for key in keys:
            stores[str(key)[:50]] += 1
        return await original_store_many(self, keys, *args, **kwargs)

    dht_node.DHTNode.store_many = counting_store_many
    lookups: collections.Counter = collections.Counter()
    original_lookup = dht_node.DHTNode._lookup

    async def counting_lookup(self, key_id, *args, find_value, latest=False, **kwargs):
        result = await original_lookup(
            self, key_id, *args, find_value=find_value, latest=latest, **kwargs
        )
        kind = "get" if find_value else "store"
        lookups[f"{kind} lookups"] += 1
        lookups[f"{kind} nodes asked"] += len(result.nearest)
        return result

    dht_node.DHTNode._lookup = counting_lookup
    atexit.register(lambda: print("lookups", json.dumps(lookups.most_common()), file=sys.stderr))
    atexit.register(lambda: print("stored", json.dumps(stores.most_common(8)), file=sys.stderr))
    atexit.register(lambda: print("sent", json.dumps(sent.most_common(15)), file=sys.stderr))
    atexit.register(lambda: print("writes", json.dumps(writes.most_common(15)), file=sys.stderr))
    atexit.register(lambda: print("read", json.dumps(gets.most_common(15)), file=sys.stderr))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("sync", "diloco", "streaming", "powersgd"))
    parser.add_argument("--host", required=True, help="the address to listen on")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--samples", type=int, default=None, help="stop after this many")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="accelerator time")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--evaluate-every", type=int, default=1, help="epochs")
    args = parser.parse_args()

    import swarmgrad

    if os.environ.get("SLOW_VERBOSE"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        if os.environ["SLOW_VERBOSE"] == "debug":  # matchmaking's decisions too
            logging.getLogger("swarmgrad.averaging").setLevel(logging.DEBUG)
    if os.environ.get("SLOW_COUNT_BYTES"):
        count_bytes_per_protocol()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every peer starts from the same weights
    model = TinyGPT()
    train, val = split(stdlib_corpus())
    generator = torch.Generator().manual_seed(1000 + args.seed)

    dht = swarmgrad.DHT(
        initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True
    )
    opt = make_optimizer(args, dht, model)
    say(event="ready", pid=os.getpid())

    samples, last_epoch = 0, None
    deadline = time.monotonic() + 1200
    budget = args.samples if args.samples is not None else float("inf")
    while opt.local_epoch < args.epochs and samples < budget and time.monotonic() < deadline:
        if opt.local_epoch != last_epoch:
            last_epoch = opt.local_epoch
            fields = {}
            if args.evaluate and last_epoch % args.evaluate_every == 0:
                fields["val_loss"] = validation_loss(model, val)
            say(event="epoch", epoch=last_epoch, time=time.time(), samples=samples, **fields)
        x, y = random_windows(train, args.batch_size, model.context, generator)
        model.loss(x, y).backward()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # the rest of a real step, as in collaborative.py
        opt.step()
        opt.zero_grad()
        samples += args.batch_size
    # shutdown first: streaming's last rounds finish and merge there (the outer step does
    # not wait for them), and the final model is the one after every sync
    epoch = opt.local_epoch
    opt.shutdown()
    final = {"val_loss": validation_loss(model, val)} if args.evaluate else {}
    say(event="epoch", epoch=epoch, time=time.time(), samples=samples, **final)
    dht.shutdown()
    say(event="done")


if __name__ == "__main__":
    main()
