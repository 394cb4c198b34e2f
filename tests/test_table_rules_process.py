"""Table rules end to end with real processes: MariaDB binlog -> capture -> sink-worker (Spark)
-> SQLite, PostgreSQL and MariaDB, one changefeed each, in one run. Event filters by type and by
Spark SQL expression, dropped and kept columns and a computed column, all at once; the rows an
ignored delete keeps stay downstream across later rounds and a killed, restarted sink-worker."""

from __future__ import annotations

import asyncio
import sqlite3
from decimal import Decimal
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from contracts.events.changefeeds import (
    ChangefeedSpecV4,
    ComputedColumnV1,
    SourceRefV1,
    TableFilterV1,
    TableRuleV1,
)
from contracts.events.rows import ColumnV1, TableMetaV1
from libs.changefeeds import record_changefeed
from libs.dburl import parse_database_url
from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from tests.helpers.e2e import (  # noqa: F401 - fixtures
    _capture,
    _created,
    _delete_changefeeds_afterwards,
    _worker,
    downstream_mariadb,
)

DB = "rules_e2e"
RULES = [
    TableRuleV1(tables=[f"{DB}.users"], ignore_insert_value_expr="status = 'test'",
                ignore_update_new_value_expr="amount > 1000",
                ignore_delete_value_expr="status = 'archived'", drop_columns=["card"],
                computed=[ComputedColumnV1(name="email_masked", expr=(
                    "concat(left(email, 1), '***@', substring_index(email, '@', -1))"))]),
    TableRuleV1(tables=[f"{DB}.audit"], ignore_events=["delete", "truncate"]),
    TableRuleV1(tables=[f"{DB}.notes"], keep_columns=["id", "body"]),
]


def _col(name: str, kind: str, sql_type: str) -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type)  # type: ignore[arg-type]


# The targets as the rules make them (what the checks read back).
USERS = TableMetaV1(columns=[_col("id", "int", "int"), _col("email", "string", "varchar(64)"),
                             _col("status", "string", "varchar(16)"),
                             _col("amount", "decimal", "decimal(8,2)"),
                             _col("email_masked", "string", "text")], primary_key=["id"])
AUDIT = TableMetaV1(columns=[_col("id", "int", "int"), _col("what", "string", "varchar(32)")],
                    primary_key=["id"])
NOTES = TableMetaV1(columns=[_col("id", "int", "int"), _col("body", "string", "varchar(64)")],
                    primary_key=["id"])


def _rows(url: str, table: str, meta: TableMetaV1) -> list[dict[str, Any]]:
    try:
        return open_sink(url).fetch_rows(TargetTable(schema=DB, name=table, meta=meta, key=("id",)))
    except Exception:
        return []  # the target appears with its first batch


def _columns(url: str, table: str, pg: PostgreSQL, down: MariaDB) -> list[str]:
    dialect = parse_database_url(url).dialect
    if dialect == "sqlite":
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    sql = ("SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
           "ORDER BY ordinal_position")
    conn: Any = pg.connect() if dialect == "postgresql" else down.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(sql, (DB, table))
            return [str(r[0]) for r in cur.fetchall()]
    finally:
        conn.close()


def _user(id_: int, email: str, status: str, amount: str) -> dict[str, Any]:
    name, domain = email.split("@")
    return {"id": id_, "email": email, "status": status, "amount": Decimal(amount),
            "email_masked": f"{name[0]}***@{domain}"}


def _wait(sinks: list[str], want: dict[str, list[dict[str, Any]]], procs: list[ServiceProcess],
          what: str) -> None:
    metas = {"users": USERS, "audit": AUDIT, "notes": NOTES}

    def landed() -> bool:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        return all(_rows(url, t, metas[t]) == rows for url in sinks for t, rows in want.items())

    try:
        wait_until(landed, 120, what, interval=0.5)
    except Exception:
        got = {url: {t: _rows(url, t, metas[t]) for t in want} for url in sinks}
        logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(15)}" for p in procs)
        raise AssertionError(f"{what}: want {want}\ngot {got}\n{logs}") from None


