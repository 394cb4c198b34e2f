"""The single-shard DDL decision (``services.sink_worker.ddl.plan``): pure, from the event."""

from __future__ import annotations

import pytest

from contracts.events.rows import ColumnV1, DdlExecutedV1, SourcePositionV1, TableMetaV1
from services.sink_worker.ddl.plan import ddl_action, rename_role

_META = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                             ColumnV1(name="note", kind="string", sql_type="varchar(10)"),
                             ColumnV1(name="req", kind="int", sql_type="int", nullable=False)],
                    primary_key=["id"])


def _ddl(statement: str, table: str = "t", meta: TableMetaV1 | None = _META) -> DdlExecutedV1:
    return DdlExecutedV1(source="s", database="db", table=table, ts=1, seq=1, statement=statement,
                         position=SourcePositionV1(binlog_file="b.000001", binlog_pos=4), meta_after=meta)


@pytest.mark.parametrize("statement, action", [
    ("ALTER TABLE t ADD COLUMN note varchar(10)", "reconcile"),
    ("ALTER TABLE t ADD COLUMN note varchar(10) NULL DEFAULT NULL AFTER id", "reconcile"),
    ("ALTER TABLE t DROP COLUMN old", "reconcile"),
    ("ALTER TABLE t ADD INDEX ix (note), ALGORITHM=INPLACE, LOCK=NONE", "reconcile"),
    ("ALTER TABLE t ALTER COLUMN note SET DEFAULT 'x'", "reconcile"),
    ("CREATE INDEX ix ON t (note)", "reconcile"),
    ("CREATE TABLE t LIKE other", "reconcile"),
    ("/* gh-ost */ ALTER TABLE `db`.`t` COMMENT='x'", "reconcile"),
    ("ALTER TABLE t ADD COLUMN note varchar(10) DEFAULT 'n/a'", "recopy"),
    ("ALTER TABLE t ADD COLUMN req int NOT NULL", "recopy"),
    ("ALTER TABLE t ADD COLUMN req int", "recopy"),  # the server made it NOT NULL (meta_after)
    ("ALTER TABLE t ADD COLUMN at datetime DEFAULT CURRENT_TIMESTAMP FIRST", "recopy"),
    ("ALTER TABLE t ADD COLUMN u char(36) DEFAULT (uuid())", "recopy"),
    ("ALTER TABLE t MODIFY note varchar(200)", "recopy"),
    ("ALTER TABLE t CHANGE note remark text", "recopy"),
    ("ALTER TABLE t RENAME COLUMN note TO remark", "recopy"),
    ("ALTER TABLE t MODIFY note varchar(10) CHARACTER SET latin1 COLLATE latin1_swedish_ci", "recopy"),
    ("ALTER TABLE t CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci", "recopy"),
    ("ALTER TABLE t ADD UNIQUE KEY uk (note)", "recopy"),
    ("ALTER TABLE t DROP INDEX uk", "recopy"),
    ("ALTER TABLE t DROP PRIMARY KEY, ADD PRIMARY KEY (id, note)", "recopy"),
    ("CREATE UNIQUE INDEX uk ON t (note)", "recopy"),
    ("DROP INDEX uk ON t", "recopy"),
    ("CREATE OR REPLACE TABLE t (id int primary key)", "recopy"),
    ("ALTER TABLE t PARTITION BY HASH(id) PARTITIONS 4", "recopy"),
    ("DROP TABLE t", "drop"),
    ("TRUNCATE TABLE t", "truncate"),
])
def test_alter_clauses_decide_between_reconcile_and_recopy(statement: str, action: str) -> None:
    assert ddl_action(_ddl(statement)) == action


@pytest.mark.parametrize("statement, table, role, action", [
    # gh-ost: the original goes to _t_del, the ghost takes its name.
    ("RENAME TABLE `db`.`t` TO `db`.`_t_del`, `db`.`_t_gho` TO `db`.`t`", "t", "replaced", "recopy"),
    ("RENAME TABLE `db`.`t` TO `db`.`_t_del`, `db`.`_t_gho` TO `db`.`t`", "_t_del", "replaced", "recopy"),
    ("RENAME TABLE `db`.`t` TO `db`.`_t_del`, `db`.`_t_gho` TO `db`.`t`", "_t_gho", "renamed_away", "leave"),
    # pt-osc, unqualified names.
    ("RENAME TABLE t TO _t_old, _t_new TO t", "_t_new", "renamed_away", "leave"),
    ("RENAME TABLE t TO u", "t", "renamed_away", "leave"),
    ("RENAME TABLE t TO u", "u", "replaced", "recopy"),
    ("ALTER TABLE t ADD COLUMN x int, RENAME TO u", "t", "renamed_away", "leave"),
    ("ALTER TABLE t RENAME TO u", "u", "replaced", "recopy"),
    # A round trip leaves the name where it was.
    ("RENAME TABLE t TO tmp, tmp TO t", "t", "unchanged", "ignore"),
    ("RENAME TABLE a TO tmp, b TO a, tmp TO b", "a", "replaced", "recopy"),
])
def test_renames_decide_by_what_holds_the_name_afterwards(statement: str, table: str, role: str,
                                                          action: str) -> None:
    ddl = _ddl(statement, table)
    assert rename_role(ddl) == role
    assert ddl_action(ddl) == action


def test_statements_that_rename_nothing_have_no_rename_role() -> None:
    assert rename_role(_ddl("ALTER TABLE t ADD COLUMN x int")) is None
    assert rename_role(_ddl("ALTER TABLE t RENAME COLUMN a TO b")) is None
    assert rename_role(_ddl("ALTER TABLE t RENAME INDEX a TO b")) is None


def test_index_ddl_without_metadata_waits_for_the_rows_that_follow() -> None:
    # Capture read the table behind a later DDL: no metadata to bring the index from; the next
    # rows' metadata carries the table's shape, and their batch brings the index.
    for statement in ("CREATE INDEX ix ON t (note)", "ALTER TABLE t ADD KEY ix (note)",
                      "ALTER TABLE t RENAME INDEX a TO b"):
        assert ddl_action(_ddl(statement, meta=None)) == "ignore", statement
