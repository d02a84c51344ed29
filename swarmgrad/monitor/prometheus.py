"""The monitor's snapshot in Prometheus' text exposition format (version 0.0.4).

One family per quantity, labelled by ``run`` and ``peer`` (the PeerID); cumulative peer
counters (averaging rounds, bytes, expert batches) are ``_total`` counters, so
``rate(swarmgrad_peer_bytes_sent_total[1m])`` gives a peer's upload rate. A peer that
restarts starts its counters again from zero, which Prometheus reads as a counter reset.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["CONTENT_TYPE", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str):
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: list[tuple[dict[str, str], float]] = []

    def add(self, labels: dict[str, str], value: float | None) -> None:
        if value is not None:
            self.samples.append((labels, value))

    def lines(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in self.samples:
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            name = f"{self.name}{{{text}}}" if text else self.name
            yield f"{name} {_number(value)}"


def render_metrics(snapshot: dict[str, Any]) -> str:
    """The text served at ``/metrics`` for a :meth:`~.collector.SwarmView.snapshot`."""
    families: dict[str, _Family] = {}

    def family(name: str, kind: str, help_text: str) -> _Family:
        if name not in families:
            families[name] = _Family(name, kind, help_text)
        return families[name]

    family("swarmgrad_monitor_polls_total", "counter", "Polls of the DHT by this monitor.").add(
        {}, snapshot["polls"]
    )
    family(
        "swarmgrad_monitor_poll_errors_total", "counter", "Polls that failed (DHT unreachable)."
    ).add({}, snapshot["poll_errors"])
    rejected = family(
        "swarmgrad_monitor_records_rejected_total",
        "counter",
        "Records from the swarm the monitor ignored, by reason (malformed or oversized).",
    )
    for reason, count in sorted(snapshot["rejected"].items()):
        rejected.add({"reason": reason}, count)

    run_gauges = [
        ("epoch", "swarmgrad_run_epoch", "The run's newest epoch among its peers."),
        ("num_peers", "swarmgrad_run_peers", "Peers of the run with a live record."),
        ("num_clients", "swarmgrad_run_clients", "Client-mode peers of the run."),
        ("loss", "swarmgrad_run_loss", "Mean of the peers' latest reported losses."),
        (
            "samples_per_second",
            "swarmgrad_run_samples_per_second",
            "Sum of the peers' training throughput.",
        ),
    ]
    peer_gauges = [
        ("epoch", "swarmgrad_peer_epoch", "The peer's local epoch."),
        ("loss", "swarmgrad_peer_loss", "Mean loss the peer reported in its latest record."),
        ("samples_per_second", "swarmgrad_peer_samples_per_second", "The peer's throughput."),
        ("num_experts", "swarmgrad_peer_experts", "Experts the peer serves."),
        ("last_seen_s", "swarmgrad_peer_last_seen_seconds", "Seconds since its last new record."),
    ]
    peer_counters = [
        ("bytes_sent", "swarmgrad_peer_bytes_sent_total", "Bytes the peer's sockets sent."),
        (
            "bytes_received",
            "swarmgrad_peer_bytes_received_total",
            "Bytes the peer's sockets received.",
        ),
        (
            "expert_batches",
            "swarmgrad_peer_expert_batches_total",
            "Forward and backward batches the peer's experts processed.",
        ),
    ]
    for run in snapshot["runs"]:
        run_label = {"run": run["run_id"]}
        for key, name, help_text in run_gauges:
            family(name, "gauge", help_text).add(run_label, run.get(key))
        for peer in run["peers"]:
            labels = {**run_label, "peer": peer["peer_id"], "role": peer["role"]}
            for key, name, help_text in peer_gauges:
                family(name, "gauge", help_text).add(labels, peer.get(key))
            rounds = family(
                "swarmgrad_peer_averaging_rounds_total",
                "counter",
                "Averaging steps of the peer, by outcome (ok: averaged with someone).",
            )
            rounds.add({**labels, "outcome": "ok"}, peer["rounds_ok"])
            rounds.add({**labels, "outcome": "failed"}, peer["rounds_failed"])
            for key, name, help_text in peer_counters:
                family(name, "counter", help_text).add(labels, peer[key])
            for offender, counts in peer["offenders"].items():
                offence = {**run_label, "peer": peer["peer_id"], "offender": offender}
                family(
                    "swarmgrad_offender_clipped_rounds_total",
                    "counter",
                    "Rounds in which robust averaging clipped the offender's contribution "
                    "to the reporting peer.",
                ).add(offence, counts["clipped_rounds"])
                family(
                    "swarmgrad_offender_bad_reductions_total",
                    "counter",
                    "Spans the offender reduced whose result failed the reporting peer's check.",
                ).add(offence, counts["bad_reductions"])
                family(
                    "swarmgrad_offender_banned",
                    "gauge",
                    "1 while the reporting peer bans the offender from its groups.",
                ).add(offence, 1 if counts["banned"] else 0)
    lines = [line for f in families.values() for line in f.lines()]
    return "\n".join(lines) + "\n"
