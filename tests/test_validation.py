"""Validation without servers: what the rules say a downstream row should be, key identity across
drivers, the changefeed v5 contract and the CLI's rendering of a status."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest

from contracts import REGISTRY
from contracts.envelope import Envelope
from contracts.events.changefeeds import (
    ChangefeedCreatedV4,
    ChangefeedCreatedV5,
    ChangefeedSpecV4,
    SourceRefV1,
    TableRuleV1,
    spec_v5,
)
from contracts.events.rows import ColumnV1, TableMetaV1
from libs.table_rules import rules_for
from libs.validation import Mismatch, RowPlan, SpanValidation, compare_row, key_text


def _col(name: str, kind: str, sql_type: str) -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type)  # type: ignore[arg-type]


COLUMNS = [_col("id", "int", "int"), _col("name", "string", "varchar(8)"),
           _col("amount", "decimal", "decimal(8,2)"), _col("at", "datetime", "datetime(6)"),
           _col("masked", "string", "text")]


def _plan(mode: str, **rule: Any) -> RowPlan:
    rules = rules_for([TableRuleV1(tables=["db.t"], **rule)], "db", "t") if rule else None
    return RowPlan.of(mode, COLUMNS, rules)


def test_full_mode_compares_values_as_the_checksum_normalises_them() -> None:
    plan = _plan("full")
    up = {"id": 1, "name": "a", "amount": Decimal("1.50"), "at": datetime(2026, 1, 2, 3, 4, 5)}
    # PostgreSQL/SQLite give other Python types for the same data: equal.
    down = {"id": "1", "name": "a", "amount": "1.5", "at": "2026-01-02 03:04:05", "masked": None}
    assert compare_row(plan, up, down) is None
    assert compare_row(plan, up, {**down, "name": "b", "amount": "2"}) == Mismatch("different",
                                                                                  ("name", "amount"))
    assert compare_row(plan, up, None) == Mismatch("missing")
    assert compare_row(plan, None, down) == Mismatch("extra")
    assert compare_row(plan, None, None) is None


def test_fast_mode_compares_existence_only() -> None:
    plan = _plan("fast")
    assert compare_row(plan, {"id": 1, "name": "a"}, {"id": 1, "name": "b"}) is None
    assert compare_row(plan, {"id": 1}, None) == Mismatch("missing")


def test_rules_decide_what_the_downstream_should_hold() -> None:
    # Computed and dropped columns are not compared (a dropped one is not among the target's).
    plan = _plan("full", computed=[{"name": "masked", "expr": "left(name, 1)"}])
    assert [c.name for c in plan.columns] == ["id", "name", "amount", "at"]
    assert compare_row(plan, {"id": 1, "name": "a"}, {"id": 1, "name": "a", "masked": "zzz"}) is None
    # An ignored delete (by type or expression) keeps the row downstream: not a mismatch.
    for rule in ({"ignore_events": ["delete"]}, {"ignore_delete_value_expr": "name = 'x'"}):
        plan = _plan("full", **rule)
        assert compare_row(plan, None, {"id": 1}) is None, rule
        assert compare_row(plan, {"id": 1}, None) == Mismatch("missing"), rule
    # An ignored insert leaves the row out downstream.
    for rule in ({"ignore_events": ["insert"]}, {"ignore_insert_value_expr": "name = 'x'"}):
        plan = _plan("full", **rule)
        assert compare_row(plan, {"id": 1}, None) is None, rule
        assert compare_row(plan, None, {"id": 1}) == Mismatch("extra"), rule
    # An ignored update keeps the older image (and an ignored key change the older key).
    plan = _plan("full", ignore_update_new_value_expr="amount > 10")
    assert not plan.compare_values and not plan.report_missing and not plan.report_extra
    assert compare_row(plan, {"id": 1, "name": "new"}, {"id": 1, "name": "old"}) is None


def test_origin_column_is_not_compared() -> None:
    plan = RowPlan.of("full", [_col("_origin", "string", "varchar(64)"), *COLUMNS], None, skip=("_origin",))
    assert "_origin" not in [c.name for c in plan.columns]


def test_key_text_is_equal_for_equal_keys_read_by_different_drivers() -> None:
    cols = [_col("id", "int", "bigint unsigned"), _col("d", "decimal", "decimal(8,2)")]
    assert key_text(cols, [18446744073709551615, Decimal("1.50")]) == key_text(cols, ["18446744073709551615",
                                                                                      "1.5"])
    assert key_text(cols, [1, Decimal("1")]) != key_text(cols, [2, Decimal("1")])


def test_changefeed_v5_adds_validation_and_v4_upcasts_to_off() -> None:
    spec = ChangefeedSpecV4(id="cf", sources=[SourceRefV1(id="s1", url="mysql://u@h/")], sink_url="sqlite:///x")
    old = Envelope(type="changefeed.created", version=4, id="e1", producer="test", epoch=0,
                   time=datetime(2026, 11, 24), data=ChangefeedCreatedV4(spec=spec).model_dump(mode="json"))
    event = REGISTRY.decode(old.model_dump_json().encode()).event
    assert isinstance(event, ChangefeedCreatedV5) and event.spec.validation.mode == "off"
    assert spec_v5(spec).validation.mode == "off"
    with pytest.raises(ValueError, match="mode"):
        spec_v5(spec).model_validate({**spec_v5(spec).model_dump(), "validation": {"mode": "sometimes"}})


def test_cli_renders_a_status(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.app import _validation

    _validation({"changefeed": "cf", "mode": "full", "rows_checked": 10, "pending": 0, "rechecking": 1,
                 "mismatches": 1, "repaired_total": 2,
                 "compare": {"state": "running", "request": {"id": "abc"}, "tables_done": 0, "tables": 1,
                             "rows_checked": 5, "rows_estimate": 9},
                 "tables": [{"table": "s/db.t", "mode": "full", "rows_checked": 10, "pending": 0,
                             "rechecking": 1, "mismatches": 1, "compare": {"state": "running"},
                             "error": None}],
                 "mismatched_rows": [{"table": "s/db.t", "key": {"id": 4}, "kind": "different",
                                      "columns": ["name"]}]})
    out = capsys.readouterr().out
    assert "1 mismatched" in out and "compare abc: running" in out and '{"id": 4}' in out


# --------------------------------------------------------------------------- the validator's re-check


class _FakeKv:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def get(self, key: str) -> Any:
        from nats.js.errors import KeyNotFoundError

        if key not in self.values:
            raise KeyNotFoundError
        return type("Entry", (), {"value": self.values[key]})()

    async def put(self, key: str, value: bytes) -> int:
        self.values[key] = value
        return 1


async def test_a_row_is_reported_only_when_it_still_differs_past_the_checkpoint_of_its_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In flight first (not reported), then past a resolved mark after the read and a checkpoint
    past that mark: re-read and reported; a reported row repaired leaves the report; a suspect
    that is equal at its re-check was in flight and is never reported."""
    from libs.scheduling.model import Span
    from services.sink_worker.round.pull import ResolvedMark
    from services.sink_worker.sinks.base import TargetTable
    from services.sink_worker.span.checkpoints import Checkpoint
    from services.sink_worker.span.runtime import SpanConfig, SpanRuntime
    from services.sink_worker.validation import validator as v

    meta = TableMetaV1(columns=[_col("id", "int", "int"), _col("name", "string", "varchar(8)")],
                       primary_key=["id"])
    span = Span("cf", "s", "db", "t")
    rt = SpanRuntime(span=span, config=SpanConfig(sink_url="sqlite:///x.db", validation="full",
                                                  source_url="mysql://u@h/"),
                     reader=None, checkpoint=Checkpoint(1, 100 << 18), state="replicating")  # type: ignore[arg-type]
    upstream: dict[int, dict[str, Any]] = {1: {"id": 1, "name": "new"}, 2: {"id": 2, "name": "x"}}
    downstream: dict[int, dict[str, Any]] = {1: {"id": 1, "name": "old"}, 2: {"id": 2, "name": "y"}}
    mark: list[ResolvedMark | None] = [None]

    def read(rt: Any, table: Any, keys: list[Any], compare: Any, chunk_rows: int) -> Any:
        texts = {key_text(table.key, k): k[0] for k in keys}
        return v._Reads({t: upstream[i] for t, i in texts.items() if i in upstream},
                        {t: downstream[i] for t, i in texts.items() if i in downstream})

    async def latest(*_: Any) -> ResolvedMark | None:
        return mark[0]

    monkeypatch.setattr(v, "_read", read)
    monkeypatch.setattr(v, "latest_resolved", latest)
    validator = v.Validator(None, v.ValidationOptions(interval_s=0.0))  # type: ignore[arg-type]
    kv = _FakeKv()
    validator._kv = kv  # type: ignore[assignment]
    check = validator._check(rt)
    check.loaded = True
    target = TargetTable(schema="db", name="t", meta=meta, key=("id",))
    check.table = v._table(rt, "db", "t", meta, target, None, None)
    check.pending = {key_text(check.table.key, (i,)): (i,) for i in (1, 2)}
    pipeline = type("P", (), {"spans": {span: rt}})()

    async def cycle() -> SpanValidation:
        await validator.run(pipeline)  # type: ignore[arg-type]
        return SpanValidation.model_validate_json(kv.values[span.kv_key])

    status = await cycle()
    assert (status.rechecking, status.mismatches) == (2, 0), status  # in flight as far as it knows
    read_ms = next(iter(check.suspects.values())).read_ms
    mark[0] = ResolvedMark(ts=(read_ms - 5) << 18, stream_seq=9)  # a mark from before the read
    assert (await cycle()).mismatches == 0
    mark[0] = ResolvedMark(ts=(read_ms + 5) << 18, stream_seq=10)  # after the read: the re-check waits
    assert (await cycle()).mismatches == 0  # ... for the checkpoint to pass it
    downstream[1] = {"id": 1, "name": "new"}  # 1 was in flight: applied by the next batch
    rt.checkpoint = Checkpoint(11, (read_ms + 5) << 18)
    status = await cycle()
    assert (status.rechecking, status.mismatches, status.found_total) == (0, 1, 1), status
    assert [(r.key, r.kind, r.columns) for r in status.reported] == [({"id": 2}, "different", ["name"])]
    downstream[2] = {"id": 2, "name": "x"}  # repaired by hand
    status = await cycle()
    assert (status.mismatches, status.repaired_total) == (0, 1), status


