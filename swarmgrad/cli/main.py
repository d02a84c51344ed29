"""``swarmgrad``: the command-line entry point and its subcommands."""

from __future__ import annotations

import argparse
import sys

from swarmgrad.cli import (
    authority_command,
    demo_command,
    dht_command,
    identity_command,
    monitor_command,
    serve_stage_command,
    server_command,
    train_command,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="swarmgrad",
        description="Train large neural networks on computers lent over the internet.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dht_command.add_parser(commands)
    server_command.add_parser(commands)
    serve_stage_command.add_parser(commands)
    train_command.add_parser(commands)
    monitor_command.add_parser(commands)
    demo_command.add_parser(commands)
    authority_command.add_parser(commands)
    identity_command.add_parser(commands)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
