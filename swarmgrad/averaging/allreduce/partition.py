"""The averaged tensors as one vector, cut into spans (one per reducing member) and parts.

:class:`TensorPartContainer` is the sender's side: it treats the local tensors as one
flat vector without copying it, plans which elements belong to which member's span and
how each span is cut into parts of about ``part_size_bytes``, serializes parts for
sending, and writes averaged parts back into the local tensors.

:class:`TensorPartReducer` is the owner's side: it sums weighted parts from every sender
of its span, part by part, and finishes a part once every sender still in the round has
delivered it.

Why parts never straddle two tensors (unless both pieces are small): a part inside one
tensor is a view of that tensor, so sending it copies nothing and writing the average
back is a single ``copy_``. Only pieces smaller than a part (small tensors, tails of
tensors) are merged into one part, and only those are copied when sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.averaging.robust.reducer import PartReducer
from swarmgrad.compression import (
    CompressionBase,
    CompressionInfo,
    CompressionType,
    SerializedTensor,
    TensorDescriptor,
    TensorRole,
    deserialize_torch_tensor,
    get_codec,
    serialize_torch_tensor,
    serialized_from_message,
    serialized_to_message,
)
from swarmgrad.compression.serialized import dtype_name
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import CodecError, ProtocolViolation, ValidationError

__all__ = [
    "DEFAULT_PART_SIZE_BYTES",
    "PartPiece",
    "PartSpec",
    "TensorPartContainer",
    "TensorPartReducer",
    "tensor_schema",
]

DEFAULT_PART_SIZE_BYTES = 2 * 1024 * 1024
_AVERAGEABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PartPiece:
    """``length`` elements of tensor ``tensor_index`` starting at flat offset ``start``."""

    tensor_index: int
    start: int
    length: int


@dataclass(frozen=True)
class PartSpec:
    """One part: where its elements live in the local tensors, and what it holds."""

    span_index: int
    part_index: int
    pieces: tuple[PartPiece, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(piece.length for piece in self.pieces)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tensor_schema(tensors: Sequence[torch.Tensor]) -> list[list[Any]]:
    """``[[dtype name, [shape...]], ...]``: what members compare before averaging."""
    return [[dtype_name(t.dtype), list(t.shape)] for t in tensors]


def check_tensor_infos(
    tensor_infos: Sequence[CompressionInfo] | None, num_tensors: int
) -> tuple[CompressionInfo, ...] | None:
    """hivemind's ``tensor_infos``: one :class:`CompressionInfo` per averaged tensor,
    telling the codec what each tensor is (its ``key`` and ``role``, e.g. for
    :class:`~swarmgrad.compression.PerTensorCompression` or a role-adaptive codec). The
    descriptor a codec sees is always the tensor's own, so a stale one cannot mislead it."""
    if tensor_infos is None:
        return None
    if isinstance(tensor_infos, CompressionInfo | str | bytes) or not isinstance(
        tensor_infos, Sequence
    ):
        raise ValidationError(
            f"tensor_infos must be a sequence of CompressionInfo, got {tensor_infos!r:.80}"
        )
    infos = tuple(tensor_infos)
    for i, info in enumerate(infos):
        if not isinstance(info, CompressionInfo):
            raise ValidationError(
                f"tensor_infos[{i}] is a {type(info).__name__}, not a CompressionInfo"
            )
    if len(infos) != num_tensors:
        raise ValidationError(
            f"tensor_infos has {len(infos)} entries for {num_tensors} averaged tensors"
        )
    return infos


def check_tensors(tensors: Sequence[torch.Tensor], what: str = "tensors") -> list[torch.Tensor]:
    """The tensors as given, after checking that they can be averaged in place: float
    dtypes, dense, on the CPU, contiguous. ``what`` names them in errors
    (``"averaged_tensors"``: "averaged tensor 2 is not contiguous")."""
    one = what.removesuffix("s").replace("_", " ")
    if isinstance(tensors, torch.Tensor):
        raise ValidationError(
            f"{what} must be a sequence of tensors, not one tensor (a single tensor)"
        )
    checked = list(tensors)
    for i, tensor in enumerate(checked):
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"{one} {i} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dtype not in _AVERAGEABLE:
            raise ValidationError(
                f"{one} {i} has dtype {tensor.dtype}; only float16, bfloat16, float32 and "
                f"float64 tensors can be averaged"
            )
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise ValidationError(f"{one} {i} must be a dense CPU tensor, got {tensor.device}")
        if not tensor.is_contiguous():
            raise ValidationError(
                f"{one} {i} (shape {list(tensor.shape)}) is not contiguous; averaging writes "
                f"into it in place, so pass a contiguous tensor"
            )
    return checked


