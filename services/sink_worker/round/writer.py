"""The write of a round's batches, one seam for every kind of sink.

In the round's worker thread, ``Writers.sort_and_write`` cuts every span's batch (``sort_job``)
and hands each sink's spans to the ``BatchWriter`` of its URL (``Writers.for_url``, one per URL,
kept across rounds). Its ``write`` runs there, after the cut: the SQL writer runs the apply job
(one Spark job per sink and round) and then the DDL barriers the batches stopped at; the
NATS-stream writer prepares each span's messages. Its ``after`` runs on the event loop once
the thread is done: the NATS-stream writer publishes there (its client is async), and a span's
batch counts as written only once every message of it is acknowledged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Protocol
from uuid import uuid4

from pyspark.sql import SparkSession

from contracts.events.rows import DdlExecutedV1, RowsChangedV2
from libs.dburl import parse_database_url
from libs.telemetry.tracing import tracer
from services.sink_worker import metrics as m
from services.sink_worker.ddl.barrier import DdlBarrier
from services.sink_worker.ddl.target_schemas import TargetSchemas
from services.sink_worker.fence import SelfFence
from services.sink_worker.fk.cascades import CascadeGraph, CascadeTable
from services.sink_worker.fk.table_group import apply_group_batch
from services.sink_worker.incidents.poison import RowFailure, TableIncident
from services.sink_worker.round.apply_job import ApplyResult, TargetPlan, run_apply
from services.sink_worker.round.large_values import LargeKeyError, LargeValues
from services.sink_worker.round.row_rules import SpanRowRules, stream_rows
from services.sink_worker.round.sort_job import (
    EventRecord,
    SortResult,
    SpanCut,
    SpanInput,
    event_records,
    run_sort,
)
from services.sink_worker.round.work import RoundAbandoned, SpanWork
from services.sink_worker.sinks.base import Sink, TargetTable
from services.sink_worker.sinks.factory import open_sink, sink_kind
from services.sink_worker.sinks.nats_stream import (
    ChangeSource,
    StreamPublisher,
    ddl_message,
    row_messages,
)
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.sinks.write_fence import WriteFences
from services.sink_worker.span.machine import SpanOutcome
from services.sink_worker.span.runtime import PipelineOptions

log = logging.getLogger(__name__)

Outcomes = dict[str, SpanOutcome]
"""Span KV key -> what the round's write did for it."""


class BatchWriter(Protocol):
    def write(self, spark: SparkSession, works: list[SpanWork], sort: SortResult, outcomes: Outcomes,
              abort: threading.Event, large: LargeValues | None) -> None:
        """Write (or prepare) the batches of ``works``, in the round's worker thread."""

    async def after(self, w: SpanWork, outcome: SpanOutcome) -> None:
        """Finish a span's write on the event loop, once the thread is done."""

    async def close(self) -> None: ...


