"""A table's definition as each database's own catalog shows it, for tests that compare a
downstream's table with the source's (NOT NULL, defaults, indexes, collation)."""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg

from libs.dburl import parse_database_url
from libs.localservers.mariadb import MariaDB

MYSQL_COLUMNS = ("SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, COLUMN_DEFAULT, CHARACTER_SET_NAME,"
                 " COLLATION_NAME, COLUMN_COMMENT, EXTRA FROM information_schema.COLUMNS"
                 " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION")
MYSQL_INDEXES = ("SELECT INDEX_NAME, NON_UNIQUE, SEQ_IN_INDEX, COLUMN_NAME, SUB_PART, COLLATION, INDEX_TYPE"
                 " FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
                 " ORDER BY INDEX_NAME, SEQ_IN_INDEX")
MYSQL_TABLE = ("SELECT TABLE_COLLATION, TABLE_COMMENT FROM information_schema.TABLES"
               " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s")


def mysql_query(server: MariaDB, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return [tuple(r) for r in cur.fetchall()]
    finally:
        conn.close()


def mysql_definition(server: MariaDB, db: str, table: str) -> dict[str, list[tuple[Any, ...]]]:
    """Columns (type, nullability, default, charset, collation, comment, extra), indexes and
    the table's collation and comment."""
    return {name: mysql_query(server, sql, (db, table))
            for name, sql in (("columns", MYSQL_COLUMNS), ("indexes", MYSQL_INDEXES), ("table", MYSQL_TABLE))}


def mysql_checksum(server: MariaDB, db: str, table: str) -> int:
    [(_, value)] = mysql_query(server, f"CHECKSUM TABLE `{db}`.`{table}`")
    return int(value)


def pg_query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    db = parse_database_url(url)
    with psycopg.connect(host=db.host, port=db.port, user=db.user or None, password=db.password or None,
                         dbname=db.database or "postgres", autocommit=True) as conn:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]  # type: ignore[arg-type]


def pg_execute(url: str, *statements: str) -> None:
    """Statements without a result (DDL, DML), each committed."""
    db = parse_database_url(url)
    with psycopg.connect(host=db.host, port=db.port, user=db.user or None, password=db.password or None,
                         dbname=db.database or "postgres", autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql.encode())


def pg_columns(url: str, schema: str, table: str) -> dict[str, tuple[Any, ...]]:
    """column -> (is_nullable, column_default, collation_name)."""
    return {str(r[0]): tuple(r[1:]) for r in pg_query(
        url, "SELECT column_name, is_nullable, column_default, collation_name FROM information_schema.columns"
             " WHERE table_schema = %s AND table_name = %s", (schema, table))}


def pg_indexes(url: str, schema: str, table: str) -> dict[str, str]:
    """index name -> its definition (primary key and unique constraints included)."""
    return {str(n): str(d) for n, d in pg_query(
        url, "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s",
        (schema, table))}


def sqlite_query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(parse_database_url(url).path)
    try:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


def sqlite_execute(url: str, *statements: str) -> None:
    conn = sqlite3.connect(parse_database_url(url).path)
    try:
        for sql in statements:
            conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


def sqlite_columns(url: str, table: str) -> dict[str, tuple[int, Any]]:
    """column -> (notnull, dflt_value)."""
    return {str(r[1]): (int(r[3]), r[4]) for r in sqlite_query(url, f"PRAGMA table_info('{table}')")}


def sqlite_indexes(url: str, table: str) -> dict[str, str]:
    """index name -> its CREATE INDEX (indexes made by CREATE INDEX, not constraints)."""
    return {str(n): str(s) for n, s in sqlite_query(
        url, "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL",
        (table,))}
