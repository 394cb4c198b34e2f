"""A source capture cannot read correctly is refused loudly: rejection event, not ready, no guess."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from nats.js import JetStreamContext

from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from services.capture import service as capture_service
from tests.helpers.capture import (
    binlog_position,
    capture_settings,
    eventually,
    rejections,
    rows_of,
    running_capture,
    source_messages,
    wait_reading,
    wait_resolved_past,
)

pytestmark = pytest.mark.integration


async def test_statement_binlog_is_refused_until_fixed(
        mariadb_factory: Callable[..., MariaDB], nats_server: NatsServer, js: JetStreamContext,
        replica_server_id: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture_service, "RETRY_REFUSED_S", 0.3)
    db = mariadb_factory(extra_args=("--binlog-format=STATEMENT",))
    db.execute("CREATE DATABASE app", "CREATE TABLE app.t (id INT PRIMARY KEY, v INT)")
    source = "cap_stmt"
    settings = capture_settings(nats_server.url, source, db.url_for("app"), replica_server_id)
    async with running_capture(settings) as capture:
        async def refused() -> bool:
            return capture.status.get("state") == "refused"

        await eventually(refused, 20, "the capture refusing a STATEMENT binlog")
        assert not capture.ready() and "binlog_format is STATEMENT" in capture.status["problem"]
        db.execute("INSERT INTO app.t VALUES (1, 1)")
        got = await rejections(js, source)
        assert [(r.kind, r.table) for r in got] == [("binlog_not_row", "")]
        assert "STATEMENT" in got[0].message

        # Fixed by the operator: capture starts on its own (at the then current position).
        db.execute("SET GLOBAL binlog_format = 'ROW'")
        await wait_reading(capture)
        assert capture.ready()
        db.execute("INSERT INTO app.t VALUES (2, 2)")
        await wait_resolved_past(js, source, binlog_position(db))
    rows = rows_of(await source_messages(js, source))
    assert [r.rows[0].after for r in rows] == [{"id": 2, "v": 2}]
    assert len(await rejections(js, source)) == 1  # reported once, not on every retry


async def test_statement_dml_mid_stream_stops_the_table_across_restarts(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, replica_server_id: int) -> None:
    source = name = "cap_stmt_dml"
    mariadb.execute(f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}")
    mariadb.execute("CREATE TABLE bad (id INT PRIMARY KEY)", "CREATE TABLE good (id INT PRIMARY KEY)",
                    database=name)
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO bad VALUES (1)", "SET SESSION binlog_format = 'STATEMENT'",
                        "INSERT INTO bad VALUES (2)", "SET SESSION binlog_format = 'ROW'",
                        "INSERT INTO bad VALUES (3)", "INSERT INTO good VALUES (1)", database=name)
        await wait_resolved_past(js, source, binlog_position(mariadb))
    # The stop survives a restart: it is read back from the rejection events.
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO bad VALUES (4)", "INSERT INTO good VALUES (2)", database=name)
        await wait_resolved_past(js, source, binlog_position(mariadb))
    got = await rejections(js, source)
    assert [(r.kind, r.table) for r in got] == [("binlog_not_row", "bad")]
    assert "INSERT INTO bad VALUES (2)" in got[0].message
    published = [(e.table, r.after["id"]) for e in rows_of(await source_messages(js, source))
                 for r in e.rows if r.after]
    assert published == [("bad", 1), ("good", 1), ("good", 2)]
