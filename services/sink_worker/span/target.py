"""Spans, their target tables and the key the apply path writes by.

A span is one upstream table (or foreign-key table group) of one changefeed; the one ``Span``
class, with its subjects and keys, is ``libs.scheduling.model.Span``. This module holds what
the apply path derives from a span: its key columns, route and target table.
"""

from __future__ import annotations

from contracts.events.changefeeds import KeyPolicy
from contracts.events.rows import TableMetaV1
from libs.routing import Router, TableRef, Target
from libs.scheduling.model import Span
from services.sink_worker.sinks.base import TargetTable


class KeylessTableError(ValueError):
    """The table has no key the changefeed allows the apply path to use."""

    def __init__(self, database: str, table: str, policy: KeyPolicy, detail: str) -> None:
        super().__init__(
            f"table {database}.{table} has no primary key{detail}; key_policy={policy!r} refuses "
            "it (set the changefeed's key_policy to 'unique' to key it by a NOT NULL unique key, "
            "or 'all_columns' to key it by every column)"
        )
        self.database = database
        self.table = table
        self.policy = policy


def choose_key(meta: TableMetaV1, policy: KeyPolicy, *, database: str = "?",
               table: str = "?") -> tuple[str, ...]:
    """The columns rows are identified by: the primary key, else what ``policy`` allows.

    A unique key qualifies only when all its columns are NOT NULL: a nullable unique key lets
    several rows hold NULL there, so it does not identify a row.
    """
    if meta.primary_key:
        return tuple(meta.primary_key)
    if policy in ("unique", "all_columns"):
        nullable = {c.name: c.nullable for c in meta.columns}
        for uk in meta.unique_keys:
            if uk and all(col in nullable and not nullable[col] for col in uk):
                return tuple(uk)
    if policy == "all_columns" and meta.columns:
        return tuple(c.name for c in meta.columns)
    detail = ""
    if policy == "unique":
        detail = " and no unique key with only NOT NULL columns"
    raise KeylessTableError(database, table, policy, detail)


def shard_ref(span: Span, database: str, table: str) -> TableRef:
    """The span as routing sees it: its source id (a subject-safe id, so its token is itself)
    with the real database and table names from its events."""
    return TableRef(span.source, database, table)


def route_of(span: Span, database: str, table: str, router: Router | None) -> Target:
    """Where the span's rows land: its route rule's target, or the same database/table."""
    if router is None:
        return Target(database, table)
    target = router.route(span.source, database, table)
    # A table the filter leaves out is not discovered as a span at all; one that still reaches
    # here (the filter changed under a running span) keeps its own name rather than vanish.
    return target if target is not None else Target(database, table)


def target_for(span: Span, database: str, table: str, meta: TableMetaV1, policy: KeyPolicy,
               router: Router | None = None, *, case_insensitive: bool = False) -> TargetTable:
    """The downstream table of a span: the changefeed's route for it (``libs.routing``), the
    same database/table name without one. Several spans (the shard group) may share a target.

    With an origin column, a rule-routed span's metadata gains it, first and in every key, so
    shards whose keys collide keep separate rows (``Router.origin_for``). The sink decides what
    ``schema`` means (MySQL database, PostgreSQL schema; SQLite has one namespace and ignores it).
    ``case_insensitive``: the changefeed's ``text_comparison`` is ``case_insensitive``.
    """
    ref = shard_ref(span, database, table)
    target = route_of(span, database, table, router)
    if router is not None:
        meta = router.rewrite_meta_for(meta, ref)
    key = choose_key(meta, policy, database=database, table=table)
    unique = tuple(tuple(uk) for uk in meta.unique_keys if tuple(uk) != key)
    return TargetTable(schema=target.schema, name=target.table, meta=meta, key=key, unique_keys=unique,
                       case_insensitive=case_insensitive)
