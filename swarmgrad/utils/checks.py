"""Argument checkers shared by every component's options.

Each checker takes the option's name and its value, returns the value in its canonical
type, and raises :class:`ValidationError` naming the option and what was expected. They
refuse ``bool`` where a number is asked for (``True`` is an ``int`` in Python, and a flag
passed in a number's place is a caller's mistake) and NaN or infinity where a finite
number is asked for (NaN passes ``value <= 0``).
"""

from __future__ import annotations

import math
from typing import Any

from swarmgrad.utils.errors import ValidationError


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def positive_int(name: str, value: Any) -> int:
    """An ``int`` greater than zero."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValidationError(f"{name} must be a positive int, got {value!r}")
    return value


def int_at_least(name: str, value: Any, low: int) -> int:
    """An ``int`` of ``low`` or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValidationError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    """An ``int`` of zero or more."""
    return int_at_least(name, value, 0)


def positive_number(name: str, value: Any) -> float:
    """A finite number greater than zero."""
    if not _is_number(value) or not 0 < value < math.inf:
        raise ValidationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def non_negative_number(name: str, value: Any) -> float:
    """A finite number of zero or more."""
    if not _is_number(value) or not 0 <= value < math.inf:
        raise ValidationError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def number_at_least(name: str, value: Any, low: float) -> float:
    """A number of ``low`` or more; infinity passes (a bound that never binds)."""
    if not _is_number(value) or not value >= low:
        raise ValidationError(f"{name} must be a number >= {low:g}, got {value!r}")
    return float(value)


def positive_seconds(name: str, value: Any) -> float:
    """A finite positive duration in seconds."""
    if not _is_number(value) or not 0 < value < math.inf:
        raise ValidationError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def optional_positive_seconds(name: str, value: Any) -> float | None:
    """``None`` (no limit) or a finite positive duration in seconds."""
    if value is None:
        return None
    if not _is_number(value) or not 0 < value < math.inf:
        raise ValidationError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def fraction(name: str, value: Any, *, low_open: bool = False, high_open: bool = False) -> float:
    """A number in [0, 1]; ``low_open``/``high_open`` exclude the ends."""
    ok = _is_number(value) and math.isfinite(value)
    if ok:
        ok = (0 < value if low_open else 0 <= value) and (value < 1 if high_open else value <= 1)
    if not ok:
        low, high = "(" if low_open else "[", ")" if high_open else "]"
        raise ValidationError(f"{name} must be a number in {low}0, 1{high}, got {value!r}")
    return float(value)


def one_of(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """One of ``choices``."""
    if value not in choices:
        raise ValidationError(f"{name} must be one of {choices!r}, got {value!r}")
    return value


def check_peer_role(*, client_mode: bool, auxiliary: bool) -> None:
    """The one rule for the two roles a peer may ask for: an auxiliary peer reduces others'
    parts, so it must accept connections, which a client-mode peer cannot."""
    if client_mode and auxiliary:
        raise ValidationError(
            "client_mode=True and auxiliary=True conflict: an auxiliary peer reduces others' "
            "parts, so it must accept connections (auxiliary=True needs client_mode=False)"
        )


__all__ = [
    "check_peer_role",
    "fraction",
    "int_at_least",
    "non_negative_int",
    "non_negative_number",
    "number_at_least",
    "one_of",
    "optional_positive_seconds",
    "positive_int",
    "positive_number",
    "positive_seconds",
]
