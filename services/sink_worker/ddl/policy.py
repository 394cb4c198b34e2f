"""What a DDL becomes downstream under the changefeed's ``schema_change_policy`` (as Flink CDC's
``schema.change.behavior``): the pure decision, from the policy, the DDL's ``ddl_action``
(``ddl.plan``) and the statement. The guarantees each policy gives are in DESIGN.md,
"Schema-change policies".

- ``evolve``: the action as ``ddl_action`` says (the target follows the source).
- ``lenient``: nothing is removed downstream. DROP TABLE, TRUNCATE and a rename of the table
  away are not applied; a reconcile keeps the target's columns the source no longer has
  (made nullable); a column rename (``RENAME COLUMN a TO b``, ``CHANGE a b ...``) adds the new
  column beside the old one and fills it from the old one in place, instead of copying the
  table again. Any other DDL that copies the table again keeps the target, widened where it
  must be, with the kept columns' values (``initial_load.empty_for_recopy``).
- ``ignore``: nothing is applied; rows are written with the columns the target has.
- ``stop``: the table stops before the DDL with an incident; once an operator resumes it, that
  one DDL is applied as under ``evolve``. A DDL that changes nothing of the table (``ignore``)
  does not stop it, nor does CREATE TABLE (a new table, not a change of a replicated one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from contracts.events.changefeeds import SchemaChangePolicy
from contracts.events.rows import DdlExecutedV1
from libs.mysql_statements import IDENT, alter_clauses, ddl_form, strip_comments, unquote
from services.sink_worker.ddl.plan import _DROP_COLUMN, DdlAction, dropped_columns
from services.sink_worker.sinks.base import TargetTable

POLICY_STOP_PREFIX = "schema change stopped by schema_change_policy = stop"
"""How an incident of the ``stop`` policy starts (``Unreplicable.error``): its ``resume``
releases the DDL the table stopped at (``SpanMachine.operator_action``)."""

Do = Literal["apply", "skip", "stop", "rename"]


@dataclass(frozen=True)
class PolicyDecision:
    do: Do
    """apply: carry out ``action``; skip: leave the target as it is and move past the DDL;
    stop: stop the table before the DDL with an incident; rename: add each renamed column's
    new name and fill it from the old one (``renamed``), keeping the old column."""
    action: DdlAction
    keep_columns: bool = False
    """A reconcile keeps the target's columns the source no longer has (nullable)."""
    renamed: tuple[tuple[str, str], ...] = ()
    """``rename``: (old, new) column names."""


_RENAME_COLUMN = re.compile(r"RENAME\s+COLUMN\s+(?P<old>" + IDENT + r")\s+TO\s+(?P<new>" + IDENT + r")",
                            re.IGNORECASE | re.DOTALL)
_CHANGE_COLUMN = re.compile(r"CHANGE\s+(COLUMN\s+)?(IF\s+EXISTS\s+)?(?P<old>" + IDENT + r")\s+(?P<new>"
                            + IDENT + r")\s+.+", re.IGNORECASE | re.DOTALL)


def _renamed(clause: str) -> tuple[str, str] | None:
    """(old, new) of one ALTER clause that names a column anew (``RENAME COLUMN a TO b``,
    ``CHANGE a b ...``; ``CHANGE a a ...`` too, with old == new), else None."""
    m = _RENAME_COLUMN.fullmatch(clause.strip()) or _CHANGE_COLUMN.fullmatch(clause.strip())
    return (unquote(m.group("old")), unquote(m.group("new"))) if m is not None else None


def column_renames(statement: str) -> tuple[tuple[str, str], ...] | None:
    """The (old, new) column pairs of an ALTER TABLE whose every clause renames a column, or
    None when it does anything else (or renames nothing)."""
    clauses = alter_clauses(strip_comments(statement))
    if not clauses:
        return None
    pairs: list[tuple[str, str]] = []
    for clause in clauses:
        pair = _renamed(clause)
        if pair is None or pair[0].casefold() == pair[1].casefold():
            return None  # not a rename; or CHANGE a a <type>: a MODIFY, which re-copies
        pairs.append(pair)
    return tuple(pairs) or None


def removes_columns(statement: str) -> bool:
    """Whether an ALTER TABLE drops a column."""
    clauses = alter_clauses(strip_comments(statement)) or []
    return any(_DROP_COLUMN.fullmatch(c.strip()) for c in clauses)


def decide(policy: SchemaChangePolicy, action: DdlAction, statement: str, *,
           released: bool = False, has_meta: bool = True) -> PolicyDecision:
    """What the DDL ``statement`` (whose evolve action is ``action``) becomes under ``policy``;
    ``released``: an operator resumed the table stopped at this DDL (``stop``); ``has_meta``:
    the event carries the table's metadata after it (a lenient rename needs it)."""
    if policy == "evolve" or (policy == "stop" and released):
        return PolicyDecision("apply", action)
    if policy == "ignore":
        return PolicyDecision("skip", action)
    if policy == "stop":
        if action == "ignore":
            return PolicyDecision("skip", action)
        if ddl_form(strip_comments(statement)) == "create_table":
            return PolicyDecision("apply", action)  # a new table changes no replicated one
        return PolicyDecision("stop", action)
    # lenient
    if action in ("drop", "truncate", "leave"):
        return PolicyDecision("skip", action)
    if action == "recopy":
        pairs = column_renames(statement) if has_meta else None
        if pairs is not None:
            return PolicyDecision("rename", "reconcile", keep_columns=True, renamed=pairs)
        return PolicyDecision("apply", action)
    return PolicyDecision("apply", action, keep_columns=True)


def stop_reason(statement: str, ts: int) -> str:
    return (f"{POLICY_STOP_PREFIX}: the DDL at ts {ts} ({statement[:300]!r}) waits for an "
            "operator; resume the incident to apply it as under evolve")


def as_target_has(table: TargetTable, names: Sequence[str]) -> TargetTable:
    """``ignore``: ``table`` with only the columns the target has (``names``, matched without
    case as MySQL and SQLite do), and the keys made of them: a row's other columns are left out
    of its write (``leave_out_columns``). A column the target has and the source no longer
    does takes the target's default in rows inserted since."""
    have = {n.casefold() for n in names}
    columns = [c for c in table.meta.columns if c.name.casefold() in have]
    kept = {c.name for c in columns}
    meta = table.meta.model_copy(update={
        "columns": columns,
        "primary_key": [c for c in table.meta.primary_key if c in kept],
        "unique_keys": [k for k in table.meta.unique_keys if set(k) <= kept]})
    return replace(table, meta=meta, leave_out_columns=True,
                   unique_keys=tuple(k for k in table.unique_keys if set(k) <= kept))


def recopy_drops(ddl: DdlExecutedV1) -> tuple[str, ...]:
    """The columns a re-copy after ``ddl`` removes from a target it keeps (an operator's, whose
    own columns stay) when the source no longer has them: those the DDL drops or renames away,
    and every column the source had right after it. The copy starts from the source as it is
    when the copy begins, past any later DDL of the table, which the span then never sees; a
    column such a DDL dropped was the source's, not the operator's, and must go too."""
    after = ddl.meta_after.columns if ddl.meta_after is not None else ()
    renamed = (_renamed(c) for c in alter_clauses(strip_comments(ddl.statement)) or [])
    return tuple(dict.fromkeys((*dropped_columns(ddl.statement), *(p[0] for p in renamed if p),
                                *(c.name for c in after))))
