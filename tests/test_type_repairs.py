"""Unit tests for the binlog decoding repairs: values pymysqlreplication hands over wrongly."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import pytest
from nats.js import JetStreamContext
from pymysqlreplication.constants import FIELD_TYPE

from libs.codec.encode import encode_value
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from services.capture.binlog_reader import _fix_row, _repairs
from tests.helpers.capture import (
    binlog_position,
    capture_settings,
    rows_of,
    running_capture,
    source_messages,
    wait_reading,
    wait_resolved_past,
)


def _event(*columns: tuple[str, int, str | None, int]) -> Any:
    return SimpleNamespace(columns=[
        SimpleNamespace(name=n, type=t, character_set_name=cs, max_length=ml)
        for n, t, cs, ml in columns])


def test_year_zero_is_not_1900() -> None:
    repairs = _repairs(_event(("y", FIELD_TYPE.YEAR, None, 0)))
    # The reader adds 1900 to the stored byte; byte 0 is YEAR 0000, the others are real years.
    assert _fix_row({"y": 1900}, repairs) == {"y": 0}
    assert _fix_row({"y": 1901}, repairs) == {"y": 1901}
    assert _fix_row({"y": 2155}, repairs) == {"y": 2155}
    assert _fix_row({"y": None}, repairs) == {"y": None}


def test_binary_gets_its_trailing_zero_bytes_back() -> None:
    repairs = _repairs(_event(("b", FIELD_TYPE.STRING, "binary", 4),
                              ("c", FIELD_TYPE.STRING, "utf8mb4", 16),
                              ("v", FIELD_TYPE.VARCHAR, "binary", 4)))
    row = _fix_row({"b": b"a\x00", "c": "a", "v": b"a"}, repairs)
    assert row == {"b": b"a\x00\x00\x00", "c": "a", "v": b"a"}
    # An all-zero BINARY(n) arrives empty (as b'' or the reader's '').
    assert _fix_row({"b": b"", "c": None, "v": b""}, repairs) == {"b": b"\0" * 4, "c": None, "v": b""}
    assert _fix_row({"b": "", "c": None, "v": b""}, repairs)["b"] == b"\0" * 4  # type: ignore[index]
    assert _fix_row({"b": b"full", "c": None, "v": None}, repairs)["b"] == b"full"  # type: ignore[index]
    assert encode_value("bytes", _fix_row({"b": b"\x01"}, repairs)["b"]) == "AQAAAA=="  # type: ignore[index]


def test_absent_columns_stay_absent() -> None:
    repairs = _repairs(_event(("y", FIELD_TYPE.YEAR, None, 0)))
    assert _fix_row({"x": 1900}, repairs) == {"x": 1900}
    assert _fix_row(None, repairs) is None


@pytest.mark.integration
async def test_capture_publishes_year_0000_and_padded_binary(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, replica_server_id: int) -> None:
    source = name = "cap_repairs"
    mariadb.execute(f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}")
    mariadb.execute("CREATE TABLE t (id INT PRIMARY KEY, y YEAR, b BINARY(4), vb VARBINARY(4))",
                    database=name)
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    async with running_capture(settings) as capture:
        await wait_reading(capture)
        mariadb.execute("INSERT INTO t VALUES (1, 0, x'0100', x'0100'), (2, 2155, '', ''),"
                        " (3, 1901, x'00000000', x'00')",
                        "UPDATE t SET y = 0, b = x'02' WHERE id = 2", database=name)
        await wait_resolved_past(js, source, binlog_position(mariadb))
    rows = [r for e in rows_of(await source_messages(js, source)) for r in e.rows]
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    assert [r.after for r in rows] == [
        {"id": 1, "y": 0, "b": b64(b"\x01\0\0\0"), "vb": b64(b"\x01\0")},
        {"id": 2, "y": 2155, "b": b64(b"\0\0\0\0"), "vb": ""},
        {"id": 3, "y": 1901, "b": b64(b"\0\0\0\0"), "vb": b64(b"\0")},
        {"id": 2, "y": 0, "b": b64(b"\x02\0\0\0"), "vb": ""}]
    assert rows[3].before == rows[1].after


def _info(*columns: tuple[str, str]) -> Any:
    from libs.codec.table_meta import ColumnSpec, TableInfo

    return TableInfo("d", "t", tuple(ColumnSpec(n, "set" if t.startswith("set") else "string", t)
                                     for n, t in columns), ("e",))


def test_enum_and_set_members_come_from_the_binlog_when_information_schema_loses_them() -> None:
    from libs.codec.table_meta import BinlogColumn, reconcile_members

    info = _info(("e", "enum('ä','?','x y')"), ("s", "set('?','b')"), ("ok", "enum('a','')"))
    cols = (BinlogColumn("e", FIELD_TYPE.ENUM, enum_values=("", "ä", "😀", "x y")),
            BinlogColumn("s", FIELD_TYPE.SET, set_values=("😀", "b")),
            BinlogColumn("ok", FIELD_TYPE.ENUM, enum_values=("", "a", "")))
    fixed = reconcile_members(info, cols)
    assert [c.sql_type for c in fixed.columns] == ["enum('ä','😀','x y')", "set('😀','b')", "enum('a','')"]
    assert fixed.meta().columns[0].sql_type == "enum('ä','😀','x y')"
    assert reconcile_members(fixed, cols) is fixed


def test_enum_members_the_reader_cannot_decode_make_the_column_unsupported() -> None:
    from libs.codec.table_meta import BinlogColumn, reconcile_members

    info = _info(("e", "enum('é','a')"))
    fixed = reconcile_members(info, (BinlogColumn("e", FIELD_TYPE.ENUM, enum_values=("", "", "a")),))
    assert [c.name for c in fixed.unsupported()] == ["e"]
    assert "UTF-8" in fixed.columns[0].sql_type
