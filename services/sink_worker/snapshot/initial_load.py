"""Initial load of a span: copy the table's rows, then hand the span to streaming.

The consistent start point is a pair of watermarks over the ROWS stream (see DESIGN.md):

1. low watermark: the source's newest resolved mark (ts and stream sequence) read *before* the
   first chunk. Every transaction in the stream before it committed before the copy began.
2. copy: the table in primary-key chunks (``snapshot_job``, Spark), each chunk one short read
   with no lock held across chunks; finished chunks are recorded in the progress record as
   each copy job (a few chunks) ends.
3. high watermark: the newest resolved mark once the last chunk is read (waiting, bounded,
   for a mark newer than the end of the copy).
4. the span's checkpoint is created at the low watermark and the span streams from there:
   every change after it is replayed over the copy with full row images, which converges
   (idempotent replay), and once the checkpoint passes the high watermark the target equals
   the source at that point. Until then a row may briefly show an older image than the copy
   wrote (the copy is fresher than the replay that catches up to it).

Progress lives in the ``sluice-snapshots`` bucket (``SnapshotProgress`` JSON, key: the span's
``kv_key``), written with compare-and-set on the revision this runner last wrote: a runner
that lost the span (moved elsewhere) fails its next write and stops. A run that dies (crash,
``kill -9``, the span stopped or moved) leaves the plan, the low watermark and the finished
chunks behind; the next run, on any worker, copies only the chunks that are not done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pyspark.sql import SparkSession

from contracts.events.rows import TableMetaV1
from libs.codec.enum_members import resolve_members, suspect_columns
from libs.codec.table_meta import load_table_info
from libs.concurrency import cancel_and_wait
from libs.config import Settings
from libs.routing import Router
from libs.scheduling.model import Span
from libs.sql_ident import quote_ident
from libs.streams import ROWS_STREAM, SNAPSHOT_BUCKET, token
from libs.table_rules import TableRulesError, rules_for
from libs.target_fit import fit_problems
from libs.ts import LOGICAL_BITS
from services.sink_worker import metrics as m
from services.sink_worker.round.pull import ResolvedMark, latest_resolved
from services.sink_worker.sinks.base import Sink, TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.sinks.write_fence import WriteFences
from services.sink_worker.snapshot.job import (
    CopyJob,
    CopyPool,
    chunks_per_job,
    connect_source,
    copy_chunk,
    count_upto,
    decode_key,
    encode_key,
    estimate_rows,
    plan_chunks,
    split_open_chunk,
)
from services.sink_worker.snapshot.plan import Chunk, SnapshotProgress
from services.sink_worker.span.checkpoints import Checkpoint
from services.sink_worker.span.target import KeylessTableError, route_of, shard_ref, target_for

log = logging.getLogger(__name__)


class UncopyableTable(ValueError):
    """The table cannot be copied as the changefeed says (a column type capture does not carry,
    computed columns, an existing target that cannot hold the rows): no retry fixes it."""


def empty_for_recopy(req: SnapshotRequest, sink: Sink, target: TargetTable) -> None:
    """Empty the target before a re-copy's first chunk.

    A target Sluice created is dropped (``ensure_table`` makes it again from the source's
    metadata, exactly as the source now is). A target that existed before the changefeed (an
    operator's: partitioned, extra columns, wider types) and, under ``schema_change_policy =
    lenient``, any target, is kept and emptied instead: the columns the DDL dropped go (lenient:
    they stay, nullable), missing ones are added, a column that cannot hold the source's new
    type takes the sink's type for it, and the rest stays as it is. The columns the source does
    not have keep their values (a side table holds them until the copy is done: ``DdlBarrier``
    restores them). If the kept target still cannot hold the rows (a key changed), an
    operator's target stops the span naming the column or key; a lenient Sluice-made one is
    dropped and made again, losing the columns lenient kept."""
    if not isinstance(sink, SqlSink):
        sink.drop_table(target)
        return
    found = sink.definition(target)
    if found is None:
        return
    made = sink.made_by_sluice(target)
    if made and not req.keep_target:
        sink.drop_table(target)
        return
    target = replace(target, keep_columns=req.keep_target)
    want = {c.name.casefold() for c in target.meta.columns}
    drops = set() if req.keep_target else {c.casefold() for c in req.recopy_drops}
    names = [c.name for c in found.columns]
    have = {n.casefold(): n for n in names}
    keep = [n for n in names if n.casefold() not in want and n.casefold() not in drops]
    if keep and all(k.casefold() in have for k in target.key):
        sink.save_columns(target, [have[k.casefold()] for k in target.key], keep)
    sink.truncate_table(target)
    sink.reconcile_schema(target, req.recopy_drops)
    now = sink.definition(target)
    if now is not None:
        sink.widen_in_place(target, {c.name: c.sql_type for c in now.columns})
        now = sink.definition(target)
    problems = fit_problems(target.meta, target.key, now, sink.dialect) if now is not None else []
    if not problems:
        log.info("re-copy keeps the existing target", extra={
            "span": req.span.name, "target": target.name, "kept_columns": keep, "made_by_sluice": made})
        return
    if made:
        log.warning("re-copy: the kept target cannot hold the rows after the DDL; made again, "
                    "without the columns lenient kept", extra={"span": req.span.name, "problems": problems})
        sink.restore_columns(target)  # drops the side table: nothing to put back into a new table
        sink.drop_table(target)
        return
    raise UncopyableTable(f"the existing target {target.name!r} cannot hold the table's rows after the "
                          f"DDL: {'; '.join(problems)}; change the target (or drop it to have Sluice "
                          "create it) and resume")


UNREPLICABLE = (KeylessTableError, TableRulesError, UncopyableTable)
"""A copy that failed with one of these stops its span with an incident instead of being tried
again every ``retry_s``: the table cannot be replicated until the operator fixes it."""



@dataclass(frozen=True)
class SnapshotOptions:
    chunk_rows: int = 50_000
    parallelism: int = 4
    write_rows: int = 5000
    job_rows: int = 1_000_000
    """At most this many rows' worth of chunks in one copy job (see ``chunks_per_job``)."""
    inline_rows: int = 0
    """A table planned as one chunk and holding at most this many rows is copied on a thread of
    the worker (``copy_chunk`` as a Spark task runs it) instead of by a Spark job. 0: never (the
    default: a stop waits for such a copy to end, where a Spark job is interrupted)."""
    watermark_timeout_s: float = 60.0
    retry_s: float = 10.0

    @classmethod
    def from_settings(cls, settings: Settings) -> SnapshotOptions:
        return cls(chunk_rows=settings.snapshot_chunk_rows, parallelism=settings.snapshot_parallelism,
                   write_rows=settings.snapshot_write_rows, inline_rows=settings.snapshot_inline_rows,
                   watermark_timeout_s=settings.snapshot_watermark_timeout_s,
                   retry_s=settings.snapshot_retry_s)


class SnapshotMoved(RuntimeError):
    """The progress record changed under this runner: another worker runs the snapshot now."""


class SnapshotStore:
    def __init__(self, js: JetStreamContext, bucket: str = SNAPSHOT_BUCKET, replicas: int = 1) -> None:
        self.js = js
        self.bucket = bucket
        self.replicas = replicas
        self._kv: KeyValue | None = None

    async def open(self) -> SnapshotStore:
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(self.bucket)
            except BucketNotFoundError:
                self._kv = await self.js.create_key_value(bucket=self.bucket, history=1,
                                                          replicas=self.replicas,
                                                          description="Sluice initial-load progress")
        return self

    async def get(self, span: Span, key: str | None = None) -> tuple[SnapshotProgress | None, int]:
        """The span's progress (under ``key``, default the span's own) and its revision (0: none)."""
        await self.open()
        assert self._kv is not None
        try:
            entry = await self._kv.get(key or span.kv_key)
        except KeyDeletedError as exc:
            return None, int(exc.entry.revision or 0) if exc.entry is not None else 0
        except KeyNotFoundError:
            return None, 0
        if not entry.value:
            return None, int(entry.revision or 0)
        return SnapshotProgress.from_json(entry.value), int(entry.revision or 0)

    async def put(self, span: Span, progress: SnapshotProgress, revision: int, key: str | None = None) -> int:
        """Write over ``revision`` (0: create); ``SnapshotMoved`` when somebody else wrote."""
        await self.open()
        assert self._kv is not None
        key = key or span.kv_key
        try:
            if revision == 0:
                return int(await self._kv.create(key, progress.to_json()))
            return int(await self._kv.update(key, progress.to_json(), last=revision))
        except KeyWrongLastSequenceError as exc:
            raise SnapshotMoved(f"snapshot progress of {span.name} was written by another worker") from exc
        except Exception as exc:
            # create() of a key that exists is also "somebody else was first".
            if "wrong last sequence" in str(exc).lower():
                raise SnapshotMoved(f"snapshot progress of {span.name} exists already") from exc
            raise

    async def delete(self, span: Span, key: str | None = None) -> None:
        await self.open()
        assert self._kv is not None
        with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
            await self._kv.delete(key or span.kv_key)


@dataclass(frozen=True)
class SnapshotRequest:
    """What the runner needs to know about a span (from its changefeed)."""

    span: Span
    source_url: str
    sink_url: str
    key_policy: Any
    mode: Literal["snapshot", "snapshot-only"]
    shards: int = 1
    router: Router | None = None
    """The changefeed's routes: the copy lands in the same target (and origin column) as the stream."""
    recopy_of: int | None = None
    """A re-copy after a DDL (``ddl_plan``): the DDL's stream sequence. The progress is kept
    under its own key (the span's first load keeps its record), the target is emptied before
    the first chunk, and a table the source no longer has leaves no target."""
    case_insensitive: bool = False
    """The changefeed's ``text_comparison`` is ``case_insensitive`` (``span.target_for``)."""
    recopy_drops: tuple[str, ...] = ()
    """A re-copy: the columns its DDL drops or renames away and the source's columns right after
    it (an existing target kept as it is loses only those the source no longer has, so a column
    a later DDL dropped, which the copy jumps over, goes too: ``empty_for_recopy``)."""
    keep_target: bool = False
    """A re-copy under ``schema_change_policy = lenient``: the target is kept, with the columns
    the source no longer has and their values."""

    @property
    def progress_key(self) -> str:
        return self.span.kv_key if self.recopy_of is None else f"{self.span.kv_key}.recopy.{self.recopy_of}"


Decision = Literal["copying", "stream", "done", "unreplicable"]


class InitialLoads:
    """Runs the initial loads of one worker's spans, one background task per copying span."""

    def __init__(self, js: JetStreamContext, spark: Callable[[], SparkSession],
                 options: SnapshotOptions | None = None, *, rows_stream: str = ROWS_STREAM,
                 bucket: str = SNAPSHOT_BUCKET, worker_id: str = "", replicas: int = 1,
                 fences: WriteFences | None = None) -> None:
        self.js = js
        self.fences = fences if fences is not None else WriteFences(worker_id)
        """The worker's write tokens (``write_fence``), shared with its stream rounds."""
        self._spark = spark
        self.options = options or SnapshotOptions()
        self.rows_stream = rows_stream
        self.store = SnapshotStore(js, bucket, replicas)
        self.worker_id = worker_id
        self._tasks: dict[Span, asyncio.Task[None]] = {}
        self._failed_at: dict[Span, float] = {}
        self.unreplicable: dict[Span, str] = {}
        """Why a span's copy failed for good (``UNREPLICABLE``), with its ``unreplicable`` decision."""
        self.progress: dict[Span, SnapshotProgress] = {}
        """The latest progress this worker knows of each span it loads (status, metrics)."""
        # Small tables' copies (``SnapshotOptions.inline_rows``), shared by every span, one at a
        # time: a copy is mostly Python (connections, statements) and competes with the event
        # loop for the GIL; with four at once the loop of a worker starting 3,000 spans fell
        # behind its heartbeats for longer than the self-fence allows.
        self._inline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-inline")

    async def decide(self, req: SnapshotRequest) -> tuple[Decision, Checkpoint | None]:
        """Where the span stands: still copying (a copy runs or was just started), ready to
        stream from the low watermark, or done (snapshot-only: nothing to stream)."""
        progress, _ = await self.store.get(req.span, req.progress_key)
        if progress is not None:
            self.progress[req.span] = progress
        if progress is not None and progress.state == "done":
            assert progress.low_watermark_seq is not None and progress.low_watermark_ts is not None
            start = Checkpoint(progress.low_watermark_seq, progress.low_watermark_ts)
            self._observe(req.span, progress)
            return ("done" if req.mode == "snapshot-only" else "stream"), start
        task = self._tasks.get(req.span)
        if task is not None and not task.done():
            return "copying", None
        if task is not None:
            self._tasks.pop(req.span)
            # A copy that ended well was another one's (a span re-copies after some DDLs); one
            # that failed is already logged and recorded, and waits before it runs again.
            if task.cancelled() or task.exception() is not None:
                self._failed_at[req.span] = time.monotonic()
            if not task.cancelled() and isinstance(task.exception(), UNREPLICABLE):
                self.unreplicable[req.span] = str(task.exception())
                return "unreplicable", None
        failed = self._failed_at.get(req.span)
        if failed is None or time.monotonic() - failed >= self.options.retry_s:
            self._failed_at.pop(req.span, None)
            self._tasks[req.span] = asyncio.create_task(self._run(req), name=f"snapshot {req.span.name}")
        return "copying", None

    def copying(self, span: Span) -> bool:
        task = self._tasks.get(span)
        return task is not None and not task.done()

    async def stop(self, span: Span) -> None:
        """Stop the span's copy (its running chunk jobs are interrupted and awaited); its
        finished chunks stay recorded for whoever runs the span next."""
        self._failed_at.pop(span, None)
        self.unreplicable.pop(span, None)
        self.progress.pop(span, None)
        task = self._tasks.pop(span, None)
        if task is None:
            return
        await cancel_and_wait(task)
        for gauge in (m.SNAPSHOT_ROWS_ESTIMATE, m.SNAPSHOT_ROWS_COPIED, m.SNAPSHOT_CHUNKS_DONE,
                      m.SNAPSHOT_ROWS_PER_S, m.SNAPSHOT_ETA_S):
            with contextlib.suppress(KeyError):
                gauge.remove(span.changefeed, span.name)

    async def close(self) -> None:
        for span in list(self._tasks):
            await self.stop(span)
        self._inline.shutdown(wait=False, cancel_futures=True)

    def status(self, span: Span) -> dict[str, Any] | None:
        p = self.progress.get(span)
        if p is None:
            return None
        return {"state": p.state, "rows_copied": p.rows_copied, "rows_estimate": p.rows_estimate,
                "chunks_done": p.chunks_done, "chunks_total": p.chunks_total,
                "rows_per_s": round(p.rows_per_s, 1), "eta_s": None if p.eta_s is None else round(p.eta_s, 1),
                "low_watermark_ts": p.low_watermark_ts, "high_watermark_ts": p.high_watermark_ts,
                "error": p.error}

    # ------------------------------------------------------------------ the copy

    async def _run(self, req: SnapshotRequest) -> None:
        span = req.span
        progress, revision = await self.store.get(span, req.progress_key)
        if progress is None:
            progress = SnapshotProgress(changefeed=span.changefeed, source=span.source,
                                        database=span.database, table=span.table, mode=req.mode)
        progress.runs += 1
        progress.worker = self.worker_id
        progress.error = None
        progress.finished_at = None
        progress.resumed_chunks = len(progress.done)
        progress.started_at = progress.started_at or time.time()
        self.progress[span] = progress
        run_started_at, rows_at_run_start = time.time(), progress.rows_copied
        try:
            if progress.low_watermark_seq is None:
                progress.state = "pending"
                revision = await self.store.put(span, progress, revision, req.progress_key)
                mark, revision = await self._wait_mark(req, progress, revision, after_ms=0)
                progress.low_watermark_ts, progress.low_watermark_seq = mark.ts, mark.stream_seq
            progress.state = "copying"
            job, chunks, small = await asyncio.to_thread(self._prepare, req, progress)
            revision = await self.store.put(span, progress, revision, req.progress_key)
            self._observe(span, progress)
            if progress.resumed_chunks:
                log.info("snapshot resumes", extra={"span": span.name, "chunks_done": progress.chunks_done,
                                                    "chunks_total": progress.chunks_total})
            if job is not None and small and len(chunks) == 1:
                revision = await self._copy_inline(req, job, progress, chunks[0], revision,
                                                   run_started_at, rows_at_run_start)
            elif job is not None and chunks:
                revision = await self._copy(req, job, progress, chunks, revision,
                                            run_started_at, rows_at_run_start)
            mark, revision = await self._wait_mark(req, progress, revision,
                                                   after_ms=int(time.time() * 1000))
            progress.high_watermark_ts, progress.high_watermark_seq = mark.ts, mark.stream_seq
            progress.state, progress.finished_at = "done", time.time()
            progress.measure(run_started_at, rows_at_run_start, progress.finished_at)
            await self.store.put(span, progress, revision, req.progress_key)
            self._observe(span, progress)
            log.info("snapshot done", extra={"span": span.name, "rows": progress.rows_copied,
                                             "chunks": progress.chunks_total,
                                             "resumed_chunks": progress.resumed_chunks,
                                             "low_watermark_ts": progress.low_watermark_ts,
                                             "high_watermark_ts": progress.high_watermark_ts})
        except asyncio.CancelledError:
            raise
        except SnapshotMoved:
            log.warning("snapshot taken over by another worker; stopping here", extra={"span": span.name})
            raise
        except Exception as exc:
            m.SNAPSHOT_FAILURES.labels(span.changefeed).inc()
            if not isinstance(exc, UNREPLICABLE):  # those are logged once, as the span's incident
                log.exception("snapshot failed", extra={"span": span.name})
            progress.state, progress.error = "failed", f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await self.store.put(span, progress, revision, req.progress_key)
            raise

    def _prepare(self, req: SnapshotRequest,
                 progress: SnapshotProgress) -> tuple[CopyJob | None, list[Chunk], bool]:
        """Blocking (a thread): the table's metadata, the plan (first run only), the target,
        and whether the table is small enough to copy without Spark (``inline_rows``).
        (None, [], False) for a re-copy of a table the source no longer has: its target is
        dropped."""
        span = req.span
        conn = connect_source(req.source_url)
        try:
            try:
                database, table = _real_names(conn, span)
            except LookupError:
                if req.recopy_of is None:
                    raise
                database, table = span.database, span.table
            info = load_table_info(conn, database, table)
            if info is None and req.recopy_of is not None:
                # Gone since the DDL (e.g. gh-ost drops ``_t_del`` after its cut-over): at the low
                # watermark the name holds nothing, so neither does its target.
                routed = route_of(span, database, table, req.router)
                open_sink(req.sink_url).drop_table(TargetTable(
                    schema=routed.schema, name=routed.table, meta=TableMetaV1(columns=[], primary_key=[]),
                    key=()))
                log.info("re-copy: the table is gone upstream; its target is dropped",
                         extra={"span": span.name})
                return None, [], False
            if info is None:
                raise LookupError(f"table {database}.{table} does not exist on source {span.source}")
            if suspect_columns(info):
                info = resolve_members(info, partial(_present_values, conn, database, table))
            unsupported = info.unsupported()
            if unsupported:
                raise UncopyableTable(f"columns of types capture does not carry: "
                                      f"{[c.name for c in unsupported]}")
            meta = info.meta()
            target = target_for(span, database, table, meta, req.key_policy, req.router,
                                case_insensitive=req.case_insensitive)
            computed = _computed_columns(req.router, database, table)
            if computed:
                # A copy reads rows with SQL on the source: no Spark SQL runs on them, so the
                # computed values would be missing. Stopped here rather than written without.
                raise UncopyableTable(
                    f"table {database}.{table} has computed columns ({', '.join(computed)}) and "
                    "must be copied: copies do not compute them; use initial_load binlog-only "
                    "and avoid DDL that re-copies the table, or drop the computed columns")
            ref = shard_ref(span, database, table)
            found = req.router.origin_for(ref) if req.router is not None else None
            origin = (found.name, found.value(ref)) if found is not None else None
            chunk_key = tuple(meta.primary_key)
            # A re-copy taken up again by a new run (its worker died, or the span moved) starts
            # over: the source may have changed shape since its chunks were copied (a later DDL
            # on the table), while the target kept the shape of those chunks, so resuming would
            # put today's values into yesterday's columns. Re-planned, the target is emptied and
            # made again from the current metadata below.
            restart = req.recopy_of is not None and bool(progress.done)
            if restart or not progress.planned or progress.key != list(chunk_key):
                progress.rows_estimate = estimate_rows(conn, database, table)
                chunks = plan_chunks(conn, database, table, chunk_key, meta, self.options.chunk_rows,
                                     progress.rows_estimate)
                progress.set_plan(chunk_key, chunks, encode_key(meta, chunk_key))
                progress.rows_copied = 0
            inline = self.options.inline_rows
            small = (inline > 0 and progress.chunks_total == 1
                     and count_upto(conn, database, table, inline) <= inline)
        finally:
            conn.close()
        sink = open_sink(req.sink_url)
        if req.recopy_of is not None and not progress.done:
            # Nothing copied yet: empty the target, so no row of the name's former table (or of
            # its former shape) survives. Once a chunk is done, the target holds the copy.
            empty_for_recopy(req, sink, target)
        sink.ensure_table(target)
        if req.shards == 1:
            # As the stream does for a single-shard target: columns follow the source's metadata.
            sink.reconcile_schema(target)
        # The copy's tasks write only while this worker holds the span's token.
        target = replace(target, fence=self.fences.take(sink, req.sink_url, target.schema, [req.span.kv_key]))
        job = CopyJob(source_url=req.source_url, database=database, table=table, chunk_key=chunk_key,
                      target=target, sink_url=req.sink_url, write_rows=self.options.write_rows,
                      origin=origin)
        return job, progress.pending(decode_key(meta, chunk_key)), small

    async def _bound_open_chunk(self, req: SnapshotRequest, job: CopyJob, progress: SnapshotProgress,
                                pending: list[Chunk], revision: int) -> tuple[list[Chunk], int]:
        """Cut the plan's open-ended last chunk when the copy nears it (it is among the next
        ``parallelism`` chunks to start; as often as that leaves room), so that no chunk holds
        more than ``chunk_rows`` rows whatever was inserted since the plan was made. The cut
        plan is recorded before any of it is copied: a resumed run copies the same chunks."""
        cut = False
        while (pending and pending[-1].upper is None and len(pending) <= self.options.parallelism):
            tail = pending[-1]
            boundary = await asyncio.to_thread(split_open_chunk, job, tail, self.options.chunk_rows)
            if boundary is None:
                break
            encode = encode_key(job.target.meta, job.chunk_key)
            progress.chunks[tail.id][1] = encode(boundary)
            progress.chunks.append([encode(boundary), None])
            progress.chunks_total = len(progress.chunks)
            pending = [*pending[:-1], Chunk(tail.id, tail.lower, boundary),
                       Chunk(len(progress.chunks) - 1, boundary, None)]
            cut = True
        if cut:
            revision = await self.store.put(req.span, progress, revision, req.progress_key)
            self._observe(req.span, progress)
        return pending, revision

    async def _copy(self, req: SnapshotRequest, job: CopyJob, progress: SnapshotProgress,
                    pending: list[Chunk], revision: int, run_started_at: float,
                    rows_at_run_start: int) -> int:
        """Copy ``pending`` through a ``CopyPool``: ``parallelism`` Spark jobs in flight, each
        copying ``chunks_per_job`` chunks, the next started as soon as one ends, each job's
        chunks recorded as it ends. On any failure or cancellation the pool's jobs are
        interrupted and their end awaited (bounded), so nothing of this worker writes once
        ``stop`` returns."""
        span = req.span
        pool = CopyPool(self._spark, job, self.options.parallelism)
        running: dict[asyncio.Future[dict[int, int]], list[Chunk]] = {}
        try:
            while pending or running:
                while pending and len(running) < self.options.parallelism:
                    pending, revision = await self._bound_open_chunk(req, job, progress, pending, revision)
                    take = chunks_per_job(len(pending), self.options.parallelism, self.options.chunk_rows,
                                          self.options.job_rows)
                    group, pending = pending[:take], pending[take:]
                    running[asyncio.wrap_future(pool.submit(group))] = group
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for future in finished:
                    del running[future]
                    for chunk_id, rows in future.result().items():
                        progress.finish_chunk(chunk_id, rows)
                        m.SNAPSHOT_ROWS.labels(span.changefeed).inc(rows)
                progress.measure(run_started_at, rows_at_run_start, time.time())
                revision = await self.store.put(span, progress, revision, req.progress_key)
                self._observe(span, progress)
            return revision
        except BaseException:
            pool.cancel()
            if running:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 60.0)
            raise
        finally:
            pool.close()

    async def _copy_inline(self, req: SnapshotRequest, job: CopyJob, progress: SnapshotProgress,
                           chunk: Chunk, revision: int, run_started_at: float,
                           rows_at_run_start: int) -> int:
        """Copy a small table's one chunk on a thread of this process: the same ``copy_chunk``
        a Spark task runs, without the job's fixed cost (scheduling, a Python worker's task),
        which is most of a small table's copy and capped a changefeed of thousands of small
        tables at the pace of Spark's task slots. The write fence guards it as it does a task."""
        future = asyncio.wrap_future(self._inline.submit(copy_chunk, job, chunk))
        try:
            rows = await asyncio.shield(future)
        except asyncio.CancelledError:
            # ``stop`` promises nothing of this copy writes once it returns: a small table's
            # copy ends soon, so it is waited for (bounded, as the Spark jobs' end is).
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(future, 60.0)
            raise
        progress.finish_chunk(chunk.id, rows)
        m.SNAPSHOT_ROWS.labels(req.span.changefeed).inc(rows)
        progress.measure(run_started_at, rows_at_run_start, time.time())
        revision = await self.store.put(req.span, progress, revision, req.progress_key)
        self._observe(req.span, progress)
        return revision

    async def _wait_mark(self, req: SnapshotRequest, progress: SnapshotProgress, revision: int, *,
                         after_ms: int) -> tuple[ResolvedMark, int]:
        """The source's newest resolved mark, once there is one whose physical time is at or
        after ``after_ms``. Capture must be running for the source; without a mark within the
        deadline the snapshot fails with a clear error (and is tried again later). For the
        high watermark, the newest mark is taken when none that new arrives in time."""
        deadline = time.monotonic() + self.options.watermark_timeout_s
        newest: ResolvedMark | None = None
        while True:
            newest = await latest_resolved(self.js, req.span.source, self.rows_stream) or newest
            if newest is not None and progress.error is not None and progress.error.startswith("waiting"):
                progress.error = None
            if newest is not None and (newest.ts >> LOGICAL_BITS) >= after_ms:
                return newest, revision
            if time.monotonic() >= deadline:
                if newest is not None and after_ms:
                    return newest, revision
                raise TimeoutError(f"no resolved mark of source {req.span.source!r} in the stream after "
                                   f"{self.options.watermark_timeout_s:.0f}s: is capture running for it?")
            if newest is None and progress.error is None:
                progress.error = (f"waiting for the first resolved mark of source {req.span.source!r} "
                                  "(capture must be running for it)")
                revision = await self.store.put(req.span, progress, revision, req.progress_key)
                self.progress[req.span] = progress
            await asyncio.sleep(0.2)

    def _observe(self, span: Span, p: SnapshotProgress) -> None:
        self.progress[span] = p
        m.SNAPSHOT_ROWS_ESTIMATE.labels(span.changefeed, span.name).set(p.rows_estimate)
        m.SNAPSHOT_ROWS_COPIED.labels(span.changefeed, span.name).set(p.rows_copied)
        m.SNAPSHOT_CHUNKS_DONE.labels(span.changefeed, span.name).set(p.chunks_done)
        m.SNAPSHOT_ROWS_PER_S.labels(span.changefeed, span.name).set(p.rows_per_s)
        # -1: no speed measured yet, so no estimate (a gauge has no "unknown").
        m.SNAPSHOT_ETA_S.labels(span.changefeed, span.name).set(-1 if p.eta_s is None else p.eta_s)


