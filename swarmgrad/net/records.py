"""Bulk record protection after the TLS 1.3 handshake: AES-256-GCM records.

Why: the stdlib's TLS record layer costs about 0.4 s per GB on each side here (it picks
AES-256-GCM and copies every record through memory BIOs), while AES-GCM from
``cryptography`` seals and opens above 7 GB/s. When both peers offer the ``swarmgrad/3``
ALPN id, they keep TLS 1.3 for what it is good at (authenticated key agreement: the
server's certificate is its ed25519 identity) and then protect their bytes with records
keyed from secrets exchanged *inside* that TLS session. See docs/design-notes.md.

Keys: each side draws a 32-byte share and sends it as its first TLS application data;
the records *it sends* are keyed by HKDF-SHA256 over its own share, labelled with the
direction (``direction_key``). So a side can send records right after its share, without
waiting a round trip for the other's: a new connection's identity handshake starts one
flight earlier. Each share is fresh, random and travels only inside the TLS session,
which is as secret as the session itself.
Records: ``u32 length | AES-256-GCM(plaintext)`` where length counts ciphertext and the
16-byte tag and is the additional authenticated data; the 96-bit nonce is a per-direction
counter, so a reordered, replayed, dropped or altered record fails authentication, and
the two directions' keys differ, so a record reflected back to its sender fails too. This
module is pure: sealing and opening, no I/O.
"""

from __future__ import annotations

import collections
import struct

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarmgrad.utils.errors import FrameTooLarge, ProtocolViolation

SHARE_SIZE = 32
TAG_SIZE = 16
LENGTH = struct.Struct(">I")
MAX_RECORD_PLAINTEXT = 4 * 1024 * 1024
MAX_RECORD = MAX_RECORD_PLAINTEXT + TAG_SIZE
# Records at least this big are sealed into reused buffers; at most _SPARE_BUFFERS wait
# for reuse per direction of a connection (a few MB on busy connections, none on the
# mostly idle ones a DHT peer keeps).
POOLED_RECORD_MIN = 64 * 1024
_SPARE_BUFFERS = 8
_TRACKED_IN_FLIGHT = 64
_NONCE_PREFIX = b"\x00\x00\x00\x00"
_LABEL = b"swarmgrad records v2"


def direction_key(share: bytes, *, from_dialer: bool) -> bytes:
    """The key of the records sent by the side that drew ``share`` (the dialer if
    ``from_dialer``, else the listener)."""
    if len(share) != SHARE_SIZE:
        raise ProtocolViolation(f"record key shares must be {SHARE_SIZE} bytes")
    info = b"dialer to listener" if from_dialer else b"listener to dialer"
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_LABEL, info=info).derive(share)


