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

A shard merge (two shard databases routed into one target with an origin column) checks the
merged target's definition on every downstream: NOT NULL, defaults, the origin column joining the
primary and unique keys, the secondary index, the collation.

Targets an operator made before the changefeeds (partitioned, an extra column with a default,
wider types) are used as they are, on a single-shard table and on a merged one: the rows
arrive, the definition stays, and a DDL that copies the single-shard table again keeps the
target (emptied and filled again, the extra column's values put back).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import pymysql.cursors
import pytest

from contracts.events.changefeeds import ChangefeedSpecV6, RouteRuleV1, SourceRefV1, TableFilterV1
from contracts.events.rows import ColumnV1
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
    pg_execute,
    pg_indexes,
    pg_query,
    sqlite_columns,
    sqlite_execute,
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


# A shard merge: two shard tables of each kind (capture reads only DB), one whose target Sluice
# makes (`items_s*`) and one whose target an operator made (`owned_s*`), routed into MERGED with
# an origin column.
SHARDS = ("s1", "s2")
MERGED = "shape_merged"
ORIGIN = "_sluice_origin"
SHARD_SETUP = [stmt for shard in SHARDS for stmt in (
    f"""CREATE TABLE {DB}.items_{shard} (
      id INT NOT NULL,
      sku VARCHAR(20) NOT NULL,
      title VARCHAR(50) NOT NULL DEFAULT 'untitled',
      qty INT NOT NULL DEFAULT 1,
      PRIMARY KEY (id),
      UNIQUE KEY u_sku (sku),
      KEY by_title (title)
    ) DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_general_ci""",
    f"CREATE TABLE {DB}.owned_{shard} (id INT NOT NULL PRIMARY KEY, qty INT NOT NULL DEFAULT 0)",
)]
SHARD_ROWS = [stmt for n, shard in enumerate(SHARDS, 1) for stmt in (
    # The same ids and SKUs in both shards: the origin column keeps them apart downstream.
    f"INSERT INTO {DB}.items_{shard} (id, sku, title, qty) VALUES (1, 'A', 'first', {n}),"
    " (2, 'B', 'second', 2)",
    f"INSERT INTO {DB}.items_{shard} (id, sku) VALUES (3, 'C')",
    f"INSERT INTO {DB}.owned_{shard} (id, qty) VALUES (1, {10 * n}), (2, {20 * n})",
)]

# A single-shard table whose targets an operator made before the changefeed.
USERMADE = "usermade"
USERMADE_SOURCE = (f"CREATE TABLE {DB}.{USERMADE} (id INT NOT NULL PRIMARY KEY, qty INT NOT NULL DEFAULT 0,"
                   " label VARCHAR(20) NOT NULL DEFAULT '')")
USERMADE_ROWS = [f"INSERT INTO {DB}.{USERMADE} (id, qty, label) VALUES (1, 1, 'a'), (2, 2, 'b'), (3, 3, 'c')"]
# Re-copies the table (a column added with a default, then a wider column), then a row more.
USERMADE_DDL = [f"ALTER TABLE {DB}.{USERMADE} ADD COLUMN extra INT NOT NULL DEFAULT 7",
                f"ALTER TABLE {DB}.{USERMADE} MODIFY label VARCHAR(200) NOT NULL DEFAULT ''",
                f"INSERT INTO {DB}.{USERMADE} (id, qty, label, extra) VALUES (4, 4, 'd', 9)"]
USER_TARGETS = {
    "mariadb": [
        f"CREATE DATABASE IF NOT EXISTS {DB}", f"CREATE DATABASE IF NOT EXISTS {MERGED}",
        f"CREATE TABLE {DB}.{USERMADE} (id BIGINT NOT NULL PRIMARY KEY, qty BIGINT NOT NULL DEFAULT 0,"
        " label VARCHAR(100) NOT NULL DEFAULT '', note VARCHAR(30) NOT NULL DEFAULT 'mine')"
        " PARTITION BY HASH (id) PARTITIONS 3",
        f"CREATE TABLE {MERGED}.owned (id BIGINT NOT NULL, {ORIGIN} VARCHAR(255) NOT NULL,"
        " qty BIGINT NOT NULL DEFAULT 0, note VARCHAR(30) NOT NULL DEFAULT 'mine',"
        f" PRIMARY KEY (id, {ORIGIN})) PARTITION BY KEY (id) PARTITIONS 2",
    ],
    "postgres": [
        f"DROP SCHEMA IF EXISTS {DB} CASCADE", f"DROP SCHEMA IF EXISTS {MERGED} CASCADE",
        f"CREATE SCHEMA {DB}", f"CREATE SCHEMA {MERGED}",
        f"CREATE TABLE {DB}.{USERMADE} (id bigint NOT NULL PRIMARY KEY, qty bigint NOT NULL DEFAULT 0,"
        " label varchar(100) NOT NULL DEFAULT '', note text NOT NULL DEFAULT 'mine') PARTITION BY HASH (id)",
        *(f"CREATE TABLE {DB}.{USERMADE}_p{i} PARTITION OF {DB}.{USERMADE}"
          f" FOR VALUES WITH (MODULUS 2, REMAINDER {i})" for i in range(2)),
        f"CREATE TABLE {MERGED}.owned (id bigint NOT NULL, {ORIGIN} varchar(255) NOT NULL,"
        f" qty bigint NOT NULL DEFAULT 0, note text NOT NULL DEFAULT 'mine', PRIMARY KEY (id, {ORIGIN}))"
        " PARTITION BY HASH (id)",
        *(f"CREATE TABLE {MERGED}.owned_p{i} PARTITION OF {MERGED}.owned"
          f" FOR VALUES WITH (MODULUS 2, REMAINDER {i})" for i in range(2)),
    ],
    "sqlite": [
        f"CREATE TABLE {USERMADE} (id INTEGER NOT NULL PRIMARY KEY, qty INTEGER NOT NULL DEFAULT 0,"
        " label TEXT NOT NULL DEFAULT '', note TEXT NOT NULL DEFAULT 'mine')",
        f"CREATE TABLE owned (id INTEGER NOT NULL, {ORIGIN} TEXT NOT NULL, qty INTEGER NOT NULL DEFAULT 0,"
        f" note TEXT NOT NULL DEFAULT 'mine', PRIMARY KEY (id, {ORIGIN}))",
    ],
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
                for gone in (cf, f"shapemerge-{name}"):
                    await record_state(js, gone, "deleted", requested_by="test", reason="test over")
                continue
            spec = ChangefeedSpecV6(
                id=cf, sources=[SourceRefV1(id=SOURCE_ID, url=source.url)],
                filter=TableFilterV1(include=[f"{DB}.*"], exclude=[f"{DB}.*_s?"]), sink_url=url,
                initial_load="binlog-only",
                text_comparison="exact" if name == "mariadb" else "case_insensitive")
            await record_changefeed(js, spec, requested_by="test")
            # The shard merge: its targets in their own schema (a SQLite file of their own).
            merge = ChangefeedSpecV6(
                id=f"shapemerge-{name}", sources=[SourceRefV1(id=SOURCE_ID, url=source.url)],
                filter=TableFilterV1(include=[f"{DB}.*_s?"]),
                routes=[RouteRuleV1(database=DB, table=f"{t}_s*", target_schema=MERGED, target_table=t)
                        for t in ("items", "owned")],
                origin_column=ORIGIN, sink_url=_merge_url(url), initial_load="binlog-only")
            await record_changefeed(js, merge, requested_by="test")
    finally:
        await nc.drain()


def _merge_url(url: str) -> str:
    """A SQLite downstream has no schemas: the merged targets live in a file of their own."""
    return url.replace("down.db", "merged.db") if url.startswith("sqlite") else url


def _source_rows(source: MariaDB, db: str, table: str) -> tuple[list[dict[str, Any]], Any]:
    conn = source.connect()
    try:
        info = load_table_info(conn, db, table)
        assert info is not None
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(f"SELECT * FROM {db}.`{table}`")
            return [dict(r) for r in cur.fetchall()], info.meta()
    finally:
        conn.close()


def _merged_rows_equal(stack: Stack, sink: str, table: str) -> bool:
    """The merged target holds every shard's rows, each under its origin."""
    rows: list[dict[str, Any]] = []
    meta: Any = None
    for shard in SHARDS:
        found, meta = _source_rows(stack.source, DB, f"{table}_{shard}")
        rows += [{**r, ORIGIN: f"{SOURCE_ID}/{DB}/{table}_{shard}"} for r in found]
    columns = [*meta.columns, ColumnV1(name=ORIGIN, kind="string", sql_type="varchar(255)", nullable=False)]
    merged = meta.model_copy(update={"columns": columns, "primary_key": [*meta.primary_key, ORIGIN]})
    key = tuple(merged.primary_key)
    target = TargetTable(schema=MERGED, name=table, meta=merged, key=key)
    down = open_sink(_merge_url(stack.sink_urls[sink])).fetch_rows(target)
    return compare_tables(rows, down, key, columns=columns).ok


def _prepare_user_targets(downstream: MariaDB, sink_urls: dict[str, str]) -> None:
    downstream.execute(*USER_TARGETS["mariadb"])
    pg_execute(sink_urls["postgres"], *USER_TARGETS["postgres"])
    for sql in USER_TARGETS["sqlite"]:
        sqlite_execute(_merge_url(sink_urls["sqlite"]) if " owned " in sql else sink_urls["sqlite"], sql)


def _rows_equal(stack: Stack, sink: str, table: str) -> bool:
    rows, meta = _source_rows(stack.source, DB, table)
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
    mariadb.execute(*SETUP, USERMADE_SOURCE, *SHARD_SETUP)
    _prepare_user_targets(downstream, sink_urls)
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
        mariadb.execute(*ROWS, *USERMADE_ROWS, *SHARD_ROWS)
        result = Stack(mariadb, downstream, sink_urls, procs)
        for sink in sink_urls:
            for table in (*TABLES, USERMADE):
                _wait(f"{sink} {table} rows", lambda s=sink, t=table: _rows_equal(result, s, t), bool, result)
            for table in ("items", "owned"):
                _wait(f"{sink} merged {table} rows", lambda s=sink, t=table: _merged_rows_equal(result, s, t),
                      bool, result)
        yield result
    finally:
        if fed:
            asyncio.run(_feeds(nats_server.url, sink_urls, mariadb, delete=True))
        for p in procs:
            p.kill()
        downstream.cleanup()


def _mysql_definition(server: MariaDB, table: str) -> dict[str, Any]:
    return mysql_definition(server, DB, table)


def _show_create(server: MariaDB, table: str) -> str:
    [(_, text)] = mysql_query(server, f"SHOW CREATE TABLE {DB}.`{table}`")
    return re.sub(r" AUTO_INCREMENT=\d+", "", str(text))


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
    # The README's first hour shows both side by side: the same text (AUTO_INCREMENT's next
    # value aside, which each server keeps itself). Secondary indexes are created in name order
    # (capture reads them from information_schema, which does not keep the source's order), so
    # with several of them the lines are the same, in another order.
    down, up = _show_create(stack.downstream, table), _show_create(stack.source, table)
    assert (down == up) if table == "sbtest1" else (sorted(down.split(",\n")) == sorted(up.split(",\n")))


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


# ---------------------------------------------------------------------------- shard merge


def _mysql_partitions(server: MariaDB, db: str, table: str) -> int:
    [(count,)] = mysql_query(server, "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE"
                                     " TABLE_SCHEMA = %s AND TABLE_NAME = %s AND PARTITION_NAME IS NOT NULL",
                             (db, table))
    return int(count)


def _pg_partitioned(url: str, schema: str, table: str) -> bool:
    return pg_query(url, "SELECT c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                         " WHERE n.nspname = %s AND c.relname = %s", (schema, table)) == [("p",)]


def _sqlite_unique_keys(url: str, table: str) -> list[set[str]]:
    keys = []
    for _, name, unique, *_ in sqlite_query(url, f"PRAGMA index_list('{table}')"):
        if unique:
            keys.append({str(r[2]) for r in sqlite_query(url, f"PRAGMA index_info('{name}')")})
    return keys


def test_merged_target_keeps_the_shape_with_the_origin_in_every_unique_key(stack: Stack) -> None:
    """The first shard's definition, the origin column joining the primary and unique keys."""
    source = mysql_definition(stack.source, DB, f"items_{SHARDS[0]}")
    target = mysql_definition(stack.downstream, MERGED, "items")
    columns = {str(c[0]): c for c in target["columns"]}
    for name, _type, nullable, default, charset, collation, comment, _extra in source["columns"]:
        assert columns[str(name)][2:7] == (nullable, default, charset, collation, comment), name
    assert columns[ORIGIN][2] == "NO"
    assert columns["title"][5] == "utf8mb4_general_ci"  # as upstream: 'FIRST' finds 'first'
    found = mysql_query(stack.downstream, f"SELECT COUNT(*) FROM {MERGED}.items WHERE title = 'FIRST'")
    assert found == [(2,)]
    indexes: dict[str, tuple[bool, set[str]]] = {}
    for name, non_unique, _, column, *_ in target["indexes"]:
        indexes.setdefault(str(name), (not int(non_unique), set()))[1].add(str(column))
    assert indexes["PRIMARY"] == (True, {"id", ORIGIN})
    assert indexes["u_sku"] == (True, {"sku", ORIGIN})
    assert indexes["by_title"] == (False, {"title"})

    url = _merge_url(stack.sink_urls["postgres"])
    pg = pg_columns(url, MERGED, "items")
    assert {n for n, c in pg.items() if c[0] == "NO"} == {"id", "sku", "title", "qty", ORIGIN}
    assert str(pg["title"][1]).startswith("'untitled'") and str(pg["qty"][1]) == "1"
    pg_idx = pg_indexes(url, MERGED, "items")
    [unique] = [d for n, d in pg_idx.items() if "UNIQUE" in d and "sku" in d]
    assert ORIGIN in unique
    assert "(title)" in pg_idx["items__by_title"]
    [pkey] = [d for n, d in pg_idx.items() if n.endswith("_pkey")]
    assert ORIGIN in pkey and "id" in pkey.split("(", 1)[1], pkey

    url = _merge_url(stack.sink_urls["sqlite"])
    lite = sqlite_columns(url, "items")
    assert {n for n, c in lite.items() if c[0] == 1} == {"id", "sku", "title", "qty", ORIGIN}
    assert lite["title"][1] == "'untitled'" and lite["qty"][1] == "1"
    assert {"sku", ORIGIN} in _sqlite_unique_keys(url, "items")
    assert "items__by_title" in sqlite_indexes(url, "items")


# ---------------------------------------------------------------------------- user-made targets


def _user_rows(stack: Stack, sink: str, db: str, table: str) -> list[tuple[Any, ...]]:
    if sink == "mariadb":
        return mysql_query(stack.downstream, f"SELECT id, note FROM {db}.{table} ORDER BY id")
    if sink == "postgres":
        return pg_query(stack.sink_urls["postgres"], f"SELECT id, note FROM {db}.{table} ORDER BY id")
    url = _merge_url(stack.sink_urls["sqlite"]) if db == MERGED else stack.sink_urls["sqlite"]
    return sqlite_query(url, f"SELECT id, note FROM {table} ORDER BY id")


def _assert_user_made_kept(stack: Stack, table: str, db: str, wide: dict[str, str]) -> None:
    """Partitioned as made, the extra column with its default, the wider types (``wide``:
    column -> the type's start on MariaDB/PostgreSQL)."""
    partitions = 3 if table == USERMADE else 2
    assert _mysql_partitions(stack.downstream, db, table) == partitions
    mysql_cols = {str(c[0]): c for c in mysql_definition(stack.downstream, db, table)["columns"]}
    assert mysql_cols["note"][2:4] == ("NO", "'mine'")
    for column, start in wide.items():
        assert str(mysql_cols[column][1]).startswith(start), mysql_cols[column]
    url = stack.sink_urls["postgres"]
    assert _pg_partitioned(url, db, table)
    pg = pg_columns(url, db, table)
    assert str(pg["note"][1]).startswith("'mine'")
    types = dict(pg_query(url, "SELECT column_name, data_type || coalesce('(' || character_maximum_length"
                               " || ')', '') FROM information_schema.columns WHERE table_schema = %s"
                               " AND table_name = %s", (db, table)))
    for column, start in wide.items():
        assert str(types[column]).startswith(start.replace("varchar", "character varying")), types
    lite_url = _merge_url(stack.sink_urls["sqlite"]) if db == MERGED else stack.sink_urls["sqlite"]
    assert sqlite_columns(lite_url, table)["note"] == (1, "'mine'")


def test_user_made_targets_are_used_as_they_are(stack: Stack) -> None:
    _assert_user_made_kept(stack, USERMADE, DB, {"qty": "bigint", "label": "varchar(100)", "id": "bigint"})
    _assert_user_made_kept(stack, "owned", MERGED, {"qty": "bigint", "id": "bigint"})
    for sink in stack.sink_urls:
        assert _user_rows(stack, sink, DB, USERMADE) == [(1, "mine"), (2, "mine"), (3, "mine")]
        assert [r[1] for r in _user_rows(stack, sink, MERGED, "owned")] == ["mine"] * 4


def test_a_ddl_that_copies_the_table_again_keeps_a_user_made_target(stack: Stack) -> None:
    # The operator's own column holds a value of theirs.
    stack.downstream.execute(f"UPDATE {DB}.{USERMADE} SET note = 'kept' WHERE id = 2")
    pg_execute(stack.sink_urls["postgres"], f"UPDATE {DB}.{USERMADE} SET note = 'kept' WHERE id = 2")
    sqlite_execute(stack.sink_urls["sqlite"], f"UPDATE {USERMADE} SET note = 'kept' WHERE id = 2")
    stack.source.execute(*USERMADE_DDL)
    for sink in stack.sink_urls:
        _wait(f"{sink} {USERMADE} rows after the re-copy", lambda s=sink: _rows_equal(stack, s, USERMADE),
              bool, stack)
        # The copy fills the rows first; the operator's values go back once it is done.
        _wait(f"{sink} {USERMADE}: the operator's column keeps its values",
              lambda s=sink: _user_rows(stack, s, DB, USERMADE),
              lambda notes: notes == [(1, "mine"), (2, "kept"), (3, "mine"), (4, "mine")], stack)
    # label widened to the source's new width; the wider qty and id stay.
    _assert_user_made_kept(stack, USERMADE, DB, {"qty": "bigint", "label": "varchar(200)", "id": "bigint"})
    assert [c[0] for c in sqlite_query(stack.sink_urls["sqlite"], f"PRAGMA table_info('{USERMADE}')")
            if c[1] == "extra"]
