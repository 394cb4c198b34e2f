"""Foreign keys of a source, and the cascades a changefeed over it cannot show downstream.

MariaDB (and MySQL before 9.x) applies ``ON DELETE``/``ON UPDATE`` ``CASCADE``, ``SET NULL`` and
``SET DEFAULT`` inside InnoDB, below the binlog: only the parent's change is logged, never the
child rows the action deletes or changes. A binlog reader therefore sees nothing happen to the
child, and a downstream fed from the binlog keeps orphans and old parent keys.

This module reads the foreign keys from information_schema (``REFERENTIAL_CONSTRAINTS`` for the
actions, ``KEY_COLUMN_USAGE`` for the columns in order), finds the tables cascading keys connect
(``cascade_groups``: one span each, whose batch carries the cascades out downstream) and names,
for the changefeed-creation answer, every cascading key a changefeed cannot carry out, with why
(see DESIGN.md, "Foreign-key cascades").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from libs.routing import Router, TableRef, Target
from libs.sql_ident import quote_ident
from libs.streams import token
from libs.table_rules import TableRulesError, rules_for

# Actions InnoDB carries out itself, out of the binlog's sight (RESTRICT/NO ACTION refuse instead).
CASCADING_ACTIONS = frozenset({"CASCADE", "SET NULL", "SET DEFAULT"})


@dataclass(frozen=True, order=True)
class ForeignKey:
    """One foreign key of a child table, as information_schema describes it."""

    database: str
    table: str
    name: str
    columns: tuple[str, ...]
    ref_database: str
    ref_table: str
    ref_columns: tuple[str, ...]
    on_delete: str = "RESTRICT"
    on_update: str = "RESTRICT"

    @property
    def cascading(self) -> bool:
        """Whether a change of the parent changes child rows without a binlog event for them."""
        return self.on_delete in CASCADING_ACTIONS or self.on_update in CASCADING_ACTIONS

    @property
    def self_referencing(self) -> bool:
        return (self.database, self.table) == (self.ref_database, self.ref_table)

    def describe(self) -> str:
        actions = [f"ON {what} {action}" for what, action in (("DELETE", self.on_delete),
                                                            ("UPDATE", self.on_update))
                   if action in CASCADING_ACTIONS]
        return (f"{self.database}.{self.table}.{self.name} ({', '.join(self.columns)}) -> "
                f"{self.ref_database}.{self.ref_table} ({', '.join(self.ref_columns)}) "
                + " ".join(actions))


_FK_QUERY = (
    "SELECT k.CONSTRAINT_SCHEMA, k.TABLE_NAME, k.CONSTRAINT_NAME, k.COLUMN_NAME,"
    " k.REFERENCED_TABLE_SCHEMA, k.REFERENCED_TABLE_NAME, k.REFERENCED_COLUMN_NAME,"
    " rc.DELETE_RULE, rc.UPDATE_RULE"
    " FROM information_schema.KEY_COLUMN_USAGE k"
    " LEFT JOIN information_schema.REFERENTIAL_CONSTRAINTS rc"
    "  ON rc.CONSTRAINT_SCHEMA = k.CONSTRAINT_SCHEMA AND rc.TABLE_NAME = k.TABLE_NAME"
    "  AND rc.CONSTRAINT_NAME = k.CONSTRAINT_NAME"
    " WHERE k.REFERENCED_TABLE_NAME IS NOT NULL{where}"
    " ORDER BY k.CONSTRAINT_SCHEMA, k.TABLE_NAME, k.CONSTRAINT_NAME, k.ORDINAL_POSITION")
# One foreign key of SHOW CREATE TABLE: its name and the actions after REFERENCES (an action
# the server does not print is RESTRICT).
_CREATE_FK = re.compile(
    r"CONSTRAINT `((?:[^`]|``)+)` FOREIGN KEY \([^)]*\) REFERENCES [^(]+\([^)]*\)"
    r"((?: ON (?:DELETE|UPDATE) (?:CASCADE|SET NULL|SET DEFAULT|RESTRICT|NO ACTION))*)")
_ACTION = re.compile(r"ON (DELETE|UPDATE) (CASCADE|SET NULL|SET DEFAULT|RESTRICT|NO ACTION)")


def load_foreign_keys(conn: Any, database: str | None = None, table: str | None = None
                      ) -> list[ForeignKey]:
    """Every foreign key of the server (of ``database``, of its ``table``, when given), columns in
    key order. A table's keys are the ones it holds as the child.

    ``conn`` is a DB-API connection to the source (pymysql). MariaDB shows a user with only
    SELECT (capture's and the checks' user) the columns of a foreign key in KEY_COLUMN_USAGE but
    no row of REFERENTIAL_CONSTRAINTS, so the actions of a key without one come from
    ``SHOW CREATE TABLE`` of its table, which SELECT allows.
    """
    where, args = "", []
    if database is not None:
        where, args = " AND k.CONSTRAINT_SCHEMA = %s", [database]
        if table is not None:
            where += " AND k.TABLE_NAME = %s"
            args.append(table)
    with conn.cursor() as cur:
        cur.execute(_FK_QUERY.format(where=where), args)
        rows = [list(r) for r in cur.fetchall()]
        hidden = sorted({(str(r[0]), str(r[1])) for r in rows if r[7] is None})
        for schema, table in hidden:
            cur.execute(f"SHOW CREATE TABLE {quote_ident('mysql', schema)}.{quote_ident('mysql', table)}")
            actions = create_table_actions(str(cur.fetchone()[1]))
            for r in rows:
                if (str(r[0]), str(r[1])) == (schema, table) and r[7] is None:
                    r[7], r[8] = actions.get(str(r[2]), ("RESTRICT", "RESTRICT"))
    return fold_rows(rows)


def create_table_actions(create_table: str) -> dict[str, tuple[str, str]]:
    """Constraint name -> (on delete, on update) of each foreign key of a CREATE TABLE text."""
    out = {}
    for match in _CREATE_FK.finditer(create_table):
        actions = dict(_ACTION.findall(match.group(2)))
        out[match.group(1).replace("``", "`")] = (actions.get("DELETE", "RESTRICT"),
                                                   actions.get("UPDATE", "RESTRICT"))
    return out


def fold_rows(rows: Iterable[Sequence[Any]]) -> list[ForeignKey]:
    """Foreign keys from ``_FK_QUERY``'s rows (one per column, in key order)."""
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for schema, table, name, column, ref_schema, ref_table, ref_column, on_delete, on_update in rows:
        fk = found.setdefault((str(schema), str(table), str(name)), {
            "ref": (str(ref_schema), str(ref_table)), "columns": [], "ref_columns": [],
            "on_delete": str(on_delete).upper(), "on_update": str(on_update).upper()})
        fk["columns"].append(str(column))
        fk["ref_columns"].append(str(ref_column))
    return sorted(ForeignKey(schema, table, name, tuple(fk["columns"]), fk["ref"][0], fk["ref"][1],
                             tuple(fk["ref_columns"]), fk["on_delete"], fk["on_update"])
                  for (schema, table, name), fk in found.items())