class SqlWriter:
    """MySQL/MariaDB, PostgreSQL, SQLite: the apply job, then the DDL barriers."""

    def __init__(self, sink_url: str, options: PipelineOptions, schemas: TargetSchemas,
                 barrier: DdlBarrier, overwrites: list[tuple[str, str]],
                 fences: WriteFences | None = None) -> None:
        self.sink_url = sink_url
        self.options = options
        self.schemas = schemas
        self.barrier = barrier
        self.overwrites = overwrites
        """(changefeed, conflict JSON) of rows removed under ``on_unique_conflict = overwrite``."""
        self.fences = fences if fences is not None else WriteFences()

    def _fenced(self, sink: Sink, works: list[SpanWork]) -> dict[str, TargetPlan]:
        """Each span's plan, its table carrying the write tokens of every span of the round that
        writes the same target (their rows meet in one partition transaction)."""
        by_target: dict[str, list[SpanWork]] = {}
        for w in works:
            assert w.plan is not None
            by_target.setdefault(w.plan.target_id, []).append(w)
        plans: dict[str, TargetPlan] = {}
        for same in by_target.values():
            schema = same[0].plan.table.schema if same[0].plan is not None else None
            fence = self.fences.take(sink, self.sink_url, schema, [w.rt.span.kv_key for w in same])
            for w in same:
                assert w.plan is not None
                plans[w.rt.span.kv_key] = replace(w.plan, table=replace(w.plan.table, fence=fence))
        return plans

    def write(self, spark: SparkSession, works: list[SpanWork], sort: SortResult, outcomes: Outcomes,
              abort: threading.Event, large: LargeValues | None) -> None:
        sink_url = self.sink_url
        batch_works = [w for w in works if sort.cuts[w.rt.span.kv_key].batch_events and w.plan]
        try:
            sink = open_sink(sink_url)
            # Thousands of targets met for the first time (a changefeed's first writes): checked
            # in bulk, not with a connection each.
            self.schemas.settle(sink, sink_url, [w.plan.table for w in batch_works if w.plan is not None
                                                 and w.rt.config.schema_change_policy != "ignore"])
            for w in batch_works:
                assert w.plan is not None
                if w.rt.config.schema_change_policy == "ignore" and isinstance(sink, SqlSink):
                    # The target keeps its definition: rows go in with the columns it has.
                    w.plan = replace(w.plan, table=self.schemas.fixed(sink, sink_url, w.plan.table))
                    continue
                reconcile = w.rt.shards == 1 or self.schemas.take_reconcile(w.rt.span.kv_key)
                self.schemas.ensure(sink, sink_url, w.plan.table, reconcile=reconcile)
            if batch_works:
                keys = [w.rt.span.kv_key for w in batch_works]
                metas = {w.rt.span.kv_key: w.source_meta for w in batch_works if w.source_meta is not None}
                plans = self._fenced(sink, batch_works)
                origins = {w.rt.span.kv_key: w.origin for w in batch_works if w.origin is not None}
                skips = {w.rt.span.kv_key: dict(w.rt.skips) for w in batch_works if w.rt.skips}
                guarded = {w.plan.target_id: w.rt.config.on_unique_conflict for w in batch_works
                           if w.plan is not None and needs_guard(w)}
                names = {w.rt.span.kv_key: w.rt.span.name for w in batch_works}
                rules = {w.rt.span.kv_key: w.rules for w in batch_works if w.rules is not None}
                row_rules = {key: SpanRowRules(by_key_meta, r) for key, r in rules.items()
                             if r.needs_spark and (by_key_meta := metas.get(key)) is not None}
                t0 = time.monotonic()
                with tracer().start_as_current_span(
                        "apply",
                        attributes={"sluice.sink": sink.__repr__(), "sluice.spans": len(keys)}):
                    result = run_apply(spark, sort.batch(keys), plans,
                                       self.options.apply_partitions, origins, skips, guarded, names,
                                       large, rules, row_rules)
                m.APPLY_SECONDS.observe(time.monotonic() - t0)
                self._count_written(batch_works, result, outcomes)
                self._stop_refused(batch_works, result, sort, outcomes)
                self._report_overwrites(batch_works, result)
        except Exception as exc:
            m.ROUND_ERRORS.labels("apply").inc()
            log.exception("apply job failed", extra={"sink": redacted(sink_url)})
            for w in works:
                outcomes[w.rt.span.kv_key] = SpanOutcome(error=f"apply failed: {exc!r}")
                if w.plan is not None:
                    # The target may have been dropped or altered behind our back: check its
                    # schema again before the retry instead of trusting this process' memory.
                    self.schemas.forget(sink_url, w.plan.table.schema, w.plan.table.name)
            return
        for w in works:
            outcome = outcomes.setdefault(w.rt.span.kv_key, SpanOutcome())
            if outcome.incident is not None:
                continue  # refused for good: nothing of its batch counts as written
            outcome.written = True
            self.barrier.after_batch(sink, sink_url, w, sort.cuts[w.rt.span.kv_key], outcome, abort)

    async def after(self, w: SpanWork, outcome: SpanOutcome) -> None:
        return None  # written in full in the thread

    async def close(self) -> None:
        return None

    def prepare_large(self, w: SpanWork) -> tuple[SqlSink, TargetTable]:
        """The sink and the target (created or reconciled, with the span's write fence) of a
        large transaction written streamed (``large_txn``); in a worker thread."""
        assert w.plan is not None
        sink = open_sink(self.sink_url)
        if not isinstance(sink, SqlSink):
            raise TypeError(f"a large transaction needs a SQL sink, not {type(sink).__name__}")
        if w.rt.config.schema_change_policy == "ignore":
            w.plan = replace(w.plan, table=self.schemas.fixed(sink, self.sink_url, w.plan.table))
        else:
            reconcile = w.rt.shards == 1 or self.schemas.take_reconcile(w.rt.span.kv_key)
            self.schemas.ensure(sink, self.sink_url, w.plan.table, reconcile=reconcile)
        return sink, self._fenced(sink, [w])[w.rt.span.kv_key].table

    def write_group(self, w: SpanWork) -> tuple[SpanCut, SpanOutcome]:
        """A table group's batch and cascades in one downstream transaction, then the DDL it
        stops at (``table_group``)."""
        assert w.group is not None
        rt, cut = w.rt, w.group.cut
        outcome = SpanOutcome()
        url = rt.config.sink_url
        try:
            sink = open_sink(url)
            assert isinstance(sink, SqlSink)
            tables: dict[tuple[str, str], CascadeTable] = {}
            for (database, table), meta in rt.group_metas.items():
                target = w.routes.target(database, table, meta)
                origin = w.routes.origin(database, table)
                self.schemas.ensure(sink, url, target, reconcile=origin is None)
                tables[(database, table)] = CascadeTable(target, origin)
            graph = CascadeGraph(tables, w.group_fks)
            if w.group.batch:
                result = apply_group_batch(sink, graph, w.group.batch,
                                           lambda ev: tables[(ev.database, ev.table)])
                outcome.rows = result.rows
                rt.rows_written += result.rows
                if result.triggers:
                    log.info("cascades carried out", extra={
                        "span": rt.span.name, "parents": result.triggers,
                        "deleted": sum(result.cascades.deleted.values()),
                        "updated": sum(result.cascades.updated.values())})
            outcome.written = True
            if w.group.ddl is not None:
                self.barrier.group_ddl(sink, url, w, w.group.ddl, outcome)
        except Exception as exc:
            m.ROUND_ERRORS.labels("apply").inc()
            log.exception("a foreign-key group's apply failed", extra={"span": rt.span.name})
            outcome = SpanOutcome(error=f"apply failed: {exc!r}")
            self.schemas.clear()
        return cut, outcome

    def _count_written(self, works: list[SpanWork], result: ApplyResult,
                       outcomes: Outcomes) -> None:
        """Count each target's rows once, and give every span its share of them.

        Spans routed into one target are applied as one merged image, so the apply job only
        knows the target's counts: a span's share is its part of the round's row changes."""
        by_target: dict[str, list[SpanWork]] = {}
        for w in works:
            assert w.plan is not None
            by_target.setdefault(w.plan.target_id, []).append(w)
        rows = 0
        for target_id, group in by_target.items():
            counts = result.per_target.get(target_id)
            if counts is None:
                continue
            cf = group[0].rt.span.changefeed
            m.ROWS_APPLIED.labels(cf, "upsert").inc(counts.upserted)
            m.ROWS_APPLIED.labels(cf, "delete").inc(counts.deleted)
            m.UNIQUE_CONFLICTS.labels(cf).inc(counts.conflicts_removed)
            total = counts.upserted + counts.deleted
            rows += total
            for w, share in zip(group, split_rows(total, [_row_changes(w) for w in group]), strict=True):
                w.rt.rows_written += share
                outcomes.setdefault(w.rt.span.kv_key, SpanOutcome()).rows += share
        m.BATCH_ROWS.observe(rows)

    def _stop_refused(self, works: list[SpanWork], result: ApplyResult, sort: SortResult,
                      outcomes: Outcomes) -> None:
        """Every span of a target the downstream refused for good gets the incident: it stops,
        and the other targets of the sink go on (they were written in full)."""
        for w in works:
            assert w.plan is not None
            failure = result.failures.get(w.plan.target_id)
            if failure is None:
                continue
            table = w.plan.table
            target = f"{table.schema}.{table.name}" if table.schema else table.name
            incident = TableIncident(id=uuid4().hex, target=target, failure=failure,
                                     upto_ts=sort.cuts[w.rt.span.kv_key].limit_ts)
            outcomes.setdefault(w.rt.span.kv_key, SpanOutcome()).incident = incident

    def _report_overwrites(self, works: list[SpanWork], result: ApplyResult) -> None:
        """Policy ``overwrite``: each removed row of another shard is counted, logged and kept
        for the worker to record as an event."""
        changefeeds = {w.plan.target_id: w.rt.span.changefeed for w in works if w.plan is not None}
        for target_id, reports in result.overwritten.items():
            cf = changefeeds[target_id]
            for text in reports:
                m.CROSS_SHARD_CONFLICTS.labels(cf, "overwritten").inc()
                log.warning("cross-shard unique conflict: the other shard's row was removed",
                            extra={"changefeed": cf, "conflict": text})
                self.overwrites.append((cf, text))


