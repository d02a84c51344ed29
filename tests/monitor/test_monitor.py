"""``Monitor`` and ``swarmgrad monitor`` against real DHT peers on loopback: bad records,
a port in use, clean shutdown, and a small swarm of Optimizer peers watched through
``/metrics`` (Prometheus' parser), ``/api/snapshot`` and a headless browser."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.robust.offenders import OffenceCounts
from swarmgrad.averaging.robust.rules import CenteredClip
from swarmgrad.dht import DHT
from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.monitor import Monitor, PortInUse
from swarmgrad.optim.metrics import RUNS_KEY, MetricsPublisher, metrics_key
from swarmgrad.utils.loop_thread import run_coroutine
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.optim import Trainer, make_model, make_optimizer, wait_until

prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus_client is not installed (the test extra)"
)

ROOT = Path(__file__).resolve().parents[2]


def _get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def _snapshot(monitor: Monitor) -> dict:
    status, content_type, body = _get(monitor.url + "api/snapshot")
    assert status == 200 and content_type == "application/json"
    return json.loads(body)


def _families(monitor: Monitor) -> dict:
    status, content_type, body = _get(monitor.url + "metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    return {f.name: f for f in prometheus_parser.text_string_to_metric_families(body.decode())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def bootstrap():
    dht = DHT(start=True)  # no validators: it stores whatever a peer signs
    try:
        yield dht
    finally:
        dht.shutdown()


def _join(bootstrap: DHT, **options) -> DHT:
    address = [str(a) for a in bootstrap.get_visible_maddrs()]
    return DHT(initial_peers=address, start=True, **options)


def test_malformed_and_oversized_records_are_counted_and_the_pages_still_serve(bootstrap):
    honest, attacker, watcher = _join(bootstrap), _join(bootstrap), None
    publisher = monitor = None
    try:
        publisher = MetricsPublisher(honest, "run", period=0.5)
        publisher.report_loss(1.25)
        signer = Ed25519SignatureValidator(attacker.peer.identity)
        attacker.add_validators([signer])
        expiration = get_dht_time() + 60
        key, mine = metrics_key("run"), signer.local_public_key
        junk = [
            {"loss": "low", "epoch": -1},
            ["not", "a", "record"],
            {"peer_id": b"x", "time": 1.0, "padding": "x" * 40_000},
        ]
        for index, value in enumerate(junk):  # subkeys that hold the attacker's marker
            assert attacker.store(key, value, expiration, subkey=mine + b"/%d" % index)
        assert attacker.store(RUNS_KEY, "not a time", expiration, subkey="bogus-run")
        watcher = _join(bootstrap, client_mode=True)
        monitor = Monitor(watcher, port=0, poll_interval=0.3)

        def settled() -> bool:
            runs = {r["run_id"]: r for r in monitor.snapshot()["runs"]}
            return "run" in runs and runs["run"]["loss"] == 1.25

        wait_until(settled, 30, "the honest peer's record")
        wait_until(lambda: monitor.snapshot()["polls"] >= 3, 30, "three polls")
        snapshot = _snapshot(monitor)
        # each bad record counted once, however many polls read it: two malformed metrics
        # records and a malformed run directory entry; one oversized record
        assert snapshot["rejected"] == {"malformed": 3, "oversized": 1}
        (run,) = [r for r in snapshot["runs"] if r["run_id"] == "run"]
        assert [p["peer_id"] for p in run["peers"]] == [str(honest.peer_id)]
        assert _get(monitor.url)[0] == 200
        families = _families(monitor)
        rejected = {
            s.labels["reason"]: s.value
            for s in families["swarmgrad_monitor_records_rejected"].samples
        }
        assert rejected == {"malformed": 3, "oversized": 1}
        assert _get(monitor.url + "nothing-here")[0] == 404
    finally:
        for item in (monitor, publisher):
            if item is not None:
                item.shutdown()
        for dht in (watcher, attacker, honest):
            if dht is not None:
                dht.shutdown()


def test_a_port_in_use_is_refused_naming_it_and_shutdown_frees_the_port(bootstrap):
    watcher = _join(bootstrap, client_mode=True)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(PortInUse, match=f"port {port} "):
                Monitor(watcher, port=port)
        monitor = Monitor(watcher, port=port, poll_interval=0.2)
        monitor.wait_for_first_poll()
        assert _get(monitor.url)[0] == 200
        # a client that connects and says nothing holds a handler until its deadline
        # (10 s); shutting down must not wait for it, nor leave it behind
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        wait_until(lambda: len(monitor._http._handlers) == 1, 10, "the idle connection")
        running = run_coroutine(_monitor_tasks(), timeout=10)
        assert "Monitor._poll_forever" in running and "HTTPServer._serve" in running
        began = time.monotonic()
        monitor.shutdown()
        assert time.monotonic() - began < 5
        monitor.shutdown()  # idempotent
        assert idle.recv(1) == b""  # closed by the monitor
        idle.close()
        assert monitor._poller is None and not monitor._http._handlers
        assert not run_coroutine(_monitor_tasks(), timeout=10)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with socket.socket() as again:  # no listener left (TIME_WAIT needs SO_REUSEADDR)
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", port))
            again.listen()
    finally:
        watcher.shutdown()


async def _monitor_tasks() -> list[str]:
    """Tasks on swarmgrad's loop that belong to a monitor or its HTTP server."""
    names = []
    for task in asyncio.all_tasks():
        name = getattr(task.get_coro(), "__qualname__", "")
        if name.startswith(("Monitor.", "HTTPServer.")) and not task.done():
            names.append(name)
    return names


