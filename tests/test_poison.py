"""Poison isolation through the real data path (NATS, Spark, SQLite downstream): a change the
downstream refuses for good stops only its table; skip, retry and resume end as promised."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts import REGISTRY
from contracts.events.changefeeds import ChangefeedCreatedV2, ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.table_incidents import TableActionRequestedV1, TableStoppedV2
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.streams import DEADLETTER_STREAM, domain_events_subject, rows_subject, table_incidents_subject
from services.sink_worker import metrics as m
from services.sink_worker.span.checkpoints import CheckpointStore
from tests import test_sort_apply as data_path
from tests.helpers.harness import Harness, Source, fetch_rows, ins, people, upd
from tests.helpers.sink_worker import _changefeeds, _get_text, _wait
from tests.helpers.worker_env import SPARK_WORKER_ENV

pytestmark = pytest.mark.integration

# Fixtures shared with the data path tests.
rows_js = data_path.rows_js
checkpoints = data_path.checkpoints
sqlite_url = data_path.sqlite_url
h = data_path.h


def _checked_table(sqlite_url: str, check: str) -> None:
    """The target made by hand downstream, with a CHECK the source does not have."""
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute("DROP TABLE IF EXISTS people")
        conn.execute(f'CREATE TABLE people ("id" INTEGER NOT NULL, "name" TEXT,'
                     f' "age" INTEGER CHECK ({check}), PRIMARY KEY ("id"), UNIQUE ("name"))')


def _status(h: Harness, table: str) -> dict[str, Any]:
    return next(s for s in h.pipeline.status() if s["table"] == table)


async def _parked(js: JetStreamContext, subject: str) -> dict[int, tuple[str, str]]:
    parked: dict[int, tuple[str, str]] = {}
    for seq in range(1, (await js.stream_info(DEADLETTER_STREAM)).state.last_seq + 1):
        try:
            msg = await js.get_msg(DEADLETTER_STREAM, seq)
        except Exception:
            continue
        hdrs = msg.headers or {}
        if hdrs.get("Sluice-Dead-Letter-Original-Subject") == subject:
            parked[int(hdrs["Sluice-Dead-Letter-Original-Seq"])] = (
                hdrs["Sluice-Dead-Letter-Kind"], hdrs["Sluice-Dead-Letter-Reason"])
    return parked


async def test_a_refused_row_stops_its_table_only_and_skip_goes_on(h: Harness, sqlite_url: str) -> None:
    _checked_table(sqlite_url, "age < 100")
    await h.run("people", "pets")
    src = h.source
    await src.txn(h.db, "people", [ins(1, "ann", 30), ins(2, "old", 150), ins(3, "cy", 40)])
    await src.txn(h.db, "pets", [ins(1, "rex", 3)])
    first = await src.resolve()

    report = await h.pipeline.round()
    assert [e for e in report.errors if "people" in e], report.errors
    assert not [e for e in report.errors if "pets" in e], report.errors
    pets_cp = await h.checkpoint("pets")
    assert pets_cp is not None and pets_cp.ts == first
    assert h.rows("pets") == people((1, "rex", 3))
    stopped = _status(h, "people")
    assert stopped["state"] == "error" and await h.checkpoint("people") is None
    incident = stopped["incident"]
    assert incident["statement"] == "upsert" and incident["key"] == "[2]"
    assert incident["key_columns"] == ["id"] and "CHECK" in incident["error"]
    span = h.span("people")
    assert m.TABLE_STOPPED.labels(h.changefeed, span.name)._value.get() == 1

    # The healthy table keeps replicating and checkpointing; the stopped one is not retried.
    await src.txn(h.db, "pets", [ins(2, "tom", 5)])
    await src.txn(h.db, "people", [ins(4, "dee", 50)])
    second = await src.resolve()
    report = await h.pipeline.round()
    assert not report.errors, report.errors
    pets_cp = await h.checkpoint("pets")
    assert pets_cp is not None and pets_cp.ts == second
    assert _status(h, "people")["incident"]["incident"] == incident["incident"]

    # skip: the refused change goes to the dead letters, the rest of the table goes on.
    assert not h.pipeline.act(span, "not-this-incident", "skip")
    assert h.pipeline.act(span, incident["incident"], "skip")
    assert not h.pipeline.act(span, incident["incident"], "skip")  # repeated: nothing happens
    await h.round()
    assert h.rows("people") == people((1, "ann", 30), (3, "cy", 40), (4, "dee", 50))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == second
    assert _status(h, "people")["state"] == "replicating"
    parked = await _parked(h.js, rows_subject(src.name, h.db, "people"))
    assert [kind for kind, _ in parked.values()] == ["skipped"]
    assert "[2]" in next(iter(parked.values()))[1]

    # A later change of the skipped key is not skipped: the skip ends at its batch.
    await src.txn(h.db, "people", [ins(2, "old", 99)])
    await src.resolve()
    await h.round()
    assert h.rows("people") == people((1, "ann", 30), (2, "old", 99), (3, "cy", 40), (4, "dee", 50))


async def test_retry_stops_again_and_resume_after_a_downstream_fix_applies(
        h: Harness, sqlite_url: str) -> None:
    _checked_table(sqlite_url, "age < 100")
    await h.run("people")
    src = h.source
    await src.txn(h.db, "people", [ins(1, "ann", 30), ins(2, "bob", 20)])
    await src.txn(h.db, "people", [upd((2, "bob", 20), (2, "bob", 120))])
    last = await src.resolve()
    await h.pipeline.round()
    first = _status(h, "people")["incident"]
    assert first["key"] == "[2]"

    # retry without a fix: refused again, as a new incident.
    assert h.pipeline.act(h.span("people"), first["incident"], "retry")
    await h.pipeline.round()
    again = _status(h, "people")["incident"]
    assert again["key"] == "[2]" and again["incident"] != first["incident"]

    # The operator widens the downstream constraint, then resumes: the row lands as upstream has it.
    _checked_table(sqlite_url, "age < 1000")
    assert h.pipeline.act(h.span("people"), again["incident"], "resume")
    await h.round()
    assert h.rows("people") == people((1, "ann", 30), (2, "bob", 120))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == last
    assert "incident" not in _status(h, "people")


async def test_worker_process_records_the_incident_and_carries_out_a_skip_from_the_log(
        rows_js: JetStreamContext, service_env: dict[str, str], tmp_path: Path,
        nats_server: NatsServer) -> None:
    log_from = nats_server.log_size()
    sink_url = f"sqlite:///{tmp_path / 'poison-down.db'}"
    _checked_table(sink_url, "age < 100")
    src = Source(rows_js)
    cf = f"cf{uuid4().hex[:6]}"
    store = await _changefeeds(rows_js)
    await store.append(domain_events_subject("changefeeds"), ChangefeedCreatedV2(spec=ChangefeedSpecV2(
        id=cf, sources=[SourceRefV1(id=src.name, url="mysql://u@127.0.0.1/")], sink_url=sink_url,
        filter=TableFilterV1(include=["shop.*"]), initial_load="binlog-only")))
    await src.txn("shop", "people", [ins(1, "ann", 30), ins(2, "old", 150)])
    await src.txn("shop", "pets", [ins(1, "rex", 3)])
    resolved = await src.resolve()

    env = {**service_env, **SPARK_WORKER_ENV, "SLUICE_LOG_JSON": "false", "SLUICE_SINK_STANDALONE": "true"}
    proc = ServiceProcess("services.sink_worker", env, tmp_path / "logs").start()
    try:
        proc.wait_healthy(timeout=60)

        def spans() -> dict[str, dict[str, Any]]:
            return {s["table"]: s for s in (proc.health() or {}).get("spans", []) if s["changefeed"] == cf}

        def stopped_beside_healthy() -> dict[str, dict[str, Any]] | None:
            found = spans()
            people_, pets = found.get("people", {}), found.get("pets", {})
            ok = "incident" in people_ and pets.get("checkpoint_ts") == resolved
            return found if ok else None

        found = await _wait(stopped_beside_healthy, 120, "people stopped and pets at the resolved ts")
        incident = found["people"]["incident"]
        assert found["people"]["state"] == "error" and incident["key"] == "[2]"
        text = await asyncio.to_thread(_get_text, proc.base_url + "/metrics")
        label = f'changefeed="{cf}",span="{cf}/{src.name}/shop.people"'
        assert f"sluice_sink_table_stopped{{{label}}} 1.0" in text

        async def recorded() -> TableStoppedV2 | None:
            last = (await rows_js.stream_info(store.stream)).state.last_seq
            for seq in range(1, last + 1):
                msg = await rows_js.get_msg(store.stream, seq)
                event = REGISTRY.decode(msg.data or b"").event
                if isinstance(event, TableStoppedV2) and event.incident == incident["incident"]:
                    # On the incidents subject: the worker's role may not write changefeed events.
                    assert msg.subject == table_incidents_subject()
                    return event
            return None

        deadline = time.monotonic() + 30
        while (event := await recorded()) is None:
            assert time.monotonic() < deadline, "timed out waiting for table.stopped in the changefeeds log"
            await asyncio.sleep(0.2)  # polling a condition with a deadline
        assert event.table.table == "people" and event.key == "[2]" and "CHECK" in event.error

        await store.append(domain_events_subject("changefeeds"), TableActionRequestedV1(
            table=event.table, incident=event.incident, action="skip", requested_by="ops"))
        await _wait(lambda: spans().get("people", {}).get("checkpoint_ts") == resolved, 120,
                    "people to go on after the skip")
        assert "incident" not in spans()["people"]
        assert fetch_rows(sink_url, "shop", "people") == people((1, "ann", 30))
        assert fetch_rows(sink_url, "shop", "pets") == people((1, "rex", 3))
        assert proc.terminate(timeout=30) == 0, proc.tail_log()
        assert not nats_server.service_violations(since=log_from)
    finally:
        proc.kill()


@pytest.mark.parametrize("sink", ["mariadb", "postgres"])
async def test_a_narrowed_or_checked_downstream_column_stops_only_its_table(
        sink: str, rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(sink)
    db = f"poison{uuid4().hex[:6]}"
    h = Harness(rows_js, checkpoints, spark, server.url, db=db)
    await h.run("people", "pets")
    src = h.source
    await src.txn(db, "people", [ins(1, "ann", 30)])
    await src.txn(db, "pets", [ins(1, "rex", 3)])
    await src.resolve()
    await h.round()
    # By hand downstream: MariaDB narrows a column ("data too long", 1406), PostgreSQL adds a
    # CHECK (SQLSTATE 23514). Neither can be fixed by retrying.
    if sink == "mariadb":
        server.execute(f"ALTER TABLE `{db}`.people MODIFY name VARCHAR(3)")
    else:
        server.execute(f'ALTER TABLE "{db}".people ADD CONSTRAINT young CHECK (age < 100)')
    await src.txn(db, "people", [ins(2, "longname", 150), ins(3, "cy", 40)])
    await src.txn(db, "pets", [ins(2, "tom", 5)])
    second = await src.resolve()
    report = await h.pipeline.round()
    assert [e for e in report.errors if "people" in e] and not [e for e in report.errors if "pets" in e]
    pets_cp = await h.checkpoint("pets")
    assert pets_cp is not None and pets_cp.ts == second
    incident = _status(h, "people")["incident"]
    assert incident["key"] == "[2]" and incident["statement"] == "upsert"
    assert incident["code"] == (1406 if sink == "mariadb" else "23514"), incident

    # The operator undoes the downstream change and resumes: the table catches up as upstream is.
    if sink == "mariadb":
        server.execute(f"ALTER TABLE `{db}`.people MODIFY name VARCHAR(11)")
    else:
        server.execute(f'ALTER TABLE "{db}".people DROP CONSTRAINT young')
    assert h.pipeline.act(h.span("people"), incident["incident"], "resume")
    await h.round()
    assert h.rows("people") == people((1, "ann", 30), (2, "longname", 150), (3, "cy", 40))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == second


async def test_a_skip_on_a_target_with_an_origin_column_parks_the_skipped_change(
        rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        sqlite_url: str) -> None:
    """The origin column is part of a merged target's key: the skipped key is matched with it,
    so the skipped change reaches the dead letters like on a plain target."""
    from libs.routing import OriginColumn, Router, RouteRule
    from services.sink_worker.span.runtime import SpanConfig

    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute("DROP TABLE IF EXISTS people")
        conn.execute('CREATE TABLE people ("_origin" TEXT NOT NULL, "id" INTEGER NOT NULL, "name" TEXT,'
                     ' "age" INTEGER CHECK (age < 100), PRIMARY KEY ("_origin", "id"))')
    h = Harness(rows_js, checkpoints, spark, sqlite_url, db=f"o{uuid4().hex[:6]}")
    rules = [RouteRule(schema=h.db, table="people", target_schema=h.db, target_table="people")]
    cfg = SpanConfig(sink_url=sqlite_url, router=Router(rules, origin=OriginColumn("_origin")))
    span = h.span("people")
    await h.pipeline.set_spans({span: cfg})
    await h.source.txn(h.db, "people", [ins(1, "ann", 30), ins(2, "old", 150)])
    await h.source.resolve()
    report = await h.pipeline.round()
    status = _status(h, "people")
    assert "incident" in status, (status, report.errors)
    incident = status["incident"]
    assert report.errors and "_origin" in incident["key_columns"], incident

    assert h.pipeline.act(span, incident["incident"], "skip")
    await h.round()
    parked = await _parked(h.js, rows_subject(h.source.name, h.db, "people"))
    assert [kind for kind, _ in parked.values()] == ["skipped"], parked
    assert _status(h, "people")["state"] == "replicating"
