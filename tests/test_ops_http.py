"""The ops endpoints of every service (libs/ops_http, libs/service): the bare ASGI app of the
control services and the routes the api's FastAPI app gets answer alike."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from libs.config import Settings
from libs.service import ServiceRuntime


def _clients() -> list[tuple[str, TestClient]]:
    settings = Settings(instance_id="ops-1")
    member = ServiceRuntime("member", settings)
    api = ServiceRuntime("api", settings, app=FastAPI())
    for rt in (member, api):
        rt.status["spans"] = 3
    return [("bare", TestClient(member.app)), ("fastapi", TestClient(api.app))]


@pytest.mark.parametrize("kind", ["bare", "fastapi"])
def test_health_ready_and_metrics_answer_the_same_on_both_apps(kind: str) -> None:
    client = dict(_clients())[kind]
    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.headers["content-type"].startswith("application/json")
    assert health.json()["status"] == "ok" and health.json()["spans"] == 3
    assert health.json()["instance"] == "ops-1"
    ready = client.get("/readyz")  # NATS is not connected: not ready, and says why
    assert ready.status_code == 503 and ready.json() == {"ready": False, "failing": ["nats"]}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


def test_an_unhealthy_service_answers_503_with_its_reason() -> None:
    settings = Settings(instance_id="ops-2")
    rt = ServiceRuntime("capture", settings)
    rt.status["unhealthy"] = "binlog purged"
    body = TestClient(rt.app).get("/healthz")
    assert body.status_code == 503 and body.json()["unhealthy"] == "binlog purged"


def test_the_bare_app_refuses_unknown_paths_and_methods() -> None:
    client = dict(_clients())["bare"]
    assert client.get("/docs").status_code == 404
    assert client.post("/healthz").status_code == 405
    assert client.head("/healthz").content == b""


def test_the_api_lists_the_ops_routes_in_its_openapi() -> None:
    client = dict(_clients())["fastapi"]
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/healthz", "/readyz", "/metrics"} <= set(paths)
    assert paths["/healthz"]["get"]["tags"] == ["ops"]


def test_a_status_given_as_a_function_is_built_when_asked_for() -> None:
    rt = ServiceRuntime("member", Settings(instance_id="ops-2"))
    calls: list[int] = []
    rt.status["spans"] = lambda: calls.append(1) or [{"span": "a"}]
    assert calls == []  # setting it builds nothing
    client = TestClient(rt.app)
    assert client.get("/healthz").json()["spans"] == [{"span": "a"}]
    assert client.get("/healthz").json()["spans"] == [{"span": "a"}]
    assert calls == [1, 1]

