"""End-to-end process test pieces: capture and standalone sink-worker processes, changefeeds,
a downstream MariaDB."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpec, SourceRefV1, TableFilterV1
from libs.changefeeds import record_changefeed, record_state
from libs.localservers.mariadb import MariaDB
from libs.localservers.service_process import ServiceProcess
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

_server_ids = itertools.count(4700)


def _capture(env: dict[str, str], logs: Path, source: MariaDB, source_id: str, db: str) -> ServiceProcess:
    return ServiceProcess("services.capture", {
        **env, "SLUICE_SOURCE_ID": source_id,
        "SLUICE_SOURCE_URL": f"{source.url_for(db)}?heartbeat=0.5",
        "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
    }, logs, instance_id=f"capture-{source_id}").start()


def _worker(env: dict[str, str], logs: Path, name: str) -> ServiceProcess:
    # Standalone: these tests are about the data path (one worker runs every span); the control
    # plane's own process tests are in test_control_plane.py.
    return ServiceProcess("services.sink_worker", {
        **env, **STANDALONE_WORKER_ENV,
    }, logs, instance_id=name).start()


_created: list[str] = []


async def _changefeed(js: JetStreamContext, cf_id: str, source_id: str, source: MariaDB, db: str,
                      sink_url: str, **extra: Any) -> None:
    spec = ChangefeedSpec(id=cf_id, sources=[SourceRefV1(id=source_id, url=source.url)],
                          filter=TableFilterV1(include=[f"{db}.*"]), sink_url=sink_url,
                          initial_load="binlog-only", **extra)
    await record_changefeed(js, spec, requested_by="test")
    _created.append(cf_id)


@pytest.fixture(autouse=True)
async def _delete_changefeeds_afterwards(js: JetStreamContext) -> AsyncIterator[None]:
    # The nats-server is shared by the session: later tests' workers must not run these feeds.
    yield
    while _created:
        await record_state(js, _created.pop(), "deleted", requested_by="test", reason="test over")


@pytest.fixture
def downstream_mariadb(mariadb_factory: Callable[..., MariaDB]) -> MariaDB:
    return mariadb_factory()
