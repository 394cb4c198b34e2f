"""Foreign-key actions carried out downstream (``services.sink_worker.fk.cascades``), compared row for
row with what InnoDB itself did on a real MariaDB source, on every SQL downstream.

The test plays the part of the data path: it mirrors each statement's own row changes to the
downstream in source order and, at each parent change that triggers a cascade, runs
``apply_cascade`` first (the downstream then holds the source's state just before it)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from libs.codec.table_meta import load_table_info
from libs.foreign_keys import ForeignKey, load_foreign_keys
from libs.localservers.mariadb import MariaDB
from libs.routing import OriginColumn, TableRef, rewrite_meta
from services.sink_worker.fk.cascades import CascadeGraph, CascadeTable, apply_cascade
from services.sink_worker.sinks.base import Delete, TargetTable, Upsert
from services.sink_worker.sinks.sql_common import SqlSink
from tests.helpers.fk_schema import CASCADE_SCHEMA, CASCADE_TABLES
from tests.helpers.sinks import SINKS, make_target

pytestmark = pytest.mark.integration
_names = itertools.count()

SCHEMA = CASCADE_SCHEMA
TABLES = CASCADE_TABLES
SEED = (
    "INSERT INTO customers VALUES (1, 'ann'), (2, 'bob'), (3, 'cy')",
    "INSERT INTO orders VALUES (10, 1), (11, 1), (20, 2), (30, 3)",
    "INSERT INTO items VALUES (100, 10), (101, 10), (110, 11), (200, 20), (300, 30)",
    "INSERT INTO notes VALUES (1, 10), (2, 11), (3, 20), (4, NULL)",
    "INSERT INTO tree VALUES (1, NULL), (2, 1), (3, 2), (4, 3), (5, 1), (6, NULL), (7, 6)",
)


@dataclass
class Mirror:
    """A source database and its downstream copy, changed statement by statement."""

    source: MariaDB
    database: str
    sink: SqlSink
    graph: CascadeGraph

    def rows(self, table: str, where: str = "1=1") -> list[dict[str, Any]]:
        conn = self.source.connect(self.database)
        try:
            with conn.cursor() as cur:
                cur.execute(f"SELECT * FROM `{table}` WHERE {where} ORDER BY 1")
                names = [d[0] for d in cur.description]
                return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
        finally:
            conn.close()

    def target(self, table: str) -> CascadeTable:
        return self.graph.tables[(self.database, table)]

    def _row(self, table: str, row: dict[str, Any]) -> dict[str, Any]:
        """The row as its target holds it: with its table's origin value in a merged target."""
        origin = self.target(table).origin
        return {**row, origin[0]: origin[1]} if origin else row

    def put(self, table: str, row: dict[str, Any]) -> None:
        target = self.target(table).target
        full = self._row(table, row)
        self.sink.apply_partition(target, [Upsert(tuple(full[k] for k in target.key), full)])

    def drop(self, table: str, row: dict[str, Any]) -> None:
        target = self.target(table).target
        full = self._row(table, row)
        self.sink.apply_partition(target, [Delete(tuple(full[k] for k in target.key))])

    def delete(self, table: str, key: int, conn: Any) -> None:
        """``DELETE`` of one parent row upstream (in ``conn``'s transaction) and downstream."""
        (before,) = _locked(conn, table, key)
        with conn.cursor() as cur:
            cur.execute(f"DELETE FROM `{table}` WHERE id = %s", (key,))
        apply_cascade(self.sink, self.graph, self.database, table, self._row(table, before), None)
        self.drop(table, before)

    def update(self, table: str, key: int, changes: dict[str, Any], conn: Any) -> None:
        (before,) = _locked(conn, table, key)
        with conn.cursor() as cur:
            sets = ", ".join(f"`{c}` = %s" for c in changes)
            cur.execute(f"UPDATE `{table}` SET {sets} WHERE id = %s", (*changes.values(), key))
        after = {**before, **changes}
        apply_cascade(self.sink, self.graph, self.database, table, self._row(table, before),
                      self._row(table, after))
        if after["id"] != before["id"]:
            self.drop(table, before)
        self.put(table, after)

    def insert(self, table: str, row: dict[str, Any], conn: Any) -> None:
        with conn.cursor() as cur:
            cols = ", ".join(f"`{c}`" for c in row)
            cur.execute(f"INSERT INTO `{table}` ({cols}) VALUES ({', '.join(['%s'] * len(row))})",
                        tuple(row.values()))
        self.put(table, row)

    def downstream(self, table: str) -> list[dict[str, Any]]:
        own = self.target(table)
        rows = self.sink.fetch_rows(own.target)
        if own.origin is not None:
            name, value = own.origin
            rows = [{k: v for k, v in r.items() if k != name} for r in rows if r[name] == value]
        return sorted(rows, key=lambda r: r["id"])

    def assert_equal(self) -> None:
        for table in TABLES:
            assert self.downstream(table) == self.rows(table), f"{self.database}.{table} differs downstream"


