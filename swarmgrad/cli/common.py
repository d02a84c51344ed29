"""What every ``swarmgrad`` subcommand shares: its exit codes, how its parser is made,
how it reports a usage error and how it hears that it should stop."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_command(
    commands: argparse._SubParsersAction, name: str, *, help: str, doc: str | None, **options: Any
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: ``help`` is its line in ``swarmgrad --help``,
    ``doc`` (its module's docstring) its ``swarmgrad NAME --help``, line breaks kept;
    ``options`` go to ``add_parser`` as they are."""
    return commands.add_parser(
        name,
        help=help,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **options,
    )


def usage_error(command: str, message: str) -> int:
    """Say on stderr what is wrong with ``swarmgrad COMMAND``'s options; the exit code."""
    print(f"swarmgrad {command}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set, so that a command's loop ends and it shuts
    down cleanly (call from the main thread)."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop
