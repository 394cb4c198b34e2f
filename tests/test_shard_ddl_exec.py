"""The owner's exec of a shard DDL on a real MariaDB target: the rewritten statement runs, a
re-run after a crash between executing and reporting done counts as done, and a failure re-run
detection cannot explain fails the exec (for an operator) instead of being guessed away."""

from __future__ import annotations

import pytest

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.localservers.mariadb import MariaDB
from services.sink_worker.ddl.shard import execute_on_target
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink

pytestmark = pytest.mark.integration


def _table(schema: str, *extra: ColumnV1) -> TargetTable:
    meta = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="bigint", nullable=False),
                                ColumnV1(name="v", kind="int", sql_type="int", nullable=True), *extra],
                       primary_key=["id"])
    return TargetTable(schema=schema, name="orders", meta=meta, key=("id",))


def test_exec_runs_the_text_and_counts_a_rerun_as_done(mariadb: MariaDB) -> None:
    schema = "shard_exec_a"
    with mariadb.connect() as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{schema}`")
    sink = open_sink(mariadb.url)
    sink.ensure_table(_table(schema))
    note = ColumnV1(name="note", kind="string", sql_type="varchar(20)", nullable=True)
    after = _table(schema, note)
    ddls = [f"ALTER TABLE `{schema}`.`orders` ADD COLUMN note varchar(20) NULL",
            f"ALTER TABLE `{schema}`.`orders` ADD INDEX ix_v (v)"]
    assert execute_on_target(sink, after, ddls) == []
    # The owner crashed before its done: the new owner executes again.
    assert execute_on_target(sink, after, ddls) == ddls
    with mariadb.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA=%s "
                    "AND TABLE_NAME='orders' ORDER BY ORDINAL_POSITION", (schema,))
        assert [r[0] for r in cur.fetchall()] == ["id", "v", "note"]
        cur.execute("SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA=%s "
                    "AND TABLE_NAME='orders' ORDER BY INDEX_NAME", (schema,))
        assert sorted(r[0] for r in cur.fetchall()) == ["PRIMARY", "ix_v"]  # the text path keeps the index


def test_exec_failure_that_is_not_a_rerun_is_raised(mariadb: MariaDB) -> None:
    schema = "shard_exec_b"
    with mariadb.connect() as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{schema}`")
    sink = open_sink(mariadb.url)
    sink.ensure_table(_table(schema))
    # Same column name with another type: not "already applied"; never guessed as done.
    with mariadb.connect() as conn, conn.cursor() as cur:
        cur.execute(f"ALTER TABLE `{schema}`.`orders` ADD COLUMN note int NULL")
    with pytest.raises(RuntimeError, match="re-run check"):
        execute_on_target(sink, _table(schema),
                          [f"ALTER TABLE `{schema}`.`orders` ADD COLUMN note varchar(20)"])
