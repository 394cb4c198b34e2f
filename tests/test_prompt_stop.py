"""A sink-worker stops promptly on SIGTERM in every phase, and loses nothing.

Real processes: SIGTERM while the worker still warms Spark (it has not joined as a member yet),
in the middle of an initial-load copy, and during a round under a write workload. Each stop is
timed against ``STOP_BOUND_S``; after the last one a restarted worker resumes and the downstream
tables end equal to the source.

The bound: a round gets ``SLUICE_SINK_STOP_GRACE_S`` (4 s) before it is abandoned, a copy's
Spark job is cancelled (its tasks are interrupted), Spark gets 3 s to stop, and the runtime waits
at most 2 s for threads it cannot interrupt (a JVM start, a job still ending) before it exits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from libs.localservers.mariadb import MariaDB
from libs.localservers.service_process import ServiceProcess
from libs.scheduling.model import Span
from tests.helpers.initial_load import (
    _capture,
    _changefeed,
    _delete_changefeeds_afterwards,
    _prefill,
    _progress,
    _wait_equal,
    _wait_progress,
    _worker,
)
from tests.helpers.workload import RandomWorkload, run_in_thread

pytestmark = pytest.mark.integration

__all__ = ["_delete_changefeeds_afterwards"]  # fixtures used here

STOP_BOUND_S = 12.0


def _timed_stop(proc: ServiceProcess) -> float:
    t0 = time.monotonic()
    code = proc.terminate(timeout=30)
    took = time.monotonic() - t0
    assert code == 0, f"{proc.instance_id} exited {code}:\n{proc.tail_log()}"
    return took


def test_sigterm_while_warming_spark_exits_at_once(service_env: dict[str, str], tmp_path: Path) -> None:
    proc = ServiceProcess("services.sink_worker", service_env, tmp_path / "logs").start()
    try:
        proc.wait_healthy(timeout=60)
        status, ready = proc.get_json("/readyz")
        # Precondition: Spark is still starting (a JVM start and a round's plans take seconds).
        assert status == 503 and "spark_warm" in ready["failing"], ready
        took = _timed_stop(proc)
        assert took < STOP_BOUND_S, f"stopped in {took:.1f} s while warming Spark:\n{proc.tail_log()}"
        log = proc.log_path.read_text()
        # It never joined: no member heartbeat, so there was nothing to hand over.
        assert "member agent started" not in log, proc.tail_log()
    finally:
        proc.kill()


@pytest.mark.timeout(600)
async def test_sigterm_mid_copy_and_mid_round_under_load_then_resume_equal(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    processes: list[ServiceProcess],
) -> None:
    db = "prompt_stop"
    workload = RandomWorkload(mariadb.connect(), db, seed=16)
    workload.create_tables()
    await asyncio.to_thread(_prefill, mariadb, db, workload, 4_000)
    tables = ["accounts", "events", "select", "pairs", "empty_one"]
    sink = f"sqlite:///{tmp_path / 'down.db'}"
    logs = tmp_path / "logs"
    capture = _capture(service_env, logs, mariadb, "pstop", db)
    processes.append(capture)
    capture.wait_healthy(60)
    chunking = {"SLUICE_SNAPSHOT_CHUNK_ROWS": "250", "SLUICE_SNAPSHOT_PARALLELISM": "2",
                "SLUICE_SNAPSHOT_WRITE_ROWS": "100"}
    await _changefeed(js, "prompt-stop", "pstop", mariadb, f"{db}.*", sink, "snapshot")
    worker = _worker(service_env, logs, "worker-pstop", **chunking)
    processes.append(worker)
    span = Span.of("prompt-stop", "pstop", db, "accounts")

    stop = threading.Event()
    thread = run_in_thread(workload, stop, txn_size=4, pause_s=0.05)
    try:
        # 1. In the middle of the copy.
        await _wait_progress(js, span, lambda p: p.chunks_done >= 2, 180,
                             "a wave of accounts chunks copied", [capture, worker])
        # Holding the table's write lock stalls the copy's next chunk reads, so the stop lands
        # in the middle of the copy however fast the machine is (and while a read waits).
        blocker = mariadb.connect()
        try:
            with blocker.cursor() as cur:
                cur.execute(f"LOCK TABLES `{db}`.accounts WRITE")
            took = await asyncio.to_thread(_timed_stop, worker)
            assert took < STOP_BOUND_S, f"stopped in {took:.1f} s mid-copy:\n{worker.tail_log()}"
            at_stop = await _progress(js, span)
            assert at_stop is not None and at_stop.state != "done", at_stop
        finally:
            with blocker.cursor() as cur:
                cur.execute("UNLOCK TABLES")
            blocker.close()

        # 2. Streaming under the workload: stop while rounds write.
        worker = _worker(service_env, logs, "worker-pstop", **chunking)
        processes.append(worker)
        await _wait_progress(js, span, lambda p: p.state == "done", 240,
                             "the resumed copy of accounts", [capture, worker])

        def writing() -> bool:
            health = worker.health() or {}
            last = health.get("last_round") or {}
            return bool(last.get("rows_written")) and health.get("rounds", 0) >= 3

        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(writing):
            assert worker.alive(), worker.tail_log()
            assert time.monotonic() < deadline, f"no round wrote rows within 120 s:\n{worker.tail_log()}"
            await asyncio.sleep(0.2)  # polling a condition with a deadline
        took = await asyncio.to_thread(_timed_stop, worker)
        assert took < STOP_BOUND_S, f"stopped in {took:.1f} s during a round:\n{worker.tail_log()}"
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)

    # 3. Nothing lost: a restarted worker resumes and the tables end equal.
    worker = _worker(service_env, logs, "worker-pstop", **chunking)
    processes.append(worker)
    await asyncio.to_thread(_wait_equal, mariadb, db, tables, sink, 240, [capture, worker])
    assert workload.statements > 0
