"""The replication-manager leader's syncpoints (``libs.syncpoints`` decides; this carries out).

Per changefeed, each tick: the spans' reported checkpoints, the sources' newest resolved marks
and the recorded syncpoints go to ``decide``; then

- Plan: record ``syncpoint.planned``, write the cap to ``SYNCPOINT_BUCKET``, then read the marks
  again: a mark past T means a worker may have written past T before it could read the cap
  (it reads the marks before the cap), so T is abandoned at once;
- Reach: write the downstream row (``sluice_syncpoint``, once per T), record
  ``syncpoint.reached`` with the hold's end, write the bucket (the cap stays);
- Release / Abandon: record ``syncpoint.ended``, write the bucket (no cap).

Every event is recorded (fenced) before the bucket says it, so the bucket never runs ahead of
the log a new leader rebuilds from. A new leader writes every changefeed's record again and
keeps a pending T only if no mark passed it: the old leader may have died before its cap was
out. A released T keeps its row; a T abandoned after its row was written keeps its row too
(every span was at T when it was written, so the row is true) but is not shown as the last one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, Literal

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.changefeeds import ChangefeedSpec
from contracts.events.rows import ResolvedAdvancedV1
from contracts.events.syncpoints import SyncpointEndedV1, SyncpointPlannedV1, SyncpointReachedV1
from libs.control.replication_state import ReplicationState
from libs.eventstore import Fenced, LeaderLog
from libs.scheduling import Span
from libs.streams import ROWS_STREAM, resolved_subject, token
from libs.syncpoints import (
    Abandon,
    ChangefeedSyncpoints,
    Idle,
    Plan,
    Reach,
    Release,
    SpanProgress,
    SyncpointRecord,
    decide,
    marks_passed,
    record_json,
    syncpoint_bucket,
)
from libs.ts import ts_seconds
from services.replication_manager.core import ReplicationCore

log = logging.getLogger(__name__)

SYNCPOINTS = Counter("sluice_syncpoints", "Syncpoints by outcome (released, abandoned).",
                     ["changefeed", "outcome"])
SYNCPOINT_TIME = Gauge("sluice_syncpoint_timestamp_seconds",
                       "Upstream commit time (Unix seconds) of the changefeed's last released syncpoint.",
                       ["changefeed"])

RESYNC_S = 5.0
"""How often a leader writes every changefeed's record to the bucket again."""

RowWriter = Callable[[str, str, int], str]
"""(sink URL, changefeed, T) -> the row's commit time; runs in a thread."""


def write_row(sink_url: str, changefeed: str, ts: int) -> str:
    from services.sink_worker.sinks.factory import open_sink
    from services.sink_worker.sinks.sql_common import SqlSink
    from services.sink_worker.sinks.syncpoint_table import write_syncpoint

    sink = open_sink(sink_url)
    assert isinstance(sink, SqlSink)
    try:
        return write_syncpoint(sink, changefeed, ts)
    finally:
        sink.close()


async def newest_mark(js: JetStreamContext, source: str, rows_stream: str = ROWS_STREAM) -> int | None:
    try:
        raw = await js.get_last_msg(rows_stream, resolved_subject(source))
    except NotFoundError:
        return None
    try:
        event = REGISTRY.decode(raw.data or b"").event
    except ContractError:
        return None
    return event.ts if isinstance(event, ResolvedAdvancedV1) else None


