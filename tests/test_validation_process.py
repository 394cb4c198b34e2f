"""Continuous validation end to end with real processes: MariaDB binlog -> capture -> sink-worker
(Spark) -> SQLite and PostgreSQL (one changefeed each), with table rules (a dropped column,
ignored deletes). A healthy run reports
nothing; a row changed by hand downstream is found by an on-demand compare and reported only
after its re-check; once repaired by hand it leaves the report."""

from __future__ import annotations

import asyncio
import sqlite3
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import (
    ChangefeedSpecV5,
    SourceRefV1,
    TableFilterV1,
    TableRuleV1,
    ValidationSpecV1,
)
from libs.changefeeds import record_changefeed
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.nats_client import read_json
from libs.scheduling.model import Span
from libs.validation import SpanValidation, bucket, request_compare
from tests.helpers.e2e import (  # noqa: F401 - fixtures
    _capture,
    _created,
    _delete_changefeeds_afterwards,
    _worker,
)

pytestmark = pytest.mark.integration
DB = "valid_e2e"
CFS = ("valid-sqlite", "valid-pg")


async def _status(js: JetStreamContext, cf: str) -> SpanValidation | None:
    raw = await read_json(await bucket(js), Span.of(cf, "valid", DB, "t").kv_key)
    return SpanValidation.model_validate(raw) if raw is not None else None


async def _until(js: JetStreamContext, ok: Any, what: str, procs: list[ServiceProcess],
                 within: float = 60) -> dict[str, SpanValidation]:
    """Every changefeed's status once ``ok`` holds for each."""
    deadline = asyncio.get_running_loop().time() + within
    last: dict[str, SpanValidation | None] = {}
    while asyncio.get_running_loop().time() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        last = {cf: await _status(js, cf) for cf in CFS}
        done = {cf: s for cf, s in last.items() if s is not None and ok(s)}
        if len(done) == len(CFS):
            return done
        await asyncio.sleep(0.3)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(20)}" for p in procs)
    raise AssertionError(f"timed out waiting for {what}; last statuses: {last}\n{logs}")


def _metric(proc: ServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"{proc.base_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'changefeed="valid-' in line)


def _by_hand(down: Path, pg: PostgreSQL, *statements: str) -> None:
    with sqlite3.connect(down) as db:
        for sql in statements:
            db.execute(sql)
    conn = pg.connect()
    try:
        with conn.cursor() as cur:
            for sql in statements:
                cur.execute(sql.replace(" t ", f" {DB}.t "))
        conn.commit()
    finally:
        conn.close()


async def test_validation_reports_a_hand_changed_row_until_it_is_repaired(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, processes: list[ServiceProcess],
) -> None:
    conn = mariadb.connect()
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {DB}")
        cur.execute(f"CREATE DATABASE {DB}")
        cur.execute(f"CREATE TABLE {DB}.t (id int PRIMARY KEY, name varchar(32), card varchar(20))")
    conn.commit()
    down = tmp_path / "down.db"
    logs = tmp_path / "logs"
    processes.append(_capture(service_env, logs, mariadb, "valid", DB))
    processes[-1].wait_healthy(60)
    for cf, url in zip(CFS, [f"sqlite:///{down}", postgres.url], strict=True):
        spec = ChangefeedSpecV5(id=cf, sources=[SourceRefV1(id="valid", url=mariadb.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                                initial_load="binlog-only", validation=ValidationSpecV1(mode="full"),
                                table_rules=[TableRuleV1(tables=[f"{DB}.t"], ignore_events=["delete"],
                                                         drop_columns=["card"])])
        await record_changefeed(js, spec, requested_by="test")
        _created.append(cf)
    worker = _worker({**service_env, "SLUICE_VALIDATION_INTERVAL_S": "0.5"}, logs, "worker-valid")
    processes.append(worker)
    worker.wait_healthy(60)

    def run(*statements: str) -> None:
        with conn.cursor() as cur:
            for sql in statements:
                cur.execute(sql)
        conn.commit()

    # Healthy: inserts, updates, a delete the rules ignore (the row stays downstream) and a
    # dropped column: every changed row checked, nothing reported.
    await asyncio.to_thread(
        run, f"INSERT INTO {DB}.t VALUES (1, 'ann', 'c1'), (2, 'bob', 'c2'), (3, 'cy', 'c3'), (4, 'di', 'c')",
        f"UPDATE {DB}.t SET name = 'bobby', card = 'c22' WHERE id = 2",
        f"DELETE FROM {DB}.t WHERE id = 3")
    for i in range(5, 25):  # changes keep coming while rows are checked: none in flight reported
        await asyncio.to_thread(run, f"INSERT INTO {DB}.t VALUES ({i}, 'n{i}', 'c')",
                                f"UPDATE {DB}.t SET name = 'm{i}' WHERE id = {i - 1}")
    statuses = await _until(js, lambda s: s.rows_checked >= 24 and s.pending == 0 and s.rechecking == 0,
                            "every changed row checked", processes, within=180)  # Spark's first job
    for status in statuses.values():
        assert status.mode == "full" and status.mismatches == 0 and status.found_total == 0, status
    assert _metric(worker, "sluice_sink_validation_mismatches") == 0

    # By hand downstream: a value changed, a row deleted. An on-demand compare finds both; they
    # are reported after their re-check, the row the ignored delete kept (3) is not.
    await asyncio.to_thread(_by_hand, down, postgres, "UPDATE t SET name = 'tampered' WHERE id = 4",
                            "DELETE FROM t WHERE id = 6")
    for cf in CFS:
        await request_compare(js, cf, "test")
    statuses = await _until(js, lambda s: s.compare is not None and s.compare.state == "done"
                            and s.mismatches == 2, "the compare and the two rows reported", processes)
    for status in statuses.values():
        reported = {r.key["id"]: (r.kind, r.columns) for r in status.reported}
        assert reported == {4: ("different", ["name"]), 6: ("missing", [])}, status
        assert status.compare is not None and status.compare.rows_checked == 24, status.compare
    assert _metric(worker, "sluice_sink_validation_mismatches") == 4

    # Repaired by hand (4 holds what its source holds: 'm5'); 6 by a new change upstream.
    await asyncio.to_thread(_by_hand, down, postgres, "UPDATE t SET name = 'm5' WHERE id = 4")
    await asyncio.to_thread(run, f"UPDATE {DB}.t SET name = 'again' WHERE id = 6")
    statuses = await _until(js, lambda s: s.mismatches == 0, "the repaired rows to leave the report",
                            processes)
    for status in statuses.values():
        assert status.repaired_total == 2 and status.found_total == 2, status
    assert _metric(worker, "sluice_sink_validation_mismatches") == 0
