"""Column values between the ROWS contract, the sinks' drivers and comparisons.

Three directions, one module, so every sink agrees on what a value *is*:

- ``decode_value`` / ``decode_row``: the contract's JSON encoding (see ``contracts.events.rows``)
  to Python values a driver accepts: int, float, Decimal, str, bytes, date, datetime, timedelta
  (MySQL TIME is a signed duration up to 838 hours, not a time of day), JSON as text, None.
- ``sql_type_for``: the source (MySQL) column type to the target dialect's column type.
- ``normalize_fetched``: what a driver hands back from a target column to the same Python types
  ``decode_value`` produces (JSON canonicalised), so rows read from MariaDB, PostgreSQL and
  SQLite compare equal to each other and to the decoded source rows.

``parse_sql_type`` also re-renders a MySQL type from its parsed parts, so a type string from the
source never reaches DDL verbatim (no injection through ``enum('x'); DROP ...``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from contracts.events.rows import ColumnKind, ColumnV1, TableMetaV1
from libs.codec.base64_sliced import b64decode_strict
from libs.codec.geometry import (
    MAX_SRID,
    SPATIAL_TYPES,
    ewkb_to_internal,
    mysql_srid_clause,
    pg_geometry_type,
)

# --------------------------------------------------------------------------- source type parsing

_BASE_RE = re.compile(r"\s*([A-Za-z][A-Za-z0-9_]*(?:\s+(?:precision|varying))?)\s*", re.IGNORECASE)
_NUM_RE = re.compile(r"\s*(\d+)\s*")
_MODIFIERS = frozenset({"unsigned", "signed", "zerofill"})


class SqlTypeError(ValueError):
    """A source column type this module cannot parse safely."""


@dataclass(frozen=True)
class SqlType:
    """A parsed MySQL column type: ``decimal(12,2) unsigned`` -> base, args, unsigned."""

    base: str  # lower case: "decimal", "varchar", "enum", "double precision"
    args: tuple[str | int, ...] = ()  # numbers as int, enum/set members as str
    unsigned: bool = False
    srid: int | None = None  # a spatial column's declared SRID (``point srid 4326``)

    def int_arg(self, index: int, default: int) -> int:
        if len(self.args) > index and isinstance(self.args[index], int):
            return int(self.args[index])
        return default

    def mysql(self) -> str:
        """Re-rendered for MySQL DDL: identifiers checked, string members re-quoted."""
        parts: list[str] = []
        for arg in self.args:
            if isinstance(arg, int):
                parts.append(str(arg))
            else:
                parts.append("'" + arg.replace("\\", "\\\\").replace("'", "''") + "'")
        text = self.base + (f"({','.join(parts)})" if parts else "")
        return text + (" unsigned" if self.unsigned else "") + mysql_srid_clause(self.srid)


def parse_sql_type(sql_type: str) -> SqlType:
    """Parse ``information_schema.COLUMNS.COLUMN_TYPE``-style text; raise SqlTypeError otherwise."""
    m = _BASE_RE.match(sql_type)
    if not m:
        raise SqlTypeError(f"cannot parse column type {sql_type!r}")
    base = " ".join(m.group(1).lower().split())
    pos = m.end()
    args: list[str | int] = []
    if pos < len(sql_type) and sql_type[pos] == "(":
        pos += 1
        while True:
            while pos < len(sql_type) and sql_type[pos].isspace():
                pos += 1
            if pos < len(sql_type) and sql_type[pos] == "'":
                # A string literal: '' and \x escapes, as COLUMN_TYPE spells enum/set members.
                pos += 1
                buf: list[str] = []
                while True:
                    if pos >= len(sql_type):
                        raise SqlTypeError(f"unterminated string in column type {sql_type!r}")
                    ch = sql_type[pos]
                    if ch == "\\" and pos + 1 < len(sql_type):
                        buf.append(sql_type[pos + 1])
                        pos += 2
                    elif ch == "'" and sql_type[pos + 1: pos + 2] == "'":
                        buf.append("'")
                        pos += 2
                    elif ch == "'":
                        pos += 1
                        break
                    else:
                        buf.append(ch)
                        pos += 1
                args.append("".join(buf))
            else:
                n = _NUM_RE.match(sql_type, pos)
                if not n:
                    raise SqlTypeError(f"cannot parse arguments of column type {sql_type!r}")
                args.append(int(n.group(1)))
                pos = n.end()
            while pos < len(sql_type) and sql_type[pos].isspace():
                pos += 1
            if pos < len(sql_type) and sql_type[pos] == ",":
                pos += 1
                continue
            if pos < len(sql_type) and sql_type[pos] == ")":
                pos += 1
                break
            raise SqlTypeError(f"cannot parse arguments of column type {sql_type!r}")
    words = sql_type[pos:].lower().split()
    srid: int | None = None
    if base in SPATIAL_TYPES and len(words) == 2 and words[0] == "srid" and words[1].isdigit():
        srid = int(words[1])
        if srid > MAX_SRID:
            raise SqlTypeError(f"SRID out of range in column type {sql_type!r}")
        words = []
    if any(w not in _MODIFIERS for w in words):
        raise SqlTypeError(f"unexpected modifiers in column type {sql_type!r}")
    return SqlType(base=base, args=tuple(args), unsigned="unsigned" in words, srid=srid)


def fsp_of(column: ColumnV1) -> int:
    """Fractional-second digits of a datetime/timestamp/time column (0 when unparsable)."""
    try:
        return min(parse_sql_type(column.sql_type).int_arg(0, 0), 6)
    except SqlTypeError:
        return 6


# --------------------------------------------------------------------------- contract -> Python

_TIME_RE = re.compile(r"^(-)?(\d+):(\d{2}):(\d{2})(?:\.(\d{1,6}))?$")


def parse_time(text: str) -> timedelta:
    """``[-]HH:MM:SS[.ffffff]`` (hours may exceed 24, up to MySQL's 838) to a timedelta."""
    m = _TIME_RE.match(text.strip())
    if not m:
        raise ValueError(f"bad time value {text!r}; expected [-]HH:MM:SS[.ffffff]")
    sign, hours, minutes, seconds, frac = m.groups()
    delta = timedelta(hours=int(hours), minutes=int(minutes), seconds=int(seconds),
                      microseconds=int((frac or "0").ljust(6, "0")))
    return -delta if sign else delta


def format_time(value: timedelta, fsp: int = 6) -> str:
    """The inverse of ``parse_time``, with ``fsp`` fraction digits (how SQLite stores TIME)."""
    micros = (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds
    sign = "-" if micros < 0 else ""
    micros = abs(micros)
    seconds, frac = divmod(micros, 1_000_000)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{sign}{hours:02d}:{minutes:02d}:{secs:02d}"
    return text + (f".{frac:06d}"[: fsp + 1] if fsp > 0 else "")


def format_datetime(value: datetime, fsp: int = 6) -> str:
    """``YYYY-MM-DD HH:MM:SS[.f]`` with exactly ``fsp`` digits: one canonical text per instant."""
    text = value.strftime("%Y-%m-%d %H:%M:%S")
    return text + (f".{value.microsecond:06d}"[: fsp + 1] if fsp > 0 else "")


class CanonicalJson(str):
    """A text ``canonical_json`` made: canonical already, so a checksum need not parse it again
    (a JSON document of many MB costs about a second to parse and dump)."""

    __slots__ = ()


def canonical_json(value: Any) -> str:
    """One text per JSON document: keys sorted, no spaces, non-ASCII kept."""
    if isinstance(value, CanonicalJson):
        return value
    doc = json.loads(value) if isinstance(value, str | bytes | bytearray) else value
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def decode_value(kind: ColumnKind, sql_type: str, v: Any) -> Any:
    """One value from the contract's JSON encoding to the Python value a driver accepts."""
    if v is None:
        return None
    if kind in ("int", "bit"):
        return int(v)
    if kind == "float":
        return float(v)
    if kind == "decimal":
        # From the string (exact digits); a JSON number would already have lost precision.
        return Decimal(str(v))
    if kind in ("string", "set"):
        return str(v)
    if kind == "bytes":
        return b64decode_strict(v) if isinstance(v, str) else bytes(v)
    if kind == "geometry":
        # MariaDB's internal format (SRID + WKB), as every sink binds it before its own encoding.
        return b64decode_strict(v) if isinstance(v, str) else bytes(v)
    if kind == "date":
        return date.fromisoformat(v)
    if kind in ("datetime", "timestamp"):
        parsed = datetime.fromisoformat(v)
        # Timestamps travel as UTC; drop a zone if a producer added one, after converting.
        if parsed.tzinfo is not None:
            parsed = parsed.astimezone(UTC).replace(tzinfo=None)
        return parsed
    if kind == "time":
        return parse_time(v)
    if kind == "json":
        # The document as text (what the contract carries); sinks store it as JSON/jsonb/TEXT.
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    raise ValueError(f"unknown column kind {kind!r}")


def _converter(kind: ColumnKind, sql_type: str) -> Callable[[Any], Any]:
    """``decode_value`` for one column kind, without the per-value dispatch; never given None."""
    if kind in ("string", "set"):
        return lambda v: v if type(v) is str else str(v)
    if kind in ("int", "bit"):
        return lambda v: v if type(v) is int else int(v)
    if kind == "decimal":
        return lambda v: Decimal(v) if type(v) is str else Decimal(str(v))
    if kind in ("datetime", "timestamp"):
        def to_datetime(v: Any) -> datetime:
            parsed = datetime.fromisoformat(v)
            if parsed.tzinfo is not None:
                parsed = parsed.astimezone(UTC).replace(tzinfo=None)
            return parsed
        return to_datetime
    if kind == "json":
        return lambda v: v if type(v) is str else decode_value(kind, sql_type, v)
    return lambda v: decode_value(kind, sql_type, v)


class RowDecoder:
    """``decode_row`` for one table's metadata, prepared once: the apply job decodes hundreds of
    thousands of rows of a few tables, and rebuilding the column set and dispatching on the
    kind per value was a third of that."""

    def __init__(self, meta: TableMetaV1, *, leave_out: bool = False) -> None:
        self.names = frozenset(c.name for c in meta.columns)
        self.leave_out = leave_out
        """An image's columns ``meta`` lacks are left out instead of refused (a target that
        keeps its definition, ``schema_change_policy = ignore``)."""
        # With each converter the type its values already have when they need no conversion
        # (the contract's ints and strings): those are taken as they are, without a call.
        self.columns = [(c.name, _converter(c.kind, c.sql_type), _NATIVE.get(c.kind, _Never))
                        for c in meta.columns]

    def __call__(self, image: Mapping[str, Any]) -> dict[str, Any]:
        if not self.leave_out and not self.names.issuperset(image):
            unknown = set(image) - self.names
            raise ValueError(f"row has columns not in the table metadata: {sorted(unknown)}")
        out: dict[str, Any] = {}
        get = image.get
        for name, convert, native in self.columns:
            v = get(name, _ABSENT)
            if v is _ABSENT:
                continue
            out[name] = v if v is None or type(v) is native else convert(v)
        return out


class _Never:
    """No value is of this type: every value of such a column goes through its converter."""


_ABSENT = object()
_NATIVE: dict[str, type] = {"string": str, "set": str, "int": int, "bit": int, "json": str}
"""Kinds whose converter returns a value of this exact type unchanged (``_converter``)."""


def decode_row(meta: TableMetaV1, image: Mapping[str, Any]) -> dict[str, Any]:
    """A row image from the contract to Python values, in ``meta``'s column order.

    Columns of the image that ``meta`` does not know are an error: writing them would need a
    schema the target does not have yet. (Decoding many rows of one table: ``RowDecoder``.)
    """
    return RowDecoder(meta)(image)


# --------------------------------------------------------------------------- driver -> Python


def _to_int(v: Any) -> int:
    if isinstance(v, bytes | bytearray | memoryview):
        # MySQL BIT(n) comes back as big-endian bytes.
        return int.from_bytes(bytes(v), "big")
    if isinstance(v, str):
        return int(v)
    return int(v)


def normalize_fetched(column: ColumnV1, v: Any, dialect: str = "mysql") -> Any:
    """A value read back from any target to the types ``decode_value`` produces. ``dialect``
    says how the target stores what the value alone does not tell (a geometry is MariaDB's
    internal format in MySQL, EWKB elsewhere: see ``libs.codec.geometry``)."""
    if v is None:
        return None
    kind = column.kind
    if kind == "geometry":
        return bytes(v) if dialect == "mysql" else ewkb_to_internal(v if isinstance(v, str) else bytes(v))
    if kind in ("int", "bit"):
        return _to_int(v)
    if kind == "float":
        return float(v)
    if kind == "decimal":
        return v if isinstance(v, Decimal) else Decimal(str(v))
    if kind in ("string", "set"):
        return v if isinstance(v, str) else bytes(v).decode()
    if kind == "bytes":
        return bytes(v) if not isinstance(v, str) else v.encode()
    if kind == "date":
        if isinstance(v, datetime):
            return v.date()
        return v if isinstance(v, date) else date.fromisoformat(str(v))
    if kind in ("datetime", "timestamp"):
        if isinstance(v, datetime):
            return v if v.tzinfo is None else v.astimezone(UTC).replace(tzinfo=None)
        return datetime.fromisoformat(str(v))
    if kind == "time":
        return v if isinstance(v, timedelta) else parse_time(str(v))
    if kind == "json":
        return CanonicalJson(canonical_json(v))
    raise ValueError(f"unknown column kind {kind!r}")


# --------------------------------------------------------------------------- type mapping

_MYSQL_TEXT = {"tinytext": 255, "text": 65535, "mediumtext": 16777215, "longtext": 4294967295}
_MYSQL_BLOB = {"tinyblob": 255, "blob": 65535, "mediumblob": 16777215, "longblob": 4294967295}
# InnoDB's index key limit with the DYNAMIC row format (MariaDB 10.2+, MySQL 5.7+).
MYSQL_MAX_KEY_BYTES = 3072


def mysql_key_bytes(column: ColumnV1) -> int | None:
    """Index bytes a key column of a MySQL target takes; None for text/blob (no fixed width)."""
    try:
        t = parse_sql_type(column.sql_type)
    except SqlTypeError:
        return None
    if t.base in _MYSQL_TEXT or t.base in _MYSQL_BLOB or t.base == "json":
        return None
    if t.base in ("char", "varchar"):
        return 4 * t.int_arg(0, 1) + 2  # utf8mb4: 4 bytes per character, +2 length bytes
    if t.base in ("binary", "varbinary"):
        return t.int_arg(0, 1) + 2
    if t.base in ("enum", "set"):
        return 8
    if t.base in ("decimal", "numeric"):
        return t.int_arg(0, 10) // 2 + 2
    return 8


def mysql_key_type(column: ColumnV1, budget_bytes: int) -> str:
    """A key column whose source type is TEXT/BLOB: InnoDB cannot index it whole, and a prefix
    index would enforce uniqueness on the prefix only (false conflicts), so it becomes a
    VARCHAR/VARBINARY as long as the key's byte budget allows. Longer values fail loudly at
    insert (strict mode) instead of colliding silently."""
    t = parse_sql_type(column.sql_type)
    if t.base in _MYSQL_BLOB:
        return f"varbinary({max(1, min(budget_bytes, _MYSQL_BLOB[t.base]))})"
    chars = max(1, budget_bytes // 4)
    return f"varchar({min(chars, _MYSQL_TEXT.get(t.base, chars))})"


def _pg_type(column: ColumnV1, t: SqlType | None) -> str:
    kind = column.kind
    base = t.base if t else ""
    if kind == "int":
        if base in ("tinyint", "bool", "boolean", "year"):
            return "smallint"
        if base == "smallint":
            return "integer" if t and t.unsigned else "smallint"
        if base in ("mediumint",):
            return "integer"
        if base in ("int", "integer"):
            return "bigint" if t and t.unsigned else "integer"
        # bigint unsigned goes up to 2**64-1: past PostgreSQL's signed bigint.
        return "numeric(20,0)" if (t is None or t.unsigned) else "bigint"
    if kind == "bit":
        width = t.int_arg(0, 1) if t else 64
        return "bigint" if width <= 63 else "numeric(20,0)"
    if kind == "float":
        # MySQL FLOAT is single precision: real keeps the same value, double would show its noise.
        return "real" if base == "float" and (t is None or t.int_arg(0, 0) <= 24) else "double precision"
    if kind == "decimal":
        if t is None or not t.args:
            # A bare "decimal" comes from capture's binlog fallback, where the declared
            # precision is unknown: unconstrained numeric keeps whatever digits arrive.
            return "numeric"
        return f"numeric({t.int_arg(0, 10)},{t.int_arg(1, 0)})"
    if kind == "string":
        # char(n) -> varchar(n): MySQL strips CHAR padding on read, PostgreSQL's bpchar keeps it.
        if base in ("char", "varchar", "character", "nchar", "nvarchar") and t and t.args:
            return f"varchar({t.int_arg(0, 255)})"
        return "text"
    if kind == "set":
        return "text"
    if kind == "bytes":
        return "bytea"
    if kind == "date":
        return "date"
    if kind in ("datetime", "timestamp"):
        # Without zone: the contract's timestamps are UTC wall-clock values; timestamptz would
        # hand back zone-aware values that then depend on the session TimeZone.
        return f"timestamp({fsp_of(column)})"
    if kind == "time":
        # MySQL TIME is -838:59:59..838:59:59, a duration; PostgreSQL's time stops at 24:00.
        return "interval"
    if kind == "json":
        return "jsonb"
    if kind == "geometry":
        # EWKB; a sink whose database has PostGIS asks for ``postgis_type_for`` instead.
        return "bytea"
    raise ValueError(f"unknown column kind {kind!r}")


def postgis_type_for(column: ColumnV1) -> str:
    """The PostGIS column type of a spatial source column (``geometry(Point,4326)``)."""
    try:
        t = parse_sql_type(column.sql_type)
    except SqlTypeError:
        return "geometry"
    return pg_geometry_type(t.base, t.srid)


def _sqlite_type(column: ColumnV1, t: SqlType | None) -> str:
    kind = column.kind
    if kind in ("int", "bit"):
        # SQLite integers are signed 64-bit: bigint unsigned / bit(64) values may not fit, and
        # INTEGER/NUMERIC affinity would turn a too-large number into a lossy REAL.
        too_wide = (kind == "int" and (t is None or (t.base == "bigint" and t.unsigned))) or (
            kind == "bit" and (t is None or t.int_arg(0, 1) > 63))
        return "TEXT" if too_wide else "INTEGER"
    if kind == "float":
        return "REAL"
    if kind == "decimal":
        # NUMERIC affinity would store 12345678901234567.89 as a REAL: TEXT keeps exact digits.
        return "TEXT"
    if kind in ("bytes", "geometry"):
        return "BLOB"  # a geometry as EWKB (libs.codec.geometry)
    return "TEXT"


def sql_type_for(dialect: str, column: ColumnV1) -> str:
    """The target column type for ``column`` in ``dialect`` (mysql, postgresql, sqlite)."""
    try:
        t: SqlType | None = parse_sql_type(column.sql_type)
    except SqlTypeError:
        t = None
    if dialect == "mysql":
        if column.kind == "timestamp":
            # DATETIME, not TIMESTAMP: the values are UTC already, and a TIMESTAMP column would
            # shift them by the session time zone and may auto-initialise/auto-update.
            fsp = fsp_of(column) if t is not None else 6
            return f"datetime({fsp})" if fsp else "datetime"
        if column.kind == "decimal" and (t is None or not t.args):
            return "decimal(65,30)"  # bare DECIMAL would mean decimal(10,0): see _pg_type
        if t is not None:
            return t.mysql()
        fallback = {
            "int": "bigint", "bit": "bit(64)", "float": "double", "decimal": "decimal(65,30)",
            "string": "longtext", "set": "longtext", "bytes": "longblob", "date": "date",
            "datetime": "datetime(6)", "time": "time(6)", "json": "json", "geometry": "geometry",
        }
        return fallback[column.kind]
    if dialect == "postgresql":
        return _pg_type(column, t)
    if dialect == "sqlite":
        return _sqlite_type(column, t)
    raise ValueError(f"unknown dialect {dialect!r}")


def is_text_like_mysql(column: ColumnV1) -> bool:
    """True when a MySQL target column of this source type cannot be indexed whole."""
    try:
        base = parse_sql_type(column.sql_type).base
    except SqlTypeError:
        return True
    return base in _MYSQL_TEXT or base in _MYSQL_BLOB or base == "json"
