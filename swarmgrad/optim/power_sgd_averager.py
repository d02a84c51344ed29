"""``PowerSGDGradientAverager``: gradient averaging with PowerSGD low-rank compression.

::

    opt = swarmgrad.Optimizer(
        ...,
        grad_averager_factory=functools.partial(PowerSGDGradientAverager, averager_rank=4),
    )

PowerSGD (Vogels, Karimireddy and Jaggi, 2019, https://arxiv.org/abs/1905.13727) sends a
gradient matrix ``M`` (m x n) as two thin factors, ``r(m + n)`` numbers instead of
``mn``. One step of subspace iteration, shared by the group, gives every member the same
rank-r approximation of the group's *weighted mean* of ``M``:

1. each member computes ``P = M Q`` with the ``Q`` of the previous round (a warm start:
   the subspace improves from round to round; the first ``Q`` comes from a fixed seed,
   the same on every member);
2. phase ``powersgd-p``: the group averages the ``P`` factors, and in the same
   all-reduce the tensors that are not worth factorising (biases, small matrices);
3. each member orthonormalises the averaged ``P`` into ``P^`` and computes
   ``Q = M^T P^``;
4. phase ``powersgd-q``: the group averages the ``Q`` factors;
5. each member replaces its gradient by ``P^ Q^T``, which is ``P^ P^^T`` times the
   group's weighted mean of ``M``: the same values on every member.

Both phases run in the group that matchmaking formed, through the averager's
``aggregate`` hook (:class:`~swarmgrad.averaging.averager_core.AveragingRound`).

**Error feedback, counted in samples.** What a round leaves out is not lost but sent
later. Each member keeps ``E``: the part of its gradients that the group has not applied
yet, as a *sum over samples* (round weight times mean gradient, the weight being its
samples). In a round of weight ``w`` it averages ``M = g + E / w`` (``g``: its mean
gradient), so the weighted sum the group computes, ``sum(w M) = sum(w g) + sum(E)``,
carries everything still owed whatever the weights are this time; afterwards it keeps
``E = w (M - P^ Q_own^T)``, with ``Q_own = M^T P^`` its own ``Q`` before phase
``powersgd-q``: the part of its own ``M`` outside the group's subspace. Hence, for any
weights, round after round::

    sum over rounds of (total weight x applied gradient) + sum of the members' E
        = sum over rounds and members of (weight x mean gradient)

Why in samples: peers contribute different numbers of samples from one epoch to the
next; an ``E`` kept as a mean gradient would enter the next round scaled by the
member's new share of the weight rather than by what it held back, and would be dropped
by a round in which the member has no samples (weight 0). Such a member still applies
the group's result and keeps its ``E`` for a later round.

Why ``Q_own`` and not the averaged ``Q`` (as PyTorch's DDP hook and hivemind 1.1 do):
both give the same sum of ``E``, but ``M - P^ Q^T`` also holds the member's whole
difference from the group's mean, ``M - mean(M)``, which never shrinks and, where
members' gradients differ persistently, grows round after round; ``M - P^ Q_own^T``
holds only the part of that difference outside the subspace (which still accumulates,
more slowly, in directions the subspace does not visit). The two coincide when members
hold the same gradient. A member that leaves the run takes its ``E`` with it.

A gradient of rank at most ``r`` whose column space the group shares is sent exactly,
with nothing left over. For others, the applied updates approach the mean over the
rounds: their distance from it is the sum of ``E`` divided by everything sent so far,
and the sum of ``E`` levels off, since a direction left out grows in ``E`` until it is
among the largest of ``M`` and the subspace turns to it (in practice; one step of
subspace iteration does not guarantee it). In the tests a 32 x 24 gradient at rank 2
levels off near 7 times its own norm within some 20 rounds, so the mean update is
within 7 % of the gradient after 100.

**Orthonormalisation** is Gram-Schmidt run twice per column (stable for the few columns
of ``P``), not a library QR: it makes no sign choice, so members that hold the same
averaged ``P`` get the same ``P^`` whatever linear algebra library they use, and a
column that is (nearly) a combination of the earlier ones becomes zero instead of an
arbitrary direction, so a rank-deficient mean gives a smaller subspace, not a random one.

**Which tensors.** A tensor of two or more dimensions is viewed as an m x n matrix, its
leading dimensions as rows and the others as columns, split where ``m + n`` is smallest
(every member derives the same). It is factorised when that saves at least
``min_compression_ratio`` of its numbers: ``1 - r(m + n) / (mn) >= min_compression_ratio``
(hivemind's meaning of the option), and saves something. Others are averaged as they
are.

**Weights and failures.** Both phases weigh members by their samples, as
:class:`~.grad_averager.GradientAverager` does. The uncompressed tensors behave as in
``GradientAverager``: each span holds the average or stays local. A factorised tensor
changes only as a whole, and only if both of its factors were averaged in full;
otherwise it keeps this peer's own mean gradient (as after a round that found no
group: this round's gradient is applied locally) and its ``E`` and ``Q`` stay as they
were, for a later round. A member whose ``P`` factors were not all averaged cannot compute a ``Q``
consistent with the others': it still runs phase ``powersgd-q`` (it reduces its span for
the others) but with weight 0, and keeps all its factorised tensors local.

**Who averages with whom.** The averager announces an ``aggregate_tag`` naming the rank
and the factorised tensors: peers with another rank, other factorised tensors or plain
``GradientAverager`` never share a round with this one (they cannot: the phases would
not match), and a lone peer configured differently from the rest of its group gets a
``GroupMismatch`` that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from swarmgrad.averaging.rounds import AveragingRound
from swarmgrad.dht.dht import DHT
from swarmgrad.optim.grad_averager import GradientAverager
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError

__all__ = ["PowerSGDGradientAverager", "PowerSGDState", "matrix_shape", "orthonormalize_"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PHASE_P = "powersgd-p"
PHASE_Q = "powersgd-q"
_Q_SEED = 0x90E5  # the first Q factors: the same on every member


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The m x n matrix that a tensor of ``shape`` is viewed as: its leading dimensions
    as rows, the others as columns, split where ``m + n`` (the size of the factors per
    unit of rank) is smallest. None for a tensor of fewer than two dimensions or without
    elements."""
    dims = [int(d) for d in shape]
    if len(dims) < 2 or math.prod(dims) == 0:
        return None
    splits = [(math.prod(dims[:i]), math.prod(dims[i:])) for i in range(1, len(dims))]
    return min(splits, key=sum)  # the first of equals: every member picks the same


