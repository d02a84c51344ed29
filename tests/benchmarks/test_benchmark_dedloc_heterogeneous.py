"""``benchmarks/dedloc_heterogeneous.py``: its spans and models, the fallback to the
simulated network (forced, and where namespaces cannot be created), and a tiny run in
the network lab (namespaces ``ddh*``, 10.86.0.0/24 and behind NAT 10.86.1.0/24, used by
no other test), which skips with the reason where the lab cannot be built."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _star_lab  # noqa: E402
import dedloc_heterogeneous as bench  # noqa: E402

from tests.helpers.benchmarks import run_script  # noqa: E402

# one fast reducer, one slow reducer, one client behind NAT: the slow reducer's share is
# what the two modes disagree on
TINY = {
    "DEDLOC_PEERS": "0.02:100mbit,0.03:10mbit,0.03:50mbit:client",
    "DEDLOC_HIDDEN": "2048",
    "DEDLOC_EPOCHS": "2",
    "DEDLOC_REPEATS": "1",
    "DEDLOC_SOLO_STEPS": "3",
    "DEDLOC_EPOCH_COMPUTE": "0.5",
}
KEYS = {
    "network", "network_reason", "nat", "peers", "parameters", "target_batch_size", "epochs",
    "repeats", "solo_sum", "equal", "adaptive", "adaptive_over_equal", "adaptive_efficiency",
    "equal_efficiency", "wall_s", "nat_reason",
}  # fmt: skip
MODE_KEYS = {"samples_per_s", "runs", "efficiency", "epoch_s", "model_averaging_s", "spans"}


def run_benchmark(env_extra: dict[str, str], timeout: float, path_prefix: Path | None = None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DEDLOC_PLOT="", **TINY, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    done = run_script("dedloc_heterogeneous.py", env, timeout)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return summary, done


def check_sane(summary: dict) -> None:
    assert KEYS <= set(summary)
    peers = bench.parse_peers(TINY["DEDLOC_PEERS"])
    assert [p["client"] for p in summary["peers"]] == [p.client for p in peers]
    solo = [p["solo"] for p in summary["peers"]]
    # each peer alone: 16 samples per step of its sleep plus a little compute
    for spec, rate in zip(peers, solo, strict=True):
        assert 0.3 * 16 / spec.step_sleep < rate <= 16 / spec.step_sleep
    assert summary["solo_sum"] == pytest.approx(sum(solo), rel=0.01)
    for mode in bench.MODES:
        row = summary[mode]
        assert MODE_KEYS <= set(row)
        assert sum(row["spans"]) == summary["parameters"]
        assert row["spans"][2] == 0  # the client reduces nothing
        # the swarm is slower than its peers with no averaging, yet not stalled
        assert 0.02 < row["efficiency"] <= 1.05
        assert row["samples_per_s"] == pytest.approx(
            row["efficiency"] * summary["solo_sum"], rel=0.02
        )
    assert summary["equal"]["spans"][0] == summary["equal"]["spans"][1]
    assert summary["adaptive"]["spans"][0] > summary["adaptive"]["spans"][1]
    assert summary["adaptive"]["model_averaging_s"] < summary["equal"]["model_averaging_s"]


# ------------------------------------------------------------------ the model


def test_peer_specs_parse_and_bad_ones_are_refused():
    assert bench.parse_peers("0.1:100mbit, 0.4:10mbit:client") == (
        bench.PeerSpec(0.1, "100mbit"),
        bench.PeerSpec(0.4, "10mbit", client=True),
    )
    for bad in ("0.1", "0.1:fast", "0.1:10mbit:nat", "0.1:10mbit:client"):
        with pytest.raises(ValueError):
            bench.parse_peers(bad)


def test_spans_clients_reduce_nothing_and_adaptive_spares_the_slow_links():
    peers, numel = bench.DEFAULT_PEERS, 1_000_000
    equal = bench.plan_spans(numel, peers, "equal")
    adaptive = bench.plan_spans(numel, peers, "adaptive")
    for spans in (equal, adaptive):
        assert sum(spans) == numel
        assert all(s == 0 for s, p in zip(spans, peers, strict=True) if p.client)
    reducers = [s for s, p in zip(equal, peers, strict=True) if not p.client]
    assert max(reducers) - min(reducers) <= 1
    assert adaptive[0] > adaptive[2] > adaptive[3]  # 100, 20, 10 Mbit/s
    # the slowest client's own vector bounds any plan: adaptive reaches that bound,
    # equal shares take twice as long on the 10 Mbit/s reducer
    bound = numel * 4 * 8 / 10e6
    assert bench.model_round_seconds(numel, peers, adaptive) == pytest.approx(bound, rel=0.01)
    assert bench.model_round_seconds(numel, peers, equal) == pytest.approx(2 * bound, rel=0.01)


def test_nat_unavailable_reason_names_nft(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "nft" in bench.nat_unavailable_reason()


# ------------------------------------------------------------------ the fallback


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_forced_simulated_network_runs_the_tiny_config_and_says_so():
    summary, done = run_benchmark({"DEDLOC_NETWORK": "sim"}, timeout=80)
    assert "network lab unavailable (DEDLOC_NETWORK=sim" in done.stderr
    assert summary["network"] == "sim" and "DEDLOC_NETWORK=sim" in summary["network_reason"]
    assert summary["nat"] is False
    check_sane(summary)
    # on the simulated network the slow reducer's share decides the round
    assert summary["adaptive_over_equal"] > 1.05


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_without_namespaces_the_benchmark_falls_back_and_names_the_reason(tmp_path):
    """An ``ip`` that cannot create namespaces, as in a container without the right."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake_ip = fake_bin / "ip"
    fake_ip.write_text("#!/bin/sh\necho 'mount --make-shared /run/netns failed: denied' >&2\n"
                       "exit 1\n")  # fmt: skip
    fake_ip.chmod(0o755)
    summary, done = run_benchmark({"DEDLOC_NETWORK": "lab"}, timeout=80, path_prefix=fake_bin)
    assert "cannot create a network namespace" in done.stderr
    assert summary["network"] == "sim"
    assert "cannot create a network namespace" in summary["network_reason"]
    check_sane(summary)


