"""A sink-worker process's start-up: without NATS it fails clearly and exits, with NATS it is ready
once Spark is warm. Apart from tests/test_services.py (every service's SIGTERM stop is timed there,
so that module runs alone): these bounds are generous, so this module runs beside others."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.localservers.service_process import ServiceProcess


@pytest.mark.integration
def test_service_without_nats_is_not_ready_and_still_stops(tmp_path: Path) -> None:
    # Nothing listens on this port: the service must fail its start-up clearly, not hang.
    from libs.localservers.common import free_port

    env = {"SLUICE_NATS_URL": f"nats://127.0.0.1:{free_port()}", "SLUICE_NATS_CONNECT_TIMEOUT_S": "2"}
    proc = ServiceProcess("services.sink_worker", env, tmp_path / "logs").start()
    try:
        assert proc.proc is not None
        proc.proc.wait(timeout=60)
        assert proc.proc.returncode != 0
        assert "cannot connect to NATS" in proc.tail_log()
    finally:
        proc.kill()


def test_sink_worker_is_ready_once_spark_is_warm(service_env: dict[str, str], tmp_path: Path) -> None:
    proc = ServiceProcess("services.sink_worker", service_env, tmp_path / "logs").start()
    try:
        proc.wait_healthy(timeout=60)
        # Readiness waits for the warm-up (a JVM start and a round's plans): generous deadline.
        body = proc.wait_ready(timeout=180)
        assert body["failing"] == [], body
        assert "Spark warmed up" in proc.log_path.read_text()
        health = proc.health()
        assert health is not None and health["status"] == "ok"
    finally:
        proc.kill()
