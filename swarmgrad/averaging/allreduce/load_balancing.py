"""How many elements of the averaged vector each group member reduces.

In a butterfly all-reduce over ``n`` members, the member that owns a fraction ``x`` of the
vector receives that fraction from every other sender and sends the average back to each
of them, while as a sender it ships the other ``1 - x`` of its own vector away and gets
it back averaged. With ``S`` senders, the bytes through member ``i`` in each direction are
(in units of the vector size)::

    load_i = s_i * (1 - x_i) + x_i * (S - s_i)        s_i = 1 if i sends, else 0

and its time is ``load_i / bandwidth_i``. The round lasts as long as its slowest member,
so the shares minimize ``max_i load_i / bandwidth_i``: a linear program, solved with
SciPy's HiGHS (hivemind solved the same problem with an interior-point method SciPy has
since removed). Many plans are often equally fast (with two senders every split is): at
the best time each share may lie anywhere in an interval, and the plan takes shares
proportional to bandwidth clipped to those intervals, which is unique and gives a faster
member never less than a slower one. Shares are then rounded to whole elements; shares
below ``min_size`` are dropped one at a time (the smallest first) and the program solved
again without them, since a tiny span costs a round trip per part and saves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import linprog

from swarmgrad.utils.errors import ValidationError

__all__ = ["load_balance_peers", "optimize_parts_lp"]

_TIE_TOLERANCE = 1e-9


def load_balance_peers(
    vector_size: int,
    bandwidths: Sequence[float | None],
    min_size: int = 0,
    *,
    senders: Sequence[bool] | None = None,
) -> tuple[int, ...]:
    """Number of elements each member reduces; the numbers sum to ``vector_size``.

    ``bandwidths[i]`` is member ``i``'s announced bandwidth (any unit, the same for all);
    ``None`` means unknown and counts as the mean of the known ones; ``0`` marks a
    client-mode member, which reduces nothing. ``senders[i]`` is False for an auxiliary
    member, which reduces but sends no tensors of its own (default: everyone sends).
    """
    if type(vector_size) is not int or vector_size < 0:
        raise ValidationError(f"vector_size must be a non-negative integer, got {vector_size!r}")
    if type(min_size) is not int or min_size < 0:
        raise ValidationError(f"min_size must be a non-negative integer, got {min_size!r}")
    known = _check_bandwidths(bandwidths)
    if senders is None:
        senders = [True] * len(known)
    elif len(senders) != len(known):
        raise ValidationError(f"{len(senders)} sender flags for {len(known)} bandwidths")
    filled = _fill_unknown(known)
    reducers = [b > 0 for b in filled]
    if not any(reducers):
        raise ValidationError(
            "no member can reduce: every bandwidth is 0 (client mode); at least one member "
            "must accept incoming parts"
        )
    if vector_size == 0:
        return (0,) * len(filled)
    while True:
        active = [b if ok else 0.0 for b, ok in zip(filled, reducers, strict=True)]
        fractions = optimize_parts_lp(active, [bool(s) for s in senders])
        sizes = _round_to_elements(fractions, vector_size)
        too_small = [i for i, size in enumerate(sizes) if 0 < size < min_size]
        if not too_small:
            return sizes
        if sum(1 for size in sizes if size > 0) == 1:
            return sizes  # a single owner cannot be dropped: it takes the whole vector
        # Drop the smallest share (the later member on ties) and solve again.
        reducers[min(too_small, key=lambda i: (sizes[i], -i))] = False


def optimize_parts_lp(bandwidths: Sequence[float], senders: Sequence[bool]) -> list[float]:
    """Fractions of the vector per member (summing to 1) that minimize the slowest
    member's time; members with bandwidth 0 get 0. See the module docstring."""
    n = len(bandwidths)
    reducers = [i for i, b in enumerate(bandwidths) if b > 0]
    if len(reducers) == 1:
        return [1.0 if i == reducers[0] else 0.0 for i in range(n)]
    if sum(senders) >= 2 and all(senders[i] for i in reducers):
        if len({bandwidths[i] for i in reducers}) == 1:
            # Equal reducers that all send: equal shares are optimal (each one's load grows
            # with its share at the same rate) and the closest to proportional. No solver.
            return [1.0 / len(reducers) if bandwidths[i] > 0 else 0.0 for i in range(n)]
    scale = max(bandwidths)
    b = np.array([bw / scale for bw in bandwidths], dtype=np.float64)
    s = np.array([1.0 if flag else 0.0 for flag in senders], dtype=np.float64)
    num_senders = s.sum()

    # Variables: x_0..x_{n-1}, t. Constraint per reducer: s_i + x_i (S - 2 s_i) <= b_i t.
    rows, rhs = [], []
    for i in reducers:
        row = np.zeros(n + 1)
        row[i] = num_senders - 2 * s[i]
        row[n] = -b[i]
        rows.append(row)
        rhs.append(-s[i])
    a_ub, b_ub = np.array(rows), np.array(rhs)
    a_eq = np.zeros((1, n + 1))
    a_eq[0, :n] = 1.0
    bounds = [(0.0, 1.0) if bandwidths[i] > 0 else (0.0, 0.0) for i in range(n)] + [(0, None)]
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    first = linprog(
        cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs"
    )
    if not first.success:  # numerically hopeless (e.g. bandwidths 1e9 apart)
        return (b / b.sum()).tolist()
    best_time = first.x[n] * (1 + _TIE_TOLERANCE) + _TIE_TOLERANCE

    # At the best time each share may lie anywhere in an interval [low, high]; take the
    # shares proportional to bandwidth, clipped to those intervals (water-filling).
    low, high = np.zeros(n), np.zeros(n)
    for i in reducers:
        coefficient, room = num_senders - 2 * s[i], b[i] * best_time - s[i]
        low[i], high[i] = 0.0, 1.0
        if coefficient > 0:
            high[i] = min(1.0, max(room / coefficient, 0.0))
        elif coefficient < 0:
            low[i] = min(1.0, max(room / coefficient, 0.0))
    if not low.sum() <= 1.0 <= high.sum():
        return first.x[:n].clip(0.0, None).tolist()
    lo_scale, hi_scale = 0.0, 1.0
    while np.clip(hi_scale * b, low, high).sum() < 1.0:
        hi_scale *= 2.0
    for _ in range(200):
        middle = (lo_scale + hi_scale) / 2
        if np.clip(middle * b, low, high).sum() < 1.0:
            lo_scale = middle
        else:
            hi_scale = middle
    x = np.clip(hi_scale * b, low, high)
    return (x / x.sum()).tolist()


