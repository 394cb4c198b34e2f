"""The data path against the real things: nats-server, local Spark, SQLite / MariaDB / PostgreSQL.

Events are published by hand here (the capture's own end-to-end tests come later), each test
with its own source id, so tests share the ROWS stream without seeing each other's spans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pyspark.sql import SparkSession

from contracts.events.rows import (
    ResolvedAdvancedV1,
    RowImageV2,
    RowsChangedV2,
    TableMetaV1,
)
from libs.eventstore import EventStore
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.scheduling.model import Span
from libs.streams import (
    DEADLETTER_STREAM,
    ROWS_STREAM,
    ROWS_SUBJECTS,
    rows_subject,
)
from libs.telemetry.tracing import setup_tracing
from services.sink_worker.round.pull import PullResult, SpanReader, latest_resolved
from services.sink_worker.span.checkpoints import (
    Checkpoint,
    CheckpointMoved,
    CheckpointRegression,
    CheckpointStore,
)
from tests.helpers.harness import (
    _POS,
    PEOPLE,
    Harness,
    Source,
    _seq,
    col,
    dele,
    ins,
    people,
    upd,
)

pytestmark = pytest.mark.integration

SPANS = InMemorySpanExporter()
setup_tracing("test", extra_processor=SimpleSpanProcessor(SPANS))


@pytest.fixture
async def rows_js(js: JetStreamContext) -> JetStreamContext:
    # Capture owns the real stream set-up; this is the same shape (rolled-up resolved marks).
    await EventStore(js, ROWS_STREAM, "test").ensure(ROWS_SUBJECTS, allow_rollup_hdrs=True)
    return js


@pytest.fixture
async def checkpoints(rows_js: JetStreamContext) -> CheckpointStore:
    return await CheckpointStore(rows_js).open()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'down.db'}"


@pytest.fixture
async def h(rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
            sqlite_url: str) -> Harness:
    return Harness(rows_js, checkpoints, spark, sqlite_url)


async def test_orders_by_ts_and_cuts_at_the_resolved_ts(h: Harness) -> None:
    await h.run("people")
    src = h.source
    t1 = await src.txn(h.db, "people", [ins(1, "ann", 30), ins(2, "bob", 40)])
    # One transaction in three messages; inside it, row order decides the final image.
    t2 = await src.txn(h.db, "people", [upd((1, "ann", 30), (1, "ann", 31)), ins(3, "cy", 50),
                                        upd((1, "ann", 31), (1, "ann", 32))], parts=3)
    await src.resolve(t2)
    t3 = await src.txn(h.db, "people", [dele(2, "bob", 40)])  # above the resolved ts
    report = await h.round()
    assert report.batch_events == 4 and report.rows_written == 3
    assert h.rows("people") == people((1, "ann", 32), (2, "bob", 40), (3, "cy", 50))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == t2 and t1 < cp.ts < t3
    # The held-back delete is the next thing the span reads.
    info = await h.js.get_msg(ROWS_STREAM, cp.stream_seq + 1)
    assert json.loads(info.data or b"")["data"]["ts"] == t3

    await src.resolve(t3)
    await h.round()
    assert h.rows("people") == people((1, "ann", 32), (3, "cy", 50))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == t3

    # Nothing pending: the checkpoint follows the resolved ts.
    idle = await src.resolve(src.next_ts())
    report = await h.round()
    assert report.batch_events == 0
    assert (await h.checkpoint("people")) == Checkpoint(cp.stream_seq, idle)


async def test_duplicates_and_replay_from_an_older_checkpoint_converge(h: Harness) -> None:
    await h.run("people")
    src = h.source
    first = RowsChangedV2(source=src.name, database=h.db, table="people", ts=src.next_ts(), seq=next(_seq),
                          position=_POS, meta=PEOPLE, rows=[ins(1, "ann", 1), ins(2, "bob", 2)])
    # At-least-once: the same event (same id) lands twice, around a later change of its rows.
    await src.publish(rows_subject(src.name, h.db, "people"), first, msg_id="dup-" + src.name)
    await src.txn(h.db, "people", [upd((1, "ann", 1), (1, "ann", 10))])
    await src.publish(rows_subject(src.name, h.db, "people"), first, msg_id="dup-" + src.name)
    await src.txn(h.db, "people", [dele(2, "bob", 2), ins(4, "dee", 4)])
    await src.resolve()
    await h.round()
    expected = people((1, "ann", 10), (4, "dee", 4))
    assert h.rows("people") == expected
    done = await h.checkpoint("people")
    assert done is not None and done.ts == src.last_ts

    # Rewind (operator reset to nothing): everything is read and applied again, same state.
    await h.checkpoints.reset(h.span("people"))
    await h.rounds_until(lambda: _at(h, "people", done))
    assert h.rows("people") == expected


async def test_several_transactions_a_message_are_cut_and_deduplicated_per_transaction(h: Harness) -> None:
    """rows.changed v4: the resolved ts may fall inside a message (its later transactions are
    read again from it, never skipped), and a copy cut otherwise (a re-read after a kill -9
    before the mark) is dropped transaction by transaction, by each one's id."""
    await h.run("people")
    src = h.source
    subject = rows_subject(src.name, h.db, "people")
    n = src.name
    _t1, t2, t3 = await src.batch(h.db, "people", [
        (f"{n}:gtid:0-1-1:shop.people:0", [ins(1, "ann", 1), ins(2, "bob", 2)]),
        (f"{n}:gtid:0-1-2:shop.people:0", [upd((1, "ann", 1), (1, "ann", 10))]),
        (f"{n}:gtid:0-1-3:shop.people:0", [ins(3, "cy", 3)])], msg_id=f"{n}:gtid:0-1-1:shop.people:0+3")
    await src.resolve(t2)
    report = await h.round()
    assert report.batch_events == 2
    assert h.rows("people") == people((1, "ann", 10), (2, "bob", 2))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == t2
    # The message is read again after the checkpoint: its third transaction is still to come.
    info = await h.js.get_msg(ROWS_STREAM, cp.stream_seq + 1)
    assert info.subject == subject and json.loads(info.data or b"")["data"]["more"][1]["ts"] == t3
    # The copy: the 2nd and 3rd again (same ids, ts, seq), then a new one, in one message.
    copied = [json.loads(info.data or b"")["data"]["more"][i]["seq"] for i in (0, 1)]
    t4 = src.next_ts()
    await src.batch(h.db, "people", [
        (f"{n}:gtid:0-1-2:shop.people:0", [upd((1, "ann", 1), (1, "ann", 10))]),
        (f"{n}:gtid:0-1-3:shop.people:0", [ins(3, "cy", 3)]),
        (f"{n}:gtid:0-1-4:shop.people:0", [dele(2, "bob", 2), upd((3, "cy", 3), (3, "cy", 30))])],
        msg_id=f"{n}:gtid:0-1-2:shop.people:0+3", ts=[t2, t3, t4], seqs=[*copied, next(_seq)])
    await src.resolve(t4)
    report = await h.round()
    assert report.batch_events == 2  # the 3rd once (both copies carry it), the 4th
    assert h.rows("people") == people((1, "ann", 10), (3, "cy", 30))
    done = await h.checkpoint("people")
    assert done is not None and done.ts == t4 and done.stream_seq >= cp.stream_seq

    # Rewind: the messages read again from the start converge on the same state.
    await h.checkpoints.reset(h.span("people"))
    await h.rounds_until(lambda: _at(h, "people", done))
    assert h.rows("people") == people((1, "ann", 10), (3, "cy", 30))


