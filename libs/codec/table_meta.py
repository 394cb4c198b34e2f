"""Table metadata: columns with their kinds, primary and unique keys.

A row is described by the binlog's table map at its position (``binlog_row_metadata=FULL``:
names, types, signedness, charsets, ENUM/SET members, nullability, primary key); that is the
authority (``describe``). information_schema (``load_table_info``) shows the table *now*: it
only adds what the table map lacks (declared SQL types, MariaDB's JSON columns, which are
LONGTEXT plus a ``json_valid`` check, unique keys) when capture knows it describes the table at
the row's position and it agrees with the table map. The initial load and the verifier read it
directly: they read the table now too.

A table without a primary key but with a unique key over NOT NULL columns gets that key as its
``primary_key``: InnoDB itself uses it as the clustered key, and it identifies a row just as
well. A table with neither keeps ``primary_key == []`` and capture reports it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from contracts.events.rows import ColumnKind, ColumnV1, TableMetaV2, TableShapeV1
from libs.codec.encode import kind_for_binlog_type, kind_for_data_type
from libs.codec.geometry import SPATIAL_TYPES
from libs.codec.table_shape import is_mariadb, load_table_shape

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
    shape: TableShapeV1 | None = None
    """Defaults, charsets, collations, comments, indexes (None: not known, e.g. from the binlog)."""
    _meta: TableMetaV2 | None = field(default=None, compare=False, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def unsupported(self) -> list[ColumnSpec]:
        return [c for c in self.columns if c.kind is None]

    def meta(self) -> TableMetaV2:
        if self._meta is None:
            meta = TableMetaV2(
                columns=[ColumnV1(name=c.name, kind=c.kind or "bytes", sql_type=c.sql_type,
                                  nullable=c.nullable) for c in self.columns],
                primary_key=list(self.primary_key),
                unique_keys=[list(k) for k in self.unique_keys],
                shape=self.shape,
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
        srids = _declared_srids(cur, database, table) if any(
            str(c[1]).lower() in SPATIAL_TYPES for c in columns) else {}
        shape = load_table_shape(cur, database, table, mariadb=is_mariadb(conn))
    specs = []
    for name, data_type, column_type, is_nullable in columns:
        kind = kind_for_data_type(str(data_type), is_json=name in json_columns)
        sql_type = "json" if kind == "json" and str(data_type).lower() != "json" else str(column_type)
        if srids.get(str(name)):
            sql_type = f"{sql_type} srid {srids[str(name)]}"
        specs.append(ColumnSpec(str(name), kind, sql_type, str(is_nullable).upper() == "YES"))
    return replace(_with_keys(database, table, specs, index_rows), shape=shape)


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


def _declared_srids(cur: Any, database: str, table: str) -> dict[str, int]:
    """Spatial columns' declared SRIDs (MariaDB ``REF_SYSTEM_ID``, MySQL 8 ``SRID``), which
    COLUMN_TYPE leaves out; 0 (none declared) left out too."""
    queries = (
        # MariaDB: the G_* columns name the column (F_GEOMETRY_COLUMN is empty there).
        "SELECT G_GEOMETRY_COLUMN, SRID FROM information_schema.GEOMETRY_COLUMNS"
        " WHERE G_TABLE_SCHEMA = %s AND G_TABLE_NAME = %s",
        "SELECT COLUMN_NAME, SRS_ID FROM information_schema.COLUMNS"
        " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s AND SRS_ID IS NOT NULL",
    )
    for sql in queries:
        try:
            cur.execute(sql, (database, table))
        except Exception:  # the other server's catalog: try the next spelling
            continue
        return {str(name): int(srid) for name, srid in cur.fetchall() if srid}
    return {}


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
    nullable: bool = True
    key_part: int | None = None
    """This column's place in the table map's primary key (0 first), None when not in it."""


def binlog_primary_key(columns: Sequence[BinlogColumn]) -> tuple[str, ...]:
    """The table map's primary key in key order (not column order: ``PRIMARY KEY (b, a)``).

    The server writes the key it clusters by: the declared primary key, else the first unique
    key over NOT NULL columns, which is what ``_with_keys`` promotes as well.
    """
    parts = sorted((c.key_part, c.name) for c in columns if c.key_part is not None)
    if parts:
        return tuple(name for _, name in parts)
    return tuple(c.name for c in columns if c.is_primary)


def describe(database: str, table: str, columns: Sequence[BinlogColumn],
             catalog: TableInfo | None, later: TableInfo | None = None) -> TableInfo:
    """The metadata of rows with the binlog description ``columns``.

    The binlog is the authority: columns, their order, kinds, nullability, ENUM/SET members
    and the primary key are the table map's. ``catalog`` (information_schema, already known to
    describe the table at the rows' position) only adds what the table map does not carry -
    declared SQL types, MariaDB's JSON (LONGTEXT with a json_valid check), unique keys, whether
    the key was declared - and only when it describes the same table as the binlog
    (``agrees``); otherwise the rows are described from the binlog alone.

    One thing is taken from a catalog that does not hold at the position (``later``, or a
    ``catalog`` that disagrees): a column of the same name whose type capture cannot carry
    (INET4, UUID, ...) is refused, because the table map shows such types as their storage
    (fixed binary) and the rows would otherwise go out as bytes in silence.
    """
    if catalog is None or not agrees(catalog, columns):
        return refuse_charsets(_binlog_only(database, table, columns, catalog or later), columns)
    primary = binlog_primary_key(columns)
    uniques = [k for k in (catalog.primary_key, *catalog.unique_keys) if k and k != primary]
    declared = catalog.declared_primary_key and catalog.primary_key == primary
    info = TableInfo(database, table, catalog.columns, primary, tuple(uniques), declared,
                     shape=catalog.shape)
    return refuse_charsets(reconcile_members(info, columns), columns)


def refuse_charsets(info: TableInfo, columns: Sequence[BinlogColumn]) -> TableInfo:
    """Text, ENUM and SET columns in a character set capture cannot decode exactly
    (``libs.codec.charsets``) marked unsupported: the table is stopped with an incident that
    names the column and its charset, instead of its text going out as bytes or misdecoded."""
    from libs.codec.charsets import decodable, mariadb_charset

    by_name = {c.name: c for c in columns}
    specs: list[ColumnSpec] = []
    changed = False
    for spec in info.columns:
        col = by_name.get(spec.name)
        if (col is not None and spec.kind in ("string", "set", "json")
                and not decodable(col.charset)):
            specs.append(replace(spec, kind=None, sql_type=f"{spec.sql_type} (character set "
                                 f"{mariadb_charset(col.charset)}, which capture cannot decode exactly)"))
            changed = True
        else:
            specs.append(spec)
    return replace(info, columns=tuple(specs), _meta=None) if changed else info


def agrees(catalog: TableInfo, columns: Sequence[BinlogColumn]) -> bool:
    """Whether ``catalog`` and the table map describe one and the same table shape: names in
    order, kinds (a JSON column is LONGTEXT in MariaDB's binlog), nullability, primary key and
    ENUM/SET members (up to the spellings ``reconcile_members`` repairs)."""
    if catalog.names != tuple(c.name for c in columns):
        return False
    for spec, col in zip(catalog.columns, columns, strict=True):
        kind = kind_for_binlog_type(col.type_code, col.charset)
        # kind None: a type capture does not carry, shown in the binlog by its storage.
        if spec.kind is not None and spec.kind != kind and not (spec.kind == "json" and kind == "string"):
            return False
        if spec.nullable != col.nullable or not _members_agree(spec, col):
            return False
    primary = binlog_primary_key(columns)
    if not primary:
        return not catalog.primary_key
    # Several unique NOT NULL keys and no primary: the server's pick may not be the catalog's.
    return primary == catalog.primary_key or primary in catalog.unique_keys


def _members_agree(spec: ColumnSpec, col: BinlogColumn) -> bool:
    from libs.codec.decode import SqlTypeError, parse_sql_type

    binlog = col.set_values if col.set_values is not None else col.enum_values
    if binlog is None:
        return True
    try:
        parsed = parse_sql_type(spec.sql_type)
    except SqlTypeError:
        return False
    if parsed.base not in ("enum", "set"):
        return False
    declared = [str(a) for a in parsed.args]
    members = list(binlog)
    if parsed.base == "enum" and len(members) == len(declared) + 1 and members[0] == "":
        members = members[1:]
    # '' in the binlog: a name the reader could not decode (reconcile_members refuses it).
    return len(members) == len(declared) and all(
        d == m or m == "" or _same_but_lossy(d, m) for d, m in zip(declared, members, strict=True))


def _binlog_only(database: str, table: str, columns: Sequence[BinlogColumn],
                 hint: TableInfo | None) -> TableInfo:
    refused = {c.name: c for c in hint.columns if c.kind is None} if hint is not None else {}
    specs = tuple(refused.get(c.name) or ColumnSpec(
        c.name, kind_for_binlog_type(c.type_code, c.charset), _binlog_sql_type(c), c.nullable)
        for c in columns)
    return TableInfo(database, table, specs, binlog_primary_key(columns), (), False, from_binlog=True)


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
            "geometry": "geometry", None: f"binlog type {col.type_code}"}[kind]
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
