"""The deterministic encoding of row changes with large values (pure)."""

from __future__ import annotations

import base64
import os

from contracts.events.rows import ColumnV1, RowImageV2, RowsChangedV4, SourcePositionV1, TableMetaV2
from contracts.registry import REGISTRY
from services.capture.large_encode import LARGE_VALUE, approx_size, encode_rows_deterministic


def _event(blob: str, text: str) -> RowsChangedV4:
    meta = TableMetaV2(columns=[ColumnV1(name="id", kind="int", sql_type="int"),
                                ColumnV1(name="b", kind="bytes", sql_type="longblob"),
                                ColumnV1(name="t", kind="string", sql_type="longtext")],
                       primary_key=["id"])
    return RowsChangedV4(source="s1", database="d", table="t", ts=470681576182644736, seq=3, part=0,
                         last_part=True, position=SourcePositionV1(binlog_file="binlog.000001", binlog_pos=4),
                         meta=meta, rows=[RowImageV2(op="update", before={"id": 1, "b": None, "t": "x"},
                                                     after={"id": 1, "b": blob, "t": text})])


def test_large_values_are_spliced_in_exactly() -> None:
    blob = base64.b64encode(os.urandom(3 * LARGE_VALUE)).decode()
    text = 'ü "quoted" \\ back\nslash\x01 ' * (LARGE_VALUE // 8) + "😀"
    event = _event(blob, text)
    decoded = REGISTRY.decode(encode_rows_deterministic(event, event_id="s1:binlog.000001:4:d.t:0"))
    assert decoded.event == event
    assert decoded.envelope.id == "s1:binlog.000001:4:d.t:0"
    assert decoded.envelope.producer == "capture/s1" and decoded.envelope.epoch == 0
    assert approx_size(event) == len(blob) + len(text) + 1


def test_the_encoding_is_a_pure_function_of_the_event() -> None:
    blob = base64.b64encode(os.urandom(2 * LARGE_VALUE)).decode()
    first = encode_rows_deterministic(_event(blob, "small"), event_id="id")
    again = encode_rows_deterministic(_event(blob, "small"), event_id="id")
    assert first == again
    assert first != encode_rows_deterministic(_event(blob, "other"), event_id="id")
