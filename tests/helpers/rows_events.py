"""Rows events of the type matrix, for the compiled row decoder's tests.

``statements`` writes every column type of the type matrix (``type_cases``) with its edge values,
text in every character set capture decodes (``CHARSET_CASES``), plus what the matrix leaves out
(zero dates, an invalid ENUM value, an empty SET, NULLs, rows events of many rows, a table map
wider than one null-bitmap byte, a column type the compiled decoder does not cover).
``read_items`` reads them back through capture's ``BinlogReader``, with the compiled decoder or
with the library's parse. ``record`` keeps each rows event's bytes with the library's values, and
``python -m tests.helpers.rows_events tests/fixtures/rows_events.json.gz`` writes them to the
fixture the fast lane decodes without a server.

``typed`` spells a value with its exact type, so ``1``, ``1.0``, ``True`` and ``Decimal(1)``
(equal in Python) never pass for each other in a comparison.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from libs.localservers.mariadb import MariaDB
from services.capture.binlog_reader import (
    BinlogReader,
    Heartbeat,
    Item,
    Position,
    ReaderFailed,
    Rows,
    _convert,
)
from tests.helpers.type_cases import CHARSET_CASES, KEY_CASES, VALUE_CASES

DB = "rows_decode"

# Beyond the type matrix: values only a lax sql_mode lets in, and types the matrix keeps apart.
EXTRA_COLUMNS = (
    ("d", "date"), ("dt0", "datetime"), ("dt3", "datetime(3)"), ("ts0", "timestamp NULL"),
    ("ts6", "timestamp(6) NULL"), ("e", "enum('a','b')"), ("s", "set('x','y')"),
    ("dec1", "decimal(1,0)"), ("dec9_9", "decimal(9,9)"), ("dec18_9", "decimal(18,9)"),
    ("dec20_10_u", "decimal(20,10) unsigned"), ("dec38_2", "decimal(38,2)"),
    ("f", "float"), ("big_set", "set(" + ",".join(f"'m{i}'" for i in range(64)) + ")"),
    ("big_enum", "enum(" + ",".join(f"'e{i}'" for i in range(300)) + ")"),
    ("bin255", "binary(255)"), ("vc300", "varchar(300) character set latin1"),
    ("c_ucs2", "varchar(10) character set ucs2"), ("c_utf16", "varchar(10) character set utf16"),
    ("c_sjis", "varchar(10) character set sjis"), ("c_gbk", "varchar(10) character set gbk"),
    ("c_cp1251", "char(10) character set cp1251"), ("c_swe7", "varchar(10) character set swe7"),
    ("c_eucjpms", "varchar(10) character set eucjpms"),
)
EXTRA_ROWS = (
    ("'0000-00-00'", "'0000-00-00 00:00:00'", "'2020-00-05 01:02:03.456'", "'0000-00-00 00:00:00'",
     "'0000-00-00 00:00:00.000000'", "'zz'", "''", "-9", "'0.999999999'", "'-123456789.123456789'",
     "'1234567890.0123456789'", "'-123456789012345678901234567890123456.78'", "'1e-30'",
     "'" + ",".join(f"m{i}" for i in range(64)) + "'", "'e299'", "x'00'", "'" + "ÿ" * 300 + "'",
     "'añ😀'", "'añ😀'", "'ｱｲ'", "'中文'", "'Жж'", "'abc'", "'ア'"),
    ("'2024-00-00'", "'2024-02-00 00:00:00'", "'0000-01-01 00:00:00.001'", "'1970-01-01 00:00:01'",
     "'2038-01-19 03:14:07.000001'", "'b'", "'x,y'", "0", "'-0.000000001'", "'0.000000000'",
     "'0'", "'0.01'", "'-0.0'", "'m0,m63'", "'e0'", "''", "''", "''", "''", "''", "''", "''", "''", "''"),
    tuple("NULL" for _ in EXTRA_COLUMNS),
)


def statements() -> list[str]:
    out = [f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}"]
    wide = ", ".join(f"c_{c.id} {c.sql_type}" for c in VALUE_CASES)
    out.append(f"CREATE TABLE {DB}.wide (id INT PRIMARY KEY, {wide})")
    for k in KEY_CASES:
        out.append(f"CREATE TABLE {DB}.{k.table} (k {k.sql_type} NOT NULL PRIMARY KEY, n INT)")
    extra = ", ".join(f"{name} {sql_type}" for name, sql_type in EXTRA_COLUMNS)
    out.append(f"CREATE TABLE {DB}.extra (id INT PRIMARY KEY, {extra})")
    out.append(f"CREATE TABLE {DB}.narrow (id INT PRIMARY KEY, k INT NOT NULL, c CHAR(120) NOT NULL,"
               " pad CHAR(60) NOT NULL)")
    out.append(f"CREATE TABLE {DB}.spatial (id INT PRIMARY KEY, p POINT, n INT,"
               " g GEOMETRY REF_SYSTEM_ID=4326)")
    charsets = ", ".join(f"c_{c.id} {c.sql_type}" for c in CHARSET_CASES)
    out.append(f"CREATE TABLE {DB}.charsets (id INT PRIMARY KEY, {charsets})")
    # The type matrix's rows, one insert each, then a multi-row update and delete.
    rows = max(len(c.values) for c in VALUE_CASES) + 1
    names = ", ".join(f"c_{c.id}" for c in VALUE_CASES)
    for i in range(rows):
        values = ", ".join(c.values[i] if i < len(c.values) else "NULL" for c in VALUE_CASES)
        out.append(f"INSERT INTO {DB}.wide (id, {names}) VALUES ({i}, {values})")
    out.append(f"INSERT INTO {DB}.wide (id) VALUES ({rows}), ({rows + 1})")
    sets = ", ".join(f"c_{c.id} = {c.values[0]}" for c in VALUE_CASES)
    out.append(f"UPDATE {DB}.wide SET {sets} WHERE id = {rows}")
    out.append(f"UPDATE {DB}.wide SET id = id + 100")  # every row, one rows event or a few
    out.append(f"DELETE FROM {DB}.wide WHERE id >= 100")
    for k in KEY_CASES:
        values = ", ".join(f"({v}, {n})" for n, v in enumerate(k.values))
        out.append(f"INSERT INTO {DB}.{k.table} (k, n) VALUES {values}")
        out.append(f"UPDATE {DB}.{k.table} SET n = n + 100")
        out.append(f"DELETE FROM {DB}.{k.table} WHERE k = {k.values[-1]}")
    # Zero dates, an invalid ENUM value (index 0) and the like need a lax sql_mode.
    out.append("SET SESSION sql_mode = ''")
    extra_names = ", ".join(name for name, _ in EXTRA_COLUMNS)
    for i, row in enumerate(EXTRA_ROWS):
        out.append(f"INSERT INTO {DB}.extra (id, {extra_names}) VALUES ({i}, {', '.join(row)})")
    out.append(f"UPDATE {DB}.extra SET id = id + 10")
    out.append(f"DELETE FROM {DB}.extra")
    out.append("SET SESSION sql_mode = DEFAULT")
    narrow = ", ".join(f"({i}, {i * 7}, '{'c' * (i % 120)}', '{'p' * 60}')" for i in range(200))
    out.append(f"INSERT INTO {DB}.narrow VALUES {narrow}")
    out.append(f"UPDATE {DB}.narrow SET k = k + 1 WHERE id < 150")
    out.append(f"DELETE FROM {DB}.narrow WHERE id >= 50")
    # Text in every charset capture decodes: inserts, an update of all rows, a delete.
    names = ", ".join(f"c_{c.id}" for c in CHARSET_CASES)
    for i in range(max(len(c.values) for c in CHARSET_CASES) + 1):
        values = ", ".join(c.values[i] if i < len(c.values) else "NULL" for c in CHARSET_CASES)
        out.append(f"INSERT INTO {DB}.charsets (id, {names}) VALUES ({i}, {values})")
    out.append(f"UPDATE {DB}.charsets SET id = id + 10")
    out.append(f"DELETE FROM {DB}.charsets WHERE id = 10")
    out.append(f"INSERT INTO {DB}.spatial VALUES (1, POINT(1, 2), 3,"
               " ST_GeomFromText('GEOMETRYCOLLECTION EMPTY', 4326)), (2, NULL, NULL, NULL),"
               " (3, ST_GeomFromText('POINT(-1.5 1e300)', 0), 5,"
               " ST_GeomFromText('POLYGON((0 0, 10 0, 10 10, 0 0), (1 1, 2 1, 2 2, 1 1))', 4326))")
    out.append(f"UPDATE {DB}.spatial SET n = 4")
    return out


def write(server: MariaDB, more: Sequence[str] = (), *,
          autocommit: bool = False) -> tuple[Position, Position]:
    """Run ``statements`` and then ``more`` on one connection (the session's sql_mode matters);
    the binlog positions before and after. ``autocommit``: each statement its own transaction
    (``more`` may then hold BEGIN/COMMIT and XA of its own)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("FLUSH BINARY LOGS")
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            start = Position(str(file), int(pos))
            if autocommit:
                conn.autocommit(True)
            for stmt in [*statements(), *more]:
                cur.execute(stmt)
            if not autocommit:
                conn.commit()
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            return start, Position(str(file), int(pos))
    finally:
        conn.close()


def assert_same_items(mine: Sequence[Item], theirs: Sequence[Item]) -> None:
    """Two reads of one binlog range gave equal items, rows compared with their values' types."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert type(a) is type(b)
        if isinstance(a, Rows) and isinstance(b, Rows):
            where = f"{b.table} {b.op} at {b.position}"
            assert typed_rows(a) == typed_rows(b), where
            assert a == b, where
        else:
            assert a == b


def read_items(server: MariaDB, start: Position, end: Position, *, fast_rows: bool,
               server_id: int = 4242, direct: bool = True) -> tuple[list[Item], BinlogReader]:
    """Capture's reader's items from ``start`` until it has read ``end`` (``direct``: the hot
    events read from the packets' bytes, as capture does; false: every event by the library)."""
    reader = BinlogReader(server.replication_settings(), server_id, start, heartbeat_s=0.2,
                          fast_rows=fast_rows, direct=direct)
    reader.start()
    items: list[Item] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            for item in reader.take(wait=0.2):
                assert not isinstance(item, ReaderFailed), item.error
                if isinstance(item, Heartbeat):
                    if (item.position.file, item.position.pos) >= (end.file, end.pos):
                        return items, reader
                    continue
                items.append(item)
        raise AssertionError(f"the reader did not reach {end} within 120 s")
    finally:
        reader.stop()
        reader.join(5)


def typed(value: Any) -> Any:
    """``value`` as JSON-ready data that names its exact type (a SET's members sorted)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(k): typed(v) for k, v in value.items()}
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", str(value)]
    if isinstance(value, float):
        return ["float", value.hex()]
    if isinstance(value, Decimal):
        return ["decimal", str(value)]
    if isinstance(value, str):
        return ["str", value]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if isinstance(value, dt.datetime):
        return ["datetime", value.isoformat()]
    if isinstance(value, dt.date):
        return ["date", value.isoformat()]
    if isinstance(value, dt.timedelta):
        return ["timedelta", value.days, value.seconds, value.microseconds]
    if isinstance(value, set | frozenset):
        return [type(value).__name__, sorted(value)]
    raise TypeError(f"no typed spelling for {type(value).__name__}")


def typed_rows(item: Rows) -> list[Any]:
    return [[typed(i.before), typed(i.after), i.before_none, i.after_none] for i in item.images]


def record(server: MariaDB) -> list[dict[str, Any]]:
    """Each rows event of ``statements`` (the compiled decoder's tables): its columns' layouts,
    its operation, its row bytes and the library's values (after capture's repairs)."""
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.event import RotateEvent
    from pymysqlreplication.row_event import DeleteRowsEvent, TableMapEvent, UpdateRowsEvent, WriteRowsEvent

    from libs.codec import charsets
    from services.capture.binlog_reader import TableMapExtras, table_map_extras
    from services.capture.rows_decode import RowsDecoder, layout_of

    start, end = write(server)
    stream = BinLogStreamReader(
        connection_settings=server.replication_settings(), server_id=4243, resume_stream=True,
        blocking=False, log_file=start.file, log_pos=start.pos,
        only_events=[WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent, TableMapEvent, RotateEvent],
        only_schemas=[DB])
    out: list[dict[str, Any]] = []
    maps: dict[int, TableMapExtras] = {}
    current = start.file
    try:
        for event in stream:
            if isinstance(event, RotateEvent):
                current = event.next_binlog
                continue
            if isinstance(event, TableMapEvent):
                maps[event.table_id] = table_map_extras(event)
                continue
            # As capture's reader does before either decode path reads the table map.
            charsets.fix_library_columns(event.columns)
            layouts = [layout_of(c) for c in event.columns]
            try:
                decoder = RowsDecoder(layouts)
            except Exception:
                continue  # a table the decoder leaves to the library: nothing to record
            body = decoder.body(event)
            assert body is not None, f"{event.table}: not laid out for the decoder"
            data, first, last = body
            item = _convert(event, current, maps)
            assert isinstance(item, Rows)
            out.append({"table": item.table, "op": item.op,
                        "columns": [_layout_json(c) for c in layouts],
                        "rows": data[first:last].hex(), "expected": typed_rows(item)})
            if (current, int(event.packet.log_pos)) >= (end.file, end.pos):
                break
    finally:
        stream.close()
    return out


def _layout_json(layout: Any) -> dict[str, Any]:
    from dataclasses import asdict
    return {k: v for k, v in asdict(layout).items() if v not in (None, 0, False)}


def main(argv: list[str]) -> None:
    path = Path(argv[0])
    with tempfile.TemporaryDirectory() as tmp:
        server = MariaDB(data_dir=Path(tmp), server_id=1).start()
        try:
            events = record(server)
        finally:
            server.cleanup()
    path.write_bytes(gzip.compress(json.dumps(events, ensure_ascii=False).encode(), mtime=0))
    print(f"{len(events)} rows events written to {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
