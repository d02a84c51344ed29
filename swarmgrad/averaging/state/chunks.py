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

A donor may send its floating-point tensors through a lossy codec (``state_compression``,
e.g. float16 for half the bytes). Such a tensor's place in the byte stream then holds the
codec's payload instead of the tensor's own bytes, and its :class:`TensorSpec` carries a
:class:`TensorEncoding` (codec name, codec parameters, payload length) next to the
original dtype and shape. The digests cover the payload, so chunks are verified before
anything is decoded; the downloader decodes a tensor once all of its payload is in. The
codecs are deterministic: donors with the same state and the same codec publish the same
manifest, so a download still draws on all of them. The encoding is part of the layout, so
chunks of donors using different codecs are never mixed. Exact tensors (no codec, or one
that does not apply to them, e.g. integers) are listed as before, so a state sent without
compression has the same manifest, byte for byte, as before encodings existed.

Nothing here does I/O: :class:`StateSnapshot` is the donor's frozen copy that serves
chunks as zero-copy memoryviews, :class:`StateAssembler` the downloader's destination
tensors that accept only chunks matching the manifest.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmgrad.compression.base import CompressionBase, CompressionInfo, NoCompression
from swarmgrad.compression.serialization import (
    deserialize_torch_tensor,
    get_codec,
    serialize_torch_tensor,
)
from swarmgrad.compression.serialized import (
    MAX_NDIM,
    CompressionType,
    SerializedTensor,
    check_header,
    dtype_from_name,
    dtype_name,
)
from swarmgrad.utils.errors import CodecError, ProtocolViolation, SwarmgradError, ValidationError

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DIGEST_SIZE",
    "CorruptChunk",
    "StateAssembler",
    "StateCompression",
    "StateManifest",
    "StateSnapshot",
    "TensorEncoding",
    "TensorSpec",
    "encode_state_tensor",
    "freeze_state",
    "pack_metadata",
    "resolve_state_compression",
]

logger = logging.getLogger(__name__)