def test_cli_port_in_use_exits_2_with_a_clear_message_and_no_traceback(bootstrap):
    address = str(bootstrap.get_visible_maddrs()[0])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "swarmgrad.cli.main", "monitor", "--initial-peers", address,
             "--port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


# ---------------------------------------------------------------------- a small swarm


@pytest.fixture(scope="module")
def swarm():
    """Two Optimizer peers training in threads, publishing metrics every 0.5 s, and a
    monitor polling every 0.5 s; yields (monitor, the peers' ids, their optimizers, the
    bootstrap address)."""
    dhts, trainers, opts, monitor = [], [], [], None
    try:
        dhts.append(DHT(start=True))
        address = [str(a) for a in dhts[0].get_visible_maddrs()]
        for index in range(2):
            dht = DHT(initial_peers=address, start=True)
            dhts.append(dht)
            model = make_model(seed=index)
            # a peer whose partner stopped waits out its round at teardown: keep it short
            opt = make_optimizer(
                dht, model, target_batch_size=32, averaging_timeout=5.0, metrics={"period": 0.5}
            )
            opts.append(opt)
            trainers.append(
                Trainer(opt, model, seed=index, until_epoch=10**6, deadline=300,
                        on_step=lambda t: t.opt.report(loss=t.losses[-1]))
            )  # fmt: skip
        for trainer in trainers:
            trainer.start()
        watcher = DHT(initial_peers=address, client_mode=True, start=True)
        dhts.append(watcher)
        monitor = Monitor(watcher, port=0, poll_interval=0.5)

        def ready() -> bool:
            runs = monitor.snapshot()["runs"]
            if not runs:
                return False
            run = runs[0]
            with_loss = [p for p in run["peers"] if p["loss"] is not None]
            losses = [x for x in run["history"]["loss"] if x is not None]
            return len(with_loss) == 2 and len(losses) >= 3 and run["epoch"] >= 1

        wait_until(ready, 60, "both peers' losses and an epoch in the monitor")
        yield monitor, sorted(str(d.peer_id) for d in dhts[1:3]), opts, address
    finally:
        for trainer in trainers:
            trainer.stop.set()
        for trainer in trainers:
            trainer.join(30)
        if monitor is not None:
            monitor.shutdown()
        for opt in opts:
            opt.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def test_snapshot_and_prometheus_endpoint_show_both_peers_and_their_loss(swarm):
    monitor, peer_ids, _, _ = swarm
    (run,) = _snapshot(monitor)["runs"]
    assert run["run_id"] == "test_run"
    assert sorted(p["peer_id"] for p in run["peers"]) == peer_ids
    assert all(p["loss"] is not None and p["bytes_sent"] > 0 for p in run["peers"])
    assert all(p["has_progress"] and p["has_metrics"] for p in run["peers"])
    assert run["loss"] is not None and run["num_peers"] == 2

    families = _families(monitor)
    (peers,) = families["swarmgrad_run_peers"].samples
    assert peers.value == 2 and peers.labels == {"run": "test_run"}
    losses = {s.labels["peer"]: s.value for s in families["swarmgrad_peer_loss"].samples}
    assert sorted(losses) == peer_ids
    assert families["swarmgrad_peer_bytes_sent"].type == "counter"
    outcomes = {s.labels["outcome"] for s in families["swarmgrad_peer_averaging_rounds"].samples}
    assert outcomes == {"ok", "failed"}
    assert families["swarmgrad_monitor_polls"].samples[0].value >= 3


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_headless_browser_shows_the_peers_and_a_loss_curve(swarm):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary found (apt-get install -y chromium)")
    monitor, peer_ids, _, _ = swarm
    with tempfile.TemporaryDirectory(prefix="swarmgrad-chromium-") as profile:
        result = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom",
             monitor.url],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    dom = result.stdout
    assert result.returncode == 0, result.stderr[-2000:]
    for peer_id in peer_ids:
        assert f'class="peer" data-peer="{peer_id}"' in dom, dom[-3000:]
    # the run's mean loss as an SVG path of several points, and each peer's own curve
    assert 'class="series loss-line"' in dom
    points = re.search(r'class="series loss-line" data-name="mean" data-points="(\d+)"', dom)
    assert points is not None and int(points.group(1)) >= 2, dom[-3000:]
    assert dom.count('class="series peer-loss"') == 2
    assert '<span class="empty">no run seen yet</span>' not in dom
    assert re.search(r'<body[^>]* data-rendered-ms="[0-9.]+"', dom)
    assert 'data-run="test_run"' in dom


