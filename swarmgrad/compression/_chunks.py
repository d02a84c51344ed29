"""Chunked traversal and random sampling of large tensors for the codecs.

Codecs process a tensor in chunks of a few megabytes so their temporaries are allocated
once per call and stay warm in cache, instead of allocating (and page-faulting) several
full-size intermediates. Each chunk is still processed with torch ops, which use torch's
intra-op threads and release the GIL. Chunks are not smaller because every torch op is a
parallel region whose start and end cost a synchronisation of the threads, which gets
expensive when other processes compete for the cores.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

#: Elements per chunk: 4 MiB of float32.
CHUNK_NUMEL = 1 << 20


def spans(numel: int, chunk: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks covering ``range(numel)``."""
    chunk = chunk or CHUNK_NUMEL
    for start in range(0, numel, chunk):
        yield start, min(start + chunk, numel)


def _float32_windows(
    tensor: torch.Tensor, chunk: int | None
) -> Iterator[tuple[int, int, torch.Tensor, bool]]:
    """``(start, stop, window, is_view)``: a float32 window on ``tensor[start:stop]``, a view
    of it when ``tensor`` is float32 (``is_view``), else a slice of one reused scratch buffer."""
    chunk = chunk or CHUNK_NUMEL
    is_view = tensor.dtype == torch.float32
    scratch = None if is_view else torch.empty(min(chunk, tensor.numel()), dtype=torch.float32)
    for start, stop in spans(tensor.numel(), chunk):
        window = tensor[start:stop] if scratch is None else scratch[: stop - start]
        yield start, stop, window, is_view


def float32_inputs(
    flat: torch.Tensor, chunk: int | None = None
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, stop, values)`` with ``values`` a float32 view of ``flat[start:stop]``.

    A float32 tensor is viewed directly; other dtypes are converted through one reused
    scratch buffer, so a yielded chunk is only valid until the next one is requested.
    """
    for start, stop, values, is_view in _float32_windows(flat, chunk):
        if not is_view:
            values.copy_(flat[start:stop])
        yield start, stop, values


def float32_outputs(
    out: torch.Tensor, chunk: int | None = None
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, stop, target)``: a float32 chunk the caller fills for ``out[start:stop]``.

    For a float32 ``out`` the target is a view into it; otherwise it is a reused scratch
    buffer that is converted into ``out`` when the caller asks for the next chunk.
    """
    for start, stop, target, is_view in _float32_windows(out, chunk):
        yield start, stop, target
        if not is_view:
            out[start:stop].copy_(target)


def block_groups(start: int, stop: int, block: int) -> list[tuple[int, int, int]]:
    """Split ``[start, stop)`` (``start`` on a block boundary) into the run of whole blocks
    and a final partial block: ``(first, last, number_of_blocks)`` for each non-empty one."""
    whole_stop = start + (stop - start) // block * block
    groups = []
    if whole_stop > start:
        groups.append((start, whole_stop, (whole_stop - start) // block))
    if stop > whole_stop:
        groups.append((whole_stop, stop, 1))
    return groups


def row_blocks(
    rows: int, cols: int, chunk: int | None = None
) -> Iterator[tuple[int, int, int, int]]:
    """``(row_start, row_stop, col_start, col_stop)`` of blocks of at most ``chunk`` elements
    covering a ``rows x cols`` matrix: whole rows grouped when rows are short, else pieces
    of one row."""
    chunk = chunk or CHUNK_NUMEL
    if cols >= chunk:
        for row in range(rows):
            for col_start, col_stop in spans(cols, chunk):
                yield row, row + 1, col_start, col_stop
    else:
        per_block = max(1, chunk // max(cols, 1))
        for row_start, row_stop in spans(rows, per_block):
            yield row_start, row_stop, 0, cols


_SAMPLE_SEED = 0x5EED


@functools.lru_cache(maxsize=16)
def random_sample_indices(numel: int, size: int) -> np.ndarray:
    """Indices of a fixed-seed random sample (with replacement) of ``size`` out of
    ``numel`` elements, or of all of them when there are at most ``size`` (read-only).

    Cached: a round encodes the same part sizes over and over (8 peers averaging 16M
    values: each encodes 32 parts of 2 MB per round, each drawing the same 64k indices),
    and the seed is fixed, so the draw is the same each time."""
    if numel <= size:
        indices = np.arange(numel)
    else:
        indices = np.random.default_rng(_SAMPLE_SEED).integers(0, numel, size)
    indices.flags.writeable = False
    return indices


def sample_values(flat: torch.Tensor, indices: np.ndarray) -> np.ndarray:
    """``flat[indices]`` as a float32 numpy array (sample-sized work is done in numpy: for
    arrays this small, torch's thread synchronisation costs more than the work)."""
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16
        return flat[torch.tensor(indices)].float().numpy()  # (the cached indices are read-only)
    return flat.numpy()[indices].astype(np.float32)
