"""Continuous validation of the spans this worker runs, and on-demand compares.

Why here: the worker that runs a span knows the keys each batch changed (it applied them), the
span's checkpoint and the table rules, and its rounds are the only writes of those keys, so
between two rounds the downstream holds exactly the rows at the checkpoint (see DESIGN.md).

A check reads a set of keys on both sides, downstream first (at checkpoint ``C``, between
rounds), then upstream (at wall time ``t``), and compares them as the rules say the downstream
should be (``libs.validation``). Equal: done. Different: the row may merely be in flight (an
upstream change after ``C``), so it becomes a *suspect* and is not reported yet. Its re-check
waits for a resolved mark of the source at or after ``t`` (every change committed before the
read is then in the stream, at or below the mark) and for the checkpoint to pass that mark.
A batch that changes the key in the meantime drops the suspect (the key is checked again as a
changed row). Otherwise every upstream change before ``t`` is applied and none touched the
key, so the difference seen at ``C`` was real: the row is read again on both sides and
reported if it still differs. Reported rows are re-read every cycle and leave the report as
soon as they are equal again (repaired).

Continuous mode checks the rows the span's batches changed (``fast``: existence, ``full``:
every compared column). An on-demand compare walks the whole table in key order, a chunk per
cycle, and hands every row that differs to the same re-check; its progress (the last key
compared) is in the span's status record, so it resumes where it stopped on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pymysql.cursors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from contracts.events.rows import ColumnV1, RowsChangedV2, TableMetaV1
from libs.codec.decode import decode_value, normalize_fetched
from libs.codec.table_meta import load_table_info
from libs.config import Settings
from libs.nats_client import read_json
from libs.routing import Router
from libs.scheduling.model import Span
from libs.sql_ident import mysql_ident as quote
from libs.streams import ROWS_STREAM
from libs.table_rules import NO_RULES, TableRules, rules_for
from libs.ts import LOGICAL_BITS
from libs.validation import (
    CompareProgress,
    ReportedRow,
    RowPlan,
    SpanValidation,
    bucket,
    compare_row,
    key_text,
    read_request,
)
from services.sink_worker import metrics as m
from services.sink_worker.round.pull import latest_resolved
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink, sink_kind
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.snapshot.initial_load import _real_names
from services.sink_worker.snapshot.job import connect_source, decode_key, encode_key, estimate_rows
from services.sink_worker.snapshot.plan import key_after
from services.sink_worker.span.machine import SpanState
from services.sink_worker.span.target import shard_ref, target_for

if TYPE_CHECKING:
    from libs.scheduling.model import Span
    from services.sink_worker.round.work import SpanWork
    from services.sink_worker.span.runtime import SpanRuntime

log = logging.getLogger(__name__)


class RunsSpans(Protocol):
    """What validation reads of the pipeline: the spans it runs (the pipeline holds a validator,
    so this module names no pipeline type)."""

    @property
    def spans(self) -> Mapping[Span, SpanRuntime]: ...

Key = tuple[Any, ...]


@dataclass(frozen=True)
class ValidationOptions:
    interval_s: float = 2.0
    batch_rows: int = 500
    max_pending: int = 10_000
    max_reported: int = 1000
    compare_chunk_rows: int = 1000

    @classmethod
    def from_settings(cls, settings: Settings) -> ValidationOptions:
        return cls(interval_s=settings.validation_interval_s, batch_rows=settings.validation_batch_rows,
                   max_pending=settings.validation_max_pending,
                   max_reported=settings.validation_max_reported,
                   compare_chunk_rows=settings.validation_compare_chunk_rows)


@dataclass(frozen=True)
class _Table:
    """A span's table as validation reads it."""

    database: str
    table: str
    source_meta: TableMetaV1
    target: TargetTable
    key: tuple[ColumnV1, ...]
    """The source's key columns (the target's key without the origin column)."""
    origin: tuple[str, str] | None
    plan: RowPlan
    """How changed rows are compared (the changefeed's mode)."""
    full: RowPlan
    """How a compare's rows are compared: every column, whatever the mode."""
    extras_by_range: bool
    """Whether a compare may take a downstream row in a key range for this span's (not a
    merged target without an origin column, whose rows of other shards share the range)."""


