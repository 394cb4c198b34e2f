"""End to end with real processes: MariaDB binlog -> capture -> JetStream -> sink-worker (Spark)
-> MariaDB, PostgreSQL and SQLite downstreams. Downstream must equal upstream row for row,
also after the capture and the sink-worker are killed with SIGKILL in the middle of a load."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from nats.js import JetStreamContext

from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target
from tests.helpers.converge import wait_converged
from tests.helpers.e2e import (  # noqa: F401 - fixtures
    _capture,
    _changefeed,
    _delete_changefeeds_afterwards,
    _worker,
    downstream_mariadb,
)
from tests.helpers.workload import TABLES, RandomWorkload, run_in_thread


def _verify_all(source: MariaDB, db: str, sink_urls: list[str]) -> list[Verification]:
    out = []
    for url in sink_urls:
        for table in TABLES:
            out.append(verify_target([ShardRef(source.url, db, table)], url, db, table))
    return out


def _wait_equal(source: MariaDB, db: str, sink_urls: list[str], timeout: float,
                procs: list[ServiceProcess]) -> None:
    wait_converged(lambda: _verify_all(source, db, sink_urls), procs, timeout, interval=0.5)


async def test_random_workload_reaches_three_downstreams_row_for_row(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],  # noqa: F811
) -> None:
    db = "e2e_three"
    conn = mariadb.connect()
    workload = RandomWorkload(conn, db, seed=20261121)
    workload.create_tables()
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "e2e3", db)
    processes.append(capture)
    capture.wait_healthy(60)
    for i, url in enumerate(sinks):
        await _changefeed(js, f"e2e-three-{i}", "e2e3", mariadb, db, url)
    worker = _worker(service_env, logs, "worker-e2e3")
    processes.append(worker)
    worker.wait_healthy(60)
    def transactions(n: int) -> None:
        for _ in range(n):
            workload.transaction(8)

    await asyncio.to_thread(transactions, 150)
    await asyncio.to_thread(_wait_equal, mariadb, db, sinks, 240, processes)
    # More changes after the first convergence: the pipelines keep following.
    await asyncio.to_thread(transactions, 50)
    await asyncio.to_thread(_wait_equal, mariadb, db, sinks, 120, processes)
    assert workload.statements >= 1600


async def test_kill_9_capture_and_worker_mid_load_loses_nothing(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    processes: list[ServiceProcess],
) -> None:
    db = "e2e_kill"
    conn = mariadb.connect()
    workload = RandomWorkload(conn, db, seed=99)
    workload.create_tables()
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "e2ek", db)
    processes.append(capture)
    capture.wait_healthy(60)
    await _changefeed(js, "e2e-kill", "e2ek", mariadb, db, sink)
    worker = _worker(service_env, logs, "worker-e2ek")
    processes.append(worker)
    worker.wait_healthy(60)

    progress = threading.Event()
    txns = {"n": 0}

    def on_txn(n: int) -> None:
        txns["n"] = n
        if n % 20 == 0:
            progress.set()

    def rows_applied() -> int:
        health = worker.health() or {}
        return sum(int(s.get("rows_written") or 0) for s in health.get("spans", []))

    def faults() -> tuple[ServiceProcess, ServiceProcess]:
        wait_until(lambda: rows_applied() > 0, 120, "the worker's first applied rows")
        worker.kill()  # in the middle of rounds: batches written, checkpoints not all advanced
        progress.clear()
        assert progress.wait(30)
        capture.kill()  # mid-load: capture must resume from its last resolved mark
        progress.clear()
        assert progress.wait(30)
        new_capture = _capture(service_env, logs, mariadb, "e2ek", db)
        new_worker = _worker(service_env, logs, "worker-e2ek")
        processes.extend([new_capture, new_worker])
        progress.clear()
        assert progress.wait(30)
        return new_capture, new_worker

    stop = threading.Event()
    thread = run_in_thread(workload, stop, txn_size=6, on_txn=on_txn, pause_s=0.02)
    try:
        capture, worker = await asyncio.to_thread(faults)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
    assert txns["n"] >= 60
    await asyncio.to_thread(_wait_equal, mariadb, db, [sink], 240, [capture, worker])
