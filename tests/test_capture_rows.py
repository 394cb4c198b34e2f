"""Capture against a real MariaDB and nats-server: every column type, order, idle resolved ts."""

from __future__ import annotations

import base64

import pytest
from nats.js import JetStreamContext

from contracts.events.rows import DdlExecutedV1, ForeignKeysChangedV1, RowsChangedV2
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.stream_origin import STREAM_ORIGIN_HEADER, StreamOrigin
from services.capture.metrics import CASCADING_FOREIGN_KEYS
from services.capture.ts_clock import physical_ms, wall_ms
from tests.helpers.capture import (
    binlog_position,
    capture_settings,
    check_order,
    ddl_of,
    eventually,
    fresh_database,
    last_resolved,
    rejections,
    replay,
    rows_of,
    running_capture,
    source_messages,
    wait_reading,
    wait_resolved_past,
)
from tests.helpers.capture_pipeline import FULL_IMAGE, NULL_IMAGE

pytestmark = pytest.mark.integration

TYPES_TABLE = """
CREATE TABLE types (
  id BIGINT UNSIGNED NOT NULL PRIMARY KEY,
  i INT, si SMALLINT UNSIGNED, d DECIMAL(12,3), f FLOAT, dbl DOUBLE,
  s VARCHAR(32) CHARACTER SET utf8mb4, tx TEXT CHARACTER SET utf8mb4,
  b BLOB, vb VARBINARY(16),
  dt DATE, dtt DATETIME(6), ts TIMESTAMP(3) NULL DEFAULT NULL, tm TIME(2),
  j JSON, e ENUM('small','large'), st SET('a','b','c'), bt BIT(10), yr YEAR
)"""

FULL_ROW = ("INSERT INTO types VALUES (18446744073709551615, -2147483648, 65535, -123456789.125, 1.5, "
            "2.25, 'héllo 😀', 'long text ✓', x'00ff10', x'deadbeef', '2024-02-29', "
            "'2024-02-29 23:59:58.123456', '2024-03-01 01:02:03.456', '-12:34:56.78', "
            "'{\"k\": [1, \"ü\"]}', 'large', 'c,a', b'1000000001', 2024)")

KINDS = {"id": "int", "i": "int", "si": "int", "d": "decimal", "f": "float", "dbl": "float",
         "s": "string", "tx": "string", "b": "bytes", "vb": "bytes", "dt": "date", "dtt": "datetime",
         "ts": "timestamp", "tm": "time", "j": "json", "e": "string", "st": "set", "bt": "bit",
         "yr": "int"}


async def test_workload_every_type_in_order(mariadb: MariaDB, nats_server: NatsServer,
                                            js: JetStreamContext, replica_server_id: int) -> None:
    source, name = "cap_wl", "cap_wl"
    fresh_database(mariadb, name, TYPES_TABLE,
                   "CREATE TABLE two (id INT PRIMARY KEY, name VARCHAR(20) NOT NULL, code INT NOT NULL,"
                   " UNIQUE KEY u_code (code))")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        conn = mariadb.connect(name)
        with conn.cursor() as cur:
            cur.execute("SET time_zone = '+00:00'")
            cur.execute(FULL_ROW)
            cur.execute("INSERT INTO types (id, st) VALUES (2, '')")
            cur.execute("BEGIN")
            cur.executemany("INSERT INTO two VALUES (%s, %s, %s)", [(1, "one", 10), (2, "two", 20),
                                                                    (3, "three", 30)])
            cur.execute("UPDATE types SET i = 7, j = '[]' WHERE id = 2")
            cur.execute("DELETE FROM two WHERE id = 2")
            cur.execute("COMMIT")
            cur.execute("UPDATE two SET id = 11, name = 'eleven' WHERE id = 1")
            cur.execute("ALTER TABLE two ADD COLUMN note VARCHAR(10) NULL")
            cur.execute("INSERT INTO two VALUES (4, 'four', 40, 'n')")
            cur.execute("DELETE FROM types WHERE id = 2")
        conn.close()
        end = binlog_position(mariadb)
        await wait_resolved_past(js, source, end)
        assert capture.status["lease"] is True and capture.status["state"] == "reading"

    messages = await source_messages(js, source)
    check_order(messages)
    rows = rows_of(messages)
    by_table = {t: [e for e in rows if e.table == t] for t in ("types", "two")}

    first = by_table["types"][0]
    assert [r.op for r in first.rows] == ["insert"] and first.rows[0].after == FULL_IMAGE
    assert {c.name: c.kind for c in first.meta.columns} == KINDS
    assert first.meta.primary_key == ["id"] and first.database == name
    assert by_table["types"][1].rows[0].after == NULL_IMAGE

    # The multi-statement transaction: one message per table, one ts, images in binlog order.
    txn = [e for e in rows if e.position == by_table["two"][0].position]
    assert sorted(e.table for e in txn) == ["two", "types"] and len({e.ts for e in txn}) == 1
    two_ops = [(r.op, (r.before or {}).get("id"), (r.after or {}).get("id")) for r in by_table["two"][0].rows]
    assert two_ops == [("insert", None, 1), ("insert", None, 2), ("insert", None, 3), ("delete", 2, None)]
    update = next(e for e in txn if e.table == "types").rows[0]
    assert update.op == "update" and update.before == NULL_IMAGE
    assert update.after == {**NULL_IMAGE, "i": 7, "j": "[]"}
    # Each row's ordinal: its place in the transaction's binlog, counted across both tables.
    assert [r.ordinal for r in by_table["two"][0].rows] == [0, 1, 2, 4] and update.ordinal == 3
    assert all(r.ordinal == i for e in rows if e.position != txn[0].position for i, r in enumerate(e.rows))
    # Unique keys come from information_schema, used only where it shows the table at the rows'
    # position: always after the last DDL (before it, depending on how far capture lagged).
    assert by_table["two"][-1].meta.unique_keys == [["code"]]
    assert all(e.meta.primary_key == ["id"] and e.meta.unique_keys in ([], [["code"]])
               for e in by_table["two"])

    ddl = ddl_of(messages)
    alter = "ALTER TABLE two ADD COLUMN note VARCHAR(10) NULL"
    assert [(d.table, d.statement) for d in ddl] == [("two", alter)]
    assert ddl[0].meta_after is not None and ddl[0].meta_after.columns[-1].name == "note"
    assert replay(rows, "two", "id") == {
        3: {"id": 3, "name": "three", "code": 30},
        11: {"id": 11, "name": "eleven", "code": 10},
        4: {"id": 4, "name": "four", "code": 40, "note": "n"},
    }
    assert set(replay(rows, "types", "id")) == {FULL_IMAGE["id"]}
    # Nothing about these tables is suspicious.
    assert await rejections(js, source) == []
    # Message ids are the binlog positions, so they are unique.
    assert len({m.id for m in messages}) == len(messages)


