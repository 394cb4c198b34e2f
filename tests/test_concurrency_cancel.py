"""``cancel_and_wait``: a task is cancelled and waited for whatever it ends with, and a
cancellation of the caller that comes meanwhile is not swallowed (a stopping sink-worker whose
shutdown swallowed it never exited)."""

from __future__ import annotations

import asyncio

import pytest

from libs.concurrency import cancel_and_wait


async def test_a_task_that_fails_or_is_cancelled_is_waited_for_quietly() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("its own failure")

    failing = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(failing)
    assert failing.done()

    sleeper = asyncio.ensure_future(asyncio.Event().wait())
    await cancel_and_wait(sleeper)
    assert sleeper.cancelled()


async def test_the_callers_own_cancellation_goes_through_once_the_task_ended() -> None:
    ended = asyncio.Event()
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # cleans up for a while before it ends
            ended.set()
            raise

    async def shutdown(task: asyncio.Task[None]) -> str:
        await cancel_and_wait(task)
        return "went on with the shutdown"  # must not happen once the caller was cancelled

    task = asyncio.ensure_future(slow_to_stop())
    await asyncio.sleep(0)
    caller = asyncio.ensure_future(shutdown(task))
    await asyncio.sleep(0)
    caller.cancel()  # the service stops while its shutdown waits for the task
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert ended.is_set() and task.done()