def _check_bandwidths(bandwidths: Sequence[float | None]) -> list[float | None]:
    if len(bandwidths) == 0:
        raise ValidationError("load balancing needs at least one member")
    checked: list[float | None] = []
    for i, value in enumerate(bandwidths):
        if value is None:
            checked.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValidationError(f"bandwidth of member {i} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValidationError(f"bandwidth of member {i} must be finite and >= 0, got {value!r}")
        checked.append(float(value))
    return checked


def _fill_unknown(bandwidths: list[float | None]) -> list[float]:
    """Unknown bandwidths count as the mean of the known non-client ones (1 if none)."""
    known = [b for b in bandwidths if b is not None and b > 0]
    mean = sum(known) / len(known) if known else 1.0
    return [mean if b is None else b for b in bandwidths]


def _round_to_elements(fractions: Sequence[float], vector_size: int) -> tuple[int, ...]:
    """Whole elements per member summing exactly to vector_size (largest remainders)."""
    exact = [f * vector_size for f in fractions]
    sizes = [math.floor(e) for e in exact]
    leftover = vector_size - sum(sizes)
    order = sorted(
        (i for i, f in enumerate(fractions) if f > 0), key=lambda i: (-(exact[i] - sizes[i]), i)
    )
    for i in order[:leftover]:
        sizes[i] += 1
    # float error could leave a few elements unassigned if few members have f > 0
    sizes[order[0] if order else 0] += vector_size - sum(sizes)
    return tuple(sizes)