async def _at(h: Harness, table: str, cp: Checkpoint) -> bool:
    return await h.checkpoint(table) == cp


@pytest.mark.parametrize("sink", ["sqlite", "mariadb", "postgres"])
async def test_unique_key_lucy_case_in_one_batch(sink: str, rows_js: JetStreamContext,
                                                 checkpoints: CheckpointStore, spark: SparkSession,
                                                 sqlite_url: str, request: pytest.FixtureRequest) -> None:
    url = sqlite_url
    if sink == "mariadb":
        url = request.getfixturevalue("mariadb").url
    elif sink == "postgres":
        url = request.getfixturevalue("postgres").url
    h = Harness(rows_js, checkpoints, spark, url, db=f"lucy{uuid4().hex[:6]}")
    await h.run("sync_table")
    src = h.source
    # TDSQL's case: three transactions; (1,lucy) and (2,lucy) hash to different partitions.
    await src.txn(h.db, "sync_table", [ins(1, "lucy", 18)])
    await src.txn(h.db, "sync_table", [dele(1, "lucy", 18)])
    await src.txn(h.db, "sync_table", [ins(2, "lucy", 20)])
    await src.resolve()
    await h.round()
    assert h.rows("sync_table") == people((2, "lucy", 20))


async def test_unique_key_lucy_case_across_batches(mariadb: MariaDB, rows_js: JetStreamContext,
                                                   checkpoints: CheckpointStore, spark: SparkSession) -> None:
    h = Harness(rows_js, checkpoints, spark, mariadb.url, db=f"lucy{uuid4().hex[:6]}")
    await h.run("sync_table")
    src = h.source
    a = await src.txn(h.db, "sync_table", [ins(1, "lucy", 18)])
    b = await src.txn(h.db, "sync_table", [dele(1, "lucy", 18)])
    c = await src.txn(h.db, "sync_table", [ins(2, "lucy", 20)])
    for ts, state in ((a, people((1, "lucy", 18))), (b, []), (c, people((2, "lucy", 20)))):
        await src.resolve(ts)
        await h.round()
        assert h.rows("sync_table") == state
    # A replay of the last two batches at once from the first batch's checkpoint: same end.
    await h.checkpoints.reset(h.span("sync_table"), Checkpoint(0, a))
    await h.round()
    assert h.rows("sync_table") == people((2, "lucy", 20))