def test_offenders_of_a_peers_averagers_reach_the_monitor_and_prometheus(swarm):
    """Robust averaging's evidence (``DecentralizedAverager.offenders``) travels in the
    peer's metrics record: counts from both of its averagers are summed per offender."""
    monitor, peer_ids, opts, _ = swarm
    reporter = opts[0]
    offender = "12D3KooWOffenderOffenderOffenderOffenderOffender"

    async def record_offences() -> None:  # on the loop thread, which owns the logs
        for averager, rounds in ((reporter.grad_averager, 2), (reporter.state_averager, 1)):
            counts = averager._core.offenders.counts.setdefault(offender, OffenceCounts())
            counts.clipped_rounds += rounds
            counts.bad_reductions += 1

    run_coroutine(record_offences(), timeout=10)

    def reported() -> bool:
        offenders = monitor.snapshot()["runs"][0]["offenders"]
        return any(o["peer_id"] == offender for o in offenders)

    wait_until(reported, 30, "the offender in the monitor")
    (entry,) = _snapshot(monitor)["runs"][0]["offenders"]
    assert entry["reported_by"] == 1
    assert entry["clipped_rounds"] == 3 and entry["bad_reductions"] == 2
    assert entry["banned_by"] == 0
    families = _families(monitor)
    (clipped,) = families["swarmgrad_offender_clipped_rounds"].samples
    assert clipped.labels["offender"] == offender and clipped.value == 3
    assert clipped.labels["peer"] == str(reporter.dht.peer_id)


def test_cli_json_prints_one_snapshot_with_the_run(swarm):
    monitor, peer_ids, _, address = swarm
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad.cli.main", "monitor", "--initial-peers", *address,
         "--run-id", "test_run", "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    (run,) = snapshot["runs"]
    assert run["run_id"] == "test_run"
    assert sorted(p["peer_id"] for p in run["peers"]) == peer_ids