@dataclass
class _Suspect:
    key: Key
    read_ms: int
    full: bool = False
    """Found by a compare: re-checked on every column, whatever the mode."""
    mark_ts: int | None = None


@dataclass
class _SpanCheck:
    status: SpanValidation
    table: _Table | None = None
    pending: dict[str, Key] = field(default_factory=dict)
    suspects: dict[str, _Suspect] = field(default_factory=dict)
    reported: dict[str, tuple[Key, ReportedRow]] = field(default_factory=dict)
    due_at: float = 0.0
    written: str = ""
    written_at: float = 0.0
    loaded: bool = False


@dataclass
class _Reads:
    upstream: dict[str, dict[str, Any]]
    downstream: dict[str, dict[str, Any]]
    chunk: list[Key] = field(default_factory=list)
    """A compare chunk: the keys read on either side, in key order of the source."""
    chunk_last: Key | None = None
    chunk_end: bool = False


class Validator:
    def __init__(self, js: JetStreamContext, options: ValidationOptions, *, worker_id: str = "",
                 rows_stream: str = ROWS_STREAM, replicas: int = 1) -> None:
        self.js = js
        self.options = options
        self.worker_id = worker_id
        self.rows_stream = rows_stream
        self.replicas = replicas
        self.checks: dict[Span, _SpanCheck] = {}
        self._kv: KeyValue | None = None

    # ------------------------------------------------------------------ from the rounds

    def note_batch(self, w: SpanWork, upto_ts: int) -> None:
        """The keys a written batch changed (events at or below ``upto_ts``) wait for a check."""
        if w.rt.config.validation == "off" or not sink_kind(w.rt.config.sink_url).holds_rows:
            return
        check = self._check(w.rt)
        try:
            self._note(check, w, upto_ts)
        except Exception as exc:  # validation never stops replication
            log.warning("validation could not note a batch's keys", exc_info=True,
                        extra={"span": w.rt.span.name})
            check.status.error = f"{type(exc).__name__}: {exc}"

    def _note(self, check: _SpanCheck, w: SpanWork, upto_ts: int) -> None:
        for e in w.fresh:
            if e.dead or e.ts > upto_ts or not isinstance(e.event, RowsChangedV2):
                continue
            ev = e.event
            table = self._table_from_batch(check, w, ev)
            if table is None:
                continue
            columns = {c.name: c for c in ev.meta.columns}
            for row in ev.rows:
                for image in (row.before, row.after):
                    if image is None or any(k.name not in image for k in table.key):
                        continue
                    values = tuple(decode_value(columns[k.name].kind, columns[k.name].sql_type,
                                                image[k.name]) for k in table.key)
                    text = key_text(table.key, values)
                    check.suspects.pop(text, None)  # changed since: its check starts over
                    if text in check.pending:
                        continue
                    if len(check.pending) >= self.options.max_pending:
                        check.status.skipped_total += 1
                        continue
                    check.pending[text] = values

    def _table_from_batch(self, check: _SpanCheck, w: SpanWork, ev: RowsChangedV2) -> _Table | None:
        if w.plan is None:
            return check.table
        current = check.table
        if (current is not None and current.source_meta == ev.meta and current.database == ev.database
                and current.table == ev.table and current.target == w.plan.table):
            return current
        check.table = _table(w.rt, ev.database, ev.table, ev.meta, w.plan.table, w.rules, w.origin)
        return check.table

    def _check(self, rt: SpanRuntime) -> _SpanCheck:
        check = self.checks.get(rt.span)
        if check is None:
            s = rt.span
            check = _SpanCheck(SpanValidation(changefeed=s.changefeed, span=s.name, source=s.source,
                                              database=s.database, table=s.table))
            self.checks[rt.span] = check
        return check

    # ------------------------------------------------------------------ between rounds

    async def run(self, pipeline: RunsSpans) -> None:
        """One validation cycle of every span that is due (called between rounds)."""
        spans = pipeline.spans
        for span in [s for s in self.checks if s not in spans]:
            del self.checks[span]  # moved away: the next owner reads its status back
            with contextlib.suppress(KeyError):
                m.VALIDATION_MISMATCHES.remove(span.changefeed, span.name)
        requests: dict[str, Any] = {}
        now = time.monotonic()
        for rt in list(spans.values()):
            check = self._check(rt)
            if now < check.due_at:
                continue
            check.due_at = now + self.options.interval_s
            try:
                kv = await self._bucket()
                if not check.loaded:
                    await self._load(kv, rt, check)
                if rt.span.changefeed not in requests:
                    requests[rt.span.changefeed] = await read_request(kv, rt.span.changefeed)
                check.status.error = None
                await self._cycle(rt, check, requests[rt.span.changefeed])
            except Exception as exc:
                log.warning("validation cycle failed", exc_info=True, extra={"span": rt.span.name})
                check.status.error = f"{type(exc).__name__}: {exc}"
                compare = check.status.compare
                if isinstance(exc, LookupError) and compare is not None and compare.state == "running":
                    # The table is gone upstream: nothing left to compare (anything else is retried).
                    compare.state, compare.error, compare.finished_at = "failed", str(exc), time.time()
            try:
                await self._publish(rt, check)
            except Exception:
                log.warning("could not record the validation status", exc_info=True,
                            extra={"span": rt.span.name})

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await bucket(self.js, self.replicas)
        return self._kv

    async def _load(self, kv: KeyValue, rt: SpanRuntime, check: _SpanCheck) -> None:
        """What the span's previous owner recorded: its reported rows and compare progress."""
        raw = await read_json(kv, rt.span.kv_key)
        check.loaded = True
        if raw is None:
            return
        old = SpanValidation.model_validate(raw)
        check.status.found_total, check.status.repaired_total = old.found_total, old.repaired_total
        check.status.rows_checked, check.status.skipped_total = old.rows_checked, old.skipped_total
        check.status.compare = old.compare
        for row in old.reported:
            check.reported[_row_text(row)] = ((), row)  # key values once the table is known

    async def _cycle(self, rt: SpanRuntime, check: _SpanCheck, request: Any) -> None:
        status = check.status
        status.mode = rt.config.validation
        status.worker = self.worker_id
        compare = status.compare
        if request is not None and (compare is None or compare.request_id != request.id):
            compare = status.compare = CompareProgress(request_id=request.id, started_at=time.time())
        comparing = compare is not None and compare.state == "running"
        busy = check.pending or check.suspects or check.reported
        if rt.config.validation == "off" and not comparing and not busy:
            return
        if rt.state is not SpanState.REPLICATING or rt.checkpoint is None:
            return  # copying, stopped or refused: its downstream is not at its checkpoint
        if not sink_kind(rt.config.sink_url).holds_rows:
            status.error = "a NATS sink holds no rows to compare"
            return
        checkpoint = rt.checkpoint.ts
        if check.table is None:
            check.table = await asyncio.to_thread(_table_from_source, rt)
        table = check.table
        self._bind_reported(check, table)
        mark = await latest_resolved(self.js, rt.span.source, self.rows_stream)
        for suspect in check.suspects.values():
            passed = mark is not None and (mark.ts >> LOGICAL_BITS) >= suspect.read_ms
            if suspect.mark_ts is None and passed and mark is not None:
                suspect.mark_ts = mark.ts
        due = {t: s for t, s in check.suspects.items() if s.mark_ts is not None and checkpoint >= s.mark_ts}
        fresh = dict(list(check.pending.items())[: self.options.batch_rows])
        for text in fresh:
            del check.pending[text]
        again = {t: k for t, (k, _) in list(check.reported.items())[: self.options.batch_rows] if k}
        keys = {**fresh, **{t: s.key for t, s in due.items()}, **again}
        chunk = compare if comparing else None
        if not keys and chunk is None:
            status.checkpoint_ts = checkpoint
            return
        reads = await asyncio.to_thread(_read, rt, table, list(keys.values()), chunk,
                                        self.options.compare_chunk_rows)
        # Taken after the upstream read: a mark at or after it covers every change the read saw.
        read_ms = int(time.time() * 1000)
        status.checked_at, status.checkpoint_ts = time.time(), checkpoint
        checked = 0
        for text, key in keys.items():
            checked += 1
            reported = check.reported.get(text)
            full = (reported[1].kind == "different" if reported is not None
                    else text in due and due[text].full)
            wrong = compare_row(table.full if full else table.plan, reads.upstream.get(text),
                                reads.downstream.get(text))
            if reported is not None:
                if wrong is None:
                    del check.reported[text]
                    status.repaired_total += 1
                continue
            if text in due:
                del check.suspects[text]
                if wrong is not None:
                    self._report(check, table, key, wrong.kind, wrong.columns)
                continue
            if wrong is not None:
                check.suspects[text] = _Suspect(key, read_ms)
        if chunk is not None:
            checked += self._compare_chunk(check, table, chunk, reads, read_ms)
        status.rows_checked += checked
        m.VALIDATION_ROWS_CHECKED.labels(rt.span.changefeed).inc(checked)

    def _compare_chunk(self, check: _SpanCheck, table: _Table, progress: CompareProgress, reads: _Reads,
                       read_ms: int) -> int:
        for key in reads.chunk:
            text = key_text(table.key, key)
            wrong = compare_row(table.full, reads.upstream.get(text), reads.downstream.get(text))
            if wrong is not None and text not in check.reported and text not in check.pending:
                check.suspects.setdefault(text, _Suspect(key, read_ms, full=True))
                progress.candidates += 1
        progress.rows_checked += len(reads.chunk)
        progress.chunks_done += 1
        if reads.chunk_last is not None:
            progress.after_key = encode_key(table.source_meta, [c.name for c in table.key])(reads.chunk_last)
        if reads.chunk_end:
            progress.state, progress.finished_at = "done", time.time()
        return len(reads.chunk)

    def _report(self, check: _SpanCheck, table: _Table, key: Key, kind: Any, columns: Sequence[str]) -> None:
        check.status.found_total += 1
        if len(check.reported) >= self.options.max_reported:
            return
        encoded = encode_key(table.source_meta, [c.name for c in table.key])(key)
        row = ReportedRow(key=dict(zip([c.name for c in table.key], encoded, strict=True)), kind=kind,
                          columns=list(columns), since=time.time())
        check.reported[key_text(table.key, key)] = (key, row)
        log.warning("validation: a downstream row differs from its source",
                    extra={"span": check.status.span, "key": row.key, "kind": kind, "columns": list(columns)})

    @staticmethod
    def _bind_reported(check: _SpanCheck, table: _Table) -> None:
        """Reported rows read back from the bucket get their key values (and key text) once the
        table's key columns are known."""
        for text, (key, row) in list(check.reported.items()):
            if key:
                continue
            del check.reported[text]
            try:
                values = decode_key(table.source_meta, [c.name for c in table.key])(
                    [row.key[c.name] for c in table.key])
            except (KeyError, ValueError, TypeError):
                continue  # the key changed shape since (DDL): nothing to re-check it by
            check.reported[key_text(table.key, values)] = (values, row)

    async def _publish(self, rt: SpanRuntime, check: _SpanCheck) -> None:
        status = check.status
        status.pending, status.rechecking = len(check.pending), len(check.suspects)
        status.reported = [row for _, row in check.reported.values()]
        status.mismatches = len(status.reported)
        if check.table is not None:
            status.target = f"{check.table.target.schema or ''}.{check.table.target.name}".lstrip(".")
        m.VALIDATION_MISMATCHES.labels(rt.span.changefeed, rt.span.name).set(status.mismatches)
        body = status.model_dump_json(exclude={"checked_at", "checkpoint_ts"})
        # Unchanged records are written again now and then only, so the api sees a live time.
        if body == check.written and time.monotonic() - check.written_at < 30:
            return
        kv = await self._bucket()
        await kv.put(rt.span.kv_key, status.model_dump_json().encode())
        check.written, check.written_at = body, time.monotonic()


