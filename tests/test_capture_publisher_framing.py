"""The publisher's own framing of row messages (``AckInbox.publish_framed``) against a real
nats-server: the stream stores what nats-py's path would (id, trace context, payload), a
re-publish of an id is dropped as a duplicate (what a restarted capture relies on), and an id
nats-py would rewrite takes nats-py's path."""

from __future__ import annotations

from nats.js import JetStreamContext

from contracts.events.rows import RowImageV2, RowsChangedV2, RowsChangedV4, SourcePositionV1
from contracts.registry import REGISTRY
from libs.config import Settings
from libs.streams import ROWS_STREAM, rows_subject
from libs.streams_setup import ensure_rows_stream
from services.capture.publisher import Publisher
from tests.helpers.capture_pipeline import INFO


def _event(seq: int) -> RowsChangedV2:
    return RowsChangedV2.model_construct(
        source="framing", database="d", table="t", ts=(1_800_000_000_000 << 18) | seq, seq=seq, part=0,
        last_part=True, position=SourcePositionV1.model_construct(binlog_file="binlog.000001",
                                                                  binlog_pos=100 + seq, gtid=None),
        meta=INFO.meta(), rows=[RowImageV2.model_construct(op="insert", before=None, after={"id": seq},
                                                           ordinal=0)])


async def test_framed_messages_are_stored_with_their_ids_and_deduplicated(js: JetStreamContext) -> None:
    await ensure_rows_stream(js, Settings())
    subject = rows_subject("framing", "d", "t")
    await js.purge_stream(ROWS_STREAM, subject=subject)
    publisher = Publisher(js, "framing", "capture/test", is_valid=lambda: True)
    framed = "framing:binlog.000001:101:d.t:0"
    odd = "framing:binlog.000001:102:d.t\nx:0"  # a newline in a table name: nats-py's path
    try:
        await publisher.send(subject, _event(1), framed, rows=1, size_bound=64)
        await publisher.send(subject, _event(2), odd, rows=1)
        publisher.end_spans()
        await publisher.flush()
        # A restarted capture publishing the same binlog again: same ids, dropped by the stream.
        await publisher.send(subject, _event(1), framed, rows=1, size_bound=64)
        await publisher.flush()
    finally:
        await publisher.close()
    info = await js.stream_info(ROWS_STREAM, subjects_filter=subject)
    assert info.state.subjects == {subject: 2}
    first = await js.get_msg(ROWS_STREAM, subject=subject, seq=1, next=True)
    assert first.headers is not None
    # traceparent rides along when a tracer is installed (an earlier test of this worker did).
    first_headers = {k: v for k, v in first.headers.items() if k != "traceparent"}
    assert first_headers == {"Nats-Msg-Id": framed, "Nats-Expected-Stream": ROWS_STREAM}
    decoded = REGISTRY.decode(first.data or b"")
    assert decoded.envelope.id == framed
    # Read back as the current version (an upcast of what was sent, nothing lost).
    assert decoded.event == RowsChangedV4.model_validate(_event(1).model_dump())
    second = await js.get_msg(ROWS_STREAM, subject=subject, seq=(first.seq or 0) + 1, next=True)
    assert second.headers is not None
    # As nats-py writes it (its path: the framed one would have kept the newline).
    second_headers = {k: v for k, v in second.headers.items() if k != "traceparent"}
    assert second_headers == {"Nats-Msg-Id": odd.replace("\n", " "), "Nats-Expected-Stream": ROWS_STREAM}
    assert REGISTRY.decode(second.data or b"").event.seq == 2  # type: ignore[attr-defined]