DIGEST_SIZE = 32  # SHA-256
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 1024
MAX_CHUNK_SIZE = 256 * 1024 * 1024
MAX_TENSORS = 1 << 20
DEFAULT_MAX_STATE_BYTES = 1 << 40  # 1 TiB: a bound on what a hostile manifest can make us allocate
MANIFEST_VERSION = 1
#: Bound on one tensor's codec parameters as msgpack (the codecs here need a few dozen bytes).
MAX_ENCODING_PARAMS_BYTES = 256


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
class TensorEncoding:
    """How a lossy codec encoded one tensor: what a downloader needs to decode it.

    ``params`` are the codec's parameters (see :mod:`swarmgrad.compression.serialized`) as
    sorted ``(name, value)`` pairs, so that encodings compare and hash by value; ``nbytes``
    is the payload's length, the tensor's share of the byte stream.
    """

    codec: str
    params: tuple[tuple[str, Any], ...]
    nbytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"codec": self.codec, "params": dict(self.params), "nbytes": self.nbytes}

    @classmethod
    def parse(cls, raw: Any, dtype: str, shape: tuple[int, ...]) -> TensorEncoding:
        """Validate an encoding (from a manifest, or a codec's output) for a tensor of
        ``dtype`` and ``shape``: a :class:`CodecError` says what is wrong."""
        if not isinstance(raw, dict):
            raise CodecError(f"the encoding must be a dict, got {type(raw).__name__}")
        codec, params, nbytes = raw.get("codec"), raw.get("params"), raw.get("nbytes")
        if not isinstance(codec, str) or codec == CompressionType.NONE:
            raise CodecError(f"codec {codec!r} is not the name of a lossy codec")
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and (v is None or type(v) in (bool, int, float, str))
            for k, v in params.items()
        ):
            raise CodecError("codec params must be a dict of strings to numbers or strings")
        try:
            packed = msgpack.packb(params, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise CodecError(f"codec params are not msgpack-serializable: {e}") from None
        if len(packed) > MAX_ENCODING_PARAMS_BYTES:
            raise CodecError(
                f"codec params take {len(packed)} bytes, at most {MAX_ENCODING_PARAMS_BYTES}"
            )
        header = {
            "codec": codec,
            "dtype": dtype,
            "shape": list(shape),
            "requires_grad": False,
            "params": params,
            "nbytes": nbytes,
        }
        check_header(header)  # the codec exists, applies to dtype, and nbytes fits params
        return cls(codec, tuple(sorted(params.items())), nbytes)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a state as the manifest describes it: its dtype and shape (what the
    downloader gets back) and, when a codec encoded it, how (None: its own bytes)."""

    dtype: str
    shape: tuple[int, ...]
    encoding: TensorEncoding | None = None

    @property
    def decoded_nbytes(self) -> int:
        """Size of the tensor itself."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Size of the tensor's share of the byte stream (its payload if encoded)."""
        return self.decoded_nbytes if self.encoding is None else self.encoding.nbytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(tensor.dtype), tuple(tensor.shape))

    def to_wire(self) -> list[Any]:
        """``[dtype, shape]`` for an exact tensor (as manifests always had it), plus the
        encoding as a third element for an encoded one."""
        entry: list[Any] = [self.dtype, list(self.shape)]
        if self.encoding is not None:
            entry.append(self.encoding.to_wire())
        return entry

    def header(self) -> dict[str, Any]:
        """The :class:`SerializedTensor` header of an encoded tensor's payload."""
        assert self.encoding is not None
        return {
            "codec": self.encoding.codec,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "requires_grad": False,
            "params": dict(self.encoding.params),
            "nbytes": self.encoding.nbytes,
        }

    def __str__(self) -> str:
        text = f"{self.dtype}{list(self.shape)}"
        return text if self.encoding is None else f"{text} as {self.encoding.codec}"


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
        """Bytes to transfer (encoded tensors count with their payload)."""
        return self.offsets[-1]

    @property
    def decoded_bytes(self) -> int:
        """Size of the tensors once decoded."""
        return sum(spec.decoded_nbytes for spec in self.tensors)

    @property
    def allocation_bytes(self) -> int:
        """What a downloader allocates: every decoded tensor, plus a payload buffer for
        every encoded one."""
        return self.decoded_bytes + sum(s.nbytes for s in self.tensors if s.encoding)

    @property
    def encoded(self) -> list[int]:
        """Indices of the tensors a codec encoded."""
        return [i for i, spec in enumerate(self.tensors) if spec.encoding is not None]

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
        h.update(msgpack.packb([[s.to_wire() for s in self.tensors]], use_bin_type=True))
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
            "tensors": [s.to_wire() for s in self.tensors],
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
                if not isinstance(entry, list) or len(entry) not in (2, 3):
                    raise ValueError("expected [dtype, shape] or [dtype, shape, encoding]")
                dtype, shape = entry[:2]
                dtype_from_name(dtype)
                if not isinstance(shape, list) or len(shape) > MAX_NDIM:
                    raise ValueError(f"shape must be a list of at most {MAX_NDIM} sizes")
                if not all(type(n) is int and n >= 0 for n in shape):
                    raise ValueError(f"shape {shape!r} has a size that is not an integer >= 0")
                encoding = None
                if len(entry) == 3:
                    encoding = TensorEncoding.parse(entry[2], dtype, tuple(shape))
            except (ValueError, TypeError, CodecError) as e:
                raise bad(f"tensor {i}: {e}") from None
            specs.append(TensorSpec(dtype, tuple(shape), encoding))
        # Bound what the manifest makes us allocate: the decoded tensors and the payload
        # buffers of the encoded ones (both live until the download is complete).
        total = 0
        for i, spec in enumerate(specs):
            total += spec.decoded_nbytes + (spec.nbytes if spec.encoding else 0)
            if total > max_state_bytes:
                raise bad(
                    f"the state is larger than the limit of {max_state_bytes} bytes (decoded "
                    f"tensors plus encoded payloads) from tensor {i} ({spec}) on"
                )
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


StateCompression = CompressionBase | CompressionType | str | None


def resolve_state_compression(compression: StateCompression) -> CompressionBase | None:
    """The codec for ``state_compression`` (None for exact transfer): a clear
    :class:`ValidationError` for an unknown name."""
    if compression is None:
        return None
    codec = get_codec(compression)
    return None if isinstance(codec, NoCompression) else codec