class StreamWriter:
    """The NATS sink: every change of each span's batch republished, in order."""

    def __init__(self, sink_url: str, options: PipelineOptions) -> None:
        self.sink_url = sink_url
        self.options = options
        self._publisher: StreamPublisher | None = None

    def write(self, spark: SparkSession, works: list[SpanWork], sort: SortResult, outcomes: Outcomes,
              abort: threading.Event, large: LargeValues | None) -> None:
        """NATS sink: every change of each span's batch (the sort job's cut, deduplicated by
        event id), in order, plus the DDL barrier; published on the event loop afterwards."""
        try:
            publisher = self.publisher()
        except Exception as exc:
            for w in works:
                outcomes[w.rt.span.kv_key] = SpanOutcome(error=f"NATS sink: {exc}")
            return
        for w in works:
            cut = sort.cuts[w.rt.span.kv_key]
            outcome = outcomes.setdefault(w.rt.span.kv_key, SpanOutcome())
            seen: set[str] = set()
            batch: list[ChangeSource] = []
            for e in w.fresh:
                if (not e.dead and isinstance(e.event, RowsChangedV2) and w.start.ts < e.ts <= cut.limit_ts
                        and e.event_id not in seen):
                    seen.add(e.event_id)
                    batch.append(ChangeSource(e.event_id, e.event))
            if w.rules is not None and w.source_meta is not None:
                batch = stream_rows(spark, w.source_meta, w.rules, batch)
            schema: str | None = w.rt.span.database
            table = w.rt.span.table
            key: tuple[str, ...] = ()
            if w.plan is not None:
                schema, table, key = w.plan.table.schema, w.plan.table.name, w.plan.table.key
            messages = row_messages(publisher.target, w.rt.span.changefeed, schema, table, key, batch)
            ddl = DdlBarrier.stream_barrier(w, cut, outcome)
            if ddl is not None:
                assert isinstance(ddl.event, DdlExecutedV1)
                messages.append(ddl_message(publisher.target, w.rt.span.changefeed, schema, table,
                                            ChangeSource(ddl.event_id, ddl.event)))
                outcome.publish_ddl = True
            outcome.publish = messages

    def publisher(self) -> StreamPublisher:
        if self._publisher is None:
            self._publisher = StreamPublisher(self.sink_url, replicas=self.options.stream_replicas,
                                              dedup_window_s=self.options.dedup_window_s)
        return self._publisher

    async def after(self, w: SpanWork, outcome: SpanOutcome) -> None:
        """Publish the span's batch; it counts as written only once every message of it is
        acknowledged by the stream (else nothing advances for it)."""
        if outcome.publish is None:
            return
        t0 = time.monotonic()
        try:
            with tracer().start_as_current_span("publish changes", attributes={
                    "sluice.span": w.rt.span.name, "sluice.messages": len(outcome.publish)}):
                await self.publisher().publish(outcome.publish)
        except Exception as exc:
            m.ROUND_ERRORS.labels("publish").inc()
            log.warning("NATS sink publish failed", exc_info=True, extra={"span": w.rt.span.name})
            outcome.error, outcome.publish = f"NATS sink publish failed: {exc!r}", None
            return
        m.APPLY_SECONDS.observe(time.monotonic() - t0)
        rows = len(outcome.publish) - (1 if outcome.publish_ddl else 0)
        m.ROWS_APPLIED.labels(w.rt.span.changefeed, "publish").inc(rows)
        m.BATCH_ROWS.observe(rows)
        w.rt.rows_written += rows
        outcome.rows += rows
        outcome.written = True
        outcome.ddl_applied = outcome.publish_ddl or outcome.ddl_ignored
        outcome.publish = None

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.close()
            self._publisher = None


