"""The table pipelines of one worker: rounds of pull, sort, apply, DDL and checkpoint.

A round covers every span the worker runs, with one cut (on the driver) for all of them:

1. read each source's resolved ts *before* pulling, so that every event at or below it is
   already in the stream when the pull runs;
2. pull each span's events after its checkpoint (bounded: each span's allowance from
   ``round_size``, together within ``max_events_per_round``, which bounds the driver's memory;
   mostly in memory already, read ahead while the previous round wrote: ``round_overlap``);
3. in the driver, choose each span's target and key; a table without a usable key is refused
   (clear error in the log, the health status and a metric) and the span stops there;
4. in a worker thread (never on the event loop): each span's cut (on the driver,
   ``sort_job``), then per sink the apply job (one Spark job) and the DDL barriers the
   batches stopped at;
5. advance each span's checkpoint, only for batches that were written in full (the spans'
   stores side by side). A span without pending events follows its source's resolved ts.

A failed round advances nothing for the spans it failed; they are read again next round, and
re-applying is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal
from uuid import uuid4

from nats.js import JetStreamContext
from opentelemetry import trace
from pyspark.sql import SparkSession

from contracts.events.changefeeds import ChangefeedSpecV2, InitialLoad, KeyPolicy
from contracts.events.rows import DdlExecutedV1, RowImageV2, RowsChangedV2, SourcePositionV1, TableMetaV1
from libs.config import Settings
from libs.dburl import parse_database_url
from libs.eventstore.deadletter import dead_letter
from libs.foreign_keys import ForeignKey
from libs.gc_pause import gc_paused
from libs.routing import Router, Target, router_for
from libs.scheduling.model import Span
from libs.source_tables import source_foreign_keys
from libs.streams import ROWS_STREAM, token
from libs.table_rules import NO_RULES, TableRules, TableRulesError, rules_for
from libs.telemetry.tracing import extract_context, tracer
from services.sink_worker import metrics as m
from services.sink_worker.apply_job import ApplyResult, TargetPlan, key_json, run_apply
from services.sink_worker.cascades import CascadeGraph, CascadeTable
from services.sink_worker.checkpoints import (
    Checkpoint,
    CheckpointMoved,
    CheckpointRegression,
    CheckpointStore,
)
from services.sink_worker.ddl_plan import ddl_action
from services.sink_worker.fence import Fenced, SelfFence  # liveness: self-fence
from services.sink_worker.large_values import LargeKeyError, LargeValues
from services.sink_worker.poison import IncidentAction, RowFailure, TableIncident
from services.sink_worker.pull import PulledEvent, PullResult, SpanReader, latest_resolved
from services.sink_worker.round_overlap import AheadSpan, read_ahead, settle
from services.sink_worker.round_size import RoundSize
from services.sink_worker.row_rules import SpanRowRules, analyse, stream_rows
from services.sink_worker.shard_ddl import ShardDdl, execute_on_target, lock_ref, rewritten
from services.sink_worker.sinks.base import Sink, TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.nats_stream import (
    ChangeSource,
    StreamMessage,
    StreamPublisher,
    ddl_message,
    is_stream_sink,
    row_messages,
)
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.sinks.unique_guard import UniqueConflictError, UniqueConflictPolicy
from services.sink_worker.snapshot import InitialLoads, SnapshotRequest, snapshot_mode
from services.sink_worker.sort_job import (
    EventRecord,
    SortResult,
    SpanCut,
    SpanInput,
    event_records,
    run_sort,
)
from services.sink_worker.span import KeylessTableError, route_of, shard_ref, target_for
from services.sink_worker.start_point import start_at_position, start_at_time
from services.sink_worker.table_errors import DdlFailure, ddl_failed
from services.sink_worker.table_group import GroupCut, apply_group_batch, cut_group, source_metas
from services.sink_worker.validation import Validator

log = logging.getLogger(__name__)

SpanState = Literal["starting", "snapshot", "replicating", "done", "refused", "blocked", "error"]
"""``snapshot``: its initial load is copying; ``done``: a snapshot-only span whose copy is done."""


@dataclass(frozen=True)
class PipelineOptions:
    max_events_per_round: int = 2000
    """The most events a round pulls, all spans together (``round_size``)."""
    min_events_per_round: int = 100
    round_max_bytes: int = 256 * 1024 * 1024
    apply_partitions: int = 4
    stop_grace_s: float = 4.0
    checkpoint_interval_s: float = 1.0
    stream_replicas: int = 1
    """Replicas and duplicate window of a stream the NATS sink creates."""
    dedup_window_s: float = 120.0
    pull_max_bytes: int = 512 * 1024 * 1024
    """Event bytes a span's reader keeps in memory (large rows: see pull.py)."""
    large_value_bytes: int = 1024 * 1024
    """Values longer than this stay out of the Spark jobs (``large_values``)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> PipelineOptions:
        return cls(
            max_events_per_round=settings.sink_max_events_per_round,
            min_events_per_round=settings.sink_min_events_per_round,
            round_max_bytes=settings.sink_round_max_bytes,
            apply_partitions=settings.sink_apply_partitions,
            stop_grace_s=settings.sink_stop_grace_s,
            # Read once libs/config.py defines SLUICE_SINK_CHECKPOINT_INTERVAL_S; the default until then.
            checkpoint_interval_s=float(getattr(settings, "sink_checkpoint_interval_s",
                                                cls.checkpoint_interval_s)),
            stream_replicas=settings.stream_replicas,
            dedup_window_s=settings.dedup_window_s,
            pull_max_bytes=settings.sink_pull_max_bytes,
            large_value_bytes=settings.sink_large_value_bytes,
        )


@dataclass(frozen=True)
class SpanConfig:
    """What the changefeed says about a span."""

    sink_url: str
    key_policy: KeyPolicy = "primary"
    start: Literal["earliest", "latest"] = "earliest"
    router: Router | None = None
    """The changefeed's routes, filter and origin column (None: every table to itself)."""
    initial_load: InitialLoad = "binlog-only"
    source_url: str = ""
    start_time: datetime | None = None
    start_position: SourcePositionV1 | None = None
    on_unique_conflict: UniqueConflictPolicy = "error"
    """A merged target's unique value held by another shard's row (``sinks.unique_guard``)."""
    validation: str = "off"
    """Continuous validation: off, fast or full (``services.sink_worker.validation``)."""

    @classmethod
    def of(cls, spec: ChangefeedSpecV2, source: str) -> SpanConfig:
        """The config of ``spec``'s spans on ``source`` (a subject token)."""
        ref = next((s for s in spec.sources if token(s.id) == source), None)
        return cls(sink_url=spec.sink_url, key_policy=spec.key_policy, start=spec.start,
                   router=router_for(spec), initial_load=spec.initial_load,
                   source_url=ref.url if ref is not None else "", start_time=spec.start_time,
                   start_position=spec.start_position.get(ref.id) if ref is not None else None,
                   # A v2 spec (never upcast: built in code) keeps the behaviour v2 had.
                   on_unique_conflict=getattr(spec, "on_unique_conflict", "overwrite"),
                   validation=_validation_mode(spec))