def _real_names(conn: Any, span: Span) -> tuple[str, str]:
    """The source's database and table names behind the span's subject tokens.

    The tokens are the names themselves unless a name has characters a subject cannot hold, so
    the exact names are asked for first: with thousands of tables, listing every one for each
    span's copy made a changefeed's start quadratic in its tables."""
    with conn.cursor() as cur:
        cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES"
                    " WHERE TABLE_TYPE = 'BASE TABLE' AND TABLE_SCHEMA = %s AND TABLE_NAME = %s",
                    (span.database, span.table))
        exact = [(str(d), str(t)) for d, t in cur.fetchall()
                 if (str(d), str(t)) == (span.database, span.table)]
        if exact:
            return exact[0]
        cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES"
                    " WHERE TABLE_TYPE = 'BASE TABLE'")
        found = [(str(d), str(t)) for d, t in cur.fetchall()
                 if token(str(d)) == span.database and token(str(t)) == span.table]
    if not found:
        raise LookupError(f"no table {span.database}.{span.table} on source {span.source}")
    exact = [(d, t) for d, t in found if (d, t) == (span.database, span.table)]
    if exact:
        return exact[0]
    if len(found) > 1:
        raise LookupError(f"several tables match {span.database}.{span.table}: {found}")
    return found[0]


def _present_values(conn: Any, database: str, table: str, column: str) -> list[tuple[int, str]]:
    """Each distinct value of an ENUM/SET column with its number (``libs.codec.enum_members``)."""
    col = quote_ident("mysql", column)
    with conn.cursor() as cur:
        cur.execute(f"SELECT DISTINCT {col} + 0, {col} FROM {quote_ident('mysql', database)}."
                    f"{quote_ident('mysql', table)} WHERE {col} IS NOT NULL")
        return [(int(n), str(v)) for n, v in cur.fetchall()]


def _computed_columns(router: Router | None, database: str, table: str) -> list[str]:
    if router is None or not router.table_rules:
        return []
    return [c.name for c in rules_for(router.table_rules, database, table).computed]


def snapshot_mode(initial_load: str) -> Literal["snapshot", "snapshot-only"] | None:
    if initial_load == "snapshot":
        return "snapshot"
    if initial_load == "snapshot-only":
        return "snapshot-only"
    return None