# ------------------------------------------------------------------ the lab


@pytest.mark.slow
@pytest.mark.netlab
@pytest.mark.timeout(150)
def test_tiny_swarm_in_the_lab_averages_fully_behind_nat_on_slow_links():
    reason = _star_lab.lab_unavailable_reason() or bench.nat_unavailable_reason()
    if reason:
        pytest.skip(f"network lab unavailable: {reason}")
    summary, _ = run_benchmark({"DEDLOC_NETWORK": "lab"}, timeout=140)
    assert summary["network"] == "lab" and summary["network_reason"] is None
    assert summary["nat"] is True
    check_sane(summary)
    for mode in bench.MODES:
        row = summary[mode]
        # most gradient rounds of the measured epochs averaged every span with everyone,
        # the 10 Mbit/s reducer and the client behind NAT included (not all: with
        # half-second epochs on 10 Mbit/s links a round now and then misses its window
        # and the peers step on their own gradients, as designed; 1 run in 3 had 0.83)
        assert row["full_rounds"] >= 0.5
        assert all(mb > 0 for mb in row["sent_mb_per_epoch"])
    # the slow reducer owns nothing in adaptive mode, so it sends less than with equal
    # shares (bytes from its veth's counters)
    assert summary["adaptive"]["sent_mb_per_epoch"][1] < summary["equal"]["sent_mb_per_epoch"][1]


def test_a_run_is_drawn_from_its_json_line(tmp_path):
    """The plot (how docs' PNG is made, also from a saved run with ``--plot-from``):
    solo rates against both modes, and each peer's share of the vector."""
    peers = [
        {"step_sleep": 0.02, "rate": "100mbit", "client": False, "solo": 50.0},
        {"step_sleep": 0.03, "rate": "10mbit", "client": True, "solo": 30.0},
    ]
    summary = {"network": "sim", "peers": peers, "adaptive_over_equal": 1.3}
    summary["equal"] = {"samples_per_s": 40.0, "runs": [39.0, 41.0], "spans": [10, 0]}
    summary["adaptive"] = {"samples_per_s": 52.0, "runs": [52.0], "spans": [10, 0]}
    saved = tmp_path / "run.log"
    saved.write_text("table\n" + json.dumps(summary) + "\n")
    picture = tmp_path / "swarm.png"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    options = ("--plot-from", str(saved), "--plot", str(picture))
    run_script("dedloc_heterogeneous.py", env, 120, *options)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
