"""Whether a target table that already exists downstream can hold a source table's rows: the
creation check of a changefeed reads the target's definition and refuses one that cannot, with
the column and the reason (pure; the readers of each downstream's catalog are in
``libs.target_definitions``).

A target is compared with the table the sink would create itself (``sql_type_for`` in the
target's dialect), so a wider type, extra columns (the rows never name them, so they take their
defaults) and any partitioning are accepted. Refused:

- a column of the source (after table rules and the origin column) the target lacks;
- a column whose type holds less: a smaller integer range, fewer characters or bytes, fewer
  integer digits or decimals, ENUM/SET members missing, or another kind of type altogether;
- a spatial column whose subtype is narrower (a POINT target for a GEOMETRY source); the
  declared SRID is not compared (MariaDB does not enforce it). On PostgreSQL a PostGIS
  ``geometry``/``geometry(Subtype,SRID)`` column holds a spatial source column, as ``bytea``
  (EWKB) does, unless it declares an SRID the source column does not (PostGIS enforces it);
- a unique key (the primary key included) that is not a source key plus perhaps more columns:
  it would refuse rows the source holds together. In a merge that means every unique key must
  hold the origin column, since shards may repeat each other's values.

SQLite columns take any value of any type, so only missing columns are refused there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.codec.decode import SqlTypeError, parse_sql_type, postgis_type_for, sql_type_for

_INF = float("inf")
_INT_BYTES = {"tinyint": 1, "smallint": 2, "mediumint": 3, "int": 4, "integer": 4, "bigint": 8,
              "int2": 2, "int4": 4, "int8": 8}
_TEXT_CAP = {"tinytext": 255, "text": 65_535, "mediumtext": 16_777_215, "longtext": 4_294_967_295}
_BLOB_CAP = {"tinyblob": 255, "blob": 65_535, "mediumblob": 16_777_215, "longblob": 4_294_967_295}
_SAME = {"double precision": "double", "real": "float", "float4": "float", "float8": "double",
         "jsonb": "json", "timestamp without time zone": "datetime", "timestamp": "datetime",
         "datetime": "datetime", "interval": "time", "boolean": "bool"}


# MySQL spatial types, and PostGIS's geometry(Subtype[,srid]) with its subtype in group 2.
_SPATIAL = re.compile(r"(geometry|point|linestring|polygon|multipoint|multilinestring|multipolygon|"
                      r"geometrycollection|geomcollection)\b(?:\s*\(\s*([a-z]+))?")
_SPATIAL_ALIASES = {"geomcollection": "geometrycollection"}


@dataclass(frozen=True)
class TargetColumn:
    name: str
    sql_type: str
    """As the downstream's catalog spells it (MySQL COLUMN_TYPE, PostgreSQL format_type)."""


@dataclass(frozen=True)
class TargetDefinition:
    columns: tuple[TargetColumn, ...]
    unique_keys: tuple[tuple[str, ...], ...]
    """The primary key and every unique index, by column names."""


@dataclass(frozen=True)
class Capacity:
    family: str
    low: float = 0
    high: float = 0
    scale: int = 0
    members: frozenset[str] | None = None


