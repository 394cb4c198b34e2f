"""Cascading foreign keys: read from information_schema's rows, named at changefeed creation with
what keeps each from being reproduced downstream (``libs.foreign_keys``), and the limits of
carrying them out downstream (``services.sink_worker.fk.cascades``, on SQLite: no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.events.changefeeds import TableFilterV1, TableRuleV1
from contracts.events.rows import ColumnV1, TableMetaV1
from libs.foreign_keys import (
    STREAM_NOT_REPRODUCED,
    ForeignKey,
    cascade_groups,
    cascade_warnings,
    create_table_actions,
    fold_rows,
    group_members,
    group_token,
)
from libs.routing import OriginColumn, Router, RouteRule, TableFilter
from services.sink_worker.fk.cascades import CascadeError, CascadeGraph, CascadeTable, apply_cascade
from services.sink_worker.sinks.base import TargetTable, Upsert
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.sql_common import SqlSink


def _fk(table: str, parent: str, columns: tuple[str, ...] = ("parent_id",), on_delete: str = "CASCADE",
        on_update: str = "RESTRICT", db: str = "shop") -> ForeignKey:
    return ForeignKey(db, table, f"fk_{table}", columns, db, parent, ("id",) * len(columns),
                      on_delete, on_update)


def test_rows_fold_into_keys_with_their_columns_in_order() -> None:
    rows = [
        ("shop", "items", "fk_order", "order_shop", "shop", "orders", "shop_id", "CASCADE", "SET NULL"),
        ("shop", "items", "fk_order", "order_no", "shop", "orders", "no", "CASCADE", "SET NULL"),
        ("shop", "notes", "fk_item", "item_id", "shop", "items", "id", "RESTRICT", "NO ACTION"),
        ("shop", "tree", "fk_up", "up", "shop", "tree", "id", "set null", "CASCADE"),
    ]
    items, notes, tree = fold_rows(rows)
    assert items == ForeignKey("shop", "items", "fk_order", ("order_shop", "order_no"), "shop", "orders",
                               ("shop_id", "no"), "CASCADE", "SET NULL")
    assert items.cascading and not notes.cascading
    assert tree.self_referencing and tree.on_delete == "SET NULL" and tree.cascading
    assert items.describe() == ("shop.items.fk_order (order_shop, order_no) -> shop.orders (shop_id, no) "
                                "ON DELETE CASCADE ON UPDATE SET NULL")


def test_every_cascading_key_the_changefeed_touches_is_named_with_its_reasons() -> None:
    fks = {"src1": [
        _fk("items", "orders"),                                   # both in
        _fk("audit", "orders", on_delete="SET NULL"),             # child filtered out
        _fk("orders", "customers", on_update="CASCADE", on_delete="RESTRICT"),  # parent out
        _fk("notes", "items", on_delete="RESTRICT"),              # no action InnoDB takes itself
        _fk("x", "y", db="other"),                                # neither selected
        _fk("tree", "tree"),                                      # self reference
    ]}
    router = Router(table_filter=TableFilter.from_contract(TableFilterV1(
        include=["shop.*"], exclude=["shop.audit", "shop.customers"])))
    # A SQL downstream carries out the keys with both ends selected (items, tree): not named.
    got = {w.fk.table: w for w in cascade_warnings(router, fks)}
    assert sorted(got) == ["audit", "orders"]
    audit = got["audit"].reasons[0]
    assert "leaves out the child shop.audit while it selects its parent shop.orders" in audit
    assert "leaves out the parent shop.customers" in got["orders"].reasons[0]
    # A NATS downstream gets no cascades at all: every key is named.
    got = {w.fk.table: w for w in cascade_warnings(router, fks, stream_sink=True)}
    assert sorted(got) == ["audit", "items", "orders", "tree"]
    assert all(w.reasons[0] == STREAM_NOT_REPRODUCED for w in got.values())
    assert got["items"].reasons == (STREAM_NOT_REPRODUCED,)
    message = got["items"].message
    assert message.startswith("foreign key src1:shop.items.fk_items (parent_id) -> shop.orders (id) "
                              "ON DELETE CASCADE: MariaDB applies it below the binlog")


def test_a_dropped_key_column_or_a_merge_without_origin_cannot_follow_a_cascade() -> None:
    fks = {s: [_fk("items", "orders", db=f"shop_{s}")] for s in ("s1", "s2")}
    tables = {s: [(f"shop_{s}", "orders"), (f"shop_{s}", "items")] for s in ("s1", "s2")}
    rules = [RouteRule(schema="shop_*", table="items", target_schema="all", target_table="items")]
    merged = Router(rules)
    got = cascade_warnings(merged, fks, tables)
    assert len(got) == 2
    assert all("merged with 1 other table(s) into all.items without an origin_column" in w.reasons[-1]
               for w in got)
    # With an origin column each shard's cascade stays within its shard.
    kept_apart = Router(rules, origin=OriginColumn("_origin"))
    assert cascade_warnings(kept_apart, fks, tables) == []
    dropping = Router(table_rules=[TableRuleV1(tables=["*.items"], drop_columns=["parent_id"])])
    reasons = cascade_warnings(dropping, {"s1": fks["s1"]})[0].reasons
    assert reasons == ("table rules drop its column(s) parent_id",)


def test_the_tables_cascading_keys_connect_form_one_group_named_by_its_members() -> None:
    fks = [_fk("orders", "customers"), _fk("items", "orders"), _fk("notes", "items", on_delete="RESTRICT"),
           _fk("tree", "tree"), _fk("audit", "orders", on_delete="SET NULL"), _fk("x", "y", db="other")]
    groups = cascade_groups(fks, lambda d, t: d == "shop" and t != "audit")
    # RESTRICT connects nothing; a key with an end left out neither; a self reference alone is one.
    assert groups == [(("shop", "customers"), ("shop", "items"), ("shop", "orders")), (("shop", "tree"),)]
    database, table = group_token(groups[0])
    assert (database, table) == ("shop", "fk~shop:customers+shop:items+shop:orders")
    assert group_members(table) == groups[0]
    assert group_members("orders") is None
    # Names a subject token cannot hold are tokenised like the subjects capture publishes on.
    assert group_token([("a.b", "t 1"), ("a.b", "u")]) == ("a_b", "fk~a_b:t_1+a_b:u")


def test_actions_come_from_show_create_table_when_information_schema_hides_them() -> None:
    text = ("CREATE TABLE `a``b` (\n  `id` int(11) NOT NULL,\n  `up` int(11) DEFAULT NULL,\n"
            "  CONSTRAINT `fk``up` FOREIGN KEY (`up`) REFERENCES `a``b` (`id`) ON DELETE SET NULL "
            "ON UPDATE CASCADE,\n  CONSTRAINT `plain` FOREIGN KEY (`x`, `y`) REFERENCES `db`.`p` (`x`, `y`)\n"
            ") ENGINE=InnoDB")
    assert create_table_actions(text) == {"fk`up": ("SET NULL", "CASCADE"), "plain": ("RESTRICT", "RESTRICT")}


def test_only_a_delete_or_a_referenced_key_change_of_a_cascading_parent_triggers() -> None:
    graph = CascadeGraph({}, [_fk("items", "orders"), _fk("audit", "orders", on_delete="RESTRICT",
                                                          on_update="SET NULL")])
    old = {"id": 1, "note": "a"}
    assert graph.triggers("shop", "orders", "delete", old, None)
    assert graph.triggers("shop", "orders", "update", old, {"id": 2, "note": "a"})
    assert not graph.triggers("shop", "orders", "update", old, {"id": 1, "note": "b"})
    assert not graph.triggers("shop", "orders", "insert", None, old)
    assert not graph.triggers("shop", "orders", "delete", {"id": None}, None)
    assert not graph.triggers("shop", "items", "delete", {"id": 1, "parent_id": 1}, None)
    # RESTRICT on delete, SET NULL on update: only the key change triggers.
    audit_only = CascadeGraph({}, [_fk("audit", "orders", on_delete="RESTRICT", on_update="SET NULL")])
    assert not audit_only.triggers("shop", "orders", "delete", old, None)
    assert audit_only.triggers("shop", "orders", "update", old, {"id": 3, "note": "a"})


def test_a_cascade_deeper_than_innodb_allows_or_set_default_is_refused(tmp_path: Path) -> None:
    """Past InnoDB's depth the upstream statement would have failed, so the downstream does not
    hold the source's rows; SET DEFAULT is never carried out by InnoDB. Both stop, neither guesses."""
    sink = open_sink(f"sqlite:///{tmp_path / 'deep.db'}")
    assert isinstance(sink, SqlSink)
    meta = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                                ColumnV1(name="parent_id", kind="int", sql_type="int")], primary_key=["id"])
    chain = TargetTable(schema=None, name="chain", meta=meta, key=("id",))
    sink.ensure_table(chain)
    sink.apply_partition(chain, [Upsert((i,), {"id": i, "parent_id": i - 1 if i else None})
                                 for i in range(20)])
    tables = {("shop", "chain"): CascadeTable(chain)}
    graph = CascadeGraph(tables, [_fk("chain", "chain")])
    with pytest.raises(CascadeError, match="deeper than InnoDB's limit of 14 levels"):
        apply_cascade(sink, graph, "shop", "chain", {"id": 0, "parent_id": None}, None)
    assert len(sink.fetch_rows(chain)) == 20  # the transaction rolled back whole
    # 14 levels are within the limit: the chain goes, level by level.
    result = apply_cascade(sink, graph, "shop", "chain", {"id": 5, "parent_id": 4}, None)
    assert result.deleted == {("shop", "chain"): 14}
    assert [r["id"] for r in sink.fetch_rows(chain)] == [0, 1, 2, 3, 4, 5]
    defaulting = CascadeGraph(tables, [_fk("chain", "chain", on_delete="SET DEFAULT")])
    with pytest.raises(CascadeError, match="SET DEFAULT"):
        apply_cascade(sink, defaulting, "shop", "chain", {"id": 4, "parent_id": 3}, None)
