"""Table rules (event filters, column selection, computed columns): the spec checks as plain
logic, and the rules in the data path in process (real Spark, NATS and SQLite): expressions
evaluated by Spark, an ignored delete keeping its row, dropped columns never written."""

from __future__ import annotations

import json
import sqlite3
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts import REGISTRY
from contracts.events.changefeeds import (
    ChangefeedCreatedV5,
    ChangefeedSpecV4,
    ComputedColumnV1,
    SourceRefV1,
    TableRuleV1,
)
from contracts.events.rows import ColumnV1, RowImageV2, TableMetaV1
from libs.codec.table_meta import load_table_info
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.routing import Router, TableRef, validate_spec
from libs.scheduling.model import Span
from libs.table_rules import TableRulesError, expression_problem, rules_for
from services.sink_worker.round.row_rules import analyse
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.snapshot.job import CopyJob, copy_chunk
from services.sink_worker.snapshot.plan import Chunk
from services.sink_worker.span.runtime import SpanConfig
from services.sink_worker.span.target import target_for
from tests import test_sort_apply as data_path
from tests.helpers.harness import Harness, fetch_rows
from tests.helpers.nats_sink import read_stream

rows_js = data_path.rows_js
checkpoints = data_path.checkpoints


def _col(name: str, kind: str = "int", sql_type: str = "int(11)") -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type, nullable=name != "id")


USERS = TableMetaV1(columns=[_col("id"), _col("email", "string", "varchar(64)"),
                             _col("status", "string", "varchar(16)"), _col("card", "string", "varchar(20)"),
                             _col("amount", "decimal", "decimal(8,2)")],
                    primary_key=["id"], unique_keys=[["card"]])
MASK = "concat(left(email, 1), '***@', substring_index(email, '@', -1))"
RULE = TableRuleV1(
    tables=["shop.users"],
    ignore_insert_value_expr="status = 'test'",
    ignore_update_new_value_expr="amount > 1000",
    ignore_delete_value_expr="status = 'archived'",
    drop_columns=["card"],
    computed=[ComputedColumnV1(name="email_masked", expr=MASK)])


def _spec(*rules: TableRuleV1, **kw: Any) -> ChangefeedSpecV4:
    return ChangefeedSpecV4(id="cf", sources=[SourceRefV1(id="s1", url="mysql://u@h/")],
                            sink_url="sqlite:///x.db", table_rules=list(rules),
                            initial_load=kw.pop("initial_load", "binlog-only"), **kw)


# -- plain logic ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("expr", "why"), [
    ("status = 'archived", "unterminated string"),
    ("status = ", "ends with an operator"),
    ("(a = 1", "unbalanced"),
    ("a = 1)", "unbalanced"),
    ("status archived", "follows an operand"),
    ("= 1", "no left operand"),
    ("select 1", "not a statement"),
    ("a = `b", "unterminated quoted name"),
    ("tags[0 = 1", "not closed"),
])
def test_an_expression_that_does_not_parse_is_named_with_the_reason(expr: str, why: str) -> None:
    problem = expression_problem(expr)
    assert problem is not None and why in problem


@pytest.mark.parametrize("expr", [
    "status = 'archived'", "x IS NOT NULL AND y IN (1, 2)", "CAST(x AS string) = '1'",
    "CASE WHEN a > 1 THEN 1 ELSE 0 END = 1", "count(*) > 1", MASK, "ts > now() - INTERVAL 1 DAY",
    "-x > 1 OR NOT (y = 'it''s')", "`odd name` <=> 2", "amount BETWEEN 1 AND 2",
    "created > DATE '2026-01-01'", "tags[0] = 'a'", "exists(items, x -> x > 1)",
    "status IN ('a', 'b') AND note IS NOT DISTINCT FROM NULL", "ts > now() - INTERVAL '1' DAY",
])
def test_spark_sql_expressions_parse(expr: str) -> None:
    assert expression_problem(expr) is None


def test_validate_spec_refuses_bad_expressions_and_dropped_keys() -> None:
    bad = TableRuleV1(tables=["shop.*"], ignore_delete_value_expr="status = 'x",
                      computed=[ComputedColumnV1(name="m", expr="concat(email,")])
    texts = [p.message for p in validate_spec(_spec(bad))]
    assert any("ignore_delete_value_expr" in t and "unterminated string" in t for t in texts), texts
    assert any("computed column m" in t for t in texts), texts
    keyless = TableRuleV1(tables=["shop.users"], drop_columns=["id", "nope"])
    texts = [p.message for p in validate_spec(_spec(keyless), {TableRef("s1", "shop", "users"): USERS})]
    assert any("nope" in t for t in texts), texts
    texts = [p.message for p in validate_spec(_spec(TableRuleV1(tables=["shop.users"], drop_columns=["id"])),
                                               {TableRef("s1", "shop", "users"): USERS})]
    assert any("key column(s) id cannot be dropped" in t for t in texts), texts
    assert validate_spec(_spec(RULE), {TableRef("s1", "shop", "users"): USERS}) == []
    texts = [p.message for p in validate_spec(_spec(RULE, initial_load="snapshot"))]
    assert any("computed columns need initial_load binlog-only" in t for t in texts), texts


