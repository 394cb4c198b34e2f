"""Continuous validation end to end with real processes: MariaDB binlog -> capture -> sink-worker
(Spark) -> SQLite, with table rules (a dropped column, ignored deletes). A healthy run reports
nothing; a row changed by hand downstream is found by an on-demand compare and reported only
after its re-check; once repaired by hand it leaves the report."""

from __future__ import annotations

import asyncio
import sqlite3
import urllib.request
from pathlib import Path
from typing import Any

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
from libs.localservers.service_process import ServiceProcess
from libs.validation import SpanValidation, bucket, read_json, request_compare
from services.sink_worker.span import Span
from tests.test_e2e_replication import (  # noqa: F401 - fixtures
    _capture,
    _created,
    _delete_changefeeds_afterwards,
    _worker,
)

DB = "valid_e2e"
CF = "valid-1"


async def _status(js: JetStreamContext) -> SpanValidation | None:
    raw = await read_json(await bucket(js), Span.of(CF, "valid", DB, "t").kv_key)
    return SpanValidation.model_validate(raw) if raw is not None else None


async def _until(js: JetStreamContext, ok: Any, what: str, procs: list[ServiceProcess],
                 within: float = 60) -> SpanValidation:
    deadline = asyncio.get_running_loop().time() + within
    last = None
    while asyncio.get_running_loop().time() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        last = await _status(js)
        if last is not None and ok(last):
            return last
        await asyncio.sleep(0.3)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(20)}" for p in procs)
    raise AssertionError(f"timed out waiting for {what}; last status: {last}\n{logs}")


def _metric(proc: ServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"{proc.base_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'changefeed="{CF}"' in line)


async def test_validation_reports_a_hand_changed_row_until_it_is_repaired(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    processes: list[ServiceProcess],
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
    spec = ChangefeedSpecV5(id=CF, sources=[SourceRefV1(id="valid", url=mariadb.url)],
                            filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=f"sqlite:///{down}",
                            initial_load="binlog-only", validation=ValidationSpecV1(mode="full"),
                            table_rules=[TableRuleV1(tables=[f"{DB}.t"], ignore_events=["delete"],
                                                     drop_columns=["card"])])
    await record_changefeed(js, spec, requested_by="test")
    _created.append(CF)
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
    status = await _until(js, lambda s: s.rows_checked >= 24 and s.pending == 0 and s.rechecking == 0,
                          "every changed row checked", processes, within=180)  # Spark's first job
    assert status.mode == "full" and status.mismatches == 0 and status.found_total == 0, status
    assert _metric(worker, "sluice_sink_validation_mismatches") == 0

    # By hand downstream: a value changed, a row deleted. An on-demand compare finds both; they
    # are reported after their re-check, the row the ignored delete kept (3) is not.
    with sqlite3.connect(down) as db:
        db.execute("UPDATE t SET name = 'tampered' WHERE id = 4")
        db.execute("DELETE FROM t WHERE id = 6")
    await request_compare(js, CF, "test")
    status = await _until(js, lambda s: s.compare is not None and s.compare.state == "done"
                          and s.mismatches == 2, "the compare and the two rows reported", processes)
    reported = {r.key["id"]: (r.kind, r.columns) for r in status.reported}
    assert reported == {4: ("different", ["name"]), 6: ("missing", [])}, status
    assert status.compare is not None and status.compare.rows_checked == 24, status.compare
    assert _metric(worker, "sluice_sink_validation_mismatches") == 2

    # Repaired by hand (4 holds what its source holds: 'm5'); 6 by a new change upstream.
    with sqlite3.connect(down) as db:
        db.execute("UPDATE t SET name = 'm5' WHERE id = 4")
    await asyncio.to_thread(run, f"UPDATE {DB}.t SET name = 'again' WHERE id = 6")
    status = await _until(js, lambda s: s.mismatches == 0, "the repaired rows to leave the report",
                          processes)
    assert status.repaired_total == 2 and status.found_total == 2, status
    assert _metric(worker, "sluice_sink_validation_mismatches") == 0
