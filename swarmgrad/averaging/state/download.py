"""The joining side of state transfer: download a state in chunks from several donors.

:func:`load_state_from_peers` reads the donors' declarations from the DHT, orders them
(highest priority first; among equals, those sharing the most common state, then those
with the fastest announced links, then at random) and opens download sessions with the
best ``max_donors`` of them (a donor that is busy or does not answer is replaced by the
next one); the best-ranked donors take the first chunks. The best session's manifest is
the *target*: its chunks are fetched from every donor whose manifest lists the same
digest for them, ``chunks_in_flight_per_donor`` at a time from each, and every chunk is
checked against its digest before it is written.

When a donor fails (connection lost, remote error, expired session) its chunks go to the
others; a donor that times out twice is dropped; a donor that sends a chunk that does not
match its digest is dropped at once and logged with its PeerID. A slow donor naturally
gets fewer chunks (each donor pulls work when it has a free slot), and at the end an idle
donor re-fetches a chunk that a slow one has held for too long. If the target's donors
all fail, another session's state becomes the target, keeping every chunk already
verified that it shares. The download gives up (returns None, with a log line saying
why) when no donor is left or ``timeout`` expires.

Donors may send floating-point tensors encoded with a lossy codec (their
``state_compression``): the manifest says how, chunks are verified as always, and each
encoded tensor is decoded into its original dtype and shape (in a worker thread) as soon
as all of its chunks are in. A payload that does not decode to what the manifest says
drops every donor that published that manifest. Donors using different codecs publish
different layouts, so their chunks are never mixed in one tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import statistics
from collections import Counter, deque
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmgrad.averaging.state.chunks import (
    DEFAULT_MAX_STATE_BYTES,
    CorruptChunk,
    StateAssembler,
    StateManifest,
    check_metadata,
)
from swarmgrad.averaging.state.protocol import (
    BUSY,
    ChunkRequest,
    DonorRecord,
    ManifestRequest,
    ReleaseRequest,
    StateRefusal,
    StateRPC,
    declaration_key,
    decode_chunk_answer,
    decode_manifest_answer,
    order_donors,
    parse_declarations,
)
from swarmgrad.averaging.state.scheduler import ChunkScheduler
from swarmgrad.dht.node import DHTNode
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import (
    DeadlineExceeded,
    ProtocolViolation,
    SwarmgradError,
    ValidationError,
)

__all__ = ["StateDownloader", "load_state_from_peers"]

logger = logging.getLogger(__name__)

State = tuple[Any, list[torch.Tensor]]


class _DonorFailed(Exception):
    """A donor's answer ends its part in the download (not retried)."""


@dataclass(eq=False)
class _Session:
    record: DonorRecord
    session_id: bytes
    priority: float
    manifest: StateManifest
    metadata: bytes
    rank: int  # position in the donor order (lower is better)
    alive: bool = True
    timeouts: int = 0

    @property
    def peer_id(self) -> PeerID:
        return self.record.peer_id


