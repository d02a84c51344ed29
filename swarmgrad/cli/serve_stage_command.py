"""``swarmgrad serve-stage``: serve one stage of a SWARM pipeline.

Example (a stage module as in ``docs/pipeline.md``)::

    swarmgrad serve-stage --module gpt_stages.py --pipeline gpt --stage 2 \\
                          --initial-peers ADDR

The peer builds every stage of the module (seeded, so all peers agree on the initial
weights), checks that they chain, serves ``--stage``, takes the stage's current state from
its other peers, averages with them every ``--average-period`` seconds (parameters,
DiLoCo pseudo-gradients or accumulated gradients: ``--averaging-mode``), and every
``--rebalance-interval`` seconds checks whether it should move to the bottleneck stage.

Once serving, it prints on stdout (scripts can parse them)::

    Serving stage 2/4 of pipeline 'gpt'
    To join, use --initial-peers MADDR [MADDR ...]

then one indented line per multiaddr. SIGINT or SIGTERM withdraw its record and exit
with code 0. Bad options or a stage module that does not load or chain exit with code 2,
a failure to start with code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from swarmgrad.cli.common import EXIT_FAILED, EXIT_OK, add_command, stop_on_signals, usage_error
from swarmgrad.utils.logging import use_swarmgrad_log_handler

logger = logging.getLogger("swarmgrad.cli.serve_stage")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands, "serve-stage", help="serve one stage of a SWARM pipeline", doc=__doc__
    )
    parser.add_argument("--module", required=True, help="stage module (make_stages, sample_input)")
    parser.add_argument("--pipeline", required=True, help="the pipeline's name in the DHT")
    parser.add_argument("--stage", type=int, required=True, help="the stage to serve first")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="peers already in the swarm")
    parser.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"])
    parser.add_argument("--update-period", type=float, default=10.0, help="seconds between records")
    parser.add_argument(
        "--average-period",
        type=float,
        default=30.0,
        help="seconds between averaging rounds (0: never)",
    )
    parser.add_argument(
        "--averaging-mode",
        choices=("parameters", "diloco", "gradients"),
        default="parameters",
        help="what the stage's peers average: their parameters, (diloco) pseudo-gradients "
        "applied by an outer Nesterov SGD, or (gradients) the gradients they accumulated, "
        "every peer then stepping with the average (no step per backward)",
    )
    parser.add_argument(
        "--rebalance-interval", type=float, default=60.0, help="seconds between checks (0: never)"
    )
    parser.add_argument(
        "--hysteresis", type=float, default=0.2, help="least gain that moves a peer"
    )
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument(
        "--activation-cache-mb",
        type=float,
        default=256.0,
        help="memory for forward graphs kept for their backward (0: always recompute)",
    )
    parser.add_argument("--batch-timeout", type=float, default=0.01)
    parser.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        help="seconds slept per batch: stands in for a slower device in demos and benchmarks",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    use_swarmgrad_log_handler()
    logging.getLogger("swarmgrad").setLevel(args.log_level.upper())
    from swarmgrad.pipeline.stages import load_stage_module
    from swarmgrad.utils.errors import ValidationError

    try:
        peer_options = _options(args)
        stage_module = load_stage_module(args.module)
        specs = stage_module.build()
        if not 0 <= args.stage < len(specs):
            raise ValidationError(f"--stage must be in [0, {len(specs)}), got {args.stage}")
    except ValidationError as e:
        return usage_error("serve-stage", str(e))
    try:
        peer = _start(args, stage_module, len(specs), peer_options)
    except Exception as e:
        print(f"swarmgrad serve-stage: failed to start: {e}", file=sys.stderr)
        return EXIT_FAILED
    stop = stop_on_signals()
    maddrs = [str(m) for m in peer.dht.get_visible_maddrs()]
    print(f"Serving stage {peer.stage}/{len(specs)} of pipeline {args.pipeline!r}", flush=True)
    print("To join, use --initial-peers MADDR [MADDR ...]", flush=True)
    for maddr in maddrs:
        print(f"  {maddr}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        peer.shutdown()
        peer.dht.shutdown()
    return EXIT_OK


def _options(args: argparse.Namespace) -> Any:
    from swarmgrad.pipeline.peer import StagePeerOptions
    from swarmgrad.pipeline.rebalance import RebalanceOptions
    from swarmgrad.pipeline.server import StageServerOptions
    from swarmgrad.pipeline.training import StageTrainingOptions
    from swarmgrad.utils.errors import ValidationError

    if not args.activation_cache_mb >= 0:
        raise ValidationError(
            f"--activation-cache-mb must be 0 or more, got {args.activation_cache_mb}"
        )
    return StagePeerOptions(
        server=StageServerOptions(
            update_period=args.update_period,
            activation_cache_bytes=int(args.activation_cache_mb * 2**20),
        ),
        training=StageTrainingOptions(average_period=args.average_period, mode=args.averaging_mode)
        if args.average_period > 0
        else None,
        rebalance=RebalanceOptions(interval=args.rebalance_interval, hysteresis=args.hysteresis)
        if args.rebalance_interval > 0
        else None,
    )


def _start(args: argparse.Namespace, stage_module: Any, num_stages: int, options: Any) -> Any:
    from torch import nn

    from swarmgrad.dht import DHT
    from swarmgrad.pipeline.peer import StagePeer
    from swarmgrad.pipeline.stages import StageSpec, make_stage_backend

    def make_backend(stage: int):
        spec = stage_module.build()[stage]
        if args.slowdown > 0:
            spec = StageSpec(
                _Slowed(spec.module, args.slowdown), spec.args_schema, spec.outputs_schema
            )
        return make_stage_backend(
            f"{args.pipeline}.{stage}",
            spec,
            stage_module.make_optimizer,
            max_batch_size=args.max_batch_size,
            timeout=args.batch_timeout,
        )

    class _Slowed(nn.Module):
        def __init__(self, inner: nn.Module, seconds: float):
            super().__init__()
            self.inner, self.seconds = inner, seconds

        def forward(self, *inputs: Any) -> Any:
            time.sleep(self.seconds)
            return self.inner(*inputs)

    dht = DHT(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs, start=True)
    try:
        peer = StagePeer(dht, args.pipeline, num_stages, args.stage, make_backend, options)
        peer.start()
    except BaseException:
        dht.shutdown()
        raise
    return peer