def capacity(sql_type: str) -> Capacity:
    """What values a column type holds, comparable across MySQL and PostgreSQL spellings."""
    text = re.sub(r"\s+", " ", sql_type.strip().lower())
    text = re.sub(r"\(\d+\) without time zone$", " without time zone", text)
    spatial = _SPATIAL.match(text)
    if spatial:
        # A GEOMETRY column (MySQL, or PostGIS without a subtype) takes every subtype.
        named = spatial.group(2) or spatial.group(1)
        base = _SPATIAL_ALIASES.get(named, named)
        return Capacity("geometry", members=None if base == "geometry" else frozenset({base}))
    varying = re.fullmatch(r"(character varying|varchar|character|char|bit varying)\s*(\((\d+)\))?", text)
    if varying:
        return Capacity("text", high=int(varying.group(3)) if varying.group(3) else _INF)
    try:
        parsed = parse_sql_type(text)
    except SqlTypeError:
        return Capacity(text)
    base = parsed.base
    if base in _INT_BYTES:
        bits = 8 * _INT_BYTES[base]
        if parsed.unsigned:
            return Capacity("number", 0, 2 ** bits - 1)
        return Capacity("number", -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if base in ("decimal", "numeric"):
        if not parsed.args:
            return Capacity("number", -_INF, _INF, scale=1000)
        precision, scale = parsed.int_arg(0, 10), parsed.int_arg(1, 0)
        top = 10.0 ** (precision - scale) - 1
        return Capacity("number", 0 if parsed.unsigned else -top, top, scale=scale)
    if base in ("char", "varchar"):
        return Capacity("text", high=parsed.int_arg(0, 1))
    if base in _TEXT_CAP:
        return Capacity("text", high=_TEXT_CAP[base])
    if base in ("binary", "varbinary"):
        return Capacity("bytes", high=parsed.int_arg(0, 1))
    if base in _BLOB_CAP:
        return Capacity("bytes", high=_BLOB_CAP[base])
    if base == "bytea":
        return Capacity("bytes", high=_INF)
    if base in ("enum", "set"):
        return Capacity(base, members=frozenset(str(a) for a in parsed.args))
    if base == "bit":
        return Capacity("bit", high=parsed.int_arg(0, 1))
    if base in ("datetime", "timestamp", "time"):
        return Capacity(_SAME.get(base, base), scale=parsed.int_arg(0, 0))
    return Capacity(_SAME.get(base, base))


def narrower(target: str, wanted: str) -> str | None:
    """Why a column of type ``target`` cannot hold every value of type ``wanted`` (None: it can)."""
    have, need = capacity(target), capacity(wanted)
    if need.family == "geometry" == have.family and have.members is not None and need.members != have.members:
        return f"{target} holds only {'/'.join(sorted(have.members))} values, not every {wanted}"
    if have.family != need.family:
        if need.family in ("enum", "set") and have.family == "text":
            return None  # member names as text: the sink's own PostgreSQL/SQLite choice
        if need.family == "bit" and have.family == "number":
            return None if have.high >= 2 ** need.high - 1 and have.low <= 0 else "a smaller integer range"
        return f"{target} cannot hold {wanted} values"
    if need.members is not None and have.members is not None and not need.members <= have.members:
        return f"members {sorted(need.members - have.members)} are missing"
    if have.low > need.low or have.high < need.high:
        return f"{target} is narrower than {wanted}"
    if have.scale < need.scale:
        return f"{target} keeps fewer fractional digits than {wanted}"
    return None


def fit_problems(meta: TableMetaV1, key: Sequence[str], target: TargetDefinition, dialect: str
                 ) -> list[str]:
    """Each reason the existing ``target`` cannot hold rows of ``meta`` (keyed by ``key``),
    naming the column or key."""
    fold = dialect in ("mysql", "sqlite")  # column names are case-insensitive there

    def norm(name: str) -> str:
        return name.casefold() if fold else name

    have = {norm(c.name): c for c in target.columns}
    problems = []
    for column in meta.columns:
        found = have.get(norm(column.name))
        if found is None:
            problems.append(f"column {column.name}: missing in the existing target")
            continue
        reason = column_problem(column, found.sql_type, dialect)
        if reason:
            problems.append(f"column {column.name}: {reason}")
    source_keys = [tuple(norm(c) for c in k) for k in (key, *meta.unique_keys) if k]
    for unique in target.unique_keys:
        cols = {norm(c) for c in unique}
        if not any(set(k) <= cols for k in source_keys):
            problems.append(f"unique key ({', '.join(unique)}): not a key of the source table (nor one "
                            "with more columns), so rows the source holds together would collide; in a "
                            "merge every unique key needs the origin column")
    return problems


def column_problem(column: ColumnV1, target_type: str, dialect: str) -> str | None:
    """Why a target column of ``target_type`` cannot hold ``column``'s values (None: it can)."""
    if dialect == "sqlite":
        return None
    reason = narrower(target_type, _wanted(column, dialect, target_type))
    if reason is None and column.kind == "geometry" and dialect == "postgresql":
        reason = _srid_conflict(column, target_type)
    return reason


_PG_SRID = re.compile(r"geometry\s*\(\s*[a-z]+\s*,\s*(\d+)\s*\)")


def _srid_conflict(column: ColumnV1, target_type: str) -> str | None:
    """PostGIS refuses a value whose SRID is not the column's declared one (MariaDB does not)."""
    declared = _PG_SRID.search(target_type.lower())
    if declared is None or int(declared.group(1)) == 0:
        return None
    try:
        srid = parse_sql_type(column.sql_type).srid
    except SqlTypeError:
        srid = None
    if srid == int(declared.group(1)):
        return None
    return (f"{target_type} takes only SRID {declared.group(1)} values (PostGIS enforces it), the "
            f"source column declares {'SRID ' + str(srid) if srid else 'no SRID'}")


def _wanted(column: ColumnV1, dialect: str, target_type: str) -> str:
    if (column.kind == "geometry" and dialect == "postgresql"
            and capacity(target_type).family == "geometry"):
        # A PostGIS geometry column: the sink writes EWKB into it (PostGIS casts it), as it
        # would into the geometry(Subtype,SRID) it creates where the extension is installed.
        return postgis_type_for(column)
    return sql_type_for(dialect, column)
