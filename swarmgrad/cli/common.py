"""What every ``swarmgrad`` subcommand shares: its exit codes and how its parser is made."""

from __future__ import annotations

import argparse
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
