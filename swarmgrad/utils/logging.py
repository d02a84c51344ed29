"""Loggers under the ``swarmgrad`` logger, and a readable handler for the CLI.

The library only logs; it installs no handler, so an application's logging setup decides
what is shown (Python prints warnings to stderr when nothing is configured). The CLI calls
:func:`use_swarmgrad_log_handler` once to get readable lines.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = [
    "ROOT_LOGGER_NAME",
    "get_logger",
    "use_hivemind_log_handler",
    "use_swarmgrad_log_handler",
]

ROOT_LOGGER_NAME = "swarmgrad"

_FORMAT = "%(asctime)s.%(msecs)03d [%(levelname)s] [%(name)s] %(message)s"
_DATE_FORMAT = "%b %d %H:%M:%S"


def get_logger(name: str | None = None) -> logging.Logger:
    """The logger ``name`` under the ``swarmgrad`` logger.

    Module names inside the package (``swarmgrad.dht.node``) are used as they are; any
    other name is placed under it (``"my_script"`` -> ``swarmgrad.my_script``).
    """
    if not name or name == ROOT_LOGGER_NAME:
        return logging.getLogger(ROOT_LOGGER_NAME)
    if name.startswith(ROOT_LOGGER_NAME + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT_LOGGER_NAME}.{name}")


class _SwarmgradHandler(logging.StreamHandler):
    """Marks the handler installed by use_swarmgrad_log_handler, so it is installed once."""


def use_swarmgrad_log_handler(
    level: int | str = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Print swarmgrad's log records at ``level`` and above to ``stream`` (stderr by
    default), one readable line each. For command-line programs; the library never calls
    it. Calling it again replaces the previous handler instead of adding a second one.

    Records stop propagating to the root logger meanwhile, so they are not shown twice.
    """
    if isinstance(level, str):
        levels = logging.getLevelNamesMapping()
        if level.upper() not in levels:
            raise ValueError(f"unknown log level {level!r}; expected one of {sorted(levels)}")
        level = levels[level.upper()]
    root = logging.getLogger(ROOT_LOGGER_NAME)
    for handler in list(root.handlers):
        if isinstance(handler, _SwarmgradHandler):
            root.removeHandler(handler)
    handler = _SwarmgradHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return handler


def use_hivemind_log_handler(where: str) -> None:
    """hivemind's switch (minimal here; the hivemind-compatibility branch has the full
    one): ``"in_hivemind"`` prints swarmgrad's records, ``"in_root_logger"`` prints every
    record of the program (the readable handler on the root logger), ``"nowhere"`` leaves
    logging to the application."""
    ours, root = logging.getLogger(ROOT_LOGGER_NAME), logging.getLogger()
    for logger in (ours, root):
        for handler in list(logger.handlers):
            if isinstance(handler, _SwarmgradHandler):
                logger.removeHandler(handler)
    if where == "in_hivemind":
        use_swarmgrad_log_handler(logging.INFO)
    elif where == "in_root_logger":
        handler = _SwarmgradHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        ours.propagate = True
    elif where == "nowhere":
        ours.propagate = True
    else:
        raise ValueError(
            f"unknown log handler mode {where!r}; expected in_hivemind, in_root_logger or nowhere"
        )
