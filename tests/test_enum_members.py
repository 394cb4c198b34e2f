"""ENUM/SET members with characters outside utf8mb3 ('😀'): the source's catalog spells them '?'
(information_schema and SHOW CREATE TABLE are utf8mb3), the table itself holds the real values.

Unit tests of ``libs.codec.enum_members`` (members read back from the rows an initial load copies),
and the whole path with real processes: rows copied by the initial load, then streamed, then a
column added by ALTER, on SQLite, PostgreSQL and MariaDB downstreams, compared row for row."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from libs.codec.enum_members import resolve_members, suspect_columns
from libs.codec.table_meta import ColumnSpec, TableInfo
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from tests.helpers.e2e import downstream_mariadb  # noqa: F401 - fixture
from tests.helpers.initial_load import (  # noqa: F401 - fixture
    _capture,
    _changefeed,
    _delete_changefeeds_afterwards,
    _wait_equal,
    _worker,
)


def _info(*columns: tuple[str, str, str]) -> TableInfo:
    return TableInfo("d", "t", tuple(ColumnSpec(n, k, t) for n, k, t in columns), primary_key=("id",))


def _types(info: TableInfo) -> dict[str, str]:
    return {c.name: c.sql_type for c in info.columns}


def test_members_come_back_from_the_rows_and_unknown_ones_widen_the_column() -> None:
    info = _info(("id", "int", "int(11)"), ("e", "string", "enum('?','a','ä?')"),
                 ("s", "set", "set('b','?','c')"), ("plain", "string", "enum('x','y')"),
                 ("gone", "string", "enum('?','z')"), ("q", "string", "enum('?','?')"))
    assert suspect_columns(info) == ["e", "s", "gone", "q"]
    present = {"e": [(1, "😀"), (3, "ä𝄞")], "s": [(3, "b,🙂"), (6, "🙂,c")], "gone": [(2, "z")],
               "q": [(1, "🙂")]}
    resolved = resolve_members(info, lambda column: present[column])
    assert _types(resolved) == {
        "id": "int(11)", "e": "enum('😀','a','ä𝄞')", "s": "set('b','🙂','c')", "plain": "enum('x','y')",
        # No row holds the first member: its value cannot be known, a varchar takes every value.
        "gone": "varchar(1)", "q": "varchar(1)"}
    # A value that does not fit the catalog's spelling (the table changed since): widened.
    odd = resolve_members(_info(("e", "string", "enum('?','a')")), lambda _: [(1, "ab")])
    assert _types(odd) == {"e": "varchar(1)"}
    wide_set = resolve_members(_info(("s", "set", "set('?','bc')")), lambda _: [])
    assert _types(wide_set) == {"s": "varchar(4)"}
    assert resolve_members(info, lambda _: []) is not info
    untouched = _info(("id", "int", "int(11)"), ("e", "string", "enum('a','b')"))
    assert suspect_columns(untouched) == [] and resolve_members(untouched, lambda _: []) is untouched


@pytest.mark.integration
async def test_four_byte_members_are_copied_streamed_and_altered_on_three_downstreams(
        js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
        postgres: PostgreSQL, downstream_mariadb: MariaDB,  # noqa: F811
        processes: list[ServiceProcess]) -> None:
    db = "enum4"
    mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}")
    mariadb.execute(
        "CREATE TABLE t (id INT PRIMARY KEY, e ENUM('😀','a','ä𝄞'), s SET('😀','b','c'),"
        " k ENUM('x','🙂') NOT NULL, UNIQUE KEY uk (k, id)) DEFAULT CHARSET=utf8mb4",
        # Only some members are in rows when the copy reads them; 'never' is in none.
        "CREATE TABLE never (id INT PRIMARY KEY, e ENUM('🙃','a')) DEFAULT CHARSET=utf8mb4",
        "INSERT INTO t VALUES (1, '😀', '😀,b', '🙂'), (2, 'ä𝄞', 'c', 'x'), (3, NULL, '', '🙂')",
        "INSERT INTO never VALUES (1, 'a')", database=db)
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "enum4", db)
    processes.append(capture)
    capture.wait_healthy(60)
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    for i, sink in enumerate(sinks):
        await _changefeed(js, f"enum4-{i}", "enum4", mariadb, f"{db}.*", sink, "snapshot")
    worker = _worker(service_env, logs, "worker-enum4")
    processes.append(worker)
    mariadb.execute("INSERT INTO t VALUES (4, '😀', '😀,c', '🙂')", "UPDATE t SET e = 'ä𝄞' WHERE id = 1",
                    "INSERT INTO never VALUES (2, '🙃')",
                    "CREATE TABLE later (id INT PRIMARY KEY, e ENUM('a','🙂')) DEFAULT CHARSET=utf8mb4",
                    "INSERT INTO later VALUES (1, '🙂')",
                    "ALTER TABLE t ADD COLUMN e2 ENUM('b','🙃') NULL",
                    "INSERT INTO t (id, k, e2) VALUES (5, 'x', '🙃')", database=db)
    for sink in sinks:
        await asyncio.to_thread(_wait_equal, mariadb, db, ["t", "never", "later"], sink, 180,
                                [capture, worker])
