"""Where a span's first round starts: its stored checkpoint, else its table group's tables'
lowest, else its initial load's low watermark, else the changefeed's start position, time or
``start`` (``earliest``, or after the newest resolved mark for ``latest``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from nats.js import JetStreamContext

from libs.scheduling.model import Span
from libs.stream_origin import stream_origin, uncovered
from services.sink_worker.incidents.poison import TableIncident
from services.sink_worker.round.pull import latest_resolved
from services.sink_worker.snapshot.initial_load import InitialLoads, SnapshotRequest, snapshot_mode
from services.sink_worker.span.checkpoints import Checkpoint, CheckpointStore
from services.sink_worker.span.runtime import SpanRuntime, copied_spans
from services.sink_worker.span.start_point import start_at_position, start_at_time

log = logging.getLogger(__name__)


class SpanStarts:
    def __init__(self, js: JetStreamContext, checkpoints: CheckpointStore, rows_stream: str,
                 initial_loads: InitialLoads | None,
                 stopped: Callable[[SpanRuntime, TableIncident], None]) -> None:
        self.js = js
        self.stopped = stopped
        """Records (and logs, once) an incident that stops a span before its first round."""
        self.checkpoints = checkpoints
        self.rows_stream = rows_stream
        self.initial_loads = initial_loads
        self._listed: dict[tuple[str, str], tuple[float, list[Span]]] = {}

    async def load(self, rt: SpanRuntime) -> None:
        stored = await self.checkpoints.get(rt.span)
        rt.stored = stored
        if stored is None:
            inherited = await self.inherit(rt)
            if inherited is not None:
                rt.checkpoint = inherited  # stored with the first round, like any checkpoint
                return
        mode = snapshot_mode(rt.config.initial_load) if self.initial_loads is not None else None
        if mode is not None and (stored is None or mode == "snapshot-only"):
            await self._initial_load(rt, mode, stored)
            return
        if stored is not None:
            rt.checkpoint = stored
            return
        if rt.config.start_position is not None or rt.config.start_time is not None:
            origin = await stream_origin(self.js, rt.span.source, self.rows_stream)
            reason = uncovered(origin, position=rt.config.start_position,
                               start_time=rt.config.start_time if rt.config.start_position is None else None)
            if reason is not None:
                # No checkpoint: the span stays stopped until the changefeed is made again.
                rt.checkpoint = None
                incident = rt.refused_before_start(reason)
                if incident is not None:
                    self.stopped(rt, incident)
                return
            if rt.config.start_position is not None:
                initial = await start_at_position(self.js, rt.span, rt.config.start_position,
                                                  self.rows_stream)
            else:
                assert rt.config.start_time is not None
                initial = await start_at_time(self.js, rt.span, rt.config.start_time, self.rows_stream)
            await self.checkpoints.advance(rt.span, initial, expected=None)
            rt.stored = rt.checkpoint = initial
            # Where a changefeed's start point put the span: what a missing or extra first row
            # is traced back to.
            log.info("span starts at its changefeed's start point", extra={
                "span": rt.span.name, "stream_seq": initial.stream_seq, "checkpoint_ts": initial.ts,
                "start_position": (rt.config.start_position.model_dump(mode="json")
                                   if rt.config.start_position is not None else None),
                "start_time": str(rt.config.start_time) if rt.config.start_time is not None else None})
            return
        if rt.config.start == "latest":
            # Start after the newest resolved mark: capture publishes a mark once everything
            # before it is acknowledged, and whatever it publishes later has a higher ts.
            mark = await latest_resolved(self.js, rt.span.source, self.rows_stream)
            initial = Checkpoint(mark.stream_seq, mark.ts) if mark else Checkpoint()
            await self.checkpoints.advance(rt.span, initial, expected=None)
            rt.stored = initial
            rt.checkpoint = initial
            return
        rt.checkpoint = Checkpoint()

    async def inherit(self, rt: SpanRuntime) -> Checkpoint | None:
        """A span new to its tables because foreign keys changed (a group formed by a key
        added, grown by a table, split by a key dropped) goes on from the lowest checkpoint of
        the spans that held its tables (each stopped at the key change, ``fk_barrier``), not
        from where a new span starts: replaying from the lowest is what any replay does, and
        converges (DESIGN.md, "Foreign-key cascades")."""
        own = set(rt.span.tables())
        candidates = [s for s in copied_spans(rt.span) if s != rt.span]
        candidates += [g for g in await self._group_spans(rt) if g != rt.span and own & set(g.tables())]
        held = [(span.tables(), cp) for span in candidates
                if (cp := await self.checkpoints.get(span)) is not None]
        start, covered = inherited_start(own, held)
        if start is None:
            return None
        config = rt.config
        from_zero = (config.start == "earliest" and config.start_position is None
                     and config.start_time is None)
        if not covered and (config.initial_load != "binlog-only" or from_zero):
            # A table no span held starts where the changefeed starts a new table: from the
            # stream's start (which also covers the others) or with its own copy.
            return None
        log.info("a new foreign-key table group starts from its tables' lowest checkpoint",
                 extra={"span": rt.span.name, "checkpoint_ts": start.ts, "stream_seq": start.stream_seq})
        return start

    async def _group_spans(self, rt: SpanRuntime) -> list[Span]:
        """The changefeed's group spans on the span's source, listed after the span was made
        here (so after the key change that made it): many spans starting at once (a worker's
        start) share one listing of the bucket's keys."""
        key = (rt.span.changefeed, rt.span.source)
        listed = self._listed.get(key)
        if listed is None or listed[0] < rt.created_at:
            listed = self._listed[key] = (time.monotonic(),
                                          await self.checkpoints.group_spans(*key))
        return listed[1]

    async def _initial_load(self, rt: SpanRuntime, mode: Literal["snapshot", "snapshot-only"],
                            stored: Checkpoint | None) -> None:
        """The span copies first (``services.sink_worker.snapshot.initial_load``): no checkpoint while it
        copies, then one at the copy's low watermark, where streaming starts."""
        assert self.initial_loads is not None
        decisions = [await self.initial_loads.decide(SnapshotRequest(
            span, rt.config.source_url, rt.config.sink_url, rt.config.key_policy, mode, rt.shards,
            rt.config.router, case_insensitive=rt.config.case_insensitive)) for span in copied_spans(rt.span)]
        decision, start = decisions[0]
        refused = [self.initial_loads.unreplicable.pop(span, None) for span in copied_spans(rt.span)]
        reasons = [r for r in refused if r is not None]
        if reasons:
            # The table cannot be copied as the changefeed says: stopped before any checkpoint.
            rt.checkpoint = None
            incident = rt.refused_before_start("; ".join(reasons))
            if incident is not None:
                self.stopped(rt, incident)
            return
        if len(decisions) > 1 and all(d != "copying" for d, _ in decisions):
            # A table group: each table is copied on its own (its own watermarks); the group
            # streams from the lowest low watermark, so the order of the copies does not matter
            # and a table copied later only replays more (DESIGN.md, "Foreign-key cascades").
            starts = [c for _, c in decisions if c is not None]
            start = Checkpoint(min(c.stream_seq for c in starts), min(c.ts for c in starts))
            decision = "done" if all(d == "done" for d, _ in decisions) else "stream"
        elif any(d == "copying" for d, _ in decisions):
            decision = "copying"
        if decision == "copying":
            rt.checkpoint = None
            rt.started("copying")
            return
        assert start is not None
        if stored is None:
            await self.checkpoints.advance(rt.span, start, expected=None)
            stored = start
        rt.stored = rt.checkpoint = stored
        rt.started("done" if decision == "done" else "stream")

    # ------------------------------------------------------------------ round


def inherited_start(tables: set[tuple[str, str]],
                    held: list[tuple[tuple[tuple[str, str], ...], Checkpoint]]
                    ) -> tuple[Checkpoint | None, bool]:
    """The lowest checkpoint of the spans that held some of ``tables`` (``held``: each one's
    tables and stored checkpoint), and whether they held every one of them."""
    relevant = [(ts, cp) for ts, cp in held if tables & set(ts)]
    if not relevant:
        return None, False
    covered = tables <= {t for ts, _ in relevant for t in ts}
    return Checkpoint(min(cp.stream_seq for _, cp in relevant), min(cp.ts for _, cp in relevant)), covered