async def test_primary_key_change_and_batch_size_bound(
        postgres: PostgreSQL, rows_js: JetStreamContext, checkpoints: CheckpointStore,
        spark: SparkSession) -> None:
    # max_events=2: batches end mid-stream, and the 3-part transaction still lands whole.
    h = Harness(rows_js, checkpoints, spark, postgres.url, db=f"pk{uuid4().hex[:6]}", max_events=2)
    await h.run("people")
    src = h.source
    await src.txn(h.db, "people", [ins(1, "ann", 1), ins(2, "bob", 2)])
    await src.txn(h.db, "people", [upd((1, "ann", 1), (5, "ann", 1)), ins(1, "new", 9),
                                   upd((2, "bob", 2), (6, "bob", 3))], parts=3)
    await src.txn(h.db, "people", [upd((5, "ann", 1), (7, "ann", 1))])
    await src.resolve()
    await h.rounds_until(lambda: _at_ts(h, "people", src.last_ts))
    assert h.rows("people") == people((1, "new", 9), (6, "bob", 3), (7, "ann", 1))


async def test_an_older_transaction_landing_late_in_the_stream_is_not_lost(
        rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        sqlite_url: str) -> None:
    # Capture re-publishes from its last resolved mark after a lost publish: the lost (older)
    # transaction then lands after newer ones. Batches of one event must still apply it.
    h = Harness(rows_js, checkpoints, spark, sqlite_url, max_events=1)
    await h.run("people")
    src = h.source
    await src.txn(h.db, "people", [ins(1, "a", 1)])
    await src.txn(h.db, "people", [upd((1, "a", 1), (1, "a", 2))])
    t3, t4 = src.next_ts(), src.next_ts()
    for ts, rows in ((t4, [upd((1, "a", 2), (1, "a", 4))]), (t3, [ins(3, "c", 3)])):
        await src.publish(rows_subject(src.name, h.db, "people"), RowsChangedV2(
            source=src.name, database=h.db, table="people", ts=ts, seq=next(_seq), position=_POS,
            meta=PEOPLE, rows=rows))
    await src.resolve(t4)
    await h.rounds_until(lambda: _at_ts(h, "people", t4))
    assert h.rows("people") == people((1, "a", 4), (3, "c", 3))


async def _at_ts(h: Harness, table: str, ts: int) -> bool:
    cp = await h.checkpoint(table)
    return cp is not None and cp.ts >= ts


async def test_ddl_is_a_barrier(h: Harness) -> None:
    await h.run("people")
    src = h.source
    await src.txn(h.db, "people", [ins(1, "ann", 1)])
    wider = TableMetaV1(columns=[*PEOPLE.columns, col("city", "string", "varchar(20)")],
                        primary_key=["id"], unique_keys=[["name"]])
    ddl_ts = await src.ddl(h.db, "people", "ALTER TABLE people ADD COLUMN city varchar(20)", wider)
    await src.txn(h.db, "people", [RowImageV2(op="insert", after={"id": 2, "name": "bob", "age": 2,
                                                                   "city": "Oslo"})], meta=wider)
    await src.resolve()

    report = await h.round()  # rows before the DDL, then the DDL alone
    assert report.batch_events == 1 and report.ddl_applied == 1
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == ddl_ts
    assert h.rows("people", wider) == [{"id": 1, "name": "ann", "age": 1, "city": None}]

    await h.round()  # the rows after it, with the new column
    assert h.rows("people", wider) == [{"id": 1, "name": "ann", "age": 1, "city": None},
                                       {"id": 2, "name": "bob", "age": 2, "city": "Oslo"}]

    await src.ddl(h.db, "people", "TRUNCATE TABLE people", wider)
    await src.txn(h.db, "people", [RowImageV2(op="insert", after={"id": 3, "name": "cy", "age": 3,
                                                                   "city": None})], meta=wider)
    await src.resolve()
    await h.rounds_until(lambda: _at_ts(h, "people", src.last_ts))
    assert h.rows("people", wider) == [{"id": 3, "name": "cy", "age": 3, "city": None}]


