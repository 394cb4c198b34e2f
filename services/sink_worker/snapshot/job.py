"""The bulk copy of an initial load (Spark): read a table in primary-key chunks, in parallel,
and write the rows through the sink's idempotent upsert.

- Planning (driver, ``plan_chunks``): an integer key spread evenly over its range is split by
  its min/max (at most twice ``chunk_rows`` a chunk: the range is at most twice the rows); any
  other key (composite, strings, sparse integers) by walking the key index, one ``ORDER BY
  key LIMIT 1 OFFSET chunk_rows-1`` per boundary, which makes every chunk exactly
  ``chunk_rows`` rows (at planning time) whatever the key distribution. The last chunk is open
  above (rows inserted during the copy land there): the runner cuts it by the same walk when
  the copy reaches it (``split_open_chunk``), so no chunk grows unbounded. A table without a
  usable key is one chunk.
- Copy (executors, ``copy_partition``; ``copy_arrow`` under ``mapInArrow`` over Spark Connect):
  Spark jobs of one task that copies a few chunks in turn, ``parallelism`` of them in flight
  (``CopyPool``). It reads the chunk with one
  unbuffered query through mysqlclient's C layer (``source_read``: rows stream from the server,
  memory holds a few write batches, not the chunk or the table) and writes each batch through
  the sink's bulk path (LOAD DATA LOCAL ... REPLACE; COPY straight into the target, or into a
  staging table then INSERT ... ON CONFLICT; executemany of INSERT OR REPLACE): the source's
  bytes undecoded where the sink reads them so (``Sink.load_source_bytes``), otherwise values
  decoded as the stream's apply job does (``Sink.load_rows``). Either way with the stream's
  semantics: rows holding a unique value under another key go, the row is inserted or replaced
  by key. No lock is held on the source beyond that query's own consistent read.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from pyspark.sql import SparkSession

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.codec.decode import decode_value
from libs.codec.encode import encode_value
from libs.dburl import parse_database_url
from libs.mysql_connection import connect as mysql_connect
from libs.spark import is_connect_session
from libs.sql_ident import mysql_ident as quote
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.snapshot import source_read
from services.sink_worker.snapshot.plan import (
    Chunk,
    KeyValues,
    chunks_from_boundaries,
    even_int_boundaries,
    evenly_spread,
    key_after,
    range_condition,
)

if TYPE_CHECKING:
    import pyarrow as pa


def connect_source(url: str) -> Any:
    """A source connection (pymysql: metadata and planning; the rows are read by
    ``source_read``); UTC, so TIMESTAMP values read here match the binlog's (UTC)."""
    db = parse_database_url(url)
    params: dict[str, Any] = {
        "host": db.host, "port": db.port, "user": db.user or "root", "password": db.password,
        "charset": "utf8mb4", "autocommit": True, "connect_timeout": 10,
        "init_command": "SET time_zone = '+00:00'",
    }
    socket = db.option("unix_socket")
    if socket:
        params["unix_socket"] = socket
    return mysql_connect(**params)


def table_ref(database: str, table: str) -> str:
    return f"{quote(database)}.{quote(table)}"


def estimate_rows(conn: Any, database: str, table: str) -> int:
    """InnoDB's estimate (statistics, no scan); a progress figure, not a count."""
    with conn.cursor() as cur:
        cur.execute("SELECT TABLE_ROWS FROM information_schema.TABLES"
                    " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s", (database, table))
        row = cur.fetchone()
    return int(row[0] or 0) if row else 0


def count_upto(conn: Any, database: str, table: str, limit: int) -> int:
    """The table's rows, counted exactly up to ``limit + 1`` (reads at most that many index
    entries): whether a table is small, which InnoDB's estimate cannot say (it reads 0 for a
    table filled since its statistics were last taken)."""
    with conn.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM {table_ref(database, table)} LIMIT %s) AS t",
                    (limit + 1,))
        row = cur.fetchone()
    return int(row[0] or 0) if row else 0


def plan_chunks(conn: Any, database: str, table: str, key: Sequence[str], meta: TableMetaV1,
                chunk_rows: int, estimate: int) -> list[Chunk]:
    """The chunks of a table (see the module doc)."""
    if not key:
        return chunks_from_boundaries([])
    ref = table_ref(database, table)
    kinds = {c.name: c.kind for c in meta.columns}
    cols = ", ".join(quote(c) for c in key)
    with conn.cursor() as cur:
        if len(key) == 1 and kinds.get(key[0]) == "int":
            cur.execute(f"SELECT MIN({cols}), MAX({cols}), COUNT(*) FROM {ref}")
            low, high, count = cur.fetchone()
            if low is None:
                return chunks_from_boundaries([])
            if evenly_spread(int(low), int(high), int(count)):
                return chunks_from_boundaries(even_int_boundaries(int(low), int(high), int(count),
                                                                  chunk_rows))
    boundaries: list[KeyValues] = []
    while (found := next_boundary(conn, database, table, key, boundaries[-1] if boundaries else None,
                                  chunk_rows)) is not None:
        boundaries.append(found)
    return chunks_from_boundaries(boundaries)