def test_rules_combine_and_rewrite_the_target_meta() -> None:
    other = TableRuleV1(tables=["shop.*"], ignore_events=["delete", "truncate"],
                        ignore_delete_value_expr="amount < 0")
    rules = rules_for([RULE, other], "shop", "users")
    assert rules.ignores("delete") and rules.ignores("truncate") and not rules.ignores("insert")
    assert rules.delete_expr == "(status = 'archived') OR (amount < 0)"
    meta = rules.rewrite_meta(USERS)
    assert [c.name for c in meta.columns] == ["id", "email", "status", "amount", "email_masked"]
    assert meta.unique_keys == []  # the unique key on a dropped column goes with it
    assert rules_for([RULE], "shop", "orders").rewrite_meta(USERS) == USERS
    keep = TableRuleV1(tables=["shop.users"], keep_columns=["email"])
    with pytest.raises(TableRulesError, match="key column"):
        rules_for([keep], "shop", "users").rewrite_meta(USERS)
    with pytest.raises(TableRulesError, match="two table rules set keep_columns"):
        rules_for([keep, keep], "shop", "users")


def test_v3_changefeed_events_upcast_to_v4_without_rules() -> None:
    raw = json.dumps({"type": "changefeed.created", "version": 3, "id": "x", "time": "2026-01-01T00:00:00Z",
                      "producer": "t", "epoch": 0,
                      "data": {"spec": _spec().model_dump(mode="json", exclude={"table_rules"})}})
    event = REGISTRY.decode(raw.encode()).event
    assert isinstance(event, ChangefeedCreatedV5) and event.spec.table_rules == []


# -- Spark ---------------------------------------------------------------------------------------

@pytest.mark.integration
def test_spark_analysis_refuses_unknown_columns_and_non_conditions(spark: SparkSession) -> None:
    assert analyse(spark, USERS, rules_for([RULE], "shop", "users")) is None
    unknown = TableRuleV1(tables=["*.*"], ignore_delete_value_expr="stauts = 'archived'")
    problem = analyse(spark, USERS, rules_for([unknown], "shop", "users"))
    assert problem is not None and "ignore_delete_value_expr" in problem and "stauts" in problem
    not_bool = TableRuleV1(tables=["*.*"], ignore_insert_value_expr="amount + 1")
    problem = analyse(spark, USERS, rules_for([not_bool], "shop", "users"))
    assert problem is not None and "not a condition" in problem


def _user(id_: int, email: str, status: str, amount: str = "1.00", card: str | None = None) -> dict[str, Any]:
    return {"id": id_, "email": email, "status": status, "card": card or f"4111-{id_}", "amount": amount}


def _expected(id_: int, email: str, status: str, amount: str) -> dict[str, Any]:
    user, domain = email.split("@")
    return {"id": id_, "email": email, "status": status, "amount": Decimal(amount),
            "email_masked": f"{user[0]}***@{domain}"}