def _row_text(row: ReportedRow) -> str:
    return "reported:" + repr(sorted(row.key.items()))


def _table(rt: SpanRuntime, database: str, table: str, meta: TableMetaV1, target: TargetTable,
           rules: TableRules | None, origin: tuple[str, str] | None) -> _Table:
    by_name = {c.name: c for c in meta.columns}
    key = tuple(by_name[k] for k in target.key if origin is None or k != origin[0])
    skip = (origin[0],) if origin is not None else ()
    return _Table(database=database, table=table, source_meta=meta, target=target, key=key, origin=origin,
                  plan=RowPlan.of(rt.config.validation, target.meta.columns, rules, skip),
                  full=RowPlan.of("full", target.meta.columns, rules, skip),
                  extras_by_range=origin is not None or rt.shards <= 1)


def _table_from_source(rt: SpanRuntime) -> _Table:
    """The span's table as the source shows it now (a span with no batch since this worker
    took it over, e.g. for a compare)."""
    conn = connect_source(rt.config.source_url)
    try:
        database, name = _real_names(conn, rt.span)
        info = load_table_info(conn, database, name)
    finally:
        conn.close()
    if info is None:
        raise LookupError(f"no table {database}.{name} on source {rt.span.source}")
    meta = info.meta()
    router: Router | None = rt.config.router
    target = target_for(rt.span, database, name, meta, rt.config.key_policy, router,
                        case_insensitive=rt.config.case_insensitive)
    rules = rules_for(router.table_rules, database, name) if router is not None else NO_RULES
    origin = None
    if router is not None:
        ref = shard_ref(rt.span, database, name)
        found = router.origin_for(ref)
        origin = (found.name, found.value(ref)) if found is not None else None
    return _table(rt, database, name, meta, target, rules, origin)


