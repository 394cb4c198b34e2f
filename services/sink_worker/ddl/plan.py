"""What a single-shard DDL event does to its target: the pure decision, from the event alone.

The decision depends only on the event (statement, the table it was published for and its
metadata after the change), never on what this process remembers, so a worker that takes a
span over after a crash decides exactly as the one that died.

- ``reconcile``: the change leaves every existing row's values as they are: a column dropped,
  a nullable column added without a default (existing rows read NULL upstream too), a plain
  index added, a default changed (only later inserts see it, and they arrive with full
  images). The target's columns are brought to the metadata in place.
- ``recopy``: existing rows change upstream, in ways only the source can say faithfully: a
  column added with a default (a literal, or an expression MariaDB evaluated per row at ALTER
  time) or NOT NULL (its implicit default), a type, length, charset or collation changed
  (MODIFY, CHANGE, CONVERT TO), a column renamed, a unique or primary key added or dropped
  (an index dropped by name may have been unique), a table replaced (CREATE OR REPLACE), or a
  different table now holds the name (the target of a RENAME, e.g. a gh-ost/pt-osc cut-over).
  The span copies its table again from the source into an emptied target with the initial-
  load machinery and streams on from the copy's low watermark. Anything this module does not
  recognise is a ``recopy`` too: slower, never wrong.
- ``leave``: the name was renamed away and nothing holds it now: the name's target is dropped
  (the rows live on under the new name, whose span copies them).
- ``drop`` / ``truncate``: the table is dropped / emptied.
- ``ignore``: the name is unchanged by the statement (e.g. named in a RENAME whose net effect
  on it is nothing) and there is no metadata to reconcile.
"""

from __future__ import annotations

import re
from typing import Literal

from contracts.events.rows import DdlExecutedV1, TableMetaV1
from libs.mysql_statements import IDENT, alter_clauses, ddl_form, renames, strip_comments, unquote

DdlAction = Literal["drop", "truncate", "reconcile", "recopy", "leave", "ignore"]

# ALTER clauses that never change an existing row's values.
_KEEPS_ROWS = [re.compile(p, re.IGNORECASE | re.DOTALL) for p in (
    r"ADD\s+(INDEX|KEY|FULLTEXT|SPATIAL)\b.*",
    r"ADD\s+(CONSTRAINT\s+(" + IDENT + r"\s+)?)?(FOREIGN\s+KEY|CHECK)\b.*",
    r"DROP\s+(FOREIGN\s+KEY|CONSTRAINT|CHECK)\b.*",
    r"RENAME\s+(INDEX|KEY)\b.*",
    r"ALTER\s+(COLUMN\s+)?" + IDENT + r"\s+(SET\s+DEFAULT\b.*|DROP\s+DEFAULT)",
    r"(ALGORITHM|LOCK)\s*=?\s*\w+",
    r"(COMMENT|ENGINE|AUTO_INCREMENT|ROW_FORMAT|KEY_BLOCK_SIZE|STATS_\w+)\s*=?\s*.*",
    r"FORCE",
)]
_DROP_COLUMN = re.compile(r"DROP\s+(COLUMN\s+)?(IF\s+EXISTS\s+)?(?!(INDEX|KEY|PRIMARY|FOREIGN|CONSTRAINT|"
                          r"CHECK|PARTITION|SYSTEM)\b)(?P<name>" + IDENT + r")\s*(RESTRICT|CASCADE)?",
                          re.IGNORECASE | re.DOTALL)
_ADD_COLUMN = re.compile(r"ADD\s+(COLUMN\s+)?(IF\s+NOT\s+EXISTS\s+)?(?!(INDEX|KEY|FULLTEXT|SPATIAL|"
                         r"CONSTRAINT|UNIQUE|PRIMARY|FOREIGN|CHECK|PARTITION|PERIOD|SYSTEM)\b)"
                         r"(?P<name>" + IDENT + r")\s+(?P<rest>.*)", re.IGNORECASE | re.DOTALL)
# What an added column's definition may hold and still read NULL in every existing row.
_FILLS_ROWS = re.compile(r"\b(DEFAULT\s+(?!NULL\b)|NOT\s+NULL|AUTO_INCREMENT|GENERATED|AS\s*\(|"
                         r"TIMESTAMP|SERIAL|PRIMARY|UNIQUE)", re.IGNORECASE)


def dropped_columns(statement: str) -> tuple[str, ...]:
    """The columns an ALTER TABLE drops (``DROP [COLUMN] [IF EXISTS] c``), unquoted: the only
    columns a reconcile removes from a target, so a target's own columns (an operator's extra
    columns on a table that existed before the changefeed) stay."""
    clauses = alter_clauses(strip_comments(statement)) or []
    found = (_DROP_COLUMN.fullmatch(c.strip()) for c in clauses)
    return tuple(unquote(m.group("name")) for m in found if m is not None)


def rename_role(ddl: DdlExecutedV1) -> Literal["unchanged", "renamed_away", "replaced"] | None:
    """For a statement that renames tables: what it did to the event's own name. None when
    the statement renames nothing."""
    pairs = renames(ddl.statement, ddl.database)
    if not pairs:
        return None
    # name -> the original name of the table that holds it now (None: nothing holds it)
    holder: dict[tuple[str, str], tuple[str, str] | None] = {}
    for old, new in pairs:
        held = holder.get(old, old)
        holder[old] = None
        holder[new] = held
    me = (ddl.database, ddl.table)
    now = holder.get(me, me)
    if now is None:
        return "renamed_away"
    return "unchanged" if now == me else "replaced"


def _clause_keeps_rows(clause: str, meta: TableMetaV1 | None) -> bool:
    if any(p.fullmatch(clause) for p in _KEEPS_ROWS):
        return True
    if _DROP_COLUMN.fullmatch(clause):
        return True
    added = _ADD_COLUMN.fullmatch(clause)
    if added is None or _FILLS_ROWS.search(added.group("rest")):
        return False
    if meta is not None:
        # The server's word over the text's: a column it made NOT NULL has a value in every row.
        name = unquote(added.group("name"))
        column = next((c for c in meta.columns if c.name == name), None)
        if column is None or not column.nullable:
            return False
    return True


def ddl_action(ddl: DdlExecutedV1) -> DdlAction:
    """What ``ddl`` does to its target (see the module docstring). Never the statement text
    itself: it is MySQL syntax and the target may be PostgreSQL or SQLite."""
    statement = strip_comments(ddl.statement)
    form = ddl_form(statement)
    if form == "drop_table":
        return "drop"
    if form == "truncate":
        return "truncate"
    role = rename_role(ddl)
    if role == "renamed_away":
        return "leave"
    if role == "replaced":
        return "recopy"
    if role == "unchanged" and form != "alter_table":
        return "ignore"
    if form in ("create_or_replace_table", "create_unique_index", "drop_index"):
        return "recopy"
    if form == "create_index":
        # Without metadata (capture read the table behind a later DDL) the rows that follow
        # bring the index, as they bring columns.
        return "reconcile" if ddl.meta_after is not None else "ignore"
    if form == "create_table":
        return "reconcile" if ddl.meta_after is not None else "ignore"
    clauses = alter_clauses(statement)
    if clauses is not None:
        if all(_clause_keeps_rows(c, ddl.meta_after) for c in clauses):
            return "reconcile" if ddl.meta_after is not None else "ignore"
        return "recopy"
    return "reconcile" if ddl.meta_after is not None else "ignore"
