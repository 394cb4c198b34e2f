"""The schema-change policy's pure decisions (``services.sink_worker.ddl.policy``): what each DDL
of the DDL matrix becomes under evolve, lenient, ignore and stop; the columns an ``ignore``
target writes; the ``stop`` incident's resume releasing exactly the DDL it stopped at."""

from __future__ import annotations

import pytest

from contracts.events.changefeeds import ChangefeedSpecV6, SourceRefV1, current_spec
from contracts.events.rows import ColumnV1, DdlExecutedV1, SourcePositionV1, TableMetaV1
from services.sink_worker.ddl.plan import ddl_action
from services.sink_worker.ddl.policy import (
    POLICY_STOP_PREFIX,
    as_target_has,
    column_renames,
    decide,
    recopy_drops,
    removes_columns,
    stop_reason,
)
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.span.machine import SpanMachine, SpanState, unreplicable

_META = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                             ColumnV1(name="n", kind="int", sql_type="int"),
                             ColumnV1(name="s2", kind="string", sql_type="varchar(20)"),
                             ColumnV1(name="c", kind="int", sql_type="int")],
                    primary_key=["id"])

# (statement, evolve's action, lenient, ignore, stop) -- "apply+keep": applied, keeping columns.
_MATRIX = [
    ("ALTER TABLE t ADD COLUMN c INT", "reconcile", "apply+keep", "skip", "stop"),
    ("ALTER TABLE t ADD COLUMN c INT NOT NULL DEFAULT 7", "recopy", "apply", "skip", "stop"),
    ("ALTER TABLE t DROP COLUMN s", "reconcile", "apply+keep", "skip", "stop"),
    ("ALTER TABLE t MODIFY n BIGINT", "recopy", "apply", "skip", "stop"),
    ("ALTER TABLE t CHANGE s s2 VARCHAR(20)", "recopy", "rename", "skip", "stop"),
    ("ALTER TABLE t RENAME COLUMN s TO s2", "recopy", "rename", "skip", "stop"),
    ("ALTER TABLE t CHANGE s s VARCHAR(40)", "recopy", "apply", "skip", "stop"),
    ("ALTER TABLE t CHANGE s s2 VARCHAR(20), ADD COLUMN x INT NOT NULL", "recopy", "apply", "skip", "stop"),
    ("CREATE INDEX ix ON t (n)", "reconcile", "apply+keep", "skip", "stop"),
    ("ALTER TABLE t ADD UNIQUE KEY uk (n)", "recopy", "apply", "skip", "stop"),
    ("TRUNCATE TABLE t", "truncate", "skip", "skip", "stop"),
    ("DROP TABLE t", "drop", "skip", "skip", "stop"),
    ("RENAME TABLE t TO t_old", "leave", "skip", "skip", "stop"),
]


def _ddl(statement: str) -> DdlExecutedV1:
    return DdlExecutedV1(source="s", database="d", table="t", ts=1, seq=1, statement=statement,
                         position=SourcePositionV1(binlog_file="b.000001", binlog_pos=4), meta_after=_META)


def _label(policy: str, statement: str) -> str:
    d = decide(policy, ddl_action(_ddl(statement)), statement)  # type: ignore[arg-type]
    return "apply+keep" if d.do == "apply" and d.keep_columns else d.do


@pytest.mark.parametrize(("statement", "action", "lenient", "ignore", "stop"), _MATRIX)
def test_each_ddl_of_the_matrix_under_each_policy(statement: str, action: str, lenient: str,
                                                  ignore: str, stop: str) -> None:
    assert ddl_action(_ddl(statement)) == action
    evolve = decide("evolve", action, statement)  # type: ignore[arg-type]
    assert (evolve.do, evolve.action, evolve.keep_columns) == ("apply", action, False)
    assert _label("lenient", statement) == lenient
    assert _label("ignore", statement) == ignore
    assert _label("stop", statement) == stop
    released = decide("stop", action, statement, released=True)  # type: ignore[arg-type]
    assert (released.do, released.action) == ("apply", action)


def test_a_lenient_rename_adds_the_new_column_and_keeps_the_old() -> None:
    d = decide("lenient", "recopy", "ALTER TABLE t CHANGE `s` `s2` VARCHAR(20), RENAME COLUMN a TO b")
    assert (d.do, d.action, d.keep_columns, d.renamed) == ("rename", "reconcile", True,
                                                          (("s", "s2"), ("a", "b")))
    # Without the metadata after it the new column's definition is unknown: copied again instead.
    assert decide("lenient", "recopy", "ALTER TABLE t RENAME COLUMN a TO b", has_meta=False).do == "apply"


def test_column_renames_only_for_pure_renames() -> None:
    assert column_renames("ALTER TABLE t RENAME COLUMN `a` TO `b`") == (("a", "b"),)
    assert column_renames("ALTER TABLE t CHANGE COLUMN a b INT NOT NULL") == (("a", "b"),)
    assert column_renames("ALTER TABLE t CHANGE a a BIGINT") is None
    assert column_renames("ALTER TABLE t RENAME COLUMN a TO b, DROP COLUMN c") is None
    assert column_renames("ALTER TABLE t RENAME TO u") is None
    assert column_renames("DROP TABLE t") is None


