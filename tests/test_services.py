"""Every service starts as a real process, serves health, readiness and metrics, and stops on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.localservers.service_process import ServiceProcess

SERVICES = ["capture", "member", "scheduler", "replication_manager", "ddl_lock", "sink_worker", "api"]


@pytest.fixture
def all_services(service_env: dict[str, str], tmp_path: Path) -> list[ServiceProcess]:
    procs = [ServiceProcess(f"services.{name}", service_env, tmp_path / "logs").start() for name in SERVICES]
    yield procs
    for p in procs:
        p.kill()


def test_services_serve_health_and_stop_cleanly_on_sigterm(all_services: list[ServiceProcess]) -> None:
    for proc in all_services:
        health = proc.wait_healthy(timeout=60)
        assert health["status"] == "ok"
        assert health["instance"] == proc.instance_id
        status, ready = proc.get_json("/readyz")
        assert status in (200, 503)
        assert "failing" in ready and "nats" not in ready["failing"], ready
        with __import__("urllib.request").request.urlopen(proc.base_url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
        assert "sluice_nats_reconnects_total" in text
    for proc in all_services:
        logged_before_stop = proc.log_path.stat().st_size
        code = proc.terminate(timeout=20)
        assert code == 0, f"{proc.instance_id} exited {code}:\n{proc.tail_log()}"
        # A clean stop is quiet: an ERROR here would page an operator for nothing.
        with open(proc.log_path, "rb") as log:
            log.seek(logged_before_stop)
            stop_lines = log.read().decode(errors="replace").splitlines()
        errors = [line for line in stop_lines if '"level": "ERROR"' in line]
        assert not errors, f"{proc.instance_id} logged errors while stopping:\n" + "\n".join(errors)
