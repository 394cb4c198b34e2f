"""When the next round starts: at once after a round with work, else on a signal that there may
be work, with ``round_interval_s`` only as the longest wait (a missed signal costs at most that).

The signal is a new resolved mark of a source the worker's spans read: capture publishes a mark
once every change up to its ts is in the stream, so a mark is exactly when a round can apply
something new. The worker listens on the marks' subjects with a core NATS subscription (no
consumer, nothing stored; it sees the messages the ROWS stream takes in on them). The flag is
cleared just before a round reads its marks, so a mark that arrives during a round wakes the
next wait at once instead of being lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.streams import resolved_subject

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pause:
    """How the loop waits before its next round."""

    seconds: float
    """The longest wait (0: none)."""
    on_signal: bool
    """Whether a signal of new work ends the wait early (not after errors: they back off)."""


def pause_after(*, worked: bool, errors: bool, failures: int, interval_s: float) -> Pause:
    """The wait after a round: none when it applied something (more may be waiting); after a
    failed round a backoff that doubles with the failures in a row (up to 30 s); else until a
    signal, at most ``interval_s``."""
    if errors:
        return Pause(min(30.0, interval_s * 2 ** min(failures + 1, 6)), on_signal=False)
    if worked:
        return Pause(0.0, on_signal=True)
    return Pause(interval_s, on_signal=True)


def subscription_changes(current: Iterable[str], wanted: Iterable[str]) -> tuple[set[str], set[str]]:
    """The subjects to subscribe to and to leave, to go from ``current`` to ``wanted``."""
    have, want = set(current), set(wanted)
    return want - have, have - want


class RoundWakeup:
    """The "there may be work" flag of one worker's rounds, set by the resolved marks of the
    sources its spans read (``follow``) and by whoever else calls ``signal``."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.flag = asyncio.Event()
        self._subs: dict[str, Subscription] = {}

    def signal(self) -> None:
        self.flag.set()

    def clear(self) -> None:
        """Before a round reads its sources' marks: what arrives from then on wakes the next wait."""
        self.flag.clear()

    async def follow(self, sources: Iterable[str]) -> None:
        """Listen to exactly the resolved marks of ``sources`` (subject tokens). A subscription
        that fails only costs latency (the loop falls back to its interval): logged, not raised."""
        add, remove = subscription_changes(self._subs, {resolved_subject(s) for s in sources})
        for subject in remove:
            sub = self._subs.pop(subject)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for subject in sorted(add):
            try:
                self._subs[subject] = await self.nc.subscribe(subject, cb=self._on_mark)
            except Exception:
                log.warning("cannot listen to resolved marks; rounds fall back to their interval",
                            exc_info=True, extra={"subject": subject})

    async def _on_mark(self, _msg: Msg) -> None:
        self.flag.set()

    async def close(self) -> None:
        await self.follow(())