@dataclass(frozen=True)
class CascadeWarning:
    """A cascading foreign key of a table the changefeed replicates (or its parent), and why
    the downstream cannot follow it."""

    source: str
    fk: ForeignKey
    reasons: tuple[str, ...]

    @property
    def message(self) -> str:
        return (f"foreign key {self.source}:{self.fk.describe()}: MariaDB applies it below the "
                "binlog, so the child rows it deletes or changes upstream stay unchanged downstream ("
                + "; ".join(self.reasons) + ")")


STREAM_NOT_REPRODUCED = ("Sluice carries cascades out on SQL downstreams only: a NATS downstream "
                         "gets no message for the child rows a parent delete or key update changes")


def cascade_warnings(router: Router, fks_by_source: Mapping[str, Sequence[ForeignKey]],
                     tables: Mapping[str, Sequence[tuple[str, str]]] | None = None, *,
                     stream_sink: bool = False) -> list[CascadeWarning]:
    """Every cascading foreign key whose parent or child the changefeed selects and whose
    cascades its downstream cannot show, with the reasons. A key with both ends selected is
    carried out on a SQL downstream (its tables form one span, ``cascade_groups``), so it is
    named only when something keeps that from being exact:

    - the downstream is a NATS stream (``stream_sink``): cascades are not synthesised there;

    - the filter leaves the child out while the parent is in, or the parent out while the child
      is in (its rows then change upstream with no event the changefeed reads);
    - table rules drop a foreign-key column of the child (the downstream cannot find the rows);
    - the child is merged with other shards into one target without an origin column (a cascade
      of one shard would reach the rows of the others).

    ``tables``: each source's tables, to find merged targets (without it merges are not judged).
    """
    out: list[CascadeWarning] = []
    groups: dict[Target, int] = {}
    if tables is not None:
        try:
            shard_groups = router.shard_groups(TableRef(s, d, t) for s, ts in tables.items() for d, t in ts)
        except ValueError:
            shard_groups = {}  # an ambiguous route is refused by the routing checks with its reason
        groups = {target: len(group.shards) for target, group in shard_groups.items()}
    for source, fks in sorted(fks_by_source.items()):
        for fk in fks:
            if not fk.cascading:
                continue
            child_in = router.filter.selected(fk.database, fk.table)
            parent_in = router.filter.selected(fk.ref_database, fk.ref_table)
            if not (child_in or parent_in):
                continue
            reasons = [STREAM_NOT_REPRODUCED] if stream_sink else []
            if parent_in and not child_in:
                reasons.append(f"the filter leaves out the child {fk.database}.{fk.table} while "
                               f"it selects its parent {fk.ref_database}.{fk.ref_table}")
            if child_in and not parent_in:
                reasons.append(f"the filter leaves out the parent {fk.ref_database}.{fk.ref_table}: "
                               f"its changes, which change {fk.database}.{fk.table}, are never read")
            if child_in:
                try:
                    rules = rules_for(router.table_rules, fk.database, fk.table)
                except TableRulesError:
                    rules = None  # refused by the table-rule checks with its reason
                dropped = [c for c in fk.columns if rules is not None and not rules.kept(c)]
                if dropped:
                    reasons.append(f"table rules drop its column(s) {', '.join(dropped)}")
                try:
                    target = router.route(source, fk.database, fk.table)
                except ValueError:
                    target = None
                if (target is not None and groups.get(target, 1) > 1
                        and router.origin_for(TableRef(source, fk.database, fk.table)) is None):
                    reasons.append(f"the child is merged with {groups[target] - 1} other table(s) into "
                                   f"{target} without an origin_column, so a cascade of one shard "
                                   "would reach the others' rows")
            if reasons:
                out.append(CascadeWarning(source, fk, tuple(reasons)))
    return out


