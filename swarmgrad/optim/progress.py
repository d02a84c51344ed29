"""Training progress records and how the swarm's progress is derived from them.

Each peer of a run publishes one :class:`LocalTrainingProgress` record in the DHT, under
the key ``f"{run_id}_progress"`` and a subkey that holds its own owner marker, so that
only that peer can write it (:class:`~swarmgrad.dht.crypto.Ed25519SignatureValidator`)
and the schema (:class:`TrainingProgressSchema`) bounds every field.

:func:`aggregate_progress` turns the records a peer read into a
:class:`GlobalTrainingProgress`: the swarm's epoch, the samples accumulated towards
``target_batch_size`` in that epoch, the number of peers and clients, and when the epoch
should complete. It is a pure function (no I/O), so the rules below are tested directly.

**Records that lie.** Anyone may publish a record under their own key, and a faulty or
hostile peer may publish absurd figures. What a single record says has a bounded effect:

* a record written "in the future" (more than ``max_time_skew`` seconds ahead of our
  clock) is ignored; an older one is extrapolated at most ``max_extrapolation`` seconds;
* a peer's rate counts at most ``rate_clip`` times the lower median of all rates (so one
  peer's 1e18 samples/s does not make the swarm's ETA zero);
* a peer's samples count at most what its clipped rate could have produced since this
  peer saw the epoch begin (plus ``plausibility_grace`` seconds' worth, 0 by default),
  and never more than the target. So a liar counts as at most ``rate_clip`` peers of
  median speed: with 8 honest peers an epoch ends after at least 8/10 of the target's
  honest samples, with 2 after 1/2. Honest peers are undercounted a little the same
  way (one that moved to the epoch before us, one much faster than the median), which
  only makes an epoch somewhat larger than ``target_batch_size``: every sample still
  counts in the average, weighted by what each peer accumulated;
* an epoch claimed by a peer whose claims were shown to be unbacked (no donor could serve
  a state that new, see :meth:`~.progress_tracker.ProgressTracker.distrust_epochs_above`)
  counts only up to our own epoch: such a peer can no longer move us.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pydantic
from pydantic import StrictBool, StrictBytes, confloat, conint

from swarmgrad.dht.schema import BytesWithPublicKey

__all__ = [
    "GlobalTrainingProgress",
    "LocalTrainingProgress",
    "ProgressRules",
    "TrainingProgressSchema",
    "aggregate_progress",
]

MAX_EPOCH = 2**53  # an epoch counter beyond this is not a training run
MAX_SAMPLES = 2**62  # fits msgpack's int64 with room to add


class LocalTrainingProgress(pydantic.BaseModel):
    """What one peer says about itself (hivemind's field names)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="ignore")

    peer_id: StrictBytes
    epoch: conint(ge=0, le=MAX_EPOCH, strict=True)
    samples_accumulated: conint(ge=0, le=MAX_SAMPLES, strict=True)
    samples_per_second: confloat(ge=0.0, allow_inf_nan=False, strict=True)
    time: confloat(allow_inf_nan=False, strict=True)
    client_mode: StrictBool


class TrainingProgressSchema(pydantic.BaseModel):
    """The DHT key ``{run_id}_progress``: one entry per peer, under its owner marker; None
    is a peer's goodbye."""

    progress: dict[BytesWithPublicKey, LocalTrainingProgress | None]


@dataclass
class GlobalTrainingProgress:
    """The swarm's progress as one peer sees it (hivemind's fields)."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_epoch: float
    next_fetch_time: float
    # the swarm's rate (each peer's clipped as counted) and its samples extrapolated to
    # estimated_at (records plus rate x age): where the swarm stands at any moment, the
    # same for every reader whatever its own clock of the epoch (see samples_at)
    samples_per_second: float = 0.0
    samples_estimated: float = 0.0
    estimated_at: float = 0.0

    def samples_at(self, time: float) -> float:
        """The swarm's samples this epoch extrapolated to DHT ``time``."""
        return self.samples_estimated + max(0.0, time - self.estimated_at) * self.samples_per_second


@dataclass(frozen=True)
class ProgressRules:
    """How records are read and how often to read them again (seconds unless noted)."""

    min_refresh_period: float = 0.5
    max_refresh_period: float = 10.0
    default_refresh_period: float = 3.0  # after a read that failed (see ProgressTracker)
    expected_drift_peers: float = 3.0
    expected_drift_rate: float = 0.2
    max_time_skew: float = 10.0
    max_extrapolation: float = 60.0
    rate_clip: float = 2.0
    plausibility_grace: float = 0.0
    # a record is republished when the others' extrapolation of it misses by more than
    # this fraction of target_batch_size (see ProgressTracker)
    report_tolerance: float = 0.01


def _lower_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def aggregate_progress(
    records: Mapping[bytes, LocalTrainingProgress],
    *,
    local_key: bytes,
    local: LocalTrainingProgress,
    target_batch_size: int,
    now: float,
    epoch_started_at: float,
    distrusted: frozenset[bytes] = frozenset(),
    rules: ProgressRules = ProgressRules(),
    observing_since: float | None = None,
    read_failed: bool = False,
) -> GlobalTrainingProgress:
    """The swarm's progress from the peers' ``records`` (subkey -> record) and our own
    ``local`` progress (which replaces whatever the DHT still holds under ``local_key``).

    ``epoch_started_at`` is when this peer saw the current global epoch begin; claims of
    samples are checked against it (see the module docstring). ``observing_since``:
    when this peer began reading the swarm; the next read is planned at most half that
    long ahead (see below). ``read_failed``: the last read of the swarm failed (the DHT
    unreachable or slow): the next one waits ``default_refresh_period``."""
    peers = {key: record for key, record in records.items() if key != local_key}
    peers = {key: r for key, r in peers.items() if r.time <= now + rules.max_time_skew}
    entries = [(local_key, local), *peers.items()]

    epoch = local.epoch
    for key, record in entries:
        if record.client_mode and key != local_key:
            continue  # client peers share no state: their epoch cannot be caught up with
        claimed = record.epoch
        if key in distrusted:
            claimed = min(claimed, local.epoch)  # it may not pull us anywhere
        epoch = max(epoch, claimed)

    # peers that measured no speed yet count as 0: a liar cannot be its own median
    rate_cap = rules.rate_clip * _lower_median([r.samples_per_second for _, r in entries])
    elapsed = max(0.0, now - epoch_started_at)

    samples = 0
    estimated = 0.0
    total_rate = 0.0
    for key, record in entries:
        rate = min(record.samples_per_second, rate_cap)
        total_rate += rate
        if record.epoch != epoch:
            continue
        counted = float(record.samples_accumulated)
        if key != local_key:
            plausible = rate * (elapsed + rules.plausibility_grace)
            counted = min(counted, plausible, float(target_batch_size))
        samples += int(counted)
        age = min(max(0.0, now - record.time), rules.max_extrapolation)
        estimated += counted + age * rate

    num_peers = len(entries)
    num_clients = sum(1 for _, record in entries if record.client_mode)
    remaining = max(0.0, target_batch_size - estimated)
    if remaining == 0:
        eta = 0.0
    elif total_rate > 0:
        eta = remaining / total_rate
    else:
        eta = math.inf
    expected_max_peers = max(
        num_peers + rules.expected_drift_peers, num_peers * (1 + rules.expected_drift_rate)
    )
    # Read again before enough newcomers could have finished the epoch unseen.
    if math.isfinite(eta):
        refresh = eta * num_peers / expected_max_peers
    else:  # peers, none with a speed yet: most likely starting, and their pace is
        # news soon (peers that waited the default 3 s in epoch 0 learnt the swarm's
        # pace after the rest had synced their first streaming fragment without them).
        # That holds for a peer that sees only itself, too: at start the others'
        # records are often a moment from reaching its DHT (lab: a peer whose first
        # read came back alone read again 3 s later, after the others had averaged
        # epoch 0 without it, and downloaded their state). A swarm that is idle
        # instead costs one small read per min_refresh_period.
        refresh = rules.min_refresh_period
    if observing_since is not None:
        # Speeds published in a swarm's first seconds are lower bounds (a peer's first
        # step includes its start-up), so its first ETAs are far too long: lab peers that
        # read 38 s at their fourth second planned their next read 10 s ahead and missed
        # epoch 0, which ended 3 s later. An estimate from T seconds of watching is not
        # trusted beyond T / 2; after twice max_refresh_period this changes nothing.
        refresh = min(refresh, 0.5 * max(0.0, now - observing_since))
    if read_failed:  # no point asking a DHT that just failed again at once
        refresh = rules.default_refresh_period
    refresh = min(max(refresh, rules.min_refresh_period), rules.max_refresh_period)
    return GlobalTrainingProgress(
        epoch=epoch,
        samples_accumulated=samples,
        target_batch_size=target_batch_size,
        num_peers=num_peers,
        num_clients=num_clients,
        eta_next_epoch=now + eta,
        next_fetch_time=now + refresh,
        samples_per_second=total_rate,
        samples_estimated=estimated,
        estimated_at=now,
    )
