"""A target table's definition as its downstream's catalog shows it (``libs.target_fit``'s
input), for the creation check and a re-copy that keeps the target; None when the table does not exist."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg

from libs.dburl import DatabaseUrl
from libs.mysql_connection import connect as mysql_connect
from libs.target_fit import TargetColumn, TargetDefinition

CONNECT_TIMEOUT_S = 3


def _definition(columns: list[tuple[Any, Any]], keys: dict[str, list[str]]) -> TargetDefinition | None:
    if not columns:
        return None
    return TargetDefinition(tuple(TargetColumn(str(n), str(t)) for n, t in columns),
                            tuple(tuple(cols) for cols in keys.values()))


def mysql_definition_of(cur: Any, database: str, table: str) -> TargetDefinition | None:
    """From a MySQL/MariaDB cursor (the caller's connection: its TLS and credentials)."""
    cur.execute("SELECT COLUMN_NAME, COLUMN_TYPE FROM information_schema.COLUMNS"
                " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
                (database, table))
    columns = list(cur.fetchall())
    cur.execute("SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS"
                " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s AND NON_UNIQUE = 0"
                " ORDER BY INDEX_NAME, SEQ_IN_INDEX", (database, table))
    keys: dict[str, list[str]] = {}
    for index, column in cur.fetchall():
        keys.setdefault(str(index), []).append(str(column))
    return _definition(columns, keys)


def postgres_definition_of(cur: Any, schema: str, table: str) -> TargetDefinition | None:
    """From a psycopg cursor."""
    ref = f'"{schema.replace(chr(34), chr(34) * 2)}"."{table.replace(chr(34), chr(34) * 2)}"'
    cur.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
        " WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (ref,))
    columns = list(cur.fetchall())
    cur.execute(
        "SELECT i.indexrelid::text, a.attname FROM pg_index i"
        " JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) ON true"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " WHERE i.indrelid = to_regclass(%s) AND i.indisunique ORDER BY i.indexrelid, k.n",
        (ref,))
    keys: dict[str, list[str]] = {}
    for index, column in cur.fetchall():
        keys.setdefault(str(index), []).append(str(column))
    return _definition(columns, keys)


def sqlite_definition_of(cur: Any, table: str) -> TargetDefinition | None:
    """From a sqlite3 cursor."""
    info = list(cur.execute("SELECT * FROM pragma_table_info(?)", (table,)).fetchall())
    columns = [(r[1], r[2]) for r in info]
    keys: dict[str, list[str]] = {}
    primary = [str(r[1]) for r in sorted(info, key=lambda r: r[5]) if r[5]]
    if primary:
        keys["primary"] = primary
    for (index,) in list(cur.execute("SELECT name FROM pragma_index_list(?) WHERE \"unique\" = 1",
                                     (table,)).fetchall()):
        keys[str(index)] = [str(r[2]) for r in cur.execute("SELECT * FROM pragma_index_info(?)",
                                                            (index,)).fetchall()]
    return _definition(columns, keys)


def read_mysql(url: DatabaseUrl, database: str, table: str) -> TargetDefinition | None:
    params: dict[str, Any] = {"host": url.host, "port": url.port or 3306, "user": url.user or "root",
                              "password": url.password or "", "connect_timeout": CONNECT_TIMEOUT_S}
    if url.option("unix_socket"):
        params["unix_socket"] = url.option("unix_socket")
    conn = mysql_connect(**params)
    try:
        with conn.cursor() as cur:
            return mysql_definition_of(cur, database, table)
    finally:
        conn.close()


def read_postgres(url: DatabaseUrl, schema: str, table: str) -> TargetDefinition | None:
    with psycopg.connect(host=url.host, port=url.port, user=url.user or None, password=url.password or None,
                         dbname=url.database or "postgres", connect_timeout=CONNECT_TIMEOUT_S) as conn:
        return postgres_definition_of(conn.cursor(), schema, table)


def read_sqlite(url: DatabaseUrl, table: str) -> TargetDefinition | None:
    if not Path(url.path).exists():
        return None
    conn = sqlite3.connect(url.path)
    try:
        return sqlite_definition_of(conn.cursor(), table)
    finally:
        conn.close()


def read_target(url: DatabaseUrl, schema: str, table: str) -> TargetDefinition | None:
    """The definition of the sink's table ``schema.table`` (SQLite: ``table``), None if absent."""
    if url.dialect == "mysql":
        return read_mysql(url, schema, table)
    if url.dialect == "postgresql":
        return read_postgres(url, schema, table)
    return read_sqlite(url, table)
