"""The apply job (Spark): a sorted batch to the final image per key, written in parallel.

1. Explode: every row image of every event becomes a record keyed by ``(target, key)``; an
   update that changes the key becomes a delete of the old key followed by an upsert of the new
   one (sub-order 0 then 1), so the old row cannot survive under its old key.
2. Collapse: repartition by a hash of ``(target, key)``, then a window over ``(target, key)``
   ordered by ``(ts, seq, part, row index, sub-order)`` keeps only the last record per key: the
   image the source had at the end of the batch. The window needs exactly the clustering the
   repartition made, so this is one shuffle, not two.
3. Write: every partition writes its final images through the sink (``Sink.apply_partition``:
   delete by key; upsert that first removes rows holding the same unique-key values under
   another key). No lock spans partitions: the batch ends at a consistent point of the
   source, so its final images satisfy every unique key together and the order in which
   partitions land does not matter (the TDSQL "lucy" case needs no lock here). The driver
   sums the counts each partition returns.

Values stay in their contract JSON encoding until the partition decodes them
(``values.RowDecoder``), so Spark never has to know a column's type. Between the explode and
the write an image travels pickled (a dict of those JSON values; it never leaves this job):
half the cost of JSON text in the Python workers and plain bytes to the JVM, for every row
change of a round.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

from contracts import REGISTRY
from contracts.events.rows import RowsChangedV1
from services.sink_worker.sinks.base import Change, Delete, TargetTable, Upsert

RECORD_SCHEMA = StructType([
    # The target's index in the round's list of targets: an int is cheaper than its id string
    # to shuffle, hash and sort for every row change.
    StructField("target", IntegerType(), False),
    StructField("key", StringType(), False),
    StructField("ts", LongType(), False),
    StructField("seq", LongType(), False),
    StructField("part", IntegerType(), False),
    StructField("idx", IntegerType(), False),
    StructField("sub", IntegerType(), False),
    StructField("op", StringType(), False),  # "upsert" | "delete"
    StructField("image", BinaryType(), True),  # pickled dict of the contract's JSON values
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


_KEY_ENCODE = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def _key_json(image: dict[str, Any], key: tuple[str, ...]) -> str:
    # The contract's JSON value of each key column: one canonical text per key value. Integer
    # keys (most of them) are spelled directly: exactly what the encoder writes, at a fifth
    # of the cost, and this runs for every row change.
    if len(key) == 1:
        value = image[key[0]]
        if type(value) is int:
            return f"[{value}]"
        return _KEY_ENCODE([value])
    values = [image[c] for c in key]
    if all(type(v) is int for v in values):
        return "[" + ",".join(map(str, values)) + "]"
    return _KEY_ENCODE(values)


def _pack(image: dict[str, Any]) -> bytes:
    return pickle.dumps(image, protocol=pickle.HIGHEST_PROTOCOL)


SpanTargets = dict[str, tuple[int, tuple[str, ...], tuple[str, str] | None]]
"""span key -> (target index, key columns, origin column name and value or None)"""


_LATEST: dict[str, int] = {}


def event_rows(body: bytes | str) -> list[dict[str, Any]]:
    """The row images of one rows event, as plain dicts (``RowImageV1`` fields).

    The driver validated every event of the batch when it pulled it (``pull.decode_for_span``),
    so a body in the newest contract version is only parsed here, not validated again (that
    was most of this job's Python time); an older version goes through the registry's
    upcasters like everywhere else.
    """
    obj = json.loads(body)
    type_, version = obj["type"], obj["version"]
    latest = _LATEST.get(type_)
    if latest is None:
        latest = _LATEST[type_] = REGISTRY.latest_version(type_)
    if version == latest:
        return list(obj["data"]["rows"])
    event = REGISTRY.decode(body).event
    assert isinstance(event, RowsChangedV1)
    return [image.model_dump(mode="json") for image in event.rows]


def explode_event(span_targets: SpanTargets, span: str, ts: int, seq: int, part: int,
                  body: bytes) -> Iterator[tuple[Any, ...]]:
    """One rows event to its row records (see ``RECORD_SCHEMA``)."""
    target, key, origin = span_targets[span]
    for idx, image in enumerate(event_rows(body)):
        op, before, after = image["op"], image.get("before"), image.get("after")
        if origin is not None:
            # Both images: a delete or key change must find this shard's row downstream.
            name, value = origin
            before = {name: value, **before} if before is not None else None
            after = {name: value, **after} if after is not None else None
        if op == "insert":
            assert after is not None
            yield (target, _key_json(after, key), ts, seq, part, idx, 0, "upsert", _pack(after))
        elif op == "delete":
            assert before is not None
            yield (target, _key_json(before, key), ts, seq, part, idx, 0, "delete", None)
        else:
            assert before is not None and after is not None
            old, new = _key_json(before, key), _key_json(after, key)
            if old != new:
                yield (target, old, ts, seq, part, idx, 0, "delete", None)
            yield (target, new, ts, seq, part, idx, 1, "upsert", _pack(after))


_EXPLODE_INPUT = ("span", "ts", "seq", "part", "body")


def explode_partition(span_targets: SpanTargets, rows: Iterator[Row]) -> Iterator[tuple[Any, ...]]:
    """``explode_event`` over a partition (rows of ``_EXPLODE_INPUT``, unpacked by position:
    cheaper than Row's lookups by name), without the garbage collector (``libs.gc_pause``)."""
    from libs.gc_pause import gc_paused

    with gc_paused():
        for span, ts, seq, part, body in rows:
            yield from explode_event(span_targets, span, ts, seq, part, body)


def write_partition(plans: list[TargetPlan], rows: Iterator[Row]) -> Iterator[tuple[str, int, int, int]]:
    """Runs on an executor: decode one partition's final images and write them per target."""
    # Imported here: executors need them, the driver's import of this module does not.
    from libs.gc_pause import gc_paused
    from services.sink_worker.sinks.factory import open_sink
    from services.sink_worker.values import RowDecoder, decode_value

    with gc_paused():
        decoders = [RowDecoder(plan.table.meta) for plan in plans]
        changes: list[list[Change]] = [[] for _ in plans]
        # Positional fields (see final_images): Row lookups by name cost more than the rest.
        for target, key_json, op, image in rows:
            table = plans[target].table
            if op == "upsert":
                decoded = decoders[target](pickle.loads(image))
                key = tuple(decoded[c] for c in table.key)
                changes[target].append(Upsert(key=key, row=decoded))
            else:
                columns = {c.name: c for c in table.meta.columns}
                raw = json.loads(key_json)
                key = tuple(decode_value(columns[c].kind, columns[c].sql_type, v)
                            for c, v in zip(table.key, raw, strict=True))
                changes[target].append(Delete(key=key))
        sinks: dict[str, Any] = {}
        for plan, target_changes in zip(plans, changes, strict=True):
            if not target_changes:
                continue
            sink = sinks.get(plan.sink_url)
            if sink is None:
                sink = sinks[plan.sink_url] = open_sink(plan.sink_url)
            result = sink.apply_partition(plan.table, target_changes)
            yield (plan.target_id, result.deleted, result.upserted, result.conflicts_removed)


def final_images(spark: SparkSession, batch: DataFrame, span_targets: SpanTargets,
                 partitions: int) -> DataFrame:
    """The last record per (target, key) of the batch: ``target, key, op, image`` (as in
    ``RECORD_SCHEMA``), in ``partitions`` partitions by a hash of (target, key)."""
    # explode_partition yields RECORD_SCHEMA tuples by construction: no per-row type check.
    exploded = batch.select(*_EXPLODE_INPUT).rdd.mapPartitions(partial(explode_partition, span_targets))
    records = spark.createDataFrame(exploded, RECORD_SCHEMA, verifySchema=False)
    # Hash-partitioned by (target, key) first: the window needs exactly that clustering, so
    # Spark adds no second shuffle, and the write runs on these partitions as they are.
    order = Window.partitionBy("target", "key").orderBy(
        F.desc("ts"), F.desc("seq"), F.desc("part"), F.desc("idx"), F.desc("sub"))
    return (records.repartition(partitions, "target", "key")
            .withColumn("_rn", F.row_number().over(order)).where(F.col("_rn") == 1)
            .select("target", "key", "op", "image"))


def run_apply(spark: SparkSession, batch: DataFrame, span_plans: dict[str, TargetPlan],
              partitions: int, origins: dict[str, tuple[str, str]] | None = None) -> ApplyResult:
    """Collapse ``batch`` (rows events of the sort job) and write it; ``span_plans`` maps each
    span key in the batch to its target, ``origins`` a span key to the origin column name and
    value its rows gain (shard routing with an origin column)."""
    # Shards of one target share its plan (and its index): their rows collapse together.
    plans = list({plan.target_id: plan for plan in span_plans.values()}.values())
    index = {plan.target_id: i for i, plan in enumerate(plans)}
    span_targets: SpanTargets = {span: (index[plan.target_id], plan.table.key, (origins or {}).get(span))
                                 for span, plan in span_plans.items()}
    final = final_images(spark, batch, span_targets, partitions)
    counts = final.rdd.mapPartitions(partial(write_partition, plans)).collect()
    result = ApplyResult(partitions=partitions)
    for target_id, deleted, upserted, conflicts in counts:
        c = result.per_target.setdefault(target_id, TargetCounts())
        c.deleted += deleted
        c.upserted += upserted
        c.conflicts_removed += conflicts
    return result