# --------------------------------------------------------------------------- reads (a thread)


def _key_condition(columns: Sequence[str], keys: Sequence[Key], ident: Any, ph: str,
                   params: list[Any]) -> str:
    if len(columns) == 1:
        params.extend(k[0] for k in keys)
        return f"{ident(columns[0])} IN ({', '.join([ph] * len(keys))})"
    ors = []
    for k in keys:
        ors.append("(" + " AND ".join(f"{ident(c)} = {ph}" for c in columns) + ")")
        params.extend(k)
    return "(" + " OR ".join(ors) + ")"


def _read(rt: SpanRuntime, table: _Table, keys: list[Key], compare: CompareProgress | None,
          chunk_rows: int) -> _Reads:
    """The rows of ``keys`` on both sides, plus a compare's next chunk: downstream first (it
    holds the rows at the checkpoint: this runs between the span's rounds), then upstream."""
    sink = open_sink(rt.config.sink_url)
    if not isinstance(sink, SqlSink):
        raise ValueError(f"validation reads SQL downstreams only, not {type(sink).__name__}")
    names = [c.name for c in table.key]
    after: Key | None = None
    if compare is not None and compare.after_key is not None:
        after = decode_key(table.source_meta, names)(compare.after_key)
    conn = connect_source(rt.config.source_url)
    try:
        chunk: list[Key] = []
        end = True
        if compare is not None:
            # The chunk's key range comes from the source; the downstream is read for it below.
            params: list[Any] = []
            where = f"WHERE {key_after(names, quote, after, params)}" if after is not None else ""
            cols = ", ".join(quote(n) for n in names)
            with conn.cursor() as cur:
                cur.execute(f"SELECT {cols} FROM {quote(table.database)}.{quote(table.table)} {where}"
                            f" ORDER BY {cols} LIMIT %s", [*params, chunk_rows])
                chunk = [tuple(r) for r in cur.fetchall()]
            end = len(chunk) < chunk_rows
            if after is None and not chunk:
                compare.rows_estimate = 0
            elif after is None:
                compare.rows_estimate = estimate_rows(conn, table.database, table.table)
        last = chunk[-1] if chunk else None
        extras = (_downstream_range(sink, table, after, None if end else last)
                  if compare is not None and table.extras_by_range else [])
        down_keys = [*keys, *chunk]
        downstream = _downstream_rows(sink, table, down_keys)
        unread = [k for k in extras if key_text(table.key, k) not in downstream]
        downstream.update(_downstream_rows(sink, table, unread))
        chunk_all = list(dict.fromkeys([*chunk, *extras]))
        upstream = _upstream_rows(conn, table, [*keys, *[k for k in extras if k not in chunk]])
        upstream.update(_upstream_rows(conn, table, chunk))
    finally:
        conn.close()
    return _Reads(upstream, downstream, chunk_all, last, end)


