"""The sort job (Spark): from the events pulled for every span of the worker, the batch each span
may apply now.

Per span (all spans in one job, never one job per table):

1. drop events with ts <= the span's checkpoint ts (applied before; re-read after a restart or
   because they sit behind an event that was held back), then duplicates by event id (the
   producer is at-least-once);
2. summarise each transaction (Spark: one row per span and ts: complete or not, DDL or not);
3. walk the summary in ts order up to the span's *horizon* (``PullResult.horizon``: the
   resolved ts, lowered to just below any event the pull has not buffered): the batch ends at
   the last complete transaction, and before the span's first DDL, which is a barrier applied
   alone after the batch; the span continues after it in the next round.

The order of changes, ``(ts, seq, part)`` and then row order inside a message, is applied where
it matters: the apply job's collapse window picks the last image per key by it, and the cut
only ever ends at a transaction boundary of that order.

Only the events' metadata goes through the deduplication and the summary: the bodies (the
row images, nearly all of a round's bytes) are handed to Spark once, after the cut and only
for events the batch can contain, and joined to the deduplicated batch by stream sequence.
Shuffling the bodies through the deduplication, twice (the summary's job and the apply job's
recomputation), was the largest JVM cost of a round (``benchmarks/apply.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from services.sink_worker.large_values import LargeValues
from services.sink_worker.pull import PulledEvent

META_FIELDS = [
    StructField("span", StringType(), False),
    StructField("kind", StringType(), False),  # "rows" | "ddl" | "dead" (a dead-lettered part)
    StructField("id", StringType(), False),
    StructField("ts", LongType(), False),
    StructField("seq", LongType(), False),
    StructField("part", IntegerType(), False),
    StructField("last_part", BooleanType(), False),
    StructField("stream_seq", LongType(), False),
]
META_SCHEMA = StructType(META_FIELDS)
# The message payload (envelope JSON) as bytes: no decoding on the driver, no UTF-16 in the JVM.
EVENT_SCHEMA = StructType([*META_FIELDS, StructField("body", BinaryType(), False)])
BODY_SCHEMA = StructType([
    StructField("span", StringType(), False),
    StructField("stream_seq", LongType(), False),
    StructField("body", BinaryType(), False),
])

SPAN_SCHEMA = StructType([
    StructField("span", StringType(), False),
    StructField("checkpoint_ts", LongType(), False),
    StructField("horizon_ts", LongType(), False),
])


@dataclass(frozen=True)
class SpanInput:
    span: str
    checkpoint_ts: int
    horizon_ts: int


@dataclass(frozen=True)
class SpanCut:
    span: str
    limit_ts: int
    """Row changes with checkpoint ts < ts <= limit_ts form the batch."""
    batch_events: int
    batch_max_ts: int | None
    ddl_ts: int | None
    """The DDL barrier the batch stops at when it may be applied right after the batch."""
    ddl_id: str | None


@dataclass
class SortResult:
    batch: DataFrame
    """Rows events (``EVENT_SCHEMA``) of every span's batch, deduplicated."""
    cuts: dict[str, SpanCut]


def event_records(span_key: str, events: Iterable[PulledEvent], large: LargeValues | None = None,
                  key: tuple[str, ...] = ()) -> list[tuple[object, ...]]:
    """``EVENT_SCHEMA`` tuples of one span's events (the body is the message's bytes, not a copy),
    with ``large``: a body that may hold large values has them as references instead
    (``large_values``; raises ``LargeKeyError`` when one is in a ``key`` column)."""
    def body(e: PulledEvent) -> bytes:
        if e.dead:
            return b""
        return large.strip(e, key) if large is not None and large.needs_strip(e) else e.data

    return [(span_key, "dead" if e.dead else "ddl" if e.is_ddl else "rows", e.event_id, e.ts, e.seq,
             e.part, e.last_part, e.stream_seq, body(e)) for e in events]


@dataclass(frozen=True)
class TxnSummary:
    """One transaction (or DDL) of one span, as the sort job's aggregation sees it."""

    ts: int
    is_ddl: bool
    complete: bool
    events: int
    ddl_id: str | None


def cut_span(span: SpanInput, txns: list[TxnSummary]) -> SpanCut:
    """The batch of one span from its transactions in ts order (see the module docstring)."""
    limit = span.horizon_ts
    ddl: TxnSummary | None = None
    events = 0
    max_ts: int | None = None
    for txn in sorted(txns, key=lambda t: t.ts):
        if txn.ts > span.horizon_ts:
            break
        if txn.is_ddl:
            ddl = txn
            limit = txn.ts - 1
            break
        if not txn.complete:
            limit = txn.ts - 1
            break
        events += txn.events
        max_ts = txn.ts
    return SpanCut(span=span.span, limit_ts=limit, batch_events=events, batch_max_ts=max_ts,
                   ddl_ts=ddl.ts if ddl else None, ddl_id=ddl.ddl_id if ddl else None)