async def test_resolved_ts_advances_while_idle(mariadb: MariaDB, nats_server: NatsServer,
                                               js: JetStreamContext, replica_server_id: int) -> None:
    source, name = "cap_idle", "cap_idle"
    fresh_database(mariadb, name, "CREATE TABLE t (id INT PRIMARY KEY)")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name) + "?heartbeat=0.2",
                                replica_server_id)
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO t VALUES (1)", database=name)
        mark = await wait_resolved_past(js, source, binlog_position(mariadb))
        seen = [mark.ts]

        async def advanced_twice() -> bool:
            got = await last_resolved(js, source)
            assert got is not None
            if got[0].ts > seen[-1]:
                seen.append(got[0].ts)
            return len(seen) >= 3

        await eventually(advanced_twice, 10, "two idle resolved marks")
        assert abs(physical_ms(seen[-1]) - wall_ms()) < 5000
        # A change after the idle marks gets a greater ts than every one of them.
        mariadb.execute("INSERT INTO t VALUES (2)", database=name)
        await wait_resolved_past(js, source, binlog_position(mariadb))
        got = await last_resolved(js, source)
        assert got is not None
        origin = StreamOrigin.parse(got[1][STREAM_ORIGIN_HEADER])
    rows = rows_of(await source_messages(js, source))
    assert [r.rows[0].after for r in rows] == [{"id": 1}, {"id": 2}]
    assert rows[1].ts > seen[-1]
    # Every mark says where the source's stream begins: before the first row, and the same
    # after a restart (the marks are rolled up, so each one carries it on).
    first = rows[0].position
    assert (origin.binlog_file, origin.binlog_pos) <= (first.binlog_file, first.binlog_pos)
    assert origin.ts < rows[0].ts
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO t VALUES (3)", database=name)
        await wait_resolved_past(js, source, binlog_position(mariadb))
        got = await last_resolved(js, source)
        assert got is not None and StreamOrigin.parse(got[1][STREAM_ORIGIN_HEADER]) == origin


async def test_table_without_key_and_unsupported_type_are_rejected(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, replica_server_id: int) -> None:
    source, name = "cap_bad", "cap_bad"
    fresh_database(mariadb, name, "CREATE TABLE nokey (a INT, b VARCHAR(5))",
                   "CREATE TABLE geo (id INT PRIMARY KEY, p INET6)",
                   "CREATE TABLE uk (a INT NOT NULL, b INT, UNIQUE KEY (a))")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO nokey VALUES (1, 'x'), (1, 'x')", "INSERT INTO nokey VALUES (2, 'y')",
                        "INSERT INTO geo VALUES (1, '::1')", "INSERT INTO geo VALUES (2, '::2')",
                        "INSERT INTO uk VALUES (5, NULL)", database=name)
        await wait_resolved_past(js, source, binlog_position(mariadb))

    messages = await source_messages(js, source)
    got = {(r.kind, r.table) for r in await rejections(js, source)}
    assert got == {("no_primary_key", "nokey"), ("unsupported_type", "geo")}
    rows = rows_of(messages)
    # Rows of a keyless table still flow, marked as such; the unsupported table's do not.
    nokey = [e for e in rows if e.table == "nokey"]
    assert [len(e.rows) for e in nokey] == [2, 1] and nokey[0].meta.primary_key == []
    assert not [e for e in rows if e.table == "geo"]
    # A unique key over NOT NULL columns identifies rows as well as a primary key.
    uk = next(e for e in rows if e.table == "uk")
    assert uk.meta.primary_key == ["a"] and uk.rows[0].after == {"a": 5, "b": None}
    assert all(isinstance(m.event, RowsChangedV2 | DdlExecutedV1) or m.subject.endswith(".rejected")
               for m in messages)


