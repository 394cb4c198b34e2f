"""Table checksums and diffs that hold across MariaDB, PostgreSQL and SQLite.

The same data comes back from three drivers in different Python types: an unsigned bigint is an
``int`` from pymysql but a ``Decimal`` from PostgreSQL's numeric(20) and a ``str`` from SQLite's
TEXT; JSON is text from MariaDB and a dict from jsonb; BIT is bytes from MySQL and an int
elsewhere. Every value is first brought to one canonical, type-tagged text (``normalize``), so
rows compare equal exactly when they hold the same data:

- numbers (int, Decimal, float, bool): the shortest exact decimal, ``1.50`` == ``1.5`` == ``1.5e0``;
  single-precision FLOAT columns compare at float32 precision;
- bytes: hex; a geometry (MariaDB's internal format, as every sink reads it back): its SRID
  and its WKB's hex; str: itself; JSON: parsed and re-dumped with sorted keys; a value whose text
  would pass 64 KiB: its tag, ``#``, its length and the SHA-256 of its bytes (a 64 MB row
  costs one hash instead of a 128 MB hex text escaped into JSON);
- datetime: ``YYYY-MM-DD HH:MM:SS.ffffff`` (aware values converted to UTC); date: ISO;
  time/timedelta: signed microseconds;
- NULL: its own tag, so NULL differs from ``''``, ``0`` and ``'null'``.

Passing ``ColumnV1`` objects as columns (instead of names) lets text be read as the column's
kind (a SQLite TEXT decimal, datetime or time), which names alone cannot tell apart from strings.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from decimal import Decimal, InvalidOperation
from typing import Any

from contracts.events.rows import ColumnV1
from libs.codec.decode import canonical_json
from libs.codec.geometry import split_internal

Column = str | ColumnV1
Row = Mapping[str, Any] | Sequence[Any]

_TIME_RE = re.compile(r"^(-)?(\d+):(\d{2}):(\d{2})(?:\.(\d{1,6}))?$")
_LONG = 64 * 1024
"""Normalised text longer than this is replaced by its digest (``#`` never starts a hex text,
and a short text that looked like a digest would have to name a length it does not have)."""


def _digest(tag: str, data: bytes) -> str:
    return f"{tag}#{len(data)}:{hashlib.sha256(data).hexdigest()}"


def _long_text(tag: str, text: str) -> str:
    if len(text) <= _LONG:
        return tag + text
    return _digest(tag, text.encode("utf-8", "surrogatepass"))


def _number(value: Any) -> str:
    if isinstance(value, float):
        value = Decimal(repr(value))
    elif not isinstance(value, Decimal):
        value = Decimal(str(value).strip())
    if value.is_nan() or value.is_infinite():
        return "#" + str(value)
    if value == 0:
        return "#0"  # -0, 0.00 and 0E-10 are one number
    text = format(value.normalize(), "f")
    return "#" + text


def _float32(value: Any) -> str:
    """The shortest decimal that reads back as the same float32 (MySQL FLOAT precision)."""
    packed = struct.pack("<f", float(value))
    f32 = struct.unpack("<f", packed)[0]
    for digits in range(1, 10):
        text = f"{f32:.{digits}g}"
        try:
            same = struct.pack("<f", float(text)) == packed
        except OverflowError:  # rounded up past FLT_MAX (3.403e38 near the largest float): not it
            continue
        if same:
            return _number(Decimal(text))
    return _number(f32)


def _micros(delta: timedelta) -> int:
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def _time_text(text: str) -> str | None:
    m = _TIME_RE.match(text.strip())
    if not m:
        return None
    sign, h, mi, s, frac = m.groups()
    micros = ((int(h) * 60 + int(mi)) * 60 + int(s)) * 1_000_000 + int((frac or "0").ljust(6, "0"))
    return f"I{-micros if sign else micros}"


def _json(value: Any) -> str:
    return _long_text("J", canonical_json(value))


def _geometry(value: bytes) -> str:
    """``G<srid>:<wkb hex>``: the SRID shown apart, so a diff says which of the two differs."""
    srid, wkb = split_internal(value)
    if 2 * len(wkb) > _LONG:
        return _digest(f"G{srid}:", wkb)
    return f"G{srid}:{wkb.hex()}"


def _is_float32(column: ColumnV1) -> bool:
    m = re.match(r"\s*(float|real)\s*(?:\(\s*(\d+)\s*\))?", column.sql_type, re.IGNORECASE)
    if not m or m.group(1).lower() != "float":
        return False
    return m.group(2) is None or int(m.group(2)) <= 24


def normalize(value: Any, column: ColumnV1 | None = None) -> str:
    """One canonical, type-tagged text per value (see the module docstring)."""
    if value is None:
        return "N"
    kind = column.kind if column is not None else None
    if isinstance(value, memoryview | bytearray):
        value = bytes(value)
    try:
        if kind == "json" or (kind is None and isinstance(value, dict | list)):
            return _json(value)
        if kind in ("int", "bit") and isinstance(value, bytes):
            return _number(int.from_bytes(value, "big"))
        if kind == "float" and column is not None and _is_float32(column):
            return _float32(value)
        if kind in ("int", "bit", "float", "decimal") and not isinstance(value, bytes):
            return _number(value)
        if kind in ("datetime", "timestamp") and isinstance(value, str):
            value = datetime.fromisoformat(value)
        if kind == "date" and isinstance(value, str):
            value = date.fromisoformat(value)
        if kind == "time" and isinstance(value, str):
            parsed = _time_text(value)
            if parsed is not None:
                return parsed
        if kind in ("string", "set") and isinstance(value, bytes):
            value = value.decode()
        if kind == "geometry" and isinstance(value, bytes):
            return _geometry(value)
    except (ValueError, InvalidOperation, TypeError, UnicodeDecodeError):
        pass  # not what the kind says: compare it as whatever it is
    if isinstance(value, bool):
        return _number(int(value))
    if isinstance(value, int | Decimal | float):
        return _number(value)
    if isinstance(value, bytes):
        return _digest("B", value) if 2 * len(value) > _LONG else "B" + value.hex()
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return "T" + value.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(value, date):
        return "D" + value.isoformat()
    if isinstance(value, timedelta):
        return f"I{_micros(value)}"
    if isinstance(value, dtime):
        return f"I{((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + value.microsecond}"
    if isinstance(value, dict | list):
        return _json(value)
    return _long_text("S", str(value))


def _name(column: Column) -> str:
    return column.name if isinstance(column, ColumnV1) else column


def _spec(column: Column) -> ColumnV1 | None:
    return column if isinstance(column, ColumnV1) else None


def _values(row: Row, names: Sequence[str]) -> list[Any]:
    if isinstance(row, Mapping):
        return [row.get(n) for n in names]
    values = list(row)
    if len(values) != len(names):
        raise ValueError(f"row has {len(values)} values for {len(names)} columns")
    return values


def normalize_row(row: Row, columns: Sequence[Column]) -> tuple[str, ...]:
    names = [_name(c) for c in columns]
    return tuple(normalize(v, _spec(c)) for v, c in zip(_values(row, names), columns, strict=True))


def table_checksum(rows: Iterable[Row], columns: Sequence[Column],
                   key: Sequence[str]) -> tuple[int, str]:
    """``(row count, sha256 hex)`` over normalised rows, independent of row order."""
    names = [_name(c) for c in columns]
    missing = [k for k in key if k not in names]
    if missing:
        raise ValueError(f"key columns {missing} are not among the columns")
    key_pos = [names.index(k) for k in key]
    norms = [normalize_row(row, columns) for row in rows]
    return len(norms), _rows_digest(norms, key_pos)


def _rows_digest(norms: Iterable[tuple[str, ...]], key_pos: Sequence[int]) -> str:
    """The sha256 hex of normalised rows in key order (``table_checksum``'s digest)."""
    lines = sorted((tuple(norm[i] for i in key_pos), json.dumps(norm, ensure_ascii=False)) for norm in norms)
    digest = hashlib.sha256()
    for _, line in lines:
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest()


@dataclass
class TableDiff:
    """How two tables differ by key; ``str(diff)`` is a short report for assertion messages."""

    columns: list[str]
    key: list[str]
    upstream_count: int = 0
    downstream_count: int = 0
    missing: list[tuple[Any, ...]] = field(default_factory=list)  # upstream keys not downstream
    extra: list[tuple[Any, ...]] = field(default_factory=list)  # downstream keys not upstream
    different: list[tuple[tuple[Any, ...], dict[str, tuple[Any, Any]]]] = field(default_factory=list)
    duplicate_keys: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)  # (side, key)
    max_examples: int = 5
    upstream_digest: str = ""
    """``table_checksum``'s digest of the upstream rows (computed from the same normalisation)."""
    downstream_digest: str = ""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.different or self.duplicate_keys)

    def __bool__(self) -> bool:
        """True when there *is* a difference, so ``assert not diff, str(diff)`` reads well."""
        return not self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"tables equal ({self.upstream_count} rows)"
        n = self.max_examples
        lines = [f"tables differ: upstream {self.upstream_count} rows, downstream "
                 f"{self.downstream_count} rows; {len(self.missing)} missing, {len(self.extra)} extra, "
                 f"{len(self.different)} different, {len(self.duplicate_keys)} duplicate keys"]
        if self.missing:
            lines.append(f"  missing downstream (key {self.key}): {self.missing[:n]}")
        if self.extra:
            lines.append(f"  extra downstream (key {self.key}): {self.extra[:n]}")
        for k, cols in self.different[:n]:
            detail = ", ".join(f"{c}: {u!r} != {d!r}" for c, (u, d) in cols.items())
            lines.append(f"  different at {k}: {detail}")
        if self.duplicate_keys:
            lines.append(f"  duplicate keys: {self.duplicate_keys[:n]}")
        return "\n".join(lines)