def next_boundary(conn: Any, database: str, table: str, key: Sequence[str], after: KeyValues | None,
                  chunk_rows: int) -> KeyValues | None:
    """The key ``chunk_rows`` rows after ``after`` (None: from the first key), walking the key
    index; None when fewer rows follow."""
    cols = ", ".join(quote(c) for c in key)
    params: list[Any] = []
    where = f"WHERE {key_after(key, quote, after, params)}" if after is not None else ""
    with conn.cursor() as cur:
        cur.execute(f"SELECT {cols} FROM {table_ref(database, table)} {where} ORDER BY {cols}"
                    " LIMIT 1 OFFSET %s", [*params, max(0, chunk_rows - 1)])
        row = cur.fetchone()
    return None if row is None else tuple(row)


def split_open_chunk(job: CopyJob, chunk: Chunk, chunk_rows: int) -> KeyValues | None:
    """Where to cut the plan's open-ended last chunk so that its first part holds ``chunk_rows``
    rows (None: it holds fewer, copy it whole). Rows inserted after the plan was made all land
    in that chunk; cut as the copy reaches it, it never grows past one chunk's size."""
    if not job.chunk_key or chunk.upper is not None:
        return None
    conn = connect_source(job.source_url)
    try:
        return next_boundary(conn, job.database, job.table, job.chunk_key, chunk.lower, chunk_rows)
    finally:
        conn.close()


def encode_key(meta: TableMetaV1, key: Sequence[str]) -> Callable[[KeyValues], list[Any]]:
    """Key values read from the source to their contract JSON (for the progress record)."""
    kinds = {c.name: c.kind for c in meta.columns}
    return lambda values: [encode_value(kinds[c], v) for c, v in zip(key, values, strict=True)]


def decode_key(meta: TableMetaV1, key: Sequence[str]) -> Callable[[list[Any]], KeyValues]:
    """Key values from the progress record to Python values a source query binds."""
    columns = {c.name: c for c in meta.columns}
    return lambda values: tuple(decode_value(columns[c].kind, columns[c].sql_type, v)
                                for c, v in zip(key, values, strict=True))


# Kinds pymysql already returns as the Python value the sinks take (what ``values.decode_value``
# makes of the contract JSON); other kinds (set, time, json, bit) and unexpected types go the
# stream's way: capture's encoding, then the sink's decoding, so both paths write the same.
_AS_READ: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (float,), "decimal": (Decimal,), "string": (str,), "bytes": (bytes,),
    "geometry": (bytes,),  # MariaDB's internal format, what the contract's value decodes to
    "date": (dt.date,), "datetime": (dt.datetime,), "timestamp": (dt.datetime,),
}


def _converter(column: ColumnV1) -> Callable[[Any], Any]:
    kind, sql_type = column.kind, column.sql_type
    direct = _AS_READ.get(kind, ())

    def via_contract(v: Any) -> Any:
        return decode_value(kind, sql_type, encode_value(kind, v))

    if not direct:
        return via_contract
    if kind == "date":
        return lambda v: v if type(v) is dt.date else via_contract(v)
    return lambda v: v if type(v) in direct else via_contract(v)


@dataclass(frozen=True)
class CopyJob:
    """What every copy task needs (pickled to the executors: URLs, names, metadata; no sockets)."""

    source_url: str
    database: str
    table: str
    chunk_key: tuple[str, ...]
    target: TargetTable
    sink_url: str
    write_rows: int = 5000
    write_bytes: int = 16 * 1024 * 1024
    """A write batch ends at this many bytes of values too: memory holds a few batches (the
    read-ahead), so a table of multi-MB rows is copied in small batches (a larger row alone)."""
    origin: tuple[str, str] | None = None
    """The origin column's name and value every copied row gains (a routed shard with one)."""


# Kinds whose values are short whatever the table: the batch's byte bound counts them as 8.
_FIXED_SIZE = frozenset({"int", "float", "decimal", "date", "datetime", "timestamp", "time", "bit"})


