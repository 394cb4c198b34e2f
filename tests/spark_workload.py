"""A small data-path workload for any Spark: the round's cut and apply job, on whatever
``SLUICE_SPARK_MASTER`` names, written to a SQLite file.

``python -m tests.spark_workload MASTER SQLITE_URL`` runs it in a process of its own (a
classic Spark session is one per process: local, a standalone cluster and Spark Connect each
need their own driver) and prints the downstream tables as one JSON line. ``expected()`` is the
same workload replayed in plain Python: what every Spark must leave downstream.

The workload holds the cases the data-path tests cover, at a few rows each: duplicates of an
event (at-least-once), a transaction in several parts, a part-less transaction beyond the
horizon that must wait, key changes (also onto a key deleted in the same batch), deletes, the
"lucy" reorder of a unique value between two rows, two shards of one target, and one unit
big enough to be split over partitions (the shuffle path) next to small ones (no shuffle).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from contracts import REGISTRY
from contracts.events.rows import ColumnV1, RowImageV2, RowsChangedV2, SourcePositionV1, TableMetaV1
from services.sink_worker.round.sort_job import EventRecord

PEOPLE = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                              ColumnV1(name="name", kind="string", sql_type="varchar(40)", nullable=True),
                              ColumnV1(name="email", kind="string", sql_type="varchar(40)", nullable=True)],
                     primary_key=["id"], unique_keys=[["email"]])
PETS = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                            ColumnV1(name="kind", kind="string", sql_type="varchar(20)", nullable=True)],
                   primary_key=["id"])
HORIZON = 1000
SPLIT_EVENTS = 5
"""The pets unit has more events than this: it takes the split path."""


def _txns() -> list[tuple[str, str, int, list[list[RowImageV2]]]]:
    """``(span, table, ts, parts)`` in source order; each part is one message."""
    ins, upd, dele = "insert", "update", "delete"
    txns: list[tuple[str, str, int, list[list[RowImageV2]]]] = [
        ("shop/people", "people", 10, [[RowImageV2(op=ins, after={"id": i, "name": f"p{i}", "email": f"e{i}"})
                                        for i in range(1, 9)]]),
        # Two parts of one transaction: the lucy reorder (e1 moves from 1 to 2, in order), a key
        # change 3 -> 30, a delete, then 4 takes key 5 after 5 is deleted.
        ("shop/people", "people", 20, [
            [RowImageV2(op=upd, before={"id": 1, "name": "p1", "email": "e1"},
                        after={"id": 1, "name": "p1", "email": "x1"}),
             RowImageV2(op=upd, before={"id": 2, "name": "p2", "email": "e2"},
                        after={"id": 2, "name": "p2", "email": "e1"})],
            [RowImageV2(op=upd, before={"id": 3, "name": "p3", "email": "e3"},
                        after={"id": 30, "name": "p3", "email": "e3"}),
             RowImageV2(op=dele, before={"id": 5, "name": "p5", "email": "e5"}),
             RowImageV2(op=upd, before={"id": 4, "name": "p4", "email": "e4"},
                        after={"id": 5, "name": "p4", "email": "e4"})]]),
        # Another shard of the same target (the same table in a second source database).
        ("shop2/people", "people", 15, [[RowImageV2(op=ins, after={"id": 100 + i, "name": f"q{i}",
                                                                    "email": f"q{i}"}) for i in range(3)]]),
        ("shop2/people", "people", 25, [[RowImageV2(op=upd, before={"id": 100, "name": "q0", "email": "q0"},
                                                    after={"id": 100, "name": "Q0", "email": "q0"})]]),
    ]
    # Pets: many small transactions, updates and key changes of earlier rows (the split unit).
    for n in range(12):
        rows = [RowImageV2(op=ins, after={"id": 3 * n + j, "kind": f"k{n}"}) for j in range(3)]
        if n:
            rows.append(RowImageV2(op=upd, before={"id": 3 * (n - 1), "kind": f"k{n - 1}"},
                                   after={"id": 1000 + n, "kind": "moved"}))
            rows.append(RowImageV2(op=dele, before={"id": 3 * (n - 1) + 1, "kind": f"k{n - 1}"}))
        txns.append(("shop/pets", "pets", 30 + n, [rows]))
    return txns


def _meta(table: str) -> TableMetaV1:
    return PEOPLE if table == "people" else PETS


def records() -> list[EventRecord]:
    """The pulled events of the round, as ``sort_job.event_records`` makes them."""
    out: list[EventRecord] = []
    seq = 0
    for span, table, ts, parts in _txns():
        for part, rows in enumerate(parts):
            seq += 1
            event = RowsChangedV2(source="src", database=span.split("/")[0], table=table, ts=ts, seq=seq,
                                  part=part, last_part=part == len(parts) - 1,
                                  position=SourcePositionV1(binlog_file="b", binlog_pos=seq),
                                  meta=_meta(table), rows=rows)
            body = REGISTRY.encode(event, producer="tests/spark_workload")
            last = part == len(parts) - 1
            out.append((span, "rows", f"{span}-{ts}-{part}", ts, seq, part, last, seq, body, -1))
    # At-least-once: a copy of an event, later in the stream.
    out.append(out[1])
    # A transaction beyond the horizon, and one whose last part is missing: neither applies.
    for ts, last in ((HORIZON + 1, True), (HORIZON - 1, False)):
        seq += 1
        late = RowsChangedV2(source="src", database="shop", table="people", ts=ts, seq=seq, last_part=last,
                             position=SourcePositionV1(binlog_file="b", binlog_pos=seq), meta=PEOPLE,
                             rows=[RowImageV2(op="insert", after={"id": 999, "name": "no", "email": "no"})])
        out.append(("shop/people", "rows", f"late-{ts}", ts, seq, 0, last, seq,
                    REGISTRY.encode(late, producer="tests/spark_workload"), -1))
    return out


def expected() -> dict[str, list[dict[str, Any]]]:
    """The downstream after the workload, replayed in plain Python."""
    tables: dict[str, dict[int, dict[str, Any]]] = {"people": {}, "pets": {}}
    for _, table, _, parts in sorted(_txns(), key=lambda t: t[2]):
        for rows in parts:
            for image in rows:
                if image.before is not None:
                    tables[table].pop(image.before["id"], None)
                if image.after is not None:
                    tables[table][image.after["id"]] = dict(image.after)
    return {name: [rows[k] for k in sorted(rows)] for name, rows in tables.items()}


def run(master: str, sink_url: str) -> dict[str, list[dict[str, Any]]]:
    from libs.config import Settings
    from libs.spark import get_spark, stop_spark
    from services.sink_worker.round.apply_job import TargetPlan, run_apply
    from services.sink_worker.round.sort_job import SpanInput, run_sort
    from services.sink_worker.sinks.base import TargetTable
    from services.sink_worker.sinks.factory import open_sink

    spark = get_spark(Settings(spark_master=master, spark_shuffle_partitions=3))
    try:
        sink = open_sink(sink_url)
        tables = {name: TargetTable(schema=None, name=name, meta=_meta(name), key=("id",),
                                    unique_keys=tuple(tuple(k) for k in _meta(name).unique_keys))
                  for name in ("people", "pets")}
        for table in tables.values():
            sink.ensure_table(table)
        routes = (("shop/people", "people"), ("shop2/people", "people"), ("shop/pets", "pets"))
        plans = {span: TargetPlan(target_id=table, sink_url=sink_url, table=tables[table])
                 for span, table in routes}
        sort = run_sort(records(), [SpanInput(span, 0, HORIZON) for span in plans])
        result = run_apply(spark, sort.batch(sorted(plans)), plans, 3, split_events=SPLIT_EVENTS)
        if result.failures:
            raise RuntimeError(f"the downstream refused changes: {result.failures}")
        return {name: sorted(sink.fetch_rows(table), key=lambda r: r["id"]) for name, table in tables.items()}
    finally:
        stop_spark()


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])), flush=True)
