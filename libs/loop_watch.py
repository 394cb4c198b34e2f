"""A watchdog for a service's event loop: how long the loop went without running a callback,
and, when that passes a threshold, where it was stuck.

Every service does its NATS work, its heartbeats and its lease renewals on one asyncio loop. A
callback that holds the loop (a computation over every span, a synchronous call, threads that
keep the GIL) delays all of them at once; a sink-worker whose heartbeats are not confirmed
within ``SLUICE_MEMBER_FENCE_S`` fences itself and drops every span, a leader whose renewals
are late loses its lease. The effect shows far from its cause, so the watchdog names the
cause: a thread samples the loop's progress every ``period_s`` and, once the loop has been
stuck longer than ``threshold_s``, logs the loop thread's stack at that moment (once per
stall) and counts the stall's length in ``sluice_event_loop_stall_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from prometheus_client import Histogram

log = logging.getLogger(__name__)

STALLS = Histogram("sluice_event_loop_stall_seconds",
                   "How long the service's event loop ran no callback, per stall longer than the threshold.",
                   buckets=(0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0))


class LoopWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, threshold_s: float = 0.5,
                 period_s: float = 0.1) -> None:
        self.loop = loop
        self.threshold_s = threshold_s
        self.period_s = period_s
        self.stalls = 0
        self.longest_s = 0.0
        self._beat = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """From the loop's thread (the one whose stack a stall reports)."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self.loop.call_soon(self._tick)
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        self._beat = time.monotonic()
        if not self._stop.is_set():
            self.loop.call_later(self.period_s, self._tick)

    def _watch(self) -> None:
        stuck_since: float | None = None
        reported = False
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            # The tick is due every period: anything beyond that is time the loop did not run.
            late = now - self._beat - self.period_s
            if late < self.threshold_s:
                if stuck_since is not None:
                    self._ended(now - stuck_since)
                stuck_since, reported = None, False
                continue
            if stuck_since is None:
                stuck_since = self._beat + self.period_s
            if not reported:
                reported = True
                self.stalls += 1
                frame = sys._current_frames().get(self._loop_thread)
                stack = traceback.format_stack(frame)[-12:] if frame is not None else []
                log.warning("event loop stalled", extra={
                    "stalled_s": round(now - stuck_since, 3),
                    "stack": [line.strip() for line in stack]})

    def _ended(self, stalled_s: float) -> None:
        self.longest_s = max(self.longest_s, stalled_s)
        STALLS.observe(stalled_s)
        log.warning("event loop ran again", extra={"stalled_s": round(stalled_s, 3)})