class Writers:
    """The round's writer of each sink URL, kept across rounds (a NATS sink keeps its connection)."""

    def __init__(self, options: PipelineOptions, schemas: TargetSchemas, barrier: DdlBarrier,
                 overwrites: list[tuple[str, str]], fences: WriteFences | None = None) -> None:
        self.options = options
        self.schemas = schemas
        self.barrier = barrier
        self.overwrites = overwrites
        self.fences = fences if fences is not None else WriteFences()
        self._writers: dict[str, BatchWriter] = {}

    def for_url(self, sink_url: str) -> BatchWriter:
        writer = self._writers.get(sink_url)
        if writer is None:
            writer = self._writers[sink_url] = (
                StreamWriter(sink_url, self.options) if sink_kind(sink_url).stream
                else SqlWriter(sink_url, self.options, self.schemas, self.barrier, self.overwrites,
                               self.fences))
        return writer

    def sql_for(self, sink_url: str) -> SqlWriter:
        """A table group's writer (groups are refused on other sinks when planned)."""
        writer = self.for_url(sink_url)
        assert isinstance(writer, SqlWriter)
        return writer

    def sort_and_write(self, spark: SparkSession, works: list[SpanWork], abort: threading.Event,
                       fence: SelfFence | None) -> tuple[dict[str, SpanCut], Outcomes]:
        """The round's cut (``sort_job``), then each sink's write; in the round's worker thread."""
        outcomes: Outcomes = {}
        # Values above the threshold stay here; the jobs get references (``large_values``).
        large = LargeValues(self.options.large_value_bytes)
        active: list[SpanWork] = []
        records: list[EventRecord] = []
        for w in works:
            if not w.fresh or w.refused:
                continue
            # Row expressions and computed columns read the images inside the job, so a table
            # with them keeps its values whole there (a reference would be filtered or computed
            # on instead of the value); its row size is then bounded by the Spark driver's memory.
            seen_whole = w.rules is not None and w.rules.needs_spark
            try:
                records.extend(event_records(w.rt.span.kv_key, w.fresh, None if seen_whole else large,
                                             w.plan.table.key if w.plan is not None else ()))
            except LargeKeyError as exc:
                outcomes[w.rt.span.kv_key] = SpanOutcome(incident=_large_key_incident(w, exc))
                continue
            active.append(w)
        if large:
            log.info("large values kept out of the round's jobs",
                     extra={"values": len(large), "bytes": large.bytes_held})
        if not active:
            return {}, outcomes
        by_key = {w.rt.span.kv_key: w for w in active}
        inputs = [SpanInput(w.rt.span.kv_key, w.start.ts, w.horizon) for w in active]
        t0 = time.monotonic()
        with tracer().start_as_current_span("sort", attributes={"sluice.events": len(records),
                                                                "sluice.spans": len(active)}):
            sort = run_sort(records, inputs)
        m.SORT_SECONDS.observe(time.monotonic() - t0)
        m.BATCH_EVENTS.observe(len(records))

        by_sink: dict[str, list[str]] = {}
        for key, cut in sort.cuts.items():
            if cut.batch_events or cut.ddl_id:
                by_sink.setdefault(by_key[key].rt.config.sink_url, []).append(key)
        for sink_url, keys in by_sink.items():
            if abort.is_set():
                raise RoundAbandoned()
            if fence is not None:  # self-fence: before each sink's write
                fence.check()
            writer = self.for_url(sink_url)
            writer.write(spark, [by_key[k] for k in keys], sort, outcomes, abort, large)
        return sort.cuts, outcomes

    async def after(self, works: list[SpanWork], outcomes: Outcomes) -> None:
        """Each span's ``after`` step, in the round's order of spans."""
        for w in works:
            outcome = outcomes.get(w.rt.span.kv_key)
            if outcome is not None:
                await self.for_url(w.rt.config.sink_url).after(w, outcome)

    async def close(self) -> None:
        for writer in self._writers.values():
            with contextlib.suppress(Exception):
                await writer.close()
        self._writers.clear()


