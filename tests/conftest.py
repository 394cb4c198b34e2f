"""Session fixtures: private servers on free ports with temp data dirs, never system services."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from tests.helpers.worker_env import SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

pytest_plugins = ["tests.fixtures_servers", "tests.api_stack"]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(data_dir=tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.drain()


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()


@pytest.fixture
def service_env(nats_server: NatsServer, tmp_path: Path) -> dict[str, str]:
    """Environment for a service subprocess pointed at the session's nats-server."""
    return {
        "SLUICE_NATS_URL": nats_server.url,
        "SLUICE_LEASE_TTL_S": "1.5",
        "SLUICE_STATE_DB_URL": f"sqlite:///{tmp_path / 'state.db'}",
        "SLUICE_DOWNSTREAM_URL": f"sqlite:///{tmp_path / 'downstream.db'}",
        "SLUICE_LOG_JSON": "true",
        "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS,
        **SINK_TEST_PACING,
    }


@pytest.fixture
def processes() -> Iterator[list[ServiceProcess]]:
    """Service processes a test starts; each is killed (SIGKILL) when the test ends."""
    procs: list[ServiceProcess] = []
    yield procs
    for p in procs:
        p.kill()


# Fixtures that start a real server, a SparkSession or a service process. A test that uses any of
# them (directly or through another fixture) is an integration test even when its module forgot
# the marker, so `-m "not integration"` stays a lane with no servers in it.
_SERVER_FIXTURES = frozenset({
    "nats_server", "nc", "js", "service_env", "mariadb", "mariadb_factory", "postgres",
    "postgres_factory", "spark", "api_stack",
})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (a dev dependency)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``SLUICE_TEST_WORKERS=2 infra/dev.sh test`` runs two xdist workers with ``--dist
    loadgroup``: each module on one worker, some modules alone (tests/helpers/xdist_modules.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.helpers.xdist_modules import ModuleScheduling

    return ModuleScheduling(config, log)
