"""The downstream's ``sluice_syncpoint`` table: one row per (changefeed, T) once every span of
the changefeed applied exactly up to T (``libs.syncpoints``).

The row is written once per T: the insert leaves an existing row alone and the commit time read
back is the first one, so a leader that writes it again after a crash or a leader change records
the same row. Where it lives: MySQL/MariaDB, the URL's database, else a database ``sluice``
created on first use; PostgreSQL, the connection's search path (``public`` by default); SQLite,
the main database.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from libs.syncpoints import SYNCPOINT_TABLE
from libs.ts import utc_text
from services.sink_worker.sinks.sql_common import SqlSink

_DEFAULT_MYSQL_DB = "sluice"


def syncpoint_table_ref(sink: SqlSink) -> str:
    if sink.dialect == "mysql":
        return f"{sink.ident(sink.db.database or _DEFAULT_MYSQL_DB)}.{sink.ident(SYNCPOINT_TABLE)}"
    return sink.ident(SYNCPOINT_TABLE)


def write_syncpoint(sink: SqlSink, changefeed: str, ts: int, now: datetime | None = None) -> str:
    """Write the row of ``(changefeed, ts)`` unless it is there; its commit time (ISO 8601, UTC)."""
    table = syncpoint_table_ref(sink)
    p = sink.placeholder
    commit_time = (now or datetime.now(UTC)).isoformat(timespec="microseconds")
    create = (f"CREATE TABLE IF NOT EXISTS {table} (changefeed VARCHAR(255) NOT NULL, "
              "syncpoint_ts BIGINT NOT NULL, upstream_time VARCHAR(40) NOT NULL, "
              "commit_time VARCHAR(40) NOT NULL, PRIMARY KEY (changefeed, syncpoint_ts))")
    insert = sink.insert_absent_sql(table, ("changefeed", "syncpoint_ts", "upstream_time", "commit_time"),
                                    ("changefeed", "syncpoint_ts"))
    select = f"SELECT commit_time FROM {table} WHERE changefeed = {p} AND syncpoint_ts = {p}"

    if sink.dialect == "mysql" and not sink.db.database:
        sink._run(lambda cur: cur.execute(f"CREATE DATABASE IF NOT EXISTS {sink.ident(_DEFAULT_MYSQL_DB)}"),
                  "create the syncpoint database")
    sink._run(lambda cur: cur.execute(create), "create the syncpoint table")

    def work(cur: Any) -> str:
        cur.execute(insert, (changefeed, ts, utc_text(ts), commit_time))
        cur.execute(select, (changefeed, ts))
        return str(cur.fetchone()[0])

    return sink._run(work, "write a syncpoint")
