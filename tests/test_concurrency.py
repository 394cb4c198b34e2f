"""libs.concurrency.gather_bounded: order, the bound, failures returned, cancellation."""

from __future__ import annotations

import asyncio
import functools

import pytest

from libs.concurrency import gather_bounded


async def test_results_keep_their_order_and_no_more_than_the_limit_run_at_once() -> None:
    running = peak = 0

    async def step(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (i % 3))  # finish out of order
        running -= 1
        if i == 7:
            raise ValueError("seven")
        return i * 10

    results = await gather_bounded([functools.partial(step, i) for i in range(40)], 5)
    assert peak == 5
    assert [r for r in results if not isinstance(r, Exception)] == [i * 10 for i in range(40) if i != 7]
    assert isinstance(results[7], ValueError) and str(results[7]) == "seven"


async def test_a_cancelled_caller_cancels_the_running_steps_and_starts_no_more() -> None:
    started: list[int] = []
    release, three = asyncio.Event(), asyncio.Event()

    async def step(i: int) -> int:
        started.append(i)
        if len(started) == 3:
            three.set()
        await release.wait()
        return i

    task = asyncio.ensure_future(gather_bounded([functools.partial(step, i) for i in range(10)], 3))
    await asyncio.wait_for(three.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task  # returns once every step is done: the waiting ones were cancelled too
    release.set()
    assert started == [0, 1, 2]


async def test_a_step_cancelled_inside_propagates_instead_of_being_a_result() -> None:
    async def step() -> int:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await gather_bounded([step], 2)