def test_a_recopy_drops_the_columns_the_source_had_after_its_ddl() -> None:
    # The DDL's own drop and rename, and every column the source had right after it: a later
    # DDL the copy jumps over (CHANGE s2 s3) leaves s2 in neither the source nor the target.
    with_meta = _ddl("ALTER TABLE t CHANGE s s2 VARCHAR(20), DROP COLUMN z")
    assert recopy_drops(with_meta) == ("z", "s", "id", "n", "s2", "c")
    # Without metadata (capture read the table behind a later DDL): the statement's own.
    bare = _ddl("ALTER TABLE t RENAME COLUMN a TO b").model_copy(update={"meta_after": None})
    assert recopy_drops(bare) == ("a",)
    assert recopy_drops(_ddl("ALTER TABLE t MODIFY n BIGINT")) == ("id", "n", "s2", "c")


def test_removes_columns() -> None:
    assert removes_columns("ALTER TABLE t DROP COLUMN s")
    assert removes_columns("ALTER TABLE t ADD COLUMN c INT, DROP s")
    assert not removes_columns("ALTER TABLE t DROP INDEX ix")
    assert not removes_columns("ALTER TABLE t ADD COLUMN c INT")


def test_a_ddl_that_changes_nothing_of_the_table_does_not_stop_it() -> None:
    assert decide("stop", "ignore", "RENAME TABLE a TO b, b TO a").do == "skip"
    assert decide("stop", "reconcile", "CREATE TABLE t (id INT PRIMARY KEY)").do == "apply"
    assert decide("stop", "recopy", "CREATE OR REPLACE TABLE t (id INT PRIMARY KEY)").do == "stop"


def test_ignore_writes_the_columns_the_target_has() -> None:
    meta = TableMetaV1(columns=[*_META.columns, ColumnV1(name="added", kind="int", sql_type="int")],
                       primary_key=["id"], unique_keys=[["added"], ["n"]])
    table = TargetTable(schema="d", name="t", meta=meta, key=("id",), unique_keys=(("added",), ("n",)))
    fixed = as_target_has(table, ["ID", "n", "s", "gone"])  # MySQL/SQLite: names without case
    assert [c.name for c in fixed.meta.columns] == ["id", "n"]  # s2, c, added: not downstream
    assert fixed.meta.unique_keys == [["n"]] and fixed.unique_keys == (("n",),)
    assert fixed.leave_out_columns and fixed.key == ("id",)


def test_resuming_a_stop_incident_releases_the_ddl_it_stopped_at_and_no_later_one() -> None:
    machine = SpanMachine(state=SpanState.REPLICATING)
    assert not machine.ddl_released(ts=50, stream_seq=9)
    stopped = machine._stop(unreplicable(stop_reason("ALTER TABLE t DROP COLUMN s", 50), 49))
    assert stopped.incident is not None and stopped.incident.failure.error.startswith(POLICY_STOP_PREFIX)
    assert machine.operator_action(stopped.incident.id, "resume") is not None
    assert machine.ddl_released(ts=50, stream_seq=9)
    assert machine.ddl_released(ts=50, stream_seq=9), "a round meeting it again still may apply it"
    assert not machine.ddl_released(ts=60, stream_seq=12), "the next DDL stops again"


def test_resuming_another_incident_releases_no_ddl() -> None:
    machine = SpanMachine(state=SpanState.REPLICATING)
    stopped = machine._stop(unreplicable("no usable key", 49))
    assert stopped.incident is not None
    machine.operator_action(stopped.incident.id, "resume")
    assert not machine.ddl_released(ts=50, stream_seq=9)


def test_an_older_spec_evolves() -> None:
    v6 = ChangefeedSpecV6(id="cf", sources=[SourceRefV1(id="s", url="mysql://u@h/")], sink_url="sqlite:///x.db")
    assert current_spec(v6).schema_change_policy == "evolve"


def test_the_api_refuses_a_bad_policy_and_a_policy_the_nats_sink_cannot_follow() -> None:
    from pydantic import ValidationError

    from services.api.source_refs import ChangefeedSpecIn
    from services.api.validation import spec_problems

    body = {"id": "cf", "sources": [{"id": "s", "url": "mysql://u@h/"}], "sink_url": "sqlite:///x.db"}
    with pytest.raises(ValidationError) as refused:
        ChangefeedSpecIn.model_validate({**body, "schema_change_policy": "drop_everything"})
    assert "schema_change_policy" in str(refused.value) and "'lenient'" in str(refused.value)
    ok = current_spec(ChangefeedSpecIn.model_validate({**body, "schema_change_policy": "ignore"}))
    assert not [p for p in spec_problems(ok) if "schema_change_policy" in p["loc"]]
    nats = ok.model_copy(update={"sink_url": "nats://127.0.0.1:4222/OUT?subject=out"})
    [problem] = [p for p in spec_problems(nats) if "schema_change_policy" in p["loc"]]
    assert "SQL downstreams" in problem["msg"]


def test_changefeed_get_shows_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import render

    render.changefeed({"id": "cf", "state": "running", "tables": 1,
                       "spec": {"id": "cf", "schema_change_policy": "stop"}})
    out = capsys.readouterr().out
    assert "schema changes: stop (a DDL stops its table with an incident until resumed)" in out
    render.changefeed({"id": "cf", "state": "running", "tables": 1, "spec": {"id": "cf"}})
    assert "schema changes: evolve" in capsys.readouterr().out
