"""Primary-key changes between keys a downstream compares as equal ('a' -> 'A' under a
case-insensitive collation, 'p2' -> 'p2  ' under PAD SPACE) keep the row, on every downstream.

The events go through the real data path (nats-server, the sink-worker pipeline, local Spark
with several apply partitions) into real MariaDB, PostgreSQL and SQLite targets: as the ones
the sink creates (utf8mb4_bin is PAD SPACE on MariaDB) and as an operator's pre-created table
whose key column has a case-insensitive collation.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts.events.rows import ColumnV1, RowImageV2, TableMetaV1
from libs.eventstore import EventStore
from libs.streams import ROWS_STREAM, ROWS_SUBJECTS
from services.sink_worker.round.apply_job import SpanTargets, final_images, plan_partitions
from services.sink_worker.round.sort_job import BatchEvent
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.span.checkpoints import CheckpointStore
from tests.helpers.harness import Harness

pytestmark = pytest.mark.integration

CODES = TableMetaV1(columns=[
    ColumnV1(name="code", kind="string", sql_type="varchar(20)", nullable=False),
    ColumnV1(name="v", kind="int", sql_type="int")], primary_key=["code"])
N = 24  # pairs per case: with 3 apply partitions, most pairs' two halves hash apart by key

@pytest.fixture
async def rows_js(js: JetStreamContext) -> JetStreamContext:
    await EventStore(js, ROWS_STREAM, "test").ensure(ROWS_SUBJECTS, allow_rollup_hdrs=True)
    return js


@pytest.fixture
async def checkpoints(rows_js: JetStreamContext) -> CheckpointStore:
    return await CheckpointStore(rows_js).open()


# A case-insensitive collation for the key column of a pre-created target, per dialect.
_CI_COLLATION = {"mysql": "COLLATE utf8mb4_general_ci", "sqlite": "COLLATE NOCASE",
                 "postgresql": 'COLLATE "sluice_ci"'}


def _url(sink: str, request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if sink == "sqlite":
        return f"sqlite:///{tmp_path / 'down.db'}"
    return str(request.getfixturevalue("mariadb" if sink == "mariadb" else "postgres").url)


def _precreate_case_insensitive(url: str, db: str) -> None:
    sink: Any = open_sink(url)
    table = TargetTable(schema=db, name="codes", meta=CODES, key=("code",))
    column = CODES.columns[0]
    plain = f"{sink.ident('code')} {sink.column_type(table, column)}"
    statements = [s.replace(plain, f"{plain} {_CI_COLLATION[sink.dialect]}", 1)
                  for s in sink.create_statements(table)]
    assert any(_CI_COLLATION[sink.dialect] in s for s in statements), statements
    if sink.dialect == "postgresql":
        statements.insert(0, "CREATE COLLATION IF NOT EXISTS sluice_ci"
                             " (provider = icu, locale = 'und-u-ks-level2', deterministic = false)")

    def work(cur: Any) -> None:
        for statement in statements:
            cur.execute(statement)
    sink._run(work, "pre-create a case-insensitive target")


def _ins(code: str, v: int) -> RowImageV2:
    return RowImageV2(op="insert", after={"code": code, "v": v})


def _upd(old: str, new: str, v: int) -> RowImageV2:
    return RowImageV2(op="update", before={"code": old, "v": v}, after={"code": new, "v": v})


@pytest.mark.parametrize("target", ["created", "case_insensitive"])
@pytest.mark.parametrize("sink", ["sqlite", "mariadb", "postgres"])
async def test_key_changes_between_collation_equal_keys_keep_the_row(
        sink: str, target: str, rows_js: JetStreamContext, checkpoints: CheckpointStore,
        spark: SparkSession, request: pytest.FixtureRequest, tmp_path: Any) -> None:
    url = _url(sink, request, tmp_path)
    h = Harness(rows_js, checkpoints, spark, url, db=f"coll{uuid4().hex[:6]}")
    if target == "case_insensitive":
        _precreate_case_insensitive(url, h.db)
    await h.run("codes")
    src = h.source
    expected: dict[str, int] = {}

    async def txn(rows: list[RowImageV2]) -> None:
        await src.txn(h.db, "codes", rows, meta=CODES)
        for r in rows:
            if r.before is not None:
                expected.pop(r.before["code"])
            if r.after is not None:
                expected[r.after["code"]] = r.after["v"]

    async def round_and_compare(what: str) -> None:
        await src.resolve()
        await h.rounds_until(lambda: _caught_up(h, src.last_ts))
        got = {r["code"]: r["v"] for r in h.rows("codes", CODES)}
        assert got == expected, f"{sink}/{target} after {what}: " \
            f"missing {sorted(set(expected) - set(got))}, extra {sorted(set(got) - set(expected))}"

    # Round 1: the rows; within it, keys that change only by case or trailing spaces, and back.
    await txn([_ins(f"k{i}", i) for i in range(N)] + [_ins(f"p{i}", i) for i in range(N)])
    await txn([_ins(f"w{i}", i) for i in range(N)])
    await txn([_upd(f"w{i}", f"W{i}  ", i) for i in range(N)])
    await txn([_ins(f"x{i}", i) for i in range(N)])
    await txn([_upd(f"x{i}", f"X{i}", i) for i in range(N)])
    await txn([_upd(f"X{i}", f"x{i}", i) for i in range(N)])
    await round_and_compare("one round with in-round key changes")
    # Round 2: the same kind of changes across rounds.
    await txn([_upd(f"k{i}", f"K{i}", i) for i in range(N)] +
              [_upd(f"p{i}", f"p{i}  ", i) for i in range(N)])
    await round_and_compare("key changes by case and trailing spaces")
    # Round 3: back, by both at once.
    await txn([_upd(f"K{i}", f"k{i} ", i) for i in range(N)] +
              [_upd(f"p{i}  ", f"P{i}", i) for i in range(N)])
    await round_and_compare("key changes back by case and spaces at once")
    assert len(expected) == 4 * N


async def _caught_up(h: Harness, ts: int) -> bool:
    cp = await h.checkpoint("codes")
    return cp is not None and cp.ts >= ts


def test_small_units_need_no_shuffle_and_a_split_unit_one(spark: SparkSession) -> None:
    # Units (a target's spans) within SPLIT_EVENTS arrive whole in one row and are not
    # moved; a bigger one is hash-partitioned by (target, bucket) once, and nothing else is.
    body = json.dumps({"type": "rows.changed", "version": 1, "data": {"rows": []}}).encode()
    events = [("s", 1, 1, 0, body, []), ("t", 1, 1, 0, body, [])]
    targets: SpanTargets = {"s": (0, ("id",), None), "t": (1, ("id",), None)}

    def exchanges(split_events: int) -> int:
        frame = final_images(spark, events, targets, 3, split_events=split_events)
        return int(frame._jdf.queryExecution().executedPlan().toString().count("Exchange "))

    assert exchanges(10) == 0
    assert exchanges(0) == 1


def test_plan_partitions_keeps_a_target_whole_and_splits_big_units() -> None:
    targets: SpanTargets = {"a1": (0, ("id",), None), "a2": (0, ("id",), None), "b": (1, ("id",), None),
                            "c": (2, ("id",), None)}
    events: list[BatchEvent] = ([("a1", 1, 1, 0, b"x", [])] * 2 + [("a2", 2, 1, 0, b"x", [])] * 2
                                + [("b", 1, 1, 0, b"xx", [])] * 3 + [("c", 1, 1, 0, b"x", [])] * 7)
    plan = plan_partitions(events, targets, 3, split_events=5)
    # The two shards of target 0 share a group; target 2 (7 events, more than a third of the
    # batch's 14) is split, in order.
    assert sorted(sorted({e[0] for e in p}) for p in plan.local) == [["a1", "a2"], ["b"]]
    assert plan.split == [("c", 1, 1, 0, b"x", [])] * 7
    assert len(plan_partitions(events, targets, 1, split_events=5).local) == 1
    # Two partitions: target 2 is no more than its fair share (7 of 14), so nothing is split:
    # units that fill the partitions between them need no shuffle.
    halves = plan_partitions(events, targets, 2, split_events=5)
    assert halves.split == [] and sorted(len(p) for p in halves.local) == [7, 7]
    # A message of several parts counts each part it holds: two messages of 3 parts are 6 events.
    messages: list[BatchEvent] = [("b", 1, 1, 0, b"m", [0, 1, 2]), ("b", 2, 4, 0, b"n", [0, 1, 2])]
    assert plan_partitions(messages, targets, 2, split_events=5).split == messages
    assert plan_partitions(messages, targets, 1, split_events=5).split == []  # the only partition
    assert plan_partitions(messages[:1], targets, 2, split_events=5).local == [messages[:1]]
