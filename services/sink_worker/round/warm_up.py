"""A round's Spark plans run once on a synthetic transaction, writing nowhere.

A fresh Spark session pays seconds the first time it plans, compiles and runs the
final-image job (class loading, whole-stage code generation, the first Python workers). The
worker pays them here, while a span prepares, not in that span's first round: two-phase
scheduling keeps the previous owner writing until the span is Prepared, so the cold start no
longer shows as a stall of the table after a move or a restarted worker taking spans.
"""

from __future__ import annotations

import time

from pyspark.sql import SparkSession

from contracts import REGISTRY
from contracts.events.rows import ColumnV1, RowImageV2, RowsChangedV2, SourcePositionV1, TableMetaV1
from services.sink_worker.round.apply_job import SpanTargets, final_images
from services.sink_worker.round.sort_job import EventRecord, SpanInput, run_sort

_SPAN = "sluice-warm-up"


def _body() -> bytes:
    event = RowsChangedV2(
        source="warm-up", database="warm_up", table="t", ts=2, seq=1,
        position=SourcePositionV1(binlog_file="warm-up", binlog_pos=0),
        meta=TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False)],
                         primary_key=["id"]),
        rows=[RowImageV2(op="insert", after={"id": 1}),
              RowImageV2(op="update", before={"id": 1}, after={"id": 2})])
    return REGISTRY.encode(event, producer="sink-worker/warm-up")


def warm_up(spark: SparkSession, partitions: int) -> float:
    """Run the cut and the final-image job of one synthetic transaction, in both of the apply's
    shapes (its last step counts instead of writing); returns the seconds it took."""
    t0 = time.monotonic()
    records: list[EventRecord] = [(_SPAN, "rows", "warm-up-1", 2, 1, 0, True, 1, _body(), -1)]
    sort = run_sort(records, [SpanInput(_SPAN, 1, 10)])
    span_targets: SpanTargets = {_SPAN: (0, ("id",), None)}
    batch = sort.batch([_SPAN])
    # Both shapes of the job: the unit whole in its partition, and split and shuffled.
    images = final_images(spark, batch, span_targets, partitions).count()
    split = final_images(spark, batch, span_targets, partitions, split_events=0).count()
    # insert id=1, then its key moves to id=2: a delete of 1 and an upsert of 2 are final.
    if images != 2 or split != 2:
        raise RuntimeError(f"Spark warm-up produced {images} and {split} final images, expected 2")
    return time.monotonic() - t0
