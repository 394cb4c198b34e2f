"""A foreign-key table group's batch (``services.sink_worker.fk.table_group``): its cut over several
tables' messages, and its apply with the cascades at their place, on SQLite (no server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contracts.events.rows import (
    ColumnV1,
    DdlExecutedV1,
    RowImageV2,
    RowsChangedV2,
    SourcePositionV1,
    TableMetaV1,
)
from libs.foreign_keys import ForeignKey
from services.sink_worker.fk.cascades import CascadeGraph, CascadeTable
from services.sink_worker.fk.table_group import apply_group_batch, cut_group
from services.sink_worker.round.pull import PulledEvent
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.sql_common import SqlSink

_POS = SourcePositionV1(binlog_file="binlog.000001", binlog_pos=4)
_INT = {"kind": "int", "sql_type": "int"}
META = {
    "customers": TableMetaV1(columns=[ColumnV1(name="id", nullable=False, **_INT)], primary_key=["id"]),
    "orders": TableMetaV1(columns=[ColumnV1(name="id", nullable=False, **_INT),
                                   ColumnV1(name="customer", **_INT)], primary_key=["id"]),
    "items": TableMetaV1(columns=[ColumnV1(name="id", nullable=False, **_INT),
                                  ColumnV1(name="order_id", **_INT)], primary_key=["id"]),
}
FKS = [ForeignKey("shop", "orders", "fk_c", ("customer",), "shop", "customers", ("id",),
                  "CASCADE", "CASCADE"),
       ForeignKey("shop", "items", "fk_o", ("order_id",), "shop", "orders", ("id",), "CASCADE", "CASCADE")]


def _rows(table: str, ts: int, seq: int, *images: tuple[str, dict[str, Any] | None, dict[str, Any] | None],
          part: int = 0, last: bool = True, ordinals: tuple[int, ...] | None = None) -> PulledEvent:
    ords = ordinals if ordinals is not None else (None,) * len(images)
    event = RowsChangedV2(source="s", database="shop", table=table, ts=ts, seq=seq, part=part, last_part=last,
                          position=_POS, meta=META[table],
                          rows=[RowImageV2(op=op, before=b, after=a, ordinal=o)
                                for (op, b, a), o in zip(images, ords, strict=True)])
    return PulledEvent(stream_seq=seq + 1, subject=f"sluice.rows.s.shop.{table}",
                       event_id=f"{ts}:{table}:{part}", event=event, data=b"")


def test_a_transaction_is_complete_only_when_every_table_has_all_its_parts() -> None:
    events = [
        _rows("customers", 10, 1, ("insert", None, {"id": 1})),
        _rows("orders", 20, 2, ("insert", None, {"id": 1, "customer": 1}), last=False),
        _rows("customers", 20, 3, ("insert", None, {"id": 2})),  # its table's only part
        _rows("customers", 30, 5, ("insert", None, {"id": 3})),
    ]
    got = cut_group("g", 0, 100, [*events, events[0]])  # a re-published copy counts once
    assert got.cut.limit_ts == 19 and [e.ts for e in got.batch] == [10]
    rest = _rows("orders", 20, 4, ("insert", None, {"id": 2, "customer": 2}), part=1)
    got = cut_group("g", 10, 100, [*events, rest])
    assert got.cut.limit_ts == 100
    assert [(e.ts, e.seq) for e in got.batch] == [(20, 2), (20, 3), (20, 4), (30, 5)]
    ddl = PulledEvent(stream_seq=9, subject="sluice.ddl.s.shop.items", event_id="ddl", data=b"",
                      event=DdlExecutedV1(source="s", database="shop", table="items", ts=25, seq=4,
                                          statement="ALTER TABLE items ADD c INT", position=_POS))
    got = cut_group("g", 10, 100, [*events, rest, ddl])
    assert got.cut.limit_ts == 24 and got.ddl is ddl and got.cut.ddl_ts == 25
    assert [e.ts for e in got.batch] == [20, 20, 20]


def _downstream(tmp_path: Path) -> tuple[SqlSink, dict[tuple[str, str], CascadeTable], CascadeGraph]:
    """A SQLite downstream with the group's tables created, and their cascade graph."""
    sink = open_sink(f"sqlite:///{tmp_path / 'down.db'}")
    assert isinstance(sink, SqlSink)
    tables = {("shop", t): CascadeTable(TargetTable(None, t, meta, ("id",))) for t, meta in META.items()}
    for table in tables.values():
        sink.ensure_table(table.target)
    return sink, tables, CascadeGraph(tables, FKS)


def test_the_batch_applies_cascades_in_binlog_order_and_replays_alike(tmp_path: Path) -> None:
    sink, tables, graph = _downstream(tmp_path)
    # One transaction: a customer, its order and item; the customer deleted (the binlog shows
    # no child row going); the customer back with a new order; an order renumbered.
    batch = [
        _rows("customers", 10, 1, ("insert", None, {"id": 1}), ("insert", None, {"id": 2})),
        _rows("orders", 10, 2, ("insert", None, {"id": 10, "customer": 1}),
              ("insert", None, {"id": 20, "customer": 2})),
        _rows("items", 10, 3, ("insert", None, {"id": 100, "order_id": 10}),
              ("insert", None, {"id": 200, "order_id": 20})),
        _rows("customers", 11, 4, ("delete", {"id": 1}, None), ("insert", None, {"id": 1})),
        _rows("orders", 11, 5, ("insert", None, {"id": 11, "customer": 1}),
              ("update", {"id": 20, "customer": 2}, {"id": 21, "customer": 2})),
    ]
    for _ in range(2):  # a replay from an older checkpoint gives the same rows
        result = apply_group_batch(sink, graph, batch, lambda ev: tables[("shop", ev.table)])
        assert result.triggers == 2
        rows = {t: sorted(tuple(r.values()) for r in sink.fetch_rows(table.target))
                for (_, t), table in tables.items()}
        assert rows == {"customers": [(1,), (2,)], "orders": [(11, 1), (21, 2)], "items": [(200, 21)]}


def test_one_transactions_tables_are_merged_by_ordinal(tmp_path: Path) -> None:
    """``insert customer 5; insert its order; delete customer 5`` in one transaction: capture
    publishes the customers' message first (the table written first), holding both customer
    rows. Publish order would delete the customer before its order exists (the cascade finds
    nothing) and then insert the order: an orphan downstream. By ordinal the cascade takes it."""
    sink, tables, graph = _downstream(tmp_path)

    def txn(ts: int, ordinals: bool) -> list[PulledEvent]:
        return [_rows("customers", ts, 2 * ts, ("insert", None, {"id": 5}), ("delete", {"id": 5}, None),
                      ordinals=(0, 2) if ordinals else None),
                _rows("orders", ts, 2 * ts + 1, ("insert", None, {"id": 50, "customer": 5}),
                      ordinals=(1,) if ordinals else None)]

    def orders() -> list[tuple[Any, ...]]:
        return sorted(tuple(r.values()) for r in sink.fetch_rows(tables[("shop", "orders")].target))

    result = apply_group_batch(sink, graph, txn(10, ordinals=True), lambda ev: tables[("shop", ev.table)])
    assert result.triggers == 1
    assert orders() == []
    # Without ordinals (rows.changed v1, upcast) the transaction keeps publish order, as before.
    apply_group_batch(sink, graph, txn(11, ordinals=False), lambda ev: tables[("shop", ev.table)])
    assert orders() == [(50, 5)]
