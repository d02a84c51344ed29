"""Per-peer metrics records: what each peer of a run tells the monitor about itself.

Every peer of a run publishes one small :class:`PeerMetrics` record in the DHT under the
key ``f"{run_id}_peer_metrics"`` and a subkey holding its own owner marker, so only that peer
can write it (:class:`~swarmgrad.dht.crypto.Ed25519SignatureValidator`, as for the
progress records of :mod:`.progress`), with :class:`MetricsSchema` bounding every field.
The run's id is also written, unsigned, under the directory key :data:`RUNS_KEY` (subkey:
the run id, value: the time), so that a monitor given no run id can find the runs.

:class:`MetricsPublisher` is the task that publishes the record every ``period``
seconds; the collaborative :class:`~.optimizer.Optimizer` starts one (its ``metrics``
argument) and ``swarmgrad server`` starts one for its experts. Whoever starts it gives a
``collect`` callable for the fields it knows (epoch, averaging rounds, experts, ...); the
publisher adds the peer's id, the time, the bytes its sockets moved, and the mean of the
losses reported with :meth:`MetricsPublisher.report_loss` since the last record.

These records live here, with the optimizer that publishes them, rather than in
``swarmgrad/monitor/`` (which reads them): the Optimizer may only import from layers
below it (``docs/design-notes.md``, "Monitoring").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable
from typing import Annotated, Any

import pydantic
from pydantic import Field, StrictBool, StrictBytes, confloat, conint, constr

from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.dht import DHT
from swarmgrad.dht.schema import BytesWithPublicKey, SchemaValidator
from swarmgrad.dht.validation import serialize
from swarmgrad.net.identity import Identity
from swarmgrad.optim.peer_record import PeerRecord
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = [
    "MAX_METRICS_BYTES",
    "RUNS_KEY",
    "MetricsPublisher",
    "MetricsSchema",
    "OffenderMetrics",
    "PeerMetrics",
    "RunDirectorySchema",
    "metrics_key",
]

logger = logging.getLogger(__name__)

RUNS_KEY = "swarmgrad_runs"  # directory of runs: subkey run id -> time last announced
MAX_METRICS_BYTES = 16 * 1024  # a serialized record above this is refused by readers
MAX_EXPERTS_LISTED = 64
MAX_OFFENDERS_LISTED = 32
_COUNT = conint(ge=0, le=2**62, strict=True)
_RUN_ID = constr(min_length=1, max_length=128, strict=True)


def metrics_key(run_id: str) -> str:
    """The DHT key under which a run's peers publish their metrics. Not
    ``f"{run_id}_metrics"``: hivemind's ALBERT example (and programs made from it) keeps
    its ``LocalMetrics`` there, under a schema that refuses our records, and ours would
    refuse theirs."""
    return f"{run_id}_peer_metrics"


class OffenderMetrics(pydantic.BaseModel):
    """What robust averaging held against one peer (``averaging/robust/offenders.py``)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="ignore")

    clipped_rounds: _COUNT = 0
    clipped_parts: _COUNT = 0
    bad_reductions: _COUNT = 0
    banned: StrictBool = False


class PeerMetrics(pydantic.BaseModel):
    """One peer's record; counters are cumulative since the peer started."""

    model_config = pydantic.ConfigDict(frozen=True, extra="ignore")

    peer_id: Annotated[StrictBytes, Field(max_length=64)]
    time: confloat(allow_inf_nan=False, strict=True)
    role: constr(max_length=16, strict=True) = "trainer"  # trainer, client, auxiliary, server
    client_mode: StrictBool = False
    epoch: conint(ge=0, le=2**53, strict=True) = 0
    loss: confloat(allow_inf_nan=False, strict=True) | None = None
    samples_per_second: confloat(ge=0.0, allow_inf_nan=False, strict=True) = 0.0
    rounds_ok: _COUNT = 0
    rounds_failed: _COUNT = 0
    bytes_sent: _COUNT = 0
    bytes_received: _COUNT = 0
    num_experts: _COUNT = 0
    experts: Annotated[
        list[constr(max_length=256, strict=True)], Field(max_length=MAX_EXPERTS_LISTED)
    ] = []
    expert_batches: _COUNT = 0  # forward and backward batches the experts processed
    offenders: Annotated[
        dict[constr(max_length=64, strict=True), OffenderMetrics],
        Field(max_length=MAX_OFFENDERS_LISTED),
    ] = {}


