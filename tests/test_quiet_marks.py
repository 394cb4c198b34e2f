"""Capture's resolved marks say since which mark it has published nothing but marks
(``QUIET_SINCE_HEADER``), against a real nats-server, and the sink reads it with the mark
(``latest_resolved``): never on a session's first mark, never across a data message."""

from __future__ import annotations

from nats.js import JetStreamContext

from contracts.events.rows import (
    ColumnV1,
    ResolvedAdvancedV1,
    RowImageV2,
    RowsChangedV2,
    SourcePositionV1,
    TableMetaV1,
)
from libs.config import Settings
from libs.streams import ROWS_STREAM, resolved_subject, rows_subject
from libs.streams_setup import ensure_rows_stream
from services.capture.publisher import Publisher
from services.sink_worker.round.pull import latest_resolved

SOURCE = "quietmarks"


def _row(seq: int) -> RowsChangedV2:
    meta = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False)],
                       primary_key=["id"])
    return RowsChangedV2(source=SOURCE, database="d", table="t", ts=(1_800_000_000_000 << 18) | seq,
                         seq=seq, part=0, last_part=True, meta=meta,
                         position=SourcePositionV1(binlog_file="binlog.000001", binlog_pos=100 + seq),
                         rows=[RowImageV2(op="insert", before=None, after={"id": seq}, ordinal=0)])


async def _mark(publisher: Publisher, pos: int) -> tuple[int, int | None]:
    event = ResolvedAdvancedV1(source=SOURCE, ts=(1_800_000_000_000 << 18) | pos,
                               position=SourcePositionV1(binlog_file="binlog.000001", binlog_pos=pos))
    await publisher.resolved(event, f"{SOURCE}:resolved:binlog.000001:{pos}", pos)
    mark = await latest_resolved(publisher.js, SOURCE)
    assert mark is not None and mark.stream_seq == publisher.resolved_stream_seq
    return mark.stream_seq, mark.quiet_since


async def test_marks_say_since_when_capture_published_nothing_else(js: JetStreamContext) -> None:
    await ensure_rows_stream(js, Settings())
    await js.purge_stream(ROWS_STREAM, subject=resolved_subject(SOURCE))
    subject = rows_subject(SOURCE, "d", "t")
    session = Publisher(js, SOURCE, "capture/test", is_valid=lambda: True)
    try:
        first, since = await _mark(session, 1000)
        assert since is None  # a session's first mark: the last one may have published after its mark
        _, since = await _mark(session, 1001)
        assert since == first
        _, since = await _mark(session, 1002)
        assert since == first  # the quiet run goes on from the same mark
        await session.send(subject, _row(7), f"{SOURCE}:quiet:7", rows=1)
        data_mark, since = await _mark(session, 1003)
        assert since is None  # a row message since the last mark
        _, since = await _mark(session, 1004)
        assert since == data_mark  # quiet again, from the mark after the row
        session.discard()
        _, since = await _mark(session, 1005)
        assert since is None  # acks given up: what was in flight may be stored after a mark
    finally:
        await session.close()
    restarted = Publisher(js, SOURCE, "capture/test", is_valid=lambda: True)
    restarted.resolved_stream_seq = session.resolved_stream_seq
    try:
        _, since = await _mark(restarted, 1006)
        assert since is None
    finally:
        await restarted.close()
