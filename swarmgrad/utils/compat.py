"""Members that hivemind programs may touch but that have no swarmgrad counterpart.

:func:`unsupported` makes a method that raises ``NotImplementedError`` saying what to use
instead, and marks it (``__hivemind_unsupported__``) so that ``benchmarks/hivemind_api.py``
and ``docs/hivemind.md`` list it as "raises, with the replacement", not as supported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["unsupported"]


def unsupported(qualname: str, instead: str, *, is_async: bool = False) -> Callable[..., Any]:
    """A method named ``qualname`` that raises ``NotImplementedError(instead)``."""
    message = f"{qualname} is hivemind machinery that swarmgrad does not have: {instead}"

    def method(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    if is_async:

        @functools.wraps(method)
        async def async_method(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(message)

        result: Callable[..., Any] = async_method
    else:
        result = method
    result.__name__ = qualname.rpartition(".")[2]
    result.__qualname__ = qualname
    result.__doc__ = f"Not in swarmgrad: {instead}"
    result.__hivemind_unsupported__ = instead  # type: ignore[attr-defined]
    return result