# --- table groups: the tables cascades connect form one span (DESIGN.md, "Foreign-key cascades")

GROUP_PREFIX = "fk~"
"""Start of a group span's table token. ``libs.streams.token`` keeps only ``[A-Za-z0-9_-]``, so
no table's own token can start with it or hold the separators below."""
_MEMBER_SEP, _NAME_SEP = "+", ":"


def cascade_groups(fks: Iterable[ForeignKey], selected: Callable[[str, str], bool]
                   ) -> list[tuple[tuple[str, str], ...]]:
    """The tables of one source that cascading keys connect, among those ``selected``: the
    connected components of the key graph (a self-referencing table alone is one too), each
    sorted, sorted. A key with one end not selected connects nothing (it is named at creation)."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(x: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for fk in fks:
        child, ref = (fk.database, fk.table), (fk.ref_database, fk.ref_table)
        if not fk.cascading or not (selected(*child) and selected(*ref)):
            continue
        parent[find(child)] = find(ref)
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for table in list(parent):
        groups.setdefault(find(table), []).append(table)
    return sorted(tuple(sorted(members)) for members in groups.values())


def group_token(members: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """``(database token, table token)`` of the group span of ``members`` (real names): the first
    member's database, and every member's tokens after ``GROUP_PREFIX``. A function of the
    members only, so every process names a group's span (and its checkpoint) alike."""
    toks = sorted({(token(d), token(t)) for d, t in members})
    return toks[0][0], GROUP_PREFIX + _MEMBER_SEP.join(f"{d}{_NAME_SEP}{t}" for d, t in toks)


def group_members(table_token: str) -> tuple[tuple[str, str], ...] | None:
    """The members' ``(database token, table token)`` of a group span's table token; None for
    the span of one table."""
    if not table_token.startswith(GROUP_PREFIX):
        return None
    out = []
    for part in table_token[len(GROUP_PREFIX):].split(_MEMBER_SEP):
        database, _, table = part.partition(_NAME_SEP)
        out.append((database, table))
    return tuple(out)


# --- DDL that may change the key graph (DESIGN.md, "Foreign-key cascades": "Keys known before
# the first change that depends on them")

_KEY_DDL = re.compile(r"\bFOREIGN\s+KEY\b|\bREFERENCES\b|\bRENAME\b|^\s*CREATE\s+(?:OR\s+REPLACE\s+)?TABLE\b",
                      re.IGNORECASE)
_IDENT = r"(?:`(?:[^`]|``)+`|[A-Za-z0-9_$]+)"
_REFERENCES = re.compile(rf"\bREFERENCES\s+({_IDENT})(?:\s*\.\s*({_IDENT}))?", re.IGNORECASE)


def ddl_may_change_keys(statement: str) -> bool:
    """Whether a DDL statement may add, drop or move a foreign key, by its text alone (the
    binlog's, so the answer is the statement's at its position, whatever the catalog says by
    the time it is read): a CREATE TABLE, anything naming FOREIGN KEY or REFERENCES, a RENAME.
    A false positive costs one read of the keys where the statement is applied."""
    return _KEY_DDL.search(statement) is not None


def referenced_tables(statement: str, database: str) -> list[tuple[str, str]]:
    """The parent tables a DDL statement names after REFERENCES, in order, each once; an
    unqualified name is in ``database`` (the child's, as the server resolves it)."""
    out: list[tuple[str, str]] = []
    for first, second in _REFERENCES.findall(statement):
        ref = (_unquote(first), _unquote(second)) if second else (database, _unquote(first))
        if ref not in out:
            out.append(ref)
    return out


def _unquote(ident: str) -> str:
    return ident[1:-1].replace("``", "`") if ident.startswith("`") else ident


def regrouped(tables: Iterable[tuple[str, str]], fks: Iterable[ForeignKey],
              selected: Callable[[str, str], bool]) -> tuple[tuple[str, str], ...] | None:
    """None when ``tables`` (a span's ``(database token, table token)``: one table, or a group's
    members) are still exactly one span under ``fks``; else the tables, as tokens, of the spans
    its tables now belong to (what discovery will re-form them into)."""
    own = frozenset(tables)
    groups = [frozenset((token(d), token(t)) for d, t in members)
              for members in cascade_groups(fks, selected)]
    now = [next((g for g in groups if table in g), frozenset({table})) for table in own]
    if all(g == own for g in now):
        return None
    return tuple(sorted(set().union(*now)))