def check_rank(rank: Any) -> int:
    return positive_int("averager_rank", rank)


def check_min_compression_ratio(ratio: Any) -> float:
    """The fraction of a tensor's numbers that factorising must save: in [0, 1) (at 1
    nothing could ever be factorised, which is plain averaging by another name)."""
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, int | float)
        or not (0 <= ratio < 1)  # also refuses NaN
    ):
        raise ValidationError(
            f"min_compression_ratio (the fraction of numbers factorising must save) must be "
            f"in [0, 1), got {ratio!r}"
        )
    return float(ratio)


def _factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """Factors and error feedback in float32 (float64 for float64 tensors): the
    projections sum many products, which half precision rounds away."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.no_grad()
def orthonormalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Make the columns of ``matrix`` (m x r, r small) orthonormal in place, in order:
    Gram-Schmidt with each column projected twice (once is not enough in floating point
    when columns are nearly parallel; twice is). A column whose remainder is below
    ``sqrt(eps)`` of its own length depends on the earlier ones and becomes zero. See the
    module docstring for why not ``torch.linalg.qr``. Returns ``matrix``."""
    tolerance = math.sqrt(torch.finfo(matrix.dtype).eps)
    for index in range(matrix.shape[1]):
        column = matrix[:, index]
        length = float(column.norm())
        if index:
            earlier = matrix[:, :index]
            for _ in range(2):
                column.sub_(earlier @ (earlier.T @ column))
        remainder = float(column.norm())
        if remainder > tolerance * length:  # False for zero and NaN columns
            column.div_(remainder)
        else:
            column.zero_()
    return matrix


