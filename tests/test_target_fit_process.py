"""The creation check against targets an operator made before the changefeed, on a real
MariaDB, PostgreSQL and SQLite downstream each: one that can hold the source's rows (wider types,
an extra column with a default, a unique key with more columns, partitioned on MariaDB) passes;
one that cannot (a missing column, a narrower type, a unique key the source does not have) is
refused with each column and reason."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from contracts.events.changefeeds import ChangefeedSpec, SourceRefV1, TableFilterV1
from libs.dburl import parse_database_url
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from services.api.prechecks import run_checks_blocking

pytestmark = pytest.mark.integration

DB = "fitdb"
SOURCE = [
    f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}",
    f"CREATE TABLE {DB}.ok_t (id INT UNSIGNED PRIMARY KEY, code VARCHAR(20) NOT NULL, UNIQUE KEY (code))",
    f"CREATE TABLE {DB}.bad_t (id INT PRIMARY KEY, code VARCHAR(20), qty INT)",
]
MYSQL_TARGETS = [
    f"CREATE DATABASE IF NOT EXISTS {DB}",
    f"CREATE TABLE {DB}.ok_t (id BIGINT PRIMARY KEY, code VARCHAR(64) NOT NULL, note VARCHAR(10) DEFAULT 'x',"
    " UNIQUE KEY (code, id)) PARTITION BY HASH (id) PARTITIONS 4",
    f"CREATE TABLE {DB}.bad_t (id INT PRIMARY KEY, code VARCHAR(5), UNIQUE KEY (code))",
]
PG_TARGETS = [
    f"CREATE SCHEMA IF NOT EXISTS {DB}",
    f"DROP TABLE IF EXISTS {DB}.ok_t, {DB}.bad_t",
    f"CREATE TABLE {DB}.ok_t (id bigint PRIMARY KEY, code text NOT NULL UNIQUE, note text DEFAULT 'x')",
    f"CREATE TABLE {DB}.bad_t (id integer PRIMARY KEY, code varchar(5) UNIQUE)",
]
SQLITE_TARGETS = [
    "CREATE TABLE ok_t (id INTEGER PRIMARY KEY, code TEXT NOT NULL UNIQUE, note TEXT DEFAULT 'x')",
    "CREATE TABLE bad_t (id INTEGER PRIMARY KEY, code TEXT UNIQUE)",
]


def _fit_messages(source: MariaDB, sink_url: str) -> list[str]:
    spec = ChangefeedSpec(id="fit", sources=[SourceRefV1(id="fit", url=source.url)],
                          filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=sink_url,
                          initial_load="binlog-only")
    result = run_checks_blocking(spec)
    return sorted(c.message for c in result.failed if c.check == "target_fit")


def _expect(messages: list[str], narrower: str | None) -> None:
    """Only bad_t is refused: its missing column, its narrower column (``narrower``: how the
    downstream spells it) and its unique key over a column the source does not key by."""
    refused = f"target {DB}.bad_t exists and cannot hold the rows of {DB}.bad_t"
    assert messages and all(refused in m for m in messages), messages
    reasons = sorted(m.split("(source fit): ", 1)[1].split("; alter")[0] for m in messages)
    wanted = ["column qty: missing in the existing target"]
    if narrower:
        wanted.append(f"column code: {narrower} is narrower than varchar(20)")
    assert [r for r in reasons if not r.startswith("unique key")] == sorted(wanted), reasons
    [key] = [r for r in reasons if r.startswith("unique key")]
    assert key.startswith("unique key (code): not a key of the source table"), reasons


def test_existing_targets_are_judged_on_every_downstream(
        mariadb: MariaDB, postgres: PostgreSQL, mariadb_factory: Callable[..., MariaDB],
        tmp_path: Path) -> None:
    mariadb.execute(*SOURCE)
    down = mariadb_factory()
    down.execute(*MYSQL_TARGETS)
    _expect(_fit_messages(mariadb, down.url), narrower="varchar(5)")

    db = parse_database_url(postgres.url)
    with psycopg.connect(host=db.host, port=db.port, user=db.user or None, password=db.password or None,
                         dbname=db.database or "postgres", autocommit=True) as conn:
        for sql in PG_TARGETS:
            conn.execute(sql)  # type: ignore[arg-type]
    _expect(_fit_messages(mariadb, postgres.url), narrower="character varying(5)")

    path = tmp_path / "down.db"
    with sqlite3.connect(path) as lite:
        for sql in SQLITE_TARGETS:
            lite.execute(sql)
    _expect(_fit_messages(mariadb, f"sqlite:///{path}"), narrower=None)

    # No target yet: nothing to judge.
    assert _fit_messages(mariadb, f"sqlite:///{tmp_path / 'empty.db'}") == []
