"""Which fragment of a streaming DiLoCo model is due when: decisions only, no I/O, no torch.

Streaming DiLoCo cuts the parameters into F fragments (:func:`split_into_fragments`)
and synchronises fragment ``f`` when the swarm's epoch is ``(f + offset) / F`` done, so
that rounds are spread over the epoch instead of all falling on its end. With one
fragment (plain DiLoCo) the only round is the outer step itself. A
:class:`FragmentSchedule` answers the driver's questions (which fragments to launch now,
which to start matchmaking for, which are left for the outer step, whose last group to
join) from the epoch, the epoch's progress and the epoch each fragment was last
launched in; :class:`~.diloco.DiLoCoOptimizer` does the averaging.
:func:`fragment_send_rate` is the pace of a streaming round's writes. See
``docs/design-notes.md`` ("Streaming DiLoCo") for the measurements behind both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarmgrad.utils.checks import fraction, positive_int
from swarmgrad.utils.errors import ValidationError

__all__ = ["FragmentSchedule", "fragment_send_rate", "split_into_fragments"]


def split_into_fragments(sizes: Sequence[int], num_fragments: int) -> list[list[int]]:
    """Cut parameters (in model order, by element count) into ``num_fragments`` runs of
    consecutive parameters with similar total sizes; every fragment gets at least one."""
    if num_fragments > len(sizes):
        raise ValidationError(
            f"num_fragments={num_fragments} is more than the model's {len(sizes)} parameter "
            "tensors: every fragment needs at least one"
        )
    total = sum(sizes)
    fragments: list[list[int]] = [[] for _ in range(num_fragments)]
    done, current = 0, 0
    for index, size in enumerate(sizes):
        left_tensors = len(sizes) - index
        left_fragments = num_fragments - current - 1
        # move on once this fragment has its share, or when the rest need a tensor each
        if fragments[current] and (
            left_tensors <= left_fragments or done >= total * (current + 1) / num_fragments
        ):
            current += 1
        fragments[current].append(index)
        done += size
    return fragments


@dataclass(frozen=True)
class FragmentSchedule:
    """When each of ``num_fragments`` fragments is synchronised within an epoch.

    ``offset`` (in (0, 1]) places fragment ``f`` at ``(f + offset) / F`` of the epoch:
    the default, one half, puts the last fragment half a fragment's period before the
    epoch ends, so its round can run while the outer step is taken. ``launched`` in the
    methods below is, per fragment, the last epoch its round was launched in (-1: never).
    """

    num_fragments: int
    offset: float = 0.5

    def __post_init__(self) -> None:
        positive_int("num_fragments", self.num_fragments)
        fraction("offset", self.offset, low_open=True)

    @property
    def streaming(self) -> bool:
        return self.num_fragments > 1

    def due_fraction(self, index: int) -> float:
        """The share of the epoch after which fragment ``index`` is due; 1.0 (the outer
        step) for plain DiLoCo's single fragment."""
        if not 0 <= index < self.num_fragments:
            raise ValidationError(f"no fragment {index}: there are {self.num_fragments}")
        if not self.streaming:
            return 1.0
        return (index + self.offset) / self.num_fragments

    def due_now(self, epoch: int, progress: float, launched: Sequence[int]) -> list[int]:
        """Fragments to launch during the epoch, in order: those whose share of the epoch
        is done (``progress``, 0..1) and not launched yet in ``epoch``. A fragment due at
        the epoch's end is left to the outer step (:meth:`left_for_outer_step`)."""
        self._check(launched)
        return [
            index for index, due in self.upcoming(epoch, launched) if due < 1.0 and progress >= due
        ]

    def upcoming(self, epoch: int, launched: Sequence[int]) -> list[tuple[int, float]]:
        """Fragments not launched yet in ``epoch``, with their due fractions: those whose
        group may be sought ahead of time."""
        self._check(launched)
        return [
            (index, self.due_fraction(index))
            for index in range(self.num_fragments)
            if launched[index] < epoch
        ]

    def left_for_outer_step(self, epoch: int, launched: Sequence[int]) -> list[int]:
        """Fragments the outer step launches: every one not launched yet in ``epoch``."""
        return [index for index, _ in self.upcoming(epoch, launched)]

    @staticmethod
    def round_tag(epoch: int, index: int) -> str:
        """The tag of a fragment's round: rounds of different epochs or fragments never
        meet, so pseudo-gradients of different syncs are never averaged together."""
        return f"outer{epoch}f{index}"

    def leader_sources(self, epoch: int, index: int) -> list[tuple[int, int]]:
        """``(fragment, epoch)`` of the groups whose leader fragment ``index``'s round of
        ``epoch`` should join directly, best first: the same peers meet again, so a later
        fragment joins this epoch's first group, and the first fragment the last
        epoch's last group (or first). None for plain DiLoCo: its one round blocks the
        outer step and goes through the DHT."""
        if not self.streaming:
            return []
        if index > 0:
            return [(0, epoch)]
        return [(self.num_fragments - 1, epoch - 1), (0, epoch - 1)]

    def pacing_window(self, epoch_length: float, pace: float) -> float:
        """Seconds over which a fragment's round spreads its writes: ``pace`` of the time
        between two fragments."""
        return pace * epoch_length / self.num_fragments

    @staticmethod
    def after_download(epoch: int) -> int:
        """The ``launched`` value of every fragment once a peer loaded the state of
        ``epoch``: none of that epoch's rounds launched yet."""
        return epoch - 1

    def _check(self, launched: Sequence[int]) -> None:
        if len(launched) != self.num_fragments:
            raise ValidationError(
                f"launched has {len(launched)} entries, one per fragment expected "
                f"({self.num_fragments})"
            )


def fragment_send_rate(
    *,
    payload_bytes: float,
    num_peers: int,
    window: float,
    measured_bytes: float | None,
    timeout: float,
    pace_margin: float = 1.05,
    min_share_of_estimate: float = 0.6,
    max_share_of_timeout: float = 0.25,
    floor: float = 1024.0,
) -> float | None:
    """Bytes per second for a streaming round's writes, or None (full speed) with nobody
    to send to or no window known.

    ``payload_bytes``: the codec's estimate of one fragment's encoded size; a member
    writes ``2 (n - 1) / n`` of it (its parts out, its span back). ``measured_bytes``:
    what the last rounds really wrote per round (deflate included, which the codec's
    estimate cannot know), used with a ``pace_margin`` and never below
    ``min_share_of_estimate`` of the estimate. The round never takes more than
    ``max_share_of_timeout`` of ``timeout`` however long ``window`` is thought to be."""
    if num_peers <= 1 or not 0 < window < math.inf:
        return None
    sent = 2 * (num_peers - 1) / num_peers * payload_bytes
    if measured_bytes is not None:
        sent = max(pace_margin * measured_bytes, min_share_of_estimate * sent)
    return max(sent / window, sent / (max_share_of_timeout * timeout), floor)
