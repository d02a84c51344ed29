"""Nested structures of lists, tuples, dicts and leaves: flatten, rebuild, map.

hivemind's helpers (``hivemind.utils.nested_*``), used by expert schemas and by programs
that pass nested tensors around. Dicts are walked in sorted key order, so the flat order
does not depend on insertion order; namedtuples are rebuilt as their own type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["nested_compare", "nested_flatten", "nested_map", "nested_pack"]


def nested_flatten(t: Any) -> Iterator[Any]:
    """The leaves of ``t`` in order (dicts by sorted key)."""
    if isinstance(t, list | tuple):
        for x in t:
            yield from nested_flatten(x)
    elif isinstance(t, dict):
        for _, v in sorted(t.items(), key=lambda kv: kv[0]):
            yield from nested_flatten(v)
    else:
        yield t


def nested_pack(flat: Iterable[Any], structure: Any) -> Any:
    """Rebuild ``structure``'s shape from the leaves ``flat`` (as produced by
    :func:`nested_flatten`). ``ValueError`` if ``flat`` has too few or too many leaves."""
    leaves = iter(flat)
    packed = _pack(leaves, structure)
    extra = next(leaves, _END)
    if extra is not _END:
        raise ValueError("nested_pack: more leaves than the structure has places for")
    return packed


_END = object()


def _pack(leaves: Iterator[Any], structure: Any) -> Any:
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):  # namedtuple
        return type(structure)(*(_pack(leaves, x) for x in structure))
    if isinstance(structure, list | tuple):
        return type(structure)(_pack(leaves, x) for x in structure)
    if isinstance(structure, dict):
        return {k: _pack(leaves, v) for k, v in sorted(structure.items(), key=lambda kv: kv[0])}
    leaf = next(leaves, _END)
    if leaf is _END:
        raise ValueError("nested_pack: fewer leaves than the structure has places for")
    return leaf


def nested_compare(t: Any, u: Any) -> bool:
    """Whether ``t`` and ``u`` have the same nesting (types, lengths, dict keys)."""
    if isinstance(t, list | tuple):
        if not isinstance(u, type(t)) or len(t) != len(u):
            return False
        return all(nested_compare(a, b) for a, b in zip(t, u, strict=True))
    if isinstance(t, dict):
        if not isinstance(u, dict) or set(t) != set(u):
            return False
        return all(nested_compare(t[k], u[k]) for k in t)
    return True


def nested_map(fn: Callable, *t: Any) -> Any:
    """``fn`` applied leaf by leaf to structures of the same shape, in that shape."""
    if not t:
        raise ValueError("nested_map needs at least one structure")
    for i, other in enumerate(t[1:], start=1):
        if not nested_compare(t[0], other):
            raise ValueError(f"nested_map: structure #{i} does not match structure #0")
    flat = [list(nested_flatten(x)) for x in t]
    return nested_pack(map(fn, *flat), t[0])