class MetricsSchema(pydantic.BaseModel):
    """The DHT key ``{run_id}_peer_metrics`` (:func:`metrics_key`; the field's name makes
    the key): one entry per peer, under its owner marker; None is a peer's goodbye."""

    peer_metrics: dict[BytesWithPublicKey, PeerMetrics | None]


class RunDirectorySchema(pydantic.BaseModel):
    """The DHT key :data:`RUNS_KEY`: run id -> DHT time at which a peer last announced it."""

    swarmgrad_runs: dict[_RUN_ID, confloat(allow_inf_nan=False, strict=True)]


def _add_offenders(total: dict[str, dict[str, Any]], offenders: dict[str, dict[str, Any]]):
    for peer, counts in offenders.items():
        entry = total.setdefault(
            str(peer),
            {"clipped_rounds": 0, "clipped_parts": 0, "bad_reductions": 0, "banned": False},
        )
        for name in ("clipped_rounds", "clipped_parts", "bad_reductions"):
            entry[name] += int(counts.get(name, 0))
        entry["banned"] = entry["banned"] or bool(counts.get("banned", False))


def merge_offenders(*sources: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Offence counts of several averagers (``DecentralizedAverager.offenders``) summed
    per peer, the :data:`MAX_OFFENDERS_LISTED` worst kept."""
    total: dict[str, dict[str, Any]] = {}
    for source in sources:
        _add_offenders(total, source)
    worst = sorted(
        total.items(),
        key=lambda item: -(item[1]["clipped_rounds"] + item[1]["bad_reductions"]),
    )
    return dict(worst[:MAX_OFFENDERS_LISTED])


def training_fields(
    role: str, client_mode: bool, epoch: int, samples_per_second: float, averagers: Any
) -> dict[str, Any]:
    """The record fields a collaborative optimizer knows, from its averagers' counters
    (shared by ``Optimizer`` and ``DiLoCoOptimizer``)."""
    averagers = list(averagers)
    return {
        "role": role,
        "client_mode": client_mode,
        "epoch": epoch,
        "samples_per_second": float(samples_per_second),
        "rounds_ok": sum(a.rounds_succeeded for a in averagers),
        "rounds_failed": sum(a.rounds_failed for a in averagers),
        "offenders": merge_offenders(*(a.offenders for a in averagers)),
    }


def is_scalar_loss(loss: Any) -> bool:
    """Whether a closure's result can go in a record (a number or a one-element tensor)."""
    if hasattr(loss, "numel") and hasattr(loss, "detach"):
        return loss.numel() == 1
    return isinstance(loss, int | float) and not isinstance(loss, bool)


class MetricsPublisher:
    """Publishes this peer's :class:`PeerMetrics` every ``period`` seconds (module
    docstring). The default, 30 s, is for slow links: one publication costs about 4 KB
    sent (a lookup and the stores on the key's nearest nodes, measured in a swarm of
    5), which at 5 s was a sixth of what a DiLoCo peer sent in a whole run.

    ``collect()`` returns the fields its owner knows (any of :class:`PeerMetrics`' but
    ``peer_id``, ``time``, ``loss`` and the byte counts); it runs on the event loop
    thread, so it must be quick and must not block. ``expiration``: how long a record
    lives (default: ``max(60, 3 * period)`` s). ``identity`` signs the record (default:
    the DHT peer's). The task runs on the process's event loop thread; :meth:`shutdown`
    stops it and says goodbye (a None record).
    """

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        collect: Callable[[], dict[str, Any]] | None = None,
        *,
        period: float = 30.0,
        expiration: float | None = None,
        identity: Identity | None = None,
        start: bool = True,
    ):
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 128:
            raise ValidationError(f"run_id must be a str of 1 to 128 characters, got {run_id!r}")
        if isinstance(period, bool) or not isinstance(period, int | float) or not period > 0:
            raise ValidationError(f"the metrics period must be a positive number, got {period!r}")
        if expiration is None:
            expiration = max(60.0, 3 * float(period))
        if isinstance(expiration, bool) or not isinstance(expiration, int | float):
            raise ValidationError(f"expiration must be a number of seconds, got {expiration!r}")
        if not expiration > period:
            raise ValidationError(
                f"expiration ({expiration} s) must exceed the period ({period} s): records "
                "would vanish between two publications"
            )
        if dht.peer is None:
            raise ValidationError("the DHT is not running: start it before the MetricsPublisher")
        self.dht, self.run_id, self.key = dht, run_id, metrics_key(run_id)
        self.period, self.expiration = float(period), float(expiration)
        self._collect = collect if collect is not None else dict
        signer = Ed25519SignatureValidator(identity if identity is not None else dht.peer.identity)
        self._subkey = signer.local_public_key
        dht.add_validators(
            [
                SchemaValidator(MetricsSchema, prefix=run_id),
                SchemaValidator(RunDirectorySchema),
                signer,
            ]
        )
        self._lock = threading.Lock()
        self._loss_sum, self._loss_count = 0.0, 0
        self._last_loss: float | None = None
        self.last_record: PeerMetrics | None = None
        self.published = 0
        self._warned_size = False
        self._record = PeerRecord(
            dht, self.key, self._subkey, self.expiration, f"the metrics record of {run_id}"
        )
        if start:
            self.start()

    def report_loss(self, loss: Any) -> None:
        """Add a training loss (a number or a one-element tensor) to the next record,
        which carries the mean of the losses reported since the previous one. A loss that
        is not finite is left out (and logged at debug level)."""
        if hasattr(loss, "detach"):
            loss = loss.detach()
            if loss.numel() != 1:
                raise ValidationError(
                    f"report a scalar loss, got a tensor of shape {tuple(loss.shape)}"
                )
            loss = loss.item()
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            raise ValidationError(f"the loss must be a number, got {type(loss).__name__}")
        value = float(loss)
        if not math.isfinite(value):
            logger.debug("%s: a non-finite loss (%r) is not published", self.run_id, value)
            return
        with self._lock:
            self._loss_sum += value
            self._loss_count += 1

    def make_record(self) -> PeerMetrics:
        """The record as it would be published now (also what the task publishes)."""
        fields = dict(self._collect())
        with self._lock:
            if self._loss_count:
                self._last_loss = self._loss_sum / self._loss_count
                self._loss_sum, self._loss_count = 0.0, 0
            loss = self._last_loss
        peer = self.dht.peer
        experts = [str(uid) for uid in fields.pop("experts", ())]
        fields.setdefault("num_experts", len(experts))
        fields["experts"] = experts[:MAX_EXPERTS_LISTED]
        fields["offenders"] = merge_offenders(fields.get("offenders") or {})
        return PeerMetrics(
            **fields,
            peer_id=self.dht.peer_id.to_bytes(),
            time=float(get_dht_time()),
            loss=loss,
            bytes_sent=peer.bytes_sent if peer is not None else 0,
            bytes_received=peer.bytes_received if peer is not None else 0,
        )

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        if self._record.task is not None:
            raise ValidationError("this MetricsPublisher is already running")
        self._record.start(self._run())

    def is_alive(self) -> bool:
        return self._record.is_alive()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop publishing and store a None record (goodbye), waiting at most ``timeout``."""
        self._record.withdraw(timeout)

    async def _run(self) -> None:
        stop = self._record.stop
        while not stop.is_set():
            await self._publish_once()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period):
                    await stop.wait()

    async def _publish_once(self) -> None:
        node = self.dht.node
        if node is None:
            return
        try:
            record = self.make_record()
        except Exception as e:  # a collect() that failed must not stop the metrics
            logger.warning("%s: could not collect this peer's metrics: %r", self.run_id, e)
            return
        value = record.model_dump()
        size = len(serialize(value))
        if size > MAX_METRICS_BYTES:  # long expert uids: the list goes, the count stays
            record = record.model_copy(update={"experts": []})
            value = record.model_dump()
            if not self._warned_size:
                self._warned_size = True
                logger.warning(
                    "%s: this peer's metrics record is %d bytes (limit %d): publishing it "
                    "without the list of experts",
                    self.run_id,
                    size,
                    MAX_METRICS_BYTES,
                )
            size = len(serialize(value))
        if size > MAX_METRICS_BYTES:  # cannot happen with the schema's bounds; be sure
            logger.warning("%s: a metrics record of %d bytes is not published", self.run_id, size)
            return
        expiration = record.time + self.expiration
        try:
            async with asyncio.timeout(max(self.period, 5.0)):
                await node.store_many(
                    [self.key, RUNS_KEY],
                    [value, record.time],
                    expiration,
                    subkeys=[self._subkey, self.run_id],
                )
        except (Exception, TimeoutError) as e:
            logger.debug("%s: publishing metrics failed: %r", self.run_id, e)
            return
        self.last_record = record
        self.published += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.run_id!r}, published {self.published})"
