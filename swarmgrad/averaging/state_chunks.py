"""A downloadable state cut into verifiable chunks: manifests, donor snapshots, assembly.

A state is ``(metadata, tensors)``. For transfer the tensors are laid end to end as one
flat byte stream (each tensor's own bytes, in order) and cut into chunks of
``chunk_size`` bytes, the last one possibly shorter. A chunk may hold the tail of one
tensor and several small tensors after it, so a model with hundreds of bias vectors is
not hundreds of round trips, and a big tensor is many chunks that can come from
different donors.

The :class:`StateManifest` names the tensors (dtype, shape), the chunk size, the SHA-256
of every chunk and of the msgpack-encoded metadata. Donors whose manifests have the same
layout and the same digest for a chunk hold byte-identical copies of it, so a downloader
may take that chunk from any of them and still check it against the digest.

Nothing here does I/O: :class:`StateSnapshot` is the donor's frozen copy that serves
chunks as zero-copy memoryviews, :class:`StateAssembler` the downloader's destination
tensors that accept only chunks matching the manifest.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmgrad.compression.serialized import MAX_NDIM, dtype_from_name, dtype_name
from swarmgrad.utils.errors import CodecError, ProtocolViolation, ValidationError

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DIGEST_SIZE",
    "CorruptChunk",
    "StateAssembler",
    "StateManifest",
    "StateSnapshot",
    "TensorSpec",
    "freeze_state",
    "pack_metadata",
]

DIGEST_SIZE = 32  # SHA-256
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 1024
MAX_CHUNK_SIZE = 256 * 1024 * 1024
MAX_TENSORS = 1 << 20
DEFAULT_MAX_STATE_BYTES = 1 << 40  # 1 TiB: a bound on what a hostile manifest can make us allocate
MANIFEST_VERSION = 1


class CorruptChunk(ProtocolViolation):
    """A chunk's bytes do not match the manifest (wrong length or wrong digest)."""


