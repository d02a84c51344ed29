"""The metrics record, its parsing by the monitor, the swarm view and the Prometheus text."""

from __future__ import annotations

import json
import math

import pydantic
import pytest

from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.schema import SchemaValidator
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.dht.validation import DHTRecord, serialize
from swarmgrad.monitor.collector import (
    MAX_LOSS_CURVES,
    MAX_RUNS,
    SwarmView,
    parse_metrics,
    parse_progress,
    parse_run_directory,
)
from swarmgrad.monitor.page import render_page
from swarmgrad.monitor.prometheus import render_metrics
from swarmgrad.net.identity import Identity
from swarmgrad.optim.metrics import (
    MAX_METRICS_BYTES,
    MetricsSchema,
    PeerMetrics,
    merge_offenders,
    metrics_key,
)

prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus_client is not installed (the test extra)"
)


def _identity_and_subkey() -> tuple[Identity, bytes]:
    identity = Identity.generate()
    return identity, Ed25519SignatureValidator(identity).local_public_key


def _metrics(identity: Identity, time: float, **fields) -> dict:
    return PeerMetrics(peer_id=identity.peer_id.to_bytes(), time=time, **fields).model_dump()


def _progress(identity: Identity, time: float, epoch: int = 0) -> dict:
    return {
        "peer_id": identity.peer_id.to_bytes(),
        "epoch": epoch,
        "samples_accumulated": 8,
        "samples_per_second": 10.0,
        "time": time,
        "client_mode": False,
    }


def _found(entries: dict) -> ValueWithExpiration:
    return ValueWithExpiration({k: ValueWithExpiration(v, 1e12) for k, v in entries.items()}, 1e12)


def test_schema_accepts_a_record_and_refuses_nan_negative_and_oversized_lists():
    identity, subkey = _identity_and_subkey()
    validator = SchemaValidator(MetricsSchema, prefix="run")
    good = _metrics(identity, 100.0, loss=1.5, rounds_ok=3, experts=["e.0"], num_experts=1)

    def accepted(value) -> bool:
        key = serialize(metrics_key("run"))  # "run_peer_metrics": the schema's field
        record = DHTRecord(key, serialize(subkey), serialize(value), 1e12)
        return validator.validate(record)

    assert accepted(good)
    assert not accepted({**good, "loss": math.nan})
    assert not accepted({**good, "rounds_ok": -1})
    assert not accepted({**good, "epoch": "3"})
    assert not accepted({**good, "experts": [f"e.{i}" for i in range(1000)]})
    assert not accepted({**good, "offenders": {f"p{i}": {} for i in range(100)}})
    with pytest.raises(pydantic.ValidationError):
        PeerMetrics(peer_id=b"x", time=1.0, samples_per_second=-1.0)


def test_parse_metrics_counts_malformed_and_oversized_records_and_keeps_good_ones():
    alice, alice_key = _identity_and_subkey()
    bob, bob_key = _identity_and_subkey()
    carol, carol_key = _identity_and_subkey()
    dave, dave_key = _identity_and_subkey()
    huge = {**_metrics(carol, 1.0), "padding": "x" * (MAX_METRICS_BYTES + 1)}
    parsed = parse_metrics(
        _found(
            {
                alice_key: _metrics(alice, 1.0, loss=0.5),
                bob_key: {"loss": "not a number"},
                carol_key: huge,
                dave_key: None,  # a goodbye
                "not bytes": _metrics(alice, 1.0),
                b"[owner:junk]": [1, 2, 3],
            }
        )
    )
    assert set(parsed.records) == {alice_key}
    assert parsed.records[alice_key].loss == 0.5
    assert parsed.goodbyes == {dave_key}
    assert parsed.rejected == {"malformed": 3, "oversized": 1}
    assert parse_metrics(None).rejected == {}
    assert parse_metrics(ValueWithExpiration(b"plain value", 1e12)).rejected == {"malformed": 1}


def test_parse_run_directory_keeps_the_freshest_valid_run_ids():
    entries = {f"run{i}": float(i) for i in range(MAX_RUNS + 5)}
    entries.update({"": 1.0, "x" * 500: 1.0, "nan": math.nan, "str": "late", "ok\x00": 2.0})
    runs, refused = parse_run_directory(_found(entries))
    assert len(runs) == MAX_RUNS
    assert runs[0] == f"run{MAX_RUNS + 4}"
    assert [reason for reason, _ in refused] == ["malformed"] * 5