def _row_changes(work: SpanWork) -> int:
    return sum(len(e.event.rows) for e in work.fresh if isinstance(e.event, RowsChangedV2))



def split_rows(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (equal parts when they are all 0), in whole
    rows that add up to ``total``: the largest remainders get the leftover rows."""
    if not weights:
        return []
    if sum(weights) <= 0:
        weights = [1] * len(weights)
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def needs_guard(w: SpanWork) -> bool:
    """A target several shards merge into, without an origin column, with a unique key besides
    its key: a conflict delete there may remove another shard's row (``sinks.unique_guard``)."""
    if w.plan is None or w.origin is not None or w.rt.shards <= 1:
        return False
    key = set(w.plan.table.key)
    return any(unique and set(unique) != key for unique in w.plan.table.unique_keys)


def redacted(url: str) -> str:
    try:
        return parse_database_url(url).redacted()
    except Exception:
        return "<unparsable sink URL>"


def _large_key_incident(w: SpanWork, exc: LargeKeyError) -> TableIncident:
    """A key value above the large-value threshold: the table stops, nothing of it is written."""
    key = w.plan.table.key if w.plan is not None else (exc.column,)
    target = w.rt.span.table
    if w.plan is not None:
        table = w.plan.table
        target = f"{table.schema}.{table.name}" if table.schema else table.name
    return TableIncident(id=uuid4().hex, target=target, upto_ts=w.horizon,
                         failure=RowFailure("upsert", None, key, f"LargeKeyError: {exc}", None))
