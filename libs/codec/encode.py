"""Column kinds and value encoding, exactly as ``contracts/events/rows.py`` spells them.

The binlog decoder (pymysqlreplication) hands over Python values; this module is the one place
that turns them into the contract's JSON. A value that does not fit its column's kind raises
``UnsupportedValue``: capture reports it and stops the table instead of guessing.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

from pymysqlreplication.constants import FIELD_TYPE, NONE_SOURCE

from contracts.events.rows import ColumnKind
from libs.codec.base64_sliced import b64encode_text
from libs.codec.geometry import SPATIAL_TYPES, GeometryError, check_internal


class UnsupportedValue(ValueError):
    """A value capture cannot publish without corrupting it."""


# information_schema.COLUMNS.DATA_TYPE -> kind. MariaDB's JSON is a LONGTEXT with a
# json_valid() check, so it arrives here as 'longtext' and the caller says whether it is JSON.
_DATA_TYPE_KINDS: dict[str, ColumnKind] = {
    **dict.fromkeys(("tinyint", "smallint", "mediumint", "int", "integer", "bigint", "year"), "int"),
    **dict.fromkeys(("float", "double", "real", "double precision"), "float"),
    **dict.fromkeys(("decimal", "numeric", "fixed"), "decimal"),
    **dict.fromkeys(("char", "varchar", "tinytext", "text", "mediumtext", "longtext", "enum"),
                    "string"),
    "set": "set",
    **dict.fromkeys(("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"), "bytes"),
    "date": "date",
    "datetime": "datetime",
    "timestamp": "timestamp",
    "time": "time",
    "json": "json",
    "bit": "bit",
    **dict.fromkeys(SPATIAL_TYPES, "geometry"),
}

_TEXT_TYPES = frozenset(("tinytext", "text", "mediumtext", "longtext"))


def kind_for_data_type(data_type: str, *, is_json: bool = False) -> ColumnKind | None:
    """The kind of a column from information_schema; None for a type capture does not carry
    (MariaDB's uuid/inet4/inet6, vector ...)."""
    data_type = data_type.lower()
    if is_json and data_type in _TEXT_TYPES:
        return "json"
    return _DATA_TYPE_KINDS.get(data_type)


# Binlog column type -> kind, for a table whose information_schema entry no longer matches the
# binlog (read behind a later DDL). Text and binary share type codes: the charset decides.
_BINLOG_KINDS: dict[int, ColumnKind] = {
    **dict.fromkeys((FIELD_TYPE.TINY, FIELD_TYPE.SHORT, FIELD_TYPE.LONG, FIELD_TYPE.INT24,
                     FIELD_TYPE.LONGLONG, FIELD_TYPE.YEAR), "int"),
    **dict.fromkeys((FIELD_TYPE.FLOAT, FIELD_TYPE.DOUBLE), "float"),
    **dict.fromkeys((FIELD_TYPE.NEWDECIMAL, FIELD_TYPE.DECIMAL), "decimal"),
    FIELD_TYPE.ENUM: "string",
    FIELD_TYPE.SET: "set",
    **dict.fromkeys((FIELD_TYPE.DATE, FIELD_TYPE.NEWDATE), "date"),
    **dict.fromkeys((FIELD_TYPE.DATETIME, FIELD_TYPE.DATETIME2), "datetime"),
    **dict.fromkeys((FIELD_TYPE.TIMESTAMP, FIELD_TYPE.TIMESTAMP2), "timestamp"),
    **dict.fromkeys((FIELD_TYPE.TIME, FIELD_TYPE.TIME2), "time"),
    FIELD_TYPE.JSON: "json",
    FIELD_TYPE.BIT: "bit",
    FIELD_TYPE.GEOMETRY: "geometry",
}
_BINLOG_STRINGS = frozenset((FIELD_TYPE.VARCHAR, FIELD_TYPE.VAR_STRING, FIELD_TYPE.STRING,
                             FIELD_TYPE.BLOB, FIELD_TYPE.TINY_BLOB, FIELD_TYPE.MEDIUM_BLOB,
                             FIELD_TYPE.LONG_BLOB))


def kind_for_binlog_type(type_code: int, charset: str | None) -> ColumnKind | None:
    if type_code in _BINLOG_STRINGS:
        return "bytes" if charset in (None, "binary") else "string"
    return _BINLOG_KINDS.get(type_code)


# pymysqlreplication returns None for these too; only a real NULL may become JSON null.
_NONE_MEANS_BAD = {
    NONE_SOURCE.OUT_OF_DATE_RANGE: "a zero or invalid date (e.g. '0000-00-00')",
    NONE_SOURCE.OUT_OF_DATETIME_RANGE: "a zero or invalid datetime (e.g. '0000-00-00 00:00:00')",
    NONE_SOURCE.OUT_OF_DATETIME2_RANGE: "a zero or invalid datetime (e.g. '0000-00-00 00:00:00')",
    NONE_SOURCE.COLS_BITMAP: "a column missing from the row image (binlog_row_image is not FULL)",
    NONE_SOURCE.JSON_PARTIAL_UPDATE: "a partial JSON update (binlog_row_value_options=PARTIAL_JSON)",
}


def encode_value(kind: ColumnKind, value: Any, *, none_source: str | None = None,
                 set_values: Sequence[str] | None = None) -> Any:
    """The contract's JSON value of one column. ``none_source`` is pymysqlreplication's reason
    for a ``None``; ``set_values`` the SET's members in definition order."""
    if value is None:
        if none_source == NONE_SOURCE.EMPTY_SET:
            return ""
        if none_source in _NONE_MEANS_BAD:
            raise UnsupportedValue(_NONE_MEANS_BAD[none_source])
        return None
    encoder = _ENCODERS[kind]
    try:
        return encoder(value, set_values)
    except UnsupportedValue:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise UnsupportedValue(f"cannot encode {type(value).__name__} as {kind}: {exc}") from None


def _expect(value: Any, types: type | tuple[type, ...], kind: str) -> None:
    if not isinstance(value, types) or isinstance(value, bool):
        raise UnsupportedValue(f"a {type(value).__name__} value in a {kind} column")


def _int(value: Any, _: Sequence[str] | None) -> int:
    _expect(value, int, "int")
    return int(value)


def _float(value: Any, _: Sequence[str] | None) -> float:
    _expect(value, (int, float), "float")
    return float(value)


def _decimal(value: Any, _: Sequence[str] | None) -> str:
    _expect(value, (Decimal, int), "decimal")
    if isinstance(value, Decimal) and not value.is_finite():
        raise UnsupportedValue(f"a non-finite decimal {value}")
    # 'f' keeps every digit and never switches to exponent notation (Decimal('1E+2')).
    return format(value, "f") if isinstance(value, Decimal) else str(value)


def _string(value: Any, _: Sequence[str] | None) -> str:
    _expect(value, str, "string")
    return str(value)


def _set(value: Any, set_values: Sequence[str] | None) -> str:
    if isinstance(value, str):
        return value
    _expect(value, (set, frozenset, list, tuple), "set")
    members: Iterable[str] = value
    if set_values:
        order = {name: i for i, name in enumerate(set_values)}
        unknown = [m for m in members if m not in order]
        if unknown:
            raise UnsupportedValue(f"SET members {unknown} not in the column's definition")
        members = sorted(members, key=order.__getitem__)
    else:
        members = sorted(members)
    return ",".join(members)


def _bytes(value: Any, _: Sequence[str] | None) -> str:
    if value == "":
        # pymysqlreplication hands an empty BLOB/VARBINARY value over as '' rather than b''.
        return ""
    _expect(value, (bytes, bytearray, memoryview), "bytes")
    return b64encode_text(value)


def _geometry(value: Any, _: Sequence[str] | None) -> str:
    _expect(value, (bytes, bytearray, memoryview), "geometry")
    try:
        return b64encode_text(check_internal(bytes(value)))
    except GeometryError as exc:
        raise UnsupportedValue(f"not a geometry in MariaDB's internal format: {exc}") from None


def _date(value: Any, _: Sequence[str] | None) -> str:
    if isinstance(value, dt.datetime) or not isinstance(value, dt.date):
        raise UnsupportedValue(f"a {type(value).__name__} value in a date column")
    return value.isoformat()


def _datetime(value: Any, _: Sequence[str] | None) -> str:
    _expect(value, dt.datetime, "datetime")
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    return str(value.isoformat(timespec="microseconds"))


def _time(value: Any, _: Sequence[str] | None) -> str:
    if isinstance(value, dt.time):
        value = dt.timedelta(hours=value.hour, minutes=value.minute, seconds=value.second,
                             microseconds=value.microsecond)
    _expect(value, dt.timedelta, "time")
    return format_time(value)


def format_time(value: dt.timedelta) -> str:
    """``[-]HH:MM:SS.ffffff``; hours may exceed 24 (MySQL TIME spans +-838 hours)."""
    sign = "-" if value < dt.timedelta(0) else ""
    micros = abs(value) // dt.timedelta(microseconds=1)
    seconds, micro = divmod(micros, 1_000_000)
    minutes, sec = divmod(seconds, 60)
    hours, minute = divmod(minutes, 60)
    return f"{sign}{hours:02d}:{minute:02d}:{sec:02d}.{micro:06d}"


def _json(value: Any, _: Sequence[str] | None) -> str:
    # MariaDB's JSON is text and arrives as the document itself; MySQL's binary JSON arrives
    # parsed (with bytes for strings and keys) and is serialised back.
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return json.dumps(_plain_json(value), ensure_ascii=False, separators=(", ", ": "))


def _plain_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {str(_plain_json(k)): _plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_json(v) for v in value]
    if isinstance(value, Decimal):
        return float(value) if not value == value.to_integral_value() else int(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return format_time(value)
    return value


def _bit(value: Any, _: Sequence[str] | None) -> int:
    if isinstance(value, str):  # pymysqlreplication spells BIT as a string of '0' and '1'
        return int(value, 2) if value else 0
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    _expect(value, int, "bit")
    return int(value)


_ENCODERS: dict[str, Any] = {
    "int": _int, "float": _float, "decimal": _decimal, "string": _string, "set": _set,
    "bytes": _bytes, "date": _date, "datetime": _datetime, "timestamp": _datetime, "time": _time,
    "json": _json, "bit": _bit, "geometry": _geometry,
}