async def test_keyless_table_stops_with_one_incident_until_resumed_under_a_key_policy_that_allows_it(
        rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        sqlite_url: str) -> None:
    logs = TableMetaV1(columns=[col("code", "string", "varchar(8)", nullable=False), col("n")],
                       primary_key=[], unique_keys=[["code"]])
    h = Harness(rows_js, checkpoints, spark, sqlite_url)
    await h.run("logs")
    src = h.source
    await src.txn(h.db, "logs", [RowImageV2(op="insert", after={"code": "a", "n": 1})], meta=logs)
    await src.txn(h.db, "logs", [RowImageV2(op="update", before={"code": "a", "n": 1},
                                            after={"code": "a", "n": 2})], meta=logs)
    await src.resolve()
    report = await h.pipeline.round()
    [status] = h.pipeline.status()
    assert status["state"] == "error"
    assert status["error"].startswith("stopped: the table cannot be replicated")
    assert "no primary key" in status["error"] and "key_policy" in status["error"]
    assert status["incident"]["kind"] == "unreplicable" and report.batch_events == 0
    assert await h.checkpoint("logs") is None  # nothing skipped past
    [(span, stop)] = h.pipeline.new_incidents  # recorded (and logged) once ...
    await h.round()
    assert len(h.pipeline.new_incidents) == 1  # ... not every round

    # The changefeed now allows a NOT NULL unique key: the table stays stopped until the
    # operator resumes its incident, then goes on from where it was.
    h.key_policy = "unique"
    await h.run("logs")
    await h.round()
    assert h.pipeline.status()[0]["state"] == "error"
    assert h.pipeline.act(span, stop.id, "resume")
    await h.round()
    assert h.pipeline.status()[0]["state"] == "replicating"
    assert h.rows("logs", logs) == [{"code": "a", "n": 2}]


async def test_garbage_on_a_span_subject_goes_to_dead_letter(h: Harness) -> None:
    await h.run("people")
    src = h.source
    subject = rows_subject(src.name, h.db, "people")
    await src.txn(h.db, "people", [ins(1, "ann", 1)])
    bad_json = await h.js.publish(subject, b"{not json", stream=ROWS_STREAM)
    wrong_type = await src.publish(subject, ResolvedAdvancedV1(source=src.name, ts=1, position=_POS))
    no_key = await src.publish(subject, RowsChangedV2(
        source=src.name, database=h.db, table="people", ts=src.next_ts(), seq=next(_seq), position=_POS,
        meta=PEOPLE, rows=[RowImageV2(op="insert", after={"name": "ghost"})]))
    # A bad part in the middle of a transaction: the rest of it still applies, the span goes on.
    ts = src.next_ts()
    bad_part = 0
    for part, image in enumerate([ins(5, "eve", 5), RowImageV2(op="insert", after={"id": 6, "bogus": 1}),
                                  ins(7, "fay", 7)]):
        seq = await src.publish(subject, RowsChangedV2(
            source=src.name, database=h.db, table="people", ts=ts, seq=next(_seq), part=part,
            last_part=part == 2, position=_POS, meta=PEOPLE, rows=[image]))
        bad_part = seq if part == 1 else bad_part
    await src.txn(h.db, "people", [ins(2, "bob", 2)])
    await src.resolve()
    await h.round()
    assert h.rows("people") == people((1, "ann", 1), (2, "bob", 2), (5, "eve", 5), (7, "fay", 7))
    assert h.pipeline.status()[0]["dead_lettered"] == 4
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == src.last_ts

    parked: dict[int, tuple[str, str]] = {}
    for seq in range(1, (await h.js.stream_info(DEADLETTER_STREAM)).state.last_seq + 1):
        try:
            msg = await h.js.get_msg(DEADLETTER_STREAM, seq)
        except Exception:
            continue
        hdrs = msg.headers or {}
        if hdrs.get("Sluice-Dead-Letter-Original-Subject") == subject:
            parked[int(hdrs["Sluice-Dead-Letter-Original-Seq"])] = (
                hdrs["Sluice-Dead-Letter-Kind"], hdrs["Sluice-Dead-Letter-Reason"])
    assert parked[bad_json.seq][0] == "malformed"
    assert parked[wrong_type][0] == "unexpected_type"
    assert parked[no_key][0] == "invalid_data" and "id" in parked[no_key][1]
    assert parked[bad_part][0] == "invalid_data" and "bogus" in parked[bad_part][1]


