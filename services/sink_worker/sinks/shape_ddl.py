"""The source table's shape (``TableShapeV1``) as each downstream can express it: pure functions
from a target table to the clauses and statements the SQL sinks put in their DDL.

What each dialect gets (DESIGN.md "Table shape per downstream"):

- MySQL/MariaDB: the column's charset and collation, NOT NULL, DEFAULT (literal and
  expression), AUTO_INCREMENT, COMMENT; every secondary index (prefix, multi-column,
  descending, FULLTEXT) by its source name; the table's charset, collation and comment.
- PostgreSQL: NOT NULL, DEFAULT where it has the same meaning (literals; CURRENT_TIMESTAMP and
  CURRENT_DATE), secondary indexes (a prefix part as ``left(col, n)``); case-insensitive source
  collations as a nondeterministic ICU collation when the changefeed asks for it.
- SQLite: NOT NULL, DEFAULT (literals; CURRENT_TIMESTAMP/CURRENT_DATE), secondary indexes (a
  prefix part as ``substr(col, 1, n)``), ``COLLATE NOCASE`` under the same option.

Rules every dialect follows:

- A unique index over a column prefix, or over columns the apply path does not know as a unique
  key, is created as a plain index: the apply path removes conflicting holders only for the
  unique keys of the metadata, so partitions applying in parallel could otherwise meet a
  transient duplicate the source never had (the source enforces the constraint already).
- An index whose columns the target lacks (left out by table rules) is not created; an index
  that is exactly the target's key is the primary key already.
- ``ON UPDATE CURRENT_TIMESTAMP`` is left out: rows arrive with every column set, and MySQL
  would overwrite an unchanged timestamp with the downstream's clock when another column changes.
- A zero-date default ('0000-00-00') is left out (strict SQL modes refuse it downstream).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence

from contracts.events.rows import ColumnShapeV1, ColumnV1, IndexV1, TableShapeV1, shape_of
from services.sink_worker.sinks.base import TargetTable

Quote = Callable[[str], str]

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_NOW = re.compile(r"(current_timestamp|now|localtimestamp|localtime)\s*(\(\s*(\d*)\s*\))?", re.IGNORECASE)
_TODAY = re.compile(r"(curdate|current_date)\s*(\(\s*\))?", re.IGNORECASE)
_LOB = re.compile(r"^(tiny|medium|long)?(text|blob)\b|^json\b", re.IGNORECASE)
_NUMERIC_KINDS = ("int", "float", "decimal", "bit")
_TEXT_KINDS = ("string", "set")
PG_NAME_MAX = 63


def table_shape(table: TargetTable) -> TableShapeV1 | None:
    return shape_of(table.meta)


def column_shapes(table: TargetTable) -> dict[str, ColumnShapeV1]:
    shape = table_shape(table)
    return {c.name: c for c in shape.columns} if shape is not None else {}


def not_null(table: TargetTable, column: ColumnV1) -> bool:
    """Key columns always; other columns as the source declares them when the shape is known
    (metadata without a shape came from the binlog alone, or from an older capture, and keeps
    the nullable columns it always had)."""
    return column.name in table.key or (table_shape(table) is not None and not column.nullable)


def is_case_insensitive(collation: str | None) -> bool:
    """A MySQL/MariaDB collation that compares case-insensitively (``_ci``; ``_ai_ci`` too)."""
    return bool(collation) and str(collation).lower().endswith("_ci")


def folds_case(table: TargetTable, column: ColumnV1) -> bool:
    """The column takes a case-insensitive collation on PostgreSQL/SQLite: the changefeed asks
    for it and the source's collation is case-insensitive."""
    if not table.case_insensitive or column.kind not in _TEXT_KINDS:
        return False
    shape = column_shapes(table).get(column.name)
    return shape is not None and is_case_insensitive(shape.collation)


