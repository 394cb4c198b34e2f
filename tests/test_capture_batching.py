"""Capture's batching while a backlog drains (no servers): resolved marks on a cadence, the same
messages however the binlog is cut into batches, a restart from any of those marks republishing
the rest identically, and the reader's batches."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from services.capture.binlog_reader import BinlogReader, Commit, Heartbeat, Position
from services.capture.pipeline import SourcePipeline, StartState
from tests.test_capture_xa_units import Binlog, Event, Recorder, Tables, _published

START = StartState(Position("binlog.000001", 4), 1, 0)


class BatchRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.span_ends = 0

    def end_spans(self) -> None:
        self.span_ends += 1


def _backlog() -> Binlog:
    b = Binlog()
    for i in range(40):
        b.txn(*range(i * 3, i * 3 + 1 + i % 3))  # 1..3 rows a transaction
    return b


async def _drain(items: list[Event], start: StartState, batch: int, *, resolve_every_s: float,
                 caught_up_at_end: bool = True) -> BatchRecorder:
    recorder = BatchRecorder()
    pipeline = SourcePipeline("src", recorder, Tables(), start, part_rows=5,  # type: ignore[arg-type]
                              resolve_every_s=resolve_every_s)
    try:
        chunks = [items[i:i + batch] for i in range(0, len(items), batch)]
        for n, chunk in enumerate(chunks):
            await pipeline.handle_batch(chunk, caught_up=caught_up_at_end and n == len(chunks) - 1)
    finally:
        pipeline.xa.close()
    return recorder


async def test_a_backlog_is_resolved_on_the_cadence_and_once_caught_up() -> None:
    items = _backlog().items
    slow = await _drain(items, START, 7, resolve_every_s=3600)
    # Nothing resolved while the reader had more queued; one mark once caught up, at the end.
    assert len(slow.marks) == 1
    last = items[-1]
    assert isinstance(last, Commit)
    assert slow.marks[0][0].position.binlog_pos == last.position.pos
    assert slow.marks[0][1] == len(slow.sent)
    assert slow.span_ends == -(-len(items) // 7)  # the batch's publish spans end with it
    every = await _drain(items, START, 7, resolve_every_s=0)
    assert len(every.marks) > 20
    # Not caught up at the end: no mark for the tail yet (the next batch or heartbeat brings it).
    open_tail = await _drain(items, START, 7, resolve_every_s=3600, caught_up_at_end=False)
    assert open_tail.marks == [] and _published(open_tail) == _published(slow)


@pytest.mark.parametrize("batch", [1, 3, 50, 1000])
async def test_batching_does_not_change_what_is_published(batch: int) -> None:
    items = _backlog().items
    one_by_one = _published(await _drain(items, START, 1, resolve_every_s=0))
    assert _published(await _drain(items, START, batch, resolve_every_s=0.0005)) == one_by_one


async def test_a_restart_from_any_cadence_mark_republishes_the_rest_identically() -> None:
    items = _backlog().items
    first = await _drain(items, START, 4, resolve_every_s=0)
    published = _published(first)
    assert len(first.marks) >= 10
    for mark, next_seq, _xa in first.marks:
        start = StartState(Position(mark.position.binlog_file, mark.position.binlog_pos), mark.ts, next_seq)
        rest = [i for i in items if i.position.pos > mark.position.binlog_pos]
        again = await _drain(rest, start, 9, resolve_every_s=3600)
        assert _published(again) == [p for p in published if p[2] >= next_seq]


def test_the_reader_hands_over_what_is_queued_in_one_batch() -> None:
    reader = BinlogReader({}, 1, Position("binlog.000001", 4), max_items=100)
    beats: list[Any] = [Heartbeat(Position("binlog.000001", p))
                        for p in itertools.islice(itertools.count(10), 30)]
    for beat in beats:
        assert reader._put(beat)
    assert reader.pending() == 30
    assert reader.take(max_items=25, wait=0.1, linger=0) == beats[:25]
    assert reader.take(max_items=25, wait=0.1, linger=0.001) == beats[25:]
    assert reader.pending() == 0
    assert reader.take(wait=0.01) == []


def test_the_fast_rows_encoding_decodes_to_the_same_event() -> None:
    from contracts.events.rows import RowImageV2, RowsChangedV4, SourcePositionV1
    from contracts.registry import REGISTRY
    from services.capture.rows_encode import encode_rows
    from tests.test_capture_rows import FULL_IMAGE, NULL_IMAGE
    from tests.test_capture_xa_units import INFO

    event = RowsChangedV4.model_construct(
        source="src", database="d", table="t", ts=(1_800_000_000_000 << 18) | 7, seq=41, part=2,
        last_part=False, position=SourcePositionV1.model_construct(binlog_file="binlog.000003",
                                                                   binlog_pos=1234, gtid="0-1-9"),
        meta=INFO.meta(),
        rows=[RowImageV2.model_construct(op="update", before=NULL_IMAGE, after=FULL_IMAGE, ordinal=3),
              RowImageV2.model_construct(op="insert", before=None, after={"id": 2**64 - 1}, ordinal=4)])
    fast = REGISTRY.decode(encode_rows(event, producer="capture/x", epoch=3,
                                       event_id="src:binlog.000003:1234:d.t:2"))
    slow = REGISTRY.decode(REGISTRY.encode(event, producer="capture/x", epoch=3,
                                           event_id="src:binlog.000003:1234:d.t:2"))
    assert fast.event == slow.event == RowsChangedV4.model_validate(event.model_dump())
    assert (fast.envelope.id, fast.envelope.producer, fast.envelope.epoch) == (
        "src:binlog.000003:1234:d.t:2", "capture/x", 3)
    # A value the contract's JSON cannot hold as orjson writes it: the caller falls back.
    too_big = event.model_copy(update={"rows": [RowImageV2.model_construct(
        op="insert", before=None, after={"id": 2**70}, ordinal=0)]})
    with pytest.raises(TypeError):
        encode_rows(too_big, producer="capture/x", epoch=3, event_id="x")


def test_the_pipelines_models_are_what_model_construct_builds() -> None:
    from contracts.events.rows import RowImageV2, SourcePositionV1
    from services.capture.pipeline import _construct

    values = {"op": "update", "before": {"id": 1}, "after": {"id": 2}, "ordinal": 0}
    fast, slow = _construct(RowImageV2, dict(values)), RowImageV2.model_construct(**values)
    assert fast == slow and fast.model_dump() == slow.model_dump() == values
    assert fast.model_fields_set == slow.model_fields_set
    assert fast.model_copy(update={"ordinal": 5}).ordinal == 5
    position = _construct(SourcePositionV1, {"binlog_file": "b.1", "binlog_pos": 4, "gtid": None})
    assert position.model_dump_json() == SourcePositionV1(binlog_file="b.1", binlog_pos=4).model_dump_json()


def test_the_reader_queues_groups_and_counts_items() -> None:
    reader = BinlogReader({}, 1, Position("binlog.000001", 4), max_items=10)
    beats: list[Any] = [Heartbeat(Position("binlog.000001", p)) for p in range(10, 22)]
    assert reader._put_group(beats[:6]) and reader._put_group(beats[6:9])
    assert reader.pending() == 9 and not reader._queue.full()
    assert reader._put(beats[9])
    assert reader._queue.full()  # the bound counts items, not groups
    # A group is not split: the batch passes max_items by less than a group.
    assert reader.take(max_items=4, wait=0.1, linger=0) == beats[:6]
    assert reader.take(max_items=100, wait=0.1, linger=0.001) == beats[6:10]
    assert reader.pending() == 0
