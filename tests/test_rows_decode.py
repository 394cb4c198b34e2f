"""The compiled row decoder on recorded rows events (no server): every column type of the type
matrix, as MariaDB wrote it, decodes to the values the binlog library gave for the same bytes
(after capture's repairs). The recording: ``python -m tests.helpers.rows_events
tests/fixtures/rows_events.json.gz`` (``tests/test_rows_decode_binlog.py`` checks the same
against a live server)."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
from pymysqlreplication.constants import FIELD_TYPE

from services.capture.binlog_reader import RowImage, Rows
from services.capture.rows_decode import ColumnLayout, RowsDecoder, compile_decoder
from tests.helpers.rows_events import typed
from tests.helpers.type_cases import CHARSET_TEXTS

FIXTURE = Path(__file__).parent / "fixtures" / "rows_events.json.gz"
EVENTS: list[dict[str, Any]] = json.loads(gzip.decompress(FIXTURE.read_bytes()))


def _layouts(event: dict[str, Any]) -> list[ColumnLayout]:
    out = []
    for c in event["columns"]:
        c = dict(c)
        for key in ("enum_values", "set_values"):
            if key in c:
                c[key] = tuple(c[key])
        out.append(ColumnLayout(**c))
    return out


def _decode(event: dict[str, Any]) -> list[Any]:
    decoder = compile_decoder(_layouts(event))
    assert decoder is not None, event["table"]
    data = bytes.fromhex(event["rows"])
    rows = decoder.decode(event["op"], data, 0, len(data))
    if event["op"] == "update":
        images = [RowImage(b, a, bn, an) for b, bn, a, an in rows]
    elif event["op"] == "insert":
        images = [RowImage(None, v, {}, n) for v, n in rows]
    else:
        images = [RowImage(v, None, n, {}) for v, n in rows]
    return [[typed(i.before), typed(i.after), i.before_none, i.after_none] for i in images]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: f"{e['table']}-{e['op']}")
def test_recorded_events_decode_to_the_librarys_values(event: dict[str, Any]) -> None:
    assert _decode(event) == event["expected"]


def test_the_recording_holds_every_covered_type_and_edge() -> None:
    covered = {FIELD_TYPE.TINY, FIELD_TYPE.SHORT, FIELD_TYPE.INT24, FIELD_TYPE.LONG,
               FIELD_TYPE.LONGLONG, FIELD_TYPE.FLOAT, FIELD_TYPE.DOUBLE, FIELD_TYPE.NEWDECIMAL,
               FIELD_TYPE.YEAR, FIELD_TYPE.DATE, FIELD_TYPE.DATETIME2, FIELD_TYPE.TIMESTAMP2,
               FIELD_TYPE.TIME2, FIELD_TYPE.VARCHAR, FIELD_TYPE.STRING, FIELD_TYPE.BLOB,
               FIELD_TYPE.ENUM, FIELD_TYPE.SET, FIELD_TYPE.BIT}
    seen = {c["type"] for e in EVENTS for c in e["columns"]}
    assert covered <= seen
    assert {(c["type"], bool(c.get("unsigned"))) for e in EVENTS for c in e["columns"]} >= {
        (t, u) for t in (FIELD_TYPE.TINY, FIELD_TYPE.SHORT, FIELD_TYPE.INT24, FIELD_TYPE.LONG,
                         FIELD_TYPE.LONGLONG) for u in (False, True)}
    assert {c["length_size"] for e in EVENTS for c in e["columns"] if c["type"] == FIELD_TYPE.BLOB} \
        == {1, 2, 3, 4}
    assert {c.get("fsp", 0) for e in EVENTS for c in e["columns"] if c["type"] == FIELD_TYPE.TIME2} \
        == set(range(7))
    sources = {s for e in EVENTS for row in e["expected"] for n in (row[2], row[3]) for s in n.values()}
    assert sources == {"null", "out of date range", "out of datetime2 range", "empty set"}
    assert any(len(e["expected"]) > 20 for e in EVENTS)  # rows events of many rows


def _narrow() -> RowsDecoder:
    decoder = compile_decoder([ColumnLayout("id", FIELD_TYPE.LONG), ColumnLayout(
        "c", FIELD_TYPE.STRING, charset="utf8mb4", max_length=480)])
    assert decoder is not None
    return decoder


def test_a_row_image_is_its_null_bitmap_then_its_values() -> None:
    decoder = _narrow()
    data = b"\x00" + struct.pack("<i", -5) + b"\x03\x00abc" + b"\x02" + struct.pack("<i", 7)
    assert decoder.decode("insert", data, 0, len(data)) == [
        ({"id": -5, "c": "abc"}, {}), ({"id": 7, "c": None}, {"c": "null"})]
    before_after = data
    assert decoder.decode("update", before_after, 0, len(before_after)) == [
        ({"id": -5, "c": "abc"}, {}, {"id": 7, "c": None}, {"c": "null"})]


def test_a_geometry_is_its_stored_bytes_after_its_length() -> None:
    # MariaDB's internal format (SRID 4326 LE + WKB of POINT(1 2)), as the library reads it:
    # the bytes after a 4-byte length, not decoded as text.
    point = bytes.fromhex("E61000000101000000000000000000F03F0000000000000040")
    decoder = compile_decoder([ColumnLayout("id", FIELD_TYPE.LONG),
                               ColumnLayout("g", FIELD_TYPE.GEOMETRY, length_size=4)])
    assert decoder is not None
    data = (b"\x00" + struct.pack("<i", 1) + struct.pack("<I", len(point)) + point
            + b"\x02" + struct.pack("<i", 2))
    assert decoder.decode("insert", data, 0, len(data)) == [
        ({"id": 1, "g": point}, {}), ({"id": 2, "g": None}, {"g": "null"})]


def test_bytes_that_do_not_end_with_the_event_are_refused() -> None:
    decoder = _narrow()
    data = b"\x00" + struct.pack("<i", 1) + b"\x05\x00abc"  # a length past the event's end
    with pytest.raises(ValueError):
        decoder.decode("insert", data, 0, len(data))
    with pytest.raises(IndexError):  # an update whose after image is missing (the reader
        # sends any error's event to the library)
        decoder.decode("update", data[:5] + b"\x00\x00", 0, 7)


@pytest.mark.parametrize("column", [
    ColumnLayout("j", FIELD_TYPE.JSON, length_size=4),  # MySQL's binary JSON
    ColumnLayout("t", FIELD_TYPE.DATETIME), ColumnLayout("t", FIELD_TYPE.TIME),
    ColumnLayout("t", FIELD_TYPE.TIMESTAMP), ColumnLayout("t", FIELD_TYPE.VAR_STRING),
    ColumnLayout("e", FIELD_TYPE.ENUM, size=1),  # no members in the table map
    ColumnLayout("s", FIELD_TYPE.SET, size=1, set_values=()),
    ColumnLayout("", FIELD_TYPE.LONG),  # no column names in the binlog
], ids=lambda c: f"{c.type}-{c.name or 'unnamed'}")
def test_columns_it_does_not_cover_leave_the_table_to_the_library(column: ColumnLayout) -> None:
    assert compile_decoder([ColumnLayout("id", FIELD_TYPE.LONG), column]) is None


def test_an_event_it_cannot_take_goes_to_the_library() -> None:
    """Not a FULL row image (a column missing from the present bitmap): None, so the reader
    lets the library decode it (with its COLS_BITMAP none sources)."""
    from pymysqlreplication.constants import BINLOG

    class Packet:
        _data = b"\x00" * 16
        _position = 0

    class Wrapper:
        packet = Packet()
        read_bytes = 0
        _BinLogPacketWrapper__data_buffer = b""

    class Event:
        event_type = BINLOG.WRITE_ROWS_EVENT_V1
        complete = True
        number_of_columns = 2
        columns_present_bitmap = b"\x01"
        packet = Wrapper()
        event_size = 16

    decoder = _narrow()
    assert decoder.body(Event()) is None
    Event.columns_present_bitmap = b"\x03"
    assert decoder.body(Event()) == (Packet._data, 0, 16)
    Event.number_of_columns = 3
    assert decoder.body(Event()) is None


def test_items_cross_the_pipe_as_tuples_and_come_back_whole() -> None:
    """The reader child pickles items; capture gets back equal items of the same classes, built
    by ``tuple.__new__`` (no per-item Python code, no state dict)."""
    from services.capture.binlog_reader import Begin, Commit, Position

    position = Position("binlog.000001", 4)
    items = [Begin(position, 7, "0-1-2", xa=True),
             Rows(position, 7, "db", "t", "update", (), (RowImage({"a": 1}, {"a": 2}, {}, {}),), 40),
             Commit(Position("binlog.000001", 99), 7)]
    blob = pickle.dumps(items, pickle.HIGHEST_PROTOCOL)
    assert b"__new__" in blob and b"__setstate__" not in blob
    back = pickle.loads(blob)
    assert back == items
    assert [type(i) for i in back] == [Begin, Rows, Commit]
    assert type(back[1].images[0]) is RowImage and type(back[1].position) is Position
    assert back[0].xa is True and back[1].event_size == 40 and str(back[2].position) == "binlog.000001:99"
    with pytest.raises(AttributeError):
        back[0].gtid = "x"  # type: ignore[misc]


def test_text_in_every_charset_decodes_to_what_was_written() -> None:
    # Both paths agreeing is not enough (the library's utf16 was wrong on both): each charset's
    # column holds exactly the text the statement wrote, in the recording and decoded again.
    inserts = [e for e in EVENTS if e["table"] == "charsets" and e["op"] == "insert"]
    assert len(inserts) == 4
    for event in inserts:
        for recorded in (event["expected"], _decode(event)):
            after = recorded[0][1]
            row = int(after["id"][1])
            for name, text in CHARSET_TEXTS.items():
                want = [text, "", text[0] + "  ", None][row]
                assert after[f"c_cs_{name}"] == (None if want is None else ["str", want]), (name, row)
            if row == 0:
                assert after["c_char_ucs2"] == ["str", "aØ€"]
                assert after["c_text_utf16"] == ["str", "Ø😀 x"]
                assert after["c_tinytext_utf32"] == ["str", "añ😀"]
                assert after["c_enum_utf16"] == ["str", "b c"]
                assert after["c_set_ucs2"] == ["set", ["x", "y"]]
                assert after["c_enum_swe7"] == ["str", "Å"]


def test_a_charset_capture_cannot_decode_stays_bytes_on_both_paths() -> None:
    # eucjpms (libs.codec.charset_tables.INEXACT): bytes, never misdecoded text; describe
    # refuses the column, so capture stops the table (tests/test_charsets.py).
    event = next(e for e in EVENTS if e["table"] == "extra" and e["op"] == "insert")
    for recorded in (event["expected"], _decode(event)):
        assert recorded[0][1]["c_eucjpms"] == ["bytes", "ア".encode("euc_jp").hex()]
        assert recorded[0][1]["c_swe7"] == ["str", "abc"]
        assert recorded[0][1]["c_utf16"] == ["str", "añ😀"]
