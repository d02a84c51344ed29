"""``swarmgrad monitor``: a dashboard of the swarm in the browser, and a Prometheus endpoint.

It joins the swarm as a client-mode DHT peer (no listening port, nothing stored), reads
the runs' progress and their peers' metrics records every few seconds, and serves:

  /               the dashboard (peers, epochs, loss and throughput over time, averaging
                  health, expert servers, offenders)
  /metrics        the same figures in Prometheus' text format
  /api/snapshot   the same figures as JSON

With --json it prints one snapshot and exits. docs/monitor.md describes every field.
With --tensorboard DIR and/or --wandb PROJECT it also writes each run's figures there, one
point each time the run's epoch moves (the tensorboard / wandb extras).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from functools import partial
from typing import Any

from swarmgrad.cli.common import EXIT_FAILED, EXIT_OK, add_command, stop_on_signals, usage_error
from swarmgrad.cli.dht_command import add_admission_arguments, admission_kwargs
from swarmgrad.utils.logging import use_swarmgrad_log_handler

logger = logging.getLogger("swarmgrad.cli.monitor")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands,
        "monitor",
        help="serve a dashboard of the swarm's runs and a Prometheus /metrics endpoint",
        doc=__doc__,
    )
    parser.add_argument(
        "--initial-peers",
        "--initial_peers",
        nargs="+",
        required=True,
        help="multiaddrs of peers in the swarm to watch",
    )
    parser.add_argument(
        "--run-id",
        "--run_id",
        action="append",
        default=None,
        help="a run to follow (repeat for several; default: every run the swarm announces)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to serve on (8080; 0: any)")
    parser.add_argument(
        "--json", action="store_true", help="print one snapshot as JSON and exit (no server)"
    )
    parser.add_argument(
        "--poll-interval",
        "--poll_interval",
        type=float,
        default=2.0,
        help="seconds between reads of the DHT (2)",
    )
    parser.add_argument(
        "--history", type=int, default=720, help="points of history kept per run (720)"
    )
    parser.add_argument(
        "--tensorboard", metavar="DIR", help="write each run's figures per epoch for TensorBoard"
    )
    parser.add_argument(
        "--wandb", metavar="PROJECT", help="log each run's figures per epoch to this W&B project"
    )
    add_admission_arguments(parser)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ...")
    parser.set_defaults(run=run)


_usage_error = partial(usage_error, "monitor")


def run(args: argparse.Namespace) -> int:
    from swarmgrad.monitor.exporters import SnapshotExporter, make_exporters
    from swarmgrad.utils.errors import ValidationError

    if not 0 <= args.port <= 65535:
        return _usage_error(f"--port must be between 0 and 65535, got {args.port}")
    if not args.poll_interval > 0:
        return _usage_error(f"--poll-interval must be positive, got {args.poll_interval}")
    if args.history < 2:
        return _usage_error(f"--history must keep at least 2 points, got {args.history}")
    if args.json and (args.tensorboard or args.wandb):
        return _usage_error("--tensorboard and --wandb export while the monitor runs, not --json")
    try:
        admission = admission_kwargs(args.authority_key, args.access_token)
    except ValueError as e:
        return _usage_error(str(e))
    try:
        exporters = SnapshotExporter(
            make_exporters(args.tensorboard, args.wandb, name="swarmgrad-monitor")
        )
    except ValidationError as e:
        return _usage_error(str(e))
    try:
        return _run(args, admission, exporters)
    finally:
        exporters.close()


def _run(args: argparse.Namespace, admission: dict, exporters: Any) -> int:
    from swarmgrad.dht import DHT
    from swarmgrad.monitor import Monitor, PortInUse
    from swarmgrad.utils.errors import SwarmgradError, ValidationError

    use_swarmgrad_log_handler(args.log_level.upper())
    stop = threading.Event() if args.json else stop_on_signals()
    try:
        dht = DHT(initial_peers=args.initial_peers, client_mode=True, start=True, **admission)
    except ValidationError as e:
        return _usage_error(str(e))
    except (SwarmgradError, OSError, ValueError) as e:
        print(f"swarmgrad monitor: could not join the swarm: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    monitor = None
    try:
        try:
            monitor = Monitor(
                dht,
                args.run_id,
                host=args.host,
                port=None if args.json else args.port,
                poll_interval=args.poll_interval,
                history=args.history,
            )
        except PortInUse as e:
            return _usage_error(str(e))
        except ValidationError as e:
            return _usage_error(str(e))
        except OSError as e:  # e.g. an address this machine does not have
            return _usage_error(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}")
        if args.json:
            monitor.wait_for_first_poll()
            print(json.dumps(monitor.snapshot(), indent=1, allow_nan=False, default=str))
            return EXIT_OK
        print(f"Monitor running at {monitor.url}", flush=True)
        print(f"  Prometheus: {monitor.url}metrics   JSON: {monitor.url}api/snapshot", flush=True)
        while not stop.wait(1.0):
            if exporters.exporters:
                exporters.export(monitor.snapshot())
        print("Shutting down", flush=True)
        return EXIT_OK
    finally:
        if monitor is not None:
            monitor.shutdown()
        dht.shutdown()
