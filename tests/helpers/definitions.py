"""A table's definition as each database's own catalog shows it, for tests that compare a
downstream's table with the source's (NOT NULL, defaults, indexes, collation)."""

from __future__ import annotations

import re
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


def _literal(value: Any) -> str:
    """A default's literal without PostgreSQL's cast ('x'::character varying) and, for a
    number, without the quotes some spellings put around it ('-1'::integer)."""
    text = str(value).split("::")[0]
    return text.strip("'") if re.fullmatch(r"'?-?[0-9.]+'?", text) else text


def literal_defaults(source: dict[str, list[tuple[Any, ...]]]) -> dict[str, str]:
    """column -> its literal default as MariaDB spells it (``7``, ``'x'``), for the columns of
    ``mysql_definition`` whose default is a literal (not NULL, not an expression, not BIT)."""
    out = {}
    for name, sql_type, _, default, *_ in source["columns"]:
        if default is None or str(default).upper() == "NULL" or "(" in str(default):
            continue
        if str(sql_type).startswith("bit") or str(default).startswith("b'"):
            continue
        out[str(name)] = str(default)
    return out


def assert_follows_source(source: dict[str, list[tuple[Any, ...]]], table: str, pg_url: str, pg_schema: str,
                          sqlite_url: str) -> None:
    """The PostgreSQL and SQLite targets of a source table (``mysql_definition``) have its NOT
    NULL columns, literal defaults, primary key and secondary indexes (``<table>__<index>``)."""
    not_null = {str(c[0]) for c in source["columns"] if c[2] == "NO"}
    pg = pg_columns(pg_url, pg_schema, table)
    lite = sqlite_columns(sqlite_url, table)
    assert {n for n, c in pg.items() if c[0] == "NO"} == not_null, (table, pg)
    assert {n for n, c in lite.items() if c[0] == 1} == not_null, (table, lite)
    for name, default in literal_defaults(source).items():
        assert _literal(pg[name][1]) == _literal(default), (table, name, pg[name])
        assert _literal(lite[name][1]) == _literal(default), (table, name, lite[name])
    primary = [str(r[3]) for r in source["indexes"] if r[0] == "PRIMARY"]
    [pkey] = [d for n, d in pg_indexes(pg_url, pg_schema, table).items() if n.endswith("_pkey")] or [""]
    pkey_columns = [c.strip().strip('"') for c in pkey.rsplit("(", 1)[-1].rstrip(")").split(",")]
    assert pkey and pkey_columns == primary, (table, pkey, primary)
    lite_pk = [str(r[1]) for r in sorted(sqlite_query(sqlite_url, f"PRAGMA table_info('{table}')"),
                                         key=lambda r: r[5]) if r[5]]
    assert lite_pk == primary, (table, lite_pk, primary)
    secondary = {f"{table}__{r[0]}" for r in source["indexes"] if r[0] != "PRIMARY"}
    assert {n for n in pg_indexes(pg_url, pg_schema, table) if "__" in n} == secondary, table
    assert set(sqlite_indexes(sqlite_url, table)) == secondary, table
