"""StepControl: a thread-safe future of a step, with its trigger, weight and stage."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from swarmgrad.averaging.step_control import AveragingStage, StepControl
from swarmgrad.utils.errors import ValidationError


async def fake_step(control: StepControl) -> str:
    """What the averager does with a control, minus the networking."""
    control._bind(asyncio.current_task())
    try:
        control._set_stage(AveragingStage.AWAITING_TRIGGER)
        await control._wait_for_trigger()
        control._set_stage(AveragingStage.RUNNING_ALLREDUCE)
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        control._mark_cancelled()
        raise
    control._finish("done")
    return "done"


def test_a_trigger_from_another_thread_releases_the_step(arun):
    async def main():
        control = StepControl(scheduled_time=1.0, weight=1.0, require_trigger=True)
        task = asyncio.ensure_future(fake_step(control))
        await asyncio.sleep(0.01)
        assert control.stage is AveragingStage.AWAITING_TRIGGER and not control.done()
        control.weight = 2.5
        thread = threading.Thread(target=control.allow_allreduce)
        thread.start()
        thread.join()
        assert await task == "done"
        return control

    control = arun(main)
    assert control.result(0) == "done" and control.triggered and control.weight == 2.5
    assert not control.cancel()  # finished: too late to cancel
    assert control.stage is AveragingStage.FINISHED and control.began_allreduce
    with pytest.raises(ValidationError, match="can no longer change"):
        control.weight = 1.0


def test_a_trigger_given_before_the_step_starts_is_kept(arun):
    async def main():
        control = StepControl(scheduled_time=1.0, weight=1.0, require_trigger=True)
        control.allow_allreduce()
        return await fake_step(control), control

    result, control = arun(main)
    assert result == "done" and control.result(0) == "done"


def test_cancel_reaches_the_step_before_and_while_it_runs(arun):
    async def main():
        early = StepControl(scheduled_time=1.0, weight=1.0)
        assert early.cancel()
        early_task = asyncio.ensure_future(fake_step(early))
        late = StepControl(scheduled_time=1.0, weight=1.0)
        late_task = asyncio.ensure_future(fake_step(late))
        await asyncio.sleep(0.01)
        assert threading_cancel(late)
        results = await asyncio.gather(early_task, late_task, return_exceptions=True)
        return results, early, late

    results, early, late = arun(main)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert early.cancelled() and late.cancelled()


def threading_cancel(control: StepControl) -> bool:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(control.cancel).result()


def test_follow_mirrors_the_inner_future():
    for outcome in ("result", "error", "cancel"):
        control = StepControl(scheduled_time=1.0, weight=1.0)
        inner = concurrent.futures.Future()
        control._follow(inner)
        if outcome == "result":
            inner.set_result({"a": 1})
            assert control.result(0) == {"a": 1}
        elif outcome == "error":
            inner.set_exception(ValidationError("bad"))
            with pytest.raises(ValidationError, match="bad"):
                control.result(0)
        else:
            inner.cancel()
            assert control.cancelled()
        assert control.stage is AveragingStage.FINISHED


def test_bad_weights_and_times_are_refused():
    with pytest.raises(ValidationError, match="weight must be finite and >= 0"):
        StepControl(scheduled_time=1.0, weight=-1)
    with pytest.raises(ValidationError, match="weight must be a number"):
        StepControl(scheduled_time=1.0, weight=True)
    with pytest.raises(ValidationError, match="scheduled_time"):
        StepControl(scheduled_time=float("inf"), weight=1)
    control = StepControl(scheduled_time=5.0, weight=1)
    with pytest.raises(ValidationError, match="weight"):
        control.weight = float("nan")
    assert control.scheduled_time == 5.0 and "idle" in repr(control)


def test_a_new_expected_group_size_is_checked_and_passed_on_only_when_it_changes():
    control = StepControl(scheduled_time=5.0, weight=1, expected_group_size=2)
    control.expected_group_size = 3  # no search under way: kept for the next one
    seen = []
    control._expected_size_hook = seen.append
    for value in (3, 4, 4, None):
        control.expected_group_size = value
    assert seen == [4, None] and control.expected_group_size is None
    for bad in (1, 2.0, True, "3"):
        with pytest.raises(ValidationError, match="expected_group_size must be an int >= 2"):
            control.expected_group_size = bad
    with pytest.raises(ValidationError, match="expected_group_size"):
        StepControl(scheduled_time=5.0, weight=1, expected_group_size=1)
    assert seen == [4, None]


def test_only_a_step_without_a_group_is_cancelled_by_cancel_if_ungrouped(arun):
    async def main():
        idle = StepControl(scheduled_time=1.0, weight=1.0)
        looking = StepControl(scheduled_time=1.0, weight=1.0)
        looking._set_stage(AveragingStage.LOOKING_FOR_GROUP)
        grouped = StepControl(scheduled_time=1.0, weight=1.0, require_trigger=True)
        task = asyncio.ensure_future(fake_step(grouped))
        await asyncio.sleep(0.01)
        assert grouped.stage is AveragingStage.AWAITING_TRIGGER
        outcomes = [c.cancel_if_ungrouped() for c in (idle, looking, grouped)]
        grouped.allow_allreduce()
        assert await task == "done"
        assert not grouped.cancel_if_ungrouped()  # finished
        return outcomes, idle, looking, grouped

    outcomes, idle, looking, grouped = arun(main)
    assert outcomes == [True, True, False]
    assert idle.cancelled() and looking.cancelled() and grouped.result(0) == "done"
