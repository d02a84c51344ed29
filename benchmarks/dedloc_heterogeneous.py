"""DeDLOC in a heterogeneous swarm: a collaborative run over peers of different speeds and
links, some behind NAT, with the all-reduce's spans sized to the announced bandwidths
(adaptive) against equal spans.

    python benchmarks/dedloc_heterogeneous.py        # about 10 minutes here

Six peers train one small MLP (1.06M parameters, real forward and backward) with
:class:`swarmgrad.Optimizer`. Each local step (16 samples) also sleeps a peer's own time,
the accelerator it would have, from 0.1 s (the fastest) to 0.4 s (the slowest), so
peers process samples at different rates and the global batch fills with whatever each
contributes. Each peer sits in its own network namespace behind a veth shaped with
``tc tbf`` (``_star_lab``) to 100, 100, 20 or 10 Mbit/s; the last two peers (50 and
10 Mbit/s) sit one namespace further, behind a NAT (nft masquerade) that they can dial
out of but nobody can dial into, and run in client mode: they send their gradients and
get the average back, reduce nothing. The bootstrap peer is on the hub, unshaped.

* **solo**: each peer's rate alone (same model, same step, a local SGD step, no swarm),
  one after another in one process; their sum is the ideal swarm, with no averaging;
* **equal**: the swarm with no bandwidth announced: every peer that can reduce (not the
  clients) owns an equal share of the vector;
* **adaptive**: each peer announces its link rate (``averager_opts={"bandwidth": ...}``)
  and the spans come from the load-balancing program
  (:mod:`swarmgrad.averaging.allreduce.load_balancing`): the 10 Mbit/s reducer gets little or
  nothing to reduce, the 100 Mbit/s ones most.

``target_batch_size`` is set from the solo rates so that an epoch's compute lasts about
``--epoch-compute`` (4) seconds; a run is one warm-up epoch then ``--epochs`` (4)
measured ones; ``--repeats`` (3) runs of each mode alternate their order, and medians
are reported. Swarm samples/s are each peer's samples between the start of epoch 1 and
of the last epoch over that time, summed. Bytes each peer sent come from its veth's
counters; ``full_rounds`` is the share of the measured epochs' gradient rounds that
averaged every span with every member. A ``model_averaging_s`` column gives the time of
one round that the spans imply at the link rates (the slowest member's bytes over its
rate).

Without the lab (no root, no ``ip``/``tc``: see ``_star_lab.lab_unavailable_reason``, or
``DEDLOC_NETWORK=sim``), the averaging rounds run on the simulated network
(:mod:`swarmgrad.net.sim`, virtual clock) with the same rates, modes and spans, and the
swarm's rate is modelled as ``target / (target / sum of solo rates + round time)``; the
reason is printed and ``network`` in the JSON says ``sim``. Without ``nft`` the clients
run in plain client mode on their own shaped hosts (``nat`` false, reason printed).

Small configurations for tests come from environment variables: ``DEDLOC_PEERS``
(``sleep:rate[:client],...``, e.g. ``0.02:100mbit,0.03:20mbit,0.03:50mbit:client``),
``DEDLOC_HIDDEN``, ``DEDLOC_EPOCHS``, ``DEDLOC_REPEATS``, ``DEDLOC_EPOCH_COMPUTE``,
``DEDLOC_SOLO_STEPS``, ``DEDLOC_NETWORK`` (``lab`` / ``sim``), ``DEDLOC_LOG_DIR``;
``DEDLOC_PLOT`` is where the PNG goes (``benchmarks/results/dedloc_heterogeneous.png``, or
``docs/`` with ``SWARMGRAD_UPDATE_DOCS=1``; empty: no plot; needs matplotlib), and
``--plot-from FILE`` draws the JSON line of an earlier run without running anything.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEER = HERE / "_dedloc_peer.py"
sys.path.insert(0, str(HERE))

from _child_process import JsonLinesProcess  # noqa: E402
from _results import figure_path  # noqa: E402
from _star_lab import StarLab, lab_unavailable_reason, set_congestion_control  # noqa: E402

MODES = ("equal", "adaptive")
PREFIX = "ddh"  # namespace names: ddhhub<pid>, ddhh<i>x<pid>, ddhn<i>x<pid> (behind NAT)
SUBNET = "10.86.0"  # the star; every NAT'd host's own LAN is 10.86.1.0/24 in its namespace
LAN_ROUTER, LAN_HOST = "10.86.1.1", "10.86.1.2"
BATCH = 16
BOOTSTRAP = (
    "import sys, time, swarmgrad\n"
    "dht = swarmgrad.DHT(host_maddrs=[f'/ip4/{sys.argv[1]}/tcp/0'], start=True)\n"
    "print(dht.get_visible_maddrs()[0], flush=True)\n"
    "time.sleep(3600)\n"
)


@dataclass(frozen=True)
class PeerSpec:
    step_sleep: float
    rate: str  # tc syntax, e.g. "100mbit"
    client: bool = False

    @property
    def mbit(self) -> float:
        return _bits_per_second(self.rate) / 1e6


DEFAULT_PEERS = (
    PeerSpec(0.10, "100mbit"),
    PeerSpec(0.15, "100mbit"),
    PeerSpec(0.20, "20mbit"),
    PeerSpec(0.30, "10mbit"),
    PeerSpec(0.20, "50mbit", client=True),
    PeerSpec(0.40, "10mbit", client=True),
)


def _bits_per_second(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate {rate!r}: expected a number followed by gbit, mbit or kbit")


def parse_peers(text: str) -> tuple[PeerSpec, ...]:
    """``"0.1:100mbit,0.4:10mbit:client"`` -> PeerSpecs."""
    specs = []
    for item in text.split(","):
        fields = item.strip().split(":")
        if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != "client"):
            raise ValueError(f"peer {item!r}: expected sleep:rate or sleep:rate:client")
        _bits_per_second(fields[1])
        specs.append(PeerSpec(float(fields[0]), fields[1], len(fields) == 3))
    if all(s.client for s in specs):
        raise ValueError("at least one peer must accept connections (not client)")
    return tuple(specs)


# ------------------------------------------------------------------ the spans' model


def plan_spans(numel: int, peers: tuple[PeerSpec, ...], mode: str) -> tuple[int, ...]:
    """The spans the averager derives for this group (round_plan: clients reduce nothing;
    announced bandwidths, or none at all for equal shares)."""
    from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers

    bandwidths = [0.0 if p.client else (p.mbit if mode == "adaptive" else None) for p in peers]
    return load_balance_peers(numel, bandwidths)


def model_round_seconds(numel: int, peers: tuple[PeerSpec, ...], spans: tuple[int, ...]) -> float:
    """The slowest member's bytes (each direction) over its link rate, for float32."""
    senders = len(peers)
    worst = 0.0
    for peer, span in zip(peers, spans, strict=True):
        share = span / numel
        load = (1 - share) + share * (senders - 1)  # vectors through its link each way
        worst = max(worst, load * numel * 4 * 8 / _bits_per_second(peer.rate))
    return worst


