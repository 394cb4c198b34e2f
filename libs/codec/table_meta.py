"""Table metadata: columns with their kinds, primary and unique keys, from information_schema.

The binlog says which columns a row has (with ``binlog_row_metadata=FULL``), but not the keys
a sink needs nor MariaDB's JSON columns (LONGTEXT plus a ``json_valid`` check), so capture asks
information_schema. information_schema shows the table *now*; when capture reads behind a
later DDL the two disagree, and ``binlog_table_info`` builds the metadata from the binlog's own
column description instead (keys: the binlog's primary key, no unique keys).

A table without a primary key but with a unique key over NOT NULL columns gets that key as its
``primary_key``: InnoDB itself uses it as the clustered key, and it identifies a row just as
well. A table with neither keeps ``primary_key == []`` and capture reports it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from contracts.events.rows import ColumnKind, ColumnV1, TableMetaV1
from libs.codec.encode import kind_for_binlog_type, kind_for_data_type

_JSON_CHECK = re.compile(r"json_valid\(\s*`?([^`)]+)`?\s*\)", re.IGNORECASE)


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: ColumnKind | None  # None: a type capture does not carry
    sql_type: str
    nullable: bool = True


@dataclass(frozen=True)
class TableInfo:
    database: str
    table: str
    columns: tuple[ColumnSpec, ...]
    primary_key: tuple[str, ...] = ()
    unique_keys: tuple[tuple[str, ...], ...] = ()
    declared_primary_key: bool = False
    from_binlog: bool = False
    _meta: TableMetaV1 | None = field(default=None, compare=False, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def unsupported(self) -> list[ColumnSpec]:
        return [c for c in self.columns if c.kind is None]

    def meta(self) -> TableMetaV1:
        if self._meta is None:
            meta = TableMetaV1(
                columns=[ColumnV1(name=c.name, kind=c.kind or "bytes", sql_type=c.sql_type,
                                  nullable=c.nullable) for c in self.columns],
                primary_key=list(self.primary_key),
                unique_keys=[list(k) for k in self.unique_keys],
            )
            object.__setattr__(self, "_meta", meta)
        assert self._meta is not None
        return self._meta


def load_table_info(conn: Any, database: str, table: str) -> TableInfo | None:
    """The table as information_schema shows it now; None when it does not exist."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, IS_NULLABLE FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            (database, table))
        columns = [tuple(r) for r in cur.fetchall()]
        if not columns:
            return None
        cur.execute(
            "SELECT INDEX_NAME, COLUMN_NAME, SUB_PART FROM information_schema.STATISTICS"
            " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s AND NON_UNIQUE = 0"
            " ORDER BY INDEX_NAME = 'PRIMARY' DESC, INDEX_NAME, SEQ_IN_INDEX",
            (database, table))
        index_rows = [tuple(r) for r in cur.fetchall()]
        json_columns = _json_columns(cur, database, table)
    specs = []
    for name, data_type, column_type, is_nullable in columns:
        kind = kind_for_data_type(str(data_type), is_json=name in json_columns)
        sql_type = "json" if kind == "json" and str(data_type).lower() != "json" else str(column_type)
        specs.append(ColumnSpec(str(name), kind, sql_type, str(is_nullable).upper() == "YES"))
    return _with_keys(database, table, specs, index_rows)


def _json_columns(cur: Any, database: str, table: str) -> set[str]:
    # MySQL has no CHECK_CONSTRAINTS.TABLE_NAME before 8.0.16 and real JSON types anyway.
    try:
        cur.execute(
            "SELECT CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS"
            " WHERE CONSTRAINT_SCHEMA = %s AND TABLE_NAME = %s", (database, table))
    except Exception:  # absent table/column on MySQL: no MariaDB JSON columns
        return set()
    found = set()
    for (clause,) in cur.fetchall():
        match = _JSON_CHECK.fullmatch(str(clause).strip())
        if match:
            found.add(match.group(1))
    return found


def _with_keys(database: str, table: str, specs: list[ColumnSpec],
               index_rows: Sequence[tuple[Any, ...]]) -> TableInfo:
    nullable = {c.name: c.nullable for c in specs}
    indexes: dict[str, list[str]] = {}
    prefixed: set[str] = set()
    for index_name, column_name, sub_part in index_rows:
        indexes.setdefault(str(index_name), []).append(str(column_name))
        if sub_part is not None:
            prefixed.add(str(index_name))
    primary = tuple(indexes.pop("PRIMARY", ()))
    # A unique key over a column prefix does not identify a row by the column's value.
    uniques = [tuple(cols) for name, cols in indexes.items() if name not in prefixed]
    declared = bool(primary)
    if not primary:
        not_null = [k for k in uniques if not any(nullable.get(c, True) for c in k)]
        if not_null:
            primary = not_null[0]
            uniques.remove(primary)
    return TableInfo(database, table, tuple(specs), primary, tuple(uniques), declared)


