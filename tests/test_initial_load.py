"""Initial load with real processes: MariaDB (binlog) -> capture -> JetStream -> sink-worker
(Spark bulk copy, then streaming) -> SQLite. Tables that hold rows before the changefeed
exists are copied in primary-key chunks while the workload keeps writing; the worker is
killed with SIGKILL in the middle of the copy and resumes from its finished chunks; afterwards
every downstream table equals its upstream table. Also: snapshot-only, and binlog-only from a
start time and from a binlog position."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts.events.rows import SourcePositionV1
from libs.codec.table_meta import load_table_info
from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.service_process import ServiceProcess
from libs.scheduling.model import Span
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.snapshot.initial_load import InitialLoads, SnapshotOptions, SnapshotRequest
from services.sink_worker.snapshot.job import CopyJob, connect_source, decode_key, encode_key, plan_chunks
from services.sink_worker.snapshot.plan import SnapshotProgress
from services.sink_worker.span.checkpoints import CheckpointStore
from services.sink_worker.span.runtime import SpanConfig
from tests.helpers.capture import eventually, last_resolved, source_messages
from tests.helpers.initial_load import (
    _capture,
    _changefeed,
    _delete_changefeeds_afterwards,  # noqa: F401 - fixture
    _equal,
    _prefill,
    _progress,
    _wait_equal,
    _wait_progress,
    _worker,
)
from tests.helpers.workload import RandomWorkload, run_in_thread


async def test_snapshot_under_writes_survives_kill_9_and_resumes_from_finished_chunks(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    processes: list[ServiceProcess],
) -> None:
    db = "snap_kill"
    workload = RandomWorkload(mariadb.connect(), db, seed=8)
    workload.create_tables()
    await asyncio.to_thread(_prefill, mariadb, db, workload, 4_000)
    tables = ["accounts", "events", "select", "pairs", "empty_one"]
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "snapk", db)
    processes.append(capture)
    capture.wait_healthy(60)
    # Small chunks, one at a time: the copy of `accounts` takes many waves, so the kill lands
    # in the middle of it.
    chunking = {"SLUICE_SNAPSHOT_CHUNK_ROWS": "250", "SLUICE_SNAPSHOT_PARALLELISM": "2",
                "SLUICE_SNAPSHOT_WRITE_ROWS": "100"}
    await _changefeed(js, "snap-kill", "snapk", mariadb, f"{db}.*", sink, "snapshot")
    worker = _worker(service_env, logs, "worker-snapk", **chunking)
    processes.append(worker)

    stop = threading.Event()
    thread = run_in_thread(workload, stop, txn_size=4, pause_s=0.1)
    try:
        span = Span.of("snap-kill", "snapk", db, "accounts")
        before = await _wait_progress(js, span, lambda p: p.chunks_done >= 2, 180,
                                      "a wave of accounts chunks copied", [capture, worker])
        assert before.chunks_total >= 12 and before.low_watermark_ts is not None
        worker.kill()
        at_kill = await _progress(js, span)
        assert at_kill is not None and 2 <= at_kill.chunks_done < at_kill.chunks_total, at_kill
        worker = _worker(service_env, logs, "worker-snapk", **chunking)
        processes.append(worker)
        done = await _wait_progress(js, span, lambda p: p.state == "done", 240,
                                    "the resumed snapshot of accounts", [capture, worker])
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
    # The second run started from the chunks the first one finished, with the same plan and
    # low watermark, and did not copy them again.
    assert done.runs == 2
    assert done.resumed_chunks >= at_kill.chunks_done
    assert done.low_watermark_ts == before.low_watermark_ts
    # The plan is the first run's, its open last chunk cut as the copy reached it (rows the
    # workload inserted since the plan land there).
    assert done.chunks_done == done.chunks_total >= before.chunks_total
    assert done.chunks[:before.chunks_total - 1] == before.chunks[:-1]
    assert done.chunks[-1][1] is None and done.chunks[before.chunks_total - 1][0] == before.chunks[-1][0]
    assert done.high_watermark_ts is not None and done.high_watermark_ts >= done.low_watermark_ts
    assert done.rows_estimate > 0 and done.rows_copied > 0
    empty = await _wait_progress(js, Span.of("snap-kill", "snapk", db, "empty_one"),
                                 lambda p: p.state == "done", 120, "the empty table's snapshot", [worker])
    assert empty.rows_copied == 0 and empty.chunks_total == 1
    await asyncio.to_thread(_wait_equal, mariadb, db, tables, sink, 240, [capture, worker])
    assert workload.statements > 0

    # The span leaves the snapshot state at its next round after the copy is recorded done.
    def accounts_replicating() -> bool:
        health = worker.health() or {}
        return {s["table"]: s["state"] for s in health.get("spans", [])}.get("accounts") == "replicating"

    await asyncio.to_thread(wait_until, accounts_replicating, 60,
                            "the accounts span replicating after its copy")


def _binlog_position(source: MariaDB) -> SourcePositionV1:
    conn = source.connect()
    with conn.cursor() as cur:
        cur.execute("SHOW MASTER STATUS")
        file, pos = cur.fetchone()[:2]
    conn.close()
    return SourcePositionV1(binlog_file=str(file), binlog_pos=int(pos))


def _insert(source: MariaDB, db: str, ids: range) -> None:
    conn = source.connect()
    with conn.cursor() as cur:
        for i in ids:
            cur.execute(f"INSERT INTO `{db}`.items VALUES (%s, %s)", (i, f"v{i}"))
    conn.close()


def _ids(sink: str, db: str) -> list[int]:
    import sqlite3

    path = sink.removeprefix("sqlite:///")
    try:
        with sqlite3.connect(path) as conn:
            return sorted(int(r[0]) for r in conn.execute('SELECT id FROM "items"'))
    except sqlite3.OperationalError:
        return []


async def test_snapshot_only_and_binlog_only_from_a_time_and_a_position(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    processes: list[ServiceProcess],
) -> None:
    db = "snap_modes"
    conn = mariadb.connect()
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{db}`")
        cur.execute(f"CREATE TABLE `{db}`.items (id INT PRIMARY KEY, v VARCHAR(16))")
    conn.close()
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "snapm", db)
    processes.append(capture)
    capture.wait_healthy(60)
    # Capture pins the source's start with its first mark: rows committed before that are not
    # in the stream (the "too-early" feed below shows what a start point before it gets).
    await eventually(lambda: _has_mark(js, "snapm"), 60, "capture's first mark of snapm")
    await asyncio.to_thread(_insert, mariadb, db, range(1, 6))
    position = await asyncio.to_thread(_binlog_position, mariadb)
    await asyncio.to_thread(_insert, mariadb, db, range(6, 11))
    # The binlog stamps commits in whole seconds: start at the next second boundary, wait for
    # the clock to pass it, then commit the rows that must be streamed.
    start_time = datetime.fromtimestamp(math.ceil(time.time() + 0.5), UTC)
    await asyncio.sleep((start_time - datetime.now(UTC)).total_seconds() + 0.05)
    assert datetime.now(UTC) > start_time
    await asyncio.to_thread(_insert, mariadb, db, range(11, 16))
    sinks = {name: f"sqlite:///{tmp_path / (name + '.db')}" for name in ("only", "time", "pos")}
    await _changefeed(js, "snap-only", "snapm", mariadb, f"{db}.*", sinks["only"], "snapshot-only")
    await _changefeed(js, "from-time", "snapm", mariadb, f"{db}.*", sinks["time"], "binlog-only",
                      start_time=start_time)
    await _changefeed(js, "from-pos", "snapm", mariadb, f"{db}.*", sinks["pos"], "binlog-only",
                      start_position={"snapm": position})
    await _changefeed(js, "too-early", "snapm", mariadb, f"{db}.*", f"sqlite:///{tmp_path / 'early.db'}",
                      "binlog-only", start_position={"snapm": SourcePositionV1(
                          binlog_file=position.binlog_file, binlog_pos=4)})
    worker = _worker(service_env, logs, "worker-snapm")
    processes.append(worker)
    procs = [capture, worker]
    await _wait_progress(js, Span.of("snap-only", "snapm", db, "items"), lambda p: p.state == "done", 180,
                         "the snapshot-only copy", procs)
    assert _ids(sinks["only"], db) == list(range(1, 16))
    await asyncio.to_thread(wait_until, lambda: _ids(sinks["time"], db) == list(range(11, 16)), 180,
                            "binlog-only from a time: exactly the rows committed after it")
    try:
        await asyncio.to_thread(wait_until, lambda: _ids(sinks["pos"], db) == list(range(6, 16)), 60,
                                "binlog-only from a position: exactly the rows after it")
    except TimeoutError as exc:  # whether rows are missing, extra or only late
        stream = "\n".join(f"seq {m.seq} {m.subject} ts {getattr(m.event, 'ts', None)} "
                           f"position {getattr(m.event, 'position', None)} "
                           f"ids {[r.after.get('id') for r in getattr(m.event, 'rows', []) if r.after]}"
                           for m in await source_messages(js, "snapm"))
        raise AssertionError(f"{exc}: ids {_ids(sinks['pos'], db)}; start position {position}\n"
                             f"the source's stream:\n{stream}\n{worker.tail_log(40)}") from None
    # Later writes stream to the binlog-only feeds but not to the snapshot-only one.
    await asyncio.to_thread(_insert, mariadb, db, range(16, 18))
    await asyncio.to_thread(wait_until, lambda: _ids(sinks["time"], db)[-1:] == [17], 60,
                            "binlog-only keeps streaming")
    await asyncio.to_thread(wait_until, lambda: _ids(sinks["pos"], db)[-1:] == [17], 60,
                            "binlog-only keeps streaming")
    assert _ids(sinks["only"], db) == list(range(1, 16))

    def state_of(changefeed: str) -> str | None:
        for s in (worker.health() or {}).get("spans", []):
            if (s["changefeed"], s["table"]) == (changefeed, "items"):
                return str(s["state"])
        return None

    await asyncio.to_thread(wait_until, lambda: state_of("snap-only") == "done", 60,
                            "the snapshot-only span reported done")
    assert state_of("from-time") == state_of("from-pos") == "replicating"
    # A start position before the point capture began the source from is refused with the
    # reason, not served from the stream's first event on (which would skip what was never read).
    early = next(s for s in worker.health()["spans"] if s["changefeed"] == "too-early")
    assert early["state"] == "error", early
    assert "before the source's stream begins" in early["incident"]["error"], early


async def _has_mark(js: JetStreamContext, source: str) -> bool:
    return await last_resolved(js, source) is not None


async def test_a_span_moved_mid_copy_hands_over_and_the_next_owner_resumes(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    spark: SparkSession, processes: list[ServiceProcess],
) -> None:
    """Two pipelines in one process stand for two workers (the control plane's stop on the old
    member, then the new member runs the span): the old one stops mid-copy, its copy job has
    ended when ``stop_span`` returns, and the new one copies only the chunks not done."""
    db = "snap_move"
    conn = mariadb.connect()
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{db}`")
        cur.execute(f"CREATE TABLE `{db}`.items (id INT PRIMARY KEY, v VARCHAR(16))")
        cur.execute(f"INSERT INTO `{db}`.items SELECT seq, CONCAT('v', seq) FROM `{db}`.seq_1_to_1500")
    capture = _capture(service_env, tmp_path / "logs", mariadb, "snapmv", db)
    processes.append(capture)
    capture.wait_healthy(60)
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    span = Span.of("snap-move", "snapmv", db, "items")
    config = SpanConfig(sink_url=sink, initial_load="snapshot", source_url=mariadb.url)
    options = SnapshotOptions(chunk_rows=150, parallelism=1, write_rows=50, retry_s=1.0)

    def pipeline(worker: str) -> Pipeline:
        loads = InitialLoads(js, lambda: spark, options, worker_id=worker)
        return Pipeline(js, checkpoints, lambda: spark, initial_loads=loads)

    checkpoints = await CheckpointStore(js).open()
    old = pipeline("old")
    await old.set_spans({span: config})
    await old.round()  # starts the copy in the background
    assert old.spans[span].state == "snapshot"
    moved = await _wait_progress(js, span, lambda p: p.chunks_done >= 2, 120, "two chunks copied", [capture])
    assert moved.state == "copying"
    with conn.cursor() as cur:  # changes during the copy, before and after the move
        cur.execute(f"UPDATE `{db}`.items SET v = 'changed' WHERE id % 97 = 0")
        cur.execute(f"DELETE FROM `{db}`.items WHERE id % 89 = 0")
    assert await old.stop_span(span) is None  # no checkpoint yet: it was copying
    assert old.initial_loads is not None and not old.initial_loads.copying(span)
    at_stop = await _progress(js, span)
    assert at_stop is not None and at_stop.state == "copying" and at_stop.chunks_done < at_stop.chunks_total
    assert await checkpoints.get(span) is None

    new = pipeline("new")
    await new.set_spans({span: config})
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO `{db}`.items VALUES (5000, 'late'), (5001, 'later')")
    deadline = time.monotonic() + 180
    while new.spans[span].state != "replicating" and time.monotonic() < deadline:
        await new.round()
        await asyncio.sleep(0.2)
    done = await _progress(js, span)
    assert done is not None and done.state == "done", done
    assert done.runs == 2 and done.worker == "new"
    assert done.resumed_chunks >= at_stop.chunks_done
    assert done.low_watermark_ts == at_stop.low_watermark_ts
    stored = await checkpoints.get(span)
    assert stored is not None and done.low_watermark_ts is not None
    assert stored.ts >= done.low_watermark_ts  # streaming started there
    while _equal(mariadb, db, ["items"], sink) is not None and time.monotonic() < deadline:
        await new.round()
        await asyncio.sleep(0.2)
    assert _equal(mariadb, db, ["items"], sink) is None
    after = await checkpoints.get(span)
    assert after is not None and after.covers(stored)
    await new.close()
    await old.close()
    conn.close()


def _no_spark() -> SparkSession:
    raise AssertionError("this test copies nothing")


async def test_the_open_last_chunk_is_cut_as_the_copy_reaches_it(
    js: JetStreamContext, mariadb: MariaDB, tmp_path: Path,
) -> None:
    """Rows inserted after the plan all fall in its open-ended last chunk: the runner cuts that
    chunk to ``chunk_rows`` by walking the key when the next wave reaches it, and records the
    cut plan before copying any of it."""
    db = "snap_tail"
    mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}",
                    f"CREATE TABLE {db}.t (id INT PRIMARY KEY, v INT)",
                    f"INSERT INTO {db}.t SELECT seq, seq FROM {db}.seq_1_to_10")
    conn = connect_source(mariadb.url)
    info = load_table_info(conn, db, "t")
    assert info is not None
    meta, key = info.meta(), ("id",)
    chunks = plan_chunks(conn, db, "t", key, meta, 4, 10)
    conn.close()
    assert [(c.lower, c.upper) for c in chunks] == [(None, (4,)), ((4,), (8,)), ((8,), None)]
    mariadb.execute(f"INSERT INTO {db}.t SELECT seq, seq FROM {db}.seq_11_to_30")  # after the plan
    span = Span.of("tail-cut", "src", db, "t")
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    progress = SnapshotProgress(changefeed=span.changefeed, source=span.source, database=db, table="t")
    progress.set_plan(key, chunks, encode_key(meta, key))
    loads = InitialLoads(js, _no_spark, SnapshotOptions(chunk_rows=4, parallelism=2),
                         bucket="sluice-snapshots-tailcut")
    await loads.store.delete(span)
    revision = await loads.store.put(span, progress, 0)
    job = CopyJob(source_url=mariadb.url, database=db, table="t", chunk_key=key,
                  target=TargetTable(schema=None, name="t", meta=meta, key=key), sink_url=sink)
    req = SnapshotRequest(span=span, source_url=mariadb.url, sink_url=sink, key_policy="primary",
                          mode="snapshot")
    pending, revision = await loads._bound_open_chunk(req, job, progress, chunks, revision)
    assert pending == chunks  # the open chunk is not in the next wave yet
    pending, revision = await loads._bound_open_chunk(req, job, progress, pending[2:], revision)
    # Cut as long as the wave has room: 9..12 and 13..16 go into it, the rest stays open.
    assert [(c.id, c.lower, c.upper) for c in pending] == [(2, (8,), (12,)), (3, (12,), (16,)),
                                                           (4, (16,), None)]
    stored, _ = await loads.store.get(span)
    assert stored is not None and stored.chunks_total == 5
    assert stored.pending(decode_key(meta, key))[2:] == pending
    await loads.store.delete(span)


async def test_a_small_table_is_copied_by_the_worker_and_a_larger_one_by_spark(
    js: JetStreamContext, mariadb: MariaDB, tmp_path: Path,
) -> None:
    """``inline_rows``: a table planned as one chunk is counted (exactly, up to the bound, since
    InnoDB's estimate can read 0 for a filled table) and copied on a thread of the worker when
    it is that small; one row more, or a plan of several chunks, and the copy is Spark's."""
    db = "snap_inline"
    mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}",
                    f"CREATE TABLE {db}.t (id INT PRIMARY KEY, v VARCHAR(20))",
                    f"INSERT INTO {db}.t SELECT seq, CONCAT('v', seq) FROM {db}.seq_1_to_10")
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    span = Span.of("inline", "src", db, "t")

    def prepared(options: SnapshotOptions) -> tuple[InitialLoads, SnapshotProgress, bool]:
        loads = InitialLoads(js, _no_spark, options, bucket="sluice-snapshots-inline")
        progress = SnapshotProgress(changefeed=span.changefeed, source=span.source, database=db, table="t")
        req = SnapshotRequest(span=span, source_url=mariadb.url, sink_url=sink, key_policy="primary",
                              mode="snapshot")
        job, chunks, small = loads._prepare(req, progress)
        assert job is not None and chunks
        return loads, progress, small

    assert not (await asyncio.to_thread(prepared, SnapshotOptions(inline_rows=9)))[2]
    assert not (await asyncio.to_thread(prepared, SnapshotOptions(inline_rows=0)))[2]
    assert not (await asyncio.to_thread(prepared, SnapshotOptions(inline_rows=100, chunk_rows=4)))[2]
    loads, progress, small = await asyncio.to_thread(prepared, SnapshotOptions(inline_rows=10))
    assert small and progress.chunks_total == 1
    req = SnapshotRequest(span=span, source_url=mariadb.url, sink_url=sink, key_policy="primary",
                          mode="snapshot")
    job, chunks, _ = await asyncio.to_thread(loads._prepare, req, progress)
    assert job is not None
    await loads.store.delete(span)
    revision = await loads.store.put(span, progress, 0)
    # _no_spark fails the copy if anything asks for a Spark session.
    await loads._copy_inline(req, job, progress, chunks[0], revision, time.time(), 0)
    stored, _ = await loads.store.get(span)
    assert stored is not None and stored.rows_copied == 10 and stored.chunks_done == 1
    with sqlite3.connect(tmp_path / "down.db") as down:
        got = down.execute("SELECT id, v FROM t ORDER BY id").fetchall()
    assert got == [(i, f"v{i}") for i in range(1, 11)]
    await loads.store.delete(span)
    await loads.close()