@dataclass
class SpanRuntime:
    span: Span
    config: SpanConfig
    reader: SpanReader
    checkpoint: Checkpoint | None = None
    """The checkpoint the next round starts from; None until loaded."""
    stored: Checkpoint | None = None
    """What the bucket holds as far as we know (None: nothing yet): the compare-and-set base."""
    stored_at: float = 0.0
    resolved_ts: int | None = None
    state: SpanState = "starting"
    error: str | None = None
    rows_written: int = 0
    dead_lettered: int = 0
    last_batch_events: int = 0
    shards: int = 1
    ddl_error: DdlFailure | None = None
    """The DDL the span stopped at because its downstream cannot take it (``table_errors``)."""
    incident: TableIncident | None = None
    """Stopped by a downstream's permanent refusal (``poison``): no round runs the span until
    an operator skips, retries or resumes it."""
    skips: dict[str, int] = field(default_factory=dict)
    """Key JSON -> ts: that key's changes up to ts are left out (skipped by an operator)."""
    skip_reasons: dict[str, TableIncident] = field(default_factory=dict)
    """Skipped keys whose events are not dead-lettered yet, with the incident they ended."""
    group_metas: dict[tuple[str, str], TableMetaV1] = field(default_factory=dict)
    """A table group's members (real names) -> their newest metadata seen (``table_group``)."""

    def status(self) -> dict[str, Any]:
        cp = self.checkpoint
        out: dict[str, Any] = {
            "span": self.span.name, "changefeed": self.span.changefeed, "source": self.span.source,
            "database": self.span.database, "table": self.span.table, "state": self.state,
            "checkpoint_ts": cp.ts if cp else None, "stream_seq": cp.stream_seq if cp else None,
            "resolved_ts": self.resolved_ts,
            "lag_s": round(m.lag_seconds(cp.ts), 3) if cp and cp.ts else None,
            "behind_resolved_s": (round(m.ts_seconds(self.resolved_ts) - m.ts_seconds(cp.ts), 3)
                                  if cp and self.resolved_ts else None),
            "rows_written": self.rows_written, "dead_lettered": self.dead_lettered,
        }
        if self.error:
            out["error"] = self.error
        if self.ddl_error is not None:
            out["ddl_error"] = self.ddl_error.as_status()
        if self.incident is not None:
            out["incident"] = self.incident.status()
        return out


@dataclass
class _Work:
    """One span's part of a round."""

    rt: SpanRuntime
    start: Checkpoint
    pulled: PullResult
    horizon: int
    fresh: list[PulledEvent]
    plan: TargetPlan | None = None
    refused: str | None = None
    origin: tuple[str, str] | None = None
    """The origin column's name and this span's value, when its rows carry one."""
    shard_wait: str | None = None
    """Stopped at a shard DDL, waiting for its operation: why (nothing moves)."""
    shard_cut: SpanCut | None = None
    """The DDL at the head of the span was carried out in the driver (a shard DDL, a rename
    away, a finished re-copy): its cut."""
    recopying: bool = False
    """A DDL at the head of the span re-copies its table (``ddl_plan``): nothing streams."""
    recopy_key: str | None = None
    """The finished re-copy's progress key, deleted once the checkpoint is past its DDL."""
    ddl_failure: DdlFailure | None = None
    """The DDL at the head of the span cannot be carried out downstream."""
    rules: TableRules | None = None
    """The table rules of the span's table (``libs.table_rules``), when it has any."""
    source_meta: TableMetaV1 | None = None
    """The table's metadata as its rows carry it (what the rules' expressions see)."""
    group: GroupCut | None = None
    """A table group's cut and batch (``table_group``), applied in the driver, not by Spark."""
    group_fks: list[ForeignKey] = field(default_factory=list)


def _validation_mode(spec: ChangefeedSpecV2) -> str:
    validation = getattr(spec, "validation", None)
    return str(validation.mode) if validation is not None else "off"


def _row_changes(work: _Work) -> int:
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


@dataclass
class _Outcome:
    written: bool = False
    rows: int = 0
    ddl_applied: bool = False
    blocked: str | None = None
    """Why the span stops at its DDL barrier: "blocked" (shard DDL) ..."""
    refused: str | None = None
    """... or "refused" (the DDL leaves the table without a usable key)."""
    error: str | None = None
    ddl_failure: DdlFailure | None = None
    incident: TableIncident | None = None
    """The downstream refused one of the batch's changes for good: the span stops."""
    publish: list[StreamMessage] | None = None
    """NATS sink: the batch's messages; written (and the DDL applied) once all are acked."""
    publish_ddl: bool = False
    ddl_ignored: bool = False
    """NATS sink: the batch's DDL is one the table rules leave out (nothing published for it)."""


@dataclass
class RoundReport:
    spans: int = 0
    events: int = 0
    batch_events: int = 0
    rows_written: int = 0
    ddl_applied: int = 0
    advanced: int = 0
    errors: list[str] = field(default_factory=list)
    abandoned: bool = False
    pull_s: float = 0.0
    duration_s: float = 0.0


class RoundAbandoned(Exception):
    """The worker is stopping and the round did not finish within the grace period."""