def target_indexes(table: TargetTable) -> list[IndexV1]:
    """The source's secondary indexes the target gets, each marked unique only where the apply
    path knows it as a unique key (see the module doc)."""
    shape = table_shape(table)
    if shape is None:
        return []
    names = {c.name for c in table.meta.columns}
    known_unique = {tuple(k) for k in table.unique_keys}
    out = []
    for index in shape.indexes:
        columns = tuple(p.column for p in index.parts)
        if not set(columns) <= names:
            continue
        whole = all(p.prefix is None for p in index.parts)
        if whole and columns == tuple(table.key):
            continue
        unique = index.unique and whole and columns in known_unique
        out.append(index.model_copy(update={"unique": unique}) if unique != index.unique else index)
    return out


def unnamed_unique_keys(table: TargetTable) -> list[tuple[str, ...]]:
    """The metadata's unique keys no named index of the shape creates (all of them without a
    shape): created as unnamed UNIQUE constraints, as before shapes."""
    named = {tuple(p.column for p in i.parts) for i in target_indexes(table) if i.unique}
    existing = {c.name for c in table.meta.columns}
    return [tuple(k) for k in table.unique_keys
            if k and set(k) != set(table.key) and set(k) <= existing and tuple(k) not in named]


def derived_index_name(table_name: str, index_name: str) -> str:
    """An index name unique across tables (PostgreSQL's and SQLite's index names share one
    namespace per schema/database): ``<table>__<index>``, cut with a hash suffix to 63 bytes."""
    name = f"{table_name}__{index_name}"
    if len(name.encode()) <= PG_NAME_MAX:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    cut = name.encode()[:PG_NAME_MAX - 11].decode(errors="ignore")
    return f"{cut}_{digest}"


def _zero_date(value: str) -> bool:
    return value.startswith("0000-00-00")


def _sql_string(value: str, *, backslash: bool) -> str:
    body = value.replace("\\", "\\\\") if backslash else value
    return "'" + body.replace("'", "''") + "'"


# ---------------------------------------------------------------------------- MySQL / MariaDB


def mysql_default(column: ColumnV1, shape: ColumnShapeV1, sql_type: str) -> str | None:
    """The DEFAULT clause's value as MySQL/MariaDB spell it, None for none."""
    value = shape.default
    if value is None or (not shape.default_expression and _zero_date(value)):
        return None
    if shape.default_expression:
        # CURRENT_TIMESTAMP stays bare (every version takes it so); other expressions go in
        # parentheses, the form both MariaDB 10.2+ and MySQL 8.0.13+ accept.
        return value if _NOW.fullmatch(value) else f"({value})"
    if column.kind in _NUMERIC_KINDS and _NUMBER.fullmatch(value):
        return value
    literal = _sql_string(value, backslash=True)
    # MySQL 8 takes a TEXT/BLOB/JSON default only as an expression; MariaDB takes both.
    return f"({literal})" if _LOB.match(sql_type.strip()) else literal


def mysql_column_clauses(table: TargetTable, column: ColumnV1, sql_type: str, *,
                         added: bool = False) -> tuple[str, str]:
    """(clauses before the NULL/NOT NULL word, clauses after it) of a column definition
    (``added``: of a column added to an existing table, which never becomes AUTO_INCREMENT)."""
    shape = column_shapes(table).get(column.name)
    if shape is None:
        return "", ""
    before = ""
    if column.kind in _TEXT_KINDS and shape.charset and shape.collation:
        before = f" CHARACTER SET {shape.charset} COLLATE {shape.collation}"
    after = ""
    default = mysql_default(column, shape, sql_type)
    if default is not None and not shape.auto_increment:
        after += f" DEFAULT {default}"
    if shape.auto_increment and not added and _leads_an_index(table, column.name):
        after += " AUTO_INCREMENT"
    if shape.comment:
        after += " COMMENT " + _sql_string(shape.comment, backslash=True)
    return before, after


def _leads_an_index(table: TargetTable, name: str) -> bool:
    # InnoDB takes AUTO_INCREMENT only on the first column of some index (a merged target's key
    # starts with the origin column, so its id may lead none).
    firsts = {table.key[0]} if table.key else set()
    firsts |= {i.parts[0].column for i in target_indexes(table) if i.parts[0].prefix is None}
    firsts |= {k[0] for k in unnamed_unique_keys(table)}
    return name in firsts


