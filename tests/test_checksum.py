"""libs.checksum: normalisation that makes the three databases' representations compare equal.

The cross-database check against real servers is in tests/test_sinks.py
(test_checksum_equal_across_databases); these are the pure rules.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta, timezone
from datetime import time as dtime
from decimal import Decimal

import pytest

from contracts.events.rows import ColumnV1
from libs.checksum import compare_tables, normalize, table_checksum


def col(name: str, kind: str, sql_type: str) -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type)


@pytest.mark.parametrize(("a", "b", "column"), [
    (18446744073709551615, Decimal("18446744073709551615"), None),
    (18446744073709551615, "18446744073709551615", col("u", "int", "bigint unsigned")),
    (Decimal("1.50"), Decimal("1.5"), None),
    (Decimal("1.50"), "1.5000", col("d", "decimal", "decimal(10,4)")),
    (Decimal("0.00"), Decimal("-0"), None),
    (5, Decimal("5.000"), None),
    (True, 1, None),
    (1.5, Decimal("1.5"), None),
    (b"\x05", 5, col("b", "bit", "bit(8)")),
    (b"ab", memoryview(b"ab"), None),
    (bytearray(b"ab"), b"ab", None),
    ('{"b": 1, "a": [1, 2]}', {"a": [1, 2], "b": 1}, col("j", "json", "json")),
    ('"x"', "\"x\"", col("j", "json", "json")),
    (datetime(2024, 1, 1, 12), "2024-01-01 12:00:00.000000", col("t", "datetime", "datetime(6)")),
    (datetime(2024, 1, 1, 12, tzinfo=UTC), datetime(2024, 1, 1, 14, tzinfo=timezone(timedelta(hours=2))),
     None),
    (date(2024, 1, 1), "2024-01-01", col("d", "date", "date")),
    (timedelta(hours=-1, seconds=-1), "-01:00:01.000000", col("t", "time", "time(6)")),
    (timedelta(hours=1, minutes=2), dtime(1, 2), None),
    (3.140000104904175, 3.14, col("f", "float", "float")),  # float32 through the binlog vs text
    ("😀", b"\xf0\x9f\x98\x80", col("s", "string", "varchar(4)")),
])
def test_same_data_normalises_equal(a: object, b: object, column: ColumnV1 | None) -> None:
    assert normalize(a, column) == normalize(b, column)


@pytest.mark.parametrize(("a", "b"), [
    (None, ""), (None, 0), (None, "null"), ("1", 1), (b"1", "1"), (Decimal("1.5"), Decimal("1.51")),
    (datetime(2024, 1, 1), date(2024, 1, 1)), (3.140000104904175, 3.14),  # double: not equal
])
def test_different_data_normalises_different(a: object, b: object) -> None:
    assert normalize(a) != normalize(b)


def test_table_checksum_ignores_row_order_and_counts() -> None:
    columns = ["id", "v"]
    rows: list[dict[str, object]] = [{"id": 1, "v": Decimal("1.0")}, {"id": 2, "v": None}]
    other: list[tuple[int, int | None]] = [(2, None), (1, 1)]  # sequences aligned to the columns are fine too
    assert table_checksum(rows, columns, ["id"]) == table_checksum(other, columns, ["id"])
    count, digest = table_checksum(rows, columns, ["id"])
    assert count == 2 and len(digest) == 64
    assert table_checksum(rows[:1], columns, ["id"])[1] != digest
    assert table_checksum([{"id": 1, "v": 1}, {"id": 2, "v": ""}], columns, ["id"])[1] != digest
    with pytest.raises(ValueError):
        table_checksum(rows, columns, ["nope"])


def test_compare_tables_reports_examples() -> None:
    up = [{"id": i, "v": f"v{i}"} for i in range(10)]
    down = [dict(r) for r in up if r["id"] not in (3, 4)] + [{"id": 42, "v": "x"}]
    down[0]["v"] = "changed"
    diff = compare_tables(up, down, ["id"], max_examples=1)
    assert not diff.ok and diff
    assert diff.missing == [(3,), (4,)] and diff.extra == [(42,)]
    assert diff.different == [((0,), {"v": ("v0", "changed")})]
    text = str(diff)
    assert "2 missing, 1 extra, 1 different" in text and "[(3,)]" in text
    assert compare_tables(up, list(reversed(up)), ["id"]).ok
    dup = compare_tables(up, [*up, up[0]], ["id"])
    assert dup.duplicate_keys == [("downstream", (0,))]


def test_float32_extremes_normalise_without_overflow() -> None:
    # Near FLT_MAX a shorter decimal can round past it (3.403e38): skipped, not an error.
    column = ColumnV1(name="f", kind="float", sql_type="float")
    top = normalize(3.40282e38, column)
    assert top == normalize(3.402820018375656e38, column) == "#3402820" + "0" * 32
    assert normalize(-3.40282e38, column).startswith("#-34028")
    assert normalize(3.40282e38, column) != normalize(3.4028e38, column)


def test_long_values_compare_by_digest_and_still_tell_one_byte_apart() -> None:
    big = bytes(range(256)) * 1024  # 256 KiB
    flipped = big[:-1] + b"\x00"
    assert normalize(big) == normalize(memoryview(big)) == normalize(bytearray(big))
    assert normalize(big) != normalize(flipped)
    assert normalize(big).startswith("B#262144:")
    text = "ü" * 70_000
    assert normalize(text) == normalize(text.encode(), ColumnV1(name="t", sql_type="longtext", kind="string"))
    assert normalize(text) != normalize(text[:-1] + "u")
    doc = {"items": [{"i": i, "name": f"item-{i}"} for i in range(5000)], "id": 1}
    reordered = '{"id": 1, "items": ' + json.dumps(doc["items"]) + "}"
    json_col = ColumnV1(name="j", sql_type="json", kind="json")
    assert normalize(json.dumps(doc), json_col) == normalize(reordered, json_col) == normalize(doc, json_col)
    assert normalize(json.dumps(doc), json_col).startswith("J#")
    # A short value keeps its readable text.
    assert normalize(b"\x01\x02") == "B0102"


def test_compare_tables_gives_the_digests_table_checksum_gives() -> None:
    columns = ["id", "b"]
    up = [{"id": 1, "b": b"x" * 100_000}, {"id": 2, "b": b"y"}]
    down = [{"id": 2, "b": b"y"}, {"id": 1, "b": memoryview(b"x" * 100_000)}]
    diff = compare_tables(up, down, ["id"], columns=columns)
    assert diff.ok
    assert diff.upstream_digest == table_checksum(up, columns, ["id"])[1] == diff.downstream_digest
    changed = compare_tables(up, [{"id": 2, "b": b"y"}, {"id": 1, "b": b"x" * 99_999 + b"z"}], ["id"],
                             columns=columns)
    assert not changed.ok and changed.upstream_digest != changed.downstream_digest


def test_a_fetched_json_document_is_parsed_once_and_still_compares_with_the_raw_text() -> None:
    from libs.codec.decode import CanonicalJson, canonical_json, normalize_fetched

    doc = ColumnV1(name="doc", sql_type="json", kind="json")
    fetched = normalize_fetched(doc, '{ "b": [1, 2],  "a": "é" }')
    assert isinstance(fetched, CanonicalJson) and fetched == '{"a":"é","b":[1,2]}'
    assert canonical_json(fetched) is fetched  # not parsed again
    up = [{"id": 1, "doc": '{"a": "é", "b": [1, 2]}'}, {"id": 2, "doc": '{"a": 1}'}]
    down = [{"id": 1, "doc": fetched}, {"id": 2, "doc": normalize_fetched(doc, '{"a": 2}')}]
    diff = compare_tables(up, down, ["id"], columns=[ColumnV1(name="id", sql_type="int", kind="int"), doc])
    assert [k for k, _ in diff.different] == [(2,)]