def _missing_key_columns(event: RowsChangedV2, key: tuple[str, ...]) -> str | None:
    for i, row in enumerate(event.rows):
        for image in (row.before, row.after):
            if image is not None:
                missing = [c for c in key if c not in image]
                if missing:
                    return f"row {i} ({row.op}) lacks key columns {missing}"
    return None


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
        self.prepared: dict[Span, SpanRuntime] = {}
        """Spans loaded by ``prepare`` that do not run (write) yet."""
        # --- liveness: self-fence ---
        self.fence: SelfFence | None = None
        """Checked before every write of a round (``Fenced`` ends the round, nothing advances)."""
        # --- end liveness ---
        self.validation: Validator | None = None
        """Continuous validation: told the keys of every written batch (``validation``)."""
        self.rounds = 0
        self.last_report: RoundReport | None = None
        # (sink url, schema, table) -> meta JSON the target was last brought to by this process.
        self._schemas: dict[tuple[str, str | None, str], str] = {}
        self._publishers: dict[str, StreamPublisher] = {}
        # (table meta JSON, rules) -> why Spark's analyser refuses the rules' expressions, or None.
        self._rules_checked: dict[tuple[str, str], str | None] = {}
        self.shard_ddl: ShardDdl | None = None
        """Shard DDL coordination; without it a sharded target's DDL blocks its spans."""
        self.known_skips: dict[Span, dict[str, int]] = {}
        """Keys operators skipped, per span, from the changefeeds log (spans run here or not)."""
        self.new_incidents: list[tuple[Span, TableIncident]] = []
        self.new_overwrites: list[tuple[str, str]] = []
        """(changefeed, conflict JSON) of rows removed under ``on_unique_conflict = overwrite``."""
        """Spans stopped since the worker last recorded them in the changefeeds log."""

    def attach_shard_ddl(self, shard_ddl: ShardDdl) -> None:
        self.shard_ddl = shard_ddl

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
            await self.spans.pop(span).reader.close()
            if self.initial_loads is not None:
                await self.initial_loads.stop(span)
            self._forget_gauges(span)
        for span, config in wanted.items():
            rt = self.spans.get(span)
            if rt is None and span in self.prepared:
                rt = self.spans[span] = self.prepared.pop(span)
                rt.checkpoint = rt.stored = None
                rt.config = config
            if rt is None:
                self.spans[span] = SpanRuntime(span, config, self._reader(span))
            elif rt.config != config:
                rt.config = config
                if rt.state == "refused":  # a new key policy may allow the table now
                    rt.state, rt.error = "replicating", None
        for span in wanted:
            self.spans[span].skips.update(self.known_skips.get(span, {}))
        # Several upstream shards in one target: their DDL needs the ddl-lock, not this path.
        self._count_shards()

    def _count_shards(self) -> None:
        """Each span's shard count: the group the coordinator knows across every worker, else
        the spans of this worker routed to the same target."""
        targets: dict[tuple[str, Target], int] = {}
        routed = {}
        for span, rt in self.spans.items():
            routed[span] = (span.changefeed, _route_tokens(span, rt.config.router))
            targets[routed[span]] = targets.get(routed[span], 0) + 1
        for span, rt in self.spans.items():
            local = targets[routed[span]]
            if self.shard_ddl is None:
                rt.shards = local
                continue
            known = self.shard_ddl.group_size(span)
            # Group unknown (discovery failed): count it as sharded, so a DDL waits for the
            # ddl-lock (which resolves a group of one at once) instead of being applied alone.
            rt.shards = max(known, local) if known is not None else max(local, 2)

    def _forget_gauges(self, span: Span) -> None:
        for gauge in (m.CHECKPOINT_LAG, m.RESOLVED_LAG, m.CHECKPOINT_TIME, m.TABLE_STOPPED):
            with contextlib.suppress(KeyError):
                gauge.remove(span.changefeed, span.name)

    async def close(self) -> None:
        await self._ahead_done()
        if self.initial_loads is not None:
            await self.initial_loads.close()
        for rt in [*self.spans.values(), *self.prepared.values()]:
            await rt.reader.close()
        self.prepared.clear()
        for publisher in self._publishers.values():
            with contextlib.suppress(Exception):
                await publisher.close()
        self._publishers.clear()

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
            start = await self._inherit(rt)
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
                await self._load(rt)
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
        if self.initial_loads is not None:
            for copied in _copied_spans(span):
                await self.initial_loads.stop(copied)  # its finished chunks stay for the next owner
        if rt is None:
            return None
        final = rt.stored
        if rt.checkpoint is not None and rt.checkpoint != rt.stored:
            try:
                if await self._store(rt, rt.checkpoint):
                    final = rt.checkpoint
            except Exception:
                log.warning("could not store the final checkpoint", exc_info=True,
                            extra={"span": span.name})
        await rt.reader.close()
        self._forget_gauges(span)
        return final

    def status(self) -> list[dict[str, Any]]:
        out = []
        for rt in sorted(self.spans.values(), key=lambda r: r.span):
            status = rt.status()
            snapshot = self.initial_loads.status(rt.span) if self.initial_loads is not None else None
            if snapshot is not None:
                status["snapshot"] = snapshot
            out.append(status)
        return out

    async def _load(self, rt: SpanRuntime) -> None:
        stored = await self.checkpoints.get(rt.span)
        rt.stored = stored
        if stored is None and rt.span.members is not None:
            inherited = await self._inherit(rt)
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
            if rt.config.start_position is not None:
                initial = await start_at_position(self.js, rt.span, rt.config.start_position,
                                                  self.rows_stream)
            else:
                assert rt.config.start_time is not None
                initial = await start_at_time(self.js, rt.span, rt.config.start_time, self.rows_stream)
            await self.checkpoints.advance(rt.span, initial, expected=None)
            rt.stored = rt.checkpoint = initial
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

    async def _inherit(self, rt: SpanRuntime) -> Checkpoint | None:
        """A new table group whose tables all ran as spans of their own (a cascading key added
        to replicated tables) goes on from the lowest of their checkpoints, not from where a new
        span starts: replaying from the lowest is what any replay does, and converges."""
        found = [await self.checkpoints.get(span) for span in _copied_spans(rt.span)]
        known = [c for c in found if c is not None]
        if not known or len(known) != len(found):
            return None
        start = Checkpoint(min(c.stream_seq for c in known), min(c.ts for c in known))
        log.info("a new foreign-key table group starts from its tables' lowest checkpoint",
                 extra={"span": rt.span.name, "checkpoint_ts": start.ts, "stream_seq": start.stream_seq})
        return start

    async def _initial_load(self, rt: SpanRuntime, mode: Literal["snapshot", "snapshot-only"],
                            stored: Checkpoint | None) -> None:
        """The span copies first (``services.sink_worker.snapshot``): no checkpoint while it
        copies, then one at the copy's low watermark, where streaming starts."""
        assert self.initial_loads is not None
        decisions = [await self.initial_loads.decide(SnapshotRequest(
            span, rt.config.source_url, rt.config.sink_url, rt.config.key_policy, mode, rt.shards,
            rt.config.router)) for span in _copied_spans(rt.span)]
        decision, start = decisions[0]
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
            rt.state = "snapshot"
            return
        assert start is not None
        if stored is None:
            await self.checkpoints.advance(rt.span, start, expected=None)
            stored = start
        rt.stored = rt.checkpoint = stored
        rt.state = "done" if decision == "done" else "replicating"

    # ------------------------------------------------------------------ round

    async def round(self, stopping: asyncio.Event | None = None) -> RoundReport:
        started = time.monotonic()
        report = RoundReport(spans=len(self.spans))
        runtimes = list(self.spans.values())
        if not runtimes:
            return report
        self.rounds += 1
        await self._ahead_done()  # a round that failed may have left its read-ahead running
        # A round holds its whole batch as live objects; collections in the middle of it only
        # walk them again and again (libs.gc_pause). The collector runs between rounds.
        with gc_paused(), tracer().start_as_current_span("sink round",
                                                         attributes={"sluice.spans": len(runtimes)}):
            works = await self._pull_all(runtimes, report)
            report.pull_s = time.monotonic() - started
            self._ahead = asyncio.ensure_future(self._read_ahead(works))  # while the batch is written
            outcomes: dict[str, _Outcome] = {}
            cuts: dict[str, SpanCut] = {}
            table_works = [w for w in works if w.group is None]
            if any(w.fresh and not w.refused for w in table_works):
                try:
                    with _batch_span(table_works):
                        cuts, outcomes = await self._in_thread(table_works, stopping)
                        if self.fence is not None:  # liveness: self-fence
                            self.fence.check()
                        await self._publish_streams(table_works, outcomes)
                except Fenced:  # liveness: self-fence, the worker starts over
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
                            outcomes[w.rt.span.kv_key] = _Outcome(error=f"sort job failed: {exc!r}")
            for w in works:
                if w.group is not None and not w.refused:
                    if self.fence is not None:  # liveness: self-fence, before the group's write
                        self.fence.check()
                    key = w.rt.span.kv_key
                    cuts[key], outcomes[key] = await asyncio.to_thread(self._apply_group, w)
            for w in works:
                if w.shard_cut is not None:
                    cuts[w.rt.span.kv_key] = w.shard_cut
                    outcomes[w.rt.span.kv_key] = _Outcome(written=True, ddl_applied=True)
            await settle([self._finish(w, cuts.get(w.rt.span.kv_key), outcomes.get(w.rt.span.kv_key), report)
                          for w in works])
            await self._ahead_done()
        report.duration_s = time.monotonic() - started
        if report.batch_events or report.ddl_applied:
            m.ROUND_SECONDS.observe(report.duration_s)
        log.debug("round done", extra={"events": report.events, "batch_events": report.batch_events,
                                       "rows": report.rows_written, "pull_s": round(report.pull_s, 3),
                                       "duration_s": round(report.duration_s, 3)})
        self._count_states()
        self.last_report = report
        return report

    async def _ahead_done(self) -> None:
        """Wait for the read-ahead (it never raises); a reader is read by one thing at a time."""
        if self._ahead is not None:
            await asyncio.shield(self._ahead)
            self._ahead = None

    async def _read_ahead(self, works: list[_Work]) -> None:
        """The next round's reading, while this one writes (``round_overlap``)."""
        if not any(w.fresh and not w.refused for w in works):
            return  # nothing to write: no time to overlap
        limits = self.round_size.limits(self.spans)
        await read_ahead(self.js, self.rows_stream, [
            AheadSpan(w.rt.reader, w.rt.span.source, limits.get(w.rt.span, 0))
            for w in works if not w.refused and w.rt.incident is None])

    async def _pull_all(self, runtimes: list[SpanRuntime], report: RoundReport) -> list[_Work]:
        for rt in runtimes:
            if rt.checkpoint is None:
                await self._load(rt)
                continue
            # One read per span and round: an operator's rewind (``CheckpointStore.reset``) or
            # another process' write must be seen even by a span that has nothing to advance.
            stored = await self.checkpoints.get(rt.span)
            if stored != rt.stored:
                log.warning("checkpoint changed outside this worker; reloading",
                            extra={"span": rt.span.name, "found": str(stored), "had": str(rt.stored)})
                await self._load(rt)
        if self.shard_ddl is not None:
            try:
                await self.shard_ddl.refresh_if_due()
                if any(self.shard_ddl.group_size(rt.span) is None for rt in runtimes):
                    await self.shard_ddl.refresh_if_due(force=True)  # a span newer than the groups
            except Exception:
                log.warning("shard group discovery failed", exc_info=True)
            self._count_shards()
        marks = {}
        for source in sorted({rt.span.source for rt in runtimes}):
            marks[source] = await latest_resolved(self.js, source, self.rows_stream)
        limits = self.round_size.limits(rt.span for rt in runtimes)
        works: list[_Work] = []
        for rt in runtimes:
            if rt.checkpoint is None or rt.state == "done":
                continue  # copying its initial load (or copied, snapshot-only): nothing to stream
            if rt.incident is not None:
                continue  # stopped until an operator acts; its checkpoint stays where it is
            start = rt.checkpoint
            mark = marks.get(rt.span.source)
            try:
                limit = limits[rt.span]
                pulled = await rt.reader.pull((start.stream_seq, start.ts), limit,
                                              mark.stream_seq if mark else None)
                self.round_size.observe(rt.span, limit, len(pulled.events), pulled.event_bytes,
                                        behind=bool(pulled.ghosts) or not pulled.reached)
            except Exception as exc:
                log.warning("pull failed", exc_info=True, extra={"span": rt.span.name})
                rt.state, rt.error = "error", f"pull failed: {exc!r}"
                report.errors.append(f"{rt.span.name}: pull: {exc!r}")
                m.ROUND_ERRORS.labels("pull").inc()
                continue
            rt.dead_lettered += pulled.dead_lettered
            rt.resolved_ts = mark.ts if mark else None
            work = _Work(rt, start, pulled, pulled.horizon(start.ts, rt.resolved_ts),
                         [e for e in pulled.events if e.ts > start.ts])
            if rt.span.members is not None:
                await self._plan_group(work)
            else:
                await self._plan(work)
                if self.shard_ddl is not None and rt.shards > 1 and not work.refused:
                    await self._shard_ddl_at_head(work)
                elif rt.shards <= 1 and not work.refused and not is_stream_sink(rt.config.sink_url):
                    await self._schema_ddl_at_head(work)
            report.events += len(work.fresh)
            works.append(work)
        return works

    async def _plan(self, w: _Work) -> None:
        """The span's target and key; refuse a keyless table, park rows without key values."""
        span, policy = w.rt.span, w.rt.config.key_policy
        last_meta: RowsChangedV2 | None = None
        kept: list[PulledEvent] = []
        barrier = False
        for e in w.fresh:
            if e.dead:
                kept.append(e)  # holds its place in its transaction; never applied
                continue
            if barrier or not isinstance(e.event, RowsChangedV2):
                barrier = True
                kept.append(e)
                continue
            ev = e.event
            if last_meta is None or (ev.database, ev.table, ev.meta) != (
                    last_meta.database, last_meta.table, last_meta.meta):
                # Consecutive events almost always share the table's metadata: route once.
                try:
                    routed = target_for(span, ev.database, ev.table, ev.meta, policy, w.rt.config.router)
                    w.rules = await self._table_rules(w.rt.config.router, ev)
                except (KeylessTableError, TableRulesError) as exc:
                    self._refuse(w, str(exc))
                    return
                origin = self._origin_of(w, ev.database, ev.table)
                key = tuple(c for c in routed.key if origin is None or c != origin[0])
            problem = _missing_key_columns(e.event, key)
            if problem is not None:
                await w.rt.reader.dead_letter_event(e, "invalid_data", problem)
                dead = replace(e, dead=True)
                w.pulled.events = [dead if x.stream_seq == e.stream_seq else x for x in w.pulled.events]
                w.rt.dead_lettered += 1
                kept.append(dead)
                continue
            kept.append(e)
            last_meta = e.event
        w.fresh = kept
        if last_meta is not None:
            table = target_for(span, last_meta.database, last_meta.table, last_meta.meta, policy,
                               w.rt.config.router)
            if w.rt.skip_reasons:
                await self._park_skipped(w, table.key)
            w.plan = TargetPlan(target_id=target_id(w.rt.config.sink_url, table),
                                sink_url=w.rt.config.sink_url, table=table)
            w.origin = self._origin_of(w, last_meta.database, last_meta.table)
            w.source_meta = last_meta.meta
        if w.rt.state == "refused":
            w.rt.state, w.rt.error = "replicating", None

    async def _plan_group(self, w: _Work) -> None:
        """A table group's cut (``table_group.cut_group``), the cascading keys among its tables
        and every member's metadata (from its events, else the source's information_schema: a
        cascade reaches children that have no event in the batch)."""
        rt = w.rt
        if is_stream_sink(rt.config.sink_url):
            self._refuse(w, "a foreign-key table group is applied with its cascades on SQL "
                            "downstreams only (DESIGN.md, \"Foreign-key cascades\")")
            return
        try:
            fks = await source_foreign_keys(rt.config.source_url, strict=True)
        except Exception as exc:
            rt.state, rt.error = "error", f"cannot read the source's foreign keys: {exc!r}"
            w.refused = rt.error
            return
        members = set(rt.span.tables())
        w.group_fks = [fk for fk in fks if fk.cascading
                       and (token(fk.database), token(fk.table)) in members
                       and (token(fk.ref_database), token(fk.ref_table)) in members]
        w.group = cut_group(rt.span.kv_key, w.start.ts, w.horizon, w.fresh)
        for e in w.group.batch:
            assert isinstance(e.event, RowsChangedV2)
            rt.group_metas[(e.event.database, e.event.table)] = e.event.meta
        names = ({(fk.database, fk.table) for fk in w.group_fks}
                 | {(fk.ref_database, fk.ref_table) for fk in w.group_fks})
        missing = sorted(n for n in names if n not in rt.group_metas)
        if missing:
            rt.group_metas.update(await asyncio.to_thread(source_metas, rt.config.source_url, missing))
        router = rt.config.router
        if router is not None and router.table_rules:
            ruled = [f"{d}.{t}" for d, t in sorted(rt.group_metas)
                     if rules_for(router.table_rules, d, t) is not NO_RULES]
            if ruled:
                self._refuse(w, f"table rules on tables of a foreign-key group ({', '.join(ruled)}) "
                                "are not carried out with its cascades")
                return
        if rt.state == "refused":
            rt.state, rt.error = "replicating", None

    def _apply_group(self, w: _Work) -> tuple[SpanCut, _Outcome]:
        """A table group's batch and cascades in one downstream transaction, then the DDL it
        stops at (``table_group``)."""
        assert w.group is not None
        rt, cut = w.rt, w.group.cut
        outcome = _Outcome()
        url = rt.config.sink_url
        try:
            sink = open_sink(url)
            assert isinstance(sink, SqlSink)
            tables: dict[tuple[str, str], CascadeTable] = {}
            for (database, table), meta in rt.group_metas.items():
                target = target_for(rt.span, database, table, meta, rt.config.key_policy, rt.config.router)
                origin = self._origin_of(w, database, table)
                self._ensure_schema(sink, url, target, reconcile=origin is None)
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
            ddl = w.group.ddl
            if ddl is not None:
                assert isinstance(ddl.event, DdlExecutedV1)
                if ddl_action(ddl.event) in ("recopy", "leave"):
                    outcome.blocked = (f"DDL at ts {ddl.ts} ({ddl.event.statement!r}) would re-copy a table "
                                       "of a foreign-key group, which is not built yet")
                else:
                    self._apply_ddl(sink, url, w, ddl.event)
                    rt.group_metas.pop((ddl.event.database, ddl.event.table), None)
                    if ddl.event.meta_after is not None:
                        rt.group_metas[(ddl.event.database, ddl.event.table)] = ddl.event.meta_after
                    outcome.ddl_applied = True
        except Exception as exc:
            m.ROUND_ERRORS.labels("apply").inc()
            log.exception("a foreign-key group's apply failed", extra={"span": rt.span.name})
            outcome = _Outcome(error=f"apply failed: {exc!r}")
            self._schemas.clear()
        return cut, outcome

    async def _table_rules(self, router: Router | None, ev: RowsChangedV2) -> TableRules | None:
        """The table's rules, their expressions checked against its metadata by Spark's
        analyser (once per table shape); ``TableRulesError`` says why they do not fit."""
        if router is None or not router.table_rules:
            return None
        rules = rules_for(router.table_rules, ev.database, ev.table)
        if rules == NO_RULES:
            return None
        if rules.needs_spark:
            cache_key = (ev.meta.model_dump_json(), repr(rules))
            if cache_key not in self._rules_checked:
                problem = await asyncio.to_thread(analyse, self._spark(), ev.meta, rules)
                self._rules_checked[cache_key] = problem
            problem = self._rules_checked[cache_key]
            if problem is not None:
                raise TableRulesError(f"table rules of {ev.database}.{ev.table}: {problem}")
        return rules

    @staticmethod
    def _origin_of(w: _Work, database: str, table: str) -> tuple[str, str] | None:
        router = w.rt.config.router
        if router is None:
            return None
        ref = shard_ref(w.rt.span, database, table)
        origin = router.origin_for(ref)
        return (origin.name, origin.value(ref)) if origin is not None else None

    async def _shard_ddl_at_head(self, w: _Work) -> None:
        """A sharded span whose next event is a DDL: handled here in the driver, without a
        Spark job (``services.sink_worker.shard_ddl``). Rows before a DDL are applied first by
        the normal round, which stops the span just below the DDL."""
        assert self.shard_ddl is not None
        head = next((e for e in w.fresh if not e.dead), None)
        if head is None or not isinstance(head.event, DdlExecutedV1):
            return
        ddl = head.event
        if head.ts > w.horizon:
            w.fresh = []  # not complete yet: the checkpoint follows the horizon, below the DDL
            return
        span = w.rt.span
        target = self.shard_ddl.lock_target(span)
        if target is None:
            target = _route_tokens(span, w.rt.config.router)
        action = ddl_action(ddl)
        w.fresh = []
        if action == "drop":
            # One shard's table is gone; the merged target keeps the other shards' rows.
            if not await self.shard_ddl.dropped(span, target, head.stream_seq, ddl.statement):
                w.shard_wait = "shard dropped upstream; waiting for the ddl-lock leader to record it"
                return
        elif action == "truncate":
            log.warning("TRUNCATE of one shard of a merged target is not replicated (the target "
                        "holds other shards' rows)", extra={"span": span.name, "statement": ddl.statement})
        else:
            ddls = (rewritten(ddl.statement, ddl.database, ddl.table, target),)
            op = await self.shard_ddl.at_ddl(span, target, ddls, head.stream_seq)
            if op is None:
                w.shard_wait = (f"DDL at ts {head.ts} on a target with {w.rt.shards} upstream shards "
                                "waits for its shard DDL operation")
                return
            if op.kind == "exec" and not self.shard_ddl.already_carried(op):
                try:
                    await asyncio.to_thread(self._exec_shard_ddl, w, ddl, op.ddls)
                except Exception as exc:
                    m.ROUND_ERRORS.labels("ddl").inc()
                    log.exception("shard DDL exec failed",
                                  extra={"span": span.name, "statement": ddl.statement})
                    await self.shard_ddl.carried_out(op, error=repr(exc))
                    w.shard_wait = f"shard DDL exec failed (retried): {exc!r}"
                    return
            await self.shard_ddl.carried_out(op)
            log.info("shard DDL carried out", extra={"span": span.name, "kind": op.kind, "ts": head.ts,
                                                     "statement": ddl.statement})
        w.shard_cut = SpanCut(span.kv_key, limit_ts=head.ts, batch_events=0, batch_max_ts=None,
                              ddl_ts=head.ts, ddl_id=head.event_id)

    async def _schema_ddl_at_head(self, w: _Work) -> None:
        """A single-shard span whose next event is a DDL that re-copies its table or renamed it
        away (``ddl_plan``): carried out here in the driver. The rows before the DDL were
        applied by the normal round, which stopped the span just below it.

        - ``leave``: the name's target is dropped and the span moves past the DDL.
        - ``recopy``: the initial-load machinery copies the table into an emptied target; the
          progress is recorded under the DDL's stream sequence, so a worker that takes the span
          over (crash, move) finds the same DDL at the head and runs the same copy again, from
          the start (``InitialLoads._prepare``: the source's shape may have moved on). Once it
          is done, the checkpoint moves to the copy's low watermark (at or past the DDL) and
          the span streams on from there, as after an initial load.
        """
        head = next((e for e in w.fresh if not e.dead), None)
        if head is None or not isinstance(head.event, DdlExecutedV1) or head.ts > w.horizon:
            return
        ddl = head.event
        action = ddl_action(ddl)
        if action not in ("recopy", "leave"):
            return
        rt, span = w.rt, w.rt.span
        url = rt.config.sink_url
        routed = route_of(span, ddl.database, ddl.table, rt.config.router)
        self._schemas.pop((url, routed.schema, routed.table), None)
        w.fresh = []

        def failed(reason: str) -> None:
            w.ddl_failure = ddl_failed(span, ddl.statement, head.ts, head.stream_seq, reason, rt.ddl_error)

        if action == "leave":
            table = TargetTable(schema=routed.schema, name=routed.table,
                                meta=TableMetaV1(columns=[], primary_key=[]), key=())
            try:
                await asyncio.to_thread(lambda: open_sink(url).drop_table(table))
            except Exception as exc:
                m.ROUND_ERRORS.labels("ddl").inc()
                failed(f"dropping the target of a table renamed away failed: {type(exc).__name__}: {exc}")
                return
            m.DDL_APPLIED.labels(span.changefeed, action).inc()
            log.info("table renamed away upstream: its target is dropped",
                     extra={"span": span.name, "ts": head.ts, "statement": ddl.statement})
            w.shard_cut = SpanCut(span.kv_key, limit_ts=head.ts, batch_events=0, batch_max_ts=None,
                                  ddl_ts=head.ts, ddl_id=head.event_id)
            return
        if self.initial_loads is None or not rt.config.source_url:
            failed("the DDL changes existing rows upstream, so the table must be copied again, but "
                   "this worker has no initial-load runner or no source URL for it")
            return
        request = SnapshotRequest(span, rt.config.source_url, url, rt.config.key_policy, "snapshot",
                                  rt.shards, rt.config.router, recopy_of=head.stream_seq)
        decision, start = await self.initial_loads.decide(request)
        if decision == "copying" or start is None:
            if not w.recopying and rt.state != "snapshot":
                log.info("DDL changes existing rows: copying the table again",
                         extra={"span": span.name, "ts": head.ts, "statement": ddl.statement})
            w.recopying = True
            return
        resume_ts = max(head.ts, start.ts)
        m.DDL_APPLIED.labels(span.changefeed, action).inc()
        log.info("re-copy after DDL done; streaming on from its low watermark",
                 extra={"span": span.name, "ddl_ts": head.ts, "low_watermark_ts": start.ts})
        w.shard_cut = SpanCut(span.kv_key, limit_ts=resume_ts, batch_events=0, batch_max_ts=None,
                              ddl_ts=resume_ts, ddl_id=head.event_id)
        w.recopy_key = request.progress_key

    def _exec_shard_ddl(self, w: _Work, ddl: DdlExecutedV1, statements: tuple[str, ...]) -> None:
        """The owner brings the target to the shard's schema after the DDL
        (``shard_ddl.execute_on_target``: idempotent, a re-run counts as done)."""
        if ddl.meta_after is None:
            log.warning("shard DDL without table metadata: nothing to change downstream",
                        extra={"span": w.rt.span.name, "statement": ddl.statement})
            return
        url = w.rt.config.sink_url
        table = target_for(w.rt.span, ddl.database, ddl.table, ddl.meta_after, w.rt.config.key_policy,
                           w.rt.config.router)
        self._schemas.pop((url, table.schema, table.name), None)
        already = execute_on_target(open_sink(url), table, statements)
        if already:
            log.info("shard DDL was already applied on the target: counted as done",
                     extra={"span": w.rt.span.name, "statements": already})
        self._schemas[(url, table.schema, table.name)] = table.meta.model_dump_json()
        m.DDL_APPLIED.labels(w.rt.span.changefeed, "reconcile").inc()

    def _refuse(self, w: _Work, reason: str) -> None:
        w.refused = reason
        if w.rt.state != "refused" or w.rt.error != reason:
            log.error("span refused: %s", reason, extra={"span": w.rt.span.name})
            m.KEYLESS_REFUSED.labels(w.rt.span.changefeed).inc()
        w.rt.state, w.rt.error = "refused", reason

    # ------------------------------------------------------------------ Spark, in a thread

    async def _in_thread(self, works: list[_Work],
                         stopping: asyncio.Event | None) -> tuple[dict[str, SpanCut], dict[str, _Outcome]]:
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

    def _spark_round(self, group: str, works: list[_Work],
                     abort: threading.Event) -> tuple[dict[str, SpanCut], dict[str, _Outcome]]:
        spark = self._spark()
        # The tag marks this thread's jobs (a classic session and Spark Connect alike), so a
        # stop interrupts exactly them.
        spark.addTag(group)
        try:
            return self._sort_and_apply(spark, works, abort)
        finally:
            spark.removeTag(group)

    def _sort_and_apply(self, spark: SparkSession, works: list[_Work],
                        abort: threading.Event) -> tuple[dict[str, SpanCut], dict[str, _Outcome]]:
        outcomes: dict[str, _Outcome] = {}
        # Values above the threshold stay here; the jobs get references (``large_values``).
        large = LargeValues(self.options.large_value_bytes)
        active: list[_Work] = []
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
                outcomes[w.rt.span.kv_key] = _Outcome(incident=_large_key_incident(w, exc))
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
            if self.fence is not None:  # liveness: self-fence, before each sink's write
                self.fence.check()
            self._apply_sink(spark, sink_url, [by_key[k] for k in keys], sort, outcomes, abort, large)
        return sort.cuts, outcomes

    def _apply_sink(self, spark: SparkSession, sink_url: str, works: list[_Work], sort: SortResult,
                    outcomes: dict[str, _Outcome], abort: threading.Event,
                    large: LargeValues | None = None) -> None:
        if is_stream_sink(sink_url):
            self._plan_stream(sink_url, works, sort, outcomes)
            return
        batch_works = [w for w in works if sort.cuts[w.rt.span.kv_key].batch_events and w.plan]
        try:
            sink = open_sink(sink_url)
            for w in batch_works:
                assert w.plan is not None
                self._ensure_schema(sink, sink_url, w.plan.table, reconcile=w.rt.shards == 1)
            if batch_works:
                keys = [w.rt.span.kv_key for w in batch_works]
                metas = {w.rt.span.kv_key: w.source_meta for w in batch_works if w.source_meta is not None}
                plans = {w.rt.span.kv_key: w.plan for w in batch_works if w.plan is not None}
                origins = {w.rt.span.kv_key: w.origin for w in batch_works if w.origin is not None}
                skips = {w.rt.span.kv_key: dict(w.rt.skips) for w in batch_works if w.rt.skips}
                guarded = {w.plan.target_id: w.rt.config.on_unique_conflict for w in batch_works
                           if w.plan is not None and _needs_guard(w)}
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
            log.exception("apply job failed", extra={"sink": _redacted(sink_url)})
            for w in works:
                outcomes[w.rt.span.kv_key] = _Outcome(error=f"apply failed: {exc!r}")
                if w.plan is not None:
                    # The target may have been dropped or altered behind our back: check its
                    # schema again before the retry instead of trusting this process' memory.
                    self._schemas.pop((sink_url, w.plan.table.schema, w.plan.table.name), None)
            return
        for w in works:
            outcome = outcomes.setdefault(w.rt.span.kv_key, _Outcome())
            if outcome.incident is not None:
                continue  # refused for good: nothing of its batch counts as written
            outcome.written = True
            cut = sort.cuts[w.rt.span.kv_key]
            if cut.ddl_id is None:
                continue
            ddl = next(e for e in w.fresh if e.event_id == cut.ddl_id)
            assert isinstance(ddl.event, DdlExecutedV1)
            if abort.is_set():
                continue  # the round is being abandoned: nothing more is written
            if w.rt.shards > 1:
                outcome.blocked = (f"DDL at ts {ddl.ts} on a target with {w.rt.shards} upstream shards "
                                   "waits for shard DDL coordination")
                continue
            if ddl_action(ddl.event) in ("recopy", "leave"):
                continue  # carried out at the head of the span next round (_schema_ddl_at_head)
            try:
                self._apply_ddl(sink, sink_url, w, ddl.event)
                outcome.ddl_applied = True
            except (KeylessTableError, TableRulesError) as exc:
                outcome.refused = str(exc)
            except Exception as exc:
                m.ROUND_ERRORS.labels("ddl").inc()
                log.debug("DDL failed", exc_info=True, extra={"span": w.rt.span.name})
                outcome.ddl_failure = ddl_failed(w.rt.span, ddl.event.statement, ddl.ts, ddl.stream_seq,
                                                 f"{type(exc).__name__}: {exc}", w.rt.ddl_error)
                outcome.error = outcome.ddl_failure.message()

    def _stop_refused(self, works: list[_Work], result: ApplyResult, sort: SortResult,
                      outcomes: dict[str, _Outcome]) -> None:
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
            outcomes.setdefault(w.rt.span.kv_key, _Outcome()).incident = incident

    def _report_overwrites(self, works: list[_Work], result: ApplyResult) -> None:
        """Policy ``overwrite``: each removed row of another shard is counted, logged and kept
        for the worker to record as an event."""
        changefeeds = {w.plan.target_id: w.rt.span.changefeed for w in works if w.plan is not None}
        for target_id, reports in result.overwritten.items():
            cf = changefeeds[target_id]
            for text in reports:
                m.CROSS_SHARD_CONFLICTS.labels(cf, "overwritten").inc()
                log.warning("cross-shard unique conflict: the other shard's row was removed",
                            extra={"changefeed": cf, "conflict": text})
                self.new_overwrites.append((cf, text))

    def _plan_stream(self, sink_url: str, works: list[_Work], sort: SortResult,
                     outcomes: dict[str, _Outcome]) -> None:
        """NATS sink: every change of each span's batch (the sort job's cut, deduplicated by
        event id), in order, plus the DDL barrier; published on the event loop afterwards."""
        try:
            publisher = self._publisher(sink_url)
        except Exception as exc:
            for w in works:
                outcomes[w.rt.span.kv_key] = _Outcome(error=f"NATS sink: {exc}")
            return
        for w in works:
            cut = sort.cuts[w.rt.span.kv_key]
            outcome = outcomes.setdefault(w.rt.span.kv_key, _Outcome())
            seen: set[str] = set()
            batch: list[ChangeSource] = []
            for e in w.fresh:
                if (not e.dead and not e.is_ddl and w.start.ts < e.ts <= cut.limit_ts
                        and e.event_id not in seen):
                    seen.add(e.event_id)
                    batch.append(ChangeSource(e.event_id, e.event))
            if w.rules is not None and w.source_meta is not None:
                batch = stream_rows(self._spark(), w.source_meta, w.rules, batch)
            schema: str | None = w.rt.span.database
            table = w.rt.span.table
            key: tuple[str, ...] = ()
            if w.plan is not None:
                schema, table, key = w.plan.table.schema, w.plan.table.name, w.plan.table.key
            messages = row_messages(publisher.target, w.rt.span.changefeed, schema, table, key, batch)
            if cut.ddl_id is not None:
                if w.rt.shards > 1:
                    outcome.blocked = (f"DDL at ts {cut.ddl_ts} on a target with {w.rt.shards} upstream "
                                       "shards waits for shard DDL coordination")
                else:
                    ddl = next(e for e in w.fresh if e.event_id == cut.ddl_id)
                    if _ddl_ignored(w, ddl):
                        outcome.ddl_ignored = True
                    else:
                        messages.append(ddl_message(publisher.target, w.rt.span.changefeed, schema, table,
                                                    ChangeSource(ddl.event_id, ddl.event)))
                        outcome.publish_ddl = True
            outcome.publish = messages

    def _publisher(self, sink_url: str) -> StreamPublisher:
        publisher = self._publishers.get(sink_url)
        if publisher is None:
            publisher = self._publishers[sink_url] = StreamPublisher(
                sink_url, replicas=self.options.stream_replicas, dedup_window_s=self.options.dedup_window_s)
        return publisher

    async def _publish_streams(self, works: list[_Work], outcomes: dict[str, _Outcome]) -> None:
        """Publish the NATS sink batches in order; a span counts as written only once every
        message of its batch is acknowledged by the stream (else nothing advances for it)."""
        for w in works:
            outcome = outcomes.get(w.rt.span.kv_key)
            if outcome is None or outcome.publish is None:
                continue
            t0 = time.monotonic()
            try:
                with tracer().start_as_current_span("publish changes", attributes={
                        "sluice.span": w.rt.span.name, "sluice.messages": len(outcome.publish)}):
                    await self._publisher(w.rt.config.sink_url).publish(outcome.publish)
            except Exception as exc:
                m.ROUND_ERRORS.labels("publish").inc()
                log.warning("NATS sink publish failed", exc_info=True, extra={"span": w.rt.span.name})
                outcome.error, outcome.publish = f"NATS sink publish failed: {exc!r}", None
                continue
            m.APPLY_SECONDS.observe(time.monotonic() - t0)
            rows = len(outcome.publish) - (1 if outcome.publish_ddl else 0)
            m.ROWS_APPLIED.labels(w.rt.span.changefeed, "publish").inc(rows)
            m.BATCH_ROWS.observe(rows)
            w.rt.rows_written += rows
            outcome.rows += rows
            outcome.written = True
            outcome.ddl_applied = outcome.publish_ddl or outcome.ddl_ignored
            outcome.publish = None

    def _count_written(self, works: list[_Work], result: ApplyResult,
                       outcomes: dict[str, _Outcome]) -> None:
        """Count each target's rows once, and give every span its share of them.

        Spans routed into one target are applied as one merged image, so the apply job only
        knows the target's counts: a span's share is its part of the round's row changes."""
        by_target: dict[str, list[_Work]] = {}
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
                outcomes.setdefault(w.rt.span.kv_key, _Outcome()).rows += share
        m.BATCH_ROWS.observe(rows)

    def _ensure_schema(self, sink: Sink, sink_url: str, table: TargetTable, *, reconcile: bool) -> None:
        """Create the target from the source schema when missing, and bring its columns to the
        batch's metadata (idempotent; skipped while this process knows it is done).

        Reconciling to the batch's metadata makes a replay from an older checkpoint converge:
        the target goes back to the schema those rows were written with, and the DDL after
        them moves it forward again. Targets fed by several shards only get created here:
        shards may be at different schema versions, and reconciling to each in turn would
        flip columns back and forth (their DDL goes through the ddl-lock).
        """
        cache_key = (sink_url, table.schema, table.name)
        meta_json = table.meta.model_dump_json()
        if cache_key in self._schemas and (self._schemas[cache_key] == meta_json or not reconcile):
            return
        sink.ensure_table(table)
        if reconcile:
            sink.reconcile_schema(table)
        self._schemas[cache_key] = meta_json

    def _apply_ddl(self, sink: Sink, sink_url: str, w: _Work, ddl: DdlExecutedV1) -> None:
        action = ddl_action(ddl)
        if _rules_ignore_ddl(w.rt.config.router, ddl, action):
            m.DDL_APPLIED.labels(w.rt.span.changefeed, "ignored").inc()
            log.info("DDL left out by the changefeed's table rules",
                     extra={"span": w.rt.span.name, "action": action, "ts": ddl.ts})
            return
        policy = w.rt.config.key_policy
        routed = route_of(w.rt.span, ddl.database, ddl.table, w.rt.config.router)
        cache_key = (sink_url, routed.schema, routed.table)
        if action == "reconcile":
            assert ddl.meta_after is not None
            table = target_for(w.rt.span, ddl.database, ddl.table, ddl.meta_after, policy, w.rt.config.router)
            self._schemas.pop(cache_key, None)
            sink.ensure_table(table)
            sink.reconcile_schema(table)
            self._schemas[cache_key] = table.meta.model_dump_json()
        elif action in ("drop", "truncate"):
            # Only the name matters to drop/truncate; the metadata may be gone with the table.
            meta = ddl.meta_after or TableMetaV1(columns=[], primary_key=[])
            table = TargetTable(schema=routed.schema, name=routed.table, meta=meta, key=())
            self._schemas.pop(cache_key, None)
            if action == "drop":
                sink.drop_table(table)
            else:
                sink.truncate_table(table)
        else:
            log.warning("DDL without table metadata: nothing to change downstream",
                        extra={"span": w.rt.span.name, "statement": ddl.statement})
        m.DDL_APPLIED.labels(w.rt.span.changefeed, action).inc()
        log.info("DDL applied", extra={"span": w.rt.span.name, "action": action, "ts": ddl.ts,
                                       "statement": ddl.statement})

    # ------------------------------------------------------------------ checkpoint

    async def _finish(self, w: _Work, cut: SpanCut | None, outcome: _Outcome | None,
                      report: RoundReport) -> None:
        rt = w.rt
        if w.refused:
            return
        if w.shard_wait is not None:
            rt.state, rt.error = "blocked", w.shard_wait
            return
        if w.ddl_failure is not None:
            rt.state, rt.error, rt.ddl_error = "error", w.ddl_failure.message(), w.ddl_failure
            report.errors.append(f"{rt.span.name}: {rt.error}")
            return
        if w.recopying:
            rt.state, rt.error, rt.ddl_error = "snapshot", None, None
            return
        if outcome is not None and outcome.incident is not None:
            self._stopped(rt, outcome.incident)
            report.errors.append(f"{rt.span.name}: {rt.error}")
            return
        if outcome is not None and outcome.error:
            rt.state, rt.error = "error", outcome.error
            rt.ddl_error = outcome.ddl_failure
            report.errors.append(f"{rt.span.name}: {outcome.error}")
            return
        rt.ddl_error = None
        if cut is None:
            handled = w.horizon  # nothing fresh: everything up to the horizon is applied
        else:
            written = outcome is not None and outcome.written
            if not written and (cut.batch_events or cut.ddl_id):
                return  # not written: nothing to checkpoint
            ddl_done = outcome is not None and outcome.ddl_applied and cut.ddl_ts is not None
            handled = cut.ddl_ts if ddl_done and cut.ddl_ts is not None else cut.limit_ts
            report.batch_events += cut.batch_events
            rt.last_batch_events = cut.batch_events
            if outcome is not None and outcome.ddl_applied:
                report.ddl_applied += 1
        new_ts = max(w.start.ts, handled)
        first_pending = w.pulled.first_seq_after(new_ts)
        new_seq = max(w.start.stream_seq,
                      first_pending - 1 if first_pending is not None else w.pulled.read_upto)
        proposed = Checkpoint(stream_seq=new_seq, ts=new_ts)
        if outcome is not None:
            report.rows_written += outcome.rows
        if outcome is not None and outcome.refused:
            if rt.state != "refused":
                log.error("span refused at DDL: %s", outcome.refused, extra={"span": rt.span.name})
                m.KEYLESS_REFUSED.labels(rt.span.changefeed).inc()
            rt.state, rt.error = "refused", outcome.refused
        elif outcome is not None and outcome.blocked:
            rt.state, rt.error = "blocked", outcome.blocked
        else:
            rt.state, rt.error = "replicating", None
        if proposed != w.start:
            rt.checkpoint = proposed
            report.advanced += 1
        if self.validation is not None and cut is not None and cut.batch_events and w.group is None:
            self.validation.note_batch(w, handled)
        # Written batches are recorded at once; an idle span following the resolved ts only
        # every checkpoint_interval_s (a restart then re-reads a little, which is harmless).
        wrote = cut is not None and (cut.batch_events > 0 or (outcome is not None and outcome.ddl_applied))
        due = wrote or time.monotonic() - rt.stored_at >= self.options.checkpoint_interval_s
        if proposed != rt.stored and due and not await self._store(rt, proposed):
            return
        if w.recopy_key is not None and rt.stored == proposed and self.initial_loads is not None:
            with contextlib.suppress(Exception):  # a leftover record is only clutter
                await self.initial_loads.store.delete(rt.span, w.recopy_key)
        cf, name = rt.span.changefeed, rt.span.name
        m.CHECKPOINT_TIME.labels(cf, name).set(m.ts_seconds(proposed.ts))
        m.CHECKPOINT_LAG.labels(cf, name).set(m.lag_seconds(proposed.ts))
        if rt.resolved_ts:
            m.RESOLVED_LAG.labels(cf, name).set(
                max(0.0, m.ts_seconds(rt.resolved_ts) - m.ts_seconds(proposed.ts)))

    def _stopped(self, rt: SpanRuntime, incident: TableIncident) -> None:
        rt.incident = incident
        self.new_incidents.append((rt.span, incident))
        rt.state, rt.error = "error", f"stopped: {incident.failure.describe()}"
        m.TABLE_INCIDENTS.labels(rt.span.changefeed).inc()
        if incident.failure.error.startswith(UniqueConflictError.__name__):
            m.CROSS_SHARD_CONFLICTS.labels(rt.span.changefeed, "refused").inc()
        m.TABLE_STOPPED.labels(rt.span.changefeed, rt.span.name).set(1)
        log.error("span stopped: the downstream refused a change for good",
                  extra={"span": rt.span.name, **incident.status()})

    async def _store(self, rt: SpanRuntime, checkpoint: Checkpoint) -> bool:
        """Write ``checkpoint`` over the one this worker last stored; False when it may not."""
        try:
            await self.checkpoints.advance(rt.span, checkpoint, expected=rt.stored)
        except CheckpointMoved as exc:
            # Somebody rewound (or moved) it on purpose: start over from what they wrote.
            log.warning("checkpoint moved under us; reloading", extra={"span": rt.span.name,
                                                                       "found": str(exc.found)})
            rt.checkpoint = None
            return False
        except CheckpointRegression:
            log.exception("refused to move a checkpoint backwards", extra={"span": rt.span.name})
            rt.checkpoint = None
            return False
        rt.stored = checkpoint
        rt.stored_at = time.monotonic()
        return True

    async def flush_checkpoints(self) -> None:
        """Store every span's latest checkpoint (on a clean stop); each covers written batches only."""
        for rt in self.spans.values():
            if rt.checkpoint is not None and rt.checkpoint != rt.stored:
                with contextlib.suppress(Exception):
                    await self._store(rt, rt.checkpoint)

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
        if rt is None or rt.incident is None or rt.incident.id != incident:
            return False
        stopped = rt.incident
        if action == "skip":
            if stopped.failure.key is None:
                return False  # no single row to skip: the batch only fails as a whole
            rt.skips[stopped.failure.key] = max(stopped.upto_ts, rt.skips.get(stopped.failure.key, 0))
            self.known_skips.setdefault(span, {})[stopped.failure.key] = rt.skips[stopped.failure.key]
            rt.skip_reasons[stopped.failure.key] = stopped
        rt.incident = None
        rt.state, rt.error = "replicating", None
        with contextlib.suppress(KeyError):
            m.TABLE_STOPPED.remove(span.changefeed, span.name)
        log.warning("operator %s on a stopped span", action, extra={"span": span.name, **stopped.status()})
        return True

    async def _park_skipped(self, w: _Work, key: tuple[str, ...]) -> None:
        """Dead-letter (a copy of) each event that holds a skipped key's change, once per key."""
        rt = w.rt
        for skipped, upto in list(rt.skips.items()):
            stopped = rt.skip_reasons.pop(skipped, None)
            if stopped is None:
                continue  # parked already
            reason = (f"skipped by an operator (incident {stopped.id}): {stopped.failure.describe()}")
            for e in w.fresh:
                if e.dead or e.ts > upto or not isinstance(e.event, RowsChangedV2):
                    continue
                if any(skipped in _image_keys(image, key, w.origin) for image in e.event.rows):
                    await dead_letter(self.js, e, reason, "skipped", self.rows_stream, seq=e.stream_seq,
                                      ack=False)
                    rt.dead_lettered += 1

    def _count_states(self) -> None:
        counts: dict[str, int] = {s: 0 for s in ("starting", "snapshot", "replicating", "done", "refused",
                                                 "blocked", "error")}
        for rt in self.spans.values():
            counts[rt.state] += 1
        for state, n in counts.items():
            m.SPANS.labels(state).set(n)


