"""Loggers under the ``swarmgrad`` logger, and a readable handler for the CLI.

The library only logs; it installs no handler, so an application's logging setup decides
what is shown (Python prints warnings to stderr when nothing is configured). The CLI calls
:func:`use_swarmgrad_log_handler` once to get readable lines.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from typing import TextIO

__all__ = [
    "ROOT_LOGGER_NAME",
    "CustomFormatter",
    "HandlerMode",
    "TextStyle",
    "get_logger",
    "golog_level_to_python",
    "in_ipython",
    "python_level_to_golog",
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


# ---------------------------------------------------------------- hivemind's names
# ``hivemind.utils.logging`` as hivemind programs use it: the environment variables keep
# hivemind's names so that a swarm's launch scripts work unchanged.

TRUE_CONSTANTS = ["TRUE", "1"]
loglevel = os.getenv("HIVEMIND_LOGLEVEL", "INFO")
use_colors = os.getenv("HIVEMIND_COLORS", "").upper() in TRUE_CONSTANTS or (
    not os.getenv("HIVEMIND_COLORS") and getattr(sys.stderr, "isatty", lambda: False)()
)
always_log_caller = os.getenv("HIVEMIND_ALWAYS_LOG_CALLER", "0").upper() in TRUE_CONSTANTS


def in_ipython() -> bool:
    """Whether this runs inside IPython or Jupyter."""
    try:
        __IPYTHON__  # type: ignore[name-defined]  # noqa: B018
    except NameError:
        return False
    return True


class HandlerMode(enum.Enum):
    """Where :func:`use_hivemind_log_handler` puts the readable handler."""

    NOWHERE = 0
    IN_HIVEMIND = 1
    IN_ROOT_LOGGER = 2


class TextStyle:
    """ANSI styles for log lines (empty strings when colours are off)."""

    RESET = "\033[0m" if use_colors else ""
    BOLD = "\033[1m" if use_colors else ""
    RED = "\033[31m" if use_colors else ""
    BLUE = "\033[34m" if use_colors else ""
    PURPLE = "\033[35m" if use_colors else ""
    ORANGE = "\033[38;5;208m" if use_colors else ""


class CustomFormatter(logging.Formatter):
    """swarmgrad's line format, with the caller's file and line for warnings and errors
    (and for every record when ``HIVEMIND_ALWAYS_LOG_CALLER=1``)."""

    def __init__(self, fmt=None, datefmt=None, style="%", validate=True, *, defaults=None):
        super().__init__(
            fmt or _FORMAT, datefmt or _DATE_FORMAT, style, validate, defaults=defaults
        )

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if always_log_caller or record.levelno >= logging.WARNING:
            text += f" ({record.filename}:{record.lineno})"
        return text


def use_hivemind_log_handler(where: HandlerMode | str) -> None:
    """hivemind's switch for the readable handler: ``"in_hivemind"`` prints swarmgrad's
    records (:func:`use_swarmgrad_log_handler`), ``"in_root_logger"`` puts the handler on
    the root logger so the program's own records are printed the same way, ``"nowhere"``
    removes it (records propagate to whatever the application configured)."""
    if isinstance(where, str):
        try:
            where = HandlerMode[where.upper()]
        except KeyError:
            choices = [m.name.lower() for m in HandlerMode]
            raise ValueError(
                f"unknown log handler mode {where!r}; expected one of {choices}"
            ) from None
    if not isinstance(where, HandlerMode):
        raise TypeError(f"where must be a HandlerMode or its name, got {type(where).__name__}")
    ours = logging.getLogger(ROOT_LOGGER_NAME)
    root = logging.getLogger()
    for logger in (ours, root):
        for handler in list(logger.handlers):
            if isinstance(handler, _SwarmgradHandler):
                logger.removeHandler(handler)
    level = logging.getLevelNamesMapping().get(loglevel.upper(), logging.INFO)
    if where is HandlerMode.NOWHERE:
        ours.propagate = True
    elif where is HandlerMode.IN_HIVEMIND:
        use_swarmgrad_log_handler(level)
    else:
        handler = _SwarmgradHandler(sys.stderr)
        handler.setFormatter(CustomFormatter())
        root.addHandler(handler)
        root.setLevel(level)
        ours.setLevel(level)
        ours.propagate = True


_GOLOG_TO_PYTHON = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "DPANIC": logging.CRITICAL,
    "PANIC": logging.CRITICAL,
    "FATAL": logging.CRITICAL,
}


def golog_level_to_python(level: str) -> int:
    """A Go (libp2p daemon) log level name as a Python level. swarmgrad runs no Go daemon;
    kept for programs that translate ``GOLOG_LOG_LEVEL``."""
    try:
        return _GOLOG_TO_PYTHON[level.upper()]
    except KeyError:
        choices = list(_GOLOG_TO_PYTHON)
        raise ValueError(f"unknown Go log level {level!r}; expected one of {choices}") from None


def python_level_to_golog(level: str) -> str:
    """A Python level name as the Go log level name (``WARNING`` -> ``WARN``)."""
    if not isinstance(level, str):
        raise TypeError(f"level must be a level name (str), got {type(level).__name__}")
    mapping = {"WARNING": "WARN", "CRITICAL": "FATAL"}
    name = level.upper()
    if name not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown Python log level {level!r}")
    return mapping.get(name, name)
