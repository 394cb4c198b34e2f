"""Rows larger than a NATS message, end to end with real processes: MariaDB binlog -> capture
(chunks under the server's 1 MiB max_payload) -> JetStream -> sink-worker (joins them, Spark
with the large values kept out of the JVM) -> MariaDB, PostgreSQL and SQLite, row for row by
checksum: rows of 1 and 4 MB (LONGBLOB) and of 4-12 MB (JSON, LONGTEXT) on three downstreams at
once, rows of 64 MB (one copied by the initial load) on the MariaDB downstream, the worker's peak
memory bounded (1 GB Spark driver); and a 32 MB row on one downstream across a kill -9 of the
capture between its chunks.

The 64 MB rows go to one downstream only: each dialect's handling of large values is the same
for 4 MB as for 64 MB (the values never enter the JVM), while every downstream that takes a
64 MB row costs the worker a join, a write and a checksum of it, minutes on a loaded 2-core
machine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.rows import ColumnV1, TableMetaV1
from libs.changefeeds import record_changefeed
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.streams import ROWS_STREAM, rows_subject
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.validation.verify import ShardRef, verify_targets
from tests.helpers.e2e import _capture, _changefeed, _created, _delete_changefeeds_afterwards  # noqa: F401 - fixture
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration

MB = 1024 * 1024
TABLES = ("blobs", "docs")
HUGE = "huge"
SCHEMA = (
    "CREATE TABLE blobs (id INT PRIMARY KEY, note VARCHAR(20), b LONGBLOB)",
    f"CREATE TABLE {HUGE} (id INT PRIMARY KEY, note VARCHAR(20), b LONGBLOB)",
    "CREATE TABLE docs (id INT PRIMARY KEY, note VARCHAR(20), j JSON, t LONGTEXT)",
)


@pytest.fixture
def downstream_mariadb(mariadb_factory: Callable[..., MariaDB]) -> MariaDB:
    return mariadb_factory()


def _worker(env: dict[str, str], logs: Path, name: str) -> ServiceProcess:
    # Large values never enter the JVM (services/sink_worker/round/large_values.py), so the driver
    # gets what the other process tests give it. The pull budget keeps each span's round to its
    # large rows and little else.
    return ServiceProcess("services.sink_worker", {
        **env, **STANDALONE_WORKER_ENV,
        "SLUICE_SINK_PULL_MAX_BYTES": str(32 * MB),
    }, logs, instance_id=name).start()


def _descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *_descendants(child)]
    return out


def _peak_rss(pid: int) -> dict[str, int]:
    """Peak resident memory (VmHWM, bytes) of the worker's process, its JVM and its Python
    task processes (each its largest), from /proc."""
    peaks: dict[str, int] = {}
    for p in [pid, *_descendants(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "VmHWM" not in fields:
            continue  # exited meanwhile (a zombie has no memory to report)
        kind = "worker" if p == pid else "jvm" if b"java" in cmdline.split(b"\0")[0] else "python tasks"
        hwm = int(fields["VmHWM"].split()[0]) * 1024
        peaks[kind] = max(peaks.get(kind, 0), hwm)
    return peaks


def _setup(source: MariaDB, db: str) -> None:
    source.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}")
    source.execute(*SCHEMA, database=db)


def _run(source: MariaDB, db: str, *statements: tuple[str, tuple[object, ...]]) -> None:
    conn = source.connect(db)
    try:
        with conn.cursor() as cur:
            for sql, args in statements:
                cur.execute(sql, args)
        conn.commit()
    finally:
        conn.close()


def _markers(url: str, db: str, table: str) -> list[tuple[int, str | None]]:
    """``(id, note)`` of every row: cheap to read, and a transaction's note says it arrived."""
    meta = TableMetaV1(columns=[ColumnV1(name="id", sql_type="int", kind="int", nullable=False),
                                ColumnV1(name="note", sql_type="varchar(20)", kind="string")],
                       primary_key=["id"])
    target = TargetTable(schema=db, name=table, meta=meta, key=("id",))
    return [(int(r["id"]), r["note"]) for r in open_sink(url).fetch_rows(target)]


