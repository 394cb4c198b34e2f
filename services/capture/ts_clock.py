"""The per-source ts clock: ``physical_ms << 18 | logical``, strictly increasing.

Every value is a pure function of the previous ts and an input time, never of the wall clock
at the moment of reading, so a capture that re-reads the binlog after a crash (starting from
the clock saved in the newest resolved mark) hands the same transaction the same ts. Only the
resolved marks of an idle source read the wall clock, and they are published before anything
that follows them, so the clock they leave behind is in the stream too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from libs.ts import LOGICAL_BITS

LOGICAL_MASK = (1 << LOGICAL_BITS) - 1


def compose(physical_ms: int, logical: int = 0) -> int:
    if physical_ms < 0 or not 0 <= logical <= LOGICAL_MASK:
        raise ValueError(f"ts parts out of range: physical={physical_ms} logical={logical}")
    return (physical_ms << LOGICAL_BITS) | logical


def physical_ms(ts: int) -> int:
    return ts >> LOGICAL_BITS


def logical(ts: int) -> int:
    return ts & LOGICAL_MASK


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class TsClock:
    """``last`` is the newest ts handed out (a commit or a resolved mark); 0 before any."""

    last: int = 0

    def commit(self, event_ms: int) -> int:
        """The ts of a transaction whose binlog event carries ``event_ms``.

        The binlog stamps events in whole seconds and a source's clock may stall or step back,
        so the physical part never goes below the last one and the logical part breaks ties;
        a full logical range rolls over into the next millisecond rather than wrapping.
        """
        last_phys, last_log = physical_ms(self.last), logical(self.last)
        if event_ms > last_phys:
            ts = compose(event_ms, 0)
        elif last_log < LOGICAL_MASK:
            ts = compose(last_phys, last_log + 1)
        else:
            ts = compose(last_phys + 1, 0)
        self.last = ts
        return ts

    def resolve(self, now_ms: int) -> int:
        """The ts of a resolved mark at wall time ``now_ms`` when everything read is published.

        It never goes back (``max`` with the last ts) and it moves the clock, so every later
        commit gets a greater ts than the mark.
        """
        ts = max(compose(max(now_ms, 0), 0), self.last)
        self.last = ts
        return ts
