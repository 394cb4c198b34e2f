"""The sort job (Spark): from the events pulled for every span of the worker, the batch each span
may apply now.

Per span (all spans in one job, never one job per table):

1. drop events with ts <= the span's checkpoint ts (applied before; re-read after a restart or
   because they sit behind an event that was held back), then duplicates by event id (the
   producer is at-least-once);
2. the *horizon*: the source's resolved ts, lowered to the newest pulled ts when the pull was cut
   short by the batch size (events up to the resolved ts may still be unread);
3. the batch ends at the last complete transaction (every part up to ``last_part`` present) at
   or below the horizon, and before the span's first DDL: that DDL is a barrier, applied alone
   after the batch, and the span continues after it in the next round.

The order of changes, ``(ts, seq, part)`` and then row order inside a message, is applied where
it matters: the apply job's collapse window picks the last image per key by it, and the cut
above only ever ends at a transaction boundary of that order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, IntegerType, LongType, StringType, StructField, StructType

from services.sink_worker.pull import PulledEvent

EVENT_SCHEMA = StructType([
    StructField("span", StringType(), False),
    StructField("kind", StringType(), False),  # "rows" | "ddl"
    StructField("id", StringType(), False),
    StructField("ts", LongType(), False),
    StructField("seq", LongType(), False),
    StructField("part", IntegerType(), False),
    StructField("last_part", BooleanType(), False),
    StructField("stream_seq", LongType(), False),
    StructField("body", StringType(), False),  # the message payload (envelope JSON)
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


def event_records(span_key: str, events: Iterable[PulledEvent]) -> list[tuple[object, ...]]:
    return [(span_key, "ddl" if e.is_ddl else "rows", e.event_id, e.ts, e.seq, e.part, e.last_part,
             e.stream_seq, e.data.decode()) for e in events]


def run_sort(spark: SparkSession, records: list[tuple[object, ...]], spans: list[SpanInput]) -> SortResult:
    events = spark.createDataFrame(records, EVENT_SCHEMA)
    params = spark.createDataFrame([(s.span, s.checkpoint_ts, s.horizon_ts) for s in spans], SPAN_SCHEMA)
    fresh = (events.join(F.broadcast(params), "span")
             .where(F.col("ts") > F.col("checkpoint_ts"))
             .dropDuplicates(["span", "id"]))

    # A transaction's rows of one table may span several messages (parts 0..n, the last one
    # flagged): it is complete when the flagged part and every part before it are present.
    incomplete = (fresh.where(F.col("kind") == "rows")
                  .groupBy("span", "ts")
                  .agg(F.max(F.col("last_part").cast("int")).alias("has_last"),
                       F.countDistinct("part").alias("nparts"), F.max("part").alias("maxpart"))
                  .where((F.col("has_last") == 0) | (F.col("nparts") != F.col("maxpart") + 1))
                  .groupBy("span").agg(F.min("ts").alias("incomplete_ts")))
    first_ddl = (fresh.where(F.col("kind") == "ddl")
                 .groupBy("span").agg(F.min(F.struct("ts", "id")).alias("ddl")))
    horizon = F.col("horizon_ts")
    cuts = (params.join(incomplete, "span", "left").join(first_ddl, "span", "left")
            .withColumn("limit_ts", F.least(
                horizon,
                F.coalesce(F.col("incomplete_ts") - 1, horizon),
                F.coalesce(F.col("ddl.ts") - 1, horizon)))
            .withColumn("ddl_applies", F.col("ddl").isNotNull() & (F.col("ddl.ts") <= horizon)
                        & (F.col("incomplete_ts").isNull() | (F.col("ddl.ts") < F.col("incomplete_ts")))))
    batch = (fresh.join(cuts.select("span", "limit_ts"), "span")
             .where((F.col("kind") == "rows") & (F.col("ts") <= F.col("limit_ts")))
             .select(*EVENT_SCHEMA.fieldNames()))
    sizes = batch.groupBy("span").agg(F.count("*").alias("n"), F.max("ts").alias("max_ts"))
    summary = cuts.join(sizes, "span", "left").select(
        "span", "limit_ts", "n", "max_ts", "ddl_applies", F.col("ddl.ts").alias("ddl_ts"),
        F.col("ddl.id").alias("ddl_id")).collect()
    result: dict[str, SpanCut] = {}
    for row in summary:
        applies = bool(row["ddl_applies"])
        result[row["span"]] = SpanCut(
            span=row["span"], limit_ts=int(row["limit_ts"]), batch_events=int(row["n"] or 0),
            batch_max_ts=int(row["max_ts"]) if row["max_ts"] is not None else None,
            ddl_ts=int(row["ddl_ts"]) if applies else None,
            ddl_id=str(row["ddl_id"]) if applies else None)
    return SortResult(batch=batch, cuts=result)
