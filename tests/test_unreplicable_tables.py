"""A table that cannot be replicated, through the whole system as real processes (capture on a
private MariaDB, member, scheduler, replication-manager, one sink-worker, the api, the CLI):
a keyless table under ``key_policy: primary`` is stopped with an unreplicable incident that the
api and the CLI show (never "replicating"), the worker logs it once, and the changefeed's
checkpoint leaves it out: it goes on past where the stopped table stands, with the other table's
rows downstream."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from libs.localservers.common import wait_until
from libs.localservers.system import LocalSystem
from services.cli.app import app
from tests.helpers.worker_env import MEMBER_WORKER_ENV, SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

pytestmark = pytest.mark.integration
DB = "shop"
CF = "unrepl"


@pytest.fixture
async def system(tmp_path: Path) -> AsyncIterator[LocalSystem]:
    system = LocalSystem(
        base_dir=tmp_path, sources=1, control_replicas=1, workers=1, lease_ttl_s=2.0, with_api=True,
        control_services=("member", "scheduler", "replication_manager"), standalone_workers=False,
        initial_load="binlog-only",
        control_env={"SLUICE_REPLICATION_TICK_S": "1"},
        worker_env={**MEMBER_WORKER_ENV, "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS,
                    **SINK_TEST_PACING},
    )
    try:
        system.start_infra()
        conn = system.source_dbs[0].connect()
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {DB}")
            cur.execute(f"CREATE TABLE {DB}.orders (id INT PRIMARY KEY, v INT)")
            cur.execute(f"CREATE TABLE {DB}.events (note VARCHAR(20), n INT)")  # no key at all
        conn.close()
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 90)
        await system.create_changefeed(system.changefeed_spec(CF, include=[f"{DB}.*"]))
        yield system
    finally:
        system.stop()


def _write(system: LocalSystem, first: int, count: int) -> None:
    conn = system.source_dbs[0].connect()
    with conn.cursor() as cur:
        for i in range(first, first + count):
            cur.execute(f"INSERT INTO {DB}.orders VALUES (%s, %s)", (i, i))
            cur.execute(f"INSERT INTO {DB}.events VALUES (%s, %s)", (f"e{i}", i))
    conn.close()


async def test_a_keyless_table_stops_with_its_reason_and_the_checkpoint_goes_on_without_it(
        system: LocalSystem) -> None:
    api = system.processes["api-1"].base_url
    headers = {"Authorization": f"Bearer {system.api_token}"}

    def get(path: str) -> Any:
        answer = httpx.get(f"{api}/api/v1{path}", headers=headers, timeout=5)
        return answer.json() if answer.status_code == 200 else None

    # The worker joins once its Spark is warm (a JVM start: slow on a busy machine).
    await asyncio.to_thread(wait_until, lambda: bool(get("/members")), 150, "the sink-worker to join",
                            interval=0.5)
    _write(system, 1, 3)  # both tables get a subject in the ROWS stream: a span each

    def tables() -> dict[str, dict[str, Any]]:
        return {t["table"]: t for t in get(f"/changefeeds/{CF}/tables") or []}

    def stopped_beside_replicating() -> bool:
        found = tables()
        return (found.get("events", {}).get("state") == "stopped"
                and found.get("orders", {}).get("state") == "replicating")

    await asyncio.to_thread(wait_until, stopped_beside_replicating, 60,
                            "events stopped and orders replicating in the api")
    events = tables()["events"]
    incident = events["incident"]
    assert incident["kind"] == "unreplicable" and incident["statement"] is None, incident
    assert events["error"].startswith("stopped: the table cannot be replicated")
    assert "no primary key" in events["error"] and "key_policy" in events["error"], events

    # The changefeed's checkpoint covers orders only: it goes on, past where events stopped,
    # with orders' new rows downstream.
    before = get(f"/changefeeds/{CF}")["checkpoint_ts"]
    _write(system, 10, 2)
    seen: list[dict[str, Any]] = []

    def orders_ids() -> list[int]:
        with sqlite3.connect(system.sink_url.removeprefix("sqlite:///")) as db:
            return sorted(r[0] for r in db.execute("SELECT id FROM orders"))  # one SQLite file: no schema

    def went_on_without_it() -> bool:
        cf = get(f"/changefeeds/{CF}")
        if not cf or not cf["stopped_tables"] or orders_ids() != [1, 2, 3, 10, 11]:
            return False
        seen.append(cf)
        at = cf["stopped_tables"][0]["checkpoint_ts"]
        return at is not None and cf["checkpoint_ts"] > max(at, before)

    await asyncio.to_thread(wait_until, went_on_without_it, 60,
                            "orders' rows downstream and the changefeed checkpoint past the stopped table")
    [stop] = seen[-1]["stopped_tables"]
    assert (stop["table"], stop["incident"], stop["kind"]) == ("events", incident["incident"], "unreplicable")
    assert "no primary key" in stop["reason"]
    # Still stopped, never "replicating", round after round.
    assert tables()["events"]["state"] == "stopped"

    # The CLI shows the same: the table's state and reason, the changefeed's uncovered table.
    runner = CliRunner()
    base = ["--url", api, "--token", system.api_token]
    out = runner.invoke(app, [*base, "changefeed", "tables", CF], env={"COLUMNS": "320"})
    assert out.exit_code == 0 and "stopped" in out.output and "cannot be replicated" in out.output, out.output
    row = next(line for line in out.output.splitlines() if " events " in f" {line} ")
    assert "replicating" not in row, out.output
    out = runner.invoke(app, [*base, "changefeed", "get", CF], env={"COLUMNS": "320"})
    assert out.exit_code == 0 and "stopped tables" in out.output and incident["incident"] in out.output

    # Logged once by its worker, not every round.
    log = system.processes["sink-worker-1"].log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "span stopped: the table cannot be replicated" in line]
    assert len(lines) == 1, lines
