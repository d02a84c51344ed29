"""Threads the library starts follow ``torch.set_num_threads``, as torch's own threads do.

PyTorch keeps the intra-op thread count per thread: ``torch.set_num_threads(n)`` sets the
process-wide count and OpenMP's and MKL's counts *for the calling thread*; another thread
takes the count over only when it first runs a parallel ATen kernel or asks
``torch.get_num_threads()``. A thread that only calls MKL directly on small tensors (a
matrix product: CenteredClip's Gram matrix, an expert's linear layer at batch 1) never
does, and MKL there runs a team of OpenMP threads the size of the machine. On the shared
2-core box, with ``torch.set_num_threads(1)`` in the main thread, an 8 x 300 Gram matrix
took 14 ms (median; up to 66 ms) on the event-loop thread against 25 us after this call:
the team's spin barrier waits for cores that the peers' threads hold. Since the loop is
the process's one event loop, that wait stalled every peer: it was most of the robust
rule's round-time cost (``robust_overhead``, benchmarks/byzantine.py).
"""

from __future__ import annotations

import sys

__all__ = ["follow_torch_threads"]


def follow_torch_threads() -> None:
    """Give the calling thread torch's intra-op thread count (OpenMP's and MKL's, as
    ``torch.set_num_threads`` set it, or torch's default). Call it first in a thread
    that may run torch kernels. Where torch is not imported yet (a DHT-only peer), it does
    nothing rather than import it (torch costs a peer 130 MB of its own memory); code
    that brings tensors to the thread later calls it again (the averager does)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.get_num_threads()  # runs torch's per-thread set-up (at::init_num_threads)