def _read_batches(job: CopyJob, chunk: Chunk, columns: Sequence[ColumnV1], *,
                  mode: source_read.Mode) -> Iterator[list[tuple[Any, ...]]]:
    """The chunk's rows in batches of ``job.write_rows`` rows or ``job.write_bytes`` bytes,
    whichever comes first (a larger row alone), streamed from one unbuffered query
    (``source_read``)."""
    where, params = range_condition(job.chunk_key, chunk, quote)
    sql = (f"SELECT {', '.join(quote(c.name) for c in columns)} FROM {table_ref(job.database, job.table)}"
           f" WHERE {where}")
    sized = [i for i, c in enumerate(columns) if c.kind not in _FIXED_SIZE]
    return source_read.stream_batches(job.source_url, sql, params, mode=mode, batch_rows=job.write_rows,
                                      batch_bytes=job.write_bytes, sized=sized)


_DONE = object()


def _as_source_bytes(value: Any) -> bytes | None:
    """A Python value as a MySQL source's text protocol would send it (the origin column's
    value beside the rows read raw)."""
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def copy_chunk(job: CopyJob, chunk: Chunk) -> int:
    """Copy one chunk; returns the rows written.

    The source read runs in a second thread, at most two batches ahead of the writes: while
    one side waits for its server the other works, and memory stays a few batches (each at
    most ``write_rows`` rows or ``write_bytes`` bytes, or one larger row), whatever the chunk's
    size."""
    from services.sink_worker.sinks.factory import open_sink

    origin = job.origin
    # The origin column is the target's, not the source's: read the others, then add it.
    columns = [c for c in job.target.meta.columns if origin is None or c.name != origin[0]]
    names = [c.name for c in columns]
    converters = [_converter(c) for c in columns]
    # Multi-row statements as large as one write batch where a sink has no bulk path.
    sink = open_sink(job.sink_url, chunk_rows=job.write_rows)
    loaded = [*names, origin[0]] if origin is not None else names
    # The source's bytes go into the sink's bulk file as they are where the sink reads them
    # (LOAD DATA into MySQL/MariaDB; COPY into PostgreSQL for numbers, text, dates): decoding
    # every value in Python and encoding it again was most of a copy's CPU. The edge-value
    # tests hold both paths to one result.
    raw = sink.takes_source_bytes(job.target, loaded)
    mode = source_read.RAW if raw else source_read.TYPED
    ahead: queue.Queue[Any] = queue.Queue(maxsize=2)
    stop = threading.Event()

    def offer(item: Any) -> bool:
        # Never blocks for good: once the writer stopped (it failed), nobody takes from the queue.
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for rows in _read_batches(job, chunk, columns, mode=mode):
                if not offer(rows):
                    return
            offer(_DONE)
        except BaseException as exc:  # handed to the writer, which raises it
            offer(exc)

    reader = threading.Thread(target=read, name=f"snapshot-read-{chunk.id}", daemon=True)
    reader.start()
    origin_raw = None if origin is None else _as_source_bytes(origin[1])
    # Keyed by the source's primary key, the copied rows never share a target key.
    keys_unique = bool(job.chunk_key) and set(job.chunk_key) <= set(job.target.key)
    written = 0
    try:
        while (rows := ahead.get()) is not _DONE:
            if isinstance(rows, BaseException):
                raise rows
            if raw:
                if origin is not None:
                    rows = [(*row, origin_raw) for row in rows]
                written += sink.load_source_bytes(job.target, loaded, rows, keys_unique=keys_unique)
                continue
            values = [[None if v is None else conv(v) for v, conv in zip(read, converters, strict=True)]
                      for read in rows]
            if origin is not None:
                for row in values:
                    row.append(origin[1])
            written += sink.load_rows(job.target, loaded, values, keys_unique=keys_unique)
    finally:
        stop.set()
        reader.join(timeout=30)
        sink.close()
    return written


COPY_SCHEMA = "chunk long, rows long"
"""What a copy task returns: one row per chunk it copied."""


def copy_arrow(job: CopyJob, tasks: tuple[tuple[Chunk, ...], ...],
               batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in a Python worker (``mapInArrow``): the input rows are indexes into ``tasks``
    (``spark.range``); copies each of that task's chunks in turn and returns ``(chunk id, rows
    written)`` for each."""
    # Imported here: pyarrow is ~70 MiB of a Python worker's memory, and the classic path's
    # workers (RDD, ``copy_partition``) never need it.
    import pyarrow as pa

    from libs.gc_pause import gc_paused

    for batch in batches:
        for index in batch.column(0).to_pylist():
            for chunk in tasks[index]:
                # Paused a chunk at a time: what a chunk leaves in cycles is collected before
                # the next one, so a task's memory does not grow with its chunks.
                with gc_paused():
                    rows = copy_chunk(job, chunk)
                yield pa.RecordBatch.from_arrays([pa.array([chunk.id], pa.int64()),
                                                  pa.array([rows], pa.int64())], names=["chunk", "rows"])


def copy_partition(job: CopyJob, tasks: Iterator[Sequence[Chunk]]) -> Iterator[tuple[int, int]]:
    """Runs on an executor (RDD, classic sessions): ``(chunk id, rows written)`` for each chunk
    of the partition's tasks."""
    from libs.gc_pause import gc_paused

    for chunks in tasks:
        for chunk in chunks:
            with gc_paused():  # a chunk at a time, as in copy_arrow
                rows = copy_chunk(job, chunk)
            yield chunk.id, rows


