"""Foreign-key cascades end to end with real processes: MariaDB binlog -> capture -> sink-worker
(Spark) -> SQLite, PostgreSQL and MariaDB downstreams, compared row for row with the source.

MariaDB binlogs only the parent's change of an ``ON DELETE``/``ON UPDATE`` action; the tables the
keys connect form one span (a table group) whose batch carries the cascades out downstream at
their place (``services.sink_worker.fk.table_group``). One changefeed per downstream, all fed by
one capture; the cases run one after the other on the same tables."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpecV2, RouteRuleV1, SourceRefV1, TableFilterV1
from libs.changefeeds import record_changefeed
from libs.checksum import compare_tables
from libs.codec.table_meta import load_table_info
from libs.foreign_keys import group_token
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.routing import OriginColumn, TableRef, rewrite_meta
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target
from tests.helpers.converge import wait_converged
from tests.helpers.e2e import (  # noqa: F401 - fixtures
    _capture,
    _created,
    _delete_changefeeds_afterwards,
    _worker,
    downstream_mariadb,
)
from tests.helpers.fk_schema import CASCADE_SCHEMA, CASCADE_TABLES

pytestmark = pytest.mark.integration
DB = "fk_e2e"
SCHEMA = (
    *CASCADE_SCHEMA,
    "CREATE TABLE plain (id INT PRIMARY KEY, v INT)",
    # Replicated as tables of their own until a cascading key joins them (then one group).
    "CREATE TABLE a (id INT PRIMARY KEY)",
    "CREATE TABLE b (id INT PRIMARY KEY, a_id INT)",
)
TABLES = (*CASCADE_TABLES, "plain", "a", "b")
SEED = (
    "INSERT INTO customers VALUES (1, 'ann'), (2, 'bob'), (3, 'cy'), (5, 'ed')",
    "INSERT INTO orders VALUES (10, 1), (11, 1), (20, 2), (30, 3), (50, 5)",
    "INSERT INTO items VALUES (100, 10), (101, 10), (110, 11), (200, 20), (300, 30), (500, 50)",
    "INSERT INTO notes VALUES (1, 10), (2, 11), (3, 20), (4, NULL), (5, 50)",
    "INSERT INTO tree VALUES (1, NULL), (2, 1), (3, 2), (4, 3), (5, 1), (6, NULL), (7, 6)",
    "INSERT INTO plain VALUES (1, 1), (2, 2)",
    "INSERT INTO a VALUES (1), (2)",
    "INSERT INTO b VALUES (10, 1), (20, 2)",
)
# Each a transaction; together: delete and update cascades, several levels, SET NULL, a
# self-referencing subtree, cascades inside a larger transaction, and rows that come back.
CASES = (
    ("UPDATE customers SET id = 4 WHERE id = 2",),  # update cascade: orders 20 -> customer 4
    ("DELETE FROM customers WHERE id = 1",),  # orders 10, 11, their items; notes 1, 2 SET NULL
    ("UPDATE orders SET id = 31 WHERE id = 30",),  # items 300 follow; nothing else moves
    ("DELETE FROM tree WHERE id = 1",),  # 2, 3, 4, 5 (four levels); 6, 7 stay
    ("INSERT INTO plain VALUES (3, 3)", "INSERT INTO customers VALUES (6, 'fi')",
     "UPDATE customers SET name = 'cyd' WHERE id = 3", "DELETE FROM customers WHERE id = 3",
     "UPDATE plain SET v = 20 WHERE id = 2", "INSERT INTO orders VALUES (60, 6)",
     "INSERT INTO items VALUES (600, 60)"),  # a cascade among other changes of one transaction
    ("UPDATE orders SET id = 51 WHERE id = 50",),  # notes 5 SET NULL on update; items 500 -> 51
    ("DELETE FROM orders WHERE id = 20", "INSERT INTO orders VALUES (20, 4)",
     "INSERT INTO items VALUES (201, 20)"),  # a parent that comes back, with a new child
    # Capture publishes one message per (transaction, table): customers' (insert and delete)
    # before orders' and items'. Only the rows' ordinals put the children before the delete.
    ("INSERT INTO customers VALUES (7, 'gu')", "INSERT INTO orders VALUES (70, 7)",
     "INSERT INTO items VALUES (700, 70)", "DELETE FROM customers WHERE id = 7"),
)


# Keys created and cascaded at once (tests "keys known before the first change that depends on
# them"), each a transaction run right after the one before.
KEY_CHANGES = (
    ("CREATE TABLE np (id INT PRIMARY KEY)",),
    ("CREATE TABLE nc (id INT PRIMARY KEY, p_id INT,"
     " FOREIGN KEY (p_id) REFERENCES np (id) ON DELETE CASCADE ON UPDATE CASCADE)",),
    ("CREATE TABLE ns (id INT PRIMARY KEY, p_id INT,"
     " FOREIGN KEY (p_id) REFERENCES np (id) ON DELETE SET NULL ON UPDATE SET NULL)",),
    ("INSERT INTO np VALUES (1), (2), (3)", "INSERT INTO nc VALUES (10, 1), (20, 2), (30, 3)",
     "INSERT INTO ns VALUES (100, 1), (200, 2), (300, 3)"),
    ("DELETE FROM np WHERE id = 1",),  # nc 10 deleted, ns 100 SET NULL
    ("UPDATE np SET id = 4 WHERE id = 2",),  # nc 20 follows to 4, ns 200 SET NULL
    # A new child of orders: the group of customers, orders, items and notes grows by it.
    ("CREATE TABLE gc (id INT PRIMARY KEY, order_id INT,"
     " FOREIGN KEY (order_id) REFERENCES orders (id) ON DELETE CASCADE)",),
    ("INSERT INTO gc VALUES (1, 60), (2, 51)",),
    ("DELETE FROM customers WHERE id = 6",),  # orders 60, items 600 and gc 1 go with it
)
NEW_TABLES = ("np", "nc", "ns", "gc")


# Two shards merged into one target with an origin column: the same keys in both, and each
# shard's cascade stays in its shard.
SHARDS = (("fks1", "fk_s1"), ("fks2", "fk_s2"))
MERGED = "fk_merged"
LOADED = "fk_loaded"
SHARD_SCHEMA = SCHEMA[:2]
SHARD_TABLES = ("customers", "orders")
SHARD_SEED = ("INSERT INTO customers VALUES (1, 'a'), (2, 'b')", "INSERT INTO orders VALUES (10, 1), (11, 2)")
SHARD_CASES = {"fk_s1": ("DELETE FROM customers WHERE id = 1",),
               "fk_s2": ("UPDATE customers SET id = 3 WHERE id = 2",)}


def _run(source: MariaDB, *statements: str, db: str = DB) -> None:
    conn = source.connect(db)
    try:
        conn.begin()  # the helper's connections autocommit: the statements are ONE transaction
        with conn.cursor() as cur:
            for sql in statements:
                cur.execute(sql)
        conn.commit()
    finally:
        conn.close()


def _merged(source: MariaDB, url: str) -> list[Verification]:
    """Each merged target against the union of the shards' rows, told apart by origin."""
    origin = OriginColumn("_origin")
    out = []
    for table in SHARD_TABLES:
        upstream: list[dict[str, Any]] = []
        meta = None
        for source_id, db in SHARDS:
            conn = source.connect(db)
            try:
                info = load_table_info(conn, db, table)
                assert info is not None
                meta = info.meta()
                with conn.cursor() as cur:
                    cur.execute(f"SELECT * FROM `{table}`")
                    names = [d[0] for d in cur.description]
                    value = origin.value(TableRef(source_id, db, table))
                    upstream += [{**dict(zip(names, r, strict=True)), origin.name: value}
                                 for r in cur.fetchall()]
            finally:
                conn.close()
        assert meta is not None
        merged = rewrite_meta(meta, origin)
        target = TargetTable(schema=MERGED, name=table, meta=merged, key=tuple(merged.primary_key))
        downstream = open_sink(url).fetch_rows(target)
        diff = compare_tables(upstream, downstream, target.key, columns=list(merged.columns))
        out.append(Verification(f"{MERGED}.{table}", diff, "", ""))
    return out