def _copied_spans(span: Span) -> list[Span]:
    """The spans whose tables an initial load copies: a table group's tables one by one."""
    if span.members is None:
        return [span]
    return [Span(span.changefeed, span.source, database, table) for database, table in span.members]


def _large_key_incident(w: _Work, exc: LargeKeyError) -> TableIncident:
    """A key value above the large-value threshold: the table stops, nothing of it is written."""
    key = w.plan.table.key if w.plan is not None else (exc.column,)
    target = w.rt.span.table
    if w.plan is not None:
        table = w.plan.table
        target = f"{table.schema}.{table.name}" if table.schema else table.name
    return TableIncident(id=uuid4().hex, target=target, upto_ts=w.horizon,
                         failure=RowFailure("upsert", None, key, f"LargeKeyError: {exc}", None))


_IGNORABLE_DDL = {"drop": "drop table", "truncate": "truncate"}


def _rules_ignore_ddl(router: Router | None, ddl: DdlExecutedV1, action: str) -> bool:
    """A TRUNCATE or DROP TABLE the table's rules leave out (``ignore_events``)."""
    kind = _IGNORABLE_DDL.get(action)
    if kind is None or router is None or not router.table_rules:
        return False
    try:
        return rules_for(router.table_rules, ddl.database, ddl.table).ignores(kind)
    except TableRulesError:
        return False


