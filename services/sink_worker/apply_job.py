"""The apply job (Spark): a sorted batch to the final image per key, written in parallel.

1. Explode: every row image of every event becomes a record keyed by ``(target, key)``; an
   update that changes the key becomes a delete of the old key followed by an upsert of the new
   one (sub-order 0 then 1), so the old row cannot survive under its old key.
2. Collapse: a window over ``(target, key)`` ordered by ``(ts, seq, part, row index, sub-order)``
   keeps only the last record per key: the image the source had at the end of the batch.
3. Write: repartition by a hash of ``(target, key)`` and let every partition write its final
   images through the sink (``Sink.apply_partition``: delete by key; upsert that first removes
   rows holding the same unique-key values under another key). No lock spans partitions: the
   batch ends at a consistent point of the source, so its final images satisfy every unique
   key together and the order in which partitions land does not matter (the TDSQL "lucy" case
   needs no lock here). The driver sums the counts each partition returns.

Values stay in their contract JSON encoding until the partition decodes them
(``values.decode_row``), so Spark never has to know a column's type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from contracts import REGISTRY
from contracts.events.rows import RowsChangedV1
from services.sink_worker.sinks.base import Change, Delete, TargetTable, Upsert

RECORD_SCHEMA = StructType([
    StructField("target", StringType(), False),
    StructField("key", StringType(), False),
    StructField("ts", LongType(), False),
    StructField("seq", LongType(), False),
    StructField("part", IntegerType(), False),
    StructField("idx", IntegerType(), False),
    StructField("sub", IntegerType(), False),
    StructField("op", StringType(), False),  # "upsert" | "delete"
    StructField("image", StringType(), True),
])


@dataclass(frozen=True)
class TargetPlan:
    """Where one span's rows go: the sink and the target table (with the key to use)."""

    target_id: str
    sink_url: str
    table: TargetTable


@dataclass
class TargetCounts:
    deleted: int = 0
    upserted: int = 0
    conflicts_removed: int = 0


@dataclass
class ApplyResult:
    per_target: dict[str, TargetCounts] = field(default_factory=dict)
    partitions: int = 0

    @property
    def written(self) -> int:
        return sum(c.deleted + c.upserted for c in self.per_target.values())


def _key_json(image: dict[str, Any], key: tuple[str, ...]) -> str:
    # The contract's JSON value of each key column: one canonical text per key value.
    return json.dumps([image[c] for c in key], separators=(",", ":"), sort_keys=True)


SpanTargets = dict[str, tuple[str, tuple[str, ...]]]
"""span key -> (target id, key columns)"""


def explode_event(span_targets: SpanTargets, row: Row) -> Iterator[tuple[Any, ...]]:
    """One rows event to its row records (see ``RECORD_SCHEMA``)."""
    target, key = span_targets[row["span"]]
    event = REGISTRY.decode(row["body"]).event
    assert isinstance(event, RowsChangedV1)
    ts, seq, part = row["ts"], row["seq"], row["part"]
    for idx, image in enumerate(event.rows):
        if image.op == "insert":
            assert image.after is not None
            yield (target, _key_json(image.after, key), ts, seq, part, idx, 0, "upsert",
                   json.dumps(image.after))
        elif image.op == "delete":
            assert image.before is not None
            yield (target, _key_json(image.before, key), ts, seq, part, idx, 0, "delete", None)
        else:
            assert image.before is not None and image.after is not None
            old, new = _key_json(image.before, key), _key_json(image.after, key)
            if old != new:
                yield (target, old, ts, seq, part, idx, 0, "delete", None)
            yield (target, new, ts, seq, part, idx, 1, "upsert", json.dumps(image.after))


def write_partition(plans: dict[str, TargetPlan], rows: Iterator[Row]) -> Iterator[tuple[str, int, int, int]]:
    """Runs on an executor: decode one partition's final images and write them per target."""
    # Imported here: executors need them, the driver's import of this module does not.
    from services.sink_worker.sinks.factory import open_sink
    from services.sink_worker.values import decode_row, decode_value

    changes: dict[str, list[Change]] = {}
    for row in rows:
        plan = plans[row["target"]]
        table = plan.table
        if row["op"] == "upsert":
            decoded = decode_row(table.meta, json.loads(row["image"]))
            key = tuple(decoded[c] for c in table.key)
            changes.setdefault(row["target"], []).append(Upsert(key=key, row=decoded))
        else:
            columns = {c.name: c for c in table.meta.columns}
            raw = json.loads(row["key"])
            key = tuple(decode_value(columns[c].kind, columns[c].sql_type, v) for c, v in zip(table.key, raw,
                                                                                                 strict=True))
            changes.setdefault(row["target"], []).append(Delete(key=key))
    sinks: dict[str, Any] = {}
    for target_id, target_changes in changes.items():
        plan = plans[target_id]
        sink = sinks.get(plan.sink_url)
        if sink is None:
            sink = sinks[plan.sink_url] = open_sink(plan.sink_url)
        result = sink.apply_partition(plan.table, target_changes)
        yield (target_id, result.deleted, result.upserted, result.conflicts_removed)


def final_images(spark: SparkSession, batch: DataFrame,
                 span_targets: dict[str, tuple[str, tuple[str, ...]]]) -> DataFrame:
    """The last record per (target, key) of the batch (``RECORD_SCHEMA``)."""
    records = spark.createDataFrame(batch.rdd.flatMap(partial(explode_event, span_targets)), RECORD_SCHEMA)
    order = Window.partitionBy("target", "key").orderBy(
        F.desc("ts"), F.desc("seq"), F.desc("part"), F.desc("idx"), F.desc("sub"))
    return records.withColumn("_rn", F.row_number().over(order)).where(F.col("_rn") == 1).drop("_rn")


def run_apply(spark: SparkSession, batch: DataFrame, span_plans: dict[str, TargetPlan],
              partitions: int) -> ApplyResult:
    """Collapse ``batch`` (rows events of the sort job) and write it; ``span_plans`` maps each
    span key in the batch to its target."""
    span_targets = {span: (plan.target_id, plan.table.key) for span, plan in span_plans.items()}
    plans = {plan.target_id: plan for plan in span_plans.values()}
    final = final_images(spark, batch, span_targets)
    counts = (final.repartition(partitions, "target", "key").rdd
              .mapPartitions(partial(write_partition, plans)).collect())
    result = ApplyResult(partitions=partitions)
    for target_id, deleted, upserted, conflicts in counts:
        c = result.per_target.setdefault(target_id, TargetCounts())
        c.deleted += deleted
        c.upserted += upserted
        c.conflicts_removed += conflicts
    return result
