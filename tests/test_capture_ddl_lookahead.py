"""The DDL look-ahead's pass over the binlog (``services/capture/ddl_lookahead.list_ddl``, a
non-blocking binlog dump of which only Query events are parsed) against ``SHOW BINLOG EVENTS``
(``list_ddl_shown``, what it replaced): on one real binlog, from every kind of start and up to
every kind of end, both must list the same DDL at the same positions.

The binlog holds DDL in and out of a default schema (``use db``), a DROP DATABASE, statements
that are not DDL (BEGIN/COMMIT of a MyISAM table, GRANT, XA), rows events, a rotation to a new
file in the middle (``FLUSH BINARY LOGS``), and the same again with checksums off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.localservers.mariadb import MariaDB
from services.capture.binlog_reader import Position
from services.capture.ddl_lookahead import AheadDdl, list_ddl, list_ddl_shown

pytestmark = pytest.mark.integration


def _statements(db: str) -> list[str]:
    return [
        f"CREATE DATABASE {db}",
        f"CREATE TABLE {db}.t (id INT PRIMARY KEY, v INT)",
        f"INSERT INTO {db}.t VALUES (1, 1), (2, 2)",
        f"USE {db}",
        "ALTER TABLE t ADD COLUMN w INT",
        "UPDATE t SET w = 3",
        "CREATE TABLE plain (id INT PRIMARY KEY) ENGINE=MyISAM",
        "INSERT INTO plain VALUES (1)",
        "XA START 'x1'", "INSERT INTO t VALUES (3, 3, 3)", "XA END 'x1'", "XA PREPARE 'x1'",
        "XA COMMIT 'x1'",
        "CREATE USER IF NOT EXISTS 'la_user'@'localhost'",
        "FLUSH BINARY LOGS",
        f"RENAME TABLE {db}.t TO {db}.`t 2`",
        "CREATE TABLE `odd``name` (id INT PRIMARY KEY)",
        "DROP TABLE plain",
        "USE mysql",
        f"CREATE TABLE {db}.other LIKE {db}.`t 2`",
        f"DROP DATABASE {db}",
    ]


def _write(server: MariaDB, db: str) -> tuple[list[Position], Position]:
    """Run the statements, each on its own; the position before each and the end."""
    conn = server.connect()
    conn.autocommit(True)
    marks: list[Position] = []
    try:
        with conn.cursor() as cur:
            def here() -> Position:
                cur.execute("SHOW MASTER STATUS")
                file, pos = cur.fetchone()[:2]
                return Position(str(file), int(pos))
            for stmt in _statements(db):
                marks.append(here())
                cur.execute(stmt)
            return marks, here()
    finally:
        conn.close()


def _shown(server: MariaDB, start: Position, until: Position) -> list[AheadDdl]:
    conn = server.connect()
    try:
        return list_ddl_shown(conn, start, until)
    finally:
        conn.close()


def _ranges(marks: list[Position], end: Position) -> Iterator[tuple[Position, Position]]:
    yield marks[0], end
    for i in range(0, len(marks), 3):
        for j in range(i + 1, len(marks), 4):
            yield marks[i], marks[j]
    yield marks[-1], end
    yield end, end


@pytest.mark.parametrize("checksum", ["CRC32", "NONE"])
def test_the_dump_lists_what_show_binlog_events_lists(mariadb: MariaDB, checksum: str) -> None:
    mariadb.execute(f"SET GLOBAL binlog_checksum = '{checksum}'")
    try:
        mariadb.execute("FLUSH BINARY LOGS")
        marks, end = _write(mariadb, f"la_{checksum.lower()}")
    finally:
        mariadb.execute("SET GLOBAL binlog_checksum = 'CRC32'")
    assert len({m.file for m in marks}) == 2  # a rotation in the middle
    whole = list_ddl(mariadb.connect, marks[0], end)
    assert whole == _shown(mariadb, marks[0], end)
    # CREATE TABLE t, ALTER, CREATE plain, RENAME, CREATE `odd``name`, DROP plain, CREATE ... LIKE
    # and DROP DATABASE; not CREATE DATABASE, the XA, MyISAM's BEGIN/COMMIT or CREATE USER.
    assert len(whole) == 8, whole
    assert whole[-1].database == f"la_{checksum.lower()}"
    assert (f"la_{checksum.lower()}", "odd`name") in whole[4].tables
    for start, until in _ranges(marks, end):
        assert list_ddl(mariadb.connect, start, until) == _shown(mariadb, start, until), (start, until)
