import asyncio
import random
import threading
import time

import pytest

from swarmgrad.net.sim import SimulationStalled, VirtualClockEventLoop, run_simulation, virtual_loop


def test_sleeping_an_hour_takes_no_wall_time_and_advances_the_clock_by_3600_s():
    async def scenario():
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3600)
        return loop.time() - start

    wall = time.perf_counter()
    with virtual_loop() as loop:
        elapsed = loop.run_until_complete(scenario())
        assert loop.virtual_time == 3600.0
    assert elapsed == 3600.0
    assert time.perf_counter() - wall < 2.0  # milliseconds in practice; slack for loaded CI


def test_virtual_time_starts_at_start_time_and_does_not_follow_the_wall_clock():
    with virtual_loop(start_time=1000.0) as loop:
        assert isinstance(loop, VirtualClockEventLoop)
        assert loop.time() == 1000.0
        loop.run_until_complete(asyncio.sleep(0))
        time.sleep(0.01)  # real time passes outside the loop; virtual time does not
        assert loop.time() == loop.virtual_time == 1000.0


def _timer_firing_order(seed: int) -> list[tuple[float, str]]:
    """Tasks and bare timers with many equal deadlines, all recording when they run."""
    fired: list[tuple[float, str]] = []

    async def sleeper(name: str, delays: list[float]) -> None:
        loop = asyncio.get_running_loop()
        for delay in delays:
            await asyncio.sleep(delay)
            fired.append((loop.time(), name))

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(seed)
        for i in range(200):
            delay = rng.choice([0.0, 0.1, 0.25, 1.0, 2.5])
            loop.call_later(delay, lambda i=i: fired.append((loop.time(), f"timer{i}")))
        async with asyncio.TaskGroup() as group:
            for i in range(50):
                delays = [rng.choice([0.0, 0.1, 0.5, 1.0]) for _ in range(5)]
                group.create_task(sleeper(f"task{i}", delays))

    with virtual_loop() as loop:
        loop.run_until_complete(scenario())
    return fired


def test_timers_fire_in_the_same_order_at_the_same_times_on_every_run():
    first = _timer_firing_order(seed=7)
    second = _timer_firing_order(seed=7)
    assert len(first) == 200 + 50 * 5
    assert first == second
    times = [when for when, _ in first]
    assert times == sorted(times)


def test_asyncio_timeout_fires_at_the_exact_virtual_instant():
    async def scenario():
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2.5):
                await asyncio.sleep(10)
        assert loop.time() == start + 2.5
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=0.3)
        assert loop.time() == start + 2.5 + 0.3
        fired = loop.create_future()
        loop.call_later(1.75, lambda: fired.set_result(loop.time()))
        expected = loop.time() + 1.75
        assert await fired == expected

    with virtual_loop(start_time=123.456) as loop:
        loop.run_until_complete(scenario())


def test_call_soon_threadsafe_from_another_thread_wakes_an_idle_loop():
    async def scenario():
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def from_thread():
            time.sleep(0.05)
            loop.call_soon_threadsafe(future.set_result, "hello")

        thread = threading.Thread(target=from_thread)
        thread.start()
        try:
            return await future  # no timer pending: the loop must block for real
        finally:
            thread.join()

    with virtual_loop(stall_timeout=5.0) as loop:
        assert loop.run_until_complete(scenario()) == "hello"
        assert loop.time() == 0.0


def test_work_in_threads_takes_no_virtual_time_and_does_not_trip_deadlines():
    async def scenario():
        loop = asyncio.get_running_loop()
        start = loop.time()
        # a timer is pending all along; the clock must not jump to it while threads work
        background = asyncio.create_task(asyncio.sleep(5))
        result = await asyncio.wait_for(asyncio.to_thread(lambda: time.sleep(0.05) or 42), 1)
        assert loop.time() == start
        await background
        assert loop.time() == start + 5
        return result

    with virtual_loop() as loop:
        assert loop.run_until_complete(scenario()) == 42


def test_run_simulation_returns_the_result_and_passes_a_seeded_network():
    async def main(network):
        await asyncio.sleep(10)
        return asyncio.get_running_loop().time(), network.seed, network.random.random()

    now, seed, draw = run_simulation(main, seed=5, start_time=100.0)
    assert (now, seed) == (110.0, 5)
    assert draw == random.Random(5).random()


def test_run_simulation_closes_the_loop_and_cancels_leftover_tasks():
    cancelled = []
    loops = []

    async def forever():
        try:
            await asyncio.sleep(10**9)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main(network):
        loops.append(asyncio.get_running_loop())
        asyncio.get_running_loop().create_task(forever())
        await asyncio.sleep(0)
        return "done"

    assert run_simulation(main) == "done"
    assert cancelled == [True]
    assert loops[0].is_closed()


def test_run_simulation_can_reject_leftover_tasks():
    async def main(network):
        asyncio.get_running_loop().create_task(asyncio.sleep(1), name="forgotten")
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="left 1 task"):
        run_simulation(main, check_leftover_tasks=True)


def test_virtual_loop_cancels_pending_tasks_and_closes_on_exit():
    with virtual_loop() as loop:
        task = loop.create_task(asyncio.sleep(60))
        loop.run_until_complete(asyncio.sleep(1))
    assert task.cancelled()
    assert loop.is_closed()


def test_many_sleeping_tasks_finish_fast_with_exact_times():
    async def napper(index: int) -> float:
        await asyncio.sleep(index * 0.001)
        return asyncio.get_running_loop().time()

    async def main(network):
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(napper(i)) for i in range(10_000)]
        return [task.result() for task in tasks]

    wall = time.perf_counter()
    results = run_simulation(main)
    assert time.perf_counter() - wall < 10.0
    assert results == [i * 0.001 for i in range(10_000)]


def test_a_deadlocked_simulation_raises_instead_of_hanging_when_given_a_stall_timeout():
    async def main(network):
        await asyncio.sleep(7)
        await asyncio.get_running_loop().create_future()  # nobody will ever complete it

    wall = time.perf_counter()
    with pytest.raises(SimulationStalled, match=r"stalled at virtual time 7\.0"):
        run_simulation(main, stall_timeout=0.2)
    assert time.perf_counter() - wall < 5.0


def test_a_simulation_collects_young_garbage_less_often_and_restores_the_thresholds():
    """A swarm of live objects made the default young-generation threshold (700) trigger
    full collections over and over; a simulation raises it and puts it back after, also
    when the scenario raises. Collection stays off where it was off."""
    import gc

    from swarmgrad.net.sim.clock import SIMULATION_GC_THRESHOLD

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)

        async def main(network):
            return gc.get_threshold()

        assert run_simulation(main) == (SIMULATION_GC_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
        with virtual_loop():
            assert gc.get_threshold() == (SIMULATION_GC_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)

        async def fails(network):
            raise KeyError("scenario failed")

        with pytest.raises(KeyError):
            run_simulation(fails)
        assert gc.get_threshold() == (700, 10, 10)

        gc.set_threshold(0, 10, 10)  # automatic collection off: a simulation leaves it off
        assert run_simulation(main) == (0, 10, 10)
        with virtual_loop() as loop:
            assert gc.get_threshold() == (0, 10, 10)
            loop.run_until_complete(asyncio.sleep(0))

        higher = 2 * SIMULATION_GC_THRESHOLD
        gc.set_threshold(higher, 10, 10)  # a higher threshold is kept
        assert run_simulation(main) == (higher, 10, 10)
        with virtual_loop():
            assert gc.get_threshold() == (higher, 10, 10)
    finally:
        gc.set_threshold(*before)
