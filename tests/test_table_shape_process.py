"""Downstream tables shaped like the source: through the real capture process and a real
sink-worker (Spark) into MariaDB, PostgreSQL and SQLite downstreams at once.

The source has a sysbench table and a table with every kind of shape a downstream may take:
NOT NULL, literal and expression defaults, charsets and collations per column, comments,
AUTO_INCREMENT, unique, prefix, multi-column and descending indexes. Checked per downstream:
the rows, and the target's own definition (its catalog: nullability, defaults, indexes,
collation); on MariaDB ``CHECKSUM TABLE`` equals the source's. Then index DDL upstream (CREATE
INDEX, ALTER ... ADD KEY, RENAME INDEX, DROP INDEX) reaches every downstream.

PostgreSQL and SQLite run under ``text_comparison = case_insensitive``: the source's ``_ci``
columns compare case-insensitively there too (a nondeterministic ICU collation; NOCASE).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import pymysql.cursors
import pytest

from contracts.events.changefeeds import ChangefeedSpecV6, SourceRefV1, TableFilterV1
from libs.changefeeds import record_changefeed, record_state
from libs.checksum import compare_tables
from libs.codec.table_meta import load_table_info
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from tests.helpers.definitions import (
    MYSQL_INDEXES,
    mysql_checksum,
    mysql_definition,
    mysql_query,
    pg_columns,
    pg_indexes,
    pg_query,
    sqlite_columns,
    sqlite_indexes,
    sqlite_query,
)
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration

DB = "shape"
SOURCE_ID = "shapesrc"
TABLES = ("sbtest1", "shaped")
_server_ids = itertools.count(5100)
T = TypeVar("T")

SETUP = [
    f"DROP DATABASE IF EXISTS {DB}",
    f"CREATE DATABASE {DB}",
    # sysbench's oltp table, as sysbench creates it (the server's default charset).
    f"""CREATE TABLE {DB}.sbtest1 (
      id INT NOT NULL AUTO_INCREMENT,
      k INT NOT NULL DEFAULT '0',
      c CHAR(120) NOT NULL DEFAULT '',
      pad CHAR(60) NOT NULL DEFAULT '',
      PRIMARY KEY (id),
      KEY k_1 (k)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_general_ci""",
    f"""CREATE TABLE {DB}.shaped (
      id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
      code VARCHAR(20) NOT NULL,
      name VARCHAR(64) NOT NULL DEFAULT 'n/a' COMMENT 'display name',
      legacy VARCHAR(30) CHARACTER SET latin1 COLLATE latin1_swedish_ci NULL,
      exact VARCHAR(10) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
      qty INT NOT NULL DEFAULT 1,
      price DECIMAL(10,2) NOT NULL DEFAULT '0.00',
      note TEXT NULL DEFAULT 'none',
      created DATETIME NOT NULL DEFAULT current_timestamp(),
      token CHAR(36) NOT NULL DEFAULT (uuid()),
      flags BIT(3) NOT NULL DEFAULT b'101',
      PRIMARY KEY (id),
      UNIQUE KEY u_code (code),
      KEY by_name_qty (name(10), qty DESC),
      KEY by_created (created),
      KEY by_note (note(20))
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_unicode_ci COMMENT='shaped like the source'""",
]
ROWS = [
    *(f"INSERT INTO {DB}.sbtest1 (k, c, pad) VALUES ({i % 7}, 'c-{i}', 'pad-{i}')" for i in range(1, 41)),
    f"INSERT INTO {DB}.sbtest1 () VALUES ()",  # every column from its default
    f"UPDATE {DB}.sbtest1 SET k = k + 1 WHERE id % 3 = 0",
    f"DELETE FROM {DB}.sbtest1 WHERE id % 10 = 0",
    f"INSERT INTO {DB}.shaped (code, name, legacy, exact, qty, price) VALUES "
    "('A1', 'Alice', 'café', 'Ab', 3, 9.99), ('b2', 'bob', NULL, 'ab', 2, 0.5)",
    f"INSERT INTO {DB}.shaped (code) VALUES ('c3')",  # defaults, literal and expression
    f"UPDATE {DB}.shaped SET note = NULL, flags = b'010' WHERE code = 'b2'",
]
INDEX_DDL = [
    f"CREATE INDEX by_qty ON {DB}.shaped (qty)",
    f"ALTER TABLE {DB}.shaped ADD KEY by_legacy_code (legacy, code)",
    f"ALTER TABLE {DB}.shaped RENAME INDEX by_created TO by_created_at",
    f"DROP INDEX by_note ON {DB}.shaped",
    f"INSERT INTO {DB}.shaped (code, name, qty) VALUES ('d4', 'Dora', 5)",
]
# The indexes of `shaped` once INDEX_DDL ran: name -> (unique, [(column, prefix)]).
INDEXES_AFTER = {
    "u_code": (True, [("code", None)]),
    "by_name_qty": (False, [("name", 10), ("qty", None)]),
    "by_created_at": (False, [("created", None)]),
    "by_qty": (False, [("qty", None)]),
    "by_legacy_code": (False, [("legacy", None), ("code", None)]),
}


@dataclass
class Stack:
    source: MariaDB
    downstream: MariaDB
    sink_urls: dict[str, str]
    procs: list[ServiceProcess]

    def logs(self) -> str:
        return "\n".join(f"--- {p.instance_id}\n{p.tail_log(30)}" for p in self.procs)


def _wait(what: str, probe: Callable[[], T], ok: Callable[[T], bool], stack: Stack,
          timeout: float = 180) -> T:
    """``probe()`` until ``ok`` holds, or fail at the deadline with the last value and the logs."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for p in stack.procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        try:
            last = probe()
            if ok(last):
                return last  # type: ignore[no-any-return]
        except Exception as exc:  # the target appears with its first batch
            last = exc
        time.sleep(1.0)
    raise AssertionError(f"{what}: never true; last: {last!r}\n{stack.logs()}")


async def _feeds(nats_url: str, sink_urls: dict[str, str], source: MariaDB, *, delete: bool = False) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for name, url in sink_urls.items():
            cf = f"shape-{name}"
            if delete:
                await record_state(js, cf, "deleted", requested_by="test", reason="test over")
                continue
            spec = ChangefeedSpecV6(
                id=cf, sources=[SourceRefV1(id=SOURCE_ID, url=source.url)],
                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url, initial_load="binlog-only",
                text_comparison="exact" if name == "mariadb" else "case_insensitive")
            await record_changefeed(js, spec, requested_by="test")
    finally:
        await nc.drain()


def _rows_equal(stack: Stack, sink: str, table: str) -> bool:
    conn = stack.source.connect()
    try:
        info = load_table_info(conn, DB, table)
        assert info is not None
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(f"SELECT * FROM {DB}.`{table}`")
            rows = [dict(r) for r in cur.fetchall()]
    finally:
        conn.close()
    meta = info.meta()
    target = TargetTable(schema=DB, name=table, meta=meta, key=tuple(meta.primary_key))
    down = open_sink(stack.sink_urls[sink]).fetch_rows(target)
    return compare_tables(rows, down, tuple(meta.primary_key), columns=meta.columns).ok


@pytest.fixture(scope="module")
def stack(mariadb: MariaDB, postgres: PostgreSQL, nats_server: NatsServer,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("table_shape")
    downstream = MariaDB(data_dir=tmp / "down_mariadb", server_id=next(_server_ids)).start()
    sink_urls = {"mariadb": downstream.url, "postgres": postgres.url,
                 "sqlite": f"sqlite:///{tmp / 'down.db'}"}
    env = {"SLUICE_NATS_URL": nats_server.url, "SLUICE_LEASE_TTL_S": "1.5",
           "SLUICE_STATE_DB_URL": f"sqlite:///{tmp / 'state.db'}",
           "SLUICE_DOWNSTREAM_URL": f"sqlite:///{tmp / 'downstream.db'}", "SLUICE_LOG_JSON": "true"}
    mariadb.execute(*SETUP)
    procs: list[ServiceProcess] = []
    fed = False
    try:
        capture = ServiceProcess("services.capture", {
            **env, "SLUICE_SOURCE_ID": SOURCE_ID, "SLUICE_SOURCE_URL": f"{mariadb.url_for(DB)}?heartbeat=0.5",
            "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
        }, tmp / "logs", instance_id="capture-shape").start()
        procs.append(capture)
        capture.wait_healthy(60)
        asyncio.run(_feeds(nats_server.url, sink_urls, mariadb))
        fed = True
        worker = ServiceProcess("services.sink_worker", {**env, **STANDALONE_WORKER_ENV},
                                tmp / "logs", instance_id="worker-shape").start()
        procs.append(worker)
        worker.wait_healthy(60)
        mariadb.execute(*ROWS)
        result = Stack(mariadb, downstream, sink_urls, procs)
        for sink in sink_urls:
            for table in TABLES:
                _wait(f"{sink} {table} rows", lambda s=sink, t=table: _rows_equal(result, s, t), bool, result)
        yield result
    finally:
        if fed:
            asyncio.run(_feeds(nats_server.url, sink_urls, mariadb, delete=True))
        for p in procs:
            p.kill()
        downstream.cleanup()


def _mysql_definition(server: MariaDB, table: str) -> dict[str, Any]:
    return mysql_definition(server, DB, table)


def _checksum(server: MariaDB, table: str) -> int:
    return mysql_checksum(server, DB, table)


def _pg_indexes(url: str, table: str) -> dict[str, str]:
    return pg_indexes(url, DB, table)


# ---------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("table", TABLES)
def test_mariadb_target_has_the_source_definition_and_checksum(stack: Stack, table: str) -> None:
    source = _mysql_definition(stack.source, table)
    target = _mysql_definition(stack.downstream, table)
    assert target["columns"] == source["columns"], "columns: NOT NULL, defaults, charset, collation, comment"
    assert target["indexes"] == source["indexes"]
    assert target["table"] == source["table"]
    assert _checksum(stack.downstream, table) == _checksum(stack.source, table)


def test_postgres_target_keeps_not_null_defaults_indexes_and_folds_case(stack: Stack) -> None:
    url = stack.sink_urls["postgres"]
    columns = pg_columns(url, DB, "shaped")
    assert columns["code"][0] == "NO" and columns["legacy"][0] == "YES" and columns["note"][0] == "YES"
    assert str(columns["name"][1]).startswith("'n/a'") and str(columns["qty"][1]) == "1"
    assert str(columns["price"][1]) == "0.00" and str(columns["note"][1]).startswith("'none'")
    assert columns["created"][1] == "LOCALTIMESTAMP" and columns["flags"][1] == "5"
    assert columns["token"][1] is None  # uuid(): no default with the same meaning
    # *_ci columns fold case; utf8mb4_bin and the key columns' exactness stay.
    assert columns["name"][2] == "sluice_ci" and columns["code"][2] == "sluice_ci"
    assert columns["exact"][2] is None
    indexes = _pg_indexes(url, "shaped")
    assert "UNIQUE" in indexes["shaped__u_code"]
    assert '"left"((name)::text, 10)' in indexes["shaped__by_name_qty"]
    assert "qty DESC" in indexes["shaped__by_name_qty"]
    assert "k_1" in " ".join(_pg_indexes(url, "sbtest1"))
    # As upstream: 'ALICE' finds 'Alice' under a case-insensitive collation.
    assert pg_query(url, f'SELECT code FROM "{DB}"."shaped" WHERE name = %s', ("ALICE",)) == [("A1",)]
    assert mysql_query(stack.source, f"SELECT code FROM {DB}.shaped WHERE name = %s", ("ALICE",)) == [("A1",)]


def test_sqlite_target_keeps_not_null_defaults_indexes_and_nocase(stack: Stack) -> None:
    url = stack.sink_urls["sqlite"]
    info = sqlite_columns(url, "shaped")
    assert info["code"][0] == 1 and info["legacy"][0] == 0
    assert info["name"][1] == "'n/a'" and info["qty"][1] == "1" and info["flags"][1] == "5"
    assert info["token"][1] is None and info["created"][1] is None
    [(create,)] = sqlite_query(url, "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'shaped'")
    assert '"name" TEXT NOT NULL DEFAULT \'n/a\' COLLATE NOCASE' in create
    assert '"exact" TEXT,' in create or '"exact" TEXT\n' in create
    indexes = sqlite_indexes(url, "shaped")
    assert "UNIQUE" in indexes["shaped__u_code"]
    assert 'substr("name", 1, 10)' in indexes["shaped__by_name_qty"]
    assert "sbtest1__k_1" in sqlite_indexes(url, "sbtest1")
    assert sqlite_query(url, "SELECT code FROM shaped WHERE name = ?", ("ALICE",)) == [("A1",)]


def test_index_ddl_reaches_every_downstream(stack: Stack) -> None:
    stack.source.execute(*INDEX_DDL)

    def mariadb_indexes() -> dict[str, tuple[bool, list[tuple[str, int | None]]]]:
        found: dict[str, tuple[bool, list[tuple[str, int | None]]]] = {}
        rows = mysql_query(stack.downstream, MYSQL_INDEXES, (DB, "shaped"))
        for name, non_unique, _, column, sub_part, _, _ in rows:
            if name != "PRIMARY":
                found.setdefault(str(name), (not int(non_unique), []))[1].append((str(column), sub_part))
        return found

    _wait("mariadb indexes after the index DDL", mariadb_indexes, lambda f: f == INDEXES_AFTER, stack)
    assert _mysql_definition(stack.downstream, "shaped") == _mysql_definition(stack.source, "shaped")
    wanted = {f"shaped__{n}" for n in INDEXES_AFTER}
    _wait("postgres indexes after the index DDL",
          lambda: {n for n in _pg_indexes(stack.sink_urls["postgres"], "shaped") if "__" in n},
          lambda f: f == wanted, stack)
    _wait("sqlite indexes after the index DDL",
          lambda: set(sqlite_indexes(stack.sink_urls["sqlite"], "shaped")), lambda f: f == wanted, stack)
    for sink in stack.sink_urls:
        _wait(f"{sink} rows after the index DDL", lambda s=sink: _rows_equal(stack, s, "shaped"), bool, stack)
    assert _checksum(stack.downstream, "shaped") == _checksum(stack.source, "shaped")