def _wait_equal(source: MariaDB, db: str, sink_urls: list[str], timeout: float,
                procs: list[ServiceProcess], huge_url: str | None = None) -> None:
    """Until every downstream has the source's rows and notes, then equal by checksum. The
    ``huge`` table is compared on ``huge_url`` only (the downstream that replicates it)."""
    deadline = time.monotonic() + timeout
    pairs = [(url, t) for url in sink_urls for t in TABLES] + ([(huge_url, HUGE)] if huge_url else [])
    want = {t: source.execute(f"SELECT id, note FROM {db}.{t} ORDER BY id") for _, t in pairs}
    wanted = {t: [(int(r[0]), r[1]) for r in rows] for t, rows in want.items()}
    last = "nothing compared yet"
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        try:
            got = {(url, t): _markers(url, db, t) for url, t in pairs}
        except Exception as exc:  # a target table appears with its first batch
            last = repr(exc)
        else:
            behind = {k: v for k, v in got.items() if v != wanted[k[1]]}
            if not behind:
                break
            last = f"rows and notes differ: {behind}; wanted {wanted}"
        time.sleep(0.5)
    else:
        logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(15)}\nhealth: {p.health()}" for p in procs)
        pytest.fail(f"downstream did not converge within {timeout}s:\n{last}\n{logs}")
    by_table: dict[str, list[str]] = {}
    for url, t in pairs:
        by_table.setdefault(t, []).append(url)
    results = [r for t, urls in by_table.items()
               for r in verify_targets([ShardRef(source.url, db, t)], urls, db, t)]
    assert all(r.ok for r in results), "\n".join(f"{r.target}: {r.diff}" for r in results if not r.ok)


