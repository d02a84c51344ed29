"""Stage training: the peers of one stage keep their replicas together.

Each stage server steps its own optimizer after every backward batch, exactly as an
expert server does (the pipeline is trained in *local-updates* mode: no peer waits for
another before stepping). Left alone the replicas of a stage would drift apart, so every
``average_period`` seconds the peers of a stage average their parameters with the
swarm's :class:`~swarmgrad.averaging.DecentralizedAverager` under the stage's own
prefix (``"<pipeline>.stage.<i>"``): each stage is a small collaborative swarm, and the
averagers of different stages never meet.

The averaging is applied as a delta: the parameters are copied out under the backend's
lock, averaged while the server keeps serving (and stepping), and then each parameter
moves by ``averaged - copied``, so the steps taken during the round are kept.

``mode="diloco"`` averages pseudo-gradients instead (DiLoCo, as
:class:`~swarmgrad.optim.DiLoCoOptimizer` does for whole models): each peer keeps the
stage's parameters as of the last round (the *anchor*); a round averages ``anchor -
parameters`` (how far each peer moved) and an outer optimizer (Nesterov SGD, lr 0.7,
momentum 0.9 by default, ``optim``'s) applies the average to the anchor; each peer
continues from the new anchor plus the steps it took during the round. With an outer
SGD of lr 1 and no momentum this is parameter averaging again.

``mode="gradients"`` is what the SWARM paper does inside a stage: the server does not
step after each backward (its backend's ``gradient_sink`` takes the batch's gradients
instead), it sums the gradients of the micro-batches it served, each weighted by its
samples (the servicer scales each micro-batch's output gradients by its size, see
:func:`swarmgrad.pipeline.server._scaled`), and at each round the stage's peers average
their mean gradients weighted by their samples: the result is the mean gradient per
sample over everything the stage served since the last round, as one large batch would
give. Every peer then steps its own optimizer with that same gradient, so replicas that
started equal (same weights, same optimizer state: a joining peer downloads both) stay
bit-identical as long as every peer takes part; a peer that found no group steps alone
on its own mean gradient (and differs from the others from then on: gradients mode
never averages parameters); a round in which nobody served anything steps nobody.

When rounds happen: at every multiple of ``average_period`` seconds of DHT time (the
shared clock of :func:`~swarmgrad.get_dht_time`), tagged with that multiple's index.
Every peer of the stage wakes at the same moments whatever its start time or load, a
tag keeps a peer that woke late for one round from meeting the next one, and a round
gives up (at most ``averaging_timeout``) just before the next boundary: a peer whose
round found nobody is back in time for the next one. (Without that bound, two peers that
started in different periods each spent a whole timeout alone and kept missing each
other.) So the peers of a stage stay in step without any extra DHT record. The
alternatives were worse for that: counting local micro-batches puts peers that serve at
different rates in different rounds, and a stage-wide ``target_batch_size`` needs a
progress record per stage in the DHT, refreshed with every batch. The cost: a round's
batch is whatever the stage served in the period, so choose the period for the batch
size you want at your throughput, and long enough for a round to average (a round cut
short at the boundary counts as no group: each peer steps alone).

Serving goes on during a round: the accumulated sums are copied out (into the
averager's host buffers, divided by the samples) and zeroed under the backend's lock, as
the parameters mode copies its parameters; the micro-batches served while the round
runs accumulate anew and are applied at the next round (one round late, as hivemind's
delayed gradient averaging does). One accumulator per parameter, no second one: a stage
is the slice of a model that barely fits its peer, and the copy is a memory copy.

The same averager shares the stage's state with peers that join the stage (a new peer,
or one that rebalancing moved here): :meth:`StageAverager.load_state_from_peers`
downloads parameters and optimizer state with the averagers' existing state download.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.averaging import DecentralizedAverager
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.optim.diloco_setup import default_outer_optimizer
from swarmgrad.optim.host_copies import copy_batch
from swarmgrad.pipeline.protocol import stage_key
from swarmgrad.utils.checks import one_of, positive_seconds
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["MODES", "StageAverager", "StageTrainingOptions"]

MODES = ("parameters", "diloco", "gradients")

#: gradients mode: a round gives up this fraction of a period before the next boundary
_ROUND_MARGIN = 0.05

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageTrainingOptions:
    """``average_period``: seconds between averaging rounds of a stage's peers;
    ``averaging_timeout``: how long one round may look for a group and run;
    ``min_matchmaking_time``: how long a round gathers peers;
    ``state_timeout``: how long a joining peer waits for the stage's state;
    ``mode``: ``"parameters"`` (average the parameters), ``"diloco"`` (average
    pseudo-gradients, applied by ``outer_optimizer``, a factory over the anchor tensors;
    default Nesterov SGD lr 0.7 momentum 0.9) or ``"gradients"`` (no step per backward:
    accumulate gradients, average them at every multiple of ``average_period`` seconds
    of DHT time, and every peer steps with the average)."""

    average_period: float = 30.0
    averaging_timeout: float = 30.0
    min_matchmaking_time: float = 5.0
    state_timeout: float = 60.0
    mode: str = "parameters"
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        one_of("mode", self.mode, MODES)
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise ValidationError("outer_optimizer must be a factory: params -> optimizer")
        if self.outer_optimizer is not None and self.mode != "diloco":
            raise ValidationError('outer_optimizer needs mode="diloco"')
        for name in (
            "average_period",
            "averaging_timeout",
            "min_matchmaking_time",
            "state_timeout",
        ):
            positive_seconds(name, getattr(self, name))
        if self.mode == "gradients" and self.min_matchmaking_time >= self.average_period / 2:
            raise ValidationError(
                f"min_matchmaking_time={self.min_matchmaking_time} must be less than half of "
                f'average_period={self.average_period} in mode="gradients": a round must form '
                "its group and average before the next round begins"
            )


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> tuple[Any, list[torch.Tensor]]:
    """The optimizer's state as (msgpack-able skeleton, tensors)."""
    if optimizer is None:
        return None, []
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().cpu())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(value, dict):
            return [[k, strip(v)] for k, v in value.items()]  # int keys survive msgpack
        if isinstance(value, list | tuple):
            return {"__list__": [strip(v) for v in value]}
        return value

    return strip(optimizer.state_dict()), tensors


