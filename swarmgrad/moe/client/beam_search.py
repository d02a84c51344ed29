"""Find the best live experts of a grid by beam search over the DHT's prefix records.

An expert ``"ffn.3.17"`` on a 2-d grid is announced under the prefixes ``"ffn."`` and
``"ffn.3."`` (:mod:`swarmgrad.moe.dht_records`): each prefix record lists the live next
coordinates, and at the last level which servers host each uid. A sample's score for an
expert is the sum of its gate scores along the grid dimensions, so the search walks the
grid one dimension at a time: it keeps the ``beam_size`` best-scoring prefixes that are
still alive, then extends them by the next coordinate. On a grid whose live experts form
a product of per-dimension sets (a full grid, or one with whole rows missing), this finds
exactly the ``beam_size`` best experts; on a ragged grid it is an approximation, as in
hivemind.

A batch shares its lookups: each level fetches the union of the prefixes its samples
need, once. Prefix records are kept in a local cache for ``prefix_cache_ttl`` seconds,
so consecutive training steps do not query the DHT at all; a prefix found empty (its
parent still listed it) is skipped for ``cache_expiration`` seconds when
``negative_caching`` is on (never the grid's root prefix: an empty-looking grid is asked
again on the next search).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarmgrad.dht.dht import DHT
from swarmgrad.moe.dht_records import parse_prefix_entries, remember_addresses
from swarmgrad.moe.expert_uid import UID_DELIMITER, ExpertInfo, ExpertPrefix, normalize_prefix
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import run_coroutine, run_coroutine_future

__all__ = ["MoEBeamSearcher", "PrefixLevel"]

_MISSING = object()


@dataclass(frozen=True, eq=False)
class PrefixLevel:
    """What one prefix record says: its live next coordinates (inside the grid) and what
    each leads to, a longer prefix or, at the last grid dimension, an expert."""

    prefix: ExpertPrefix
    coords: np.ndarray  # int64, ascending
    children: tuple[Any, ...]  # ExpertPrefix per coordinate, or ExpertInfo at the last level


class MoEBeamSearcher:
    """Beam search for the experts of the grid ``uid_prefix`` x ``grid_size``.

    :param dht: a running ``DHT`` (or a ``DHTNode`` when used from coroutines)
    :param uid_prefix: the grid's name, with or without the trailing ``"."``
    :param grid_size: the number of coordinates along each grid dimension
    :param num_workers: the most prefixes fetched from the DHT in one request batch
    :param negative_caching: remember prefixes found empty for ``cache_expiration`` s
    :param prefix_cache_ttl: seconds a fetched prefix record is reused without asking
        the DHT again (new and vanished experts show up after at most this long)
    """

    def __init__(
        self,
        dht: Any,
        uid_prefix: str,
        grid_size: Sequence[int],
        num_workers: int | None = None,
        negative_caching: bool = True,
        cache_expiration: float = 300.0,
        *,
        prefix_cache_ttl: float = 2.0,
        max_cache_entries: int = 100_000,
    ):
        grid_size = tuple(grid_size)
        if not grid_size or not all(isinstance(n, int) and n > 0 for n in grid_size):
            raise ValidationError(f"grid_size must be positive ints, got {grid_size!r}")
        if num_workers is not None:
            positive_int("num_workers", num_workers)
        self.dht = dht
        self.uid_prefix = normalize_prefix(uid_prefix)
        self.grid_size = grid_size
        self.num_workers = num_workers
        self.negative_caching, self.cache_expiration = negative_caching, cache_expiration
        self.prefix_cache_ttl = prefix_cache_ttl
        self.max_cache_entries = max_cache_entries
        self._cache: dict[ExpertPrefix, tuple[float, PrefixLevel | None]] = {}
        self.fetched_prefixes = 0  # statistics: prefixes asked from the DHT

    # ------------------------------------------------------------------ public API

    def find_best_experts(
        self, grid_scores: Sequence[Any], beam_size: int, return_future: bool = False
    ) -> list[ExpertInfo] | concurrent.futures.Future:
        """The ``beam_size`` best live experts for one sample, best first;
        ``grid_scores[d]`` holds the scores of every coordinate of dimension ``d``."""
        scores = [np.asarray(_to_numpy(s), dtype=np.float64)[None] for s in grid_scores]

        async def search() -> list[ExpertInfo]:
            return (await self.batch_find_best_experts_async(scores, beam_size))[0]

        return run_coroutine_future(search()) if return_future else run_coroutine(search())

    def batch_find_best_experts(
        self, batch_grid_scores: Sequence[Any], beam_size: int, return_future: bool = False
    ) -> list[list[ExpertInfo]] | concurrent.futures.Future:
        """For each sample, its ``beam_size`` best live experts, best first;
        ``batch_grid_scores[d]`` is a ``[batch, grid_size[d]]`` array of scores."""
        coro = self.batch_find_best_experts_async(batch_grid_scores, beam_size)
        return run_coroutine_future(coro) if return_future else run_coroutine(coro)

    async def batch_find_best_experts_async(
        self, batch_grid_scores: Sequence[Any], beam_size: int
    ) -> list[list[ExpertInfo]]:
        ranked = await self.search(batch_grid_scores, beam_size)
        return [[info for _, info in sample] for sample in ranked]

    async def search(
        self, batch_grid_scores: Sequence[Any], beam_size: int, num_results: int | None = None
    ) -> list[list[tuple[float, ExpertInfo]]]:
        """For each sample, up to ``num_results`` (default ``beam_size``) live experts as
        (score, info), best first. The ones past ``beam_size`` come from the same final
        beam at no extra cost: the MoE layers fall back on them when chosen experts fail."""
        positive_int("beam_size", beam_size)
        num_results = beam_size if num_results is None else max(num_results, beam_size)
        scores = self._check_scores(batch_grid_scores)
        batch_size = scores[0].shape[0]
        if batch_size == 0:
            return []
        node = self._node()
        root = (await self._fetch(node, [self.uid_prefix], 0))[self.uid_prefix]
        if root is None:
            return [[] for _ in range(batch_size)]
        beams: list[list[tuple[float, PrefixLevel]]] = [[(0.0, root)] for _ in range(batch_size)]
        last = len(self.grid_size) - 1
        for dim in range(last):
            ranked = _Ranked(beams, scores[dim], head=2 * beam_size)
            beams = await self._next_beams(node, ranked, beam_size, dim + 1)
        ranked = _Ranked(beams, scores[last], head=num_results)
        return [ranked.best(s, min(num_results, count)) for s, count in enumerate(ranked.counts)]

    def clear_cache(self) -> None:
        self._cache.clear()

    # ------------------------------------------------------------------ one level

    async def _next_beams(
        self, node: Any, ranked: _Ranked, beam_size: int, level: int
    ) -> list[list[tuple[float, PrefixLevel]]]:
        """Walk each sample's ranked candidate prefixes, fetching the unknown ones for all
        samples together, until each has ``beam_size`` live ones or runs out."""
        known: dict[ExpertPrefix, PrefixLevel | None] = {}
        beams: list[list[tuple[float, PrefixLevel]]] = [[] for _ in ranked.counts]
        positions = [0] * len(beams)
        while True:
            wanted: set[ExpertPrefix] = set()
            for s, end in enumerate(ranked.counts):
                beam, pos = beams[s], positions[s]
                if len(beam) >= beam_size or pos >= end:
                    continue
                head, scores = ranked.head_children(s), ranked.scores[s]
                while len(beam) < beam_size and pos < end:  # take what is known
                    child = head[pos] if pos < len(head) else ranked.child(s, pos)
                    found = known.get(child, _MISSING)
                    if found is _MISSING:
                        break
                    if found is not None:
                        score = scores[pos] if pos < len(head) else ranked.score(s, pos)
                        beam.append((score, found))
                    pos += 1
                positions[s] = pos
                deficit = beam_size - len(beam)
                while deficit > 0 and pos < end:  # then ask for as many as still needed
                    child = head[pos] if pos < len(head) else ranked.child(s, pos)
                    if known.get(child, _MISSING) is not None:  # unknown, or known alive
                        deficit -= 1
                        if child not in known:
                            wanted.add(child)
                    pos += 1
            if not wanted:
                return beams
            known.update(await self._fetch(node, wanted, level))

    # ------------------------------------------------------------------ fetching

    def _node(self) -> Any:
        if isinstance(self.dht, DHT):
            if self.dht.node is None:
                raise ValidationError("the DHT is not running: start it before the beam search")
            return self.dht.node
        return self.dht

    async def _fetch(
        self, node: Any, prefixes: Iterable[ExpertPrefix], level: int
    ) -> dict[ExpertPrefix, PrefixLevel | None]:
        """Prefix records from the local cache, or the DHT for the expired or unknown."""
        now = time.monotonic()
        found: dict[ExpertPrefix, PrefixLevel | None] = {}
        missing = []
        for prefix in prefixes:
            cached = self._cache.get(prefix)
            if cached is not None and cached[0] > now:
                found[prefix] = cached[1]
            else:
                missing.append(prefix)
        if not missing:
            return found
        self.fetched_prefixes += len(missing)
        chunk = self.num_workers or len(missing)
        records: dict[ExpertPrefix, Any] = {}
        for parts in await asyncio.gather(
            *(node.get_many(missing[i : i + chunk]) for i in range(0, len(missing), chunk))
        ):
            records.update(parts)
        now = time.monotonic()
        if len(self._cache) + len(missing) > self.max_cache_entries:
            self._cache = {p: e for p, e in self._cache.items() if e[0] > now}
            if len(self._cache) + len(missing) > self.max_cache_entries:
                self._cache.clear()
        for prefix in missing:
            parsed = self._parse(node, prefix, records.get(prefix), level)
            found[prefix] = parsed
            if parsed is not None:
                self._cache[prefix] = (now + self.prefix_cache_ttl, parsed)
            elif self.negative_caching and prefix != self.uid_prefix:
                # (never the grid's root: a grid that looks empty is asked again next time)
                self._cache[prefix] = (now + self.cache_expiration, None)
        return found

    def _parse(self, node: Any, prefix: ExpertPrefix, record: Any, level: int):
        entries = parse_prefix_entries(prefix, record)
        size, last = self.grid_size[level], level == len(self.grid_size) - 1
        coords, children = [], []
        for coord in sorted(entries):
            if coord >= size:
                continue  # declared outside this grid
            if not last:
                coords.append(coord)
                children.append(f"{prefix}{coord}{UID_DELIMITER}")
                continue
            uid = f"{prefix}{coord}"
            servers = tuple(dict.fromkeys(s for u, s in entries[coord] if u == uid))
            if servers:  # (an entry naming a deeper uid is not an expert of this grid)
                coords.append(coord)
                children.append(ExpertInfo(uid, servers))
        if not coords:
            return None
        if last:
            remember_addresses(node, children)
        return PrefixLevel(prefix, np.asarray(coords, dtype=np.int64), tuple(children))

    def _check_scores(self, batch_grid_scores: Sequence[Any]) -> list[np.ndarray]:
        if len(batch_grid_scores) != len(self.grid_size):
            raise ValidationError(
                f"expected scores for {len(self.grid_size)} grid dimensions, "
                f"got {len(batch_grid_scores)}"
            )
        scores = [np.asarray(_to_numpy(s), dtype=np.float64) for s in batch_grid_scores]
        batch_size = scores[0].shape[0] if scores[0].ndim == 2 else -1
        for dim, (array, size) in enumerate(zip(scores, self.grid_size, strict=True)):
            if array.ndim != 2 or array.shape != (batch_size, size):
                raise ValidationError(
                    f"grid scores of dimension {dim}: expected shape [batch, {size}] with the "
                    f"same batch for every dimension, got {list(array.shape)}"
                )
        return scores


class _Ranked:
    """Every sample's extensions of its beam by one coordinate, best first, computed for
    the whole batch with a few array operations.

    Candidate ``(k, c)`` of sample ``s`` extends the ``k``-th prefix of its beam by that
    prefix's ``c``-th live coordinate. Only the ``head`` best of each sample are sorted
    up front; a walk past them (many dead prefixes) sorts that sample's rest on demand.
    Coordinates scored -inf or NaN (dropped out by the switch gate) are left out."""

    def __init__(self, beams: list[list[tuple[float, PrefixLevel]]], scores: np.ndarray, head):
        levels: list[PrefixLevel] = []
        index: dict[int, int] = {}
        width = max(1, max(len(beam) for beam in beams))
        rows, ks, owners, bases = [], [], [], []  # per beam entry of every sample
        for s, beam in enumerate(beams):
            for k, (base, level) in enumerate(beam):
                i = index.get(id(level))
                if i is None:
                    i = index[id(level)] = len(levels)
                    levels.append(level)
                rows.append(s)
                ks.append(k)
                owners.append(i)
                bases.append(base)
        span = max(1, max((len(level.coords) for level in levels), default=1))
        coords = np.zeros((len(levels) + 1, span), dtype=np.int64)  # the last row: padding
        valid = np.zeros((len(levels) + 1, span), dtype=bool)
        for i, level in enumerate(levels):
            coords[i, : len(level.coords)] = level.coords
            valid[i, : len(level.coords)] = True
        batch = len(beams)
        owner = np.full((batch, width), len(levels), dtype=np.int64)
        base = np.zeros((batch, width))
        if rows:
            owner[rows, ks] = owners
            base[rows, ks] = bases
        totals = base[:, :, None] + scores[np.arange(batch)[:, None, None], coords[owner]]
        totals[~valid[owner] | np.isnan(totals)] = -np.inf
        self.flat = totals.reshape(batch, width * span)
        self.counts = np.count_nonzero(self.flat > -np.inf, axis=1).tolist()
        head = min(max(head, 1), self.flat.shape[1])
        if head < self.flat.shape[1]:
            top = np.argpartition(-self.flat, head - 1, axis=1)[:, :head]
            order = np.take_along_axis(
                top, np.argsort(-np.take_along_axis(self.flat, top, 1), axis=1, kind="stable"), 1
            )
        else:
            order = np.argsort(-self.flat, axis=1, kind="stable")
        self.head = head
        self.order = order.tolist()
        self.scores = np.take_along_axis(self.flat, order, 1).tolist()
        self.span, self.owner, self.levels = span, owner.tolist(), levels
        self._rest: dict[int, tuple[list[int], list[float]]] = {}

    def _row(self, s: int, j: int) -> tuple[list[int], list[float], int]:
        """The sorted candidates holding position ``j``, and the position of their first."""
        if j < self.head:
            return self.order[s], self.scores[s], 0
        rest = self._rest.get(s)
        if rest is None:  # everything past the head, in order (ties: the head's choice holds)
            taken = set(self.order[s])
            order = [i for i in np.argsort(-self.flat[s], kind="stable").tolist() if i not in taken]
            rest = self._rest[s] = (order, self.flat[s][order].tolist())
        return rest[0], rest[1], self.head

    def score(self, s: int, j: int) -> float:
        if j < self.head:
            return self.scores[s][j]
        _, scores, first = self._row(s, j)
        return scores[j - first]

    def child(self, s: int, j: int) -> Any:
        """The longer prefix (or the expert) of sample ``s``'s ``j``-th best extension."""
        order, _, first = self._row(s, j)
        k, c = divmod(order[j - first], self.span)
        return self.levels[self.owner[s][k]].children[c]

    def head_children(self, s: int) -> list[Any]:
        """The children of sample ``s``'s ``head`` best extensions, in order."""
        levels, owner, span = self.levels, self.owner[s], self.span
        return [
            levels[owner[index // span]].children[index % span]
            for index in self.order[s][: self.counts[s]]
        ]

    def best(self, s: int, count: int) -> list[tuple[float, Any]]:
        """(score, child) of sample ``s``'s ``count`` best extensions (``count <= head``)."""
        levels, owner, span = self.levels, self.owner[s], self.span
        return [
            (score, levels[owner[index // span]].children[index % span])
            for index, score in zip(self.order[s][:count], self.scores[s][:count], strict=True)
        ]


def _to_numpy(scores: Any) -> Any:
    detach = getattr(scores, "detach", None)
    return detach().cpu().numpy() if detach is not None else scores