def mysql_index_clause(q: Quote, index: IndexV1) -> str:
    """The index as a CREATE TABLE body line (``UNIQUE KEY `u` (`a`(8), `b` DESC)``)."""
    parts = ", ".join(q(p.column) + (f"({p.prefix})" if p.prefix else "") + (" DESC" if p.descending else "")
                      for p in index.parts)
    word = {"fulltext": "FULLTEXT KEY", "spatial": "SPATIAL KEY"}.get(index.kind,
                                                                    "UNIQUE KEY" if index.unique else "KEY")
    using = " USING HASH" if index.kind == "hash" else ""
    comment = " COMMENT " + _sql_string(index.comment, backslash=True) if index.comment else ""
    return f"{word} {q(index.name)} ({parts}){using}{comment}"


def mysql_table_options(table: TargetTable) -> str:
    """The CREATE TABLE options: the source's charset, collation and comment when known, else
    utf8mb4_bin (exact comparisons, every character)."""
    shape = table_shape(table)
    if shape is None or not (shape.charset and shape.collation):
        return " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    comment = " COMMENT=" + _sql_string(shape.comment, backslash=True) if shape.comment else ""
    return f" ENGINE=InnoDB DEFAULT CHARSET={shape.charset} COLLATE={shape.collation}{comment}"


# ---------------------------------------------------------------------------- PostgreSQL

PG_CI_COLLATION = "sluice_ci"
"""The nondeterministic ICU collation (case-insensitive, accent-sensitive: ``und-u-ks-level2``)
created in the target's schema when the changefeed folds case."""


def pg_collation_statement(q: Quote, schema: str | None) -> str:
    name = f"{q(schema)}.{q(PG_CI_COLLATION)}" if schema else q(PG_CI_COLLATION)
    return (f"CREATE COLLATION IF NOT EXISTS {name} "
            "(provider = icu, locale = 'und-u-ks-level2', deterministic = false)")


def pg_collation_ref(q: Quote, schema: str | None) -> str:
    return f"{q(schema)}.{q(PG_CI_COLLATION)}" if schema else q(PG_CI_COLLATION)


def pg_default(column: ColumnV1, shape: ColumnShapeV1) -> str | None:
    """The default as PostgreSQL can say it with the same meaning, None when it cannot."""
    value = shape.default
    if value is None or column.kind == "geometry":  # a geometry default is MySQL SQL
        return None
    if shape.default_expression:
        if _NOW.fullmatch(value) and column.kind == "timestamp":
            return "(CURRENT_TIMESTAMP AT TIME ZONE 'UTC')"  # timestamps are kept in UTC
        if _NOW.fullmatch(value) and column.kind == "datetime":
            return "LOCALTIMESTAMP"
        if _TODAY.fullmatch(value) and column.kind == "date":
            return "CURRENT_DATE"
        return None  # uuid(), arithmetic, ...: no translation with the same meaning
    if "\0" in value or _zero_date(value):
        return None
    if column.kind in _NUMERIC_KINDS:
        return value if _NUMBER.fullmatch(value) else None
    if column.kind == "bytes":
        return "'\\x" + value.encode("utf-8", "surrogateescape").hex() + "'::bytea"
    if column.kind == "json" and not _valid_json(value):
        return None
    return _sql_string(value, backslash=False)


def _valid_json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def pg_index_statement(q: Quote, table_ref: str, table: TargetTable, index: IndexV1, *,
                       gist: bool = False) -> str | None:
    """CREATE INDEX for a secondary index (None: one PostgreSQL has no form of, FULLTEXT; a
    SPATIAL one unless ``gist``, PostGIS's geometry columns, where it is a GiST index)."""
    if index.kind == "spatial" and gist:
        cols = ", ".join(q(p.column) for p in index.parts)
        name = q(derived_index_name(table.name, index.name))
        return f"CREATE INDEX IF NOT EXISTS {name} ON {table_ref} USING GIST ({cols})"
    if index.kind in ("fulltext", "spatial"):
        return None
    colmap = {c.name: c for c in table.meta.columns}
    parts = []
    for p in index.parts:
        col = q(p.column)
        if p.prefix:
            kind = colmap[p.column].kind
            col = f"(left({col}, {p.prefix}))" if kind in _TEXT_KINDS else (
                f"(substring({col} from 1 for {p.prefix}))")
        parts.append(col + (" DESC" if p.descending else ""))
    name = q(derived_index_name(table.name, index.name))
    unique = "UNIQUE " if index.unique else ""
    return f"CREATE {unique}INDEX IF NOT EXISTS {name} ON {table_ref} ({', '.join(parts)})"