class Sealer:
    """Protects outgoing plaintext as a sequence of records.

    Large records are sealed into reused buffers (``encrypt_into``): allocating a fresh
    zero-filled buffer per megabyte record cost a quarter of the sealing time. The caller
    writes the buffers to a transport in order and, before sealing more, tells
    :meth:`release` how many bytes that transport still buffers: a buffer is reused only
    once every byte of it has left the transport.
    """

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0
        self._sealed_bytes = 0  # bytes of every record returned so far
        self._in_flight: collections.deque[tuple[int, bytearray]] = collections.deque()
        self._spare: list[bytearray] = []

    def seal(self, *plaintexts: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """Records for the plaintexts (each split at MAX_RECORD_PLAINTEXT), as buffers to
        write in order. Consecutive records share one buffer (see :meth:`prepare`)."""
        job = self.prepare(*plaintexts)
        job.run()
        return job.buffers

    def seal_small(self, plaintext: bytes | bytearray | memoryview) -> bytes:
        """One record for a plaintext shorter than POOLED_RECORD_MIN: the short path of
        RPC-sized writes (no job, no buffer bookkeeping)."""
        prefix = LENGTH.pack(len(plaintext) + TAG_SIZE)
        nonce = _NONCE_PREFIX + self._counter.to_bytes(8, "big")
        self._counter += 1
        self._sealed_bytes += LENGTH.size + len(plaintext) + TAG_SIZE
        return prefix + self._aead.encrypt(nonce, plaintext, prefix)

    def prepare(self, *plaintexts: bytes | bytearray | memoryview) -> SealJob:
        """Reserve the records of the plaintexts (their nonces, in order, and the buffer
        they go to) without encrypting them; :meth:`SealJob.run` encrypts, on any thread.

        All records of one call go into one contiguous buffer, so a frame header's small
        record and its payload's large one leave in a single write without being joined
        (the stdlib's ``writelines`` joins, a copy of every byte, before Python 3.12)."""
        chunks = []
        for plaintext in plaintexts:
            view = memoryview(plaintext).cast("B")
            chunks.extend(
                view[start : start + MAX_RECORD_PLAINTEXT]
                for start in range(0, len(view), MAX_RECORD_PLAINTEXT)
            )
        total = sum(LENGTH.size + len(chunk) + TAG_SIZE for chunk in chunks)
        job = SealJob(self._aead, total)
        if total < POOLED_RECORD_MIN:  # small: sealed now, fresh bytes
            sealed = []
            for chunk in chunks:
                prefix = LENGTH.pack(len(chunk) + TAG_SIZE)
                sealed += (prefix, self._aead.encrypt(self._next_nonce(), chunk, prefix))
            if sealed:
                job.buffers.append(b"".join(sealed))
            self._sealed_bytes += total
            return job
        self._sealed_bytes += total
        out = memoryview(self._take(total))[:total]
        pos = 0
        for chunk in chunks:
            size = LENGTH.size + len(chunk) + TAG_SIZE
            prefix = LENGTH.pack(len(chunk) + TAG_SIZE)
            out[pos : pos + LENGTH.size] = prefix
            body = out[pos + LENGTH.size : pos + size]
            job.items.append((self._next_nonce(), chunk, prefix, body))
            pos += size
        job.buffers.append(out)
        return job

    def _next_nonce(self) -> bytes:
        nonce = _NONCE_PREFIX + self._counter.to_bytes(8, "big")
        self._counter += 1
        return nonce

    def release(self, still_buffered: int) -> None:
        """The transport still holds the last ``still_buffered`` bytes written: buffers
        entirely before them are free to reuse."""
        written_out = self._sealed_bytes - still_buffered
        while self._in_flight and self._in_flight[0][0] <= written_out:
            _, buffer = self._in_flight.popleft()
            if len(self._spare) < _SPARE_BUFFERS:
                self._spare.append(buffer)

    def _take(self, size: int) -> bytearray:
        for index, buffer in enumerate(self._spare):
            if size <= len(buffer) <= 4 * size:
                del self._spare[index]
                break
        else:
            buffer = bytearray(size)
        if len(self._in_flight) >= _TRACKED_IN_FLIGHT:  # a slow reader: stop tracking the
            self._in_flight.popleft()  # oldest, the transport frees it when written
        self._in_flight.append((self._sealed_bytes, buffer))
        return buffer


class SealJob:
    """Records reserved by :meth:`Sealer.prepare`: ``buffers`` holds them once
    :meth:`run` returned. ``run`` touches only the plaintext and the job's own buffer,
    so it may run on a worker thread (AES-GCM releases the GIL) while the event loop
    reserves the next job; the records must still be written in reservation order."""

    __slots__ = ("_aead", "buffers", "items", "nbytes")

    def __init__(self, aead: AESGCM, nbytes: int):
        self._aead = aead
        self.nbytes = nbytes  # bytes of all its records
        self.items: list[tuple[bytes, memoryview, bytes, memoryview]] = []
        self.buffers: list[bytes | memoryview] = []

    def run(self) -> None:
        encrypt_into = self._aead.encrypt_into
        for nonce, chunk, prefix, out in self.items:
            encrypt_into(nonce, chunk, prefix, out)
        self.items = []  # let go of the plaintext


class Opener:
    """Authenticates and decrypts incoming records, in order."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0

    @staticmethod
    def record_length(prefix: bytes | bytearray | memoryview) -> int:
        """Total ciphertext length announced by a record's 4-byte prefix (checked)."""
        (length,) = LENGTH.unpack(prefix)
        if length > MAX_RECORD:
            raise FrameTooLarge(f"record of {length} bytes exceeds the limit of {MAX_RECORD}")
        if length <= TAG_SIZE:
            raise ProtocolViolation(f"record of {length} bytes is shorter than its tag")
        return length

    def open_into(
        self,
        prefix: bytes | bytearray | memoryview,
        sealed: bytes | bytearray | memoryview,
        out: memoryview,
    ) -> None:
        """Decrypt ``sealed`` (len(out) + 16 bytes) into ``out``; ProtocolViolation if the
        record was forged, altered, replayed or reordered. ``out`` is garbage on error."""
        self.open_reserved(self.reserve(), prefix, sealed, out)

    def reserve(self) -> int:
        """The number of the next record, taken now (records are numbered in the order
        they arrive) so that :meth:`open_reserved` may run later, on another thread."""
        number = self._counter
        self._counter += 1
        return number

    def open_reserved(
        self,
        number: int,
        prefix: bytes | bytearray | memoryview,
        sealed: bytes | bytearray | memoryview,
        out: memoryview,
    ) -> None:
        """:meth:`open_into` for record ``number`` from :meth:`reserve`; thread-safe."""
        nonce = _NONCE_PREFIX + number.to_bytes(8, "big")
        try:
            self._aead.decrypt_into(nonce, sealed, prefix, out)
        except Exception:  # cryptography raises InvalidTag
            raise ProtocolViolation(
                f"record {number} failed authentication (forged, altered or out of order)"
            ) from None