def _upstream_rows(conn: Any, table: _Table, keys: list[Key]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    names = [c.name for c in table.key]
    for start in range(0, len(keys), 500):
        part = keys[start: start + 500]
        params: list[Any] = []
        cond = _key_condition(names, part, quote, "%s", params)
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(f"SELECT * FROM {quote(table.database)}.{quote(table.table)} WHERE {cond}", params)
            for row in cur.fetchall():
                out[key_text(table.key, [row[n] for n in names])] = dict(row)
    return out


def _target_params(sink: SqlSink, table: _Table) -> tuple[Any, str, list[str], list[ColumnV1]]:
    ident = sink.ident if sink.placeholder == "?" else sink.pident
    target = table.target
    names = [c.name for c in table.key]
    return ident, sink.placeholder, names, list(target.meta.columns)


def _downstream_rows(sink: SqlSink, table: _Table, keys: list[Key]) -> dict[str, dict[str, Any]]:
    ident, ph, names, columns = _target_params(sink, table)
    by_name = {c.name: c for c in columns}
    out: dict[str, dict[str, Any]] = {}
    step = max(1, min(500, sink.max_params // max(1, len(names) + 1)))
    for start in range(0, len(keys), step):
        part = [tuple(sink._adapt(by_name.get(n), v) for n, v in zip(names, k, strict=True))
                for k in keys[start: start + step]]
        params: list[Any] = []
        cond = _key_condition(names, part, ident, ph, params)
        if table.origin is not None:
            cond += f" AND {ident(table.origin[0])} = {ph}"
            params.append(table.origin[1])
        sql = (f"SELECT {', '.join(ident(c.name) for c in columns)} FROM "
               f"{sink._table_ref(table.target, for_params=ph != '?')} WHERE {cond}")

        def work(cur: Any, sql: str = sql, params: list[Any] = params) -> list[Any]:
            cur.execute(sql, params)
            return list(cur.fetchall())

        for raw in _missing_table_is_empty(sink, work):
            row = {c.name: normalize_fetched(c, v, sink.dialect) for c, v in zip(columns, raw, strict=True)}
            out[key_text(table.key, [row[n] for n in names])] = row
    return out


def _downstream_range(sink: SqlSink, table: _Table, after: Key | None, upto: Key | None) -> list[Key]:
    """The downstream keys of the span in ``(after, upto]`` (``upto`` None: to the end)."""
    ident, ph, names, columns = _target_params(sink, table)
    by_name = {c.name: c for c in columns}
    params: list[Any] = []
    parts = []
    if after is not None:
        parts.append(key_after(names, ident, tuple(sink._adapt(by_name.get(n), v)
                                                   for n, v in zip(names, after, strict=True)), params))
    if upto is not None:
        bound = tuple(sink._adapt(by_name.get(n), v) for n, v in zip(names, upto, strict=True))
        parts.append("NOT " + key_after(names, ident, bound, params))
    if table.origin is not None:
        parts.append(f"{ident(table.origin[0])} = %s")
        params.append(table.origin[1])
    where = (" WHERE " + " AND ".join(parts)) if parts else ""
    if ph != "%s":
        where = where.replace("%s", ph)
    ref = sink._table_ref(table.target, for_params=ph != "?")
    sql = f"SELECT {', '.join(ident(n) for n in names)} FROM {ref}{where}"

    def work(cur: Any) -> list[Any]:
        cur.execute(sql, params)
        return list(cur.fetchall())

    return [tuple(normalize_fetched(by_name[n], v, sink.dialect) for n, v in zip(names, raw, strict=True))
            for raw in _missing_table_is_empty(sink, work)]


def _missing_table_is_empty(sink: SqlSink, work: Any) -> list[Any]:
    """A target not created yet holds no rows (its first batch creates it)."""
    try:
        return sink._run(work, "validation read", retryable=lambda exc: False)
    except Exception as exc:
        text = str(exc).lower()
        if "no such table" in text or "doesn't exist" in text or "does not exist" in text:
            return []
        raise