@dataclass(eq=False)
class _Round:
    """One attempt to complete one target manifest."""

    target: _Session
    assembler: StateAssembler
    scheduler: ChunkScheduler
    donors: dict[PeerID, _Session] = field(default_factory=dict)
    workers: set[asyncio.Task] = field(default_factory=set)
    fetches: dict[tuple[PeerID, int], asyncio.Task] = field(default_factory=dict)
    durations: deque = field(default_factory=lambda: deque(maxlen=32))
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    upgrade: bool = False  # a better state turned up: stop and switch to it
    rejected: str | None = None  # the target's state does not decode: why

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class StateDownloader:
    """One download (see the module docstring); :meth:`run` returns the state or None.

    After a run, ``chunks_from`` counts the chunks each donor delivered, ``dropped``
    says why each dropped donor was dropped, ``bytes_received`` counts the chunk bytes
    that arrived (duplicates and refused chunks included) and ``manifest`` is the manifest
    of the state returned (its ``total_bytes`` is what the state costs on the wire, its
    ``decoded_bytes`` what it takes in memory).
    """

    def __init__(
        self,
        peer: Peer,
        dht_node: DHTNode,
        *,
        prefix: str,
        request_timeout: float = 10.0,
        chunk_timeout: float = 30.0,
        max_donors: int = 4,
        chunks_in_flight_per_donor: int = 3,
        max_timeouts_per_donor: int = 2,
        min_steal_after: float = 0.5,
        max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
        rng: random.Random | None = None,
    ):
        if max_donors < 1 or chunks_in_flight_per_donor < 1:
            raise ValidationError("max_donors and chunks_in_flight_per_donor must be >= 1")
        self.peer, self.dht_node, self.prefix = peer, dht_node, prefix
        self.request_timeout, self.chunk_timeout = request_timeout, chunk_timeout
        self.max_donors = max_donors
        self.chunks_in_flight_per_donor = chunks_in_flight_per_donor
        self.max_timeouts_per_donor = max_timeouts_per_donor
        self.min_steal_after = min_steal_after
        self.max_state_bytes = max_state_bytes
        self.rng = rng or random.Random()
        self.rpc = StateRPC.for_prefix(prefix)
        self.chunks_from: Counter[PeerID] = Counter()
        self.dropped: dict[PeerID, str] = {}
        self.refused: dict[PeerID, str] = {}
        self.bytes_received = 0
        self.manifest: StateManifest | None = None
        self._candidates: deque[tuple[int, DonorRecord]] = deque()
        self._sessions: list[_Session] = []
        self._opening: dict[asyncio.Task, DonorRecord] = {}  # manifest requests in flight
        self._round: _Round | None = None
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ entry point

    async def run(self, timeout: float | None = None) -> State | None:
        """Download the best state on offer; None if no donor could provide one in time."""
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await self._download()
        except TimeoutError:
            if not deadline.expired():
                raise
            logger.warning(
                "could not download the state under %r within %s s%s",
                self.prefix,
                timeout,
                self._why(),
            )
            return None
        finally:
            openers = list(self._opening)
            for task in openers:
                task.cancel()
            await asyncio.gather(*openers, return_exceptions=True)
            await self._release_sessions()

    def _why(self) -> str:
        reasons = {**self.refused, **self.dropped}
        if not reasons:
            return ""
        return " (" + "; ".join(f"{peer}: {why}" for peer, why in reasons.items()) + ")"

    def _live(self) -> list[_Session]:
        return [s for s in self._sessions if s.alive]

    async def _download(self) -> State | None:
        found = await self.dht_node.get(declaration_key(self.prefix), latest=True)
        records = parse_declarations(found, exclude=self.peer.peer_id)
        if not records:
            logger.info("no peer shares its state under %r", self.prefix)
            return None
        self._candidates = deque(enumerate(order_donors(records, self.rng)))
        self._fill()
        assembler: StateAssembler | None = None
        while True:
            live = self._live()
            if not live and not self._opening:
                logger.warning(
                    "no donor could provide the state under %r%s", self.prefix, self._why()
                )
                return None
            # Start as soon as no donor still answering could offer a higher priority
            # (a donor that is merely slower to answer joins the download when it does).
            pending = max((r.priority for r in self._opening.values()), default=-math.inf)
            if not live or max(s.priority for s in live) < pending:
                changed = self._changed
                await changed.wait()
                continue
            target = self._choose_target(live)
            try:
                new = StateAssembler(target.manifest)
            except ValidationError as e:
                self._forget(target, str(e))
                continue
            if assembler is not None:
                kept = new.adopt(assembler)
                logger.info(
                    "switching to the state of %s, keeping %d verified chunks", target.peer_id, kept
                )
            assembler = new
            if not await self._fetch_all(target, assembler):
                continue
            source = str(target.peer_id)
            try:
                # tensors completed by adopted chunks are not decoded yet
                await asyncio.to_thread(assembler.decode, assembler.pending, source)
                metadata, tensors = assembler.result(target.metadata, source)
            except ProtocolViolation as e:
                self._reject(target, str(e))
                continue
            self.manifest = target.manifest
            logger.info(
                "downloaded a state of %d bytes (%d decoded) in %d chunks from %s",
                target.manifest.total_bytes,
                target.manifest.decoded_bytes,
                target.manifest.num_chunks,
                ", ".join(f"{p} ({n})" for p, n in self.chunks_from.most_common()) or "-",
            )
            return metadata, tensors

    def _reject(self, target: _Session, reason: str) -> None:
        """The target's state is unusable (it does not decode): drop every donor that
        published the same manifest, since they all serve the same bytes."""
        for session in self._live():
            if (
                session is not target
                and session.manifest.root_digest == target.manifest.root_digest
            ):
                self._forget(session, f"serves the same state as {target.peer_id}: {reason}")
        self._forget(target, reason)

    def _forget(self, session: _Session, reason: str) -> None:
        session.alive = False
        self.dropped[session.peer_id] = reason
        logger.warning("dropping donor %s: %s", session.peer_id, reason)
        self._fill()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _choose_target(self, live: list[_Session]) -> _Session:
        """Highest priority first; among equals, the state most donors can serve."""
        shared = Counter(s.manifest.root_digest for s in live)
        return min(live, key=lambda s: (-s.priority, -shared[s.manifest.root_digest], s.rank))

    # ------------------------------------------------------------------ sessions

    def _fill(self) -> None:
        """Ask more candidates for a session until ``max_donors`` are open or opening."""
        while self._candidates and len(self._live()) + len(self._opening) < self.max_donors:
            rank, record = self._candidates.popleft()
            task = asyncio.ensure_future(self._open_session(rank, record))
            self._opening[task] = record
            task.add_done_callback(self._on_opened)

    def _on_opened(self, task: asyncio.Task) -> None:
        record = self._opening.pop(task, None)
        if task.cancelled():
            return
        try:
            session = task.result()  # _open_session returns None for the errors it expects
        except Exception as e:  # a bug or an answer nobody anticipated: skip that donor
            donor = record.peer_id if record is not None else "a donor"
            logger.warning("could not open a session with %s: %r", donor, e)
            session = None
        round_ = self._round
        if session is None:
            self._fill()
        elif round_ is not None and not round_.finished.is_set():
            if session.priority > round_.target.priority:  # a better state: switch to it
                logger.info(
                    "%s offers priority %s, over the %s being downloaded: switching",
                    session.peer_id,
                    session.priority,
                    round_.target.priority,
                )
                round_.upgrade = True
                round_.finished.set()
            else:
                self._add_donor(round_, session)
        self._notify()
        if round_ is not None:
            self._check_finished(round_)

    async def _open_session(self, rank: int, record: DonorRecord) -> _Session | None:
        donor = record.peer_id
        try:
            self.peer.add_addresses(donor, record.maddrs)
        except (ValueError, SwarmgradError) as e:
            self.refused[donor] = f"unusable addresses: {e}"
            return None
        try:
            answer = await self.peer.call(
                donor, self.rpc.manifest, ManifestRequest().encode(), timeout=self.request_timeout
            )
            offer = decode_manifest_answer(answer, donor)
            if isinstance(offer, StateRefusal):
                reason = f"{offer.status}: {offer.reason}"
                self.refused[donor] = reason
                log = logger.info if offer.status == BUSY else logger.debug
                log("donor %s refused to share its state (%s)", donor, reason)
                return None
            manifest = StateManifest.from_wire(
                offer.manifest, source=str(donor), max_state_bytes=self.max_state_bytes
            )
            check_metadata(manifest, offer.metadata, str(donor))
        except CorruptChunk as e:
            logger.warning("dropping donor %s: %s", donor, e)
            self.dropped[donor] = str(e)
            return None
        except (SwarmgradError, OSError) as e:
            self.refused[donor] = f"{type(e).__name__}: {e}"
            logger.debug("donor %s did not open a download session: %s", donor, e)
            return None
        session = _Session(record, offer.session, offer.priority, manifest, offer.metadata, rank)
        self._sessions.append(session)
        return session

    async def _release_sessions(self) -> None:
        """Tell the donors we are done (best effort, briefly), so their slots free up."""
        alive = [s for s in self._sessions if s.alive]
        self._sessions = []
        if not alive:
            return

        async def release(session: _Session) -> None:
            with contextlib.suppress(SwarmgradError, OSError):
                await self.peer.call(
                    session.peer_id,
                    self.rpc.release,
                    ReleaseRequest(session.session_id).encode(),
                    timeout=min(self.request_timeout, 2.0),
                )

        await asyncio.gather(*(release(s) for s in alive))

    # ------------------------------------------------------------------ one target

    async def _fetch_all(self, target: _Session, assembler: StateAssembler) -> bool:
        """Fetch the target's missing chunks from every donor that holds them. True when
        complete; False when the chunks left are held by no remaining donor."""
        round_ = _Round(target, assembler, ChunkScheduler(assembler.missing))
        self._round = round_
        # the best-ranked donors take the first chunks (all of a one-chunk state)
        for session in sorted(self._live(), key=lambda s: s.rank):
            self._add_donor(round_, session)
        self._check_finished(round_)
        try:
            await round_.finished.wait()
        finally:
            self._round = None
            tasks = list(round_.workers)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if round_.rejected is not None:
            self._reject(target, round_.rejected)
            return False
        return assembler.complete

    def _add_donor(self, round_: _Round, session: _Session) -> None:
        target = round_.target.manifest
        manifest = session.manifest
        if manifest.layout != target.layout:
            return
        if manifest.root_digest == target.root_digest:
            eligible = None
        else:
            eligible = [
                i
                for i in round_.assembler.missing
                if manifest.chunk_digests[i] == target.chunk_digests[i]
            ]
            if not eligible:
                return
        round_.scheduler.add_donor(session.peer_id, eligible)
        round_.donors[session.peer_id] = session
        for _ in range(self.chunks_in_flight_per_donor):
            self._spawn(round_, self._worker(round_, session))

    def _spawn(self, round_: _Round, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        round_.workers.add(task)
        task.add_done_callback(round_.workers.discard)

    def _check_finished(self, round_: _Round) -> None:
        scheduler = round_.scheduler
        if scheduler.complete or (not self._opening and scheduler.unobtainable()):
            round_.finished.set()

    def _steal_after(self, round_: _Round) -> float:
        """How long a chunk may be in flight before an idle donor fetches a copy of it:
        a few times the typical chunk time, never below ``min_steal_after``."""
        if not round_.durations:
            return max(self.min_steal_after, self.chunk_timeout / 4)
        return max(self.min_steal_after, 3 * statistics.median(round_.durations))

    async def _worker(self, round_: _Round, session: _Session) -> None:
        loop = asyncio.get_running_loop()
        donor = session.peer_id
        scheduler = round_.scheduler
        try:
            while session.alive and not scheduler.complete:
                steal_after = self._steal_after(round_)
                chunk = scheduler.take(donor, loop.time(), steal_after)
                if chunk is None:
                    if not scheduler.has_work(donor):
                        return
                    changed = round_.changed
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(steal_after / 2):
                            await changed.wait()
                    continue
                await self._fetch_chunk(round_, session, chunk)
        except Exception as e:  # never leave the round waiting on a worker that died
            logger.exception("state download worker for %s failed", donor)
            self._drop(round_, session, f"internal error: {e!r}")

    async def _fetch_chunk(self, round_: _Round, session: _Session, chunk: int) -> None:
        loop = asyncio.get_running_loop()
        donor = session.peer_id
        started = loop.time()
        fetch = asyncio.ensure_future(
            self.peer.call(
                donor,
                self.rpc.chunk,
                ChunkRequest(session.session_id, chunk).encode(),
                timeout=self.chunk_timeout,
            )
        )
        round_.fetches[donor, chunk] = fetch
        try:
            await asyncio.wait([fetch])
        finally:
            if not fetch.done():
                fetch.cancel()
                await asyncio.gather(fetch, return_exceptions=True)
            round_.fetches.pop((donor, chunk), None)
        if fetch.cancelled():  # another donor delivered this chunk first
            return
        try:
            answer = fetch.result()
            parts = self._parts_of(answer, donor, chunk)
            self.bytes_received += sum(len(p) for p in parts if isinstance(p, Sized))
            if chunk in round_.assembler.done:
                return
            await asyncio.to_thread(round_.assembler.write, chunk, parts, str(donor))
        except CorruptChunk as e:
            self._drop(round_, session, str(e), warn=True)
            return
        except DeadlineExceeded:
            session.timeouts += 1
            if session.timeouts >= self.max_timeouts_per_donor:
                self._drop(round_, session, f"{session.timeouts} chunk requests timed out")
            else:
                round_.scheduler.fail(chunk, donor)
                round_.notify()
            return
        except (_DonorFailed, SwarmgradError, OSError) as e:
            self._drop(round_, session, f"{type(e).__name__}: {e}")
            return
        if chunk in round_.assembler.done:
            return
        ready = round_.assembler.finish(chunk)
        if ready:
            # Decode before the scheduler hears of the chunk: the round cannot end (and
            # the result cannot be read) while a tensor is half decoded.
            source = str(round_.target.peer_id)
            try:
                await asyncio.to_thread(round_.assembler.decode, ready, source)
            except ProtocolViolation as e:
                round_.rejected = str(e)
                round_.finished.set()
                return
        for other in round_.scheduler.finish(chunk, donor):
            duplicate = round_.fetches.get((other, chunk))
            if duplicate is not None:
                duplicate.cancel()
        round_.durations.append(loop.time() - started)
        self.chunks_from[donor] += 1
        round_.notify()
        self._check_finished(round_)

    @staticmethod
    def _parts_of(answer: Any, donor: PeerID, chunk: int) -> list[Any]:
        decoded = decode_chunk_answer(answer, donor, chunk)
        if isinstance(decoded, StateRefusal):
            raise _DonorFailed(f"chunk {chunk}: {decoded.status}: {decoded.reason}")
        parts = decoded.parts
        if not isinstance(parts, list):
            raise CorruptChunk(f"chunk {chunk} from {donor} carries no list of parts")
        return parts

    def _drop(self, round_: _Round, session: _Session, reason: str, warn: bool = False) -> None:
        if not session.alive:
            return
        session.alive = False
        donor = session.peer_id
        self.dropped[donor] = reason
        (logger.warning if warn else logger.info)("dropping donor %s: %s", donor, reason)
        round_.scheduler.remove_donor(donor)
        round_.donors.pop(donor, None)
        for (fetcher, _), fetch in list(round_.fetches.items()):
            if fetcher == donor:
                fetch.cancel()
        self._fill()  # a replacement, if any candidate is left
        round_.notify()
        self._check_finished(round_)


async def load_state_from_peers(
    peer: Peer,
    dht_node: DHTNode,
    *,
    prefix: str,
    timeout: float | None = None,
    **options: Any,
) -> State | None:
    """Download the best state shared under ``prefix``: ``(metadata, tensors)``, or None
    if no donor could provide it within ``timeout`` seconds (see :class:`StateDownloader`
    for the options)."""
    downloader = StateDownloader(peer, dht_node, prefix=prefix, **options)
    return await downloader.run(timeout)
