"""Schema-change policies with real processes: MariaDB binlog -> capture -> JetStream ->
sink-worker (Spark) -> MariaDB, PostgreSQL and SQLite, one changefeed per (policy, downstream)
on one capture and one worker. Each policy meets the DDL matrix's kinds (a re-copying MODIFY,
ADD and DROP COLUMN, a column rename, TRUNCATE, DROP TABLE) on its own tables, and each
downstream's definition and rows are checked against what the policy promises (DESIGN.md,
"Schema-change policies"); ``evolve`` is the DDL matrix itself (test_ddl_matrix.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpec, SourceRefV1, TableFilterV1
from contracts.events.table_incidents import TableActionRequestedV1, TableRefV1
from libs.changefeeds import record_changefeed, record_state, record_table_event
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from services.sink_worker.ddl.policy import POLICY_STOP_PREFIX
from services.sink_worker.validation.verify import ShardRef, verify_target
from tests.helpers.definitions import mysql_query, pg_columns, pg_query, sqlite_columns, sqlite_query
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration

DB = "schema_policy"
POLICIES = {"lenient": "len", "ignore": "ign", "stop": "stp"}
_server_ids = itertools.count(4950)
_created: list[str] = []


@pytest.fixture(autouse=True)
async def _delete_changefeeds_afterwards(js: JetStreamContext) -> AsyncIterator[None]:
    yield
    while _created:
        await record_state(js, _created.pop(), "deleted", requested_by="test", reason="test over")


class Downstreams:
    """The three downstreams, read with plain SQL (``rows``, ``columns``)."""

    def __init__(self, sqlite_url: str, pg_url: str, maria: MariaDB) -> None:
        self.urls = {"sqlite": sqlite_url, "pg": pg_url, "maria": maria.url}
        self.maria = maria

    def rows(self, kind: str, table: str, columns: str) -> list[tuple[Any, ...]]:
        """``columns`` of every row, by id (values as text, NULL as None)."""
        cols = columns.split(", ")
        if kind == "maria":
            sql = f"SELECT {columns} FROM `{DB}`.`{table}` ORDER BY id"
            found = mysql_query(self.maria, sql)
        elif kind == "pg":
            # ORDER BY t.id: a bare ``id`` would name the output column, the text.
            sql = f'SELECT {", ".join(f"t.{c}::text" for c in cols)} FROM "{DB}"."{table}" AS t ORDER BY t.id'
            found = pg_query(self.urls["pg"], sql)
        else:
            found = sqlite_query(self.urls["sqlite"], f'SELECT {columns} FROM "{table}" ORDER BY id')
        return [tuple(None if v is None else str(v) for v in r) for r in found]

    def columns(self, kind: str, table: str) -> dict[str, bool]:
        """column -> nullable."""
        if kind == "maria":
            return {str(n): v == "YES" for n, v in mysql_query(
                self.maria, "SELECT COLUMN_NAME, IS_NULLABLE FROM information_schema.COLUMNS"
                            " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s", (DB, table))}
        if kind == "pg":
            return {n: c[0] == "YES" for n, c in pg_columns(self.urls["pg"], DB, table).items()}
        return {n: c[0] == 0 for n, c in sqlite_columns(self.urls["sqlite"], table).items()}


def _exec(source: MariaDB, *statements: str) -> None:
    conn = source.connect()
    try:
        with conn.cursor() as cur:
            for sql in statements:
                cur.execute(sql)
        conn.commit()
    finally:
        conn.close()


def _source_rows(source: MariaDB, table: str, columns: str) -> list[tuple[Any, ...]]:
    return [tuple(None if v is None else str(v) for v in r)
            for r in mysql_query(source, f"SELECT {columns} FROM `{DB}`.`{table}` ORDER BY id")]


def _spans(worker: ServiceProcess) -> list[dict[str, Any]]:
    return list((worker.health() or {}).get("spans", []))


def _span(worker: ServiceProcess, changefeed: str, table: str) -> dict[str, Any]:
    return next((s for s in _spans(worker)
                 if s.get("changefeed") == changefeed and s.get("table") == table), {})


def _converged(source: MariaDB, url: str, table: str) -> bool:
    try:
        return verify_target([ShardRef(source.url, DB, table)], url, DB, table).ok
    except Exception:  # the target appears with its first batch
        return False


def _wait(check: Callable[[], bool], what: str, procs: list[ServiceProcess], timeout: float = 180,
          detail: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        if check():
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(60)}" for p in procs)
    spans = [{k: s.get(k) for k in ("span", "state", "error")} for p in procs[1:] for s in _spans(p)
             if s.get("state") != "replicating"]
    pytest.fail(f"not within {timeout}s: {what}\n{detail()}\nspans not replicating: {spans}\n{logs}")


def _b_kept(down: Downstreams, table: str) -> Callable[[], bool]:
    """The 20 rows before TRUNCATE and DROP TABLE, and the row inserted between them."""
    want = [*map(str, range(1, 21)), "100"]
    return lambda: all([r[0] for r in down.rows(k, table, "id")] == want for k in down.urls)


@pytest.mark.timeout(900)
async def test_each_policy_meets_the_ddl_matrix_on_three_downstreams(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, mariadb_factory: Callable[..., MariaDB], processes: list[ServiceProcess],
) -> None:
    t0 = time.monotonic()
    maria_down = mariadb_factory()
    down = Downstreams(f"sqlite:///{tmp_path / 'down.db'}", postgres.url, maria_down)
    _exec(mariadb, f"DROP DATABASE IF EXISTS `{DB}`", f"CREATE DATABASE `{DB}`")
    for p in POLICIES.values():
        _exec(mariadb,
              f"CREATE TABLE `{DB}`.{p}_a (id INT PRIMARY KEY, n INT NOT NULL,"
              " s VARCHAR(10) NOT NULL DEFAULT 'x', r VARCHAR(10))",
              f"CREATE TABLE `{DB}`.{p}_b (id INT PRIMARY KEY, n INT)")
    logs = tmp_path / "logs"
    capture = ServiceProcess("services.capture", {
        **service_env, "SLUICE_SOURCE_ID": "pol", "SLUICE_SOURCE_URL": f"{mariadb.url_for(DB)}?heartbeat=0.5",
        "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
    }, logs, instance_id="capture-pol").start()
    processes.append(capture)
    capture.wait_healthy(60)
    feeds: dict[tuple[str, str], str] = {}
    for policy, p in POLICIES.items():
        for kind, url in down.urls.items():
            spec = ChangefeedSpec(id=f"pol-{p}-{kind}", sources=[SourceRefV1(id="pol", url=mariadb.url)],
                                  filter=TableFilterV1(include=[f"{DB}.{p}_*"]), sink_url=url,
                                  initial_load="binlog-only", schema_change_policy=policy)  # type: ignore[arg-type]
            await record_changefeed(js, spec, requested_by="test")
            _created.append(spec.id)
            feeds[(policy, kind)] = spec.id
    worker = ServiceProcess("services.sink_worker", {**service_env, **STANDALONE_WORKER_ENV},
                            logs, instance_id="worker-pol").start()
    processes.append(worker)
    worker.wait_healthy(60)
    procs = [capture, worker]

    for p in POLICIES.values():
        _exec(mariadb, *[f"INSERT INTO `{DB}`.{p}_a VALUES ({i}, {i}, 's{i}', 'r{i}')" for i in range(1, 21)],
              *[f"INSERT INTO `{DB}`.{p}_b VALUES ({i}, {i})" for i in range(1, 21)])
    everything = [(url, f"{p}_{t}") for url in down.urls.values() for p in POLICIES.values() for t in "ab"]
    await asyncio.to_thread(_wait, lambda: all(_converged(mariadb, u, t) for u, t in everything),
                            "every table replicated before its DDL", procs)
    before = {kind: down.columns(kind, "ign_a") for kind in down.urls}
    t_setup = time.monotonic() - t0

    # The same DDL kinds on each policy's tables (lenient's below, one at a time).
    big = 1 << 40
    _exec(mariadb,
          f"ALTER TABLE `{DB}`.ign_a ADD COLUMN c INT",
          f"ALTER TABLE `{DB}`.ign_a DROP COLUMN s",
          f"ALTER TABLE `{DB}`.ign_a RENAME COLUMN r TO r2",
          f"ALTER TABLE `{DB}`.ign_a MODIFY n BIGINT NOT NULL",
          *[f"INSERT INTO `{DB}`.ign_a (id, n, c, r2) VALUES ({i}, {i * 1000}, {i}, 'n{i}')"
            for i in range(21, 26)],
          f"UPDATE `{DB}`.ign_a SET c = id, n = n + 1 WHERE id <= 5",
          f"TRUNCATE TABLE `{DB}`.ign_b", f"INSERT INTO `{DB}`.ign_b VALUES (100, 100)",
          f"DROP TABLE `{DB}`.ign_b",
          f"ALTER TABLE `{DB}`.stp_a ADD COLUMN c INT",
          f"INSERT INTO `{DB}`.stp_a (id, n, c) VALUES (21, 21, 21)",
          f"DROP TABLE `{DB}`.stp_b")

    # lenient, each DDL once the one before it is downstream: a DDL capture reads behind a
    # later one of its table comes without metadata, and a rename without it is copied again
    # (DESIGN.md). A type change (a re-copy) comes last, below.
    def on_all(check: Callable[[dict[str, bool]], bool]) -> Callable[[], bool]:
        return lambda: all(check(down.columns(k, "len_a")) for k in down.urls)

    _exec(mariadb, f"ALTER TABLE `{DB}`.len_a ADD COLUMN c INT")
    await asyncio.to_thread(_wait, on_all(lambda c: "c" in c), "lenient: c added", procs)
    _exec(mariadb, f"ALTER TABLE `{DB}`.len_a DROP COLUMN s")
    await asyncio.to_thread(_wait, on_all(lambda c: c.get("s") is True), "lenient: s kept, nullable", procs)
    _exec(mariadb, f"ALTER TABLE `{DB}`.len_a RENAME COLUMN r TO r2")
    await asyncio.to_thread(_wait, on_all(lambda c: "r2" in c), "lenient: r2 beside r", procs)
    _exec(mariadb,
          *[f"INSERT INTO `{DB}`.len_a (id, n, c, r2) VALUES ({i}, {i * 1000}, {i}, 'n{i}')"
            for i in range(21, 26)],
          f"UPDATE `{DB}`.len_a SET c = id, n = n + 1 WHERE id <= 5",
          f"TRUNCATE TABLE `{DB}`.len_b", f"INSERT INTO `{DB}`.len_b VALUES (100, 100)",
          f"DROP TABLE `{DB}`.len_b")

    def kept(i: int, value: str) -> str | None:
        return value if i <= 20 else None

    # lenient: every source column equal to the source's; s and r kept, nullable, with their
    # values in the rows written before the DROP/RENAME (updated rows too), their default in
    # rows inserted since (s: 'x', r: NULL); r2 filled from r in the rows before the rename.
    def lenient_done() -> bool:
        want = _source_rows(mariadb, "len_a", "id, n, c, r2")
        return all(down.rows(k, "len_a", "id, n, c, r2") == want for k in down.urls) \
            if all("r2" in down.columns(k, "len_a") for k in down.urls) else False

    def lenient_diff() -> str:
        want = _source_rows(mariadb, "len_a", "id, n, c, r2")
        out = []
        for k in down.urls:
            have = down.rows(k, "len_a", "id, n, c, r2")
            out.append(f"{k}: columns {down.columns(k, 'len_a')}, downstream only "
                       f"{[r for r in have if r not in want][:6]}, source only "
                       f"{[r for r in want if r not in have][:6]}, span "
                       f"{_span(worker, feeds[('lenient', k)], 'len_a')}")
        return "\n".join(out)

    await asyncio.to_thread(_wait, lenient_done, "lenient: len_a's source columns equal", procs,
                            detail=lenient_diff)
    for kind in down.urls:
        cols = down.columns(kind, "len_a")
        assert {"id", "n", "c", "r2", "s", "r"} <= set(cols), (kind, cols)
        assert cols["s"] and cols["r"], (kind, cols)
        assert down.rows(kind, "len_a", "id, s, r") == [
            (str(i), f"s{i}" if i <= 20 else "x", kept(i, f"r{i}")) for i in range(1, 26)], kind
        assert down.rows(kind, "len_a", "id, r2")[:20] == [(str(i), f"r{i}") for i in range(1, 21)], kind

    # lenient, a DDL that copies the table again (a type change): the target is kept, widened
    # where it must be, and the columns lenient kept keep their values (DESIGN.md).
    _exec(mariadb, f"ALTER TABLE `{DB}`.len_a MODIFY n BIGINT NOT NULL",
          f"INSERT INTO `{DB}`.len_a (id, n, c, r2) VALUES (26, {big}, 26, 'n26')")
    kept_rows = [(str(i), f"s{i}" if i <= 20 else "x", kept(i, f"r{i}")) for i in range(1, 27)]
    # The copy fills the rows first; the kept columns' values go back once it is done.
    await asyncio.to_thread(_wait, lambda: lenient_done() and all(
        ("26", str(big)) in down.rows(k, "len_a", "id, n") and down.rows(k, "len_a", "id, s, r") == kept_rows
        for k in down.urls), "lenient: len_a copied again after MODIFY n BIGINT, s and r kept", procs,
        detail=lambda: lenient_diff() + "\n" + str({k: down.rows(k, "len_a", "id, s, r") for k in down.urls}))
    for kind in down.urls:
        cols = down.columns(kind, "len_a")
        assert {"s", "r"} <= set(cols) and cols["s"] and cols["r"], (kind, cols)
    assert mysql_query(maria_down, "SELECT DATA_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s"
                                   " AND TABLE_NAME = 'len_a' AND COLUMN_NAME = 'n'", (DB,)) == [("bigint",)]
    assert pg_columns(down.urls["pg"], DB, "len_a")["n"][0] == "NO"
    # TRUNCATE and DROP TABLE not applied: the rows before them and the one between stay.
    await asyncio.to_thread(_wait, _b_kept(down, "len_b"), "lenient: len_b's rows stay", procs,
                            detail=lambda: str({k: down.rows(k, "len_b", "id") for k in down.urls}))
    t_lenient = time.monotonic() - t0

    # ignore: the target's definition as it was; rows with the columns it has (s takes its
    # default in new rows, r is NULL there: the source has neither any more).
    def ignore_done() -> bool:
        want = _source_rows(mariadb, "ign_a", "id, n")
        return all(down.rows(k, "ign_a", "id, n") == want for k in down.urls)

    await asyncio.to_thread(_wait, ignore_done, "ignore: ign_a's id and n equal", procs)
    for kind in down.urls:
        assert down.columns(kind, "ign_a") == before[kind], kind
        assert down.rows(kind, "ign_a", "id, s, r") == [
            (str(i), f"s{i}" if i <= 20 else "x", kept(i, f"r{i}")) for i in range(1, 26)], kind
    await asyncio.to_thread(_wait, _b_kept(down, "ign_b"), "ignore: ign_b's rows stay", procs,
                            detail=lambda: str({k: down.rows(k, "ign_b", "id") for k in down.urls}))
    t_ignore = time.monotonic() - t0

    # stop: each table stops at its DDL with an incident; nothing after it is applied.
    def stopped(table: str) -> bool:
        return all((_span(worker, feeds[("stop", k)], table).get("incident") or {}).get("error", "")
                   .startswith(POLICY_STOP_PREFIX) for k in down.urls)

    await asyncio.to_thread(_wait, lambda: stopped("stp_a") and stopped("stp_b"),
                            "stop: stp_a and stp_b stopped by incidents", procs)
    for kind in down.urls:
        assert [r[0] for r in down.rows(kind, "stp_a", "id")] == list(map(str, range(1, 21))), kind
        assert "c" not in down.columns(kind, "stp_a"), kind
        assert len(down.rows(kind, "stp_b", "id")) == 20, kind
    # An operator resumes stp_a: its DDL is applied, the rows after it follow.
    for kind in down.urls:
        incident = _span(worker, feeds[("stop", kind)], "stp_a")["incident"]["incident"]
        await record_table_event(js, TableActionRequestedV1(
            table=TableRefV1(changefeed=feeds[("stop", kind)], source="pol", database=DB, table="stp_a"),
            incident=incident, action="resume", requested_by="test"), "test")
    await asyncio.to_thread(_wait, lambda: all(_converged(mariadb, u, "stp_a") for u in down.urls.values()),
                            "stop: stp_a after its resume", procs)
    assert all("c" in down.columns(k, "stp_a") for k in down.urls)
    # A later DDL stops it again.
    _exec(mariadb, f"ALTER TABLE `{DB}`.stp_a DROP COLUMN c",
          f"INSERT INTO `{DB}`.stp_a (id, n) VALUES (22, 22)")
    await asyncio.to_thread(_wait, lambda: stopped("stp_a"), "stop: stp_a stopped again at its next DDL",
                            procs)
    assert all("22" not in [r[0] for r in down.rows(k, "stp_a", "id")] for k in down.urls)
    t_stop = time.monotonic() - t0

    # ignore, a type changed upstream: a value the target's old type cannot hold stops the
    # table with an incident naming the row (SQLite's columns take any value).
    _exec(mariadb, f"INSERT INTO `{DB}`.ign_a (id, n) VALUES (30, {big})")
    for kind in ("maria", "pg"):
        await asyncio.to_thread(
            _wait, lambda kind=kind: (_span(worker, feeds[("ignore", kind)], "ign_a").get("incident") or {})
            .get("key") == "[30]", f"ignore: {kind} refuses n = 2^40 into INT", procs)
    await asyncio.to_thread(_wait, lambda: ("30", str(big)) in down.rows("sqlite", "ign_a", "id, n"),
                            "ignore: SQLite takes it", procs)
    states = {(s["changefeed"], s["table"]): s["state"] for s in _spans(worker)}
    assert states[(feeds[("lenient", "pg")], "len_a")] == "replicating", states
    print(f"\nphases (s since start): setup {t_setup:.1f}, lenient {t_lenient:.1f}, ignore {t_ignore:.1f}, "
          f"stop {t_stop:.1f}, all {time.monotonic() - t0:.1f}")
