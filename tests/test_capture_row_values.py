"""A row image's values as capture encodes them (``services.capture.row_values``): the fast
path (the table's own columns in order, its int/text columns of exactly those types) gives
exactly what the column-by-column path gives, values and size, over a matrix of kinds, NULLs,
wrong types and images whose keys are not the table's. Pure."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest
from pymysqlreplication.constants import NONE_SOURCE

from libs.codec.encode import UnsupportedValue
from libs.codec.table_meta import BinlogColumn, ColumnSpec, TableInfo
from services.capture.row_values import _by_column, encode_row

_KINDS: dict[str, tuple[str, Any]] = {
    # name: (kind, a value as the binlog reader gives it)
    "id": ("int", 18446744073709551615), "k": ("int", -7), "c": ("string", "héllo 😀" * 3),
    "pad": ("string", ""), "d": ("decimal", Decimal("-123456789.125")), "f": ("float", 1.5),
    "b": ("bytes", b"\x00\xff"), "dt": ("date", dt.date(2024, 2, 29)),
    "dtt": ("datetime", dt.datetime(2024, 2, 29, 23, 59, 58, 123456)),
    "tm": ("time", dt.timedelta(seconds=-5)),
    "j": ("json", {"k": [1, "ü"]}), "st": ("set", {"a", "c"}), "bt": ("bit", b"\x02\x01"),
}

_TABLES = {
    "sysbench": ["id", "k", "c", "pad"],
    "every kind": list(_KINDS),
    "no as-is column": ["d", "dt", "j"],
    "one text column": ["c"],
    "one int column": ["k"],
}


def _table(names: list[str]) -> tuple[TableInfo, tuple[BinlogColumn, ...]]:
    specs = tuple(ColumnSpec(n, _KINDS[n][0], _KINDS[n][0]) for n in names)  # type: ignore[arg-type]
    columns = tuple(BinlogColumn(n, 3, set_values=("a", "b", "c") if n == "st" else None) for n in names)
    return TableInfo("d", "t", specs, primary_key=(names[0],)), columns


def _images(names: list[str]) -> list[dict[str, Any]]:
    full = {n: _KINDS[n][1] for n in names}
    out = [full, {n: None for n in names}, {**full, names[-1]: None}, dict(reversed(full.items())),
           {**full, "extra": 1}, {n: v for n, v in full.items() if n != names[0]}]
    if "k" in names:
        out.append({**full, "k": True})  # a bool is not an int column's value
        out.append({**full, "k": 3.0})
    if "c" in names:
        out.append({**full, "c": b"raw"})  # bytes in a text column
    return out


@pytest.mark.parametrize("table", list(_TABLES))
def test_the_fast_path_is_the_column_path(table: str) -> None:
    info, columns = _table(_TABLES[table])
    for image in _images(_TABLES[table]):
        try:
            want = _by_column(info, columns, image, {})
        except UnsupportedValue as exc:
            with pytest.raises(UnsupportedValue) as caught:
                encode_row(info, columns, image, {})
            assert str(caught.value) == str(exc)
            continue
        got = encode_row(info, columns, image, {})
        assert got == want
        assert list(got[0]) == [spec.name for spec in info.columns]  # the table's order, always
        assert [type(v) for v in got[0].values()] == [type(v) for v in want[0].values()]


def test_the_image_is_not_the_encoded_row() -> None:
    """The encoded row is a dict of its own: the reader's image is not kept or changed."""
    info, columns = _table(_TABLES["sysbench"])
    image = {"id": 1, "k": 2, "c": "x", "pad": "y"}
    out, size = encode_row(info, columns, image, {})
    assert out == image and out is not image
    assert size == sum(len(n) + 6 for n in image) + 8 + 8 + 1 + 1


@pytest.mark.parametrize("source,want", [(NONE_SOURCE.EMPTY_SET, ""), (NONE_SOURCE.NULL, None)])
def test_a_none_source_is_read_on_both_paths(source: str, want: str | None) -> None:
    info, columns = _table(["id", "st"])
    for image in ({"id": 1, "st": None}, {"st": None, "id": 1}):
        assert encode_row(info, columns, image, {"st": source})[0]["st"] == want
        assert _by_column(info, columns, image, {"st": source})[0]["st"] == want
    info, columns = _table(["id", "dt"])
    with pytest.raises(UnsupportedValue, match="column dt"):
        encode_row(info, columns, {"id": 1, "dt": None}, {"dt": NONE_SOURCE.OUT_OF_DATE_RANGE})