def _local_frame(spark: SparkSession, rows: Sequence[tuple[object, ...]], schema: StructType) -> DataFrame:
    """A DataFrame of driver-side rows, handed to the JVM as one Arrow table when pyarrow is
    there: for the bodies (nearly all of a round's bytes) that costs the JVM about 40 % less
    CPU than unpickling them batch by batch (``benchmarks/apply.py``); otherwise pickled."""
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover - pyarrow is a dependency; Spark Connect setups may differ
        return spark.createDataFrame(rows, schema, verifySchema=False)
    if not rows:
        return spark.createDataFrame([], schema)
    types = [{"string": pa.string(), "bigint": pa.int64(), "binary": pa.binary()}[f.dataType.simpleString()]
             for f in schema.fields]
    arrow_schema = pa.schema([pa.field(f.name, t, nullable=f.nullable) for f, t in zip(schema.fields, types,
                                                                                       strict=True)])
    # Spark makes one partition per Arrow batch: cut the rows into as many batches as there are
    # cores, of about equal bytes, so the explode that reads them runs on all of them.
    slices = max(1, spark.sparkContext.defaultParallelism)
    sizes = [sum(len(v) for v in row if isinstance(v, bytes | str)) + 16 for row in rows]
    total, start, acc = sum(sizes), 0, 0
    batches: list[Any] = []
    for i, size in enumerate(sizes):
        acc += size
        if acc * slices >= total * (len(batches) + 1) or i == len(rows) - 1:
            columns = list(zip(*rows[start:i + 1], strict=True))
            batches.append(pa.RecordBatch.from_arrays(
                [pa.array(col, type=t) for col, t in zip(columns, types, strict=True)], schema=arrow_schema))
            start = i + 1
    return spark.createDataFrame(pa.Table.from_batches(batches, schema=arrow_schema), schema)


def run_sort(spark: SparkSession, records: list[tuple[object, ...]], spans: list[SpanInput]) -> SortResult:
    """``records``: ``EVENT_SCHEMA`` tuples (``event_records``) of every span in the round."""
    # Built by this module, so the schema holds by construction: no per-row type check.
    events = spark.createDataFrame([r[:-1] for r in records], META_SCHEMA, verifySchema=False)
    params = spark.createDataFrame([(s.span, s.checkpoint_ts, s.horizon_ts) for s in spans], SPAN_SCHEMA)
    fresh = (events.join(F.broadcast(params), "span")
             .where(F.col("ts") > F.col("checkpoint_ts"))
             .dropDuplicates(["span", "id"]))
    # One row per (span, ts): a transaction's rows of one table may span several messages
    # (parts 0..n, the last one flagged); it is complete when the flagged part and every part
    # before it are present. A DDL is a transaction of its own. The summary is at most one row
    # per event of the round, so the driver orders it and walks it to find each span's cut.
    is_ddl = F.col("kind") == "ddl"
    summary = (fresh.groupBy("span", "ts")
               .agg(F.max(is_ddl.cast("int")).alias("ddl"),
                    F.max(F.col("last_part").cast("int")).alias("has_last"),
                    F.countDistinct("part").alias("nparts"), F.max("part").alias("maxpart"),
                    F.sum((F.col("kind") == "rows").cast("int")).alias("n"),
                    F.min(F.when(is_ddl, F.col("id"))).alias("ddl_id"))
               .collect())
    per_span: dict[str, list[TxnSummary]] = {s.span: [] for s in spans}
    for row in summary:
        per_span[row["span"]].append(TxnSummary(
            ts=int(row["ts"]), is_ddl=bool(row["ddl"]), events=int(row["n"]),
            complete=bool(row["ddl"]) or (bool(row["has_last"]) and row["nparts"] == row["maxpart"] + 1),
            ddl_id=row["ddl_id"]))
    cuts = {s.span: cut_span(s, per_span[s.span]) for s in spans}
    limits = spark.createDataFrame([(k, c.limit_ts) for k, c in cuts.items()], "span string, limit_ts long")
    batch_meta = (fresh.join(F.broadcast(limits), "span")
                  .where((F.col("kind") == "rows") & (F.col("ts") <= F.col("limit_ts")))
                  .select(*META_SCHEMA.fieldNames()))
    # The bodies of every copy the batch may hold (the driver knows the cut); the deduplicated
    # metadata decides which copy is applied. The metadata side is small: broadcast, so the
    # bodies are never shuffled.
    window = {s.span: (s.checkpoint_ts, cuts[s.span].limit_ts) for s in spans}
    wanted = []
    for r in records:
        span, ts = r[0], r[3]
        assert isinstance(span, str) and isinstance(ts, int)
        if r[1] == "rows" and window[span][0] < ts <= window[span][1]:
            wanted.append((span, r[7], r[8]))
    bodies = _local_frame(spark, wanted, BODY_SCHEMA)
    batch = (bodies.join(F.broadcast(batch_meta), ["span", "stream_seq"])
             .select(*EVENT_SCHEMA.fieldNames()))
    return SortResult(batch=batch, cuts=cuts)
