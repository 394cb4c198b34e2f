"""An event-loop lag probe: how late a periodic timer fires on the loop it runs on.

A task sleeps ``interval`` again and again and records how much later than asked each sleep
ended: the longest such delay is the longest stretch the loop spent in other work without a
turn (a lease renewal due in that stretch waits as long).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class LoopLag:
    interval: float = 0.05
    max_lag: float = 0.0
    samples: list[float] = field(default_factory=list)

    async def _run(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.interval)
            lag = time.monotonic() - asked - self.interval
            self.samples.append(lag)
            self.max_lag = max(self.max_lag, lag)


@contextlib.asynccontextmanager
async def loop_lag_probe(interval: float = 0.05) -> AsyncIterator[LoopLag]:
    """A ``LoopLag`` recording on the running loop while the block runs."""
    probe = LoopLag(interval)
    task = asyncio.create_task(probe._run(), name="loop-lag-probe")
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