def _wait_equal(source: MariaDB, targets: list[tuple[str, str]], merged_sinks: list[str],
                procs: list[ServiceProcess], timeout: float, tables: tuple[str, ...] = TABLES) -> None:
    """``targets``: (sink URL, schema) holding the tables of ``DB``; ``merged_sinks``: the shards'."""
    def verify() -> list[Verification]:
        results = [verify_target([ShardRef(source.url, DB, t)], url, schema, t)
                   for url, schema in targets for t in tables]
        return results + [r for url in merged_sinks for r in _merged(source, url)]

    wait_converged(verify, procs, timeout, interval=0.3, log_lines=5)


async def test_cascades_reach_three_downstreams_row_for_row(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],  # noqa: F811
) -> None:
    for db, schema in ((DB, SCHEMA), *((db, SHARD_SCHEMA) for _, db in SHARDS)):
        mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}")
        mariadb.execute(*schema, database=db)
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    # SQLite has one namespace: the merged targets get a file of their own.
    merged_sinks = [f"sqlite:///{tmp_path / 'merged.db'}", *sinks[1:]]
    logs = tmp_path / "logs"
    for source_id, db in (("fk", DB), *SHARDS):
        processes.append(_capture(service_env, logs, mariadb, source_id, db))
    for p in processes:
        p.wait_healthy(60)
    for i, (url, merged_url) in enumerate(zip(sinks, merged_sinks, strict=True)):
        specs = [
            ChangefeedSpecV2(id=f"fk-{i}", sources=[SourceRefV1(id="fk", url=mariadb.url)],
                             filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                             initial_load="binlog-only"),
            ChangefeedSpecV2(id=f"fk-merged-{i}", sources=[SourceRefV1(id=s, url=mariadb.url_for(db))
                                                           for s, db in SHARDS],
                             filter=TableFilterV1(include=["fk_s*.*"]), sink_url=merged_url,
                             routes=[RouteRuleV1(database="fk_s*", target_schema=MERGED)],
                             origin_column="_origin", initial_load="binlog-only")]
        for spec in specs:
            await record_changefeed(js, spec, requested_by="test")
            _created.append(spec.id)
    worker = _worker(service_env, logs, "worker-fk")
    processes.append(worker)
    worker.wait_healthy(60)

    await asyncio.to_thread(_run, mariadb, *SEED)
    for _, db in SHARDS:
        await asyncio.to_thread(_run, mariadb, *SHARD_SEED, db=db)
    await asyncio.to_thread(_wait_equal, mariadb, [(url, DB) for url in sinks], merged_sinks, processes,
                            180)  # Spark's first job
    for statements in CASES[:3]:
        await asyncio.to_thread(_run, mariadb, *statements)
    # Initial load of the tables with their keys (each copied on its own, in whatever order the
    # copies finish), then streaming with the cascades that follow.
    loaded = [(f"sqlite:///{tmp_path / 'loaded.db'}", LOADED), (postgres.url, LOADED),
              (downstream_mariadb.url, LOADED)]
    for i, (url, _) in enumerate(loaded):
        spec = ChangefeedSpecV2(id=f"fk-load-{i}", sources=[SourceRefV1(id="fk", url=mariadb.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                                routes=[RouteRuleV1(database=DB, target_schema=LOADED)],
                                initial_load="snapshot")
        await record_changefeed(js, spec, requested_by="test")
        _created.append(spec.id)
    for statements in CASES[3:]:
        await asyncio.to_thread(_run, mariadb, *statements)
    for db, statements in SHARD_CASES.items():
        await asyncio.to_thread(_run, mariadb, *statements, db=db)
    await asyncio.to_thread(_wait_equal, mariadb, [(url, DB) for url in sinks] + loaded, merged_sinks,
                            processes, 90)

    # One span for the four tables the keys connect, one for the self-referencing table, one
    # for the table outside any key.
    groups = {group_token([(DB, t) for t in TABLES[:4]])[1], group_token([(DB, "tree")])[1]}
    assert _spans(worker, "fk-0") == groups | {"plain", "a", "b"}

    # Keys that change in the stream, each followed at once by the cascade that needs them
    # (discovery reads keys every few seconds; the spans stop at the key change until their
    # group is formed again, and the group replays from the lowest checkpoint of their spans):
    # - a cascading key added to replicated tables: their spans become one group;
    # - tables created and cascaded within a second (delete and update cascade, SET NULL);
    # - a group grown by a new child of one of its tables (announced on the parent's subject).
    await asyncio.to_thread(_run, mariadb, "ALTER TABLE b ADD CONSTRAINT fk_a FOREIGN KEY (a_id)"
                                           " REFERENCES a (id) ON DELETE CASCADE")
    await asyncio.to_thread(_run, mariadb, "DELETE FROM a WHERE id = 1", "INSERT INTO b VALUES (30, 2)")
    for statements in KEY_CHANGES:
        await asyncio.to_thread(_run, mariadb, *statements)
    await asyncio.to_thread(_wait_equal, mariadb, [(url, DB) for url in sinks] + loaded, merged_sinks,
                            processes, 90, (*TABLES, *NEW_TABLES))
    joined = group_token([(DB, "a"), (DB, "b")])[1]
    created = group_token([(DB, t) for t in ("np", "nc", "ns")])[1]
    grown = group_token([(DB, t) for t in (*TABLES[:4], "gc")])[1]
    cfs = [f"fk-{i}" for i in range(3)] + [f"fk-load-{i}" for i in range(3)]
    spans = [_spans(worker, cf) for cf in cfs]
    assert all({joined, created, grown} <= s for s in spans), spans
    assert "starts from its tables' lowest checkpoint" in worker.log_path.read_text()


def _spans(worker: ServiceProcess, changefeed: str) -> set[str]:
    return {s["table"] for s in (worker.health() or {}).get("spans", []) if s["changefeed"] == changefeed}
