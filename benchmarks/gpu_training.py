"""One peer's training throughput through ``swarmgrad.Optimizer`` against plain PyTorch,
and two peers against one with their combined batch, on a GPT-style model.

Runs with no arguments: on a GPU, a ~100M-parameter GPT (12 layers, width 768, 16k
vocabulary, 512 tokens) in bf16 autocast; where torch sees no GPU (or with ``--small``),
a scaled-down model in fp32 on the CPU, small enough for the test suite.

* **Throughput.** The plain loop accumulates 8 micro-batches and steps AdamW (the same
  global batch); swarmgrad's is a one-peer swarm whose ``target_batch_size`` is 8
  micro-batches, so the swarm steps every 8 local steps: samples/s of each after a
  warm-up, in sync mode with the optimizer on the device, and with
  ``offload_optimizer=True`` (master copy and AdamW in host memory). Target: >= 0.97 of
  plain's throughput.
* **Two peers.** Two processes train together (each batch B) for E epochs of 16B
  samples; one process trains alone with batch 2B for E epochs of 16B samples (the same
  global batch and number of updates; the samples each setup consumed are reported, as
  peers that wait for each other at an epoch's end keep computing). Held-out loss of
  each; target: within 2%.

The data is learnable and needs no download: token sequences from a fixed random Markov
chain (a held-out set from another seed). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
LOCAL_STEPS = 8  # micro-batches per global step, for the plain loop and the swarm alike


@dataclass(frozen=True)
class Config:
    vocab: int
    width: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    timed_steps: int
    epochs: int  # of the two-peer comparison

    @classmethod
    def full(cls) -> Config:
        return cls(vocab=16384, width=768, layers=12, heads=12, seq_len=512, batch=16,
                   timed_steps=8 * LOCAL_STEPS, epochs=30)  # fmt: skip

    @classmethod
    def small(cls) -> Config:
        return cls(vocab=64, width=32, layers=2, heads=2, seq_len=32, batch=8,
                   timed_steps=3 * LOCAL_STEPS, epochs=3)  # fmt: skip


class GPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm causal blocks, a
    language-model head tied to the token embedding."""

    def __init__(self, c: Config):
        super().__init__()
        self.tokens = nn.Embedding(c.vocab, c.width)
        self.positions = nn.Embedding(c.seq_len, c.width)
        layer = nn.TransformerEncoderLayer(
            c.width, c.heads, 4 * c.width, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, c.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.tokens.weight
        for weight in (self.tokens.weight, self.positions.weight):
            nn.init.normal_(weight, std=0.02)  # GPT-2's init (the head is tied)
        mask = torch.triu(torch.full((c.seq_len, c.seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)
        hidden = self.blocks(hidden, mask=self.mask, is_causal=True)
        return self.head(self.norm(hidden))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


class MarkovData:
    """Sequences from a fixed random Markov chain (sparse transitions: learnable)."""

    def __init__(self, c: Config, device: torch.device, seed: int):
        chain = torch.Generator().manual_seed(1234)
        logits = torch.randn(c.vocab, c.vocab, generator=chain) * 4.0
        self.transitions = torch.softmax(logits, dim=-1).to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.c, self.device = c, device

    def batch(self, size: int) -> torch.Tensor:
        tokens = torch.empty(size, self.c.seq_len + 1, dtype=torch.long, device=self.device)
        tokens[:, 0] = torch.randint(
            self.c.vocab, (size,), device=self.device, generator=self.generator
        )
        for t in range(1, self.c.seq_len + 1):
            probs = self.transitions[tokens[:, t - 1]]
            tokens[:, t] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return tokens


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(c: Config, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return GPT(c).to(device)


LEARNING_RATE = {"small": 3e-3, "full": 3e-4}
_lr = LEARNING_RATE["full"]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=_lr, weight_decay=0.01)


def use_learning_rate(c: Config) -> None:
    global _lr
    _lr = LEARNING_RATE["small" if c.width < 256 else "full"]


# ---------------------------------------------------------------------- throughput


def time_plain(c: Config, device: torch.device, batches: list[torch.Tensor]) -> float:
    model = make_model(c, device)
    opt = adamw(model.parameters())

    def step(i: int) -> None:
        with autocast(device):
            loss = loss_of(model, batches[i % len(batches)]) / LOCAL_STEPS
        loss.backward()
        if (i + 1) % LOCAL_STEPS == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return _timed(c, device, step)


def time_swarmgrad(c: Config, device: torch.device, batches: list, offload: bool) -> float:
    from swarmgrad import DHT, Optimizer

    model = make_model(c, device)
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    opt = Optimizer(
        dht=dht, run_id=f"gpu-bench-{offload}-{os.getpid()}",
        target_batch_size=LOCAL_STEPS * c.batch, batch_size_per_step=c.batch,
        optimizer=adamw, params=model.parameters(), offload_optimizer=offload,
        matchmaking_time=0.5, averaging_timeout=10.0, metrics=False,
    )  # fmt: skip
    try:

        def step(i: int) -> None:
            with autocast(device):
                loss = loss_of(model, batches[i % len(batches)])
            loss.backward()
            opt.step()
            opt.zero_grad()

        return _timed(c, device, step)
    finally:
        opt.shutdown()
        dht.shutdown()


def _timed(c: Config, device: torch.device, step) -> float:
    for i in range(2 * LOCAL_STEPS):  # warm-up: kernels, allocator, the swarm's first epochs
        step(i)
    sync(device)
    began = time.perf_counter()
    for i in range(c.timed_steps):
        step(i)
    sync(device)
    return c.timed_steps * c.batch / (time.perf_counter() - began)


# ---------------------------------------------------------------------- two peers


def peer_main(args: argparse.Namespace) -> None:
    """A child process: train with the swarm for ``--epochs`` epochs, print the held-out
    loss as JSON."""
    from swarmgrad import DHT, Optimizer

    c = Config(**json.loads(args.config))
    use_learning_rate(c)
    device = torch.device(args.device)
    model = make_model(c, device)
    dht = DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    opt = Optimizer(
        dht=dht, run_id=args.run_id, target_batch_size=args.target, batch_size_per_step=args.batch,
        optimizer=adamw, params=model.parameters(), matchmaking_time=args.matchmaking_time,
        averaging_timeout=60.0,
        offload_optimizer=False, metrics=False,
    )  # fmt: skip
    data = MarkovData(c, device, seed=args.seed)
    samples = 0
    try:
        while opt.local_epoch < args.epochs:
            with autocast(device):
                loss = loss_of(model, data.batch(args.batch))
            loss.backward()
            opt.step()
            opt.zero_grad()
            samples += args.batch
        held_out = MarkovData(c, device, seed=999).batch(64)
        with torch.no_grad(), autocast(device):
            final = float(loss_of(model, held_out))
        print(json.dumps({"loss": final, "samples": samples, "epoch": opt.local_epoch}))
    finally:
        opt.shutdown()
        dht.shutdown()


def run_peers(c: Config, device: torch.device, epochs: int) -> dict:
    from swarmgrad import DHT

    boot = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    address = str(boot.get_visible_maddrs()[0])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    target = 2 * LOCAL_STEPS * c.batch

    def spawn(run_id: str, batch: int, seed: int, log) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--peer", "--run-id", run_id,
             "--initial-peers", address, "--batch", str(batch), "--target", str(target),
             "--epochs", str(epochs), "--seed", str(seed), "--device", str(device),
             "--matchmaking-time", "0.5" if c.width < 256 else "2.0",
             "--config", json.dumps(asdict(c))],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )  # fmt: skip

    try:
        with tempfile.TemporaryFile("w+") as log:
            began = time.perf_counter()
            pair = [spawn("gpu-bench-pair", c.batch, seed, log) for seed in (1, 2)]
            alone = spawn("gpu-bench-alone", 2 * c.batch, 3, log)
            outputs = [p.communicate(timeout=3600)[0] for p in [*pair, alone]]
            seconds = time.perf_counter() - began
            if any(p.returncode for p in [*pair, alone]):
                log.seek(0)
                raise RuntimeError(f"a peer failed:\n{log.read()[-3000:]}")
    finally:
        boot.shutdown()
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    pair_loss = sum(r["loss"] for r in results[:2]) / 2
    return {
        "pair_losses": [r["loss"] for r in results[:2]],
        "pair_samples": sum(r["samples"] for r in results[:2]),
        "alone_loss": results[2]["loss"],
        "alone_samples": results[2]["samples"],
        "loss_ratio_pair_vs_alone": pair_loss / results[2]["loss"],
        "seconds": seconds,
    }


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the scaled-down CPU model")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--skip-peers", action="store_true", help="throughput only")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of the two-peer run")
    # (the child process of the two-peer comparison)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    for name in ("--run-id", "--config"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    for name in ("--batch", "--target", "--seed"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--matchmaking-time", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer_main(args)
        return

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    small = args.small or device.type != "cuda"
    c = Config.small() if small else Config.full()
    if args.epochs is not None:
        c = Config(**{**asdict(c), "epochs": args.epochs})
    use_learning_rate(c)
    began = time.perf_counter()
    params = sum(p.numel() for p in GPT(c).parameters())
    data = MarkovData(c, device, seed=0)
    batches = [data.batch(c.batch) for _ in range(LOCAL_STEPS)]
    plain_first = time_plain(c, device, batches)
    synced = time_swarmgrad(c, device, batches, offload=False)
    offloaded = time_swarmgrad(c, device, batches, offload=True)
    plain_again = time_plain(c, device, batches)  # the first run warmed up the process
    plain = max(plain_first, plain_again)  # (the ratios are against the faster)
    peers = None if args.skip_peers else run_peers(c, device, c.epochs)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{params / 1e6:.1f}M-parameter GPT on {name} "
          f"({'bf16 autocast' if device.type == 'cuda' else 'fp32'}), batch {c.batch} x "
          f"{c.seq_len} tokens, global batch {LOCAL_STEPS} micro-batches")  # fmt: skip
    print(f"{'loop':<34}{'samples/s':>12}{'vs plain':>10}")
    for label, value in (("plain PyTorch (accumulate 8, AdamW)", plain),
                         ("swarmgrad.Optimizer, sync", synced),
                         ("swarmgrad.Optimizer, offload_optimizer", offloaded)):  # fmt: skip
        print(f"{label:<34}{value:>12.1f}{value / plain:>10.3f}")
    if peers is not None:
        pair_loss, ratio = sum(peers["pair_losses"]) / 2, peers["loss_ratio_pair_vs_alone"]
        print(f"two peers (batch {c.batch} each): held-out loss {pair_loss:.4f}; one peer "
              f"(batch {2 * c.batch}): {peers['alone_loss']:.4f}; ratio {ratio:.4f}")  # fmt: skip
    print(json.dumps({
        "device": name,
        "dtype": "bf16" if device.type == "cuda" else "fp32",
        "params": params,
        "config": asdict(c),
        "samples_per_s": {"plain": plain, "sync": synced, "offload": offloaded,
                          "plain_runs": [plain_first, plain_again]},
        "ratio_sync": synced / plain,
        "ratio_offload": offloaded / plain,
        "peers": peers,
        "seconds": time.perf_counter() - began,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
