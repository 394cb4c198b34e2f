"""The event-loop watchdog: a callback that holds the loop is reported with its stack, once per
stall, and counted when the loop runs again; a loop that keeps running reports nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from libs.loop_watch import LoopWatch
from tests.helpers.capture import eventually


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # the blocking call the watchdog must find: the test's subject, not a wait


async def test_a_stall_is_logged_with_the_blocking_stack_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = LoopWatch(asyncio.get_running_loop(), threshold_s=0.2, period_s=0.05)
    caplog.set_level(logging.WARNING, logger="libs.loop_watch")
    watch.start()
    try:
        for _ in range(5):
            await asyncio.sleep(0.05)  # a loop that runs: nothing to report
        assert watch.stalls == 0
        _hold_the_loop(0.6)

        async def ended() -> bool:
            return watch.longest_s > 0

        await eventually(ended, 5, "the stall's end to be counted", interval=0.05)
    finally:
        watch.stop()
    assert watch.stalls == 1
    assert 0.3 <= watch.longest_s <= 2.0
    stalled = [r for r in caplog.records if r.getMessage() == "event loop stalled"]
    assert len(stalled) == 1
    assert any("_hold_the_loop" in line for line in stalled[0].stack)  # type: ignore[attr-defined]
    assert any(r.getMessage() == "event loop ran again" for r in caplog.records)