async def test_processing_continues_the_publish_trace(h: Harness) -> None:
    await h.run("people")
    SPANS.clear()
    await h.source.txn(h.db, "people", [ins(1, "ann", 1)])
    await h.source.resolve()
    await h.round()
    finished = SPANS.get_finished_spans()
    subject = rows_subject(h.source.name, h.db, "people")
    [published] = [s for s in finished if s.name == f"publish {subject}"]
    [process] = [s for s in finished if s.name == f"process {subject}"]
    assert process.parent is not None and published.context is not None
    assert (process.parent.trace_id, process.parent.span_id) == (published.context.trace_id,
                                                                 published.context.span_id)
    # The batch is a child of the (oldest) change's publish span; sort and apply are its children.
    [batch] = [s for s in finished if s.name == "sink batch"]
    assert batch.parent is not None and batch.parent.span_id == published.context.span_id
    assert batch.context is not None and batch.context.trace_id == published.context.trace_id
    for name in ("sort", "apply"):
        [child] = [s for s in finished if s.name == name]
        assert child.parent is not None and child.parent.span_id == batch.context.span_id, name
    assert "sink round" in {s.name for s in finished}


def _pulled(result: PullResult, checkpoint_ts: int, resolved: int) -> tuple[Any, ...]:
    """What a round sees of a pull (bodies by position, ghosts, horizon), comparable."""
    horizon = result.horizon(checkpoint_ts, resolved)
    return ([(e.stream_seq, e.ts, e.dead) for e in result.events], result.ghosts, result.reached,
            result.dead_lettered, result.event_bytes, horizon, result.first_seq_after(horizon))


def _next_checkpoint(result: PullResult, start: Checkpoint, resolved: int) -> Checkpoint:
    """Where a round that applied everything up to the horizon leaves the span (``_finish``)."""
    ts = max(start.ts, result.horizon(start.ts, resolved))
    pending = result.first_seq_after(ts)
    return Checkpoint(max(start.stream_seq, pending - 1 if pending is not None else result.read_upto), ts)


@pytest.mark.parametrize(("limit", "max_bytes"), [(100, 512 * 1024 * 1024), (3, 512 * 1024 * 1024),
                                                  (100, 2500)], ids=["in-memory", "ghosts", "max-bytes"])
async def test_read_ahead_fills_the_buffer_and_changes_no_later_pull(
        rows_js: JetStreamContext, limit: int, max_bytes: int) -> None:
    # Two readers of one span: `ahead` reads ahead while a round "writes", `plain` does not.
    # Every pull after that returns the same to both, at the same checkpoints.
    src = Source(rows_js)
    span = Span.of("cf", src.name, "shop", "people")
    ahead = SpanReader(rows_js, span, max_bytes=max_bytes)
    plain = SpanReader(rows_js, span, max_bytes=max_bytes)
    try:
        for i in range(4):
            await src.txn("shop", "people", [ins(i, f"n{i}", i)])
        mark = await latest_resolved(rows_js, src.name)  # none yet: nothing resolved
        assert mark is None
        await src.resolve()
        mark = await latest_resolved(rows_js, src.name)
        assert mark is not None
        first_mark, start = mark, Checkpoint()
        first = await ahead.pull((start.stream_seq, start.ts), limit, mark.stream_seq)
        assert _pulled(first, start.ts, mark.ts) == _pulled(
            await plain.pull((start.stream_seq, start.ts), limit, mark.stream_seq), start.ts, mark.ts)

        # Published while round 1's batch is written: rows, a transaction in parts, garbage.
        for i in range(4, 8):
            await src.txn("shop", "people", [ins(i, f"n{i}", i)])
        await src.txn("shop", "people", [ins(i, f"m{i}", i) for i in range(10, 13)], parts=3)
        garbage = await rows_js.publish(rows_subject(src.name, "shop", "people"), b"{not json",
                                        stream=ROWS_STREAM)
        await src.txn("shop", "people", [ins(20, "z", 20)])
        await src.resolve()
        mark = await latest_resolved(rows_js, src.name)
        assert mark is not None
        await ahead.read_ahead(mark.stream_seq, budget=limit)
        assert ahead.read_upto >= mark.stream_seq - 1  # everything before the mark is read
        if limit == 100 and max_bytes > 2500:
            read = [e.stream_seq for e in ahead.buffer if e.stream_seq > first.read_upto]
            assert len(read) == 4 + 3 + 1 and garbage.seq not in read  # dead-lettered already

        cp = _next_checkpoint(first, start, first_mark.ts)  # round 1 applied what it pulled
        for _ in range(20):
            got = await ahead.pull((cp.stream_seq, cp.ts), limit, mark.stream_seq)
            want = await plain.pull((cp.stream_seq, cp.ts), limit, mark.stream_seq)
            assert _pulled(got, cp.ts, mark.ts) == _pulled(want, cp.ts, mark.ts)
            cp, before = _next_checkpoint(got, cp, mark.ts), cp
            if cp == before:
                break
        assert cp.ts == mark.ts  # caught up, through the ghosts and the garbage
    finally:
        await ahead.close()
        await plain.close()


