"""Two-phase XA transactions end to end with real processes: MariaDB binlog -> capture ->
sink-worker (Spark) -> SQLite, PostgreSQL and MariaDB downstreams, compared row for row with the
source, and a NATS stream in the Debezium envelope.

XA PREPARE and XA COMMIT are separate binlog groups, often from different connections with other
transactions between; capture keeps the prepared rows by XID and publishes them at the commit.
One capture (killed with SIGKILL between PREPARE and COMMIT, twice, and started again), one
worker, one changefeed per downstream; the cases run one after the other on the same tables."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from libs.changefeeds import record_changefeed
from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.nats_auth import ADMIN
from libs.streams import ROWS_STREAM, resolved_subject
from services.capture.publisher import XA_PREPARED_HEADER
from services.capture.xa import XaResume
from services.sink_worker.validation.verify import ShardRef, Verification, verify_targets
from tests.helpers.converge import wait_converged
from tests.helpers.e2e import (  # noqa: F401 - fixtures
    _capture,
    _created,
    _delete_changefeeds_afterwards,
    _worker,
    downstream_mariadb,
)
from tests.helpers.nats_sink import read_stream

pytestmark = pytest.mark.integration
DB = "xa_e2e"
SOURCE = "xa"
SCHEMA = ("CREATE TABLE t (id INT PRIMARY KEY, v INT, pad VARCHAR(200))",
          "CREATE TABLE u (id INT PRIMARY KEY, t_id INT, note TEXT)")
TABLES = ("t", "u")
OUT_STREAM = "XA_OUT"
# A budget the big transaction's ~600 KB of rows is well past: its parts go to disk.
XA_MEMORY_BYTES = 64 * 1024


def _txn(source: MariaDB, *statements: str) -> None:
    conn = source.connect(DB)
    try:
        conn.begin()  # the helper's connections autocommit: the statements are ONE transaction
        with conn.cursor() as cur:
            for sql in statements:
                cur.execute(sql)
        conn.commit()
    finally:
        conn.close()


def _prepare(source: MariaDB, xid: str, *statements: str, rows: list[tuple[Any, ...]] | None = None) -> None:
    """XA START .. XA PREPARE on a connection of its own, closed afterwards: the transaction
    stays prepared, and its decision comes from another session."""
    conn = source.connect(DB)
    thread = conn.thread_id()
    try:
        with conn.cursor() as cur:
            cur.execute(f"XA START {xid}")
            for sql in statements:
                cur.execute(sql)
            if rows:
                cur.executemany("INSERT INTO t VALUES (%s, %s, %s)", rows)
            cur.execute(f"XA END {xid}")
            cur.execute(f"XA PREPARE {xid}")
    finally:
        conn.close()
    # The server detaches the prepared transaction when it has handled the disconnect, which it
    # does on its own time: an XA COMMIT from another session before that finds no such XID
    # (XAER_NOTA, seen on a loaded machine).
    gone = f"SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = {thread}"
    wait_until(lambda: not source.execute(gone), 30, f"the session that prepared {xid} to be gone")


def _wait_equal(source: MariaDB, sinks: list[str], procs: list[ServiceProcess], timeout: float) -> None:
    def verify() -> list[Verification]:
        return [r for t in TABLES for r in verify_targets([ShardRef(source.url, DB, t)], sinks, DB, t)]

    wait_converged(verify, procs, timeout, interval=0.3, log_lines=10)


def _wait_health(capture: ServiceProcess, what: str, check: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        health = capture.health() or {}
        if check(health):
            return health
        assert capture.alive(), capture.tail_log()
        assert time.monotonic() < deadline, f"capture never showed {what}: {health}\n{capture.tail_log(10)}"
        time.sleep(0.1)


async def _mark_names(js: JetStreamContext, xids: set[str]) -> XaResume:
    """The newest resolved mark, once it records exactly ``xids`` as prepared and undecided."""
    deadline = time.monotonic() + 30
    while True:
        msg = await js.get_last_msg(ROWS_STREAM, resolved_subject(SOURCE))
        header = (msg.headers or {}).get(XA_PREPARED_HEADER)
        resume = XaResume.from_header(header) if header else None
        if resume is not None and set(resume.xids) == xids:
            return resume
        assert time.monotonic() < deadline, f"no resolved mark names {xids}: {header}"
        await asyncio.sleep(0.1)


def xid(name: str) -> str:
    return "X'" + name.encode().hex() + "',X'',1"


async def test_xa_transactions_reach_three_downstreams_and_a_stream(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],  # noqa: F811
    nats_server: NatsServer,
) -> None:
    mariadb.execute(f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}")
    mariadb.execute(*SCHEMA, database=DB)
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    host = nats_server.plain_url.split("://", 1)[1]
    stream_sink = f"nats://{ADMIN}:secret:xa-sink-pw@{host}/{OUT_STREAM}?subject=xa.out&format=debezium"
    logs = tmp_path / "logs"
    capture_env = {**service_env, "SLUICE_CAPTURE_XA_MEMORY_BYTES": str(XA_MEMORY_BYTES)}

    def start_capture() -> ServiceProcess:
        proc = _capture(capture_env, logs, mariadb, SOURCE, DB)
        processes.append(proc)
        proc.wait_healthy(60)
        return proc

    capture = start_capture()
    for i, url in enumerate([*sinks, stream_sink]):
        spec = ChangefeedSpecV2(id=f"xa-{i}", sources=[SourceRefV1(id=SOURCE, url=mariadb.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                                initial_load="binlog-only")
        await record_changefeed(js, spec, requested_by="test")
        _created.append(spec.id)
    assert nats_server.stack_auth is not None
    # The sink-worker role may not write streams of the stack's own server: the stream is
    # written as a user that may (a real deployment points the sink at its own NATS).
    sink_password = nats_server.stack_auth.password(ADMIN)
    worker = _worker({**service_env, "SLUICE_SECRET_XA_SINK_PW": sink_password,
                      "SLUICE_SECRETS_HOSTS": f"xa-sink-pw={host}"}, logs, "worker-xa")
    processes.append(worker)
    worker.wait_healthy(60)

    seed = ", ".join(f"({i}, {i}, 'seed')" for i in range(1, 21))
    await asyncio.to_thread(_txn, mariadb, f"INSERT INTO t VALUES {seed}",
                            "INSERT INTO u VALUES (90, 1, 'seed')")
    await asyncio.to_thread(_wait_equal, mariadb, sinks, [capture, worker], 180)  # Spark's first job

    # --- Everyday XA, no waits between: prepared with other transactions committing before the
    # decision, decided from another session, several XIDs interleaved, a rollback, one phase.
    await asyncio.to_thread(_prepare, mariadb, "'p1'", "INSERT INTO t VALUES (100, 1, 'p1')",
                            "UPDATE t SET v = 101 WHERE id = 1", "INSERT INTO u VALUES (1, 100, 'p1')")
    await asyncio.to_thread(_txn, mariadb, "INSERT INTO t VALUES (21, 21, 'plain')")
    await asyncio.to_thread(_prepare, mariadb, "'p2','branch',7", "INSERT INTO t VALUES (200, 2, 'p2')",
                            "DELETE FROM t WHERE id = 2")
    await asyncio.to_thread(_prepare, mariadb, "'rb'", "INSERT INTO t VALUES (300, 3, 'rolled back')",
                            "UPDATE t SET v = -3 WHERE id = 3")
    await asyncio.to_thread(_prepare, mariadb, "'i1'", "INSERT INTO u VALUES (11, 4, 'i1')")
    await asyncio.to_thread(_prepare, mariadb, "'i2'", "UPDATE t SET v = 5 WHERE id = 5",
                            "INSERT INTO u VALUES (12, 5, 'i2')")
    await asyncio.to_thread(mariadb.execute, "XA COMMIT 'p1'", "XA ROLLBACK 'rb'", database=DB)
    await asyncio.to_thread(_txn, mariadb, "UPDATE t SET pad = 'after p1' WHERE id = 100")
    conn = mariadb.connect(DB)
    try:
        with conn.cursor() as cur:
            for sql in ("XA START 'op'", "INSERT INTO t VALUES (400, 4, 'one phase')", "XA END 'op'",
                        "XA COMMIT 'op' ONE PHASE"):
                cur.execute(sql)
    finally:
        conn.close()
    await asyncio.to_thread(mariadb.execute, "XA COMMIT 'i2'", "XA COMMIT 'p2','branch',7",
                            "XA COMMIT 'i1'", database=DB)
    # A big one: its parts go past the memory budget to a temporary file while it waits.
    big = [(i, i, "x" * 150) for i in range(1000, 4000)]
    await asyncio.to_thread(_prepare, mariadb, "'big'", "DELETE FROM t WHERE id = 6", rows=big)
    await asyncio.to_thread(_wait_health, capture, "a spilled XA transaction",
                            lambda h: h.get("xa_prepared") == 1 and h.get("xa_spilled_bytes", 0) > 0)
    await asyncio.to_thread(_txn, mariadb, "DELETE FROM t WHERE id = 7")
    await asyncio.to_thread(mariadb.execute, "XA COMMIT 'big'", database=DB)
    await asyncio.to_thread(_wait_equal, mariadb, sinks, [capture, worker], 120)
    health = capture.health() or {}
    assert (health.get("xa_prepared"), health.get("xa_spilled_bytes")) == (0, 0)

    # --- kill -9 between PREPARE and COMMIT, after the resolved marks passed the prepared group:
    # the next capture reads the binlog again from that group (recovery), and the COMMIT, written
    # while no capture runs, still publishes its rows.
    await asyncio.to_thread(_prepare, mariadb, "'k1'", "INSERT INTO t VALUES (500, 5, 'k1')",
                            "UPDATE t SET v = 8 WHERE id = 8", "INSERT INTO u VALUES (20, 500, 'k1')")
    await asyncio.to_thread(_txn, mariadb, "INSERT INTO t VALUES (22, 22, 'plain')")
    await _mark_names(js, {xid("k1")})
    capture.kill()
    await asyncio.to_thread(_txn, mariadb, "INSERT INTO t VALUES (23, 23, 'while down')")
    await asyncio.to_thread(_prepare, mariadb, "'k2'", "INSERT INTO t VALUES (600, 6, 'k2')",
                            "DELETE FROM u WHERE id = 11")
    await asyncio.to_thread(mariadb.execute, "XA COMMIT 'k1'", database=DB)
    capture = start_capture()
    # --- and again with the decision after the restart: the recovered rows wait in the new
    # capture, k2's group lying before the mark it starts from.
    await _mark_names(js, {xid("k2")})
    capture.kill()
    capture = start_capture()
    await asyncio.to_thread(_wait_health, capture, "recovery done",
                            lambda h: h.get("xa_prepared") == 1 and h.get("xa_recovering") is False)
    await asyncio.to_thread(_txn, mariadb, "INSERT INTO t VALUES (24, 24, 'after restart')")
    await asyncio.to_thread(mariadb.execute, "XA COMMIT 'k2'", database=DB)
    await asyncio.to_thread(_wait_equal, mariadb, sinks, [capture, worker], 120)
    log = capture.log_path.read_text()
    assert log.count("XA recovery done") >= 2, log[-3000:]
    assert "not found in the binlog" not in log and "did not see prepared" not in log

    # --- The NATS stream in the Debezium envelope: the XA-committed rows arrived, the rolled
    # back ones did not.
    async def stream_ids() -> dict[tuple[str, int], dict[str, Any]]:
        out = {}
        for subject, _headers, data in await read_stream(js, OUT_STREAM):
            if subject.endswith(".ddl"):
                continue
            body = json.loads(data)
            row = body["after"] or body["before"]
            out[(subject.rsplit(".", 1)[-1], int(row["id"]))] = body
        return out

    deadline = time.monotonic() + 60
    wanted = {("t", 100), ("t", 200), ("t", 400), ("t", 500), ("t", 600), ("u", 1), ("u", 12), ("t", 3999)}
    while True:
        seen = await stream_ids()
        if wanted <= seen.keys():
            break
        assert time.monotonic() < deadline, sorted(wanted - seen.keys())
        assert worker.alive(), worker.tail_log()
        await asyncio.sleep(0.3)
    assert seen[("t", 100)]["op"] in ("c", "u") and seen[("t", 3999)]["after"]["pad"] == "x" * 150
    assert ("t", 300) not in seen and ("u", 11) in seen and seen[("u", 11)]["op"] == "d"
    # k1 is one transaction with the ts and ids of its commit group, which follows row 23's.
    k1, k1_u, down = seen[("t", 500)]["source"], seen[("u", 20)]["source"], seen[("t", 23)]["source"]
    assert k1["ts"] == k1_u["ts"] > down["ts"]

    def pos(source: dict[str, Any]) -> int:
        # The id names the commit group by its GTID (source:gtid:domain-server-seq:...): its
        # seq orders the groups as their binlog positions do.
        return int(source["event_id"].split(":")[2].rsplit("-", 1)[-1])

    assert pos(k1) == pos(k1_u) > pos(down), (k1, down)
