"""The DDL matrix with real processes: MariaDB binlog -> capture -> JetStream -> sink-worker
(Spark) -> MariaDB, PostgreSQL and SQLite. Every schema change runs while a writer keeps
changing the tables, and every downstream must end up equal to the source row for row
(defaults of existing rows, widened types, renamed columns, changed keys included), with a
gh-ost and a pt-osc style cut-over, and a worker killed with SIGKILL in the middle of a re-copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NoKeysError

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.rows import ColumnV1, TableMetaV1
from libs.changefeeds import record_changefeed, record_state
from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.streams import SNAPSHOT_BUCKET
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.snapshot.plan import SnapshotProgress
from services.sink_worker.validation.verify import ShardRef, verify_target
from tests.helpers.definitions import (
    assert_follows_source,
    literal_defaults,
    mysql_definition,
    pg_columns,
    pg_indexes,
)
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration

DB = "ddl_matrix"
_server_ids = itertools.count(4900)
_created: list[str] = []


def _capture(env: dict[str, str], logs: Path, source: MariaDB) -> ServiceProcess:
    return ServiceProcess("services.capture", {
        **env, "SLUICE_SOURCE_ID": "ddlm", "SLUICE_SOURCE_URL": f"{source.url_for(DB)}?heartbeat=0.5",
        "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
    }, logs, instance_id="capture-ddlm").start()


def _worker(env: dict[str, str], logs: Path) -> ServiceProcess:
    # Small chunks: a re-copy takes several waves, so the worker can be killed in the middle.
    return ServiceProcess("services.sink_worker", {
        **env, **STANDALONE_WORKER_ENV,
        "SLUICE_SNAPSHOT_CHUNK_ROWS": "100", "SLUICE_SNAPSHOT_PARALLELISM": "2",
        "SLUICE_SNAPSHOT_RETRY_S": "1",
    }, logs, instance_id="worker-ddlm").start()


@pytest.fixture(autouse=True)
async def _delete_changefeeds_afterwards(js: JetStreamContext) -> AsyncIterator[None]:
    yield
    while _created:
        await record_state(js, _created.pop(), "deleted", requested_by="test", reason="test over")


@dataclass
class _Writer:
    """Random inserts, updates and deletes on the live tables, one transaction at a time.

    ``names`` maps a logical table to its current name; ``mirror`` names a gh-ost ghost that
    receives the same change in the same transaction (gh-ost's binlog applier, in short);
    holding ``lock`` stops the writer between transactions (a cut-over's table lock)."""

    source: MariaDB
    names: dict[str, str]
    columns: dict[str, str]
    mirror: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    next_id: int = 100_000
    txns: int = 0
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        conn = self.source.connect()
        rng = random.Random(1313)
        try:
            while not self.stop.is_set():
                with self.lock:
                    logical = rng.choice(sorted(self.names))
                    table, extra = self.names[logical], self.columns[logical]
                    try:
                        self._one(conn, rng, table, extra, self.mirror.get(logical))
                        self.txns += 1
                    except Exception as exc:  # a statement racing a DDL: the source refused it
                        conn.rollback()
                        self.errors.append(repr(exc))
                time.sleep(0.05)  # a steady trickle: every DDL meets writes, the worker keeps up
        finally:
            conn.close()

    def _one(self, conn: Any, rng: random.Random, table: str, extra: str, ghost: str | None) -> None:
        op = rng.random()
        statements: list[tuple[str, tuple[Any, ...]]] = []
        if op < 0.5:
            self.next_id += 1
            i = self.next_id
            cols = "id, n" + (f", {extra}" if extra else "")
            values = (i, rng.randrange(1000)) + ((i,) if extra == "u" else (f"w{i}",) if extra else ())
            marks = ", ".join(["%s"] * len(values))
            statements.append((f"INSERT INTO `{DB}`.`{{t}}` ({cols}) VALUES ({marks})", values))
        else:
            with conn.cursor() as cur:
                cur.execute(f"SELECT id FROM `{DB}`.`{table}` ORDER BY RAND() LIMIT 1")
                row = cur.fetchone()
            if row is None:
                return
            if op < 0.85:
                statements.append((f"UPDATE `{DB}`.`{{t}}` SET n = n + 1 WHERE id = %s", (row[0],)))
            else:
                statements.append((f"DELETE FROM `{DB}`.`{{t}}` WHERE id = %s", (row[0],)))
        conn.begin()
        with conn.cursor() as cur:
            for sql, params in statements:
                cur.execute(sql.format(t=table), params)
                if ghost is not None:
                    # gh-ost applies the original's row changes to the ghost as REPLACE/DELETE.
                    ghost_sql = sql.replace("INSERT INTO", "REPLACE INTO")
                    cur.execute(ghost_sql.format(t=ghost), params)
        conn.commit()


def _exec(conn: Any, *statements: str) -> None:
    with conn.cursor() as cur:
        for sql in statements:
            cur.execute(sql)


def _target_exists(url: str, table: str) -> bool:
    sink: Any = open_sink(url)
    ref = TargetTable(schema=DB, name=table, meta=TableMetaV1(columns=[], primary_key=[]), key=())
    return bool(sink._run(lambda cur: sink._current(cur, ref) is not None, "exists"))


def _wait_converged(source: MariaDB, sinks: list[str], live: list[str], gone: list[str],
                    procs: list[ServiceProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "nothing compared yet"
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        problems = []
        for url in sinks:
            for table in live:
                try:
                    result = verify_target([ShardRef(source.url, DB, table)], url, DB, table)
                except Exception as exc:
                    problems.append(f"{url.split(':')[0]} {table}: {exc!r}"[:300])
                    continue
                if not result.ok:
                    problems.append(f"{url.split(':')[0]} {table}: {result.diff}"[:300])
            problems += [f"{url.split(':')[0]} {table}: stale target still there"
                         for url in sinks for table in gone if _target_exists(url, table)]
        if not problems:
            return
        last = "\n".join(problems)
        time.sleep(1.0)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(25)}\nhealth: {p.health()}" for p in procs)
    pytest.fail(f"downstreams did not converge within {timeout}s:\n{last}\n{logs}")


async def _wait_mid_recopy(js: JetStreamContext, table: str) -> None:
    """Until a re-copy of ``table`` (for any downstream) has chunks done but not all of them."""
    timeout = 120.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kv = await js.key_value(SNAPSHOT_BUCKET)
        except BucketNotFoundError:  # the worker creates it with its first copy
            await asyncio.sleep(0.05)
            continue
        with contextlib.suppress(NoKeysError):
            for key in await kv.keys():
                if f".{table}.recopy." not in key:
                    continue
                with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
                    entry = await kv.get(key)
                    if entry.value:
                        progress = SnapshotProgress.from_json(entry.value)
                        if 0 < progress.chunks_done < progress.chunks_total:
                            return
        await asyncio.sleep(0.05)
    pytest.fail(f"no re-copy of {table} was seen in the middle of its chunks within {timeout}s")


@pytest.mark.timeout(900)
async def test_ddl_matrix_under_writes_reaches_three_downstreams_row_for_row(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, mariadb_factory: Callable[..., MariaDB], processes: list[ServiceProcess],
) -> None:
    downstream = mariadb_factory()
    conn = mariadb.connect()
    _exec(conn, f"DROP DATABASE IF EXISTS `{DB}`", f"CREATE DATABASE `{DB}`")
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream.url]
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb)
    processes.append(capture)
    capture.wait_healthy(60)
    for i, url in enumerate(sinks):
        spec = ChangefeedSpecV2(id=f"ddlm-{i}", sources=[SourceRefV1(id="ddlm", url=mariadb.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                                initial_load="binlog-only")
        await record_changefeed(js, spec, requested_by="test")
        _created.append(spec.id)
    worker = _worker(service_env, logs)
    processes.append(worker)
    worker.wait_healthy(60)

    t = f"`{DB}`"
    _exec(conn,
          f"CREATE TABLE {t}.m_add (id INT PRIMARY KEY, n INT, s VARCHAR(5))",
          f"CREATE TABLE {t}.m_mod (id INT PRIMARY KEY, n INT, s VARCHAR(5) CHARACTER SET utf8mb4)",
          f"CREATE TABLE {t}.m_idx (id INT PRIMARY KEY, n INT, u INT)",
          f"CREATE TABLE {t}.m_ren (id INT PRIMARY KEY, n INT)",
          f"CREATE TABLE {t}.orders (id INT PRIMARY KEY, n INT, s VARCHAR(20))",
          f"CREATE TABLE {t}.items (id INT PRIMARY KEY, n INT, s VARCHAR(10))")
    with conn.cursor() as cur:
        for table, extra in (("m_add", "s"), ("m_mod", "s"), ("m_idx", "u"), ("m_ren", ""),
                             ("orders", "s"), ("items", "s")):
            size = 1000 if table == "m_mod" else 300  # m_mod: 10 chunks to re-copy
            cols = "id, n" + (f", {extra}" if extra else "")
            rows = [(i, i % 97) + ((i,) if extra == "u" else ("v",) if extra else ())
                    for i in range(1, size + 1)]
            marks = ", ".join(["%s"] * len(rows[0]))
            cur.executemany(f"INSERT INTO {t}.{table} ({cols}) VALUES ({marks})", rows)
    conn.commit()

    columns = {"m_add": "", "m_mod": "", "m_idx": "u", "m_ren": "", "orders": "s", "items": "s"}
    writer = _Writer(mariadb, names={k: k for k in columns}, columns=dict(columns))
    thread = threading.Thread(target=writer.run, name="ddl-writer", daemon=True)
    thread.start()

    def settle() -> None:
        start = writer.txns
        wait_until(lambda: writer.txns >= start + 10, 60, "10 writer transactions after the DDL")

    def before_kill() -> None:
        # ADD COLUMN with defaults: a literal NOT NULL, an expression evaluated at ALTER time,
        # one MariaDB evaluates per row, FIRST/AFTER, and a plain nullable one (in place).
        _exec(conn, f"ALTER TABLE {t}.m_add ADD COLUMN c_lit INT NOT NULL DEFAULT 7 AFTER id")
        settle()
        _exec(conn, f"ALTER TABLE {t}.m_add ADD COLUMN c_ts DATETIME(6) NOT NULL"
                    " DEFAULT CURRENT_TIMESTAMP(6) FIRST")
        settle()
        _exec(conn, f"ALTER TABLE {t}.m_add ADD COLUMN c_uuid CHAR(36) DEFAULT (uuid())",
              f"ALTER TABLE {t}.m_add ADD COLUMN c_null VARCHAR(10)")
        settle()
        # MODIFY to a longer length; the worker is killed in the middle of its re-copy.
        _exec(conn, f"ALTER TABLE {t}.m_mod MODIFY s VARCHAR(100)")

    def after_kill() -> None:
        _exec(conn, f"UPDATE {t}.m_mod SET s = REPEAT('x', 80) WHERE id % 3 = 0")
        conn.commit()
        _exec(conn, f"ALTER TABLE {t}.m_mod MODIFY n BIGINT")
        _exec(conn, f"UPDATE {t}.m_mod SET n = 1099511627776 WHERE id % 7 = 0")
        conn.commit()
        settle()
        # CHANGE COLUMN (rename and retype), then a charset/collation change.
        _exec(conn, f"ALTER TABLE {t}.m_mod CHANGE s s2 VARCHAR(200)")
        settle()
        _exec(conn, f"ALTER TABLE {t}.m_mod MODIFY s2 VARCHAR(200) CHARACTER SET latin1"
                    " COLLATE latin1_general_ci")
        settle()
        # Indexes: unique added, plain added, unique dropped, primary key changed.
        _exec(conn, f"ALTER TABLE {t}.m_idx ADD UNIQUE KEY uk_u (u)")
        settle()
        _exec(conn, f"CREATE INDEX ix_n ON {t}.m_idx (n)", f"ALTER TABLE {t}.m_idx DROP INDEX uk_u")
        settle()
        _exec(conn, f"ALTER TABLE {t}.m_idx DROP PRIMARY KEY, ADD PRIMARY KEY (id, u)")
        settle()
        # CREATE TABLE ... LIKE, filled and then written like the others.
        _exec(conn, f"CREATE TABLE {t}.m_like LIKE {t}.m_idx",
              f"INSERT INTO {t}.m_like SELECT * FROM {t}.m_idx")
        conn.commit()
        with writer.lock:
            writer.names["m_like"], writer.columns["m_like"] = "m_like", "u"
        # RENAME TABLE: the rows live on under the new name.
        with writer.lock:
            _exec(conn, f"RENAME TABLE {t}.m_ren TO {t}.m_ren2")
            writer.names["m_ren"] = "m_ren2"
        settle()
        gh_ost()
        pt_osc()
        settle()

    def gh_ost() -> None:
        # gh-ost: ghost LIKE the original, altered, rows copied in chunks while the original's
        # changes are applied to it, then the two-table RENAME and the old table dropped.
        _exec(conn, f"CREATE TABLE {t}._orders_gho LIKE {t}.orders",
              f"ALTER TABLE {t}._orders_gho ADD COLUMN note VARCHAR(20) NOT NULL DEFAULT 'ghost',"
              " MODIFY s VARCHAR(60)")
        with writer.lock:
            writer.mirror["orders"] = "_orders_gho"
        for low in range(0, 101_000, 200):
            with writer.lock:
                _exec(conn, f"INSERT IGNORE INTO {t}._orders_gho (id, n, s) SELECT id, n, s FROM {t}.orders"
                            f" WHERE id > {low} AND id <= {low + 200} LOCK IN SHARE MODE")
                conn.commit()
            if low > 400:
                break
        with writer.lock:
            _exec(conn, f"INSERT IGNORE INTO {t}._orders_gho (id, n, s) SELECT id, n, s FROM {t}.orders")
            conn.commit()
            _exec(conn, f"RENAME TABLE {t}.orders TO {t}._orders_del, {t}._orders_gho TO {t}.orders")
            writer.mirror.pop("orders")
        settle()
        _exec(conn, f"DROP TABLE {t}._orders_del")

    def pt_osc() -> None:
        # pt-online-schema-change: new table LIKE the original, altered, triggers mirror the
        # original's writes, rows copied in chunks, the two-table RENAME, triggers and old dropped.
        _exec(conn, f"CREATE TABLE {t}._items_new LIKE {t}.items",
              f"ALTER TABLE {t}._items_new MODIFY s VARCHAR(80), ADD COLUMN flag TINYINT NOT NULL DEFAULT 1",
              f"CREATE TRIGGER {t}.pt_ins AFTER INSERT ON {t}.items FOR EACH ROW"
              f" REPLACE INTO {t}._items_new (id, n, s) VALUES (NEW.id, NEW.n, NEW.s)",
              f"CREATE TRIGGER {t}.pt_upd AFTER UPDATE ON {t}.items FOR EACH ROW"
              f" REPLACE INTO {t}._items_new (id, n, s) VALUES (NEW.id, NEW.n, NEW.s)",
              f"CREATE TRIGGER {t}.pt_del AFTER DELETE ON {t}.items FOR EACH ROW"
              f" DELETE IGNORE FROM {t}._items_new WHERE id = OLD.id")
        for low in range(0, 400, 100):
            _exec(conn, f"INSERT LOW_PRIORITY IGNORE INTO {t}._items_new (id, n, s) SELECT id, n, s"
                        f" FROM {t}.items WHERE id > {low} AND id <= {low + 100} LOCK IN SHARE MODE")
            conn.commit()
        with writer.lock:
            _exec(conn, f"INSERT LOW_PRIORITY IGNORE INTO {t}._items_new (id, n, s) SELECT id, n, s"
                        f" FROM {t}.items WHERE id > 400")
            conn.commit()
            _exec(conn, f"RENAME TABLE {t}.items TO {t}._items_old, {t}._items_new TO {t}.items",
                  f"DROP TRIGGER {t}.pt_ins", f"DROP TRIGGER {t}.pt_upd", f"DROP TRIGGER {t}.pt_del")
        settle()
        _exec(conn, f"DROP TABLE IF EXISTS {t}._items_old")

    try:
        await asyncio.to_thread(before_kill)
        await _wait_mid_recopy(js, "m_mod")
        worker.kill()
        worker = _worker(service_env, logs)
        processes.append(worker)
        await asyncio.to_thread(after_kill)
    finally:
        writer.stop.set()
        await asyncio.to_thread(thread.join, 30)
    assert writer.txns >= 100, f"the writer made only {writer.txns} transactions: {writer.errors[-3:]}"
    live = ["m_add", "m_mod", "m_idx", "m_like", "m_ren2", "orders", "items"]
    gone = ["m_ren", "_orders_gho", "_orders_del", "_items_new", "_items_old"]
    await asyncio.to_thread(_wait_converged, mariadb, sinks, live, gone, [capture, worker], 420)
    # Existing rows got the defaults the source gave them (not NULL), and no span is in error.
    with conn.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM {t}.m_add WHERE c_lit = 7 AND c_uuid IS NOT NULL AND id <= 300")
        assert cur.fetchone()[0] > 0
    states = {s["state"] for s in (worker.health() or {}).get("spans", [])}
    assert "error" not in states, worker.health()
    _assert_definitions(mariadb, downstream, sinks, live)


def _assert_definitions(source: MariaDB, downstream: MariaDB, sinks: list[str], live: list[str]) -> None:
    """After the DDL, each target's definition is the source's: on MariaDB every column (type,
    NOT NULL, default, charset, collation, comment) and index; on PostgreSQL and SQLite the NOT
    NULL columns, the literal defaults (``c_lit``'s 7), the primary key (``m_idx``'s changed
    one) and the secondary indexes (``ix_n``, created by CREATE INDEX upstream); the changefeed
    compares text exactly there, so no column has a collation of its own."""
    sqlite_url, pg_url = sinks[0], sinks[1]
    for table in live:
        src = mysql_definition(source, DB, table)
        assert mysql_definition(downstream, DB, table) == src, table
        assert_follows_source(src, table, pg_url, DB, sqlite_url)
        assert all(c[2] is None for c in pg_columns(pg_url, DB, table).values()), table
    assert "m_idx__ix_n" in pg_indexes(pg_url, DB, "m_idx")
    assert literal_defaults(mysql_definition(source, DB, "m_add")).get("c_lit") == "7"


@pytest.mark.timeout(400)
async def test_a_ddl_the_downstream_cannot_take_stops_the_table_visibly(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, processes: list[ServiceProcess],
) -> None:
    # A 64-character column name: MariaDB takes it, PostgreSQL keeps at most 63 bytes.
    db, long_name = "ddl_refused", "c" * 64
    conn = mariadb.connect()
    _exec(conn, f"DROP DATABASE IF EXISTS `{db}`", f"CREATE DATABASE `{db}`")
    logs = tmp_path / "logs"
    capture = ServiceProcess("services.capture", {
        **service_env, "SLUICE_SOURCE_ID": "ddlr",
        "SLUICE_SOURCE_URL": f"{mariadb.url_for(db)}?heartbeat=0.5",
        "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
    }, logs, instance_id="capture-ddlr").start()
    processes.append(capture)
    capture.wait_healthy(60)
    spec = ChangefeedSpecV2(id="ddlr", sources=[SourceRefV1(id="ddlr", url=mariadb.url)],
                            filter=TableFilterV1(include=[f"{db}.*"]), sink_url=postgres.url,
                            initial_load="binlog-only")
    await record_changefeed(js, spec, requested_by="test")
    _created.append(spec.id)
    worker = _worker(service_env, logs)
    processes.append(worker)
    worker.wait_healthy(60)
    _exec(conn, f"CREATE TABLE `{db}`.ok (id INT PRIMARY KEY, n INT)",
          f"CREATE TABLE `{db}`.bad (id INT PRIMARY KEY, n INT)",
          f"INSERT INTO `{db}`.ok VALUES (1, 1)", f"INSERT INTO `{db}`.bad VALUES (1, 1)")
    conn.commit()
    # Downstream first, so the CREATE's metadata (read by capture when it meets the CREATE)
    # cannot already show the ALTER's column.
    await asyncio.to_thread(wait_until, lambda: _equal(mariadb, postgres.url, db, "bad"), 120,
                            "the table `bad` replicated before its ALTER")
    statement = f"ALTER TABLE `{db}`.bad ADD COLUMN `{long_name}` INT"
    _exec(conn, statement, f"INSERT INTO `{db}`.bad VALUES (2, 2, 2)",
          f"INSERT INTO `{db}`.ok VALUES (2, 2)")
    conn.commit()

    def span(table: str) -> dict[str, Any]:
        spans = (worker.health() or {}).get("spans", [])
        return next((s for s in spans if s.get("table") == table), {})

    await asyncio.to_thread(wait_until, lambda: span("bad").get("state") == "error", 120,
                            "the span of `bad` in state error at its DDL")
    failure = span("bad")["ddl_error"]
    assert failure["statement"] == statement
    assert "longer than postgresql allows" in failure["reason"]
    # Stopped at the DDL, not past it: the row after it is not downstream; the other table goes on.
    await asyncio.to_thread(wait_until, lambda: _equal(mariadb, postgres.url, db, "ok"), 120,
                            "the healthy table replicated beside the stopped one")
    two = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                               ColumnV1(name="n", kind="int", sql_type="int")], primary_key=["id"])
    rows = open_sink(postgres.url).fetch_rows(TargetTable(schema=db, name="bad", meta=two, key=("id",)))
    assert [r["id"] for r in rows] == [1], rows
    text = _metrics_text(worker)
    assert 'sluice_sink_ddl_failures_total{changefeed="ddlr"}' in text
    assert span("bad")["state"] == "error", "the DDL was skipped"
    assert "DDL cannot be applied downstream" in worker.tail_log(200)


def _equal(source: MariaDB, url: str, db: str, table: str) -> bool:
    try:
        return verify_target([ShardRef(source.url, db, table)], url, db, table).ok
    except Exception:  # the target appears with its first batch
        return False


def _metrics_text(proc: ServiceProcess) -> str:
    with urllib.request.urlopen(f"{proc.base_url}/metrics", timeout=5) as resp:
        return resp.read().decode()