def _ddl_ignored(w: _Work, e: PulledEvent) -> bool:
    return isinstance(e.event, DdlExecutedV1) and _rules_ignore_ddl(w.rt.config.router, e.event,
                                                                      ddl_action(e.event))


def _needs_guard(w: _Work) -> bool:
    """A target several shards merge into, without an origin column, with a unique key besides
    its key: a conflict delete there may remove another shard's row (``sinks.unique_guard``)."""
    if w.plan is None or w.origin is not None or w.rt.shards <= 1:
        return False
    key = set(w.plan.table.key)
    return any(unique and set(unique) != key for unique in w.plan.table.unique_keys)


def _image_keys(image: RowImageV2, key: tuple[str, ...], origin: tuple[str, str] | None) -> list[str]:
    """The key JSON (as the apply job spells it, origin column included) of a row change's images."""
    out = []
    for values in (image.before, image.after):
        if values is None:
            continue
        full = {origin[0]: origin[1], **values} if origin is not None else values
        if all(c in full for c in key):
            out.append(key_json(full, key))
    return out


def _route_tokens(span: Span, router: Router | None) -> Target:
    """The span's target by its subject tokens (how spans are discovered and shard groups
    formed, in this worker and in the ddl-lock alike)."""
    try:
        return route_of(span, span.database, span.table, router)
    except ValueError:  # ambiguous routes: refused at creation, counted on its own here
        return Target(span.database, span.table)