def compare_tables(upstream_rows: Iterable[Row], downstream_rows: Iterable[Row], key: Sequence[str],
                   columns: Sequence[Column] | None = None, max_examples: int = 5) -> TableDiff:
    """Diff two row sets by ``key`` after normalisation (columns default to the rows' own keys)."""
    up = list(upstream_rows)
    down = list(downstream_rows)
    if columns is None:
        seen: dict[str, None] = {}
        for row in [*up, *down]:
            if not isinstance(row, Mapping):
                raise ValueError("rows without column names need explicit columns")
            seen.update(dict.fromkeys(row))
        columns = list(seen)
    names = [_name(c) for c in columns]
    key_pos = [names.index(k) for k in key]
    diff = TableDiff(columns=names, key=list(key), upstream_count=len(up),
                     downstream_count=len(down), max_examples=max_examples)

    Index = dict[tuple[str, ...], tuple[tuple[str, ...], list[Any]]]

    def index(rows: list[Row], side: str) -> tuple[Index, str]:
        """Rows by normalised key, and the digest of all of them (duplicates included)."""
        out: Index = {}
        norms = []
        for row in rows:
            raw = _values(row, names)
            norm = normalize_row(row, columns)
            norms.append(norm)
            k = tuple(norm[i] for i in key_pos)
            if k in out:
                diff.duplicate_keys.append((side, tuple(raw[i] for i in key_pos)))
            out[k] = (norm, raw)
        return out, _rows_digest(norms, key_pos)

    up_index, diff.upstream_digest = index(up, "upstream")
    down_index, diff.downstream_digest = index(down, "downstream")
    for k, (norm, raw) in sorted(up_index.items()):
        if k not in down_index:
            diff.missing.append(tuple(raw[i] for i in key_pos))
            continue
        other_norm, other_raw = down_index[k]
        if norm != other_norm:
            cols = {names[i]: (raw[i], other_raw[i]) for i in range(len(names)) if norm[i] != other_norm[i]}
            diff.different.append((tuple(raw[i] for i in key_pos), cols))
    for k, (_, raw) in sorted(down_index.items()):
        if k not in up_index:
            diff.extra.append(tuple(raw[i] for i in key_pos))
    return diff
