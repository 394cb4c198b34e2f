"""When a control leader snapshots its domain: every ``every`` events (replayed ones count too,
so a leader that took over a long tail snapshots right away and the next one replays little)."""

from __future__ import annotations

import logging

from nats.errors import MaxPayloadError

from libs.eventstore import LeaderLog
from libs.telemetry.metrics import SNAPSHOTS_TOO_LARGE

log = logging.getLogger(__name__)


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
        try:
            await domain_log.snapshot()
        except MaxPayloadError:
            self.since = 0
            # A large state goes in chunks (libs/eventstore/snapshot_chunks), so this is a
            # server whose max_payload is below what a chunk needs for its headers. A new
            # leader then replays from the last snapshot that was written: slower, the same
            # state. The leader keeps its term; it tries again after another ``every`` events.
            SNAPSHOTS_TOO_LARGE.labels(stream=domain_log.stream).inc()
            log.error("snapshot of %s not written: larger than the NATS server's max_payload; "
                      "a new leader will replay from the last snapshot that fitted", domain_log.stream)
            return False
        self.since = 0
        return True