# ---------------------------------------------------------------------------- SQLite


def sqlite_default(column: ColumnV1, shape: ColumnShapeV1) -> str | None:
    value = shape.default
    if value is None or column.kind == "geometry":
        return None
    if shape.default_expression:
        if _NOW.fullmatch(value) and column.kind == "timestamp":
            return "CURRENT_TIMESTAMP"  # UTC, as the sink keeps timestamps
        if _TODAY.fullmatch(value) and column.kind == "date":
            return "CURRENT_DATE"
        return None
    if _zero_date(value):
        return None
    if column.kind in _NUMERIC_KINDS and _NUMBER.fullmatch(value):
        # BIGINT UNSIGNED is TEXT here (past int64), as are decimals: the default is text too.
        wide = column.kind == "decimal" or re.match(r"bigint\b.*unsigned", column.sql_type, re.IGNORECASE)
        return _sql_string(value, backslash=False) if wide else value
    if column.kind == "bytes":
        return "X'" + value.encode("utf-8", "surrogateescape").hex() + "'"
    return _sql_string(value, backslash=False)


def sqlite_index_statement(q: Quote, table: TargetTable, index: IndexV1) -> str | None:
    if index.kind in ("fulltext", "spatial"):
        return None
    parts = []
    for p in index.parts:
        col = q(p.column)
        if p.prefix:
            col = f"substr({col}, 1, {p.prefix})"
        parts.append(col + (" DESC" if p.descending else ""))
    unique = "UNIQUE " if index.unique else ""
    return (f"CREATE {unique}INDEX IF NOT EXISTS {q(derived_index_name(table.name, index.name))}"
            f" ON {q(table.name)} ({', '.join(parts)})")


def index_names(table: TargetTable, indexes: Sequence[IndexV1], *, derived: bool) -> dict[str, IndexV1]:
    """Downstream index name -> index."""
    return {(derived_index_name(table.name, i.name) if derived else i.name): i for i in indexes}


def _definition(index: IndexV1) -> tuple[object, ...]:
    return (index.unique, index.kind, tuple((p.column, p.prefix, p.descending) for p in index.parts))


def index_changes(wanted: Sequence[IndexV1], existing: Sequence[IndexV1]) -> tuple[list[str], list[IndexV1]]:
    """(names to drop, indexes to create) that bring a MySQL-family target's secondary indexes
    to ``wanted`` by name: a wanted one missing is created; an existing one of another name
    but the same definition as a missing one is dropped (the source renamed it); one whose
    definition changed under its name is dropped and created again. Indexes the source never
    had (an operator's own, the unnamed unique keys) are left alone."""
    have = {i.name: i for i in existing}
    missing = [i for i in wanted if i.name not in have]
    changed = [i for i in wanted if i.name in have and _definition(have[i.name]) != _definition(i)]
    wanted_names = {i.name for i in wanted}
    missing_defs = {_definition(i) for i in missing}
    renamed = [i.name for i in existing if i.name not in wanted_names and _definition(i) in missing_defs]
    return renamed + [i.name for i in changed], missing + changed


def missing_derived(table: TargetTable, existing_names: Sequence[str]) -> list[IndexV1]:
    """The source's indexes a PostgreSQL/SQLite target lacks (by derived name)."""
    have = set(existing_names)
    return [i for i in target_indexes(table) if derived_index_name(table.name, i.name) not in have]


def owned_index_drops(table: TargetTable, existing_names: Sequence[str]) -> list[str]:
    """Indexes of a PostgreSQL/SQLite target that Sluice created for a source index the source
    no longer has (its derived names start with ``<table>__``); others are left alone."""
    wanted = {derived_index_name(table.name, i.name) for i in target_indexes(table)}
    prefix = f"{table.name}__"
    return [n for n in existing_names if n.startswith(prefix) and n not in wanted]