def _json_doc(n: int, size: int) -> str:
    # A real-looking document: many small members, not one long string.
    items = ",".join(f'{{"i":{i},"name":"item-{n}-{i}","tags":["a","b"]}}' for i in range(size // 40))
    return f'{{"id":{n},"items":[{items}]}}'


# Peak resident memory the worker may reach with a span holding a 64 MB row's insert and update
# images in one round beside the other spans' rounds (DESIGN.md, "Rows larger than a NATS message").
WORKER_RSS_BOUND = 2600 * MB
JVM_RSS_BOUND = 1600 * MB  # a 1 GB heap and the JVM's own


async def _snapshot_changefeed(js: JetStreamContext, cf_id: str, source_id: str, source: MariaDB,
                               db: str, sink_url: str, tables: tuple[str, ...]) -> None:
    spec = ChangefeedSpecV2(id=cf_id, sources=[SourceRefV1(id=source_id, url=source.url)],
                            filter=TableFilterV1(include=[f"{db}.{t}" for t in tables]), sink_url=sink_url,
                            initial_load="snapshot")
    await record_changefeed(js, spec, requested_by="test")
    _created.append(cf_id)


@pytest.mark.timeout(1200)
async def test_rows_of_1_4_and_64_mb_reach_three_downstreams_in_bounded_memory(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],
) -> None:
    db = "e2e_big"
    _setup(mariadb, db)
    # Already there when the changefeeds start: copied by the initial load.
    _run(mariadb, db, (f"INSERT INTO {HUGE} VALUES (50, 'copied', REPEAT(UNHEX('A1B2C3D4'), %s))",
                       (64 * MB // 4,)),
         ("INSERT INTO blobs VALUES (50, 'copied', REPEAT(UNHEX('A1B2C3D4'), %s))", (4 * MB // 4,)))
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "e2ebig", db)
    processes.append(capture)
    capture.wait_healthy(60)
    for i, url in enumerate(sinks):
        tables = (*TABLES, HUGE) if url == downstream_mariadb.url else TABLES
        await _snapshot_changefeed(js, f"e2e-big-{i}", "e2ebig", mariadb, db, url, tables)
    worker = _worker(service_env, logs, "worker-e2ebig")
    processes.append(worker)
    worker.wait_healthy(60)

    for table, n, size in (("blobs", 1, 1 * MB), ("blobs", 2, 4 * MB), (HUGE, 3, 64 * MB)):
        _run(mariadb, db,
             (f"INSERT INTO {table} VALUES (%s, 'small', 'tiny')", (n + 100,)),
             (f"INSERT INTO {table} VALUES (%s, %s, RANDOM_BYTES(1024))", (n, f"{size} bytes")),
             (f"UPDATE {table} SET b = REPEAT(b, %s) WHERE id = %s", (size // 1024, n)))
    _run(mariadb, db,
         ("INSERT INTO docs VALUES (1, 'a', %s, REPEAT('t', %s))", (_json_doc(1, 1 * MB), 1 * MB)),
         ("INSERT INTO docs VALUES (2, 'b', %s, REPEAT('u', %s))", (_json_doc(2, 4 * MB), 1024)))
    _run(mariadb, db, ("INSERT INTO docs VALUES (3, 'c', %s, REPEAT('ü', %s))",
                       (_json_doc(3, 8 * MB), 4 * MB)))
    huge_url = downstream_mariadb.url
    await asyncio.to_thread(_wait_equal, mariadb, db, sinks, 600, processes, huge_url)

    # An update of the big row (new image, same key), a key change of a 4 MB row, a delete.
    _run(mariadb, db, (f"UPDATE {HUGE} SET b = REVERSE(b), note = 'reversed' WHERE id = 3", ()),
         ("UPDATE blobs SET id = 20 WHERE id = 2", ()),
         ("DELETE FROM docs WHERE id = 3", ()),
         ("UPDATE docs SET t = REPEAT('v', %s), note = 'longer' WHERE id = 2", (5 * MB,)))
    await asyncio.to_thread(_wait_equal, mariadb, db, sinks, 600, processes, huge_url)
    _run(mariadb, db, (f"DELETE FROM {HUGE} WHERE id = 3", ()), ("DELETE FROM blobs WHERE id = 1", ()))
    await asyncio.to_thread(_wait_equal, mariadb, db, sinks, 300, processes, huge_url)
    rows = mariadb.execute(f"SELECT id, LENGTH(b) FROM {db}.blobs ORDER BY id")
    assert [(int(r[0]), int(r[1])) for r in rows] == [(20, 4 * MB), (50, 4 * MB), (101, 4), (102, 4)]
    rows = mariadb.execute(f"SELECT id, LENGTH(b) FROM {db}.{HUGE} ORDER BY id")
    assert [(int(r[0]), int(r[1])) for r in rows] == [(50, 64 * MB), (103, 4)]
    assert mariadb.execute(f"SELECT LENGTH(t) FROM {db}.docs WHERE id = 2")[0][0] == 5 * MB
    assert worker.proc is not None
    peaks = _peak_rss(worker.proc.pid)
    print(f"peak RSS (MB): { {k: v // MB for k, v in peaks.items()} }")
    assert peaks["worker"] < WORKER_RSS_BOUND, peaks
    assert peaks["jvm"] < JVM_RSS_BOUND, peaks


async def _subject_count(js: JetStreamContext, subject: str) -> int:
    info = await js.stream_info(ROWS_STREAM, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


@pytest.mark.timeout(900)
async def test_kill_9_of_the_capture_between_chunks_of_a_32_mb_row(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    processes: list[ServiceProcess],
) -> None:
    db = "e2e_bigkill"
    _setup(mariadb, db)
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "e2ebigk", db)
    processes.append(capture)
    capture.wait_healthy(60)
    await _changefeed(js, "e2e-bigkill", "e2ebigk", mariadb, db, sink)
    worker = _worker(service_env, logs, "worker-e2ebigk")
    processes.append(worker)
    worker.wait_healthy(60)
    _run(mariadb, db, ("INSERT INTO blobs VALUES (1, 'before', 'x')", ()),
         ("INSERT INTO docs VALUES (1, 'before', '{}', 'x')", ()))
    await asyncio.to_thread(_wait_equal, mariadb, db, [sink], 300, processes)

    subject = rows_subject("e2ebigk", db, "blobs")
    base = await _subject_count(js, subject)
    # 32 MB of base64 in 1 MiB chunks: about 43 chunk messages.
    writer = asyncio.create_task(asyncio.to_thread(
        _run, mariadb, db, ("INSERT INTO blobs VALUES (2, 'big', REPEAT(UNHEX('00FF7A'), %s))",
                            (32 * MB // 3,)),
        ("UPDATE blobs SET note = 'after big' WHERE id = 1", ())))
    deadline = time.monotonic() + 120
    stored = 0
    while stored - base < 3:
        assert time.monotonic() < deadline, f"no chunks of the 32 MB row stored (count {stored - base})"
        stored = await _subject_count(js, subject)
        await asyncio.sleep(0.005)
    capture.kill()
    await writer
    partial = await _subject_count(js, subject) - base
    assert 3 <= partial < 40, f"the kill did not land between the chunks: {partial} stored"
    # The worker meanwhile holds the half set; a new capture publishes the rest (the chunks
    # already stored are deduplicated by id) and the row arrives whole.
    capture = _capture(service_env, logs, mariadb, "e2ebigk", db)
    processes.append(capture)
    _run(mariadb, db, ("UPDATE blobs SET b = REVERSE(b) WHERE id = 2", ()),
         ("UPDATE blobs SET note = 'reversed' WHERE id = 2", ()),
         ("UPDATE docs SET note = 'd', t = REPEAT('d', %s) WHERE id = 1", (8 * MB,)))
    await asyncio.to_thread(_wait_equal, mariadb, db, [sink], 600, [capture, worker])
