"""Foreign-key actions the binlog never shows, carried out on a SQL downstream.

InnoDB applies ``ON DELETE``/``ON UPDATE`` ``CASCADE`` and ``SET NULL`` below the binlog: the
binlog holds the parent's delete or update, never the child rows the action deleted or changed
(``libs.foreign_keys``). ``apply_cascade`` reproduces one such parent change on the downstream
the way InnoDB carried it out upstream: for every cascading foreign key whose parent is the
changed table, the child rows that referenced the parent's old values are selected, then
deleted (``CASCADE`` on delete), given the new values (``CASCADE`` on update) or NULL
(``SET NULL``); each of those child changes is in turn a parent change for the child's own
children (multi-level, self-referencing tables), to the depth InnoDB allows.

Exactness rests on the caller: the downstream tables of the foreign keys' group must hold
exactly the source's state just before the parent change (everything before it applied,
nothing after), and the cascade must run in the transaction that applies the parent change
(DESIGN.md, "Foreign-key cascades"). Then the selected rows are the rows InnoDB changed.

In a merged shard group every statement also matches the child's origin column value, so a
cascade of one shard never reaches the rows another shard keeps in the same target table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from contracts.events.rows import ColumnV1
from libs.codec.decode import normalize_fetched
from libs.foreign_keys import ForeignKey
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.sql_common import SqlSink

# InnoDB's cascade depth: 14 levels of child rows commit, a 15th fails the parent's statement
# (error 193; measured on MariaDB 10.11). A deeper cascade here therefore means the downstream
# does not hold the source's state.
MAX_CASCADE_LEVELS = 14


class CascadeError(RuntimeError):
    """A cascade the downstream cannot reproduce faithfully (the span must stop, not guess)."""


@dataclass(frozen=True)
class CascadeTable:
    """One upstream table of a foreign-key group and where its rows are downstream."""

    target: TargetTable
    origin: tuple[str, str] | None = None
    """The origin column's name and this table's value in a merged target (else None)."""


@dataclass(frozen=True)
class CascadeGraph:
    """The cascading foreign keys among the tables of one group, by parent table."""

    tables: Mapping[tuple[str, str], CascadeTable]
    """Upstream ``(database, table)`` -> its downstream table."""
    fks: Sequence[ForeignKey]

    def children(self, database: str, table: str) -> list[ForeignKey]:
        return [fk for fk in self.fks
                if fk.cascading and (fk.ref_database, fk.ref_table) == (database, table)]

    def triggers(self, database: str, table: str, op: Literal["insert", "update", "delete"],
                 before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> bool:
        """Whether this row change of the parent makes InnoDB change child rows: a delete, or an
        update of referenced columns, of a table with a cascading child (cheap: no downstream)."""
        if op == "insert" or before is None:
            return False
        for fk in self.children(database, table):
            action = fk.on_delete if after is None else fk.on_update
            if action not in ("CASCADE", "SET NULL", "SET DEFAULT"):
                continue
            if any(before.get(c) is None for c in fk.ref_columns):
                continue
            if after is None or any(before.get(c) != after.get(c) for c in fk.ref_columns):
                return True
        return False


@dataclass
class CascadeResult:
    deleted: dict[tuple[str, str], int] = field(default_factory=dict)
    updated: dict[tuple[str, str], int] = field(default_factory=dict)

    def count(self, what: dict[tuple[str, str], int], table: tuple[str, str]) -> None:
        what[table] = what.get(table, 0) + 1


def apply_cascade(sink: SqlSink, graph: CascadeGraph, database: str, table: str,
                  before: Mapping[str, Any], after: Mapping[str, Any] | None) -> CascadeResult:
    """Carry out on ``sink``, in one transaction, what InnoDB did to the child rows when the
    parent row ``before`` of ``database.table`` was deleted (``after`` None) or became ``after``.

    Images are decoded values (``values.decode_row``), as the apply path writes them. The parent
    row itself is not written here: the caller applies it with the batch it belongs to.
    """
    def work(cur: Any) -> CascadeResult:
        result = CascadeResult()
        run_cascade(sink, cur, graph, database, table, before, after, result)
        return result

    return sink._run(work, f"cascade from {database}.{table}")


def run_cascade(sink: SqlSink, cur: Any, graph: CascadeGraph, database: str, table: str,
                before: Mapping[str, Any], after: Mapping[str, Any] | None, result: CascadeResult,
                depth: int = 0) -> None:
    """``apply_cascade`` on an open cursor (the caller's transaction)."""
    for fk in graph.children(database, table):
        old = tuple(before.get(c) for c in fk.ref_columns)
        if any(v is None for v in old):
            continue  # a NULL is referenced by no child row
        if after is None:
            action, new = fk.on_delete, None
        else:
            new = tuple(after.get(c) for c in fk.ref_columns)
            if new == old:
                continue  # the referenced columns did not change
            action = fk.on_update
        if action not in ("CASCADE", "SET NULL", "SET DEFAULT"):
            continue  # RESTRICT/NO ACTION: upstream refused the change if a child row existed
        child = graph.tables.get((fk.database, fk.table))
        if child is None:
            continue  # a child the changefeed does not replicate (named at creation)
        if action == "SET DEFAULT":
            raise CascadeError(f"{fk.describe()}: SET DEFAULT is not carried out by InnoDB; a source "
                               "that has it is not a MariaDB/MySQL InnoDB table")
        child_key = (fk.database, fk.table)
        rows = _select(sink, cur, child, fk.columns, old)
        if rows and depth >= MAX_CASCADE_LEVELS:
            raise CascadeError(f"{fk.describe()}: the cascade goes deeper than InnoDB's limit of "
                               f"{MAX_CASCADE_LEVELS} levels, so the downstream does not hold the "
                               "source's rows")
        for row in rows:
            if action == "CASCADE" and new is None:
                _delete(sink, cur, child, row)
                result.count(result.deleted, child_key)
                changed: dict[str, Any] | None = None
            else:
                values = new if action == "CASCADE" and new is not None else (None,) * len(fk.columns)
                changed = {**row, **dict(zip(fk.columns, values, strict=True))}
                if changed == row:
                    continue
                _update(sink, cur, child, row, fk.columns, values)
                result.count(result.updated, child_key)
            run_cascade(sink, cur, graph, fk.database, fk.table, row, changed, result, depth + 1)


def _where(sink: SqlSink, table: CascadeTable, columns: Sequence[str], values: Sequence[Any],
           params: list[Any]) -> str:
    colmap: dict[str, ColumnV1] = {c.name: c for c in table.target.meta.columns}
    names, vals = list(columns), list(values)
    if table.origin is not None:
        names.append(table.origin[0])
        vals.append(table.origin[1])
    return sink._match(names, vals, colmap, params)


def _select(sink: SqlSink, cur: Any, table: CascadeTable, columns: Sequence[str],
            values: Sequence[Any]) -> list[dict[str, Any]]:
    cols = table.target.meta.columns
    params: list[Any] = []
    where = _where(sink, table, columns, values, params)
    names = ", ".join(sink.pident(c.name) for c in cols)
    # Locked like the rows InnoDB's cascade locks (SQLite locks the whole database anyway).
    lock = "" if sink.dialect == "sqlite" else " FOR UPDATE"
    cur.execute(f"SELECT {names} FROM {sink._table_ref(table.target, for_params=True)} WHERE {where}{lock}",
                params)
    return [{c.name: normalize_fetched(c, v, sink.dialect) for c, v in zip(cols, raw, strict=True)}
            for raw in cur.fetchall()]


def _key_of(table: CascadeTable, row: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    key = list(table.target.key)
    return key, [row[c] for c in key]


def _delete(sink: SqlSink, cur: Any, table: CascadeTable, row: Mapping[str, Any]) -> None:
    params: list[Any] = []
    colmap = {c.name: c for c in table.target.meta.columns}
    key, values = _key_of(table, row)
    where = sink._match(key, values, colmap, params)
    cur.execute(f"DELETE FROM {sink._table_ref(table.target, for_params=True)} WHERE {where}", params)


def _update(sink: SqlSink, cur: Any, table: CascadeTable, row: Mapping[str, Any],
            columns: Sequence[str], values: Sequence[Any]) -> None:
    colmap = {c.name: c for c in table.target.meta.columns}
    params: list[Any] = []
    sets = []
    for name, value in zip(columns, values, strict=True):
        sets.append(f"{sink.pident(name)} = {sink.placeholder}")
        params.append(sink._adapt(colmap.get(name), value))
    key, key_values = _key_of(table, row)
    where = sink._match(key, key_values, colmap, params)
    cur.execute(f"UPDATE {sink._table_ref(table.target, for_params=True)} SET {', '.join(sets)} "
                f"WHERE {where}", params)