def pack_metadata(metadata: Any) -> bytes:
    """msgpack-encode state metadata; a clear error if it cannot be sent."""
    try:
        return msgpack.packb(metadata, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValidationError(f"state metadata must be msgpack-serializable: {e}") from None


def _digest(parts: Sequence[Any]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a state as the manifest describes it."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(tensor.dtype), tuple(tensor.shape))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class StateManifest:
    """What a donor's snapshot holds and how to check every chunk of it."""

    tensors: tuple[TensorSpec, ...]
    chunk_size: int
    chunk_digests: tuple[bytes, ...]
    metadata_digest: bytes
    metadata_size: int

    def __post_init__(self) -> None:
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValidationError(
                f"chunk size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes, "
                f"got {self.chunk_size}"
            )
        expected = -(-self.total_bytes // self.chunk_size)
        if len(self.chunk_digests) != expected:
            raise ValidationError(
                f"a state of {self.total_bytes} bytes in chunks of {self.chunk_size} has "
                f"{expected} chunks, but the manifest lists {len(self.chunk_digests)} digests"
            )

    # ------------------------------------------------------------------ layout

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each tensor in the flat byte stream, plus the total at the end."""
        offsets = [0]
        for spec in self.tensors:
            offsets.append(offsets[-1] + spec.nbytes)
        return tuple(offsets)

    @property
    def total_bytes(self) -> int:
        return self.offsets[-1]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_digests)

    @property
    def layout(self) -> tuple[tuple[TensorSpec, ...], int]:
        """Two manifests with equal layouts cut the same bytes into the same chunks."""
        return self.tensors, self.chunk_size

    @functools.cached_property
    def root_digest(self) -> bytes:
        """One digest for the whole state: equal roots mean byte-identical states."""
        h = hashlib.sha256()
        h.update(msgpack.packb([[[s.dtype, list(s.shape)] for s in self.tensors]]))
        h.update(self.chunk_size.to_bytes(8, "little"))
        h.update(self.metadata_digest)
        for digest in self.chunk_digests:
            h.update(digest)
        return h.digest()

    def chunk_range(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.num_chunks:
            raise ValidationError(f"chunk index {index} is out of range [0, {self.num_chunks})")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_bytes)

    def segments(self, index: int) -> list[tuple[int, int, int]]:
        """The pieces of chunk ``index``: ``(tensor index, offset in it, length)``."""
        start, end = self.chunk_range(index)
        offsets = self.offsets
        tensor = bisect.bisect_right(offsets, start) - 1
        pieces = []
        while start < end:
            while offsets[tensor + 1] <= start:  # skip empty tensors
                tensor += 1
            length = min(end, offsets[tensor + 1]) - start
            pieces.append((tensor, start - offsets[tensor], length))
            start += length
        return pieces

    # ------------------------------------------------------------------ wire

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "tensors": [[s.dtype, list(s.shape)] for s in self.tensors],
            "chunk_size": self.chunk_size,
            "digests": b"".join(self.chunk_digests),
            "metadata_digest": self.metadata_digest,
            "metadata_size": self.metadata_size,
        }

    @classmethod
    def from_wire(
        cls, message: Any, *, source: str, max_state_bytes: int = DEFAULT_MAX_STATE_BYTES
    ) -> StateManifest:
        """Parse a manifest from a remote peer; :class:`ProtocolViolation` names ``source``
        and what was wrong."""

        def bad(what: str) -> ProtocolViolation:
            return ProtocolViolation(f"malformed state manifest from {source}: {what}")

        if not isinstance(message, dict):
            raise bad(f"expected a dict, got {type(message).__name__}")
        if message.get("v") != MANIFEST_VERSION:
            raise bad(f"version {message.get('v')!r}, this peer reads {MANIFEST_VERSION}")
        raw_tensors = message.get("tensors")
        if not isinstance(raw_tensors, list) or len(raw_tensors) > MAX_TENSORS:
            raise bad(f"'tensors' must be a list of at most {MAX_TENSORS} entries")
        specs = []
        for i, entry in enumerate(raw_tensors):
            try:
                dtype, shape = entry
                dtype_from_name(dtype)
                if not isinstance(shape, list) or len(shape) > MAX_NDIM:
                    raise ValueError(f"shape must be a list of at most {MAX_NDIM} sizes")
                if not all(type(n) is int and n >= 0 for n in shape):
                    raise ValueError(f"shape {shape!r} has a size that is not an integer >= 0")
            except (ValueError, TypeError, CodecError) as e:
                raise bad(f"tensor {i}: {e}") from None
            specs.append(TensorSpec(dtype, tuple(shape)))
        total = 0
        for spec in specs:
            total += spec.nbytes
            if total > max_state_bytes:
                raise bad(f"the state is larger than the limit of {max_state_bytes} bytes")
        chunk_size = message.get("chunk_size")
        digests = message.get("digests")
        metadata_digest = message.get("metadata_digest")
        metadata_size = message.get("metadata_size")
        if type(chunk_size) is not int or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise bad(f"chunk size {chunk_size!r} is not in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        if not isinstance(digests, bytes | bytearray) or len(digests) % DIGEST_SIZE:
            raise bad(f"'digests' must be bytes, a multiple of {DIGEST_SIZE} long")
        if not isinstance(metadata_digest, bytes | bytearray) or len(metadata_digest) != 32:
            raise bad(f"'metadata_digest' must be {DIGEST_SIZE} bytes")
        if type(metadata_size) is not int or metadata_size < 0:
            raise bad(f"metadata size {metadata_size!r} is not an integer >= 0")
        digests = bytes(digests)
        chunk_digests = tuple(
            digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE)
        )
        try:
            return cls(
                tuple(specs), chunk_size, chunk_digests, bytes(metadata_digest), metadata_size
            )
        except ValidationError as e:
            raise bad(str(e)) from None


def freeze_state(
    metadata: Any, tensors: Sequence[torch.Tensor], *, copy: bool = True
) -> tuple[bytes, list[torch.Tensor]]:
    """Encode the metadata and take contiguous CPU copies of the tensors: the part of a
    snapshot that must happen under the owner's lock (hashing can follow outside it).
    With ``copy=False`` CPU tensors are used as they are (only safe when nobody modifies
    them while the snapshot lives)."""
    metadata_bytes = pack_metadata(metadata)
    frozen = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"state tensor {i} is a {type(tensor).__name__}, not a tensor")
        try:
            dtype_name(tensor.dtype)
        except CodecError as e:
            raise ValidationError(f"state tensor {i}: {e}") from None
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        elif copy:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        frozen.append(tensor.contiguous())
    return metadata_bytes, frozen


def _as_uint8(buffer: Any) -> torch.Tensor:
    """A byte buffer as a uint8 tensor, without a copy when it is writable."""
    view = memoryview(buffer).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class StateSnapshot:
    """A donor's frozen copy of its state, served chunk by chunk without further copies.

    Build it with :meth:`build` (in a worker thread for big states: it copies and hashes
    everything once). Concurrent downloads share one snapshot.
    """

    def __init__(
        self,
        manifest: StateManifest,
        metadata: bytes,
        flat: list[memoryview],
        keepalive: Sequence[torch.Tensor] = (),
    ):
        self.manifest = manifest
        self.metadata = metadata
        self._flat = flat
        self._keepalive = list(keepalive)  # the memory behind the views

    @classmethod
    def build(
        cls,
        metadata: Any,
        tensors: Sequence[torch.Tensor],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        copy: bool = True,
    ) -> StateSnapshot:
        """Freeze ``(metadata, tensors)`` and hash it (see :func:`freeze_state`)."""
        return cls.from_frozen(*freeze_state(metadata, tensors, copy=copy), chunk_size)

    @classmethod
    def from_frozen(
        cls, metadata: bytes, tensors: Sequence[torch.Tensor], chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> StateSnapshot:
        """Hash a state made by :func:`freeze_state` chunk by chunk."""
        flat = [memoryview(_flat_bytes(t).numpy()) for t in tensors]
        specs = tuple(TensorSpec.of(t) for t in tensors)
        num_chunks = -(-sum(len(f) for f in flat) // chunk_size)
        # a manifest without digests yet: checks the chunk size and cuts the chunks
        layout = StateManifest(specs, chunk_size, (b"",) * num_chunks, b"", 0)
        digests = tuple(
            _digest([flat[t][o : o + n] for t, o, n in layout.segments(i)])
            for i in range(num_chunks)
        )
        metadata_digest = hashlib.sha256(metadata).digest()
        manifest = StateManifest(specs, chunk_size, digests, metadata_digest, len(metadata))
        return cls(manifest, metadata, flat, keepalive=tensors)

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes

    def chunk(self, index: int) -> list[memoryview]:
        """The bytes of chunk ``index`` as views into the snapshot (no copy)."""
        return [self._flat[t][o : o + n] for t, o, n in self.manifest.segments(index)]


class StateAssembler:
    """The downloader's destination: tensors allocated from a manifest, filled chunk by
    chunk, each chunk checked against its digest before it is written."""

    def __init__(self, manifest: StateManifest):
        self.manifest = manifest
        try:
            self.tensors = [
                torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype))
                for spec in manifest.tensors
            ]
        except (RuntimeError, MemoryError) as e:
            raise ValidationError(
                f"cannot allocate a state of {manifest.total_bytes} bytes: {e}"
            ) from None
        self._flat = [_flat_bytes(t) for t in self.tensors]
        self.done: set[int] = set()

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.manifest.num_chunks) if i not in self.done]

    @property
    def complete(self) -> bool:
        return len(self.done) == self.manifest.num_chunks

    def verify(self, index: int, parts: Sequence[Any], source: str = "a donor") -> None:
        """Raise :class:`CorruptChunk` unless ``parts`` are exactly chunk ``index``."""
        start, end = self.manifest.chunk_range(index)
        if not isinstance(parts, list | tuple) or not all(
            isinstance(p, bytes | bytearray | memoryview) for p in parts
        ):
            raise CorruptChunk(f"chunk {index} from {source} is not a list of byte buffers")
        got = sum(len(p) for p in parts)
        if got != end - start:
            raise CorruptChunk(
                f"chunk {index} from {source} has {got} bytes, the manifest says {end - start}"
            )
        digest = _digest(parts)
        expected = self.manifest.chunk_digests[index]
        if digest != expected:
            raise CorruptChunk(
                f"chunk {index} from {source} does not match its digest (expected "
                f"{expected.hex()[:16]}..., got {digest.hex()[:16]}...)"
            )

    def write(self, index: int, parts: Sequence[Any], source: str = "a donor") -> None:
        """Verify chunk ``index`` and copy it into place (thread-safe for distinct chunks).
        Does not mark it done: the caller decides which copy of a chunk counts."""
        self.verify(index, parts, source)
        # Copy part by part into the tensors with torch, which releases the GIL (this runs
        # in worker threads while the event loop keeps receiving).
        segments = iter(self.manifest.segments(index))
        tensor, offset, left = next(segments, (0, 0, 0))
        for part in parts:
            source = _as_uint8(part)
            position = 0
            while position < len(source):
                if left == 0:
                    tensor, offset, left = next(segments)
                n = min(left, len(source) - position)
                self._flat[tensor][offset : offset + n].copy_(source[position : position + n])
                position, offset, left = position + n, offset + n, left - n

    def adopt(self, other: StateAssembler) -> int:
        """Take over the chunks ``other`` already verified that this manifest lists with
        the same digest (after switching to another donor's state). Returns how many."""
        if other.manifest.layout != self.manifest.layout:
            return 0
        adopted = 0
        for index in other.done:
            if other.manifest.chunk_digests[index] != self.manifest.chunk_digests[index]:
                continue
            for tensor, offset, length in self.manifest.segments(index):
                self._flat[tensor][offset : offset + length] = other._flat[tensor][
                    offset : offset + length
                ]
            self.done.add(index)
            adopted += 1
        return adopted

    def result(self, metadata: bytes) -> tuple[Any, list[torch.Tensor]]:
        """The finished state; ``metadata`` must match the manifest's digest."""
        if not self.complete:
            raise ValidationError(f"{len(self.missing)} chunks of the state are still missing")
        check_metadata(self.manifest, metadata, "the donor")
        try:
            value = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise ProtocolViolation(f"state metadata does not decode: {e}") from None
        return value, self.tensors


def check_metadata(manifest: StateManifest, metadata: Any, source: str) -> None:
    """Raise :class:`CorruptChunk` unless ``metadata`` is the manifest's metadata."""
    if not isinstance(metadata, bytes | bytearray):
        raise CorruptChunk(f"state metadata from {source} is not a byte buffer")
    if len(metadata) != manifest.metadata_size:
        raise CorruptChunk(
            f"state metadata from {source} has {len(metadata)} bytes, the manifest says "
            f"{manifest.metadata_size}"
        )
    if hashlib.sha256(metadata).digest() != manifest.metadata_digest:
        raise CorruptChunk(f"state metadata from {source} does not match its digest")
