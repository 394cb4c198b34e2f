"""When a control leader snapshots its domain: every ``every`` events (replayed ones count too,
so a leader that took over a long tail snapshots right away and the next one replays little)."""

from __future__ import annotations

from libs.eventstore import LeaderLog


class SnapshotPolicy:
    def __init__(self, every: int) -> None:
        self.every = every
        self.since = 0

    def opened(self, domain_log: LeaderLog) -> None:
        loaded = domain_log.loaded
        self.since = loaded.events_replayed if loaded is not None else 0

    def appended(self, n: int = 1) -> None:
        self.since += n

    def due(self) -> bool:
        return self.since >= self.every

    async def maybe_snapshot(self, domain_log: LeaderLog) -> bool:
        if not self.due():
            return False
        await domain_log.snapshot()
        self.since = 0
        return True
