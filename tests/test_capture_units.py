"""Capture's pure parts: the ts clock, value encoding, statement classification."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from pymysqlreplication.constants import NONE_SOURCE

from libs.codec.encode import UnsupportedValue, encode_value, format_time, kind_for_data_type
from libs.mysql_statements import classify
from services.capture.binlog_reader import _fix_negative_time2
from services.capture.ts_clock import LOGICAL_MASK, TsClock, compose, logical, physical_ms

# ------------------------------------------------------------------ ts clock


def test_commit_ts_follows_event_time_and_breaks_ties() -> None:
    clock = TsClock()
    a = clock.commit(1_000)
    b = clock.commit(1_000)  # same second in the binlog
    c = clock.commit(2_000)
    assert (physical_ms(a), logical(a)) == (1_000, 0)
    assert (physical_ms(b), logical(b)) == (1_000, 1)
    assert (physical_ms(c), logical(c)) == (2_000, 0)


def test_commit_ts_never_goes_back_when_the_source_clock_steps_back() -> None:
    clock = TsClock()
    first = clock.commit(5_000)
    back = clock.commit(3_000)
    assert back > first and physical_ms(back) == 5_000 and logical(back) == 1


def test_logical_overflow_rolls_into_the_next_millisecond() -> None:
    clock = TsClock(compose(7_000, LOGICAL_MASK - 1))
    a = clock.commit(7_000)
    b = clock.commit(7_000)
    assert (physical_ms(a), logical(a)) == (7_000, LOGICAL_MASK)
    assert (physical_ms(b), logical(b)) == (7_001, 0)
    assert b > a


def test_same_start_and_events_give_the_same_ts() -> None:
    events = [1_000, 1_000, 900, 2_000, 2_000, 2_000, 1_500, 3_000]
    start = compose(950, 3)
    runs = []
    for _ in range(2):
        clock = TsClock(start)
        runs.append([clock.commit(e) for e in events])
    assert runs[0] == runs[1]
    assert all(x < y for x, y in zip(runs[0], runs[0][1:], strict=False))


def test_resolved_marks_are_monotonic_and_later_commits_exceed_them() -> None:
    clock = TsClock()
    c1 = clock.commit(10_000)
    r1 = clock.resolve(12_345)
    assert r1 == compose(12_345, 0) and r1 > c1
    r2 = clock.resolve(12_000)  # wall clock stepped back: the mark does not
    assert r2 == r1
    c2 = clock.commit(11_000)  # binlog seconds lag the wall clock
    assert c2 > r2 and physical_ms(c2) == 12_345


# -------------------------------------------------------------------- values


@pytest.mark.parametrize(("kind", "value", "expected"), [
    ("int", 18446744073709551615, 18446744073709551615),
    ("int", -5, -5),
    ("float", 1.25, 1.25),
    ("decimal", Decimal("-123.450"), "-123.450"),
    ("decimal", Decimal("1E+3"), "1000"),
    ("string", "héllo 😀", "héllo 😀"),
    ("set", {"c", "a"}, "a,c"),
    ("bytes", b"\x00\xff", "AP8="),
    ("bytes", b"", ""),
    ("bytes", "", ""),  # how pymysqlreplication delivers an empty BLOB
    ("date", dt.date(2024, 2, 29), "2024-02-29"),
    ("datetime", dt.datetime(2024, 2, 29, 1, 2, 3), "2024-02-29T01:02:03.000000"),
    ("timestamp", dt.datetime(2024, 2, 29, 1, 2, 3, 450000), "2024-02-29T01:02:03.450000"),
    ("time", dt.timedelta(hours=-838, minutes=-59, seconds=-59), "-838:59:59.000000"),
    ("time", dt.timedelta(hours=1, microseconds=5), "01:00:00.000005"),
    ("json", '{"a": 1}', '{"a": 1}'),
    ("json", {b"a": [1, b"x"]}, '{"a": [1, "x"]}'),
    ("bit", "1000000001", 513),
    ("int", None, None),
])
def test_encode_value(kind: str, value: object, expected: object) -> None:
    set_values = ("a", "b", "c") if kind == "set" else None
    assert encode_value(kind, value, set_values=set_values) == expected  # type: ignore[arg-type]


def test_null_reasons_are_told_apart() -> None:
    assert encode_value("set", None, none_source=NONE_SOURCE.EMPTY_SET) == ""
    assert encode_value("set", None, none_source=NONE_SOURCE.NULL) is None
    with pytest.raises(UnsupportedValue, match="zero or invalid date"):
        encode_value("date", None, none_source=NONE_SOURCE.OUT_OF_DATE_RANGE)
    with pytest.raises(UnsupportedValue, match="binlog_row_image"):
        encode_value("int", None, none_source=NONE_SOURCE.COLS_BITMAP)


def test_value_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(UnsupportedValue):
        encode_value("string", b"\xff", set_values=None)
    with pytest.raises(UnsupportedValue):
        encode_value("int", True)
    with pytest.raises(UnsupportedValue):
        encode_value("date", dt.datetime(2024, 1, 1))


def test_kinds_from_information_schema() -> None:
    assert kind_for_data_type("BIGINT") == "int"
    assert kind_for_data_type("longtext", is_json=True) == "json"
    assert kind_for_data_type("varbinary") == "bytes"
    assert kind_for_data_type("point") == "geometry" and kind_for_data_type("inet6") is None


def test_negative_time_fraction_is_repaired() -> None:
    # What pymysqlreplication returns for -12:34:56.78 and -00:00:00.5; whole seconds are right.
    assert format_time(_fix_negative_time2(-dt.timedelta(seconds=45296, microseconds=220000))) == \
        "-12:34:56.780000"
    assert format_time(_fix_negative_time2(-dt.timedelta(seconds=1, microseconds=-500000))) == \
        "-00:00:00.500000"
    assert _fix_negative_time2(-dt.timedelta(seconds=7)) == -dt.timedelta(seconds=7)
    assert _fix_negative_time2(dt.timedelta(seconds=7, microseconds=3)) == \
        dt.timedelta(seconds=7, microseconds=3)


# ---------------------------------------------------------------- statements


@pytest.mark.parametrize(("query", "kind", "tables"), [
    ("BEGIN", "begin", ()),
    ("COMMIT /* implicit */", "commit", ()),
    ("ALTER TABLE t ADD COLUMN x INT", "ddl", (("d", "t"),)),
    ("ALTER TABLE `o`.`t` RENAME TO `o`.`u`", "ddl", (("o", "t"), ("o", "u"))),
    ("ALTER TABLE t RENAME COLUMN a TO b", "ddl", (("d", "t"),)),
    ("CREATE TABLE IF NOT EXISTS `we``ird` (id INT)", "ddl", (("d", "we`ird"),)),
    ("DROP TABLE `a`,`x`.`b` /* generated by server */", "ddl", (("d", "a"), ("x", "b"))),
    ("RENAME TABLE a TO b, x.c TO x.d", "ddl", (("d", "a"), ("d", "b"), ("x", "c"), ("x", "d"))),
    ("TRUNCATE TABLE t", "ddl", (("d", "t"),)),
    ("CREATE UNIQUE INDEX u ON t (a)", "ddl", (("d", "t"),)),
    ("DROP INDEX u ON x.t", "ddl", (("x", "t"),)),
    ("DROP DATABASE IF EXISTS shop", "drop_database", ()),
    ("INSERT INTO t VALUES (1)", "dml", (("d", "t"),)),
    ("delete from x.t where a = 1", "dml", (("x", "t"),)),
    ("CREATE USER bob", "other", ()),
    ("SAVEPOINT s1", "other", ()),
])
def test_classify(query: str, kind: str, tables: tuple[tuple[str, str], ...]) -> None:
    stmt = classify(query, "d")
    assert stmt.kind == kind and stmt.tables == tables


def test_a_non_empty_str_in_a_bytes_column_is_still_refused() -> None:
    with pytest.raises(UnsupportedValue):
        encode_value("bytes", "abc")
