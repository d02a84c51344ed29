"""LoopLockHolder: the tensors' RLock held for coroutines without blocking the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from swarmgrad.averaging.tensor_lock import LoopLockHolder


def test_the_loop_keeps_running_while_a_user_thread_holds_the_lock(arun):
    lock = threading.RLock()
    taken, release = threading.Event(), threading.Event()

    def user():
        with lock:
            taken.set()
            release.wait(10)

    async def main():
        thread = threading.Thread(target=user)
        thread.start()
        taken.wait(10)
        holder = LoopLockHolder(lock)
        waiting = asyncio.ensure_future(holder.acquire(10))
        ticks = 0
        for _ in range(20):  # the loop is free meanwhile
            await asyncio.sleep(0.005)
            ticks += 1
        assert not waiting.done()
        release.set()
        assert await waiting
        reentrant = lock.acquire(blocking=False)  # held by the holder's thread, not ours
        holder.release()
        await holder.close()
        thread.join()
        return ticks, reentrant, lock.acquire(timeout=1)

    ticks, reentrant, free = arun(main)
    assert ticks == 20 and not reentrant and free


def test_a_cancelled_wait_never_leaves_the_lock_taken_and_timeouts_hold(arun):
    lock = threading.RLock()

    async def main():
        holder = LoopLockHolder(lock)
        assert await holder.acquire(1.0)
        holder.release()
        lock.acquire()  # this thread holds it now, like a user in get_tensors()
        waiting = asyncio.ensure_future(holder.acquire(None))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert not await holder.acquire(0.2)  # still ours: the attempt times out
        waited = loop.time() - started
        lock.release()
        assert await holder.acquire(5)  # the abandoned attempt did not keep it
        holder.release()
        await holder.close()
        with pytest.raises(RuntimeError, match="closed"):
            await holder.acquire(1)
        return waited, lock.acquire(timeout=1)

    waited, free = arun(main)
    assert 0.2 <= waited < 2.0 and free
