"""``swarmgrad demo``: a whole swarm on this machine.

``swarmgrad demo`` (or ``swarmgrad demo train``) trains one small language model with
several trainer processes (:mod:`swarmgrad.cli.demo_train`); ``swarmgrad demo moe`` trains
through a decentralized mixture of experts hosted by expert servers
(:mod:`swarmgrad.cli.demo_moe`); ``swarmgrad demo pipeline`` trains a model split into
stages served by swarms of stage peers (:mod:`swarmgrad.cli.demo_pipeline`).
"""

from __future__ import annotations

import argparse

from swarmgrad.cli import demo_moe, demo_pipeline, demo_train

__all__ = ["add_parser"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="run a small swarm here: collaborative training (default) or experts (moe)",
        description=demo_train.__doc__.split("\n\n")[0],
    )
    demo_train.add_arguments(parser)  # `swarmgrad demo` alone is `swarmgrad demo train`
    kinds = parser.add_subparsers(dest="demo", metavar="{train,moe,pipeline}")
    train = kinds.add_parser(
        "train",
        help="trainers train one tiny GPT together (the default)",
        description=demo_train.__doc__.split("\n\n")[0],
    )
    demo_train.add_arguments(train)
    moe = kinds.add_parser(
        "moe",
        help="a trainer uses experts hosted by expert servers",
        description=demo_moe.__doc__.split("\n\n")[0],
    )
    demo_moe.add_arguments(moe)
    pipeline = kinds.add_parser(
        "pipeline",
        help="a model split into stages, each served by a swarm of stage peers (SWARM)",
        description=demo_pipeline.__doc__.split("\n\n")[0],
    )
    demo_pipeline.add_arguments(pipeline)
