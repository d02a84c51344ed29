"""The error an adapter raises when its framework is not installed.

An ``ImportError`` deep inside ``lightning`` or ``transformers`` says what is missing
but not how to get it; this one names the extra of swarmgrad that installs it.
"""

from __future__ import annotations

from swarmgrad.utils.errors import SwarmgradError

__all__ = ["MissingExtraError", "missing_extra"]


class MissingExtraError(SwarmgradError, ImportError):
    """An optional adapter was imported without the framework it adapts."""


def missing_extra(extra: str, module: str, cause: ImportError) -> MissingExtraError:
    """The error for ``module`` failing to import because of ``cause``."""
    return MissingExtraError(
        f"{module} needs the '{extra}' extra: pip install 'swarmgrad[{extra}]' "
        f"({type(cause).__name__}: {cause})"
    )
