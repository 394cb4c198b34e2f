"""Write fencing in the downstream (``sinks/write_fence.py``): a span's writes land only while
their owner holds the span's newest token, on every SQL downstream, in the sink's own
transactions and inside the apply job's Spark tasks.

The case it exists for: a worker killed while its apply or copy job still runs (on a Spark
Connect server, or a task finishing its partition after the JVM is gone) must not overwrite
what the span's next owner wrote. Here the "dead" owner is a writer holding the older token.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from contracts.events.rows import ColumnV1, TableMetaV1
from services.sink_worker.round.apply_job import TargetPlan, run_apply
from services.sink_worker.round.sort_job import SpanInput, run_sort
from services.sink_worker.sinks.base import TargetTable, Upsert
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.sinks.write_fence import WriteFence, WriteFenceLost, WriteFences
from tests import spark_workload
from tests.helpers.sinks import SINKS, Target, make_target

pytestmark = pytest.mark.integration

META = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                            ColumnV1(name="v", kind="string", sql_type="varchar(20)")],
                   primary_key=["id"])
SPAN = "cf.src.shop.items"


@pytest.fixture(params=SINKS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return make_target(request, request.param, tmp_path)


def _rows(target: Target, table: TargetTable) -> dict[int, str]:
    return {r["id"]: r["v"] for r in target.sink.fetch_rows(table)}


def _upsert(key: int, v: str) -> Upsert:
    return Upsert(key=(key,), row={"id": key, "v": v})


def _fenced(table: TargetTable, schema: str | None, token: int) -> TargetTable:
    return replace(table, fence=WriteFence(schema, ((SPAN, token),)))


def test_a_writer_whose_token_was_bumped_changes_nothing(target: Target) -> None:
    table = target.table("items", META)
    old = WriteFences("worker-old").take(target.sink, "url", target.schema, [SPAN])
    new = WriteFences("worker-new").take(target.sink, "url", target.schema, [SPAN])
    assert old is not None and new is not None
    assert old.tokens == ((SPAN, 1),) and new.tokens == ((SPAN, 2),)

    target.sink.apply_partition(replace(table, fence=new), [Upsert(key=(1,), row={"id": 1, "v": "new"})])
    with pytest.raises(WriteFenceLost, match="taken over"):
        target.sink.apply_partition(replace(table, fence=old), [Upsert(key=(1,), row={"id": 1, "v": "old"}),
                                                                Upsert(key=(2,), row={"id": 2, "v": "old"})])
    with pytest.raises(WriteFenceLost):
        target.sink.load_rows(replace(table, fence=old), ["id", "v"], [(1, "old"), (3, "old")])
    assert _rows(target, table) == {1: "new"}
    # The owner's own copy batches still land.
    assert target.sink.load_rows(replace(table, fence=new), ["id", "v"], [(3, "copy")]) == 1
    assert _rows(target, table) == {1: "new", 3: "copy"}


def test_a_fence_row_that_is_gone_refuses_too(target: Target) -> None:
    table = target.table("items", META)
    target.sink.take_write_fences(target.schema, ["cf.other"], "w")  # the fence table, not SPAN's row
    with pytest.raises(WriteFenceLost, match="no fence row"):
        target.sink.apply_partition(_fenced(table, target.schema, 1), [_upsert(1, "x")])
    assert _rows(target, table) == {}


def test_a_worker_takes_a_token_once_and_again_after_forgetting(target: Target) -> None:
    target.table("items", META)
    fences = WriteFences("w")
    first = fences.take(target.sink, "url", target.schema, [SPAN, "cf.src.shop.more"])
    again = fences.take(target.sink, "url", target.schema, [SPAN])
    assert first is not None and again is not None
    assert dict(first.tokens)[SPAN] == dict(again.tokens)[SPAN] == 1
    fences.forget(SPAN)
    back = fences.take(target.sink, "url", target.schema, [SPAN])
    assert back is not None and back.tokens == ((SPAN, 2),)


@pytest.mark.parametrize("kind", ["mariadb", "postgres"])
def test_the_bump_waits_for_a_write_in_flight_and_refuses_the_next(kind: str, request: pytest.FixtureRequest,
                                                                   tmp_path: Path) -> None:
    """A dead owner's transaction in flight at the takeover commits before the new token
    exists; every later one of it is refused (the shared lock on the fence row orders them)."""
    target = make_target(request, kind, tmp_path)
    table = target.table("items", META)
    sink = target.sink
    assert isinstance(sink, SqlSink)
    old = sink.take_write_fences(target.schema, [SPAN], "worker-old")
    assert old == {SPAN: 1}
    in_flight = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def slow_write(cur: Any) -> None:
        cur.execute(f"INSERT INTO {sink._table_ref(table, for_params=True)} (id, v) VALUES (1, 'old')")
        in_flight.set()
        assert release.wait(60)

    def old_owner() -> None:
        try:
            sink._run(slow_write, "the old owner's last partition",
                             fence=WriteFence(target.schema, ((SPAN, 1),)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    writer = threading.Thread(target=old_owner)
    writer.start()
    assert in_flight.wait(60)
    taken: list[dict[str, int] | None] = []
    taker = threading.Thread(
        target=lambda: taken.append(sink.take_write_fences(target.schema, [SPAN], "new")))
    taker.start()
    try:
        # Something must NOT happen here, so no condition to wait for: unheld, the bump is done
        # in milliseconds; held by the write's shared lock on the fence row, it is still waiting
        # after this window. (A probe of the server's lock waits was tried instead and missed the
        # wait in about one run in five under load, for reasons not found.)
        taker.join(3.0)
        assert taker.is_alive() and not taken, \
            "the token moved while a write holding the old one was in flight"
    finally:
        release.set()
        writer.join(60)
        taker.join(60)
    assert not errors, errors
    assert taken == [{SPAN: 2}]
    assert _rows(target, table) == {1: "old"}  # committed before the bump
    with pytest.raises(WriteFenceLost):
        sink.apply_partition(_fenced(table, target.schema, 1), [_upsert(1, "late")])
    sink.apply_partition(_fenced(table, target.schema, 2), [_upsert(1, "new")])
    assert _rows(target, table) == {1: "new"}


def test_the_apply_job_tasks_refuse_a_stale_token(spark: SparkSession, tmp_path: Path) -> None:
    """The check runs where the rows are written, in the Spark tasks (the fence travels
    pickled with the plan): a job holding a bumped token writes nothing."""
    from services.sink_worker.sinks.factory import open_sink

    url = f"sqlite:///{tmp_path / 'down.db'}"
    sink = open_sink(url)
    tables = {name: TargetTable(schema=None, name=name, meta=spark_workload._meta(name), key=("id",),
                                unique_keys=tuple(tuple(k) for k in spark_workload._meta(name).unique_keys))
              for name in ("people", "pets")}
    for table in tables.values():
        sink.ensure_table(table)
    routes = (("shop/people", "people"), ("shop2/people", "people"), ("shop/pets", "pets"))
    dead, alive = WriteFences("dead"), WriteFences("alive")

    def plans(fences: WriteFences) -> dict[str, TargetPlan]:
        out = {}
        for span, name in routes:
            spans = [s for s, n in routes if n == name]
            fence = fences.take(sink, url, None, spans)
            out[span] = TargetPlan(target_id=name, sink_url=url, table=replace(tables[name], fence=fence))
        return out

    stale = plans(dead)
    current = plans(alive)  # the takeover: every span's token bumped
    sort = run_sort(spark_workload.records(), [SpanInput(span, 0, spark_workload.HORIZON) for span in stale])
    with pytest.raises(Exception, match="taken over"):
        run_apply(spark, sort.batch(sorted(stale)), stale, 3, split_events=spark_workload.SPLIT_EVENTS)
    assert all(sink.fetch_rows(t) == [] for t in tables.values())
    result = run_apply(spark, sort.batch(sorted(current)), current, 3,
                       split_events=spark_workload.SPLIT_EVENTS)
    assert not result.failures
    written = {name: sorted(sink.fetch_rows(t), key=lambda r: r["id"]) for name, t in tables.items()}
    assert written == spark_workload.expected()


def test_kept_writes_share_one_connection_and_a_failed_one_is_not_kept(target: Target) -> None:
    """The apply job writes a partition's targets over one connection (``keep``), a transaction
    each: the fence is checked in every one, and a connection whose transaction failed is
    closed, never handed to the next write."""
    sink = target.sink
    assert isinstance(sink, SqlSink)
    table = target.table("items", META)
    old = WriteFences("worker-old").take(sink, "url", target.schema, [SPAN])
    new = WriteFences("worker-new").take(sink, "url", target.schema, [SPAN])
    assert old is not None and new is not None
    opened: list[Any] = []
    connect = sink._connect

    def counting() -> Any:
        opened.append(connect())
        return opened[-1]

    sink._connect = counting  # type: ignore[method-assign]
    try:
        for i in range(5):
            sink.apply_partition(replace(table, fence=new), [_upsert(i, "new")], keep=True)
        assert len(opened) == 1 and sink._kept is opened[0]
        with pytest.raises(WriteFenceLost):
            sink.apply_partition(replace(table, fence=old), [_upsert(9, "old")], keep=True)
        assert sink._kept is None  # the failed transaction's connection was closed, not kept
        sink.apply_partition(replace(table, fence=new), [_upsert(5, "new")], keep=True)
        assert len(opened) == 2 and sink._kept is opened[1]
    finally:
        sink.close()
        sink._connect = connect  # type: ignore[method-assign]
    assert sink._kept is None
    assert _rows(target, table) == {i: "new" for i in range(6)}