# ------------------------------------------------------------------ processes


class Proc(JsonLinesProcess):
    """A peer process (see ``_child_process``), one BLAS thread each."""

    def __init__(self, argv: list[str], log_path: Path | None):
        super().__init__(argv, log_path, env={"OMP_NUM_THREADS": "1"})


def measure_solo(peers: tuple[PeerSpec, ...], hidden: int, steps: int) -> list[float]:
    """Samples/s of each peer alone, one after another in one process."""
    argv = [
        sys.executable, str(PEER), "--solo", ",".join(str(p.step_sleep) for p in peers),
        "--solo-steps", str(steps), "--hidden", str(hidden), "--batch-size", str(BATCH),
    ]  # fmt: skip
    proc = Proc(argv, None)
    try:
        proc.process.wait(60 + len(peers) * steps * (max(p.step_sleep for p in peers) + 0.5))
    finally:
        proc.kill()
    rates = [e["rate"] for e in proc.of_kind("solo")]
    if len(rates) != len(peers):
        raise RuntimeError(f"the solo measurement gave {len(rates)} rates for {len(peers)} peers")
    return rates


# ------------------------------------------------------------------ the lab


class Lab:
    """The star (``_star_lab.StarLab``) plus, for each client, a namespace behind a NAT
    whose router is the client's star host: the client's traffic crosses its shaped veth,
    and nothing can dial it."""

    def __init__(self, peers: tuple[PeerSpec, ...], nat: bool):
        self.peers, self.nat = peers, nat
        self.star = StarLab(len(peers), [p.rate for p in peers], prefix=PREFIX, subnet=SUBNET)
        self.homes: dict[int, str] = {}

    def __enter__(self) -> Lab:
        try:
            self.star.__enter__()
            if self.nat:
                for i, peer in enumerate(self.peers):
                    if peer.client:
                        self._behind_nat(i)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _behind_nat(self, i: int) -> None:
        router = self.star.hosts[i]
        home = f"{PREFIX}n{i}x{self.star.tag}"
        _run(["ip", "netns", "add", home])
        self.homes[i] = home
        _run(["ip", "-n", home, "link", "set", "lo", "up"])
        set_congestion_control(home, self.star.congestion_control)
        _run(["ip", "-n", router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0",
              "netns", home])  # fmt: skip
        _run(["ip", "-n", router, "addr", "add", f"{LAN_ROUTER}/24", "dev", "lan"])
        _run(["ip", "-n", router, "link", "set", "lan", "up"])
        _run(["ip", "-n", home, "addr", "add", f"{LAN_HOST}/24", "dev", "eth0"])
        _run(["ip", "-n", home, "link", "set", "eth0", "up"])
        _run(["ip", "-n", home, "route", "add", "default", "via", LAN_ROUTER])
        _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        ruleset = (
            "table ip nat {\n  chain post {\n    type nat hook postrouting priority 100;\n"
            '    oifname "eth0" masquerade;\n  }\n}\n'
        )
        _run(["ip", "netns", "exec", router, "nft", "-f", "-"], stdin=ruleset)

    def host(self, index: int | None) -> tuple[list[str], str]:
        """(command prefix, address to listen on) for peer ``index`` (None: the hub)."""
        if index is None:
            return self.star.exec_prefix(None), self.star.hub_addr
        if index in self.homes:
            return ["ip", "netns", "exec", self.homes[index]], LAN_HOST
        return self.star.exec_prefix(index), self.star.addresses[index]

    def sent(self) -> list[int]:
        return [self.star.tx_bytes(i) for i in range(len(self.peers))]

    def close(self) -> None:
        for home in self.homes.values():
            subprocess.run(["ip", "netns", "delete", home], capture_output=True, timeout=10)
        self.homes.clear()
        self.star.close()


