"""The pure pieces that wire routing and shard DDL into the system: the ddl-domain contracts and
their conversion, the operator's lock view, routing from a changefeed spec (validation included),
the sink's routed targets and the origin column in the apply job, and the ddl-lock fold."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from contracts import REGISTRY
from contracts.events import shard_ddl as c
from contracts.events.changefeeds import ChangefeedSpecV2, RouteRuleV1, SourceRefV1, TableFilterV1
from contracts.events.rows import ColumnV1, TableMetaV1
from libs.control.ddl_state import DdlState
from libs.eventstore import StoredEvent
from libs.routing import OriginColumn, Router, RouteRule, TableRef, Target, router_for, validate_spec
from libs.scheduling.model import Span
from libs.shard_ddl.convert import done_contract, done_of, from_contract, to_contract
from libs.shard_ddl.lock import (
    CaughtUp,
    DoneReceived,
    ExecFailed,
    GroupChanged,
    Info,
    InfoQueued,
    InfoReceived,
    InfoRequest,
    LockCreated,
    LockKeeper,
    LockRemoved,
    LockResolved,
    Operation,
    OperationIssued,
    ShardLeft,
    Unlocked,
)
from libs.shard_ddl.view import lock_view, parse_span, parse_target, span_name
from services.sink_worker.round.apply_job import explode_event
from services.sink_worker.span.target import target_for

T = Target("merged", "orders")
A = TableRef("src1", "shop_a", "orders_1")
B = TableRef("src2", "shop_b", "orders_2")
D = ("ALTER TABLE `merged`.`orders` ADD COLUMN note varchar(20)",)
D2 = ("ALTER TABLE `merged`.`orders` ADD COLUMN note varchar(30)",)

EVENTS = [
    GroupChanged("cf", T, (A, B), 1.0), LockCreated("cf", T, 1, 1, A, D, (A, B), 1.0),
    InfoReceived("cf", T, 1, A, D, 10, 1.0), InfoQueued("cf", T, B, D, 11, 2.0),
    CaughtUp("cf", T, B, 2, D, 11, 2.0), OperationIssued("cf", T, 1, A, "exec", D, 10, 3.0),
    DoneReceived("cf", T, 1, A, "exec", 4.0), ExecFailed("cf", T, 1, A, "boom", 4.0),
    ShardLeft("cf", T, 1, B, "dropped", 5.0), Unlocked("cf", T, 1, "exec", A, "ops", "why", 6.0),
    Unlocked("cf", T, 1, "skip", None, "ops", "why", 6.0),
    LockResolved("cf", T, 1, ((A, 10), (B, 11)), 1.0, 7.0), LockRemoved("cf", T, 1, "", "gone", (), 1.0, 7.0),
    Info("cf", T, A, D, 10), Operation("cf", T, 1, B, "skip", D, 11), InfoRequest("cf", T, B),
]


@pytest.mark.parametrize("item", EVENTS, ids=lambda e: type(e).__name__)
def test_every_lock_event_and_message_round_trips_through_its_contract(item: object) -> None:
    model = to_contract(item)  # type: ignore[arg-type]
    raw = REGISTRY.encode(model, producer="test")
    decoded = REGISTRY.decode(raw).event
    assert from_contract(decoded) == item


def test_done_round_trips_with_and_without_an_error() -> None:
    done = Operation("cf", T, 3, A, "exec", D, 10).done()
    assert done_of(done_contract(done)) == done
    failed = done_contract(done, "duplicate column")
    assert failed.error == "duplicate column" and done_of(failed) == done


def test_garbage_reports_are_contract_errors() -> None:
    from contracts import ContractError

    with pytest.raises(ContractError):
        REGISTRY.decode(b'{"type": "shard_ddl.info", "version": 1, "id": "x", "time": "2026-01-01T00:00:00Z",'
                        b' "producer": "p", "epoch": 0, "data": {"changefeed": "cf"}}')
    with pytest.raises(ContractError):
        REGISTRY.decode(b"not json")


def _keeper_with_conflict() -> LockKeeper:
    keeper = LockKeeper()
    keeper.handle_info(Info("cf", T, A, D, 10), 100.0, {A, B})
    keeper.handle_info(Info("cf", T, B, D2, 20), 101.0, {A, B})
    return keeper


def test_lock_view_shows_owner_shards_and_the_conflict() -> None:
    keeper = _keeper_with_conflict()
    lock = keeper.lock("cf", T)
    assert lock is not None
    view = lock_view(lock)
    json.dumps(view)  # the command interface sends it as JSON
    assert view["state"] == "conflict" and view["owner"] == "cf/src1/shop_a.orders_1"
    assert view["ddls"] == list(D) and view["error"] is None
    assert {s["span"]: s["state"] for s in view["shards"]} == {
        "cf/src1/shop_a.orders_1": "blocked", "cf/src2/shop_b.orders_2": "blocked"}
    assert view["conflict"]["statements"] == [list(D), list(D2)]
    assert datetime.fromisoformat(view["created_at"]).timestamp() == 100.0


def test_lock_view_after_unlock_skip_records_who_and_why() -> None:
    keeper = _keeper_with_conflict()
    keeper.unlock("cf", T, "skip", by="ops", reason="index names differ", now=102.0)
    lock = keeper.lock("cf", T)
    assert lock is not None
    view = lock_view(lock)
    assert view["state"] == "skipping" and view["conflict"] is None
    assert view["unlocks"][0]["by"] == "ops" and view["unlocks"][0]["reason"] == "index names differ"
    assert {s["state"] for s in view["shards"]} == {"skip_sent"}


@pytest.mark.parametrize("text", ["cf/src1/shop_a.orders_1", "src1/shop_a.orders_1", "src1:shop_a.orders_1"])
def test_parse_span_accepts_the_names_operators_see(text: str) -> None:
    assert parse_span("cf", text) == A
    assert parse_span("cf", span_name("cf", A)) == A


@pytest.mark.parametrize("text", ["", "src1", "src1/shop_a", "a/b/c.d/e", "src1/.t"])
def test_parse_span_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_span("cf", text)


def test_parse_target() -> None:
    assert parse_target("merged.orders") == T
    for bad in ("merged", ".orders", "merged.", ""):
        with pytest.raises(ValueError):
            parse_target(bad)


def _spec(**kw: object) -> ChangefeedSpecV2:
    base: dict[str, object] = {
        "id": "cf", "sources": [SourceRefV1(id="src1", url="mysql://h/"), SourceRefV1(id="src2", url="mysql://h/")],
        "sink_url": "sqlite:///x.db", "filter": TableFilterV1(include=["shop_*.*"]),
        "routes": [RouteRuleV1(database="shop_*", table="orders_*", target_schema="merged",
                               target_table="orders")]}
    base.update(kw)
    return ChangefeedSpecV2.model_validate(base)


META = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="bigint", nullable=False),
                            ColumnV1(name="v", kind="int", sql_type="int", nullable=True)],
                   primary_key=["id"])
META_TEXT_KEY = TableMetaV1(columns=[ColumnV1(name="id", kind="string", sql_type="varchar(10)",
                                              nullable=False)],
                            primary_key=["id"])


def test_router_for_a_spec_routes_shards_to_the_target_and_others_to_themselves() -> None:
    router = router_for(_spec())
    assert router.route("src1", "shop_a", "orders_1") == T
    assert router.route("src2", "shop_b", "customers") == Target("shop_b", "customers")
    assert router.route("src1", "other", "orders_1") is None  # filtered out
    assert router == router_for(_spec())  # spans' configs compare equal across rebuilds


def test_validate_spec_lists_empty_routes_and_incompatible_keys() -> None:
    spec = _spec(routes=[
        RouteRuleV1(database="shop_*", table="orders_*", target_schema="merged", target_table="orders"),
        RouteRuleV1(database="nothing_*", target_schema="x", name="empty")])
    problems = validate_spec(spec, {A: META, B: META_TEXT_KEY})
    kinds = sorted(p.kind for p in problems)
    assert kinds == ["empty_route", "incompatible_keys"]
    assert any("empty" in p.message for p in problems)
    assert validate_spec(_spec(), {A: META, B: META}) == []


def test_validate_spec_reports_an_unreadable_rule_instead_of_raising() -> None:
    spec = _spec(routes=[RouteRuleV1(database="~(", target_schema="x")])
    problems = validate_spec(spec, [A])
    assert [p.kind for p in problems] == ["invalid_rule"]


def test_target_for_routes_and_adds_the_origin_column_to_routed_shards() -> None:
    span = Span("cf", "src1", "shop_a", "orders_1")
    rule = RouteRule(schema="shop_*", table="orders_*", target_schema="merged", target_table="orders")
    router = Router([rule],
                    origin=OriginColumn("_origin"))
    table = target_for(span, "shop_a", "orders_1", META, "primary", router)
    assert (table.schema, table.name) == ("merged", "orders")
    assert table.key == ("_origin", "id") and table.meta.columns[0].name == "_origin"
    other = Span("cf", "src1", "shop_a", "customers")
    plain = target_for(other, "shop_a", "customers", META, "primary", router)
    assert (plain.schema, plain.name, plain.key) == ("shop_a", "customers", ("id",))  # not merged: unchanged
    assert target_for(span, "shop_a", "orders_1", META, "primary").name == "orders_1"  # no routes


def test_explode_event_puts_the_origin_into_both_images_and_the_key() -> None:
    body = REGISTRY.encode(_rows_event(), producer="test")
    origin = ("_origin", "src1/shop_a/orders_1")
    recs = list(explode_event({"s": (0, ("_origin", "id"), origin)}, "s", 5, 1, 0, body))
    # update that keeps the key: one upsert; the delete: a delete by the origin-qualified key
    assert [(r[1], r[7]) for r in recs] == [('["src1/shop_a/orders_1",1]', "upsert"),
                                           ('["src1/shop_a/orders_1",2]', "delete")]
    assert recs[0][8]["_origin"] == "src1/shop_a/orders_1"
    plain = list(explode_event({"s": (0, ("id",), None)}, "s", 5, 1, 0, body))
    assert [r[1] for r in plain] == ["[1]", "[2]"] and "_origin" not in plain[0][8]


def _rows_event() -> object:
    from contracts.events.rows import RowImageV2, RowsChangedV2

    return RowsChangedV2.model_validate({
        "source": "src1", "database": "shop_a", "table": "orders_1", "ts": 5, "seq": 0,
        "position": {"binlog_file": "b.1", "binlog_pos": 4},
        "meta": META.model_dump(), "rows": [
            RowImageV2(op="update", before={"id": 1, "v": 1}, after={"id": 1, "v": 2}).model_dump(),
            RowImageV2(op="delete", before={"id": 2, "v": 1}).model_dump()]})


def _stored(model: object, seq: int) -> StoredEvent:
    env = REGISTRY.envelope(model, producer="t")  # type: ignore[arg-type]
    return StoredEvent(seq=seq, subject="s", headers={}, envelope=env, event=model,  # type: ignore[arg-type]
                       original_version=1)


def test_ddl_state_fold_rebuilds_the_keeper_and_stops_folding_lock_events_once_live() -> None:
    live = LockKeeper()
    events = [*live.handle_info(Info("cf", T, A, D, 10), 1.0, {A, B}).events,
              *live.handle_info(Info("cf", T, B, D, 20), 2.0, {A, B}).events]
    state = DdlState()
    for n, e in enumerate(events):
        state.fold(_stored(to_contract(e), n + 1))
    assert state.keeper == live and state.keeper.pending_operations() == live.pending_operations()
    dropped = c.ShardDroppedV1(changefeed="cf", target=c.TargetRefV1(database="merged", table="orders"),
                               span=c.ShardRefV1(source="src2", database="shop_b", table="orders_2"),
                               position=30)
    state.live = True
    state.fold(_stored(dropped, 99))
    state.fold(_stored(to_contract(events[0]), 100))  # a live append: the keeper applied it already
    assert state.keeper == live and state.dropped == {("cf", B): 30}
    state.fold(_stored(to_contract(InfoReceived("cf", T, 1, B, D, 40, 3.0)), 101))
    assert state.dropped == {}  # the shard is back (its table was created again)