def run_copy(spark: SparkSession, job: CopyJob, tasks: Sequence[Sequence[Chunk]]) -> dict[int, int]:
    """One Spark job of one task per item of ``tasks``, each copying its chunks in turn; rows
    written per chunk id.

    Over Spark Connect (no ``sparkContext``) a DataFrame over ``spark.range`` and
    ``mapInArrow``; on a classic session an RDD, whose Python workers do not load pyarrow and
    Spark SQL's Python side: measured on ``bench_snapshot``, mapInArrow's two workers and the
    JVM's Arrow buffers added ~350 MiB to the copying worker's peak RSS (1.15-1.22 GiB against
    0.81-0.83 GiB), past the 1 GiB budget, for no speed that stood out of the noise (the copy
    moves two numbers per chunk through Spark; the rows never pass through it)."""
    if not tasks:
        return {}
    if is_connect_session(spark):
        frame = spark.range(0, len(tasks), 1, len(tasks))
        copy = partial(copy_arrow, job, tuple(tuple(t) for t in tasks))
        rows = frame.mapInArrow(copy, COPY_SCHEMA).collect()
        return {int(r[0]): int(r[1]) for r in rows}
    rdd = spark.sparkContext.parallelize([list(t) for t in tasks], len(tasks))
    return dict(rdd.mapPartitions(partial(copy_partition, job)).collect())


def chunks_per_job(pending: int, parallelism: int, chunk_rows: int, job_rows: int) -> int:
    """How many chunks one copy job takes: about a second of fixed cost goes to every Spark job
    on a busy machine, so a job copies several chunks, spreading the copy over about two jobs
    per slot of the pool; at most ``job_rows`` rows' worth of chunks, because a crash loses
    (copies again) the chunks of the jobs in flight, and progress is recorded per job."""
    spread = -(-pending // (2 * parallelism))
    return max(1, min(spread, job_rows // max(1, chunk_rows)))


def _classic_context(spark: SparkSession) -> Any:
    """The SparkContext of a classic session; None over Spark Connect, which has none."""
    try:
        return spark.sparkContext
    except Exception:
        return None


class CopyPool:
    """Copies chunks as a pool of at most ``parallelism`` Spark jobs in flight, each one task
    that copies a few chunks in turn: a free slot starts the next job as soon as one ends, so
    no slot waits for the slowest task of a wave, and each job's chunks are recorded
    as it ends.

    Every job carries the pool's id (a job group on a classic session, a tag over Spark
    Connect), so ``cancel`` interrupts exactly this copy's jobs."""

    def __init__(self, spark: Callable[[], SparkSession], job: CopyJob, parallelism: int) -> None:
        self._spark = spark
        self.job = job
        self.parallelism = parallelism
        self.tag = f"sluice-snapshot-{uuid4().hex[:12]}"
        self._abort = threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="snapshot-copy")

    def submit(self, chunks: Sequence[Chunk]) -> Future[dict[int, int]]:
        """Start copying ``chunks`` (one job, one task); at most ``parallelism`` in flight."""
        return self._executor.submit(self._copy, list(chunks))

    def _copy(self, chunks: list[Chunk]) -> dict[int, int]:
        spark = self._spark()
        context = _classic_context(spark)
        # A classic session keeps job tags per thread (the JVM's interruptTag finds only the
        # calling thread's), and ``cancel`` runs on another thread: there the pool is a job
        # group, which any thread cancels, with its running tasks interrupted rather than left
        # to finish a chunk read that a locked source table can hold indefinitely. Spark
        # Connect's tags are matched by the server, whichever client thread interrupts.
        if context is not None:
            context.setJobGroup(self.tag, "sluice initial load", interruptOnCancel=True)
        else:
            spark.addTag(self.tag)
        try:
            if self._abort.is_set():
                raise RuntimeError("the copy was cancelled")
            return run_copy(spark, self.job, [chunks])
        finally:
            if context is None:
                spark.removeTag(self.tag)

    def cancel(self) -> None:
        """No further job starts; the running ones are interrupted (their futures fail)."""
        self._abort.set()
        with contextlib.suppress(Exception):
            spark = self._spark()
            context = _classic_context(spark)
            if context is not None:
                context.cancelJobGroup(self.tag)
            else:
                spark.interruptTag(self.tag)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
