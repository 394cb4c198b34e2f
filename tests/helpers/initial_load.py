"""The initial-load process tests' pieces: processes, changefeeds with an initial load, its progress."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from contracts.events.changefeeds import ChangefeedSpecV2, InitialLoad, SourceRefV1, TableFilterV1
from libs.changefeeds import record_changefeed
from libs.localservers.mariadb import MariaDB
from libs.localservers.service_process import ServiceProcess
from libs.scheduling.model import Span
from libs.streams import SNAPSHOT_BUCKET
from services.sink_worker.snapshot.plan import SnapshotProgress
from services.sink_worker.validation.verify import ShardRef, verify_target

# One list of the changefeeds a test created and one fixture deleting them (shared nats-server).
from tests.helpers.e2e import _created, _delete_changefeeds_afterwards  # noqa: F401 - fixture
from tests.helpers.worker_env import STANDALONE_WORKER_ENV
from tests.helpers.workload import RandomWorkload

_server_ids = itertools.count(4800)



def _capture(env: dict[str, str], logs: Path, source: MariaDB, source_id: str, db: str) -> ServiceProcess:
    return ServiceProcess("services.capture", {
        **env, "SLUICE_SOURCE_ID": source_id, "SLUICE_SOURCE_URL": f"{source.url_for(db)}?heartbeat=0.3",
        "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
    }, logs, instance_id=f"capture-{source_id}").start()


def _worker(env: dict[str, str], logs: Path, name: str, **extra: str) -> ServiceProcess:
    return ServiceProcess("services.sink_worker", {
        **env, **STANDALONE_WORKER_ENV,
        "SLUICE_SNAPSHOT_RETRY_S": "1", **extra,
    }, logs, instance_id=name).start()


async def _changefeed(js: JetStreamContext, cf_id: str, source_id: str, source: MariaDB, include: str,
                      sink_url: str, initial_load: InitialLoad, **extra: Any) -> None:
    spec = ChangefeedSpecV2(id=cf_id, sources=[SourceRefV1(id=source_id, url=source.url)],
                            filter=TableFilterV1(include=[include]), sink_url=sink_url,
                            initial_load=initial_load, **extra)
    await record_changefeed(js, spec, requested_by="test")
    _created.append(cf_id)


async def _progress(js: JetStreamContext, span: Span) -> SnapshotProgress | None:
    try:
        kv = await js.key_value(SNAPSHOT_BUCKET)
        entry = await kv.get(span.kv_key)
    except (KeyNotFoundError, Exception):
        return None
    return SnapshotProgress.from_json(entry.value) if entry.value else None


async def _wait_progress(js: JetStreamContext, span: Span, check: Any, within_s: float, what: str,
                         procs: list[ServiceProcess]) -> SnapshotProgress:
    deadline = time.monotonic() + within_s
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        last = await _progress(js, span)
        if last is not None and check(last):
            return last
        await asyncio.sleep(0.05)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(20)}" for p in procs)
    pytest.fail(f"{what} not within {within_s}s; progress: {last}\n{logs}")


def _equal(source: MariaDB, db: str, tables: list[str], sink: str) -> str | None:
    """None when every table is equal downstream, else what differs."""
    problems = []
    for table in tables:
        try:
            result = verify_target([ShardRef(source.url, db, table)], sink, db, table)
        except Exception as exc:  # the target appears with the copy
            problems.append(f"{table}: {exc!r}")
            continue
        if not result.ok:
            problems.append(f"{table}: {result.diff}")
    return "\n".join(problems) or None


def _wait_equal(source: MariaDB, db: str, tables: list[str], sink: str, within_s: float,
                procs: list[ServiceProcess]) -> None:
    deadline = time.monotonic() + within_s
    last: str | None = "nothing compared yet"
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        last = _equal(source, db, tables, sink)
        if last is None:
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(15)}\nhealth: {p.health()}" for p in procs)
    pytest.fail(f"downstream did not converge within {within_s}s:\n{last}\n{logs}")


def _prefill(source: MariaDB, db: str, workload: RandomWorkload, rows: int) -> None:
    """Rows that exist before the changefeed (all column kinds), plus a composite-key table and
    an empty one; the workload's later updates and deletes hit these rows too."""
    conn = source.connect()
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO `{db}`.accounts SELECT seq, CONCAT('user', seq, '@example.com'),"
                    " seq / 7, IF(seq % 5 = 0, NULL, CONCAT('note ü ', seq)),"
                    " TIMESTAMP('2026-01-01 00:00:00') + INTERVAL seq SECOND"
                    f" FROM `{db}`.seq_1_to_{rows}")
        cur.execute(f"INSERT INTO `{db}`.events SELECT seq, ELT(1 + seq % 3, 'a', 'b', 'c'),"
                    " IF(seq % 4 = 0, NULL, JSON_OBJECT('n', seq, 's', 'ü')), UNHEX(HEX(seq)),"
                    " TIMESTAMP('2026-02-01 00:00:00.123') + INTERVAL seq MINUTE,"
                    f" ELT(1 + seq % 4, '', 'x', 'x,z', NULL) FROM `{db}`.seq_1_to_{rows // 8}")
        cur.execute(f"INSERT INTO `{db}`.`select` SELECT seq, IF(seq % 2, 'drop table', NULL), seq * 1000"
                    f" FROM `{db}`.seq_1_to_{rows // 16}")
        cur.execute(f"CREATE TABLE `{db}`.pairs (region VARCHAR(16) NOT NULL, n INT NOT NULL,"
                    " amount DECIMAL(10,3) NULL, PRIMARY KEY (region, n))")
        cur.execute(f"INSERT INTO `{db}`.pairs SELECT ELT(1 + seq % 3, 'eu', 'US', 'apac'), seq, seq / 3"
                    f" FROM `{db}`.seq_1_to_{rows // 8}")
        cur.execute(f"CREATE TABLE `{db}`.empty_one (id INT PRIMARY KEY, v VARCHAR(8))")
    conn.close()
    workload.ids["accounts"] = list(range(1, rows + 1))
    workload.ids["events"] = list(range(1, rows // 8 + 1))
    workload.ids["select"] = list(range(1, rows // 16 + 1))
    workload.next_id = rows + 1
