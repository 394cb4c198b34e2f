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
            # A snapshot is one message: a state past the server's max_payload (the replication
            # domain near 70,000 spans at the default 1 MiB) cannot be written. A new leader then
            # replays from the last snapshot that fitted: slower, the same state. The leader
            # keeps its term; it tries again after another ``every`` events.
            SNAPSHOTS_TOO_LARGE.labels(stream=domain_log.stream).inc()
            log.error("snapshot of %s not written: larger than the NATS server's max_payload; "
                      "a new leader will replay from the last snapshot that fitted", domain_log.stream)
            return False
        self.since = 0
        return True
