"""A fast fingerprint of tensors' bytes, for telling equal training states apart.

Peers share these digests in each round to skip a state round when everyone already
holds the same state (``TrainingStateAverager.state_digest``) and to see DiLoCo copies
that drifted apart. The digest is a consistency check, not a security one: a dishonest
peer can simply claim the digest the others share, so a cryptographic hash buys nothing
here. It does cost: blake2b over a 9.45M-parameter model with its Adam moments
(113 MB) took 0.2-0.3 s per epoch on the 2-core box, in the training thread, against
14-30 ms for XXH3-128 (see docs/design-notes.md, "The state digest")."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash


class TensorDigest:
    """Feed tensors (their dtype, shape and bytes) and other bytes; read a 16-byte digest."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()

    def update_bytes(self, data: bytes) -> None:
        self._hash.update(data)

    @torch.no_grad()
    def update_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            self._hash.update(str((flat.dtype, tuple(tensor.shape))).encode())
            self._hash.update(flat.view(torch.uint8).numpy())

    def digest(self) -> bytes:
        return self._hash.digest()