def encode_state_tensor(
    index: int, tensor: torch.Tensor, codec: CompressionBase | None
) -> tuple[TensorSpec, memoryview, Any]:
    """One frozen tensor's spec, its bytes in the stream, and what keeps them alive.

    Floating-point tensors go through ``codec``; a tensor the codec leaves exact (other
    dtypes, empty tensors) or cannot take (an error, or an encoding a downloader would
    refuse) travels as its own bytes.
    """
    exact = TensorSpec.of(tensor), memoryview(_flat_bytes(tensor).numpy()), tensor
    if codec is None or not tensor.dtype.is_floating_point:
        return exact
    try:
        info = CompressionInfo.from_tensor(tensor, key=index)
        serialized = serialize_torch_tensor(tensor, codec, info)
        if serialized.codec == CompressionType.NONE:
            return exact
        if serialized.torch_dtype != tensor.dtype or serialized.shape != tuple(tensor.shape):
            raise CodecError(
                f"the codec turned {TensorSpec.of(tensor)} into "
                f"{serialized.dtype}{list(serialized.shape)}"
            )
        spec = TensorSpec(
            serialized.dtype,
            serialized.shape,
            TensorEncoding.parse(
                {"codec": serialized.codec, "params": dict(serialized.params),
                 "nbytes": serialized.nbytes},
                serialized.dtype,
                serialized.shape,
            ),
        )  # fmt: skip
    except (SwarmgradError, TypeError, ValueError, RuntimeError) as e:
        logger.warning("state tensor %d travels exact: %s cannot encode it (%s)", index, codec, e)
        return exact
    payload = memoryview(serialized.buffer).cast("B")
    return spec, payload, serialized


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
        keepalive: Sequence[Any] = (),
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
        compression: StateCompression = None,
    ) -> StateSnapshot:
        """Freeze ``(metadata, tensors)``, encode and hash it (see :func:`freeze_state`)."""
        frozen = freeze_state(metadata, tensors, copy=copy)
        return cls.from_frozen(*frozen, chunk_size, compression=compression)

    @classmethod
    def from_frozen(
        cls,
        metadata: bytes,
        tensors: Sequence[torch.Tensor],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        compression: StateCompression = None,
    ) -> StateSnapshot:
        """Encode the floating-point tensors of a state made by :func:`freeze_state` with
        ``compression`` (None or NONE: none is encoded), then hash it chunk by chunk.
        Runs outside the owner's lock: the frozen tensors are private copies."""
        codec = resolve_state_compression(compression)
        encoded = [encode_state_tensor(i, t, codec) for i, t in enumerate(tensors)]
        specs = tuple(spec for spec, _, _ in encoded)
        flat = [payload for _, payload, _ in encoded]
        num_chunks = -(-sum(len(f) for f in flat) // chunk_size)
        # a manifest without digests yet: checks the chunk size and cuts the chunks
        layout = StateManifest(specs, chunk_size, (b"",) * num_chunks, b"", 0)
        digests = tuple(
            _digest([flat[t][o : o + n] for t, o, n in layout.segments(i)])
            for i in range(num_chunks)
        )
        metadata_digest = hashlib.sha256(metadata).digest()
        manifest = StateManifest(specs, chunk_size, digests, metadata_digest, len(metadata))
        return cls(manifest, metadata, flat, keepalive=[keep for _, _, keep in encoded])

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes

    def chunk(self, index: int) -> list[memoryview]:
        """The bytes of chunk ``index`` as views into the snapshot (no copy)."""
        return [self._flat[t][o : o + n] for t, o, n in self.manifest.segments(index)]


class StateAssembler:
    """The downloader's destination: tensors allocated from a manifest, filled chunk by
    chunk, each chunk checked against its digest before it is written.

    An exact tensor's bytes are written straight into it. An encoded tensor's payload is
    collected in a buffer of its own and decoded (:meth:`decode`) once every chunk it
    spans is done; until then its entry in ``tensors`` is None.
    """

    def __init__(self, manifest: StateManifest):
        self.manifest = manifest
        self.tensors: list[torch.Tensor | None] = []
        self._flat: list[torch.Tensor] = []  # each tensor's share of the stream, writable
        try:
            for spec in manifest.tensors:
                if spec.encoding is None:
                    tensor = torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype))
                    self.tensors.append(tensor)
                    self._flat.append(_flat_bytes(tensor))
                else:
                    self.tensors.append(None)
                    self._flat.append(torch.empty(spec.nbytes, dtype=torch.uint8))
        except (RuntimeError, MemoryError) as e:
            raise ValidationError(
                f"cannot allocate a state of {manifest.allocation_bytes} bytes: {e}"
            ) from None
        self.done: set[int] = set()
        # for each encoded tensor, the chunks its payload spans that are not done yet
        self._waiting: dict[int, set[int]] = {}
        chunk_size = manifest.chunk_size
        for i in manifest.encoded:
            start, end = manifest.offsets[i], manifest.offsets[i + 1]
            self._waiting[i] = set(range(start // chunk_size, -(-end // chunk_size)))

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

    def finish(self, index: int) -> list[int]:
        """Mark chunk ``index`` (written and verified) done. Returns the encoded tensors
        whose payload it completed: they are ready for :meth:`decode`."""
        self.done.add(index)
        ready = []
        for tensor, _, _ in self.manifest.segments(index):
            waiting = self._waiting.get(tensor)
            if waiting is not None and index in waiting:
                waiting.discard(index)
                if not waiting:
                    ready.append(tensor)
        return ready

    def adopt(self, other: StateAssembler) -> int:
        """Take over the chunks ``other`` already verified that this manifest lists with
        the same digest (after switching to another donor's state). Returns how many."""
        if other.manifest.layout != self.manifest.layout:
            return 0
        adopted = 0
        for index in sorted(other.done):
            if other.manifest.chunk_digests[index] != self.manifest.chunk_digests[index]:
                continue
            for tensor, offset, length in self.manifest.segments(index):
                self._flat[tensor][offset : offset + length] = other._flat[tensor][
                    offset : offset + length
                ]
            self.finish(index)
            adopted += 1
        return adopted

    @property
    def pending(self) -> list[int]:
        """Encoded tensors not decoded yet."""
        return [i for i in self.manifest.encoded if self.tensors[i] is None]

    def decode(self, indices: Sequence[int], source: str = "the donor") -> None:
        """Decode the encoded tensors ``indices`` (their payloads must be complete) into
        their original dtype and shape. ``source`` is whoever published the manifest: a
        payload that does not decode to what the manifest says is a
        :class:`ProtocolViolation` naming it and the tensor. Thread-safe for distinct
        tensors (it runs in worker threads)."""
        for index in indices:
            spec = self.manifest.tensors[index]
            if spec.encoding is None or self.tensors[index] is not None:
                continue
            if self._waiting.get(index, set()) - self.done:
                raise ValidationError(f"tensor {index} cannot be decoded: chunks are missing")
            payload = self._flat[index]
            try:
                buffer = memoryview(payload.numpy()) if len(payload) else b""
                serialized = SerializedTensor.from_header(spec.header(), buffer)
                value = deserialize_torch_tensor(serialized)
            except (CodecError, RuntimeError, ValueError, TypeError) as e:
                raise ProtocolViolation(
                    f"tensor {index} ({spec}) of the state from {source} does not decode: {e}"
                ) from None
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype != dtype_from_name(spec.dtype)
                or tuple(value.shape) != spec.shape
            ):
                got = (
                    f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise ProtocolViolation(
                    f"tensor {index} of the state from {source} decodes to {got}, "
                    f"the manifest says {spec.dtype}{list(spec.shape)}"
                )
            self.tensors[index] = value.detach().requires_grad_(False)

    def result(self, metadata: bytes, source: str = "the donor") -> tuple[Any, list[torch.Tensor]]:
        """The finished state; ``metadata`` must match the manifest's digest. Decodes any
        encoded tensor not decoded yet (:class:`ProtocolViolation` if one does not)."""
        if not self.complete:
            raise ValidationError(f"{len(self.missing)} chunks of the state are still missing")
        check_metadata(self.manifest, metadata, source)
        self.decode(self.pending, source)
        try:
            value = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise ProtocolViolation(f"state metadata does not decode: {e}") from None
        tensors = [t for t in self.tensors if t is not None]
        assert len(tensors) == len(self.tensors)
        return value, tensors


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