def _run(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")


def nat_unavailable_reason() -> str | None:
    import shutil

    if shutil.which("nft") is None:
        return "`nft` (nftables) is not installed"
    return None


def run_swarm(lab: Lab, address: str, mode: str, run_id: str, target: int, args, rep: int) -> dict:
    """One collaborative run of every peer in ``mode``; rates over the measured epochs."""
    peers = lab.peers
    log_dir = Path(args.log_dir) if args.log_dir else None
    procs: list[Proc] = []
    try:
        before = lab.sent()
        for i, peer in enumerate(peers):
            prefix, host = lab.host(i)
            argv = [
                *prefix, sys.executable, str(PEER), "--host", host, "--initial-peers", address,
                "--run-id", run_id, "--seed", str(i), "--step-sleep", str(peer.step_sleep),
                "--hidden", str(args.hidden), "--batch-size", str(BATCH),
                "--target-batch-size", str(target), "--epochs", str(args.epochs + 1),
                "--deadline", str(args.run_timeout),
            ]  # fmt: skip
            if peer.client:
                argv.append("--client-mode")
            if mode == "adaptive" and not peer.client:
                argv += ["--bandwidth", str(peer.mbit)]
            log = log_dir / f"{run_id}_{i}.log" if log_dir else None
            procs.append(Proc(argv, log))
        deadline = time.monotonic() + args.run_timeout + 30
        while not all(p.of_kind("done") for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run_id}: the swarm did not finish in {args.run_timeout} s")
            for i, p in enumerate(procs):
                if p.process.poll() not in (None, 0):
                    raise RuntimeError(f"{run_id}: peer {i} exited with {p.process.returncode}")
            time.sleep(0.1)
        after = lab.sent()
    finally:
        for p in procs:
            p.kill()
    if log_dir:
        events = [p.of_kind("epoch") for p in procs]
        (log_dir / f"{run_id}_events.json").write_text(json.dumps(events))
    rates, epoch_seconds, outcomes, samples = [], [], [], 0
    last = args.epochs + 1
    for i, p in enumerate(procs):
        epochs = {e["epoch"]: e for e in p.of_kind("epoch")}
        # rounds that ended the measured epochs (the warm-up epoch's excluded)
        outcomes += [e["full"] for k, e in epochs.items() if k >= 2 and e["full"] is not None]
        first = min((k for k in epochs if k >= 1), default=None)
        if first is None or last not in epochs or first == last:
            raise RuntimeError(f"{run_id}: peer {i} saw epochs {sorted(epochs)}")
        span = epochs[last]["time"] - epochs[first]["time"]
        rates.append((epochs[last]["samples"] - epochs[first]["samples"]) / span)
        samples += epochs[last]["samples"] - epochs[first]["samples"]
        epoch_seconds.append(span / (last - first))
    sent = [a - b for a, b in zip(after, before, strict=True)]
    return {
        "samples_per_s": sum(rates),
        "epoch_s": statistics.median(epoch_seconds),
        "samples_per_epoch": samples / args.epochs,
        "sent_mb_per_epoch": [round(s / 1e6 / (args.epochs + 1), 2) for s in sent],
        "full_rounds": round(sum(outcomes) / len(outcomes), 3) if outcomes else None,
    }


def run_lab(peers, solo_rates, target, numel, args, nat: bool) -> dict:
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with Lab(peers, nat) as lab:
        prefix, hub = lab.host(None)
        boot = Proc([*prefix, sys.executable, "-c", BOOTSTRAP, hub], None)
        try:
            address = boot.first_line(60)
            for rep in range(args.repeats):
                order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    run_id = f"ddh_{mode}_{rep}_{os.getpid()}"
                    result = run_swarm(lab, address, mode, run_id, target, args, rep)
                    runs[mode].append(result)
                    print(f"  {mode} run {rep + 1}: {json.dumps(result)}", file=sys.stderr)
        finally:
            boot.kill()
    return runs


# ------------------------------------------------------------------ the simulated network


def sim_round(peers: tuple[PeerSpec, ...], spans: tuple[int, ...], numel: int, seed: int) -> float:
    """Virtual seconds of one all-reduce of ``numel`` float32 with these spans on the
    simulated network. The simulator shapes links, not hosts: each host's rate is split
    among its links in proportion to the bytes each one carries in this round (member a
    sends b its part of b's span, and the average of its own span back), so that a
    host's links, alone, would all finish when its whole load would."""
    import asyncio
    import hashlib

    import torch

    from swarmgrad.averaging.allreduce import AllReduceRunner, AveragingMode
    from swarmgrad.averaging.group_info import GroupInfo
    from swarmgrad.net.sim import run_simulation
    from swarmgrad.net.sim.backend import create_sim_peer

    world = len(peers)
    # elements a -> b: a's part of b's span, and the average of a's own span for b
    carried = [[spans[b] + spans[a] if a != b else 0 for b in range(world)] for a in range(world)]
    out_total = [sum(row) for row in carried]
    in_total = [sum(carried[a][b] for a in range(world)) for b in range(world)]
    modes = [AveragingMode.CLIENT if p.client else AveragingMode.NODE for p in peers]
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(world)]

    async def main(network) -> float:
        ips = [f"{SUBNET}.{10 + i}" for i in range(world)]
        nodes = [await create_sim_peer(network, ip=ip) for ip in ips]
        for a in range(world):
            for b in range(world):
                if a != b:
                    nodes[a].add_addresses(nodes[b].peer_id, nodes[b].get_visible_maddrs())
                    share = carried[a][b] or 1
                    bandwidth = min(
                        _bits_per_second(peers[a].rate) * share / max(out_total[a], 1),
                        _bits_per_second(peers[b].rate) * share / max(in_total[b], 1),
                    )
                    network.set_link(
                        f"{ips[a]}:31337", f"{ips[b]}:31337", bandwidth=bandwidth / 8,
                        latency=0.001, symmetric=False,
                    )  # fmt: skip
        ids = tuple(n.peer_id for n in nodes)
        group = GroupInfo(hashlib.sha256(b"dedloc").digest()[:16], ids, tuple(b"" for _ in ids))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(
            *(
                AllReduceRunner(node, group, [t], span_sizes=spans, modes=modes).run()
                for node, t in zip(nodes, tensors, strict=True)
            )
        )
        elapsed = loop.time() - started
        for node in nodes:
            await node.shutdown()
        return elapsed

    return run_simulation(main, seed=seed)