def _locked(conn: Any, table: str, key: int) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM `{table}` WHERE id = %s FOR UPDATE", (key,))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def _source(mariadb: MariaDB, database: str) -> list[ForeignKey]:
    mariadb.execute(f"DROP DATABASE IF EXISTS {database}", f"CREATE DATABASE {database}")
    mariadb.execute(*SCHEMA, *SEED, database=database)
    conn = mariadb.connect()
    try:
        return load_foreign_keys(conn, database)
    finally:
        conn.close()


def _targets(mariadb: MariaDB, database: str, schema: str | None, prefix: str,
             origin: OriginColumn | None) -> dict[str, TargetTable]:
    conn = mariadb.connect()
    try:
        out = {}
        for table in TABLES:
            info = load_table_info(conn, database, table)
            assert info is not None
            meta = rewrite_meta(info.meta(), origin) if origin else info.meta()
            out[table] = TargetTable(schema=schema, name=f"{prefix}_{table}", meta=meta,
                                     key=tuple(meta.primary_key))
        return out
    finally:
        conn.close()


@pytest.fixture(params=SINKS)
def downstream(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Mirror]]:
    target = make_target(request, request.param, tmp_path)
    assert isinstance(target.sink, SqlSink)
    mariadb: MariaDB = request.getfixturevalue("mariadb")
    prefix = f"fk{next(_names)}"
    created: list[str] = []

    def mirror(shard: str, origin: OriginColumn | None = None) -> Mirror:
        database = f"{prefix}_{shard}"
        created.append(database)
        fks = _source(mariadb, database)
        tables = {}
        for table, tt in _targets(mariadb, database, target.schema, prefix, origin).items():
            target.sink.ensure_table(tt)
            own = (origin.name, origin.value(TableRef("src1", database, table))) if origin else None
            tables[(database, table)] = CascadeTable(tt, own)
        m = Mirror(mariadb, database, target.sink, CascadeGraph(tables, fks))
        for table in TABLES:  # the initial copy
            for row in m.rows(table):
                m.put(table, row)
        m.assert_equal()
        return m

    yield mirror
    for database in created:
        mariadb.execute(f"DROP DATABASE IF EXISTS {database}")


def _txn(m: Mirror, *steps: Callable[[Any], None]) -> None:
    conn = m.source.connect(m.database, autocommit=False)
    try:
        conn.begin()
        for step in steps:
            step(conn)
        conn.commit()
    finally:
        conn.close()


def test_delete_update_set_null_multi_level_and_self_reference(downstream: Callable[..., Mirror]) -> None:
    m = downstream("one")
    # Multi-level delete: customer 1 -> orders 10, 11 -> items; notes of those orders -> NULL.
    _txn(m, lambda c: m.delete("customers", 1, c))
    m.assert_equal()
    # Update cascade through two levels (customer 2 -> 22 -> orders.customer), and an order key
    # change: items follow it (CASCADE), notes lose it (SET NULL).
    _txn(m, lambda c: m.update("customers", 2, {"id": 22}, c))
    _txn(m, lambda c: m.update("orders", 20, {"id": 21}, c))
    m.assert_equal()
    # Self reference: a subtree goes with its root, level by level. (InnoDB refuses an ON UPDATE
    # CASCADE that comes back to the table it is updating, so a renumbered node with children
    # never commits upstream.)
    _txn(m, lambda c: m.delete("tree", 2, c))
    m.assert_equal()
    assert [r["id"] for r in m.rows("tree")] == [1, 5, 6, 7]


def test_a_cascade_inside_a_larger_transaction(downstream: Callable[..., Mirror]) -> None:
    m = downstream("txn")
    # Rows inserted before the parent's delete in the same transaction go with it; the parent
    # inserted again afterwards, with a new child, keeps them.
    _txn(m,
         lambda c: m.insert("orders", {"id": 31, "customer": 3}, c),
         lambda c: m.insert("items", {"id": 310, "order_id": 31}, c),
         lambda c: m.insert("notes", {"id": 5, "order_id": 31}, c),
         lambda c: m.delete("customers", 3, c),
         lambda c: m.insert("customers", {"id": 3, "name": "cy2"}, c),
         lambda c: m.insert("orders", {"id": 32, "customer": 3}, c),
         lambda c: m.insert("items", {"id": 320, "order_id": 32}, c))
    m.assert_equal()
    assert [r["id"] for r in m.rows("orders") if r["customer"] == 3] == [32]


def test_a_cascade_stays_within_its_shard_of_a_merged_target(downstream: Callable[..., Mirror]) -> None:
    origin = OriginColumn("_origin")
    a, b = downstream("a", origin), downstream("b", origin)
    # Both shards hold customer 1 with the same keys below it in the same target tables.
    _txn(a, lambda c: a.delete("customers", 1, c))
    _txn(b, lambda c: b.update("orders", 20, {"id": 23}, c))
    a.assert_equal()
    b.assert_equal()
    assert [r["id"] for r in b.downstream("orders")] == [10, 11, 23, 30]