def _check_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach() for t in check_tensors(tensors)]


def _plan_parts(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    span_sizes: Sequence[int],
    part_size_bytes: int,
) -> tuple[tuple[PartSpec, ...], ...]:
    """Cut the flat vector into spans, and each span into parts (see module docstring)."""
    spans: list[tuple[PartSpec, ...]] = []
    tensor_index, offset = 0, 0  # position in the flat vector: tensor, element within it
    for span_index, span_size in enumerate(span_sizes):
        chunks: list[PartPiece] = []  # pieces of at most one part's worth, in order
        remaining = span_size
        while remaining > 0:
            while numels[tensor_index] == offset:
                tensor_index, offset = tensor_index + 1, 0
            per_part = max(1, part_size_bytes // dtypes[tensor_index].itemsize)
            length = min(remaining, numels[tensor_index] - offset, per_part)
            chunks.append(PartPiece(tensor_index, offset, length))
            offset += length
            remaining -= length
        parts: list[PartSpec] = []
        group: list[PartPiece] = []
        for chunk in chunks:
            dtype = dtypes[chunk.tensor_index]
            per_part = max(1, part_size_bytes // dtype.itemsize)
            if group and (
                dtypes[group[0].tensor_index] != dtype
                or sum(p.length for p in group) + chunk.length > per_part
            ):
                parts.append(
                    PartSpec(span_index, len(parts), tuple(group), dtypes[group[0].tensor_index])
                )
                group = []
            group.append(chunk)
        if group:
            parts.append(
                PartSpec(span_index, len(parts), tuple(group), dtypes[group[0].tensor_index])
            )
        spans.append(tuple(parts))
    return tuple(spans)


class TensorPartContainer:
    """Local tensors seen as one flat vector, split into per-member spans and parts.

    ``span_sizes[j]`` is how many elements member ``j`` reduces (0 for client-mode
    members); they must sum to the total number of elements. Parts are views of the
    tensors (see the module docstring), so do not modify the tensors while a round uses
    them, except through :meth:`apply_part`.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        span_sizes: Sequence[int],
        *,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        compression: CompressionType | str | CompressionBase = CompressionType.NONE,
        tensor_infos: Sequence[CompressionInfo] | None = None,
    ):
        self.tensors = _check_tensors(tensors)
        self.tensor_infos = check_tensor_infos(tensor_infos, len(self.tensors))
        self.part_size_bytes = positive_int("part_size_bytes", part_size_bytes)
        self.codec = get_codec(compression)
        self._flat = [t.view(-1) for t in self.tensors]
        self._descriptors = [TensorDescriptor.from_tensor(t) for t in self.tensors]
        self.total_size = sum(t.numel() for t in self._flat)
        sizes = list(span_sizes)
        if any(type(s) is not int or s < 0 for s in sizes):
            raise ValidationError(f"span sizes must be non-negative integers, got {sizes}")
        if sum(sizes) != self.total_size:
            raise ValidationError(
                f"span sizes sum to {sum(sizes)} but the tensors hold {self.total_size} elements"
            )
        self.span_sizes = tuple(sizes)
        self.parts = _plan_parts(
            [t.numel() for t in self._flat],
            [t.dtype for t in self._flat],
            self.span_sizes,
            part_size_bytes,
        )

    @property
    def num_spans(self) -> int:
        return len(self.span_sizes)

    def num_parts(self, span_index: int) -> int:
        return len(self.parts[span_index])

    def span_nbytes(self, span_index: int) -> int:
        return sum(spec.nbytes for spec in self.parts[span_index])

    def part_offsets(self, span_index: int) -> list[int]:
        """Byte offset of each part when a span's parts travel back to back, plus the
        span's total size at the end."""
        offsets = [0]
        for spec in self.parts[span_index]:
            offsets.append(offsets[-1] + spec.nbytes)
        return offsets

    def part_from_bytes(self, span_index: int, part_index: int, data: torch.Tensor) -> torch.Tensor:
        """View ``data`` (uint8, exactly the part's bytes) as the part's values; copied
        only when its address does not suit the dtype (mixed dtypes, odd sizes)."""
        spec = self.parts[span_index][part_index]
        if data.data_ptr() % spec.dtype.itemsize:
            data = data.clone()
        return data.view(spec.dtype)

    # ---------------------------------------------------------------- sending

    def local_part(self, span_index: int, part_index: int) -> torch.Tensor:
        """The part's current local values, flat: a view when it lies in one tensor."""
        spec = self.parts[span_index][part_index]
        views = [self._view(piece) for piece in spec.pieces]
        return views[0] if len(views) == 1 else torch.cat(views)

    def serialize(self, span_index: int, part_index: int) -> SerializedTensor:
        """The part compressed with the container's codec."""
        spec = self.parts[span_index][part_index]
        first = spec.pieces[0].tensor_index
        given = self.tensor_infos[first] if self.tensor_infos is not None else None
        info = CompressionInfo(
            key=first if given is None else given.key,
            descriptor=self._descriptors[first],
            role=TensorRole.UNSPECIFIED if given is None else given.role,
            part_index=part_index,
            part_size=spec.numel,
        )
        return serialize_torch_tensor(self.local_part(span_index, part_index), self.codec, info)

    def serialize_part(self, span_index: int, part_index: int) -> dict[str, Any]:
        """The part as a wire message (:func:`~swarmgrad.compression.serialized_to_message`)."""
        return serialized_to_message(self.serialize(span_index, part_index))

    def iterate_input_parts(self, span_index: int) -> Iterator[dict[str, Any]]:
        """Wire messages of one span's parts, in order, each serialized when asked for."""
        for part_index in range(self.num_parts(span_index)):
            yield self.serialize_part(span_index, part_index)

    # ---------------------------------------------------------------- receiving

    def decode_part(
        self, span_index: int, part_index: int, message: Any, what: str
    ) -> torch.Tensor:
        """Decode a received part and check it is the part we expect (dtype, size).

        Raises :class:`ProtocolViolation` naming ``what`` (the sender, say) otherwise."""
        spec = self.parts[span_index][part_index]
        try:
            tensor = deserialize_torch_tensor(serialized_from_message(message, what))
        except CodecError as e:
            raise ProtocolViolation(f"{what}: {e}") from None
        if tensor.dtype != spec.dtype or tensor.numel() != spec.numel or tensor.dim() != 1:
            raise ProtocolViolation(
                f"{what}: part {part_index} of span {span_index} must be {spec.numel} "
                f"{dtype_name(spec.dtype)} values, got shape {list(tensor.shape)} of "
                f"{dtype_name(tensor.dtype)}"
            )
        return tensor

    def apply_part(
        self, span_index: int, part_index: int, averaged: torch.Tensor, alpha: float = 1.0
    ) -> None:
        """Write an averaged part into the local tensors.

        ``alpha=1`` replaces the local values; otherwise each value moves ``alpha`` of the
        way from the local value to the average (hivemind's ``averaging_alpha``)."""
        spec = self.parts[span_index][part_index]
        if averaged.numel() != spec.numel:
            raise ValidationError(
                f"part {part_index} of span {span_index} has {spec.numel} elements, "
                f"got {averaged.numel()}"
            )
        averaged = averaged.view(-1)
        offset = 0
        with torch.no_grad():
            for piece in spec.pieces:
                target = self._view(piece)
                source = averaged[offset : offset + piece.length]
                if alpha == 1.0:
                    target.copy_(source)
                else:
                    target.lerp_(source.to(target.dtype), alpha)
                offset += piece.length

    def _view(self, piece: PartPiece) -> torch.Tensor:
        return self._flat[piece.tensor_index][piece.start : piece.start + piece.length]


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _PartState:
    __slots__ = ("acc", "lent", "lent_weight", "plain", "plain_count", "started", "weight")

    def __init__(self, acc: torch.Tensor | None):
        self.acc = acc  # running weighted sum (preallocated, or made by the first sender)
        # a borrowed first input, not yet in ``acc``: the next input is added to it in one
        # pass (``acc = lent + w * part``) instead of copying it into ``acc`` first
        self.lent: torch.Tensor | None = None
        self.lent_weight = 0.0
        self.started = False
        self.weight = 0.0
        self.plain: torch.Tensor | None = None  # unweighted sum of weight-0 contributions
        self.plain_count = 0


class TensorPartReducer(PartReducer):
    """Owner side: the weighted average of each part of one span over its senders.

    ``part_specs`` lists ``(numel, dtype)`` per part; senders are numbered
    ``0..num_senders-1``. Each sender contributes each part once with its weight; part
    ``k`` is finished when every sender has contributed it or has been excluded
    (:meth:`on_sender_failed`). A sender excluded midway keeps the parts it already
    delivered (they are valid data) and is no longer waited for. The result of a part is
    the weighted mean of what was delivered (the plain mean if all weights were 0), or
    ``None`` if nobody delivered it. Results are tensors of the part's dtype.

    ``buffer`` (uint8, at least :meth:`accumulator_nbytes`) holds the running sums, so
    a round allocates nothing; results of float32/float64 parts are views of it.
    """

    min_inputs = 1  # a part is averaged from any sender that delivered it

    def __init__(
        self,
        part_specs: Sequence[tuple[int, torch.dtype]],
        num_senders: int,
        *,
        buffer: torch.Tensor | None = None,
    ):
        super().__init__(part_specs, num_senders)
        accumulators: list[torch.Tensor | None] = [None] * len(self.part_specs)
        if buffer is not None:
            needed = self.accumulator_nbytes(self.part_specs)
            if buffer.dtype != torch.uint8 or buffer.numel() < needed:
                raise ValidationError(f"accumulation buffer must be >= {needed} uint8 bytes")
            offset = 0
            for index, (numel, dtype) in enumerate(self.part_specs):
                acc_dtype = _accumulator_dtype(dtype)
                size = numel * acc_dtype.itemsize
                accumulators[index] = buffer[offset : offset + size].view(acc_dtype)
                offset += -(-size // 8) * 8
        self._parts = [_PartState(acc) for acc in accumulators]
        self._finish_ready()  # no senders at all: every part is finished already

    @staticmethod
    def accumulator_nbytes(part_specs: Sequence[tuple[int, torch.dtype]]) -> int:
        """Bytes of the ``buffer`` that holds the running sums (8-byte aligned parts)."""
        total = 0
        for numel, dtype in part_specs:
            total += -(-numel * _accumulator_dtype(dtype).itemsize // 8) * 8
        return total

    def _add(
        self,
        sender_index: int,
        part_index: int,
        part: torch.Tensor,
        weight: float,
        reuse: bool,
        borrow: bool = False,
    ) -> None:
        state = self._parts[part_index]
        part = part.view(-1)
        acc_dtype = _accumulator_dtype(self.part_specs[part_index][1])
        if weight > 0:
            if state.lent is not None:  # the borrowed first input and this one, one pass
                self._fold_lent(state, part, weight, reuse and part.dtype == acc_dtype)
            elif not state.started:
                if borrow and part.dtype == acc_dtype:
                    state.lent, state.lent_weight = part, weight
                elif state.acc is None:
                    if reuse and part.dtype == acc_dtype:
                        state.acc = part if weight == 1.0 else part.mul_(weight)
                    else:
                        state.acc = torch.mul(part.to(acc_dtype), weight)
                elif part.dtype == acc_dtype:
                    torch.mul(part, weight, out=state.acc)
                else:
                    state.acc.copy_(part).mul_(weight)
                state.started = True
            else:
                state.acc.add_(part, alpha=weight)
            state.weight += weight
        else:
            if state.plain is None:
                state.plain = part.to(acc_dtype, copy=not reuse or part.dtype != acc_dtype)
            else:
                state.plain.add_(part)
            state.plain_count += 1

    @staticmethod
    def _fold_lent(state: _PartState, part: torch.Tensor, weight: float, reuse: bool) -> None:
        """``acc = lent_weight * lent + weight * part``, reading the borrowed input once;
        into ``part``'s own memory when it may be reused (a received buffer), so that no
        new buffer of the part's size is made."""
        lent, state.lent = state.lent, None
        if state.acc is None and reuse:
            state.acc = part
        if state.lent_weight == 1.0:
            if state.acc is None:
                state.acc = torch.add(lent, part, alpha=weight)
            else:
                torch.add(lent, part, alpha=weight, out=state.acc)
        elif state.acc is part:
            part.mul_(weight).add_(lent, alpha=state.lent_weight)
        else:
            if state.acc is None:
                state.acc = torch.mul(lent, state.lent_weight)
            else:
                torch.mul(lent, state.lent_weight, out=state.acc)
            state.acc.add_(part, alpha=weight)

    def _reduce(self, part_index: int) -> torch.Tensor | None:
        state = self._parts[part_index]
        _, dtype = self.part_specs[part_index]
        if state.lent is not None:  # nobody else with a weight delivered it: its values
            lent, state.lent = state.lent, None
            result = lent.clone() if state.acc is None else state.acc.copy_(lent)
        elif state.started and state.weight > 0:
            result = state.acc.div_(state.weight)
        elif state.plain is not None:
            result = state.plain.div_(state.plain_count)
        else:
            result = None
        if result is not None and result.dtype != dtype:
            result = result.to(dtype)
        state.acc = state.plain = None
        return result
