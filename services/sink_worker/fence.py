"""The worker's self-fence: it writes only while the server has recently confirmed its heartbeats.

The member service may declare a member left (and the replication-manager move its spans) only
after it has heard nothing from it for ``SLUICE_MEMBER_FENCE_S`` plus a margin (a killed worker,
found by the leader's probe) or ``SLUICE_MEMBER_TTL_S`` (a silent one). A heartbeat counts as
confirmed once ``flush`` returned after it: the server has it. The fence deadline is the *send*
time of the newest confirmed heartbeat plus ``bound_s``; the leader measures its silence from
when it *received* a heartbeat, which is later, so a worker that stops confirming stops writing
before the leader may move its spans (the arithmetic is in DESIGN.md, Leadership).

A worker whose connection was ever lost (nats-py reconnects on its own) does not trust later
confirmations for this incarnation: while it was away the leader may have found it gone. It
starts over as a new incarnation instead (``SinkAgent.start_over``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Fenced(Exception):
    """A write was refused because the worker could not confirm its heartbeats in time."""


class SelfFence:
    def __init__(self, bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound_s = bound_s
        self._clock = clock
        self._confirmed_sent_at: float | None = None
        self._broken = False
        self.fenced = 0
        """How many times this worker fenced itself (each one started a new incarnation)."""

    def confirm(self, sent_at: float) -> None:
        """The heartbeat sent at ``sent_at`` (this clock) reached the server."""
        if self._broken:
            return
        if self._confirmed_sent_at is not None and sent_at >= self._confirmed_sent_at + self.bound_s:
            # A gap longer than the bound (a stopped process resuming): the deadline passed
            # while nobody looked, and the leader may have moved the spans meanwhile.
            self._broken = True
            return
        if self._confirmed_sent_at is None or sent_at > self._confirmed_sent_at:
            self._confirmed_sent_at = sent_at

    def connection_lost(self) -> None:
        """No later confirmation counts for this incarnation (see the module docstring)."""
        self._broken = True

    @property
    def broken(self) -> bool:
        """The connection was lost since this incarnation began: only a new one may write."""
        return self._broken

    @property
    def deadline(self) -> float | None:
        """Until when writing is allowed (this clock); None before the first confirmation."""
        if self._broken or self._confirmed_sent_at is None:
            return None
        return self._confirmed_sent_at + self.bound_s

    def may_write(self) -> bool:
        deadline = self.deadline
        if deadline is not None and self._clock() >= deadline:
            self._broken = True  # latched: only a new incarnation writes again
        return deadline is not None and self._clock() < deadline

    def remaining_s(self) -> float | None:
        deadline = self.deadline
        return None if deadline is None else round(deadline - self._clock(), 3)

    def check(self) -> None:
        """Raise ``Fenced`` when writing is not allowed now."""
        if not self.may_write():
            raise Fenced(f"no heartbeat confirmed by the server within {self.bound_s} s")

    def reset(self) -> None:
        """A new incarnation: nothing confirmed yet, the connection trusted again."""
        self._confirmed_sent_at = None
        self._broken = False
