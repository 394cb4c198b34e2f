"""Downstream errors as transient or permanent, per dialect, and the bisection that finds the
refused row (pure logic: real driver exception classes, no server)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import psycopg
import pymysql
import pytest

from services.sink_worker.incidents.poison import RowFailure, locate_poison
from services.sink_worker.sinks.error_class import (
    ErrorClass,
    classify,
    classify_mysql,
    classify_postgres,
    classify_sqlite,
    error_code,
)


@pytest.mark.parametrize(("code", "expected"), [
    (1264, "permanent"), (1406, "permanent"), (4025, "permanent"), (3819, "permanent"),
    (1048, "permanent"), (1452, "permanent"), (1062, "permanent"), (1366, "permanent"),
    (1213, "transient"), (1205, "transient"), (2013, "transient"), (1146, "transient"),
    (None, "transient"),
])
def test_mysql_error_numbers(code: int | None, expected: ErrorClass) -> None:
    assert classify_mysql(code) == expected


@pytest.mark.parametrize(("state", "expected"), [
    ("22001", "permanent"), ("22003", "permanent"), ("23514", "permanent"), ("23505", "permanent"),
    ("23502", "permanent"), ("42804", "permanent"),
    ("40001", "transient"), ("40P01", "transient"), ("08006", "transient"), ("55P03", "transient"),
    ("57P01", "transient"), ("42P01", "transient"), (None, "transient"),
])
def test_postgres_sqlstates(state: str | None, expected: ErrorClass) -> None:
    assert classify_postgres(state) == expected


@pytest.mark.parametrize(("code", "expected"), [
    (sqlite3.SQLITE_CONSTRAINT_CHECK, "permanent"), (sqlite3.SQLITE_CONSTRAINT_NOTNULL, "permanent"),
    (sqlite3.SQLITE_TOOBIG, "permanent"), (sqlite3.SQLITE_MISMATCH, "permanent"),
    (sqlite3.SQLITE_BUSY, "transient"), (sqlite3.SQLITE_LOCKED, "transient"),
    (sqlite3.SQLITE_IOERR, "transient"), (None, "transient"),
])
def test_sqlite_result_codes(code: int | None, expected: ErrorClass) -> None:
    assert classify_sqlite(code) == expected


def test_driver_exceptions_are_classified_by_their_code() -> None:
    assert classify("mysql", pymysql.err.DataError(1406, "Data too long for column 'name'")) == "permanent"
    # As the server raises it: with its SQLSTATE beside the error number.
    with_state = pymysql.err.DataError(1406, "Data too long for column 'name'")
    with_state.sqlstate = "22001"  # type: ignore[attr-defined]
    assert classify("mysql", with_state) == "permanent" and error_code(with_state) == 1406
    assert classify("mysql", pymysql.err.OperationalError(1213, "Deadlock found")) == "transient"
    assert classify("postgresql", psycopg.errors.lookup("23514")("check violation")) == "permanent"
    assert classify("postgresql", psycopg.errors.lookup("40P01")("deadlock")) == "transient"
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a INTEGER CHECK (a < 10))")
    with pytest.raises(sqlite3.IntegrityError) as refused:
        conn.execute("INSERT INTO t VALUES (11)")
    assert classify("sqlite", refused.value) == "permanent"
    # Not a driver's error (a bug, a lost socket): transient, the batch is retried as before.
    assert classify("mysql", ValueError("boom")) == "transient"
    assert classify("sqlite", ConnectionError()) == "transient"


class _Refusing:
    """Applies changes (ints) to ``written``; refuses ``bad`` ones in any batch holding them."""

    def __init__(self, bad: set[int], transient_after: int | None = None) -> None:
        self.bad = bad
        self.written: set[int] = set()
        self.calls = 0
        self.transient_after = transient_after

    def apply(self, changes: Sequence[int]) -> None:
        self.calls += 1
        if self.transient_after is not None and self.calls > self.transient_after:
            raise ConnectionError("lost")
        if self.bad & set(changes):
            raise ValueError("refused")
        self.written |= set(changes)


def _kind(exc: BaseException) -> ErrorClass:
    return "permanent" if isinstance(exc, ValueError) else "transient"


def test_bisection_finds_the_refused_change_and_writes_the_rest_before_it() -> None:
    db = _Refusing({13})
    changes = list(range(40))
    index, error = locate_poison(db.apply, changes, _kind, ValueError("first"))
    assert index is not None and changes[index] == 13 and str(error) == "refused"
    assert set(range(13)) <= db.written and 13 not in db.written
    assert db.calls <= 2 * 6 + 1  # logarithmic, not a transaction per row


def test_bisection_without_a_single_refused_row_reports_the_batch() -> None:
    first = ValueError("pair")
    index, error = locate_poison(lambda changes: None, [1, 2], _kind, first)
    assert index is None and error is first


def test_a_transient_error_while_bisecting_is_raised() -> None:
    db = _Refusing({3}, transient_after=1)
    with pytest.raises(ConnectionError):
        locate_poison(db.apply, list(range(8)), _kind, ValueError("first"))


def test_row_failure_round_trips_json() -> None:
    failure = RowFailure("upsert", '["p2",7]', ("id", "n"), "IntegrityError: CHECK failed", 275)
    assert RowFailure.from_json(failure.to_json()) == failure
    assert '["p2",7]' in failure.describe() and "upsert" in failure.describe()