def _restore(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, dict) and "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if isinstance(skeleton, dict) and "__list__" in skeleton:
        return [_restore(v, tensors) for v in skeleton["__list__"]]
    if isinstance(skeleton, list):
        return {k: _restore(v, tensors) for k, v in skeleton}
    return skeleton


class _StageStateAverager(DecentralizedAverager):
    """Shares the backend's live parameters and optimizer state with joining peers."""

    def __init__(self, backend: ModuleBackend, *args: Any, **kwargs: Any):
        self._backend = backend
        super().__init__(*args, **kwargs)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        backend = self._backend
        with backend.lock:
            params = [p.detach().cpu().clone() for p in backend.module.parameters()]
            skeleton, opt_tensors = _optimizer_tensors(backend.optimizer)
            opt_tensors = [t.clone() for t in opt_tensors]
            counters = {"update_count": backend.update_count}
        metadata = {"num_params": len(params), "optimizer": skeleton, **counters}
        return metadata, params + opt_tensors


class StageAverager:
    """Averages one stage server's parameters with the stage's other peers.

    :param dht: the running DHT of the stage server's peer;
    :param averager_kwargs: more options for the :class:`DecentralizedAverager`
        (``target_group_size``, ``compression``...).
    """

    def __init__(
        self,
        dht: Any,
        pipeline: str,
        stage: int,
        backend: ModuleBackend,
        options: StageTrainingOptions | None = None,
        **averager_kwargs: Any,
    ):
        self.options = options or StageTrainingOptions()
        if not isinstance(self.options, StageTrainingOptions):
            raise ValidationError("options must be StageTrainingOptions")
        self.backend, self.stage = backend, stage
        params = [p for p in backend.module.parameters()]
        if not params:
            raise ValidationError(f"stage {stage} has no parameters to average")
        if self.options.mode == "gradients":
            self._check_gradients_mode()  # before the averager exists: nothing to undo
        self._staging = [p.detach().cpu().clone().contiguous() for p in params]
        self.averager = _StageStateAverager(
            backend,
            self._staging,
            dht,
            start=True,
            prefix=stage_key(pipeline, stage),
            min_matchmaking_time=self.options.min_matchmaking_time,
            **averager_kwargs,
        )
        self._anchor: list[torch.Tensor] = []
        self._outer: torch.optim.Optimizer | None = None
        if self.options.mode == "diloco":
            self._reset_anchor()
        self.rounds = 0
        self.solo_steps = 0  # gradients mode: steps on this peer's own gradient alone
        self._params = params
        self._accumulators: list[torch.Tensor] = []
        self._samples = 0  # served since the last round (guarded by the backend's lock)
        if self.options.mode == "gradients":
            self._install_gradient_sink()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ averaging

    def _reset_anchor(self) -> None:
        """The current parameters become the anchor, with a fresh outer optimizer."""
        with self.backend.lock:
            self._anchor = [p.detach().cpu().clone() for p in self.backend.module.parameters()]
        make_outer = self.options.outer_optimizer or default_outer_optimizer
        self._outer = make_outer(self._anchor)

    def average_once(self) -> bool:
        """One averaging round; True if it averaged with at least one other peer."""
        if self.options.mode == "diloco":
            return self._outer_step()
        if self.options.mode == "gradients":
            return self._gradient_round()
        params = list(self.backend.module.parameters())
        with self.backend.lock, self.averager.get_tensors() as staging:
            for buffer, param in zip(staging, params, strict=True):
                buffer.copy_(param.detach().cpu())
            copied = [buffer.clone() for buffer in staging]
        result = self.averager.step(timeout=self.options.averaging_timeout)
        if not result:
            return False
        with self.backend.lock, self.averager.get_tensors() as staging, torch.no_grad():
            for param, averaged, before in zip(params, staging, copied, strict=True):
                param.add_((averaged - before).to(param.device))
        self.rounds += 1
        return True

    def _outer_step(self) -> bool:
        """DiLoCo: average the pseudo-gradients, step the anchor, move the parameters by
        as much as the anchor moved (the steps taken meanwhile are kept)."""
        params = list(self.backend.module.parameters())
        with self.backend.lock, self.averager.get_tensors() as staging:
            copied = [p.detach().cpu().clone() for p in params]
            for buffer, anchor, now in zip(staging, self._anchor, copied, strict=True):
                buffer.copy_(anchor - now)
        if not self.averager.step(timeout=self.options.averaging_timeout):
            return False  # nobody to average with: train on, the anchor stays
        assert self._outer is not None
        with self.averager.get_tensors() as staging:
            for anchor, averaged in zip(self._anchor, staging, strict=True):
                anchor.grad = averaged.clone()
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        with self.backend.lock, torch.no_grad():
            for param, anchor, now in zip(params, self._anchor, copied, strict=True):
                # param = new anchor + (param - copied): the steps taken during the round
                param.add_((anchor - now).to(param.device))
        self.rounds += 1
        return True

    # ------------------------------------------------------------------ gradients mode

    def _check_gradients_mode(self) -> None:
        if self.backend.optimizer is None:
            raise ValidationError(
                f'stage {self.stage}: mode="gradients" needs the backend\'s optimizer, which '
                "applies the averaged gradients"
            )
        if self.backend.gradient_sink is not None:
            raise ValidationError(
                f"stage {self.stage}: the backend already hands its gradients to another "
                "averager; one backend, one gradient averager"
            )

    def _install_gradient_sink(self) -> None:
        with self.backend.lock:
            try:
                self._check_gradients_mode()
            except ValidationError:
                self.averager.shutdown()
                raise
            self._accumulators = [
                torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self._params
            ]
            self.backend.gradient_sink = self._accumulate

    @torch.no_grad()
    def _accumulate(self, batch_size: int) -> None:
        """The backend's gradient sink: on the runtime's thread (or the server's event loop,
        for a lone cheap batch of a CPU stage: moe/server/runtime.py), always under the
        backend's lock, with the batch's ``sum(n_i * g_i)`` in the parameters' ``.grad``."""
        for accumulator, param in zip(self._accumulators, self._params, strict=True):
            if param.grad is not None:
                accumulator.add_(param.grad)
        self._samples += batch_size

    def _gradient_round(
        self,
        round_tag: str = "",
        scheduled_time: float | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Copy out this peer's mean gradient, average it with the stage's peers weighted
        by samples, step with the result (alone, on the local mean, if no group formed).
        True if it averaged with at least one other peer."""
        with self.backend.lock, self.averager.get_tensors() as staging:
            copy_batch(zip(self._accumulators, staging, strict=True))
            for accumulator in self._accumulators:
                accumulator.zero_()
            samples, self._samples = self._samples, 0
        with self.averager.get_tensors() as staging:
            for buffer in staging:
                if samples:
                    buffer.div_(samples)
                else:
                    buffer.zero_()
        try:
            gathered = self.averager.step(
                gather={"samples": samples},
                weight=float(samples),
                scheduled_time=scheduled_time,
                timeout=self.options.averaging_timeout if timeout is None else timeout,
                round_tag=round_tag,
            )
        except Exception as e:  # the gradients are copied out: step on them, not lose them
            logger.warning("stage %d: a gradient round failed: %r", self.stage, e)
            gathered = None
        if gathered:
            total = sum(_samples_of(data) for data in gathered.values())
        else:
            total = samples  # no group: this peer's own gradient, if it served anything
        if total > 0:
            self._apply_staged_gradients()
            if not gathered:
                self.solo_steps += 1
        if not gathered:
            if samples:
                logger.info(
                    "stage %d: no group for the gradient round; stepped alone on %d samples",
                    self.stage,
                    samples,
                )
            return False
        self.rounds += 1
        return True

    def _apply_staged_gradients(self) -> None:
        """One optimizer step with the averager's buffers as the gradients."""
        backend = self.backend
        with backend.lock, self.averager.get_tensors() as staging, torch.no_grad():
            bad = [i for i, g in enumerate(staging) if not bool(torch.isfinite(g).all())]
            if bad:
                logger.warning(
                    "stage %d: the averaged gradient of parameters %s is not finite; step skipped",
                    self.stage,
                    bad[:8],
                )
                return
            for param, averaged in zip(self._params, staging, strict=True):
                if param.requires_grad:
                    param.grad = averaged.to(param.device, copy=True)
            try:
                backend.apply_gradients()
            finally:
                backend.module.zero_grad(set_to_none=True)

    def _reset_accumulators(self) -> None:
        with self.backend.lock:
            for accumulator in self._accumulators:
                accumulator.zero_()
            self._samples = 0

    def load_state_from_peers(self) -> bool:
        """Take the stage's parameters and optimizer state from its other peers; False
        (state unchanged) if none answered within ``state_timeout``."""
        deadline = time.monotonic() + self.options.state_timeout
        state = None
        while state is None:  # a donor's declaration may not have reached the DHT yet
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            state = self.averager.load_state_from_peers(timeout=min(remaining, 10.0))
        metadata, tensors = state
        params = list(self.backend.module.parameters())
        num_params = metadata.get("num_params") if isinstance(metadata, dict) else None
        if num_params != len(params) or len(tensors) < num_params:
            raise ValidationError(
                f"stage {self.stage}: a peer's state has {num_params} parameters, this "
                f"stage's module has {len(params)}"
            )
        for i, (param, tensor) in enumerate(zip(params, tensors[:num_params], strict=True)):
            if param.shape != tensor.shape:
                raise ValidationError(
                    f"stage {self.stage}: parameter {i} has shape {list(param.shape)}, the "
                    f"downloaded one {list(tensor.shape)}"
                )
        with self.backend.lock, torch.no_grad():
            for param, tensor in zip(params, tensors[:num_params], strict=True):
                param.copy_(tensor.to(param.device))
            if self.backend.optimizer is not None and metadata.get("optimizer") is not None:
                restored = _restore(metadata["optimizer"], list(tensors[num_params:]))
                self.backend.optimizer.load_state_dict(restored)
            self.backend.update_count = int(metadata.get("update_count", 0))
        if self.options.mode == "diloco":
            self._reset_anchor()  # the downloaded parameters are where this peer starts
        if self.options.mode == "gradients":
            self._reset_accumulators()  # gradients of the replaced weights
        logger.info("stage %d: loaded the stage's state from its peers", self.stage)
        return True

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        """Average every ``average_period`` seconds on a background thread."""
        if self._thread is not None:
            raise ValidationError("this stage averager was already started")
        self._thread = threading.Thread(
            target=self._run, name=f"stage-{self.stage}-averaging", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        gradients = self.options.mode == "gradients"
        while True:
            if gradients:  # at the next multiple of the period, in DHT time
                period = self.options.average_period
                index = math.floor(get_dht_time() / period) + 1
                delay = index * period - get_dht_time()
            else:
                delay = self.options.average_period
            if self._stop.wait(max(delay, 0.0)):
                return
            try:
                if gradients:  # a round ends before the next one's boundary: see above
                    end = (index + 1 - _ROUND_MARGIN) * period
                    self._gradient_round(
                        round_tag=f"g{index}",
                        scheduled_time=index * period + self.options.min_matchmaking_time,
                        timeout=max(min(self.options.averaging_timeout, end - get_dht_time()), 0.1),
                    )
                else:
                    self.average_once()
            except Exception as e:  # one failed round must not stop the next
                logger.warning("stage %d: an averaging round failed: %r", self.stage, e)

    def shutdown(self) -> None:
        """Stop averaging; in gradients mode the backend steps after each backward
        again, and the gradients accumulated since the last round are dropped."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if self._accumulators:
            with self.backend.lock:
                if self.backend.gradient_sink == self._accumulate:
                    self.backend.gradient_sink = None
        self.averager.shutdown()
        if thread is not None:
            thread.join(self.options.averaging_timeout + 10)


def _samples_of(gathered: Any) -> int:
    """The samples a group member says it contributed (0 if it says nothing sensible:
    a remote peer's data)."""
    value = gathered.get("samples") if isinstance(gathered, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value