def run_sim(peers, solo_rates, target, numel, args) -> dict:
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    compute = target / sum(solo_rates)
    for rep in range(args.repeats):
        for mode in MODES:
            seconds = sim_round(peers, plan_spans(numel, peers, mode), numel, rep)
            runs[mode].append(
                {
                    "samples_per_s": target / (compute + seconds),
                    "epoch_s": compute + seconds,
                    "samples_per_epoch": target,
                }
            )
    return runs


# ------------------------------------------------------------------ report


def summarize(runs: dict[str, list[dict]], ideal: float, numel, peers) -> dict:
    out = {}
    for mode in MODES:
        rates = [r["samples_per_s"] for r in runs[mode]]
        row = {
            "samples_per_s": round(statistics.median(rates), 1),
            "runs": [round(r, 1) for r in rates],
            "efficiency": round(statistics.median(rates) / ideal, 3),
            "epoch_s": round(statistics.median(r["epoch_s"] for r in runs[mode]), 2),
            # more than the target: peers step on until they see the swarm reach it
            "samples_per_epoch": round(
                statistics.median(r.get("samples_per_epoch", 0) for r in runs[mode])
            ),
            "model_averaging_s": round(
                model_round_seconds(numel, peers, plan_spans(numel, peers, mode)), 2
            ),
            "spans": list(plan_spans(numel, peers, mode)),
        }
        full = [r["full_rounds"] for r in runs[mode] if r.get("full_rounds") is not None]
        row["full_rounds"] = round(min(full), 3) if full else None
        if runs[mode] and "sent_mb_per_epoch" in runs[mode][0]:
            row["sent_mb_per_epoch"] = [
                round(statistics.median(r["sent_mb_per_epoch"][i] for r in runs[mode]), 2)
                for i in range(len(peers))
            ]
        out[mode] = row
    return out