async def test_cascading_foreign_keys_are_named_and_followed_through_ddl(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, replica_server_id: int) -> None:
    source, name = "cap_fk", "cap_fk"
    fresh_database(mariadb, name, "CREATE TABLE p (id INT PRIMARY KEY)",
                   "CREATE TABLE c (id INT PRIMARY KEY, p INT, CONSTRAINT fk_p FOREIGN KEY (p)"
                   " REFERENCES p (id) ON DELETE CASCADE)",
                   "CREATE TABLE r (id INT PRIMARY KEY, p INT, FOREIGN KEY (p) REFERENCES p (id))")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)

    def named() -> list[str]:
        return list(capture.status.get("cascading_foreign_keys") or [])

    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO p VALUES (1)", "INSERT INTO c VALUES (10, 1)", database=name)
        first = ["cap_fk.c.fk_p (p) -> cap_fk.p (id) ON DELETE CASCADE"]
        await eventually(lambda: _is(named(), first), 20, f"capture to name {first}")
        # A DDL replaces the key: capture follows it (the old one is gone, the new one named).
        mariadb.execute("ALTER TABLE c DROP FOREIGN KEY fk_p", "ALTER TABLE c ADD CONSTRAINT fk_q FOREIGN KEY"
                        " (p) REFERENCES p (id) ON UPDATE SET NULL", database=name)
        second = ["cap_fk.c.fk_q (p) -> cap_fk.p (id) ON UPDATE SET NULL"]
        await eventually(lambda: _is(named(), second), 20, f"capture to name {second} after the DDL")
        assert CASCADING_FOREIGN_KEYS.labels(source)._value.get() == 1
        # The key changes reach the parent's DDL subject too, in stream order at each DDL's ts
        # (DESIGN.md, "Foreign-key cascades", 4.); the drop names no parent.
        messages = await source_messages(js, source)
        alter = [m.event for m in messages
                 if isinstance(m.event, DdlExecutedV1) and "fk_q" in m.event.statement]
        announced = [m for m in messages if isinstance(m.event, ForeignKeysChangedV1)
                     and "fk_q" in m.event.statement]
        assert [(m.subject, m.event.ts, m.event.by_table) for m in announced] == [
            (f"sluice.ddl.{source}.{name}.p", alter[0].ts, "c")]


async def _is(got: list[str], want: list[str]) -> bool:
    return got == want


async def test_huge_transaction_is_split_into_parts(mariadb: MariaDB, nats_server: NatsServer,
                                                    js: JetStreamContext, replica_server_id: int) -> None:
    source, name = "cap_parts", "cap_parts"
    fresh_database(mariadb, name, "CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(10))",
                   "CREATE TABLE big (id INT PRIMARY KEY, b LONGBLOB)",
                   "CREATE TABLE small (id INT PRIMARY KEY)")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        conn = mariadb.connect(name)
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            cur.executemany("INSERT INTO t VALUES (%s, %s)", [(i, f"r{i}") for i in range(1201)])
            cur.execute("COMMIT")
            # A row over NATS' max_payload (1 MiB) travels in chunks, in its transaction.
            cur.execute("BEGIN")
            cur.execute("INSERT INTO big VALUES (1, REPEAT('x', 1100000))")
            cur.execute("INSERT INTO small VALUES (1)")
            cur.execute("COMMIT")
        conn.close()
        await wait_resolved_past(js, source, binlog_position(mariadb))
    rows = rows_of(await source_messages(js, source))
    parts = [(e.part, e.last_part, len(e.rows)) for e in rows if e.table == "t"]
    assert parts == [(0, False, 500), (1, False, 500), (2, True, 201)]
    assert len({e.ts for e in rows if e.table == "t"}) == 1
    assert [r.after["id"] for e in rows if e.table == "t" for r in e.rows if r.after] == list(range(1201))
    assert [e.table for e in rows if e.table != "t"] == ["big", "small"]
    big = next(m for m in await source_messages(js, source) if m.subject.endswith(".big"))
    assert big.chunks >= 2, "the 1.1 MB row was not cut into chunks"
    assert base64.b64decode(big.event.rows[0].after["b"]) == b"x" * 1100000
    assert await rejections(js, source) == []
