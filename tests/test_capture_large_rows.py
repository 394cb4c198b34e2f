"""Capture of rows larger than a NATS message: chunks up to the limit, a visible stop beyond it."""

from __future__ import annotations

import base64

import pytest
from nats.js import JetStreamContext
from prometheus_client import REGISTRY as METRICS

from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from tests.helpers.capture import (
    binlog_position,
    capture_settings,
    fresh_database,
    rejections,
    rows_of,
    running_capture,
    source_messages,
    wait_reading,
    wait_resolved_past,
)

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


async def test_a_row_over_the_message_limit_stops_its_table_visibly(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, replica_server_id: int) -> None:
    source, name = "cap_limit", "cap_limit"
    fresh_database(mariadb, name, "CREATE TABLE big (id INT PRIMARY KEY, b LONGBLOB)",
                   "CREATE TABLE other (id INT PRIMARY KEY)")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    settings = settings.model_copy(update={"capture_max_message_bytes": 2 * MiB})
    before = METRICS.get_sample_value("sluice_capture_oversized_messages_total", {"source": source}) or 0
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        conn = mariadb.connect(name)
        conn.autocommit(True)
        with conn.cursor() as cur:
            # Under the limit but over max_payload: chunks. Over the limit: a rejection.
            cur.execute("INSERT INTO big VALUES (1, REPEAT('a', %s))", (MiB,))
            cur.execute("INSERT INTO big VALUES (2, REPEAT('b', %s))", (2 * MiB,))
            cur.execute("INSERT INTO big VALUES (3, 'small, but after the stop')")
            cur.execute("INSERT INTO other VALUES (1)")
        conn.close()
        await wait_resolved_past(js, source, binlog_position(mariadb))
        assert capture.status.get("stopped_tables") == [f"{name}.big"], capture.status
    rows = rows_of(await source_messages(js, source))
    big = [r.after for e in rows if e.table == "big" for r in e.rows if r.after]
    assert [b["id"] for b in big] == [1]
    assert base64.b64decode(big[0]["b"]) == b"a" * MiB
    assert [e.table for e in rows if e.table != "big"] == ["other"]
    got = await rejections(js, source)
    assert [(r.kind, r.table) for r in got] == [("unsupported_type", "big")]
    assert "SLUICE_CAPTURE_MAX_MESSAGE_BYTES" in got[0].message and "capture stopped" in got[0].message
    after = METRICS.get_sample_value("sluice_capture_oversized_messages_total", {"source": source})
    assert after == before + 1
