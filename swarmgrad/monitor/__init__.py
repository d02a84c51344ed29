"""Watching a swarm: the peers' metrics records collected from the DHT, a web dashboard
and a Prometheus endpoint (``swarmgrad monitor``).

Peers publish their records with :class:`~swarmgrad.optim.metrics.MetricsPublisher` (the
collaborative ``Optimizer`` starts one); :class:`Monitor` reads them with the runs'
progress records and serves them."""

from swarmgrad.monitor.collector import SwarmView, parse_metrics, parse_progress
from swarmgrad.monitor.http import PortInUse
from swarmgrad.monitor.monitor import Monitor
from swarmgrad.monitor.prometheus import render_metrics
from swarmgrad.optim.metrics import MetricsPublisher, PeerMetrics

__all__ = [
    "MetricsPublisher",
    "Monitor",
    "PeerMetrics",
    "PortInUse",
    "SwarmView",
    "parse_metrics",
    "parse_progress",
    "render_metrics",
]