class PowerSGDState:
    """PowerSGD for a fixed list of tensors (shapes and dtypes of ``templates``): which
    are factorised, their error feedback and warm-started ``Q`` factors, and the steps of
    a round, none of which touches the network.

    :meth:`aggregate` runs a round in a group: :meth:`matrices`, :meth:`project`, phase
    ``powersgd-p``, :meth:`reflect`, phase ``powersgd-q``, :meth:`apply`.
    :meth:`compress_locally` is the same arithmetic for a group of one (what a round
    computes, without a network; the averager never needs it, since a peer alone keeps
    its exact gradient). ``tensors`` given to the steps are the averaged tensors (shapes
    of ``templates``); only :meth:`apply` changes them.

    ``errors[k]`` is ``E`` of the k-th factorised tensor (an m x n matrix) in units of
    the round weight times gradient: see the module docstring.
    """

    def __init__(
        self,
        templates: Sequence[torch.Tensor],
        rank: int,
        min_compression_ratio: float = 0.5,
    ):
        self.rank = check_rank(rank)
        self.min_compression_ratio = check_min_compression_ratio(min_compression_ratio)
        compressed, uncompressed, shapes = [], [], []
        for index, template in enumerate(templates):
            shape = matrix_shape(template.shape)
            saving = 0.0 if shape is None else 1 - self.factor_fraction(*shape)
            # a factorisation that saves nothing would only add error, even at ratio 0
            if saving > 0 and saving >= self.min_compression_ratio:
                compressed.append(index)
                shapes.append(shape)
            else:
                uncompressed.append(index)
        self.num_tensors = len(templates)
        self.compressed: tuple[int, ...] = tuple(compressed)  # indices of factorised tensors
        self.uncompressed: tuple[int, ...] = tuple(uncompressed)
        self.matrix_shapes: tuple[tuple[int, int], ...] = tuple(shapes)
        self.uncompressed_numel = sum(templates[i].numel() for i in uncompressed)
        dtypes = [_factor_dtype(templates[i].dtype) for i in compressed]
        self.errors = [torch.zeros(m, n, dtype=d) for (m, n), d in zip(shapes, dtypes, strict=True)]
        self.qs = []
        for slot, ((_, n), dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            generator = torch.Generator().manual_seed(_Q_SEED + slot)
            self.qs.append(torch.randn(n, self.rank, generator=generator, dtype=dtype))

    def factor_fraction(self, m: int, n: int) -> float:
        """Numbers sent for an m x n matrix, as a fraction of its size."""
        return self.rank * (m + n) / (m * n)

    def sent_fraction(self) -> float:
        """Numbers a round sends, as a fraction of the uncompressed tensors' (both
        phases together); 1.0 when nothing is factorised."""
        factorised = sum(m * n for m, n in self.matrix_shapes)
        factors = sum(self.rank * (m + n) for m, n in self.matrix_shapes)
        plain = self.uncompressed_numel
        return (factors + plain) / (factorised + plain) if factorised + plain else 1.0

    @property
    def tag(self) -> str:
        """What peers must share to average together: the rank and which tensors are
        factorised (as a digest: the list can be long)."""
        digest = hashlib.sha256(repr((self.num_tensors, self.compressed)).encode()).hexdigest()
        return (
            f"PowerSGD rank {self.rank}, {len(self.compressed)} of {self.num_tensors} tensors "
            f"factorised ({digest[:12]})"
        )

    # ------------------------------------------------------------------ the steps

    @torch.no_grad()
    def matrices(self, tensors: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
        """``M = g + E / weight`` for each factorised tensor (new tensors); just ``g``
        with weight 0, when nothing this member sends counts and ``E`` must wait."""
        result = []
        for slot, error in enumerate(self.errors):
            matrix = tensors[self.compressed[slot]].reshape(error.shape).to(error.dtype, copy=True)
            if weight > 0:
                matrix.add_(error, alpha=1.0 / weight)
            result.append(matrix)
        return result

    @torch.no_grad()
    def project(self, matrices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``P = M Q`` for each factorised tensor (new tensors, to be averaged)."""
        return [matrix @ q for matrix, q in zip(matrices, self.qs, strict=True)]

    @torch.no_grad()
    def reflect(
        self, matrices: Sequence[torch.Tensor], ps: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Orthonormalise the (averaged) ``ps`` in place and return ``Q = M^T P^`` for
        each (new tensors, to be averaged)."""
        qs = []
        for matrix, p in zip(matrices, ps, strict=True):
            orthonormalize_(p)
            qs.append((matrix.T @ p).contiguous())
        return qs

    @torch.no_grad()
    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        matrices: Sequence[torch.Tensor],
        ps: Sequence[torch.Tensor],
        qs: Sequence[torch.Tensor],
        *,
        done: Sequence[bool],
        weight: float,
        own_qs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """For each factorised tensor whose factors were averaged (``done``): write
        ``P^ Q^T`` into the tensor, keep ``Q`` as the next round's warm start and, if
        this member's ``M`` counted (``weight`` > 0), ``E = weight (M - P^ Q_own^T)``
        (``own_qs``: this member's ``Q`` before averaging; default ``qs``). The others
        keep their tensor, ``E`` and ``Q``."""
        own_qs = qs if own_qs is None else own_qs
        for slot, ok in enumerate(done):
            if not ok:
                continue
            tensor = tensors[self.compressed[slot]]
            p = ps[slot]
            if weight > 0:
                residual = matrices[slot] - p @ own_qs[slot].T
                if bool(torch.isfinite(residual).all()):
                    self.errors[slot].copy_(residual.mul_(weight))
                else:  # our gradient was not finite, so the group left it out: E waits
                    logger.debug("PowerSGD: tensor %d is not finite here", self.compressed[slot])
            tensor.copy_((p @ qs[slot].T).view(tensor.shape))
            self.qs[slot].copy_(qs[slot])

    def compress_locally(self, tensors: Sequence[torch.Tensor], weight: float = 1.0) -> None:
        """One round in a group of one: each factorised tensor becomes the rank-r
        approximation of its ``M``, as a group's tensors become that of their mean."""
        matrices = self.matrices(tensors, weight)
        ps = self.project(matrices)
        qs = self.reflect(matrices, ps)
        self.apply(tensors, matrices, ps, qs, done=[True] * len(ps), weight=weight)

    # ------------------------------------------------------------------ in a group

    def _start(
        self, tensors: Sequence[torch.Tensor], weight: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        matrices = self.matrices(tensors, weight)
        return matrices, self.project(matrices)

    async def aggregate(self, current: AveragingRound) -> None:
        """Both phases in ``current``'s group (the averager's ``aggregate`` hook)."""
        tensors = current.tensors
        plain = [tensors[i] for i in self.uncompressed]
        weight = current.weight if current.contributes else 0.0
        if current.contributes:
            matrices, ps = await _in_worker(self._start, tensors, weight)
        else:  # an auxiliary member only reduces: its factors are placeholders
            matrices = []
            ps = [
                torch.zeros(m, self.rank, dtype=q.dtype)
                for (m, _), q in zip(self.matrix_shapes, self.qs, strict=True)
            ]
        first = await current.allreduce([*ps, *plain], phase=PHASE_P)
        factors_averaged = all(first.averaged[: len(ps)])
        if current.contributes:
            qs = await _in_worker(self.reflect, matrices, ps)
        else:
            qs = [torch.zeros_like(q) for q in self.qs]
        own_qs = [q.clone() for q in qs]
        second = await current.allreduce(
            qs, phase=PHASE_Q, weight=weight if factors_averaged else 0.0
        )
        if not current.contributes:
            return
        done = [factors_averaged and ok for ok in second.averaged]
        if not all(done):
            logger.info(
                "PowerSGD: %d of %d factorised tensors keep this peer's gradient (%s)",
                done.count(False),
                len(done),
                "P factors not averaged in full" if not factors_averaged else "Q not averaged",
            )
        await _in_worker(
            functools.partial(self.apply, done=done, weight=weight, own_qs=own_qs),
            tensors,
            matrices,
            ps,
            qs,
        )


async def _in_worker(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a worker thread, keeping the event loop free. If the caller
    is cancelled meanwhile, the call is still waited for before the cancellation goes
    on: it works on tensors whose lock the round holds until it returns."""
    task = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((task,))
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise


class PowerSGDGradientAverager(GradientAverager):
    """A :class:`~.grad_averager.GradientAverager` that sends large gradients as PowerSGD
    factors of rank ``averager_rank`` with error feedback (see the module docstring).

    ``min_compression_ratio``: factorise a tensor only if that saves at least this
    fraction of its numbers (hivemind's meaning; default 0.5). Other arguments are
    :class:`GradientAverager`'s (``averaged_grads``, ``reuse_grad_buffers``, ...) and,
    through it, :class:`~swarmgrad.averaging.averager.DecentralizedAverager`'s;
    ``averaging_alpha`` must stay 1 (the factors must be the group's exact average) and
    ``aggregate`` / ``aggregate_tag`` are this class's own.

    Memory: one error-feedback matrix per factorised tensor (its size, float32) and the
    small ``Q`` factors; a round briefly holds one more copy of the factorised
    gradients. The ``Q`` factors are not shared with joining peers (hivemind shares
    them): a joiner starts from the seeded ones, and since the group averages ``P``
    before anyone uses it, a member with another ``Q`` makes that round's subspace a
    little worse, never its result inconsistent.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        averager_rank: int,
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: torch.device | None = None,
        client_mode: bool | None = None,
        warn: bool = True,
        min_compression_ratio: float = 0.5,
        averaged_grads: Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ):
        self.rank = check_rank(averager_rank)
        self.min_compression_ratio = check_min_compression_ratio(min_compression_ratio)
        for own in ("aggregate", "aggregate_tag"):
            if own in kwargs:
                raise ValidationError(
                    f"PowerSGDGradientAverager brings its own aggregate hook: do not pass {own}"
                )
        alpha = kwargs.get("averaging_alpha", 1.0)
        if alpha != 1:
            raise ValidationError(
                f"PowerSGDGradientAverager needs averaging_alpha=1 (the factors must be the "
                f"group's average), got {alpha!r}"
            )
        parameters = tuple(parameters)
        if averaged_grads is not None:
            averaged_grads = list(averaged_grads)
        # the tensors that will be averaged (GradientAverager checks them against the
        # parameters); their dtypes decide the factors'
        templates = averaged_grads if averaged_grads is not None else parameters
        templates = [t for t in templates if isinstance(t, torch.Tensor)]
        self.power_sgd = PowerSGDState(templates, self.rank, self.min_compression_ratio)
        if self.power_sgd.compressed:
            kwargs["aggregate"] = self.power_sgd.aggregate
            kwargs["aggregate_tag"] = self.power_sgd.tag
            logger.info(
                "%s: PowerSGD rank %d factorises %d of %d tensors; a round sends %.1f%% of "
                "their numbers",
                prefix,
                self.rank,
                len(self.power_sgd.compressed),
                len(templates),
                100 * self.power_sgd.sent_fraction(),
            )
        elif templates:
            logger.info(
                "%s: PowerSGD rank %d factorises none of these %d tensors: plain averaging",
                prefix,
                self.rank,
                len(templates),
            )
        super().__init__(
            parameters,
            dht=dht,
            prefix=prefix,
            reuse_grad_buffers=reuse_grad_buffers,
            accumulate_grads_on=accumulate_grads_on,
            client_mode=client_mode,
            warn=warn,
            averaged_grads=averaged_grads,
            **kwargs,
        )