async def test_filters_and_column_rules_on_three_downstreams_across_a_restart(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],  # noqa: F811
) -> None:
    conn = mariadb.connect()
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {DB}")
        cur.execute(f"CREATE DATABASE {DB}")
        cur.execute(f"CREATE TABLE {DB}.users (id int PRIMARY KEY, email varchar(64), status varchar(16), "
                    "card varchar(20), amount decimal(8,2))")
        cur.execute(f"CREATE TABLE {DB}.audit (id int PRIMARY KEY, what varchar(32))")
        cur.execute(f"CREATE TABLE {DB}.notes (id int PRIMARY KEY, body varchar(64), secret varchar(64))")
    conn.commit()
    sinks = [f"sqlite:///{tmp_path / 'down.db'}", postgres.url, downstream_mariadb.url]
    logs = tmp_path / "logs"
    processes.append(_capture(service_env, logs, mariadb, "rules", DB))
    processes[-1].wait_healthy(60)
    for i, url in enumerate(sinks):
        spec = ChangefeedSpecV4(id=f"rules-{i}", sources=[SourceRefV1(id="rules", url=mariadb.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                                initial_load="binlog-only", table_rules=RULES)
        await record_changefeed(js, spec, requested_by="test")
        _created.append(spec.id)
    processes.append(_worker(service_env, logs, "worker-rules-1"))
    processes[-1].wait_healthy(60)

    def run(*statements: str) -> None:
        with conn.cursor() as cur:
            for sql in statements:
                cur.execute(sql)
        conn.commit()

    await asyncio.to_thread(
        run,
        f"INSERT INTO {DB}.users VALUES (1, 'ann@x.org', 'live', '4111-1', 10), (2, 'bob@y.org', 'test', "
        "'4111-2', 20), (3, 'cy@z.org', 'live', '4111-3', 30), (4, 'di@z.org', 'archived', '4111-4', 40)",
        f"UPDATE {DB}.users SET amount = 5000 WHERE id = 3",  # ignored: new amount > 1000
        f"UPDATE {DB}.users SET status = 'gold', amount = 7.5 WHERE id = 1",
        f"DELETE FROM {DB}.users WHERE id = 4",  # ignored: archived
        f"INSERT INTO {DB}.audit VALUES (1, 'login'), (2, 'logout'), (3, 'login')",
        f"DELETE FROM {DB}.audit WHERE id = 1",  # ignored: deletes
        f"INSERT INTO {DB}.notes VALUES (1, 'hello', 'pin 1234'), (2, 'bye', 'pin 5678')",
        f"UPDATE {DB}.notes SET secret = 'pin 0000', body = 'hi' WHERE id = 1")
    users = [_user(1, "ann@x.org", "gold", "7.50"), _user(3, "cy@z.org", "live", "30.00"),
             _user(4, "di@z.org", "archived", "40.00")]
    audit = [{"id": 1, "what": "login"}, {"id": 2, "what": "logout"}, {"id": 3, "what": "login"}]
    notes = [{"id": 1, "body": "hi"}, {"id": 2, "body": "bye"}]
    await asyncio.to_thread(_wait, sinks, {"users": users, "audit": audit, "notes": notes}, processes,
                            "the first changes, filtered, on the three downstreams")
    for url in sinks:
        assert _columns(url, "users", postgres, downstream_mariadb) == [c.name for c in USERS.columns], url
        assert _columns(url, "notes", postgres, downstream_mariadb) == ["id", "body"], url

    # A TRUNCATE the rules ignore, then the worker dies and a new one takes its spans over from
    # their checkpoints: the rows the ignored delete and truncate kept stay, new changes land.
    await asyncio.to_thread(run, f"TRUNCATE TABLE {DB}.audit")
    processes[-1].kill()
    await asyncio.to_thread(
        run,
        f"INSERT INTO {DB}.audit VALUES (4, 'restart')",
        f"UPDATE {DB}.users SET email = 'cyril@z.org', amount = 30 WHERE id = 3",
        f"DELETE FROM {DB}.users WHERE id = 1",  # a live row: its delete applies
        f"INSERT INTO {DB}.users VALUES (5, 'ed@q.org', 'test', '4111-5', 1)",  # ignored
        f"UPDATE {DB}.users SET status = 'archived' WHERE id = 3",
        f"DELETE FROM {DB}.users WHERE id = 3")  # ignored: archived by then
    processes.append(_worker(service_env, logs, "worker-rules-2"))
    processes[-1].wait_healthy(60)
    users = [_user(3, "cyril@z.org", "archived", "30.00"), _user(4, "di@z.org", "archived", "40.00")]
    audit = [*audit, {"id": 4, "what": "restart"}]
    await asyncio.to_thread(_wait, sinks, {"users": users, "audit": audit, "notes": notes},
                            [processes[0], processes[-1]],
                            "the changes after a restart, filtered, with the ignored deletes' rows kept")