async def test_checkpoint_never_goes_backwards(checkpoints: CheckpointStore) -> None:
    span = Span.of("cf", f"s{uuid4().hex[:8]}", "db.with.dots", "t")
    assert await checkpoints.advance(span, Checkpoint(10, 100)) == Checkpoint(10, 100)
    assert await checkpoints.advance(span, Checkpoint(12, 150)) == Checkpoint(12, 150)
    for behind in (Checkpoint(11, 200), Checkpoint(20, 149), Checkpoint(0, 0)):
        with pytest.raises(CheckpointRegression):
            await checkpoints.advance(span, behind)
    assert await checkpoints.get(span) == Checkpoint(12, 150)


async def test_a_compare_and_set_from_the_last_seen_entry_is_one_write_and_sees_every_other_writer(
    checkpoints: CheckpointStore, rows_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch,
) -> None:
    span = Span.of("cf", f"s{uuid4().hex[:8]}", "db", "t")
    other = await CheckpointStore(rows_js).open()  # another process' store
    reads = 0
    real_get = checkpoints.kv.get

    async def counting_get(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        return await real_get(*args, **kwargs)

    monkeypatch.setattr(checkpoints.kv, "get", counting_get)
    assert await checkpoints.advance(span, Checkpoint(1, 10), expected=None) == Checkpoint(1, 10)
    assert reads == 1  # nothing known yet: read, then create
    assert await checkpoints.advance(span, Checkpoint(2, 20), expected=Checkpoint(1, 10)) == Checkpoint(2, 20)
    assert reads == 1  # from the entry it wrote: the update at its revision, no read
    with pytest.raises(CheckpointRegression):
        await checkpoints.advance(span, Checkpoint(1, 30), expected=Checkpoint(2, 20))
    # Another writer moves it: the remembered revision is stale, so the update is refused and the
    # store reads what they wrote.
    assert await other.advance(span, Checkpoint(3, 30)) == Checkpoint(3, 30)
    with pytest.raises(CheckpointMoved):
        await checkpoints.advance(span, Checkpoint(4, 40), expected=Checkpoint(2, 20))
    assert await checkpoints.advance(span, Checkpoint(4, 40), expected=Checkpoint(3, 30)) == Checkpoint(4, 40)
    # The same value written again by another writer is a new revision: refused, read, accepted.
    await other.reset(span, Checkpoint(4, 40))
    assert await checkpoints.advance(span, Checkpoint(5, 50), expected=Checkpoint(4, 40)) == Checkpoint(5, 50)
    await other.reset(span)  # deleted by an operator
    with pytest.raises(CheckpointMoved):
        await checkpoints.advance(span, Checkpoint(6, 60), expected=Checkpoint(5, 50))
    assert await checkpoints.get(span) is None
    assert await other.get(span) is None
    checkpoints.forget(span)  # it ran elsewhere meanwhile: the next store reads the entry first
    before = reads
    assert await checkpoints.advance(span, Checkpoint(7, 70), expected=None) == Checkpoint(7, 70)
    assert reads == before + 1 and await other.get(span) == Checkpoint(7, 70)
