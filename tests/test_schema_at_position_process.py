"""A row is read with the schema it was written with, end to end with real processes: MariaDB
binlog -> capture -> sink-worker (Spark) -> SQLite, PostgreSQL and MariaDB, compared row for row.

The capture process is paused (SIGSTOP) while the schema changes run - a writer-less gh-ost
cut-over, a pt-osc cut-over, ADD PRIMARY KEY, DROP PRIMARY KEY (with a unique key in its place,
and with none), a RENAME right after writes - and resumed (SIGCONT) after the last of them, so it
reads every row after information_schema already shows the tables' final shapes (or no table).
Each row must still carry the key it had at its position, and no table that had a key there is
refused as keyless."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.rows import DdlExecutedV1, RowsChangedV2
from libs.changefeeds import record_changefeed
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from services.sink_worker.validation.verify import ShardRef, Verification, verify_targets
from tests.helpers.capture import binlog_position, eventually, last_resolved, read_messages, rejections
from tests.helpers.converge import wait_converged
from tests.helpers.e2e import (  # noqa: F401 - fixtures
    _capture,
    _created,
    _delete_changefeeds_afterwards,
    _worker,
    downstream_mariadb,
)

pytestmark = pytest.mark.integration
DB = "sch_pos"
SOURCE = "schpos"
SCHEMA = (
    "CREATE TABLE orders (id INT PRIMARY KEY, n INT)",  # gh-ost
    "CREATE TABLE items (id INT PRIMARY KEY, v VARCHAR(20))",  # pt-osc
    "CREATE TABLE ak (id INT NOT NULL, code INT NOT NULL, v INT, UNIQUE KEY u_code (code))",
    "CREATE TABLE dk (id INT PRIMARY KEY, code INT NOT NULL, v INT)",
    "CREATE TABLE gone_key (id INT PRIMARY KEY, v INT)",  # DROP PRIMARY KEY, nothing instead
    "CREATE TABLE rn (id INT PRIMARY KEY, v INT)",
)
SEED = (
    "INSERT INTO orders VALUES (1, 10), (2, 20), (3, 30)",
    "INSERT INTO items VALUES (1, 'a'), (2, 'b')",
    "INSERT INTO ak VALUES (1, 100, 1), (2, 200, 2)",
    "INSERT INTO dk VALUES (1, 100, 1), (2, 200, 2)",
    "INSERT INTO gone_key VALUES (1, 1)",
    "INSERT INTO rn VALUES (1, 1)",
)
# Run while capture is stopped: every row below is read when information_schema is past it.
CHANGES = (
    # gh-ost: ghost LIKE the original, altered, copied, the original's writes applied to it,
    # then the cut-over with no writer running, and the original dropped.
    "INSERT INTO orders VALUES (4, 40)",
    "CREATE TABLE _orders_gho LIKE orders",
    "ALTER TABLE _orders_gho ADD COLUMN note VARCHAR(10) NOT NULL DEFAULT 'g'",
    "INSERT INTO _orders_gho (id, n) SELECT id, n FROM orders",
    "UPDATE orders SET n = 41 WHERE id = 4",
    "REPLACE INTO _orders_gho (id, n) VALUES (4, 41)",
    "RENAME TABLE orders TO _orders_del, _orders_gho TO orders",
    "DROP TABLE _orders_del",
    # pt-osc: new table, plain copy, atomic rename, old one dropped, writes after.
    "UPDATE items SET v = 'b2' WHERE id = 2",
    "CREATE TABLE _items_new (id INT PRIMARY KEY, v VARCHAR(40), extra INT NULL)",
    "INSERT INTO _items_new (id, v) SELECT id, v FROM items",
    "RENAME TABLE items TO _items_old, _items_new TO items",
    "DROP TABLE _items_old",
    "INSERT INTO items VALUES (3, 'c', 3)",
    # The unique NOT NULL key is the key until a primary key is added.
    "UPDATE ak SET v = 11 WHERE id = 1",
    "ALTER TABLE ak ADD PRIMARY KEY (id)",
    "UPDATE ak SET code = 201 WHERE id = 2",
    # The primary key is the key until it is dropped; a unique key takes over.
    "UPDATE dk SET code = 101 WHERE id = 1",
    "ALTER TABLE dk DROP PRIMARY KEY, ADD UNIQUE KEY u_code (code)",
    "UPDATE dk SET id = 20 WHERE code = 200",
    # Keyed up to the ALTER, keyless after it.
    "UPDATE gone_key SET v = 2 WHERE id = 1",
    "ALTER TABLE gone_key DROP PRIMARY KEY",
    "INSERT INTO gone_key VALUES (2, 2)",
    # Rows written just before their table is renamed away.
    "INSERT INTO rn VALUES (2, 2)",
    "UPDATE rn SET v = 10 WHERE id = 1",
    "RENAME TABLE rn TO rn2",
)
SEEDED = ("orders", "items", "ak", "dk", "gone_key", "rn")
COMPARED = ("orders", "items", "ak", "dk", "rn2")  # gone_key is refused from its keyless rows on


def _verify(source: MariaDB, sinks: list[str], tables: tuple[str, ...]) -> list[Verification]:
    return [r for t in tables for r in verify_targets([ShardRef(source.url, DB, t)], sinks, DB, t)]


async def test_rows_keep_their_schema_when_capture_lags_behind_ddl(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],  # noqa: F811
) -> None:
    mariadb.execute(f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}")
    mariadb.execute(*SCHEMA, database=DB)
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, SOURCE, DB)
    processes.append(capture)
    capture.wait_healthy(60)
    for i, url in enumerate(sinks):
        spec = ChangefeedSpecV2(id=f"schpos-{i}", sources=[SourceRefV1(id=SOURCE, url=mariadb.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                                initial_load="binlog-only")
        await record_changefeed(js, spec, requested_by="test")
        _created.append(spec.id)
    worker = _worker(service_env, logs, "worker-schpos")
    processes.append(worker)
    worker.wait_healthy(60)
    mariadb.execute(*SEED, database=DB)
    await asyncio.to_thread(wait_converged, lambda: _verify(mariadb, sinks, SEEDED), processes, 180,
                            interval=0.5, log_lines=5)  # Spark's first job

    start = binlog_position(mariadb)
    capture.pause()
    try:
        mariadb.execute(*CHANGES, database=DB)
    finally:
        capture.resume()
    end = binlog_position(mariadb)

    async def read_all() -> bool:
        got = await last_resolved(js, SOURCE)
        return got is not None and (got[0].position.binlog_file, got[0].position.binlog_pos) >= end

    await eventually(read_all, 60, "capture past the changes")
    await asyncio.to_thread(wait_converged, lambda: _verify(mariadb, sinks, COMPARED), processes, 180,
                            interval=0.5, log_lines=5)

    # Each row carries the key its table had at the row's position.
    stored = await read_messages(js, f"sluice.*.{SOURCE}.{DB}.>")
    after = [m.event for m in stored if isinstance(m.event, RowsChangedV2 | DdlExecutedV1)
             and (m.event.position.binlog_file, m.event.position.binlog_pos) >= start]
    keys = {t: [(e.meta.primary_key, e.meta.unique_keys) for e in after
                if isinstance(e, RowsChangedV2) and e.table == t]
            for t in ("ak", "dk", "gone_key", "_orders_gho", "orders", "rn")}
    assert keys["ak"] == [(["code"], []), (["id"], [["code"]])]
    assert keys["dk"] == [(["id"], []), (["code"], [])]
    assert keys["gone_key"] == [(["id"], []), ([], [])]
    assert keys["_orders_gho"] and all(k == (["id"], []) for k in keys["_orders_gho"])
    assert keys["orders"] and all(k[0] == ["id"] for k in keys["orders"])
    assert keys["rn"] == [(["id"], [])] * 2
    ghost = next(e for e in after if isinstance(e, RowsChangedV2) and e.table == "_orders_gho")
    assert [c.name for c in ghost.meta.columns] == ["id", "n", "note"]

    # A DDL's meta_after is the table right after it, or none when a later DDL of the table
    # already shows in information_schema.
    ddl = {(e.table, e.statement): e.meta_after for e in after if isinstance(e, DdlExecutedV1)}
    assert ddl[("_orders_gho", "CREATE TABLE _orders_gho LIKE orders")] is None
    add_pk = ddl[("ak", "ALTER TABLE ak ADD PRIMARY KEY (id)")]
    assert add_pk is not None and add_pk.primary_key == ["id"] and add_pk.unique_keys == [["code"]]
    assert ddl[("items", "RENAME TABLE items TO _items_old, _items_new TO items")] is not None

    # Only the table that truly lost its key is refused, once, at a row after the ALTER.
    refused = [(r.kind, r.table) for r in await rejections(js, SOURCE)]
    assert refused == [("no_primary_key", "gone_key")]
