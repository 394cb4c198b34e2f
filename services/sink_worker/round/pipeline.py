"""The table pipelines of one worker: rounds of pull, sort, apply, DDL and checkpoint.

A round covers every span the worker runs, with one cut (on the driver) for all of them:

1. read each source's resolved ts *before* pulling, so that every event at or below it is
   already in the stream when the pull runs;
2. pull each span's events after its checkpoint (bounded: each span's allowance from
   ``round_size``, together within ``max_events_per_round``, which bounds the driver's memory;
   mostly in memory already, read ahead while the previous round wrote: ``round_overlap``);
3. in the driver, plan each span once (``round_plan``): its routes, target and key; a table
   without a usable key stops with an incident (recorded in the changefeeds log, logged once,
   in the health status and a metric) until an operator resumes it; a DDL at its head is
   carried out or waited for (``ddl_barrier``);
4. in a worker thread (never on the event loop): each span's cut (on the driver,
   ``sort_job``), then per sink its writer (``writer``: the apply job, one Spark job, and the
   DDL barriers the batches stopped at; the NATS sink publishes afterwards, on the loop);
5. advance each span's checkpoint, only for batches that were written in full
   (``checkpoint_advance``; the spans' stores side by side). A span without pending events
   follows its source's resolved ts.

A failed round advances nothing for the spans it failed; they are read again next round, and
re-applying is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from uuid import uuid4

from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from libs.concurrency import gather_bounded
from libs.gc_pause import gc_paused
from libs.scheduling.model import Span
from libs.spark import spark_gone
from libs.streams import ROWS_STREAM
from libs.syncpoints import SyncpointCaps, capped
from libs.table_rules import NO_RULES, rules_for
from libs.telemetry.tracing import tracer
from services.sink_worker import metrics as m
from services.sink_worker.ddl.barrier import DdlBarrier
from services.sink_worker.ddl.shard import ShardDdl, lock_ref
from services.sink_worker.ddl.target_schemas import TargetSchemas
from services.sink_worker.fence import Fenced, SelfFence
from services.sink_worker.fk.barrier import ForeignKeyBarrier
from services.sink_worker.incidents.poison import IncidentAction, TableIncident
from services.sink_worker.round.checkpoint_advance import CheckpointAdvance
from services.sink_worker.round.large_txn import LargeTxnOptions, apply_large, large_head
from services.sink_worker.round.overlap import AheadSpan, read_ahead, settle
from services.sink_worker.round.plan import RoundPlanner, count_shards
from services.sink_worker.round.pull import (
    PullResult,
    ResolvedMark,
    SpanReader,
    last_data_seq,
    latest_resolved,
)
from services.sink_worker.round.quiet import follow_quietly, quiet_after_visit, recheck_quietly
from services.sink_worker.round.routes import SpanRoutes
from services.sink_worker.round.size import RoundSize
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.round.trace import batch_span
from services.sink_worker.round.work import RoundAbandoned, RoundReport, SpanWork
from services.sink_worker.round.writer import Outcomes, Writers, needs_guard
from services.sink_worker.sinks.factory import sink_kind
from services.sink_worker.sinks.write_fence import WriteFences
from services.sink_worker.snapshot.initial_load import InitialLoads, snapshot_mode
from services.sink_worker.span.checkpoints import Checkpoint, CheckpointStore
from services.sink_worker.span.machine import SpanOutcome, SpanState
from services.sink_worker.span.runtime import PipelineOptions, SpanConfig, SpanRuntime, copied_spans
from services.sink_worker.span.start import SpanStarts
from services.sink_worker.validation.validator import Validator

log = logging.getLogger(__name__)

# Spans whose stored checkpoint is read, or whose pull runs, at once in a round: each mostly
# waits on a request (and a pull on its decode in a thread), so a few dozen overlap well; more
# would only queue on the server and the default thread pool.
PULL_CONCURRENCY = 16


class Pipeline:
    def _reader(self, span: Span) -> SpanReader:
        return SpanReader(self.js, span, self.rows_stream, max_bytes=self.options.pull_max_bytes)

    def __init__(self, js: JetStreamContext, checkpoints: CheckpointStore,
                 spark: Callable[[], SparkSession], options: PipelineOptions | None = None,
                 rows_stream: str = ROWS_STREAM, initial_loads: InitialLoads | None = None) -> None:
        self.js = js
        self.checkpoints = checkpoints
        self.initial_loads = initial_loads
        """Runs the initial loads of spans in a snapshot mode (None: every span streams only)."""
        self._spark = spark
        self.options = options or PipelineOptions()
        self.rows_stream = rows_stream
        self.round_size = RoundSize(self.options.min_events_per_round, self.options.max_events_per_round,
                                    self.options.round_max_bytes)
        """Each span's events per round, adapted to whether it is behind (``round_size``)."""
        self._ahead: asyncio.Future[None] | None = None
        """The running round's read-ahead (``round_overlap``); None or done between rounds."""
        self.spans: dict[Span, SpanRuntime] = {}
        self._spans_changed = 0  # bumped whenever ``spans`` or a span's config changes
        self._shards_counted: tuple[int, float | None] | None = None
        self._groups_checked = -1  # ``_spans_changed`` when the groups were last checked for every span
        self.followed: set[Span] = set()
        """Spans that only followed their source's resolved ts in the last round (``round.quiet``):
        their progress waits for the member's next complete report (``report_delta``)."""
        self.prepared: dict[Span, SpanRuntime] = {}
        """Spans loaded by ``prepare`` that do not run (write) yet."""
        self.fence: SelfFence | None = None
        """Checked before every write of a round (``Fenced`` ends the round, nothing advances)."""
        self.validation: Validator | None = None
        """Continuous validation: told the keys of every written batch (``validation``)."""
        self.rounds = 0
        self.last_report: RoundReport | None = None
        self.shard_ddl: ShardDdl | None = None
        """Shard DDL coordination; without it a sharded target's DDL blocks its spans."""
        self.known_skips: dict[Span, dict[str, int]] = {}
        """Keys operators skipped, per span, from the changefeeds log (spans run here or not)."""
        self.new_incidents: list[tuple[Span, TableIncident]] = []
        """Spans stopped since the worker last recorded them in the changefeeds log."""
        self.new_overwrites: list[tuple[str, str]] = []
        """(changefeed, conflict JSON) of rows removed under ``on_unique_conflict = overwrite``."""
        self.advance = CheckpointAdvance(checkpoints, self.options, initial_loads, self.new_incidents)
        self.starts = SpanStarts(js, checkpoints, rows_stream, initial_loads, self.advance.stopped)
        self.planner = RoundPlanner(js, rows_stream, spark)
        schemas = TargetSchemas()
        self.barrier = DdlBarrier(schemas, initial_loads)
        self.fk_barrier = ForeignKeyBarrier()
        self.caps = SyncpointCaps(js)
        """Each changefeed's syncpoint cap, read every round (``libs.syncpoints``)."""
        self.fences = initial_loads.fences if initial_loads is not None else WriteFences()
        """Write tokens of the spans this worker writes (``write_fence``), shared with the copies."""
        self.writers = Writers(self.options, schemas, self.barrier, self.new_overwrites, self.fences)

    def attach_shard_ddl(self, shard_ddl: ShardDdl) -> None:
        self.shard_ddl = self.barrier.shard_ddl = shard_ddl
        self._spans_changed += 1  # counted again with the groups

        def passed(changefeed: str, ref: object) -> int | None:
            for span, rt in self.spans.items():
                if span.changefeed == changefeed and lock_ref(span) == ref and rt.checkpoint is not None:
                    return rt.checkpoint.stream_seq
            return None

        shard_ddl.passed = passed

    # ------------------------------------------------------------------ spans

    async def set_spans(self, wanted: dict[Span, SpanConfig]) -> None:
        """Run exactly ``wanted`` from the next round on (checkpoints stay in the bucket).

        A wanted span that was prepared (``prepare``) starts with the prepared reader and its
        read-ahead; its checkpoint is read from the bucket again at its first round, because
        the previous owner went on writing while it prepared."""
        await self._ahead_done()  # after a failed round: its read-ahead may still use the readers
        for span in [s for s in self.spans if s not in wanted]:
            self._spans_changed += 1
            await self.spans.pop(span).reader.close()
            if self.initial_loads is not None:
                await self.initial_loads.stop(span)
            self.advance.forget_gauges(span)
            self._forget(span)
        for span, config in wanted.items():
            rt = self.spans.get(span)
            if rt is None and span in self.prepared:
                rt = self.spans[span] = self.prepared.pop(span)
                rt.checkpoint = rt.stored = None
                rt.config = config
                self._spans_changed += 1
            if rt is None:
                self.spans[span] = SpanRuntime(span, config, self._reader(span))
                self._spans_changed += 1
            elif rt.config != config:
                rt.config = config
                self._spans_changed += 1
        if self.known_skips:
            for span in wanted:
                self.spans[span].skips.update(self.known_skips.get(span, {}))
        self._count_shards()

    def _count_shards(self) -> None:
        """Several upstream shards in one target: their DDL needs the ddl-lock, not this path.
        Counted again only when the spans, their configs or the shard groups changed: counting
        every span each round was a tenth of an idle worker's CPU at 3,000 spans."""
        groups_at = self.shard_ddl.groups_at if self.shard_ddl is not None else None
        key = (self._spans_changed, groups_at)
        if key != self._shards_counted:
            count_shards(self.spans, self.shard_ddl)
            self._shards_counted = key

    async def close(self) -> None:
        await self._ahead_done()
        if self.initial_loads is not None:
            await self.initial_loads.close()
        for rt in [*self.spans.values(), *self.prepared.values()]:
            await rt.reader.close()
        self.prepared.clear()
        await self.writers.close()

    # ------------------------------------------------------------------ two-phase scheduling

    async def prepare(self, span: Span, config: SpanConfig) -> Checkpoint:
        """First phase of taking a span over: load it without writing anything.

        Reads the span's checkpoint (read-only: a span without one starts where its config
        says, but nothing is stored until it runs), creates its consumer there and pulls the
        first batch into the reader's read-ahead, so the span starts at once when it is
        committed. Sorting waits for the span's first round: the previous owner keeps writing
        meanwhile, so a batch sorted now would mostly be below the checkpoint by then. Safe to
        run while a round is in progress (it touches only this span's reader). Returns the
        checkpoint it prepared from."""
        rt = self.prepared.get(span)
        if rt is None:
            rt = self.prepared[span] = SpanRuntime(span, config, self._reader(span))
        rt.config = config
        start = await self.checkpoints.get(span)
        if start is None and span.members is not None:
            start = await self.starts.inherit(rt)
        if start is None and self.initial_loads is not None and snapshot_mode(config.initial_load):
            # Its initial load runs once it is committed here; nothing to read ahead before.
            rt.checkpoint = Checkpoint()
            return rt.checkpoint
        mark = await latest_resolved(self.js, span.source, self.rows_stream)
        if start is None:
            if config.start == "latest" and mark is not None:
                start = Checkpoint(mark.stream_seq, mark.ts)
            else:
                start = Checkpoint()
        limit = max(1, self.options.max_events_per_round // (len(self.spans) + 1))
        await rt.reader.pull((start.stream_seq, start.ts), limit, mark.stream_seq if mark else None)
        rt.resolved_ts = mark.ts if mark else None
        rt.checkpoint = start
        return start

    async def load_checkpoints(self) -> dict[Span, Checkpoint]:
        """Load the checkpoint of every span that has none yet (as the next round would):
        where each newly started span begins. The worker records it for the hand-over audit."""
        loaded: dict[Span, Checkpoint] = {}
        for rt in self.spans.values():
            if rt.checkpoint is None:
                await self.starts.load(rt)
                if rt.checkpoint is not None:
                    loaded[rt.span] = rt.checkpoint
        return loaded

    async def drop_prepared(self, span: Span) -> None:
        rt = self.prepared.pop(span, None)
        if rt is not None:
            await rt.reader.close()

    async def stop_span(self, span: Span) -> Checkpoint | None:
        """Stop running ``span`` (between rounds): store its latest checkpoint, which covers
        written batches only, and let it go. Returns that checkpoint: the next owner starts
        there. A checkpoint that cannot be stored is not returned (the next owner re-applies
        from the stored one, which is idempotent)."""
        await self._ahead_done()
        rt = self.spans.pop(span, None)
        self._spans_changed += 1
        if self.initial_loads is not None:
            for copied in copied_spans(span):
                await self.initial_loads.stop(copied)  # its finished chunks stay for the next owner
        if rt is None:
            return None
        final = await self.advance.store_final(rt)
        await rt.reader.close()
        self.advance.forget_gauges(span)
        self._forget(span)
        return final

    def _forget(self, span: Span) -> None:
        """What this worker kept about a span it let go. Its write fences are taken again
        (bumped) if the span comes back, and its checkpoint read again: another owner may have
        written meanwhile, and the remembered revisions would only grow with every span held."""
        for key in {span.kv_key, *(s.kv_key for s in copied_spans(span))}:
            self.fences.forget(key)
        self.checkpoints.forget(span)

    def status(self) -> list[dict[str, Any]]:
        out = []
        for rt in sorted(self.spans.values(), key=lambda r: r.span):
            status = rt.status()
            snapshot = self.initial_loads.status(rt.span) if self.initial_loads is not None else None
            if snapshot is not None:
                status["snapshot"] = snapshot
            out.append(status)
        return out

    # ------------------------------------------------------------------ round

    async def round(self, stopping: asyncio.Event | None = None) -> RoundReport:
        started = time.monotonic()
        report = RoundReport(spans=len(self.spans))
        runtimes = list(self.spans.values())
        if not runtimes:
            return report
        self.rounds += 1
        self.followed = set()
        await self._ahead_done()  # a round that failed may have left its read-ahead running
        # A round holds its whole batch as live objects; collections in the middle of it only
        # walk them again and again (libs.gc_pause). The collector runs between rounds.
        with gc_paused(), tracer().start_as_current_span("sink round",
                                                         attributes={"sluice.spans": len(runtimes)}):
            works = await self._pull_all(runtimes, report)
            report.pull_s = time.monotonic() - started
            self._ahead = asyncio.ensure_future(self._read_ahead(works))  # while the batch is written
            outcomes: Outcomes = {}
            cuts: dict[str, SpanCut] = {}
            table_works = [w for w in works if w.group is None and w.large is None]
            if any(w.fresh and not w.refused for w in table_works):
                try:
                    with batch_span(table_works):
                        t_write = time.monotonic()
                        cuts, outcomes = await self._in_thread(table_works, stopping)
                        report.write_s = time.monotonic() - t_write
                        if self.fence is not None:
                            self.fence.check()
                        await self.writers.after(table_works, outcomes)
                except Fenced:  # self-fence: the worker starts over
                    raise
                except RoundAbandoned:
                    await self._ahead_done()
                    report.abandoned = True
                    report.duration_s = time.monotonic() - started
                    self.last_report = report
                    return report
                except Exception as exc:
                    m.ROUND_ERRORS.labels("sort").inc()
                    log.exception("round failed before the apply")
                    if spark_gone(exc) and not (stopping is not None and stopping.is_set()):
                        # The driver's JVM died (e.g. out of memory): every later round would fail
                        # the same way. Exit like a crash, so the supervisor starts a fresh process
                        # and the control plane moves the spans meanwhile; nothing advanced.
                        log.critical("the Spark JVM is gone; the worker exits to be restarted")
                        logging.shutdown()
                        os._exit(70)
                    report.errors.append(f"sort: {exc!r}")
                    for w in table_works:
                        if w.fresh and not w.refused:
                            outcomes[w.rt.span.kv_key] = SpanOutcome(error=f"sort job failed: {exc!r}")
            for w in works:
                if w.group is not None and not w.refused:
                    if self.fence is not None:  # self-fence: before the group's write
                        self.fence.check()
                    key = w.rt.span.kv_key
                    cuts[key], outcomes[key] = await asyncio.to_thread(
                        self.writers.sql_for(w.rt.config.sink_url).write_group, w)
            for w in works:
                if w.large is not None:
                    if self.fence is not None:  # self-fence: before the transaction's write
                        self.fence.check()
                    cuts[w.rt.span.kv_key], outcomes[w.rt.span.kv_key] = await self._apply_large(w)
            t_advance = time.monotonic()
            await settle([self.advance.finish(w, cuts.get(w.rt.span.kv_key), outcomes.get(w.rt.span.kv_key),
                                              report, self.validation) for w in works])
            self._note_quiet(works)
            t_ahead = time.monotonic()
            report.advance_s = t_ahead - t_advance
            await self._ahead_done()
            report.ahead_wait_s = time.monotonic() - t_ahead
        report.duration_s = time.monotonic() - started
        if report.batch_events or report.ddl_applied:
            m.ROUND_SECONDS.observe(report.duration_s)
            for stage, seconds in (("pull", report.pull_s), ("write", report.write_s),
                                   ("advance", report.advance_s), ("ahead_wait", report.ahead_wait_s)):
                m.STAGE_SECONDS.labels(stage).observe(seconds)
        log.debug("round done", extra={"events": report.events, "batch_events": report.batch_events,
                                       "rows": report.rows_written, "pull_s": round(report.pull_s, 3),
                                       "write_s": round(report.write_s, 3),
                                       "advance_s": round(report.advance_s, 3),
                                       "ahead_wait_s": round(report.ahead_wait_s, 3),
                                       "duration_s": round(report.duration_s, 3)})
        self._count_states()
        self.last_report = report
        return report

    async def _ahead_done(self) -> None:
        """Wait for the read-ahead (it never raises); a reader is read by one thing at a time."""
        if self._ahead is not None:
            await asyncio.shield(self._ahead)
            self._ahead = None

    async def _read_ahead(self, works: list[SpanWork]) -> None:
        """The next round's reading, while this one writes (``round_overlap``)."""
        if not any(w.fresh and not w.refused for w in works):
            return  # nothing to write: no time to overlap
        limits = self.round_size.limits(self.spans)
        await read_ahead(self.js, self.rows_stream, [
            AheadSpan(w.rt.reader, w.rt.span.source, limits.get(w.rt.span, 0))
            for w in works if not w.refused and w.rt.incident is None])

    async def _check_stored(self, runtimes: list[SpanRuntime], now: float, recheck_s: float) -> None:
        """Start the spans without a checkpoint, and reload those whose stored checkpoint is not
        the one this worker stored last.

        An operator's rewind (``CheckpointStore.reset``) or another process' write must be seen
        even by a span that has nothing to advance. A span that stored its checkpoint, or had it
        read, less than ``recheck_s`` ago is not read again: its next store is a compare-and-set
        at the revision it last saw, which finds any such write as the read would; one that does
        not store finds it at most ``recheck_s`` later. (Read every round, it was a request per
        span and round: 3,000 of a round's 4.2 s pull with 3,000 tables written to at once.)"""
        checked: list[SpanRuntime] = []
        for rt in runtimes:
            if rt.checkpoint is None and rt.incident is not None:
                continue  # its copy was refused for good: nothing to start until an operator acts
            if rt.checkpoint is None:
                await self.starts.load(rt)
                continue
            if rt.quiet is not None and now - rt.quiet.visited_at < recheck_s:
                continue  # quiet (``round.quiet``): read at its next full visit
            if recheck_s > 0 and now - max(rt.stored_at, rt.checked_at) < recheck_s:
                continue
            checked.append(rt)
        found = await gather_bounded((functools.partial(self.checkpoints.get, rt.span) for rt in checked),
                                     PULL_CONCURRENCY)
        for rt, stored in zip(checked, found, strict=True):
            if isinstance(stored, Exception):
                raise stored
            rt.checked_at = now
            if stored != rt.stored:
                log.warning("checkpoint changed outside this worker; reloading",
                            extra={"span": rt.span.name, "found": str(stored), "had": str(rt.stored)})
                await self.starts.load(rt)

    async def _pull_all(self, runtimes: list[SpanRuntime], report: RoundReport) -> list[SpanWork]:
        now = time.monotonic()
        recheck_s = self.options.quiet_recheck_s
        await self._check_stored(runtimes, now, recheck_s)
        if self.shard_ddl is not None:
            try:
                await self.shard_ddl.refresh_if_due()
                # Looked at once per change of the spans: a span newer than the groups.
                if (self._groups_checked != self._spans_changed
                        and any(self.shard_ddl.group_size(rt.span) is None for rt in runtimes)):
                    await self.shard_ddl.refresh_if_due(force=True)
                self._groups_checked = self._spans_changed
            except Exception:
                log.warning("shard group discovery failed", exc_info=True)
            self._count_shards()
        marks = {}
        for source in sorted({rt.span.source for rt in runtimes}):
            marks[source] = await latest_resolved(self.js, source, self.rows_stream)
        last_data = await self._last_data(runtimes)
        # After the marks, never before: a mark this round acts on is then older than the cap it
        # reads, and the leader abandons a T some mark passed before its cap was out.
        try:
            caps = await self.caps.read(rt.span.changefeed for rt in runtimes if rt.config.syncpoints)
        except Exception as exc:
            # Without the caps no span of a changefeed with syncpoints may write: it could pass T.
            log.warning("cannot read the syncpoint caps; those spans wait", exc_info=True)
            report.errors.append(f"syncpoint caps: {exc!r}")
            runtimes = [rt for rt in runtimes if not rt.config.syncpoints]
            caps = {}
        limits = self.round_size.limits(rt.span for rt in runtimes)
        visits: list[tuple[SpanRuntime, Checkpoint, ResolvedMark | None]] = []
        rechecks: list[SpanRuntime] = []
        for rt in runtimes:
            if rt.checkpoint is None or rt.state is SpanState.DONE:
                continue  # copying its initial load (or copied, snapshot-only): nothing to stream
            if rt.incident is not None:
                continue  # stopped until an operator acts; its checkpoint stays where it is
            start = rt.checkpoint
            mark = marks.get(rt.span.source)
            followed = follow_quietly(rt.quiet, start, mark, last_data.get(rt.span.source),
                                      caps.get(rt.span.changefeed), now, recheck_s)
            if followed is not None and mark is not None:
                self._follow(rt, followed, mark)
                continue
            due = recheck_quietly(rt.quiet, start, mark, last_data.get(rt.span.source),
                                  caps.get(rt.span.changefeed), now, recheck_s)
            if due is not None and mark is not None:
                self._follow(rt, due, mark)
                rechecks.append(rt)
                continue
            rt.quiet = None
            rt.reader.stream_large = self._may_stream(rt)
            rt.reader.open_max = (self.options.large_txn_window_events, self.options.large_txn_window_bytes)
            visits.append((rt, start, mark))

        async def pull(rt: SpanRuntime, start: Checkpoint, mark: ResolvedMark | None) -> PullResult:
            return await rt.reader.pull((start.stream_seq, start.ts), limits[rt.span],
                                        mark.stream_seq if mark else None)

        await self._recheck_quiet(rechecks, now)
        # A pull mostly waits (its consumer's answer, a fetch, the decode in a thread): the spans'
        # pulls overlap, each on its own reader. What follows (plans, barriers) stays in order.
        pulls = await gather_bounded((functools.partial(pull, *v) for v in visits), PULL_CONCURRENCY)
        works: list[SpanWork] = []
        for (rt, start, mark), pulled in zip(visits, pulls, strict=True):
            try:
                if isinstance(pulled, Exception):
                    raise pulled
                self.round_size.observe(rt.span, limits[rt.span], len(pulled.events), pulled.event_bytes,
                                        behind=bool(pulled.ghosts) or not pulled.reached)
            except Exception as exc:
                log.warning("pull failed", exc_info=True, extra={"span": rt.span.name})
                rt.pull_failed(f"pull failed: {exc!r}")
                report.errors.append(f"{rt.span.name}: pull: {exc!r}")
                m.ROUND_ERRORS.labels("pull").inc()
                continue
            work = await self._plan(rt, start, mark, pulled, caps.get(rt.span.changefeed))
            report.events += len(work.fresh)
            works.append(work)
        return works

    async def _plan(self, rt: SpanRuntime, start: Checkpoint, mark: ResolvedMark | None, pulled: PullResult,
                    cap: int | None) -> SpanWork:
        """A span's work for this round from what its pull brought: its horizon, its plan (or
        its group's), its DDL and foreign-key barriers, and a large transaction at its head."""
        rt.dead_lettered += pulled.dead_lettered
        rt.resolved_ts = mark.ts if mark else None
        horizon = capped(pulled.horizon(start.ts, rt.resolved_ts), cap, start.ts)
        work = SpanWork(rt, start, pulled, horizon,
                        [e for e in pulled.events if e.ts > start.ts], SpanRoutes(rt.span, rt.config))
        if rt.span.members is not None:
            await self.planner.plan_group(work)
        else:
            await self.planner.plan(work)
            await self.barrier.at_head(work)
        await self.fk_barrier.check(work)
        if (rt.reader.stream_large and rt.resolved_ts is not None and work.head is None
                and work.fk_wait is None and work.plan is not None and work.rules is None
                and not needs_guard(work)):
            work.large = large_head(pulled, start.ts, capped(rt.resolved_ts, cap, start.ts))
        work.mark = mark
        return work

    async def _last_data(self, runtimes: list[SpanRuntime]) -> dict[str, int]:
        """Each source's newest data message in the stream (``round.quiet``), for the sources
        with a quiet span; read after the marks, never before. A source that cannot be asked is
        left out, and its quiet spans are visited in full."""
        found: dict[str, int] = {}
        for source in sorted({rt.span.source for rt in runtimes if rt.quiet is not None}):
            try:
                found[source] = await last_data_seq(self.js, source, self.rows_stream)
            except Exception:
                log.warning("cannot read the source's last data message; its quiet spans are visited",
                            exc_info=True, extra={"source": source})
        return found

    def _follow(self, rt: SpanRuntime, checkpoint: Checkpoint, mark: ResolvedMark) -> None:
        """A quiet span follows the resolved ts (``round.quiet``); stored at its recheck."""
        rt.resolved_ts = mark.ts
        self.followed.add(rt.span)
        if checkpoint != rt.checkpoint:
            rt.checkpoint = checkpoint
            assert rt.quiet is not None
            rt.quiet = replace(rt.quiet, checkpoint=checkpoint)
            m.CHECKPOINT_TIME.labels(rt.span.changefeed, rt.span.name).set(m.ts_seconds(checkpoint.ts))
        m.CHECKPOINT_LAG.labels(rt.span.changefeed, rt.span.name).set(m.lag_seconds(checkpoint.ts))

    async def _recheck_quiet(self, rechecks: list[SpanRuntime], now: float) -> None:
        """The recheck of quiet spans with nothing new to read (``round.quiet``): each stores
        its followed checkpoint, side by side. One whose store is refused (moved under us) is
        visited next round and reloaded; one whose store failed is rechecked next round."""

        async def store(rt: SpanRuntime) -> bool:
            assert rt.checkpoint is not None
            return rt.checkpoint == rt.stored or await self.advance.store(rt, rt.checkpoint)

        results = await gather_bounded((functools.partial(store, rt) for rt in rechecks), PULL_CONCURRENCY)
        for rt, stored in zip(rechecks, results, strict=True):
            if isinstance(stored, Exception):
                log.warning("storing a quiet span's checkpoint failed; rechecked next round",
                            exc_info=stored, extra={"span": rt.span.name})
            elif stored and rt.quiet is not None:
                rt.quiet = replace(rt.quiet, visited_at=now)
            else:
                rt.quiet = None

    def _note_quiet(self, works: list[SpanWork]) -> None:
        """After the round: which visited spans are quiet (``round.quiet``). None while the
        shortcut is off, so no round asks the stream for what only the shortcut needs."""
        if self.options.quiet_recheck_s <= 0:
            return
        now = time.monotonic()
        for w in works:
            rt = w.rt
            rt.quiet = quiet_after_visit(
                replicating=(rt.state is SpanState.REPLICATING and rt.incident is None
                             and rt.span.members is None),
                fresh=len(w.fresh), head=w.head is not None or w.large is not None or w.group is not None,
                reached=w.pulled.reached, ghosts=len(w.pulled.ghosts), mark=w.mark,
                checkpoint=rt.checkpoint if rt.checkpoint == rt.stored else None, now=now)

    def _may_stream(self, rt: SpanRuntime) -> bool:
        """Whether the span's transactions larger than its round are applied streamed
        (``large_txn``): a table span on a SQL sink that the driver-side write covers as the
        apply job would (no table rules, no skipped keys, one shard or an origin column, so no
        cross-shard guard). The others' readers keep a transaction in progress whole."""
        if not self.options.large_txn_stream or rt.span.members is not None or rt.skips:
            return False
        if sink_kind(rt.config.sink_url).stream:
            return False
        router = rt.config.router
        span = rt.span
        if router is not None and rules_for(router.table_rules, span.database, span.table) is not NO_RULES:
            return False
        return rt.shards <= 1 or (router is not None and router.origin is not None)

    async def _apply_large(self, w: SpanWork) -> tuple[SpanCut, SpanOutcome]:
        """The span's head transaction, larger than its round, streamed into one downstream
        transaction (``large_txn``); a failure leaves the checkpoint where it is."""
        assert w.large is not None
        options = self.options
        try:
            writer = self.writers.sql_for(w.rt.config.sink_url)
            sink, table = await asyncio.to_thread(writer.prepare_large, w)
            reader = SpanReader(self.js, w.rt.span, self.rows_stream,
                                max_bytes=options.large_txn_window_bytes)
            reader.stream_large = True
            reader.open_max = (options.large_txn_window_events, options.large_txn_window_bytes)
            with tracer().start_as_current_span("apply large transaction",
                                                attributes={"sluice.span": w.rt.span.name}):
                cut, outcome = await apply_large(
                    reader, sink, table, w.large, w.start.stream_seq, w.origin,
                    LargeTxnOptions(options.large_txn_window_events, options.large_txn_window_bytes,
                                    w.rt.config.large_txn_split_rows))
        except Exception as exc:
            m.ROUND_ERRORS.labels("apply").inc()
            log.exception("a large transaction's apply failed", extra={"span": w.rt.span.name})
            if w.plan is not None:
                self.writers.schemas.forget(w.rt.config.sink_url, w.plan.table.schema, w.plan.table.name)
            return (SpanCut(w.rt.span.kv_key, limit_ts=w.large.ts, batch_events=1, batch_max_ts=w.large.ts,
                            ddl_ts=None, ddl_id=None), SpanOutcome(error=f"apply failed: {exc!r}"))
        w.rt.rows_written += outcome.rows
        m.BATCH_ROWS.observe(outcome.rows)
        return cut, outcome

    # ------------------------------------------------------------------ Spark, in a thread

    async def _in_thread(self, works: list[SpanWork],
                         stopping: asyncio.Event | None) -> tuple[dict[str, SpanCut], Outcomes]:
        group = f"sluice-round-{uuid4().hex[:12]}"
        abort = threading.Event()
        job = asyncio.ensure_future(asyncio.to_thread(self._spark_round, group, works, abort))
        if stopping is None:
            return await job
        stop_wait = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({job, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        if job.done():
            return job.result()
        # Stopping: let the round finish if it can (its batches are then checkpointed), else
        # cancel its Spark jobs and advance nothing: the next owner re-applies from the
        # checkpoints, which is idempotent.
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.options.stop_grace_s)
        except TimeoutError:
            log.warning("stopping: abandoning the current round", extra={"group": group})
            abort.set()  # no further stage starts (cancelJobGroup only reaches running jobs)
            with contextlib.suppress(Exception):
                self._spark().interruptTag(group)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(job, 2.0)
            raise RoundAbandoned() from None

    def _spark_round(self, group: str, works: list[SpanWork],
                     abort: threading.Event) -> tuple[dict[str, SpanCut], Outcomes]:
        spark = self._spark()
        # The tag marks this thread's jobs (a classic session and Spark Connect alike), so a
        # stop interrupts exactly them.
        spark.addTag(group)
        try:
            return self.writers.sort_and_write(spark, works, abort, self.fence)
        finally:
            spark.removeTag(group)

    async def flush_checkpoints(self) -> None:
        """Store every span's latest checkpoint (on a clean stop); each covers written batches only."""
        await self.advance.flush_checkpoints(self.spans.values())

    # ------------------------------------------------------------------ operator actions

    def remember_skips(self, span: Span, skips: dict[str, int]) -> None:
        """The keys skipped on ``span`` (whoever ran it then): left out whenever it runs here."""
        self.known_skips[span] = dict(skips)
        rt = self.spans.get(span)
        if rt is not None:
            rt.skips.update(skips)

    def act(self, span: Span, incident: str, action: IncidentAction) -> bool:
        """An operator's decision on the span's incident; False (and nothing changes) when the
        span is not here or is not stopped by that incident, so a repeated, late or misrouted
        decision is harmless.

        ``skip`` leaves the refused key's changes up to the incident's batch out (they go to
        the dead letters with the reason) and goes on; ``retry`` and ``resume`` run the span
        again as it is (``resume`` after the downstream was fixed): a change refused again
        stops it again, as a new incident."""
        rt = self.spans.get(span)
        decided = rt.operator_action(incident, action) if rt is not None else None
        if decided is None or decided.incident is None:
            return False
        if decided.skip is not None:
            self.known_skips.setdefault(span, {})[decided.skip[0]] = decided.skip[1]
        with contextlib.suppress(KeyError):
            m.TABLE_STOPPED.remove(span.changefeed, span.name)
        log.warning("operator %s on a stopped span", action,
                    extra={"span": span.name, **decided.incident.status()})
        return True

    def _count_states(self) -> None:
        counts = dict.fromkeys(SpanState, 0)
        for rt in self.spans.values():
            counts[rt.state] += 1
        for state, n in counts.items():
            m.SPANS.labels(state.value).set(n)
