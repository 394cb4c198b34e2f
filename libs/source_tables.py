"""The tables a source server holds now (information_schema), for changefeeds that copy tables
before streaming them: such a table is a span even before any change of it reaches the ROWS
stream (a table nobody writes would otherwise never be copied)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from libs.dburl import parse_database_url
from libs.foreign_keys import ForeignKey, load_foreign_keys
from libs.mysql_connection import connect as mysql_connect

log = logging.getLogger(__name__)

_SYSTEM = ("mysql", "information_schema", "performance_schema", "sys")
_CACHE_S = 10.0
_cache: dict[str, tuple[float, list[tuple[str, str]]]] = {}


def connect_source(url: str) -> Any:
    """A pymysql connection to the source server of ``url`` (no database selected)."""
    db = parse_database_url(url)
    params: dict[str, Any] = {"host": db.host, "port": db.port, "user": db.user or "root",
                                 "password": db.password, "charset": "utf8mb4", "connect_timeout": 5,
                                 "read_timeout": 30}
    socket = db.option("unix_socket")
    if socket:
        params["unix_socket"] = socket
    return mysql_connect(**params)


def list_tables(url: str) -> list[tuple[str, str]]:
    """``(database, table)`` of every base table of the source (only the URL's database when it
    names one), system schemas left out."""
    db = parse_database_url(url)
    conn = connect_source(url)
    try:
        with conn.cursor() as cur:
            marks = ", ".join(["%s"] * len(_SYSTEM))
            sql = ("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES"
                   f" WHERE TABLE_TYPE = 'BASE TABLE' AND TABLE_SCHEMA NOT IN ({marks})")
            args: list[str] = list(_SYSTEM)
            if db.database:
                sql += " AND TABLE_SCHEMA = %s"
                args.append(db.database)
            cur.execute(sql, args)
            return sorted((str(d), str(t)) for d, t in cur.fetchall())
    finally:
        conn.close()


async def source_tables(url: str) -> list[tuple[str, str]]:
    """``list_tables`` off the event loop, cached for a few seconds (discovery runs every few
    seconds on every worker and scheduler); an unreachable source lists nothing and says so."""
    now = time.monotonic()
    hit = _cache.get(url)
    if hit is not None and now - hit[0] < _CACHE_S:
        return hit[1]
    try:
        tables = await asyncio.to_thread(list_tables, url)
    except Exception as exc:
        log.warning("cannot list the source's tables", extra={"source": parse_database_url(url).redacted(),
                                                              "error": repr(exc)})
        tables = hit[1] if hit is not None else []
    # Failures are cached too: an unreachable source is asked again after the same pause.
    _cache[url] = (now, tables)
    return tables


_fk_cache: dict[str, tuple[float, list[ForeignKey]]] = {}


async def source_foreign_keys(url: str, *, strict: bool = False,
                              read_after: float | None = None) -> list[ForeignKey]:
    """The source's foreign keys (``libs.foreign_keys``; the URL's database only when it names
    one), cached like ``source_tables``. A failed read keeps the last answer, because the keys
    decide which tables form one span: a group span falling apart into table spans for one
    failed read would start those from no checkpoint. A source never read answers none (its
    tables keep their own spans until a read succeeds; DESIGN.md, "Foreign-key cascades"), or
    with ``strict`` raises: a group span must not apply a batch without its keys.

    ``read_after`` (a ``time.monotonic()``): the answer must come from a read that started
    after it, else it raises (never the last answer): a span deciding whether it may pass a
    DDL met at that moment needs keys that show the DDL (DESIGN.md, "Foreign-key cascades")."""
    now = time.monotonic()
    hit = _fk_cache.get(url)
    if hit is not None and now - hit[0] < _CACHE_S and (read_after is None or hit[0] >= read_after):
        return hit[1]

    def read() -> list[ForeignKey]:
        conn = connect_source(url)
        try:
            return load_foreign_keys(conn, parse_database_url(url).database or None)
        finally:
            conn.close()

    try:
        fks = await asyncio.to_thread(read)
    except Exception as exc:
        log.warning("cannot read the source's foreign keys", extra={
            "source": parse_database_url(url).redacted(), "error": repr(exc)})
        if (hit is None and strict) or read_after is not None:
            raise
        fks = hit[1] if hit is not None else []
    _fk_cache[url] = (now, fks)
    return fks
