"""All-reduce on shaped links: our butterfly all-reduce against gloo and the bandwidth bound.

    python benchmarks/allreduce_links.py        # everything, about 11 minutes here

N peers (4 and 8), each a process in its own network namespace behind a veth pair to a hub
namespace (``_star_lab.StarLab``), every link shaped with ``tc tbf`` in both directions,
at 1 Gbit/s and at 100 Mbit/s per peer; 16M float32 (64 MB) per peer. Per setting and
repetition, in the same processes over the same links:

* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend (plaintext, ring);
* ``none``, ``float16``, ``uniform_8bit``: ours (TLS 1.3 handshake, AES-256-GCM records),
  uncompressed, with ``Float16Compression`` and with ``Uniform8BitQuantization``;
* the bound: ``2 (N-1)/N x bytes / link rate``, the time any all-reduce needs to move
  its bytes through each peer's link (uncompressed).

Mixed rates: 6 peers, 2 at 1 Gbit/s, 2 at 100 Mbit/s, 2 at 20 Mbit/s, ours uncompressed
with equal spans against spans balanced to the link rates
(``swarmgrad.averaging.allreduce.load_balancing``); the model's time for each plan is printed too.

Each round starts from a gloo barrier; its time is the slowest member's; figures are
medians over the repetitions. Every round of ours is checked against gloo's average.
Where the lab cannot be built (not root, no ``ip netns``), the script says so and runs the
same rounds on the simulated network (``swarmgrad.net.sim``, virtual clock: compute
costs no time there; it has no shared uplink, so each host's rate is split over its links
in proportion to the bytes the round's plan sends on them, ``rate / (N-1)`` with equal
spans), without gloo.

Environment (all optional): ``ARL_PEERS`` (``4,8``), ``ARL_RATES`` (``1gbit,100mbit``),
``ARL_CODECS`` (``none,float16,uniform_8bit``), ``ARL_MIXED`` (``1``; ``0`` skips the
mixed rates, ``only`` runs nothing else), ``ARL_REPS`` (4; 1 on the simulated
network, whose virtual time does not vary), ``ARL_MIXED_REPS`` (3; 1 simulated),
``ARL_NUMEL`` (16000000), ``ARL_PART_BYTES`` (the all-reduce's default part size),
``ARL_SIM`` (``1`` forces the simulated network), ``ARL_GLOO`` (``0``: gloo only in
the first repetition, for profiling ours), ``ARL_MIXED_MIN_TIMEOUT`` (30: the
shortest wait for a stalled peer in the mixed-rate rounds; with the library's 5 s, a
20 Mbit/s member whose whole connection went silent for 5 s was excluded from an
equal-span round), ``ARL_LOG_DIR`` (the workers' stderr), ``LAB_CC`` (the namespaces'
TCP congestion control, ``cubic``; see ``_star_lab.py``), ``ARL_PLOT`` (where the PNG
goes, ``benchmarks/results/allreduce_links.png``, or ``docs/`` with
``SWARMGRAD_UPDATE_DOCS=1``; empty: no plot; needs matplotlib, the bench extra),
``ARL_PLOT_FROM`` (a file holding the JSON line of an earlier run: draw its plot, run
nothing). Prints a table, the ratio per target, and last one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _results import figure_path  # noqa: E402
from _star_lab import (  # noqa: E402
    StarLab,
    _bits_per_second,
    default_congestion_control,
    lab_unavailable_reason,
)

CODECS = ("none", "float16", "uniform_8bit")
MIXED_RATES = ("1gbit", "1gbit", "100mbit", "100mbit", "20mbit", "20mbit")
SUBNET = "10.79.2"  # this benchmark's /24 inside its namespaces
GLOO_PORT = 29517
START_TIMEOUT = 120.0


def _env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def bound_seconds(world: int, nbytes: int, rate: str) -> float:
    return 2 * (world - 1) / world * nbytes * 8 / _bits_per_second(rate)


def plan_seconds(spans: list[int], rates: list[str], itemsize: int = 4) -> float:
    """The load-balancing model's round time: the slowest link's bytes over its rate
    (in each direction a member moves its own vector minus its span, plus its span's
    average back to the n-1 others; see swarmgrad/averaging/allreduce/load_balancing.py)."""
    total, n = sum(spans), len(spans)
    worst = 0.0
    for span, rate in zip(spans, rates, strict=True):
        load = (total - span) + span * (n - 1)
        worst = max(worst, load * itemsize * 8 / _bits_per_second(rate))
    return worst


def balanced_fractions(rates: list[str]) -> list[float]:
    return [_bits_per_second(r) / 1e6 for r in rates]


# ------------------------------------------------------------------------- the lab


class LabGroup:
    """``world`` worker processes on hosts 0..world-1 of a StarLab, driven over pipes."""

    def __init__(self, lab: StarLab, world: int, numel: int, part_bytes: int, log_dir: Path | None):
        self.lab = lab
        self.world = world
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        for rank in range(world):
            config = {
                "rank": rank,
                "world": world,
                "host": lab.addresses[rank],
                "master": lab.addresses[0],
                "port": GLOO_PORT,
                "numel": numel,
                "part_size_bytes": part_bytes,
            }
            stderr = open(log_dir / f"peer{world}_{rank}.log", "w") if log_dir else None
            self.procs.append(
                subprocess.Popen(
                    [
                        *lab.exec_prefix(rank),
                        sys.executable,
                        str(HERE / "_allreduce_peer.py"),
                        "links",
                        json.dumps(config),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr if stderr else subprocess.DEVNULL,
                    text=True,
                    env=env,
                    start_new_session=True,
                )
            )
        maddrs = self._gather(START_TIMEOUT)
        self._send_all(maddrs)

    def _send_all(self, obj) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(obj) + "\n")
            proc.stdin.flush()

    def _gather(self, timeout: float) -> list:
        results: list = [None] * self.world

        def read(rank: int) -> None:
            stdout = self.procs[rank].stdout
            assert stdout is not None
            for line in stdout:
                if line.startswith("@"):
                    results[rank] = json.loads(line[1:])
                    return

        threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(self.world)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        missing = [r for r, value in enumerate(results) if value is None]
        if missing:
            raise RuntimeError(f"peers {missing} of {self.world} did not answer in {timeout} s")
        errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
        if errors:
            raise RuntimeError(f"a peer failed: {errors[0]}")
        return results

    def round(self, order: dict, timeout: float) -> dict:
        before = [self.lab.tx_bytes(host) for host in range(self.world)]
        self._send_all(order)
        reports = self._gather(timeout)
        sent = [self.lab.tx_bytes(host) - b for host, b in enumerate(before)]
        return {
            "sent_mb": statistics.mean(sent) / 1e6,
            "elapsed": max(r["elapsed"] for r in reports),
            "cpu": sum(r["cpu"] for r in reports),
            "max_error": max(r.get("max_error", 0.0) for r in reports),
            "fully_averaged": all(r.get("fully_averaged", True) for r in reports),
            "exclusions": sum(r.get("excluded", 0) for r in reports),
        }

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def run_lab(plan: dict, log_dir: Path | None) -> dict:
    worlds = sorted(set(plan["peers"]) | ({len(MIXED_RATES)} if plan["mixed"] else set()))
    results: dict = {"settings": [], "mixed": None}
    with StarLab(max(worlds), None, prefix="arl", subnet=SUBNET) as lab:
        for world in plan["peers"]:
            group = LabGroup(lab, world, plan["numel"], plan["part_bytes"], log_dir)
            try:
                for rate in plan["rates"]:
                    for host in range(world):
                        lab.set_rate(host, rate)
                    times = _repeat(group, world, rate, plan)
                    results["settings"].append({"peers": world, "rate": rate, **times})
                    _print_setting(results["settings"][-1], plan)
            finally:
                group.close()
        if plan["mixed"]:
            world = len(MIXED_RATES)
            for host, rate in enumerate(MIXED_RATES):
                lab.set_rate(host, rate)
            group = LabGroup(lab, world, plan["numel"], plan["part_bytes"], log_dir)
            try:
                results["mixed"] = _mixed(group, plan)
            finally:
                group.close()
    return results


def _repeat(group: LabGroup, world: int, rate: str, plan: dict) -> dict:
    kinds = ["gloo", *plan["codecs"]]
    rounds: dict[str, list[dict]] = {kind: [] for kind in kinds}
    nbytes = plan["numel"] * 4
    # a generous per-round limit: 4 x what gloo-like speed would take, at least 60 s
    limit = max(60.0, 4 * bound_seconds(world, nbytes, rate) + 30)
    for rep in range(plan["reps"]):
        if rep == 0:
            order = kinds  # gloo first: every later round is checked against its average
        else:
            order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
            if not plan["gloo"]:  # profiling ours: gloo only in the first repetition
                order = [kind for kind in order if kind != "gloo"]
        for kind in order:
            if kind == "gloo":
                message = {"op": "gloo"}
            else:
                message = {"op": "ours", "codec": kind, "tag": f"{world}-{rate}-{kind}-{rep}"}
            rounds[kind].append(group.round(message, limit))
    return _summarize(rounds, world, nbytes, rate)


def _summarize(rounds: dict[str, list[dict]], world: int, nbytes: int, rate: str) -> dict:
    out: dict = {"bound_s": round(bound_seconds(world, nbytes, rate), 3)}
    for kind, values in rounds.items():
        out[kind] = {
            "median_s": round(statistics.median(v["elapsed"] for v in values), 3),
            "rounds_s": [round(v["elapsed"], 3) for v in values],
            "cpu_s": round(statistics.median(v["cpu"] for v in values), 2),
            "sent_mb_per_peer": round(statistics.median(v.get("sent_mb", 0.0) for v in values), 1),
            "max_error": max(v["max_error"] for v in values),
            "fully_averaged": all(v["fully_averaged"] for v in values),
            "exclusions": sum(v.get("exclusions", 0) for v in values),
        }
    return out


def _mixed(group: LabGroup, plan: dict) -> dict:
    from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers

    rates = list(MIXED_RATES)
    fractions = balanced_fractions(rates)
    rounds: dict[str, list[dict]] = {"gloo": [], "equal": [], "balanced": []}
    limit = 600.0
    # one gloo round for the reference average (not timed against: its ring waits for the
    # slowest link, as equal spans do)
    rounds["gloo"].append(group.round({"op": "gloo"}, limit))
    for rep in range(plan["mixed_reps"]):
        order = ("equal", "balanced") if rep % 2 == 0 else ("balanced", "equal")
        for kind in order:
            message = {
                "op": "ours",
                "codec": "none",
                "tag": f"mixed-{kind}-{rep}",
                "min_timeout": plan["mixed_min_timeout"],
                "fractions": fractions if kind == "balanced" else None,
            }
            rounds[kind].append(group.round(message, limit))
    total = plan["numel"]
    spans = {
        "equal": list(load_balance_peers(total, [None] * len(rates))),
        "balanced": list(load_balance_peers(total, fractions)),
    }
    out = _summarize(rounds, len(rates), total * 4, "20mbit")
    out.pop("bound_s")
    out["rates"] = rates
    for kind in ("equal", "balanced"):
        out[kind]["spans"] = spans[kind]
        out[kind]["model_s"] = round(plan_seconds(spans[kind], rates), 3)
    out["speedup"] = round(out["equal"]["median_s"] / out["balanced"]["median_s"], 3)
    print(
        f"mixed rates {'/'.join(rates)}: equal spans {out['equal']['median_s']:.2f} s "
        f"(model {out['equal']['model_s']:.2f}), balanced {out['balanced']['median_s']:.2f} s "
        f"(model {out['balanced']['model_s']:.2f}), speedup {out['speedup']:.2f} x",
        flush=True,
    )
    return out


# ------------------------------------------------------------ the simulated network


def run_sim(plan: dict) -> dict:
    results: dict = {"settings": [], "mixed": None}
    for world in plan["peers"]:
        for rate in plan["rates"]:
            rounds: dict[str, list[dict]] = {kind: [] for kind in plan["codecs"]}
            for rep in range(plan["reps"]):
                for kind in plan["codecs"]:
                    rounds[kind].append(
                        _sim_round(
                            [rate] * world, kind, None, plan["numel"], rep, plan["part_bytes"]
                        )
                    )
            summary = _summarize(rounds, world, plan["numel"] * 4, rate)
            results["settings"].append({"peers": world, "rate": rate, **summary})
            _print_setting(results["settings"][-1], plan)
    if plan["mixed"]:
        from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers

        rates = list(MIXED_RATES)
        rounds = {"equal": [], "balanced": []}
        # Each simulated link holds a fixed share of its hosts' rates (there is no shared
        # uplink), and a 20 Mbit/s peer's share towards a 100 Mbit/s peer's small span is
        # under 1 Mbit/s: 2 MiB parts would cross it one at a time (17 s each, stored and
        # forwarded) where TCP would give that flow a fair share. Finer parts restore the
        # pipeline (balanced: 44.2 s with 2 MiB parts, 26.9 s with 128 KiB; model 25.6 s).
        part_bytes = min(plan["part_bytes"], 128 * 1024)
        for rep in range(plan["mixed_reps"]):
            fractions = balanced_fractions(rates)
            for kind, plan_fractions in (("equal", None), ("balanced", fractions)):
                rounds[kind].append(
                    _sim_round(rates, "none", plan_fractions, plan["numel"], rep, part_bytes)
                )
        out = _summarize(rounds, len(rates), plan["numel"] * 4, "20mbit")
        out.pop("bound_s")
        out["rates"] = rates
        for kind, fractions in (("equal", None), ("balanced", balanced_fractions(rates))):
            spans = list(load_balance_peers(plan["numel"], fractions or [None] * len(rates)))
            out[kind]["spans"] = spans
            out[kind]["model_s"] = round(plan_seconds(spans, rates), 3)
        out["speedup"] = round(out["equal"]["median_s"] / out["balanced"]["median_s"], 3)
        print(
            f"mixed rates (simulated): equal {out['equal']['median_s']:.2f} s, balanced "
            f"{out['balanced']['median_s']:.2f} s, speedup {out['speedup']:.2f} x",
            flush=True,
        )
        results["mixed"] = out
    return results


def _sim_link_rate(a: int, b: int, rates: list[str], spans) -> float:
    """Bytes per second of the simulated link ``a -> b``. The simulated network has no
    shared uplink, so each host's rate is split over its links in proportion to the bytes
    the round sends on them (``a``'s parts of ``b``'s span, and ``a``'s averages back to
    ``b``), on both ends; with equal spans that is ``rate / (N-1)`` per link."""

    def share(host: int, other: int) -> float:
        total = sum(spans[host] + spans[c] for c in range(len(spans)) if c != host)
        return (spans[host] + spans[other]) / total if total else 0.0

    rate = min(_bits_per_second(rates[a]) * share(a, b), _bits_per_second(rates[b]) * share(b, a))
    floor = min(_bits_per_second(r) for r in rates) / 100  # links the plan leaves unused
    return max(rate, floor) / 8


def _sim_round(
    rates: list[str],
    codec: str,
    fractions: list[float] | None,
    numel: int,
    seed: int,
    part_size_bytes: int,
) -> dict:
    """One round on the simulated network; elapsed is virtual time."""
    import asyncio
    import hashlib

    import torch

    from swarmgrad.averaging.allreduce import AllReduceRunner
    from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers
    from swarmgrad.averaging.group_info import GroupInfo
    from swarmgrad.compression import Float16Compression, NoCompression, Uniform8BitQuantization
    from swarmgrad.net.sim import run_simulation
    from swarmgrad.net.sim.backend import create_sim_peer

    codecs = {
        "none": NoCompression,
        "float16": Float16Compression,
        "uniform_8bit": Uniform8BitQuantization,
    }
    world = len(rates)
    spans = load_balance_peers(numel, fractions or [None] * world)
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = sum(tensors) / world

    async def main(network) -> tuple[float, list]:
        ips = [f"{SUBNET}.{10 + i}" for i in range(world)]
        peers = [await create_sim_peer(network, ip=ip) for ip in ips]
        for a in range(world):
            for b in range(world):
                if a != b:
                    peers[a].add_addresses(peers[b].peer_id, peers[b].get_visible_maddrs())
                    network.set_link(
                        f"{ips[a]}:31337",
                        f"{ips[b]}:31337",
                        bandwidth=_sim_link_rate(a, b, rates, spans),
                        latency=0.0005,
                        symmetric=False,
                    )
        ids = tuple(p.peer_id for p in peers)
        group = GroupInfo(hashlib.sha256(b"sim").digest()[:16], ids, tuple(b"" for _ in ids))
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcomes = await asyncio.gather(
            *(
                AllReduceRunner(
                    peer,
                    group,
                    [t],
                    peer_fractions=fractions,
                    compression=codecs[codec](),
                    part_size_bytes=part_size_bytes,
                ).run()
                for peer, t in zip(peers, tensors, strict=True)
            )
        )
        elapsed = loop.time() - started
        for peer in peers:
            await peer.shutdown()
        return elapsed, outcomes

    wall = time.perf_counter()
    # small chunks: a link carries several streams at once, and a tiny share of a slow
    # link would otherwise pass one 64 KB chunk at a time (store and forward)
    elapsed, outcomes = run_simulation(main, seed=seed, chunk_size=16384)
    return {
        "elapsed": elapsed,
        "cpu": time.perf_counter() - wall,
        "max_error": max(float((t - expected).abs().max()) for t in tensors),
        "fully_averaged": all(o.fully_averaged for o in outcomes),
    }


# ------------------------------------------------------------------------- report


def _print_setting(s: dict, plan: dict) -> None:
    gloo = s.get("gloo", {}).get("median_s")
    cells = [f"{s['peers']:>2} peers {s['rate']:>7}: bound {s['bound_s']:6.2f} s"]
    if gloo is not None:
        cells.append(f"gloo {gloo:6.2f}")
    for kind in plan["codecs"]:
        cells.append(f"{kind} {s[kind]['median_s']:6.2f}")
    print(" | ".join(cells), flush=True)


def flat_results(settings: list[dict]) -> list[dict]:
    """One row per setting and codec: ``peers``, ``rate``, ``compression``, ``ours_s``,
    ``gloo_s`` (None where gloo did not run: the simulated network), ``bound_s``. The
    shape ``../shared/tools/check_targets.py`` reads."""
    rows = []
    for s in settings:
        gloo = s.get("gloo", {}).get("median_s")
        for kind in CODECS:
            if kind in s:
                rows.append({"peers": s["peers"], "rate": s["rate"], "compression": kind,
                             "ours_s": s[kind]["median_s"], "gloo_s": gloo,
                             "bound_s": s["bound_s"]})  # fmt: skip
    return rows


def targets(results: dict, plan: dict) -> list[dict]:
    """Each target of the issue with its measured ratio (None where not measured)."""
    rows = []
    for s in results["settings"]:
        where = f"{s['peers']} peers, {s['rate']}"
        gloo = s.get("gloo", {}).get("median_s")
        if "none" in s:
            if gloo:
                rows.append(_target(f"{where}: none / gloo", s["none"]["median_s"] / gloo, 1.1))
            rows.append(
                _target(f"{where}: none / bound", s["none"]["median_s"] / s["bound_s"], 1.25)
            )
        if gloo and s["rate"] == "100mbit":
            for kind, need in (("float16", 1.8), ("uniform_8bit", 3.5)):
                if kind in s:
                    rows.append(
                        _target(
                            f"{where}: gloo / {kind}", gloo / s[kind]["median_s"], need, least=True
                        )
                    )
    if results.get("mixed"):
        rows.append(
            _target("mixed rates: equal / balanced", results["mixed"]["speedup"], 1.5, least=True)
        )
    return rows


DEFAULT_PLOT = figure_path("allreduce_links.png")
_PLOT_KINDS = (
    ("gloo", "gloo (ring)"),
    ("none", "ours"),
    ("float16", "ours, float16"),
    ("uniform_8bit", "ours, 8-bit"),
)


def plot(summary: dict, path: Path) -> bool:
    """Round times over the bound per setting (bars; 1 = the link's limit for 32-bit
    values), and the mixed-rate rounds in seconds; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the bench extra): no plot", file=sys.stderr)
        return False
    settings, mixed = summary["settings"], summary.get("mixed")
    fig, axes = plt.subplots(
        1, 2 if mixed else 1, figsize=(10, 4.2) if mixed else (6.4, 4.2), squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if mixed else None,
    )  # fmt: skip
    ax = axes[0][0]
    kinds = [(k, label) for k, label in _PLOT_KINDS if any(k in s for s in settings)]
    width = 0.8 / max(1, len(kinds))
    for i, (kind, label) in enumerate(kinds):
        xs = [n + (i - (len(kinds) - 1) / 2) * width for n in range(len(settings))]
        ys = [s[kind]["median_s"] / s["bound_s"] if kind in s else 0.0 for s in settings]
        ax.bar(xs, ys, width, label=label)
    for level, style in ((1.0, "--"), (0.5, ":"), (0.25, ":")):  # 32, 16 and 8 bits
        ax.axhline(level, color="black", linewidth=0.8, linestyle=style)
    ax.set_ylim(0, 1.55)
    ax.set_xticks(range(len(settings)))
    ax.set_xticklabels([f"{s['peers']} peers\n{s['rate']}" for s in settings])
    ax.set_ylabel("round time / bound for 32-bit values\n(dotted: for 16 and 8 bits)")
    ax.set_title(f"16M float32 per peer, {summary['network']} network; medians", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    if mixed:
        ax = axes[0][1]
        names = [k for k in ("gloo", "equal", "balanced") if k in mixed]
        ax.bar(names, [mixed[k]["median_s"] for k in names], color=["C0", "C1", "C2"])
        ax.set_ylabel("round time, s")
        counts: dict[str, int] = {}
        for rate in mixed["rates"]:
            counts[rate] = counts.get(rate, 0) + 1
        ax.set_title("mixed: " + ", ".join(f"{n} x {r}" for r, n in counts.items()), fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_if_asked(summary: dict) -> None:
    target = os.environ.get("ARL_PLOT", str(DEFAULT_PLOT))
    if target and plot(summary, Path(target)):
        print(f"plot: {target}", flush=True)


def _target(name: str, value: float, limit: float, least: bool = False) -> dict:
    met = value >= limit if least else value <= limit
    return {"target": name, "value": round(value, 3), "limit": limit, "at_least": least, "met": met}


def main() -> None:
    from swarmgrad.averaging.allreduce.partition import DEFAULT_PART_SIZE_BYTES

    # SIGTERM (a timeout, CI) ends through the finally blocks: peers stopped, namespaces gone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.environ.get("ARL_PLOT_FROM"):
        lines = Path(os.environ["ARL_PLOT_FROM"]).read_text().strip().splitlines()
        _plot_if_asked(json.loads(lines[-1]))
        return
    mixed_env = os.environ.get("ARL_MIXED", "1")
    plan = {
        "peers": [int(p) for p in _env_list("ARL_PEERS", "4,8")] if mixed_env != "only" else [],
        "rates": _env_list("ARL_RATES", "1gbit,100mbit"),
        "codecs": [c for c in _env_list("ARL_CODECS", ",".join(CODECS)) if c in CODECS],
        "mixed": mixed_env != "0",
        "reps": int(os.environ.get("ARL_REPS", "4")),
        "mixed_reps": int(os.environ.get("ARL_MIXED_REPS", "3")),
        "numel": int(os.environ.get("ARL_NUMEL", "16000000")),
        "gloo": os.environ.get("ARL_GLOO", "1") != "0",
        "mixed_min_timeout": float(os.environ.get("ARL_MIXED_MIN_TIMEOUT", "30")),
        "part_bytes": int(os.environ.get("ARL_PART_BYTES", str(DEFAULT_PART_SIZE_BYTES))),
    }
    log_dir = Path(os.environ["ARL_LOG_DIR"]) if os.environ.get("ARL_LOG_DIR") else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    reason = "ARL_SIM=1" if os.environ.get("ARL_SIM") == "1" else lab_unavailable_reason()
    if reason is not None:
        # virtual time does not vary with the box's load: one round per setting is enough
        plan["reps"] = int(os.environ.get("ARL_REPS", "1"))
        plan["mixed_reps"] = int(os.environ.get("ARL_MIXED_REPS", "1"))
    started = time.time()
    print(
        f"all-reduce of {plan['numel']:,} float32 ({plan['numel'] * 4 / 1e6:.0f} MB) per peer; "
        f"medians of {plan['reps']} rounds (mixed rates: {plan['mixed_reps']}); "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    if reason is None:
        print(
            "network lab: one namespace per peer, veth to a hub, tc tbf both ways, TCP "
            f"congestion control {default_congestion_control()} (LAB_CC)",
            flush=True,
        )
        results = run_lab(plan, log_dir)
    else:
        print(
            f"network lab unavailable ({reason}): running on the simulated network "
            f"(virtual time, no gloo)",
            flush=True,
        )
        results = run_sim(plan)
    rows = targets(results, plan)
    print("\ntargets:")
    for row in rows:
        sign = ">=" if row["at_least"] else "<="
        verdict = "met" if row["met"] else "MISSED"
        print(f"  {row['target']:<40} {row['value']:7.3f}  ({sign} {row['limit']})  {verdict}")
    print(f"total wall time {time.time() - started:.0f} s", flush=True)
    summary = {
        "network": "lab" if reason is None else "sim",
        "fallback_reason": reason,
        "congestion_control": default_congestion_control() if reason is None else None,
        "numel": plan["numel"],
        "reps": plan["reps"],
        "mixed_reps": plan["mixed_reps"],
        "settings": results["settings"],
        "mixed": results["mixed"],
        "targets": rows,
        "results": flat_results(results["settings"]),
    }
    _plot_if_asked(summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
