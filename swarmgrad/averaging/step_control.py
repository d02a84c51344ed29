"""A handle on one averaging step that runs in the background.

``DecentralizedAverager.step(wait=False)`` returns a :class:`StepControl`: a
``concurrent.futures.Future`` of the step's result (the group's gathered data, or None)
that also lets the caller steer the step while it runs. The common pattern, as in
hivemind's optimizer, is to schedule matchmaking ahead of time and release the all-reduce
only when the local tensors are ready::

    control = averager.step(scheduled_time=get_dht_time() + 10, require_trigger=True,
                            wait=False)
    ...                                   # compute gradients meanwhile
    control.weight = samples_this_epoch   # may change until the all-reduce begins
    control.allow_allreduce()
    gathered = control.result(timeout=60)

Why a Future subclass rather than a bare future plus side methods: the caller keeps one
object, thread-safe in every method, whose ``cancel()`` reaches the coroutine on the event
loop (a step cancelled during its all-reduce leaves the spans already averaged in place
and the rest local, see :mod:`.allreduce.types`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import math
import threading
from collections.abc import Callable
from typing import Any

from swarmgrad.averaging.allreduce.pacing import SendPacer
from swarmgrad.averaging.allreduce.types import check_weight
from swarmgrad.averaging.matchmaking.group_bits import check_round_tag
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.timeutils import get_dht_time

__all__ = ["AveragingStage", "StepControl"]


class AveragingStage(enum.Enum):
    IDLE = 0  # created, not started yet
    LOOKING_FOR_GROUP = 1
    AWAITING_TRIGGER = 2  # a group is formed; the all-reduce waits for allow_allreduce()
    RUNNING_ALLREDUCE = 3
    FINISHED = 4


def _check_expected_group_size(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 2):
        raise ValidationError(f"expected_group_size must be an int >= 2 or None, got {value!r}")
    return value


class StepControl(concurrent.futures.Future):
    """One averaging step: its future result, its trigger, its weight and stage.

    ``scheduled_time`` is the DHT time at which this peer, if it leads a group, starts
    it. ``weight`` may be changed until the all-reduce begins. With
    ``require_trigger=True`` the step forms a group and then waits for
    :meth:`allow_allreduce` (until the step's deadline) before averaging.
    ``round_tag``: the step meets only peers whose step has the same tag.
    ``send_pacer``: a :class:`~swarmgrad.averaging.allreduce.pacing.SendPacer` that spaces this
    peer's writes of the round (None: as fast as the link goes); one pacer shared by
    several rounds keeps their total at its rate. Settable like ``weight`` until the
    all-reduce begins.
    ``expected_group_size``: how many peers the caller knows will come (None: unknown);
    a group this peer leads begins as soon as it has that many members instead of
    waiting for its scheduled time. Settable while the step looks for its group: a
    step scheduled before the caller learned of a new peer then waits for it too.
    ``leader_hint``: the peer expected to lead the group (this peer itself, or another):
    matchmaking then skips the DHT (see :mod:`~swarmgrad.averaging.matchmaking.driver`).
    """

    def __init__(
        self,
        scheduled_time: float,
        deadline: float | None = None,
        allow_retries: bool = True,
        weight: float = 1.0,
        data_for_gather: Any = None,
        *,
        require_trigger: bool = False,
        round_tag: str = "",
        expected_group_size: int | None = None,
        leader_hint: PeerID | None = None,
    ):
        super().__init__()
        if not isinstance(scheduled_time, int | float) or not math.isfinite(scheduled_time):
            raise ValidationError(f"scheduled_time must be a finite DHT time, got {scheduled_time}")
        self._scheduled_time = float(scheduled_time)
        if deadline is not None and (
            not isinstance(deadline, int | float) or not math.isfinite(deadline)
        ):
            raise ValidationError(f"deadline must be a finite DHT time or None, got {deadline}")
        # hivemind's fields, kept for programs that build or read a StepControl themselves
        self._deadline = None if deadline is None else float(deadline)
        self._allow_retries = bool(allow_retries)
        self._data_for_gather = data_for_gather
        self._weight = check_weight(weight)
        self._send_pacer: SendPacer | None = None
        self.require_trigger = bool(require_trigger)
        self.round_tag = check_round_tag(round_tag)
        self._expected_group_size = _check_expected_group_size(expected_group_size)
        # set by the averager while this step looks for a group: tells the search a new
        # expected size (from any thread)
        self._expected_size_hook: Callable[[int | None], None] | None = None
        if leader_hint is not None and not isinstance(leader_hint, PeerID):
            raise ValidationError(f"leader_hint must be a PeerID or None, got {leader_hint!r:.60}")
        self.leader_hint = leader_hint
        self._stage = AveragingStage.IDLE
        self._state_lock = threading.Lock()
        self._triggered = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trigger: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ user side

    @property
    def scheduled_time(self) -> float:
        return self._scheduled_time

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        if self.began_allreduce:
            raise ValidationError("the all-reduce has begun: its weight can no longer change")
        self._weight = check_weight(value)

    @property
    def expected_group_size(self) -> int | None:
        return self._expected_group_size

    @expected_group_size.setter
    def expected_group_size(self, value: int | None) -> None:
        value = _check_expected_group_size(value)
        if value == self._expected_group_size:
            return
        self._expected_group_size = value
        hook = self._expected_size_hook
        if hook is not None:
            hook(value)

    @property
    def send_pacer(self) -> SendPacer | None:
        return self._send_pacer

    @send_pacer.setter
    def send_pacer(self, value: SendPacer | None) -> None:
        if self.began_allreduce:
            raise ValidationError("the all-reduce has begun: its pacing can no longer change")
        if value is not None and not isinstance(value, SendPacer):
            raise ValidationError(f"send_pacer must be a SendPacer or None, got {value!r}")
        self._send_pacer = value

    @property
    def deadline(self) -> float | None:
        """The DHT time by which the step must end (None: no deadline of its own)."""
        return self._deadline

    @property
    def allow_retries(self) -> bool:
        return self._allow_retries

    @property
    def data_for_gather(self) -> Any:
        return self._data_for_gather

    def get_timeout(self) -> float | None:
        """Seconds left until the deadline (0 when past; None without a deadline)."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - get_dht_time())

    def attach(self, trigger: concurrent.futures.Future, cancel: concurrent.futures.Future):
        """Tie this step to two futures, as hivemind's averager does across processes:
        ``trigger`` done allows the all-reduce, ``cancel`` done cancels the step."""
        trigger.add_done_callback(lambda _: self.allow_allreduce())
        cancel.add_done_callback(lambda _: self.cancel())

    @staticmethod
    def reset_backend() -> None:
        """hivemind resets its inter-process futures here; swarmgrad has none."""

    async def wait_for_trigger(self) -> None:
        """On the averager's loop: until :meth:`allow_allreduce` is called."""
        await self._wait_for_trigger()

    async def wait_for_cancel(self) -> None:
        """On any loop: until the step is cancelled (forever if it ends otherwise)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.add_done_callback(
            lambda f: loop.call_soon_threadsafe(
                lambda: done.done() or done.set_result(f.cancelled())
            )
        )
        if not await done:
            await loop.create_future()  # finished without a cancel: nothing to wait for

    @property
    def stage(self) -> AveragingStage:
        return self._stage

    @property
    def triggered(self) -> bool:
        return self._triggered

    @property
    def began_allreduce(self) -> bool:
        return self._stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED)

    def allow_allreduce(self) -> None:
        """Let the all-reduce begin once a group is formed (any thread; idempotent)."""
        with self._state_lock:
            self._triggered = True
            loop, event = self._loop, self._trigger
        if loop is not None and event is not None:
            _call_on(loop, event.set)

    def cancel(self) -> bool:
        """Stop the step; False if it has already finished. The coroutine on the event
        loop is cancelled too (asynchronously: its clean-up follows shortly)."""
        with self._state_lock:
            loop, task = self._loop, self._task
        cancelled = super().cancel()
        if cancelled and loop is not None and task is not None:
            _call_on(loop, task.cancel)
        return cancelled

    def cancel_if_ungrouped(self) -> bool:
        """Cancel the step if it has no group yet (True if it was cancelled). A step
        whose group formed is left alone: its members count on this peer's part."""
        if self.done() or self._stage not in (
            AveragingStage.IDLE,
            AveragingStage.LOOKING_FOR_GROUP,
        ):
            return False
        return self.cancel()

    # ------------------------------------------------------------------ averager side

    def _bind(self, task: asyncio.Task) -> None:
        """Called on the loop by the step that runs this control."""
        loop = asyncio.get_running_loop()
        with self._state_lock:
            self._loop, self._task = loop, task
            self._trigger = asyncio.Event()
            if self._triggered:
                self._trigger.set()
        if self.cancelled():  # cancelled before the step started
            task.cancel()

    def _unbind(self) -> None:
        """Called on the loop by the step as it ends: the task's stored exception (its
        traceback's frames hold this control) and this control must not hold each other,
        a cycle that only the collector's rare full pass frees (issue 32)."""
        with self._state_lock:
            self._task = None

    async def _wait_for_trigger(self) -> None:
        assert self._trigger is not None, "the control is not bound to a running step"
        await self._trigger.wait()

    def _set_stage(self, stage: AveragingStage) -> None:
        self._stage = stage

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._stage = AveragingStage.FINISHED
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(result)

    def _mark_cancelled(self) -> None:
        """The step's coroutine was cancelled: so is this future (if not done yet)."""
        self._stage = AveragingStage.FINISHED
        super().cancel()

    def _follow(self, inner: concurrent.futures.Future) -> None:
        """Mirror ``inner`` (the step coroutine's future) once it ends: covers a step that
        was cancelled before it could report through :meth:`_finish`."""

        def copy(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                self._mark_cancelled()
            elif done.exception() is not None:
                self._finish(error=done.exception())
            else:
                self._finish(done.result())

        inner.add_done_callback(copy)

    def __repr__(self) -> str:
        state = "done" if self.done() else self._stage.name.lower()
        return f"<StepControl {state} scheduled_time={self._scheduled_time:.3f} w={self._weight}>"


def _call_on(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
    """Run ``fn`` on ``loop``: now if we are on it, else soon from its thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
    else:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to stop
            loop.call_soon_threadsafe(fn)