DEFAULT_PLOT = figure_path("dedloc_heterogeneous.png")


def plot(summary: dict, path: Path) -> bool:
    """Left: the sum of the peers' solo rates (stacked by peer) against the swarm's
    samples/s with equal and with bandwidth-balanced spans (each run a dot). Right: each
    peer's share of the averaged vector in both modes. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the bench extra): no plot", file=sys.stderr)
        return False
    peers = summary["peers"]
    names = [
        f"{i}: {p['step_sleep']:g} s/step\n{p['rate']}{', client' if p['client'] else ''}"
        for i, p in enumerate(peers)
    ]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10.5, 4.4), gridspec_kw={"width_ratios": [1, 1.6]}
    )
    bottom = 0.0
    for i, p in enumerate(peers):
        left.bar(0, p["solo"], bottom=bottom, color=f"C{i % 10}", alpha=0.5, edgecolor="white")
        bottom += p["solo"]
    for x, mode in ((1, "equal"), (2, "adaptive")):
        left.bar(x, summary[mode]["samples_per_s"], color="C7" if mode == "equal" else "C2")
        runs = summary[mode]["runs"]
        left.plot([x] * len(runs), runs, "k.", markersize=6)
    left.set_xticks([0, 1, 2])
    left.set_xticklabels(["sum of solo\nrates", "swarm,\nequal spans", "swarm,\nbalanced spans"])
    left.set_ylabel("samples/s")
    left.set_title(
        f"{summary['network']} network; adaptive / equal {summary['adaptive_over_equal']:.2f} x",
        fontsize=9,
    )
    left.grid(axis="y", alpha=0.3)
    total = {mode: sum(summary[mode]["spans"]) or 1 for mode in ("equal", "adaptive")}
    width = 0.38
    for offset, mode, color in ((-width / 2, "equal", "C7"), (width / 2, "adaptive", "C2")):
        shares = [span / total[mode] for span in summary[mode]["spans"]]
        xs = [i + offset for i in range(len(peers))]
        right.bar(xs, shares, width, color=color, label=f"{mode} spans")
    right.set_xticks(range(len(peers)))
    right.set_xticklabels(names, fontsize=7)
    right.set_ylabel("share of the averaged vector")
    right.set_title("who reduces what (clients reduce nothing)", fontsize=9)
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default=env("DEDLOC_PEERS"), help="sleep:rate[:client],...")
    parser.add_argument("--hidden", type=int, default=int(env("DEDLOC_HIDDEN", "8192")))
    parser.add_argument("--epochs", type=int, default=int(env("DEDLOC_EPOCHS", "4")))
    parser.add_argument("--repeats", type=int, default=int(env("DEDLOC_REPEATS", "3")))
    parser.add_argument(
        "--epoch-compute", type=float, default=float(env("DEDLOC_EPOCH_COMPUTE", "4.0"))
    )
    parser.add_argument("--solo-steps", type=int, default=int(env("DEDLOC_SOLO_STEPS", "12")))
    parser.add_argument(
        "--network", choices=("lab", "sim"), default=env("DEDLOC_NETWORK", "lab"),
        help="sim: the simulated network even where the lab could be built",
    )  # fmt: skip
    parser.add_argument("--run-timeout", type=float, default=240.0)
    parser.add_argument("--log-dir", default=env("DEDLOC_LOG_DIR"))
    parser.add_argument("--plot", default=env("DEDLOC_PLOT", str(DEFAULT_PLOT)))
    parser.add_argument("--plot-from", help="a file ending with an earlier run's JSON line")
    args = parser.parse_args()
    if args.plot_from:
        saved = json.loads(Path(args.plot_from).read_text().strip().splitlines()[-1])
        if args.plot and plot(saved, Path(args.plot)):
            print(f"plot: {args.plot}")
        return
    # SIGTERM (a timeout, a CI runner) ends through the finally blocks: peers killed and
    # the namespaces deleted, instead of left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    peers = parse_peers(args.peers) if args.peers else DEFAULT_PEERS
    numel = 2 * 64 * args.hidden + args.hidden + 64  # make_model's parameters

    reason = "DEDLOC_NETWORK=sim / --network sim" if args.network == "sim" else None
    reason = reason or lab_unavailable_reason()
    network = "lab" if reason is None else "sim"
    nat_reason = nat_unavailable_reason() if network == "lab" else None
    if reason:
        print(f"network lab unavailable ({reason}): the simulated network", file=sys.stderr)
    elif nat_reason and any(p.client for p in peers):
        print(f"no NAT ({nat_reason}): clients in plain client mode", file=sys.stderr)

    began = time.monotonic()
    solo_rates = measure_solo(peers, args.hidden, args.solo_steps)
    ideal = sum(solo_rates)
    target = max(BATCH, round(args.epoch_compute * ideal / BATCH) * BATCH)
    print(
        f"{len(peers)} peers, {numel:,} parameters, solo sum {ideal:.1f} samples/s, "
        f"target batch {target}, network {network}",
        file=sys.stderr,
    )
    if network == "lab":
        runs = run_lab(peers, solo_rates, target, numel, args, nat=nat_reason is None)
    else:
        runs = run_sim(peers, solo_rates, target, numel, args)
    modes = summarize(runs, ideal, numel, peers)
    ratio = modes["adaptive"]["samples_per_s"] / modes["equal"]["samples_per_s"]

    header = f"{'peer':>4} {'step s':>7} {'link':>8} {'client':>6} {'solo/s':>7}"
    print(header + "".join(f" {m + ' span':>14}" for m in MODES))
    for i, (p, rate) in enumerate(zip(peers, solo_rates, strict=True)):
        spans = "".join(f" {modes[m]['spans'][i]:>14,}" for m in MODES)
        print(
            f"{i:>4} {p.step_sleep:>7.2f} {p.rate:>8} {'yes' if p.client else '':>6} "
            f"{rate:>7.1f}{spans}"
        )
    print(f"\nsum of solo rates: {ideal:.1f} samples/s (the swarm with no averaging)")
    print(f"target batch {target}; epoch s and samples per epoch: medians over runs")
    print(f"{'mode':>9} {'samples/s':>10} {'runs':>24} {'/ solo sum':>10} {'epoch s':>8} "
          f"{'samples/epoch':>13} {'model avg s':>11} {'full rounds':>11}")  # fmt: skip
    for mode in MODES:
        m = modes[mode]
        runs_text = ", ".join(f"{r:.1f}" for r in m["runs"])
        print(
            f"{mode:>9} {m['samples_per_s']:>10.1f} {runs_text:>24} {m['efficiency']:>10.3f} "
            f"{m['epoch_s']:>8.2f} {m['samples_per_epoch']:>13} {m['model_averaging_s']:>11.2f} "
            f"{m['full_rounds'] if m['full_rounds'] is not None else '-':>11}"
        )
    print(f"adaptive / equal: {ratio:.2f} x (medians over {args.repeats} runs each)")
    summary = {
        "network": network,
        "network_reason": reason,
        "nat": network == "lab" and nat_reason is None,
        "nat_reason": nat_reason,
        "peers": [
            {"step_sleep": p.step_sleep, "rate": p.rate, "client": p.client, "solo": round(r, 1)}
            for p, r in zip(peers, solo_rates, strict=True)
        ],
        "parameters": numel,
        "target_batch_size": target,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "solo_sum": round(ideal, 1),
        **modes,
        "adaptive_over_equal": round(ratio, 3),
        "adaptive_efficiency": modes["adaptive"]["efficiency"],
        "equal_efficiency": modes["equal"]["efficiency"],
        "wall_s": round(time.monotonic() - began, 1),
    }
    if args.plot and plot(summary, Path(args.plot)):
        print(f"plot: {args.plot}", file=sys.stderr)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
