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
``negative_caching`` is on.
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
        if num_workers is not None and num_workers < 1:
            raise ValidationError(f"num_workers must be >= 1, got {num_workers}")
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
        if beam_size < 1:
            raise ValidationError(f"beam_size must be >= 1, got {beam_size}")
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
            ranked = [_Ranked(beam, scores[dim][s]) for s, beam in enumerate(beams)]
            beams = await self._next_beams(node, ranked, beam_size, dim + 1)
        results = []
        for s, beam in enumerate(beams):
            ranked = _Ranked(beam, scores[last][s])
            count = min(num_results, len(ranked))
            results.append([(ranked.scores[j], ranked.child(j)) for j in range(count)])
        return results

    def clear_cache(self) -> None:
        self._cache.clear()

    # ------------------------------------------------------------------ one level

    async def _next_beams(
        self, node: Any, ranked: list[_Ranked], beam_size: int, level: int
    ) -> list[list[tuple[float, PrefixLevel]]]:
        """Walk each sample's ranked candidate prefixes, fetching the unknown ones for all
        samples together, until each has ``beam_size`` live ones or runs out."""
        known: dict[ExpertPrefix, PrefixLevel | None] = {}
        beams: list[list[tuple[float, PrefixLevel]]] = [[] for _ in ranked]
        positions = [0] * len(ranked)
        while True:
            wanted: set[ExpertPrefix] = set()
            for s, candidates in enumerate(ranked):
                beam, pos, end = beams[s], positions[s], len(candidates)
                while len(beam) < beam_size and pos < end:  # take what is known
                    found = known.get(candidates.child(pos), _MISSING)
                    if found is _MISSING:
                        break
                    if found is not None:
                        beam.append((candidates.scores[pos], found))
                    pos += 1
                positions[s] = pos
                deficit = beam_size - len(beam)
                while deficit > 0 and pos < end:  # then ask for as many as still needed
                    child = candidates.child(pos)
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
            elif self.negative_caching:
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
    """Every extension of a beam's prefixes by one coordinate, best first: the sorted
    scores, and for each the beam entry it extends and the child index in that entry.
    Coordinates scored -inf or NaN (dropped out by the switch gate) are left out."""

    __slots__ = ("beam", "children", "owners", "scores")

    def __init__(self, beam: list[tuple[float, PrefixLevel]], dim_scores: np.ndarray):
        self.beam = beam
        if len(beam) == 1:
            base, level = beam[0]
            totals = base + dim_scores[level.coords]
            owners = np.zeros(len(totals), dtype=np.int64)
            children = np.arange(len(totals))
        elif beam:
            totals = np.concatenate([base + dim_scores[level.coords] for base, level in beam])
            sizes = [len(level.coords) for _, level in beam]
            owners = np.repeat(np.arange(len(beam)), sizes)
            children = np.concatenate([np.arange(n) for n in sizes])
        else:
            totals = owners = children = np.empty(0, dtype=np.int64)
        order = np.argsort(-totals, kind="stable")  # NaN sorts last, -inf just before it
        scores = totals[order]
        keep = int(np.count_nonzero(scores > -np.inf))
        self.scores = scores[:keep].tolist()
        self.owners = owners[order[:keep]].tolist()
        self.children = children[order[:keep]].tolist()

    def __len__(self) -> int:
        return len(self.scores)

    def child(self, j: int) -> Any:
        """The longer prefix (or the expert) of the ``j``-th best extension."""
        return self.beam[self.owners[j]][1].children[self.children[j]]


def _to_numpy(scores: Any) -> Any:
    detach = getattr(scores, "detach", None)
    return detach().cpu().numpy() if detach is not None else scores
