"""A row image's values in their JSON encoding, with their part of a part's size estimate.

Per row change this is most of what capture's own process does with a row (every value of
every before and after image). Most values are already their encoding: an integer column's
``int``, a text column's ``str``. A table whose images have exactly the table's columns, in
order, with those columns of exactly those types, is encoded by ``dict`` and C-level tuple
comparisons; only its other columns (temporal, decimal, binary, ENUM/SET, JSON, ...) go through
``encode_value`` one by one. Anything else (a NULL, a value of another type, other keys) takes
the column-by-column path, which says what is wrong with a value. Both paths give the same
values and the same size, which must stay deterministic: a part is cut where the estimate says,
and a re-read must cut the same parts (``pipeline._send_part``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from libs.codec.encode import UnsupportedValue, encode_value
from libs.codec.table_meta import BinlogColumn, ColumnSpec, TableInfo

# Kinds whose value, when the reader gives exactly this type, is already its JSON encoding
# (encode_value would return it unchanged).
_AS_IS: dict[str | None, type] = {"int": int, "string": str}

_MAX_PLANS = 1024


@dataclass(frozen=True)
class _Plan:
    names: tuple[str, ...]
    as_is: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    """The values of the as-is columns, by position."""
    as_is_types: tuple[type, ...]
    strings: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    """The values of the as-is text columns."""
    as_is_fixed: int
    """The size of the as-is columns but their text values' lengths."""
    others: tuple[tuple[int, ColumnSpec, BinlogColumn], ...]
    """Columns that go through ``encode_value``: position, spec, binlog column."""


def _getter(positions: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        only = positions[0]
        return lambda values: (values[only],)
    return itemgetter(*positions)


def _plan(info: TableInfo, columns: tuple[BinlogColumn, ...]) -> _Plan:
    as_is = [i for i, spec in enumerate(info.columns) if spec.kind in _AS_IS]
    strings = [i for i in as_is if _AS_IS[info.columns[i].kind] is str]
    return _Plan(
        names=tuple(spec.name for spec in info.columns),
        as_is=_getter(as_is),
        as_is_types=tuple(_AS_IS[info.columns[i].kind] for i in as_is),
        strings=_getter(strings),
        as_is_fixed=sum(len(info.columns[i].name) + 6 for i in as_is) + 8 * (len(as_is) - len(strings)),
        others=tuple((i, spec, col) for i, (spec, col) in enumerate(zip(info.columns, columns, strict=True))
                     if spec.kind not in _AS_IS),
    )


# (id(info), id(columns)) -> (info, columns, plan); both kept so their ids cannot be reused.
_plans: dict[tuple[int, int], tuple[TableInfo, tuple[BinlogColumn, ...], _Plan]] = {}


def _plan_of(info: TableInfo, columns: tuple[BinlogColumn, ...]) -> _Plan:
    key = (id(info), id(columns))
    found = _plans.get(key)
    if found is None or found[0] is not info or found[1] is not columns:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        found = _plans[key] = (info, columns, _plan(info, columns))
    return found[2]


def encode_row(info: TableInfo, columns: tuple[BinlogColumn, ...], values: dict[str, Any],
               none_sources: dict[str, str]) -> tuple[dict[str, Any], int]:
    """The row's values encoded, and their part of ``_approx_size`` (made in the same pass)."""
    plan = _plan_of(info, columns)
    if tuple(values) == plan.names:
        row = tuple(values.values())
        if tuple(map(type, plan.as_is(row))) == plan.as_is_types:
            out = dict(values)
            size = plan.as_is_fixed + sum(map(len, plan.strings(row)))
            for i, spec, col in plan.others:
                value = _encoded(spec, col, row[i], none_sources)
                out[spec.name] = value
                size += len(spec.name) + 6 + (len(value) if isinstance(value, str) else 8)
            return out, size
    return _by_column(info, columns, values, none_sources)


def _encoded(spec: ColumnSpec, col: BinlogColumn, value: Any, none_sources: dict[str, str]) -> Any:
    assert spec.kind is not None
    try:
        return encode_value(spec.kind, value, none_source=none_sources.get(spec.name),
                            set_values=col.set_values)
    except UnsupportedValue as exc:
        raise UnsupportedValue(f"column {spec.name} ({spec.sql_type}): {exc}") from None


def _by_column(info: TableInfo, columns: tuple[BinlogColumn, ...], values: dict[str, Any],
               none_sources: dict[str, str]) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    size = 0
    for spec, col in zip(info.columns, columns, strict=True):
        name = spec.name
        value = values.get(name)
        if type(value) is not _AS_IS.get(spec.kind):
            value = _encoded(spec, col, value, none_sources)
        out[name] = value
        size += len(name) + 6 + (len(value) if isinstance(value, str) else 8)
    return out, size