def _redacted(url: str) -> str:
    try:
        return parse_database_url(url).redacted()
    except Exception:
        return "<unparsable sink URL>"


def target_id(sink_url: str, table: TargetTable) -> str:
    """Identifies a target table across spans (shards of one target collapse together) without
    carrying the sink URL, which may hold a password, into Spark's data."""
    digest = hashlib.sha256(sink_url.encode()).hexdigest()[:12]
    return f"{digest}:{table.schema or ''}.{table.name}"


@contextlib.contextmanager
def _batch_span(works: list[_Work]) -> Any:
    """The span of a round's sort and apply, a child of the publish span of the oldest change in
    the round: that change's trace runs from capture's publish through the sink's pull, sort and
    apply. A batch merges many traces; it links to the first change of every other span."""
    firsts = [w.fresh[0] for w in works if w.fresh and not w.refused]
    firsts.sort(key=lambda e: e.ts)
    parent = extract_context(firsts[0].headers) if firsts else None
    with tracer().start_as_current_span("sink batch", context=parent, links=_links(firsts[1:]),
                                        attributes={"sluice.spans": len(firsts)}) as span:
        yield span


def _links(events: Any) -> list[trace.Link]:
    """Links from a batch span to the publish spans of (the first event of) each span's batch."""
    links: list[trace.Link] = []
    for e in events:
        ctx = trace.get_current_span(extract_context(e.headers)).get_span_context()
        if ctx.is_valid:
            links.append(trace.Link(ctx))
        if len(links) >= 32:
            break
    return links


def spark_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the py4j gateway to the JVM cannot be reached."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ == "Py4JNetworkError":
            return True
        if isinstance(cur, ConnectionRefusedError) and cur.__traceback__ is not None and any(
                "py4j" in frame.f_code.co_filename for frame, _ in _walk_tb(cur.__traceback__)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _walk_tb(tb: Any) -> Iterator[tuple[Any, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