def test_the_api_refuses_validation_of_a_nats_sink() -> None:
    from contracts.events.changefeeds import ChangefeedSpecV5, ValidationSpecV1
    from services.api.validation import spec_problems

    spec = ChangefeedSpecV5(id="cf", sources=[SourceRefV1(id="s1", url="mysql://u@h/")],
                            sink_url="nats://127.0.0.1:4222/OUT?subject=out",
                            validation=ValidationSpecV1(mode="fast"))
    problems = spec_problems(spec)
    assert [p["loc"] for p in problems] == [["body", "validation", "mode"]], problems
    assert spec_problems(spec.model_copy(update={"validation": ValidationSpecV1()})) == []


async def test_a_compare_walks_the_table_by_key_range_and_resumes_on_a_new_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of two keys a cycle; the worker running the span goes away after the first chunk
    and a new one (fresh validator, the same bucket) goes on after the last key compared."""
    from libs.scheduling.model import Span
    from libs.validation import CompareRequest, request_key
    from services.sink_worker.sinks.base import TargetTable
    from services.sink_worker.span.checkpoints import Checkpoint
    from services.sink_worker.span.runtime import SpanConfig, SpanRuntime
    from services.sink_worker.validation import validator as v

    meta = TableMetaV1(columns=[_col("id", "int", "int"), _col("name", "string", "varchar(8)")],
                       primary_key=["id"])
    span = Span("cf", "s", "db", "t")
    rt = SpanRuntime(span=span, config=SpanConfig(sink_url="sqlite:///x.db", validation="off",
                                                  source_url="mysql://u@h/"),
                     reader=None, checkpoint=Checkpoint(1, 100 << 18), state="replicating")  # type: ignore[arg-type]
    upstream = {i: {"id": i, "name": f"n{i}"} for i in range(1, 6)}
    downstream = {**upstream, 3: {"id": 3, "name": "other"}}
    chunks: list[list[int]] = []

    def read(rt: Any, table: Any, keys: list[Any], compare: Any, chunk_rows: int) -> Any:
        after = compare.after_key[0] if compare is not None and compare.after_key else 0
        chunk = sorted(i for i in upstream if i > after)[:chunk_rows] if compare is not None else []
        chunks.append(chunk)
        wanted = {key_text(table.key, k): k[0] for k in keys} | {key_text(table.key, (i,)): i for i in chunk}
        return v._Reads({t: upstream[i] for t, i in wanted.items()},
                        {t: downstream[i] for t, i in wanted.items()},
                        [(i,) for i in chunk], (chunk[-1],) if chunk else None, len(chunk) < chunk_rows)

    mark: list[Any] = [None]

    async def latest(*_: Any) -> Any:
        return mark[0]

    monkeypatch.setattr(v, "_read", read)
    monkeypatch.setattr(v, "latest_resolved", latest)
    monkeypatch.setattr(v, "_table_from_source", lambda rt: v._table(
        rt, "db", "t", meta, TargetTable(schema="db", name="t", meta=meta, key=("id",)), None, None))
    kv = _FakeKv()
    kv.values[request_key("cf")] = CompareRequest(id="r1").model_dump_json().encode()
    pipeline = type("P", (), {"spans": {span: rt}})()

    def owner() -> Any:
        validator = v.Validator(None, v.ValidationOptions(interval_s=0.0, compare_chunk_rows=2))  # type: ignore[arg-type]
        validator._kv = kv  # type: ignore[assignment]
        return validator

    async def cycle(validator: Any) -> SpanValidation:
        await validator.run(pipeline)
        return SpanValidation.model_validate_json(kv.values[span.kv_key])

    first = owner()
    status = await cycle(first)
    assert status.compare is not None and (status.compare.after_key, status.compare.state) == ([2], "running")
    second = owner()  # the span moved: the new owner reads the progress back
    status = await cycle(second)
    assert status.compare is not None and status.compare.after_key == [4], status.compare
    assert status.rechecking == 1  # key 3 differs: re-checked before it is reported
    status = await cycle(second)
    assert status.compare is not None and status.compare.state == "done", status.compare
    assert status.compare.rows_checked == 5 and status.compare.candidates == 1, status.compare
    assert chunks == [[1, 2], [3, 4], [5]]
    await cycle(second)  # done: no further chunk for the same request
    assert len(chunks) == 3
    # Its re-check (every column, although the changefeed's mode is off) reports it.
    from services.sink_worker.round.pull import ResolvedMark

    read_ms = next(iter(second.checks[span].suspects.values())).read_ms
    mark[0] = ResolvedMark(ts=(read_ms + 1) << 18, stream_seq=5)
    rt.checkpoint = Checkpoint(5, (read_ms + 1) << 18)
    status = await cycle(second)
    assert [(r.key, r.kind, r.columns) for r in status.reported] == [({"id": 3}, "different", ["name"])]