def test_view_joins_progress_and_metrics_by_signer_and_bounds_history():
    alice, alice_key = _identity_and_subkey()
    bob, bob_key = _identity_and_subkey()
    view = SwarmView(history=5)
    for step in range(12):
        t = 1000.0 + step
        metrics = parse_metrics(
            _found(
                {
                    alice_key: _metrics(alice, t, loss=2.0 - 0.1 * step, rounds_ok=step),
                    # bob claims alice's peer id: he is named after the key that signed
                    bob_key: {**_metrics(bob, t, loss=1.0), "peer_id": alice.peer_id.to_bytes()},
                }
            )
        )
        progress = parse_progress(_found({alice_key: _progress(alice, t, epoch=step // 4)}))
        view.update_run("run", progress, metrics, now=t)
    snapshot = view.snapshot(now=1012.0)
    (run,) = snapshot["runs"]
    names = {p["peer_id"] for p in run["peers"]}
    assert names == {str(alice.peer_id), str(bob.peer_id)}
    assert run["num_peers"] == 2
    assert run["epoch"] == 2
    assert len(run["history"]["time"]) == 5  # bounded
    assert len(run["loss_by_peer"][str(alice.peer_id)]) == 5
    assert run["loss"] == pytest.approx(((2.0 - 1.1) + 1.0) / 2)
    assert run["rounds_ok"] == 11
    alice_row = next(p for p in run["peers"] if p["peer_id"] == str(alice.peer_id))
    assert alice_row["has_progress"] and alice_row["has_metrics"]
    assert alice_row["samples_accumulated"] == 8


def test_view_drops_a_peer_after_its_goodbye():
    alice, alice_key = _identity_and_subkey()
    view = SwarmView()
    view.update_run(
        "run", parse_progress(None), parse_metrics(_found({alice_key: _metrics(alice, 1.0)})), 1.0
    )
    assert view.snapshot(2.0)["runs"][0]["num_peers"] == 1
    view.update_run("run", parse_progress(None), parse_metrics(_found({alice_key: None})), 2.0)
    assert view.snapshot(3.0)["runs"][0]["num_peers"] == 0


def test_offenders_are_merged_per_averager_and_summed_per_run():
    merged = merge_offenders(
        {"p1": {"clipped_rounds": 2, "clipped_parts": 4, "bad_reductions": 0, "banned": False}},
        {"p1": {"clipped_rounds": 1, "clipped_parts": 1, "bad_reductions": 1, "banned": True}},
    )
    assert merged == {
        "p1": {"clipped_rounds": 3, "clipped_parts": 5, "bad_reductions": 1, "banned": True}
    }
    alice, alice_key = _identity_and_subkey()
    bob, bob_key = _identity_and_subkey()
    view = SwarmView()
    metrics = parse_metrics(
        _found(
            {
                alice_key: _metrics(alice, 1.0, offenders=merged),
                bob_key: _metrics(bob, 1.0, offenders={"p1": {"clipped_rounds": 2}}),
            }
        )
    )
    view.update_run("run", parse_progress(None), metrics, 1.0)
    (offender,) = view.snapshot(1.0)["runs"][0]["offenders"]
    assert offender["peer_id"] == "p1"
    assert offender["reported_by"] == 2 and offender["banned_by"] == 1
    assert offender["clipped_rounds"] == 5 and offender["bad_reductions"] == 1


def test_prometheus_text_parses_and_escapes_labels():
    alice, alice_key = _identity_and_subkey()
    view = SwarmView()
    metrics = parse_metrics(
        _found(
            {
                alice_key: _metrics(
                    alice, 1.0, loss=0.25, rounds_ok=3, rounds_failed=1, bytes_sent=10,
                    offenders={'evil"\\\npeer': {"clipped_rounds": 4, "banned": True}},
                )
            }
        )
    )  # fmt: skip
    view.update_run('run "x"\\', parse_progress(None), metrics, 1.0)
    view.count_rejected([("oversized", b"a"), ("oversized", b"b"), ("oversized", b"a")])
    text = render_metrics(view.snapshot(1.0))
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    (loss,) = families["swarmgrad_peer_loss"].samples
    assert loss.value == 0.25 and loss.labels["run"] == 'run "x"\\'
    rounds = {
        s.labels["outcome"]: s.value for s in families["swarmgrad_peer_averaging_rounds"].samples
    }
    assert rounds == {"ok": 3, "failed": 1}
    rejected = {
        s.labels["reason"]: s.value for s in families["swarmgrad_monitor_records_rejected"].samples
    }
    assert rejected == {"malformed": 0, "oversized": 2}
    (banned,) = families["swarmgrad_offender_banned"].samples
    assert banned.labels["offender"] == 'evil"\\\npeer' and banned.value == 1


def test_a_bad_record_read_at_every_poll_is_counted_once():
    alice, alice_key = _identity_and_subkey()
    view = SwarmView()
    bad = _found({alice_key: {"loss": "low"}})
    for now in range(5):
        view.update_run("run", parse_progress(None), parse_metrics(bad), float(now))
    assert view.snapshot(5.0)["rejected"] == {"malformed": 1, "oversized": 0}
    worse = _found({alice_key: {"loss": "lower"}})  # a new bad record: counted
    view.update_run("run", parse_progress(None), parse_metrics(worse), 6.0)
    assert view.snapshot(6.0)["rejected"]["malformed"] == 2


def test_a_peer_whose_record_vanished_is_dropped_after_two_polls_without_it():
    """The DHT hides a goodbye (a deleted subkey) and an expired record alike."""
    alice, alice_key = _identity_and_subkey()
    bob, bob_key = _identity_and_subkey()
    view = SwarmView()
    both = _found({alice_key: _metrics(alice, 1.0), bob_key: _metrics(bob, 1.0)})
    only_alice = _found({alice_key: _metrics(alice, 2.0)})
    view.update_run("run", parse_progress(None), parse_metrics(both), 1.0)
    view.update_run("run", parse_progress(None), parse_metrics(only_alice), 2.0)
    assert view.snapshot(2.0)["runs"][0]["num_peers"] == 2  # one missed read is no departure
    view.update_run("run", parse_progress(None), parse_metrics(only_alice), 3.0)
    (peer,) = view.snapshot(3.0)["runs"][0]["peers"]
    assert peer["peer_id"] == str(alice.peer_id)


def test_the_page_inlines_the_snapshot_as_inert_json():
    hostile = {"runs": [{"run_id": '</script><script>alert("x")</script>&'}]}
    page = render_page(hostile)
    inline = page.split('<script id="initial-snapshot" type="application/json">', 1)[1]
    data, rest = inline.split("</script>", 1)
    assert json.loads(data) == hostile
    assert "alert" not in rest.split("<script>", 1)[0]
    assert "__INITIAL_SNAPSHOT__" not in page
    assert json.loads(render_page(None).split('type="application/json">')[1].split("<")[0]) is None


def test_the_snapshot_carries_the_loss_curves_of_the_peers_that_reported_last():
    view = SwarmView()
    peers = [_identity_and_subkey() for _ in range(MAX_LOSS_CURVES + 5)]
    entries = {
        key: _metrics(identity, 100.0 + index, loss=float(index))
        for index, (identity, key) in enumerate(peers)
    }
    view.update_run("run", parse_progress(None), parse_metrics(_found(entries)), 200.0)
    (run,) = view.snapshot(200.0)["runs"]
    assert run["num_peers"] == MAX_LOSS_CURVES + 5
    newest = {str(identity.peer_id) for identity, _ in peers[5:]}
    assert set(run["loss_by_peer"]) == newest


def test_a_run_the_directory_stops_listing_is_dropped_after_two_reads():
    alice, alice_key = _identity_and_subkey()
    view = SwarmView()
    for run in ("old", "new"):
        records = parse_metrics(_found({alice_key: _metrics(alice, 1.0)}))
        view.update_run(run, parse_progress(None), records, 1.0)
    view.retain_runs(["new"])
    assert {r["run_id"] for r in view.snapshot(2.0)["runs"]} == {"old", "new"}
    view.retain_runs(["new"])
    assert [r["run_id"] for r in view.snapshot(3.0)["runs"]] == ["new"]
