"""Awaiting many independent requests side by side, a bounded number at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_bounded(steps: Iterable[Callable[[], Awaitable[T]]], limit: int) -> list[T | Exception]:
    """Run each of ``steps`` with at most ``limit`` running at once and return their results in
    order, a step that failed as its exception (so one failure neither hides the others' results
    nor leaves them running). Factories, not coroutines: a step that never starts (the caller
    was cancelled) is then never created. A cancellation (of the caller or inside a step)
    cancels the rest and propagates."""
    gate = asyncio.Semaphore(max(1, limit))

    async def one(step: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await step()

    results = await asyncio.gather(*(one(step) for step in steps), return_exceptions=True)
    out: list[T | Exception] = []
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
        out.append(result)
    return out


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it ended with, without swallowing a
    cancellation of the caller itself: ``with suppress(BaseException): await task`` also ate the
    CancelledError meant for the caller when both came at once, so a stopping service went on
    with its shutdown (checkpoint stores against an unreachable NATS server, one timeout each)
    and never exited. The caller's own cancellation is raised once the task has ended."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # the task's own failure: already its owner's to report
        return