@dataclass(frozen=True)
class BinlogColumn:
    """What the binlog's table map says about one column (FULL row metadata)."""

    name: str
    type_code: int
    charset: str | None = None
    unsigned: bool = False
    is_primary: bool = False
    set_values: tuple[str, ...] | None = None
    enum_values: tuple[str, ...] | None = None


def binlog_table_info(database: str, table: str, columns: Sequence[BinlogColumn],
                      current: TableInfo | None = None) -> TableInfo:
    """Metadata for rows whose binlog columns differ from information_schema's ``current``.

    The binlog decides which columns there are; a column that ``current`` still has with a
    kind the binlog agrees with keeps its declared type, others are described from the binlog.
    Keys: the binlog's primary key, else ``current``'s if all its columns are present; unique
    keys from ``current`` whose columns are all present.
    """
    known = {c.name: c for c in current.columns} if current is not None else {}
    specs = []
    for col in columns:
        kind = kind_for_binlog_type(col.type_code, col.charset)
        spec = known.get(col.name)
        if spec is not None and (spec.kind == kind or (spec.kind == "json" and kind == "string")):
            specs.append(spec)
        else:
            specs.append(ColumnSpec(col.name, kind, _binlog_sql_type(col)))
    names = {c.name for c in columns}
    primary = tuple(c.name for c in columns if c.is_primary)
    declared = bool(primary)
    uniques: tuple[tuple[str, ...], ...] = ()
    if current is not None:
        if not primary and current.primary_key and set(current.primary_key) <= names:
            primary, declared = current.primary_key, current.declared_primary_key
        uniques = tuple(k for k in current.unique_keys if set(k) <= names and k != primary)
    return TableInfo(database, table, tuple(specs), primary, uniques, declared, from_binlog=True)


def _binlog_sql_type(col: BinlogColumn) -> str:
    # Best effort: the binlog keeps the type family, not the declared lengths.
    if col.set_values is not None:
        return "set(" + ",".join(_quote(v) for v in col.set_values) + ")"
    if col.enum_values is not None:
        # The reader puts the invalid-value '' first; a declared '' member stays.
        members = col.enum_values[1:] if col.enum_values[:1] == ("",) else col.enum_values
        return "enum(" + ",".join(_quote(v) for v in members) + ")"
    kind = kind_for_binlog_type(col.type_code, col.charset)
    name = {"int": "bigint", "float": "double", "decimal": "decimal", "string": "longtext",
            "bytes": "longblob", "set": "set", "date": "date", "datetime": "datetime(6)",
            "timestamp": "timestamp(6)", "time": "time(6)", "json": "json", "bit": "bit(64)",
            None: f"binlog type {col.type_code}"}[kind]
    return f"{name} unsigned" if col.unsigned and kind == "int" else name


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def reconcile_members(info: TableInfo, columns: Sequence[BinlogColumn]) -> TableInfo:
    """ENUM/SET members as the binlog's values are decoded with them.

    information_schema (and SHOW CREATE TABLE) spell member names in utf8mb3, so a 4-byte
    character ('😀') reads '?': a target created from that would refuse the value. The binlog's
    member list has it right, and the reader maps each value through that list, so it wins.
    The reader decodes those names as UTF-8 and drops ones that are not ('é' of a latin1 ENUM
    becomes ''): its values would be wrong, so such a column is marked unsupported (refused
    visibly) instead.
    """
    from libs.codec.decode import SqlTypeError, parse_sql_type

    by_name = {c.name: c for c in columns}
    specs: list[ColumnSpec] = []
    changed = False
    for spec in info.columns:
        col = by_name.get(spec.name)
        binlog = None if col is None else (col.set_values if col.set_values is not None
                                            else col.enum_values)
        if binlog is None or spec.kind not in ("string", "set"):
            specs.append(spec)
            continue
        try:
            parsed = parse_sql_type(spec.sql_type)
        except SqlTypeError:
            specs.append(spec)
            continue
        if parsed.base not in ("enum", "set"):
            specs.append(spec)
            continue
        declared = [str(a) for a in parsed.args]
        members = list(binlog)
        if parsed.base == "enum" and len(members) == len(declared) + 1 and members[0] == "":
            members = members[1:]  # the reader's index 0: the invalid-value ''
        if members == declared:
            specs.append(spec)
        elif len(members) == len(declared) and all(
                _same_but_lossy(d, m) for d, m in zip(declared, members, strict=True)):
            body = ",".join(_quote(m) for m in members)
            specs.append(replace(spec, sql_type=f"{parsed.base}({body})"))
            changed = True
        else:
            specs.append(replace(spec, kind=None, sql_type=f"{spec.sql_type} (members the binlog "
                                 "reader cannot decode: only UTF-8 compatible ENUM/SET names)"))
            changed = True
    return replace(info, columns=tuple(specs), _meta=None) if changed else info


def _same_but_lossy(declared: str, binlog: str) -> bool:
    """``declared`` is ``binlog`` with each character utf8mb3 cannot hold shown as '?'."""
    return len(declared) == len(binlog) and all(
        d == b or (d == "?" and ord(b) > 0xFFFF) for d, b in zip(declared, binlog, strict=True))