def test_an_expert_server_appears_with_its_experts(bootstrap):
    address = str(bootstrap.get_visible_maddrs()[0])
    server = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad.cli.main", "server", "--expert-cls", "ffn",
         "--hidden-dim", "8", "--num-experts", "3", "--expert-pattern", "expert.[0:3]",
         "--initial-peers", address, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--metrics-period", "0.5", "--metrics-run-id", "moe", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )  # fmt: skip
    watcher = _join(bootstrap, client_mode=True)
    monitor = Monitor(watcher, port=0, poll_interval=0.3)
    try:
        wait_until(lambda: monitor.snapshot()["expert_servers"], 60, "the expert server")
        (entry,) = _snapshot(monitor)["expert_servers"]
        assert entry["run_id"] == "moe" and entry["role"] == "server"
        assert entry["num_experts"] == 3
        assert sorted(entry["experts"]) == ["expert.0", "expert.1", "expert.2"]
        (experts,) = _families(monitor)["swarmgrad_peer_experts"].samples
        assert experts.value == 3 and experts.labels["role"] == "server"
        server.terminate()  # says goodbye: its record is withdrawn
        assert server.wait(30) == 0, server.stderr.read()
        wait_until(lambda: not monitor.snapshot()["expert_servers"], 30, "the server's goodbye")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stderr.close()
        monitor.shutdown()
        watcher.shutdown()


def test_a_peer_clipped_by_centered_clip_is_reported_in_the_monitor(bootstrap):
    """Issue 15's accountability end to end: an attacker's contribution scaled by 1000 is
    clipped by the honest span owners' CenteredClip, their averagers count it, their
    metrics records carry it and the monitor lists the attacker as an offender."""
    dhts = [_join(bootstrap) for _ in range(4)]
    watcher = _join(bootstrap, client_mode=True)
    honest = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    averagers, publishers, monitor = [], [], None
    try:
        for dht, value in zip(dhts, [*honest, honest[0] * 1000], strict=True):
            averagers.append(
                DecentralizedAverager(
                    [value.clone()], dht, prefix="clip", start=True, target_group_size=4,
                    aggregation=CenteredClip(tau=20.0, n_iters=50),  # above the honest spread
                    min_matchmaking_time=1.0,
                )
            )  # fmt: skip
        for averager in averagers[:3]:
            publishers.append(
                MetricsPublisher(
                    averager.dht, "clip", lambda a=averager: {"offenders": a.offenders},
                    period=0.3,
                )
            )  # fmt: skip
        controls = [a.step(timeout=30, wait=False, expected_group_size=4) for a in averagers]
        assert all(len(control.result(60) or ()) == 4 for control in controls)
        assert [(a.rounds_succeeded, a.rounds_failed) for a in averagers] == [(1, 0)] * 4
        attacker = str(dhts[3].peer_id)
        monitor = Monitor(watcher, run_ids=["clip"], port=0, poll_interval=0.3)

        def reported() -> bool:
            runs = monitor.snapshot()["runs"]
            offenders = runs[0]["offenders"] if runs else []
            return any(o["peer_id"] == attacker and o["reported_by"] == 3 for o in offenders)

        wait_until(reported, 30, "the attacker reported by the three honest peers")
        (entry,) = _snapshot(monitor)["runs"][0]["offenders"]  # nobody else
        assert entry["peer_id"] == attacker
        assert entry["clipped_rounds"] == 3 and entry["bad_reductions"] == 0
        assert entry["banned_by"] == 0  # no ban_after: counted, not banned
        families = _families(monitor)
        reporters = {
            s.labels["peer"]
            for s in families["swarmgrad_offender_clipped_rounds"].samples
            if s.labels["offender"] == attacker and s.value == 1
        }
        assert reporters == {str(d.peer_id) for d in dhts[:3]}
    finally:
        if monitor is not None:
            monitor.shutdown()
        for item in publishers + averagers:
            item.shutdown()
        for dht in [watcher, *dhts]:
            dht.shutdown()


def test_bad_http_requests_get_an_error_status_and_the_server_keeps_serving(bootstrap):
    watcher = _join(bootstrap, client_mode=True)
    monitor = Monitor(watcher, port=0, poll_interval=0.5)
    try:

        def ask(raw: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", monitor.port), timeout=10) as s:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                return b"".join(iter(lambda: s.recv(65536), b""))

        assert ask(b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert ask(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n").startswith(b"HTTP/1.1 400 ")
        assert ask(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert ask(b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        head = ask(b"HEAD /api/snapshot HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        assert _get(monitor.url + "api/snapshot?x=1")[0] == 200
    finally:
        monitor.shutdown()
        watcher.shutdown()