@pytest.mark.integration
async def test_rules_in_the_round_on_sqlite_and_the_nats_sink(
        rows_js: JetStreamContext, checkpoints: Any, spark: SparkSession, tmp_path: Any,
        nats_server: NatsServer) -> None:
    sqlite_url = f"sqlite:///{tmp_path / 'down.db'}"
    stream = f"OUT_{uuid4().hex[:8].upper()}"
    typed = TableRuleV1(tables=["shop.typed"], ignore_events=["delete", "truncate"])
    router = Router(table_rules=[RULE, typed])
    h = Harness(rows_js, checkpoints, spark, sqlite_url)
    nats_h = Harness(rows_js, checkpoints, spark, f"{nats_server.url}/{stream}?subject=out.{stream.lower()}")
    nats_h.source = h.source  # the same captured changes, a second changefeed to the NATS sink
    for harness in (h, nats_h):
        cfg = SpanConfig(sink_url=harness.sink_url, router=router)
        await harness.pipeline.set_spans({harness.span("users"): cfg, harness.span("typed"): cfg})
    src = h.source
    await src.txn("shop", "users", [
        RowImageV2(op="insert", after=_user(1, "ann@x.org", "live")),
        RowImageV2(op="insert", after=_user(2, "bob@y.org", "test")),  # ignored insert
        RowImageV2(op="insert", after=_user(3, "cy@z.org", "live")),
        RowImageV2(op="insert", after=_user(4, "di@z.org", "archived")),
    ], meta=USERS)
    await src.txn("shop", "users", [
        RowImageV2(op="update", before=_user(3, "cy@z.org", "live"),
                   after=_user(3, "cy@z.org", "live", "5000.00")),  # ignored: new amount > 1000
        RowImageV2(op="update", before=_user(1, "ann@x.org", "live"),
                   after=_user(1, "ann@x.org", "gold", "7.50")),
        RowImageV2(op="delete", before=_user(4, "di@z.org", "archived")),  # ignored: stays
        RowImageV2(op="insert", after=_user(5, "ed@q.org", "live")),
    ], meta=USERS)
    await src.txn("shop", "users", [RowImageV2(op="delete", before=_user(5, "ed@q.org", "live"))], meta=USERS)
    await src.txn("shop", "typed", [data_path.ins(1, "x", 1), data_path.ins(2, "y", 2)])
    await src.txn("shop", "typed", [data_path.dele(1, "x", 1)])  # deletes ignored by type
    await src.ddl("shop", "typed", "TRUNCATE TABLE typed", data_path.PEOPLE)  # ignored too
    await src.txn("shop", "typed", [data_path.ins(3, "z", 3)])
    await src.resolve()
    meta = rules_for([RULE], "shop", "users").rewrite_meta(USERS)

    async def landed() -> bool:
        return (len(fetch_rows(sqlite_url, "shop", "users", meta)) == 3
                and len(fetch_rows(sqlite_url, "shop", "typed", data_path.PEOPLE)) == 3)
    await h.rounds_until(landed)
    assert fetch_rows(sqlite_url, "shop", "users", meta) == [
        _expected(1, "ann@x.org", "gold", "7.50"), _expected(3, "cy@z.org", "live", "1.00"),
        _expected(4, "di@z.org", "archived", "1.00")]
    assert [r["id"] for r in fetch_rows(sqlite_url, "shop", "typed", data_path.PEOPLE)] == [1, 2, 3]

    async def published() -> bool:
        try:
            return len(await read_stream(rows_js, stream)) >= 9
        except Exception:
            return False
    await nats_h.rounds_until(published)
    published = await read_stream(rows_js, stream)
    assert not [subject for subject, _headers, _data in published if subject.endswith(".ddl")]
    messages = [json.loads(data) for _subject, _headers, data in published]
    users = [(m["data"]["op"], m["data"]["row"], m["data"]["after"] or m["data"]["before"])
             for m in messages if m["data"]["table"] == "users"]
    assert [(op, row, image["id"]) for op, row, image in users] == [
        ("insert", 0, 1), ("insert", 2, 3), ("insert", 3, 4), ("update", 1, 1), ("insert", 3, 5),
        ("delete", 0, 5)]
    assert all("card" not in image for _op, _row, image in users)
    assert users[3][2]["email_masked"] == "a***@x.org"
    typed_ops = [m["data"]["op"] for m in messages if m["data"]["table"] == "typed"]
    assert typed_ops == ["insert", "insert", "insert"]  # past the ignored TRUNCATE


@pytest.mark.integration
async def test_rules_naming_an_unknown_column_stop_the_table_with_the_reason(
        rows_js: JetStreamContext, checkpoints: Any, spark: SparkSession, tmp_path: Any) -> None:
    h = Harness(rows_js, checkpoints, spark, f"sqlite:///{tmp_path / 'down.db'}")
    rule = TableRuleV1(tables=["shop.users"], ignore_delete_value_expr="stauts = 'archived'")
    cfg = SpanConfig(sink_url=h.sink_url, router=Router(table_rules=[rule]))
    await h.pipeline.set_spans({h.span("users"): cfg})
    await h.source.txn("shop", "users", [RowImageV2(op="insert", after=_user(1, "a@b.c", "live"))],
                       meta=USERS)
    await h.source.resolve()
    report = await h.pipeline.round()  # the stop is the round's outcome for this span
    [status] = h.pipeline.status()
    assert status["state"] == "error" and "stauts" in status["error"], status
    assert status["error"].startswith("stopped: the table cannot be replicated"), status
    assert status["incident"]["kind"] == "unreplicable" and report.batch_events == 0, status
    await h.round()  # stopped: later rounds run nothing for it and report no error
    assert len(h.pipeline.new_incidents) == 1


@pytest.mark.integration
def test_the_initial_copy_never_reads_a_dropped_column(mariadb: MariaDB, tmp_path: Path) -> None:
    db = "rules_copy"
    mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}",
                    f"CREATE TABLE {db}.people (id INT PRIMARY KEY, name VARCHAR(20), ssn VARCHAR(11))",
                    f"INSERT INTO {db}.people VALUES (1, 'ann', '123-45-6789'), (2, 'bob', NULL)")
    sink_url = f"sqlite:///{tmp_path / 'down.db'}"
    router = Router(table_rules=[TableRuleV1(tables=[f"{db}.people"], drop_columns=["ssn"])])
    conn = mariadb.connect()
    try:
        info = load_table_info(conn, db, "people")
    finally:
        conn.close()
    assert info is not None
    span = Span.of("rules-copy", "src1", db, "people")
    target = target_for(span, db, "people", info.meta(), "primary", router)
    open_sink(sink_url).ensure_table(target)
    job = CopyJob(source_url=mariadb.url, database=db, table="people", chunk_key=("id",), target=target,
                  sink_url=sink_url)
    assert copy_chunk(job, Chunk(0, None, None)) == 2
    with sqlite3.connect(tmp_path / "down.db") as down:
        assert [r[1] for r in down.execute("PRAGMA table_info(people)")] == ["id", "name"]
        assert sorted(down.execute("SELECT id, name FROM people").fetchall()) == [(1, "ann"), (2, "bob")]