class SyncpointDriver:
    def __init__(self, js: JetStreamContext, domain_log: LeaderLog, core: ReplicationCore,
                 specs: Callable[[], dict[str, ChangefeedSpec]],
                 running: Callable[[str], bool],
                 stopped: Callable[[], Collection[tuple[str, str, str, str]]],
                 *, write: RowWriter = write_row, rows_stream: str = ROWS_STREAM,
                 clock: Callable[[], float] = time.time) -> None:
        self.js = js
        self.domain_log = domain_log
        self.core = core
        self.specs = specs
        self.running = running
        self.stopped = stopped
        self.write = write
        self.rows_stream = rows_stream
        self.clock = clock
        self._kv: Any = None
        self._started = False
        self._synced = 0.0
        self.errors: dict[str, str] = {}

    @property
    def state(self) -> dict[str, ChangefeedSyncpoints]:
        recorded = self.domain_log.state
        assert isinstance(recorded, ReplicationState)
        return recorded.syncpoints

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await syncpoint_bucket(self.js)
        return self._kv

    async def _put(self, changefeed: str) -> None:
        sp = self.state.get(changefeed, ChangefeedSyncpoints())
        kv = await self._bucket()
        await kv.put(token(changefeed), record_json(sp.record(changefeed)))

    async def _append(self, event: BaseModel) -> None:
        await self.domain_log.append(event)

    def _sources(self, spec: ChangefeedSpec | None, spans: list[Span]) -> list[str]:
        """The changefeed's sources (subject tokens): its spec's, else those of its spans."""
        if spec is not None:
            return sorted({token(s.id) for s in spec.sources})
        return sorted({s.source for s in spans})

    async def _marks(self, sources: list[str]) -> dict[str, int | None]:
        return {s: await newest_mark(self.js, s, self.rows_stream) for s in sources}

    async def start(self) -> None:
        """A new term: the bucket says what the log says; a pending T no mark passed stays."""
        now = self.clock()
        specs = self.specs()
        for cf, sp in sorted(self.state.items()):
            pending = sp.pending
            if pending is not None and not pending.reached:
                sources = self._sources(specs.get(cf), self.core.wanted.get(cf, []))
                passed = marks_passed(pending.ts, await self._marks(sources))
                if passed is not None:
                    await self._end(cf, pending.ts, "abandoned",
                                    f"the leader changed and the mark of {passed} passed T meanwhile", now)
                    continue
            await self._put(cf)
        self._started = True
        self._synced = self.clock()

    async def tick(self) -> None:
        try:
            if not self._started:
                await self.start()
            elif self.clock() - self._synced >= RESYNC_S:
                # A deposed leader's last bucket write can land after this term's: write every
                # record again now and then, so the bucket never keeps a cap the log has ended.
                self._synced = self.clock()
                for cf in sorted(self.state):
                    await self._put(cf)
        except Fenced:
            raise
        except Exception:
            log.warning("syncpoint records not written; next tick again", exc_info=True)
            return
        if not self.core.ready:
            return  # the checkpoints are not the members' yet
        specs = self.specs()
        stopped = self.stopped()
        for cf in sorted(set(specs) | set(self.state)):
            spec = specs.get(cf)
            interval = spec.syncpoint_interval if spec is not None and self.running(cf) else None
            sp = self.state.get(cf, ChangefeedSyncpoints())
            if interval is None and sp.pending is None:
                continue
            try:
                await self._step(cf, spec, interval, sp, stopped)
                self.errors.pop(cf, None)
            except Fenced:
                raise  # deposed: the loop steps down
            except Exception as exc:
                # The downstream may be unreachable: the spans wait at T (or go on, if it was not
                # planned yet) and the next tick tries again, until the reach timeout abandons T.
                if self.errors.get(cf) != repr(exc):
                    log.warning("syncpoint step failed", exc_info=True, extra={"changefeed": cf})
                self.errors[cf] = repr(exc)

    async def _step(self, cf: str, spec: ChangefeedSpec | None, interval: float | None,
                    sp: ChangefeedSyncpoints, stopped: Collection[tuple[str, str, str, str]]) -> None:
        spans = self.core.wanted.get(cf, [])
        sets = self.core.manager.sets
        progress: dict[str, SpanProgress] = {}
        for span in spans:
            rs = sets.get(span)
            usable = rs is not None and rs.error is None and rs.primary is not None
            progress[span.name] = SpanProgress(rs.checkpoint_ts if usable and rs is not None else None,
                                               stopped=span in stopped)
        sources = self._sources(spec, spans)
        marks = await self._marks(sources)
        now = self.clock()
        step = decide(sp, interval_s=interval, hold_s=spec.syncpoint_hold_s if spec else 0.0, now=now,
                      spans=progress, marks=marks)
        if isinstance(step, Idle):
            return
        if isinstance(step, Plan):
            await self._append(SyncpointPlannedV1(changefeed=cf, ts=step.ts, planned_at=now))
            await self._put(cf)
            passed = marks_passed(step.ts, await self._marks(sources))
            if passed is not None:
                await self._end(cf, step.ts, "abandoned",
                                f"the mark of {passed} passed T before the cap was out", self.clock())
            return
        if isinstance(step, Reach):
            assert spec is not None
            commit_time = await asyncio.to_thread(self.write, spec.sink_url, cf, step.ts)
            reached_at = self.clock()
            await self._append(SyncpointReachedV1(changefeed=cf, ts=step.ts, commit_time=commit_time,
                                                  hold_until=reached_at + spec.syncpoint_hold_s))
            await self._put(cf)
            log.info("syncpoint reached", extra={"changefeed": cf, "ts": step.ts,
                                                 "commit_time": commit_time,
                                                 "hold_s": spec.syncpoint_hold_s})
            return
        if isinstance(step, Release):
            await self._end(cf, step.ts, "released", "", now)
            SYNCPOINT_TIME.labels(cf).set(ts_seconds(step.ts))
            return
        if isinstance(step, Abandon):
            log.warning("syncpoint abandoned: %s", step.reason, extra={"changefeed": cf, "ts": step.ts})
            await self._end(cf, step.ts, "abandoned", step.reason, now)

    async def _end(self, cf: str, ts: int, outcome: Literal["released", "abandoned"], reason: str,
                   now: float) -> None:
        await self._append(SyncpointEndedV1(changefeed=cf, ts=ts, outcome=outcome,
                                            reason=reason, ended_at=now))
        await self._put(cf)
        SYNCPOINTS.labels(cf, outcome).inc()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cf, sp in sorted(self.state.items()):
            record: SyncpointRecord = sp.record(cf)
            view = record.view()
            if cf in self.errors:
                view["error"] = self.errors[cf]
            out[cf] = view
        return out
