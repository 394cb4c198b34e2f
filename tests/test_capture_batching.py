"""Capture's batching while a backlog drains (no servers): resolved marks on a cadence, the same
messages however the binlog is cut into batches, a restart from any of those marks republishing
the rest identically, and the reader's batches."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from contracts.events.rows import RowsChangedV2, RowsChangedV3, RowsChangedV4, parts_of
from services.capture.binlog_reader import BinlogReader, Commit, Heartbeat, Position
from services.capture.pipeline import SourcePipeline, StartState
from services.capture.rows_encode import encode_rows
from tests.helpers.capture_pipeline import (
    FULL_IMAGE,
    INFO,
    NULL_IMAGE,
    Binlog,
    Event,
    Recorder,
    Tables,
    published_parts,
    xa_workload,
)

START = StartState(Position("binlog.000001", 4), 1, 0)


class BatchRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.span_ends = 0
        self.sent_at_mark: list[int] = []

    async def resolved(self, event: Any, msg_id: str, next_seq: int, *, xa: Any = None,
                       server: str | None = None) -> None:
        self.sent_at_mark.append(len(self.sent))
        await super().resolved(event, msg_id, next_seq, xa=xa, server=server)

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
    assert open_tail.marks == [] and published_parts(open_tail) == published_parts(slow)


@pytest.mark.parametrize("batch", [1, 3, 50, 1000])
async def test_batching_does_not_change_what_is_published(batch: int) -> None:
    items = _backlog().items
    one_by_one = published_parts(await _drain(items, START, 1, resolve_every_s=0))
    assert published_parts(await _drain(items, START, batch, resolve_every_s=0.0005)) == one_by_one


async def test_a_restart_from_any_cadence_mark_republishes_the_rest_identically() -> None:
    items = _backlog().items
    first = await _drain(items, START, 4, resolve_every_s=0)
    published = published_parts(first)
    assert len(first.marks) >= 10
    for mark, next_seq, _xa in first.marks:
        start = StartState(Position(mark.position.binlog_file, mark.position.binlog_pos), mark.ts, next_seq)
        rest = [i for i in items if i.position.pos > mark.position.binlog_pos]
        again = await _drain(rest, start, 9, resolve_every_s=3600)
        assert published_parts(again) == [p for p in published if p[2] >= next_seq]


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
    # A message of one part is written as v3 (readers of v3 read it as before); read as v4.
    assert fast.original_version == 3
    assert fast.event == slow.event == RowsChangedV4.model_validate(event.model_dump())
    assert (fast.envelope.id, fast.envelope.producer, fast.envelope.epoch) == (
        "src:binlog.000003:1234:d.t:2", "capture/x", 3)
    # Several transactions: v4, each part with its own id, ts, seq and position.
    from contracts.events.rows import RowsPartV1
    more = [RowsPartV1.model_construct(
        event_id=f"src:gtid:0-1-{10 + i}:d.t:0", ts=event.ts + i, seq=41 + i, part=0, last_part=True,
        position=SourcePositionV1.model_construct(binlog_file="binlog.000003", binlog_pos=1234 + 100 * i,
                                                  gtid=f"0-1-{10 + i}"),
        rows=event.rows[:i]) for i in (1, 2)]
    batch = RowsChangedV4.model_construct(**{**dict(event), "part": 0, "last_part": True,
                                             "event_id": "src:gtid:0-1-9:d.t:0", "more": more})
    fast = REGISTRY.decode(encode_rows(batch, producer="capture/x", epoch=3, event_id="b+3"))
    slow = REGISTRY.decode(REGISTRY.encode(batch, producer="capture/x", epoch=3, event_id="b+3"))
    assert fast.original_version == 4 and fast.event == slow.event
    assert fast.event == RowsChangedV4.model_validate(batch.model_dump())
    assert [i for i, _ in parts_of(fast.event, "b+3")] == [  # type: ignore[arg-type]
        "src:gtid:0-1-9:d.t:0", "src:gtid:0-1-11:d.t:0", "src:gtid:0-1-12:d.t:0"]
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


# ------------------------------------------------ several transactions per message (v4)

# A source with GTIDs: messages are named by them (DESIGN.md, "Source failover by GTID").
GSTART = StartState(Position("binlog.000001", 4), 1, 0, gtid="0-1-0", ids_by_gtid=True)


def _parts(recorder: Recorder) -> list[tuple[str, int, int, int, bool, list[int]]]:
    """What a reader of the messages sees, each transaction part alone (``parts_of``)."""
    out = []
    for s in recorder.sent:
        assert isinstance(s.event, RowsChangedV2)
        for event_id, part in parts_of(s.event, s.msg_id):
            out.append((event_id, part.ts, part.seq, part.part, part.last_part,
                        [(r.after or {})["id"] for r in part.rows]))
    return out


def _messages(recorder: Recorder) -> list[tuple[str, str]]:
    """Each message's id and its body (time aside): what JetStream's dedupe compares."""
    out = []
    for s in recorder.sent:
        assert isinstance(s.event, RowsChangedV2)
        out.append((s.msg_id, encode_rows(s.event, producer="p", epoch=0, event_id=s.msg_id)
                    .decode().split('"time"')[0] + repr(_parts_of_one(s))))
    return out


def _parts_of_one(s: Any) -> list[Any]:
    return [(i, p.ts, p.seq, p.position.gtid, [r.model_dump() for r in p.rows])
            for i, p in parts_of(s.event, s.msg_id)]


async def _drain_batched(items: list[Event], start: StartState, chunk: int, *, window: int,
                         resolve_every_s: float, part_rows: int = 500,
                         caught_up_at_end: bool = True, caught_up_every: bool = False,
                         cuts: dict[str, int] | None = None) -> BatchRecorder:
    recorder = BatchRecorder()
    pipeline = SourcePipeline("src", recorder, Tables(), start, part_rows=part_rows,  # type: ignore[arg-type]
                              resolve_every_s=resolve_every_s, batch_transactions=window, cuts=cuts)
    try:
        chunks = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        for n, part in enumerate(chunks):
            last = n == len(chunks) - 1
            await pipeline.handle_batch(part, caught_up=caught_up_every or (caught_up_at_end and last))
    finally:
        pipeline.xa.close()
    return recorder


def _seqno(part_id: str) -> int:
    return int(part_id.split(":")[2].split("-")[2])


@pytest.mark.parametrize("window", [2, 4, 16])
async def test_several_transactions_a_message_carry_each_ones_boundary(window: int) -> None:
    items = _backlog().items
    single = await _drain(items, GSTART, 1, resolve_every_s=0)
    batched = await _drain_batched(items, GSTART, 5, window=window, resolve_every_s=0)
    # Each transaction part as the message of its own it was: same id, ts, seq, part, rows.
    assert _parts(batched) == published_parts(single)
    assert len(batched.sent) < len(single.sent)
    for s in batched.sent:
        ids = [i for i, _ in parts_of(s.event, s.msg_id)]  # type: ignore[arg-type]
        # A window's transactions only (GTID seq_no // window), named by the first and the count.
        assert len({_seqno(i) // window for i in ids}) == 1
        assert s.msg_id == (ids[0] if len(ids) == 1 else f"{ids[0]}+{len(ids)}")
        assert isinstance(s.event, RowsChangedV4 if len(ids) > 1 else RowsChangedV3)
    # A mark only where no batch is open: the parts before it (seq < its next seq) are exactly
    # those published before it.
    assert len(batched.marks) >= 3
    for (_mark, next_seq, _xa), sent in zip(batched.marks, batched.sent_at_mark, strict=True):
        before = BatchRecorder()
        before.sent = batched.sent[:sent]
        assert [p[2] for p in _parts(before)] == list(range(next_seq))


async def test_part_limits_end_a_batch_where_the_binlog_says() -> None:
    items = _backlog().items
    batched = await _drain_batched(items, GSTART, 5, window=64, part_rows=5, resolve_every_s=3600)
    assert _parts(batched) == published_parts(await _drain(items, GSTART, 1, resolve_every_s=0))
    sizes = [sum(len(p.rows) for _, p in parts_of(s.event, s.msg_id))  # type: ignore[arg-type]
             for s in batched.sent]
    assert max(sizes) <= 5 and len(batched.sent) > 1


@pytest.mark.parametrize("chunk", [1, 3, 50, 1000])
async def test_batches_do_not_depend_on_how_the_reader_hands_items_over(chunk: int) -> None:
    items = _backlog().items
    reference = _messages(await _drain_batched(items, GSTART, 1, window=8, resolve_every_s=0))
    again = await _drain_batched(items, GSTART, chunk, window=8, resolve_every_s=0.0005)
    assert _messages(again) == reference


async def test_a_restart_from_any_mark_republishes_the_same_messages() -> None:
    """kill -9 after any mark: the re-read's messages are the first reading's, byte for byte
    (time aside) and id for id, so JetStream's duplicate window drops every copy."""
    items = _backlog().items
    first = await _drain_batched(items, GSTART, 4, window=4, resolve_every_s=0)
    messages = _messages(first)
    assert len(first.marks) >= 5
    for mark, next_seq, _xa in first.marks:
        start = StartState(Position(mark.position.binlog_file, mark.position.binlog_pos), mark.ts, next_seq,
                           gtid=mark.position.gtid, ids_by_gtid=True)
        rest = [i for i in items if i.position.pos > mark.position.binlog_pos]
        again = await _drain_batched(rest, start, 9, window=4, resolve_every_s=3600)
        after = [m for m, s in zip(messages, first.sent, strict=True)
                 if s.event.seq >= next_seq]  # type: ignore[attr-defined]
        assert _messages(again) == after


async def test_another_server_of_the_topology_cuts_the_same_batches() -> None:
    """GTID failover: the replica holds the same transactions (same GTIDs, event times) at other
    files and positions; its reading names and cuts every message as the primary's did."""
    items = _backlog().items
    moved: list[Event] = []
    for item in items:
        where = Position("replica-bin.000007", item.position.pos * 3 + 1000)
        moved.append(item._replace(position=where))
    here = await _drain_batched(items, GSTART, 6, window=4, resolve_every_s=0)
    there = await _drain_batched(moved, GSTART, 11, window=4, resolve_every_s=0)
    assert [s.msg_id for s in there.sent] == [s.msg_id for s in here.sent]
    strip = [[(i, ts, seq, gtid, rows) for i, ts, seq, gtid, rows in _parts_of_one(s)] for s in here.sent]
    assert [_parts_of_one(s) for s in there.sent] == strip


async def test_xa_and_batches_publish_every_part_once_in_seq_order() -> None:
    items = xa_workload().items
    single = await _drain(items, GSTART, 1, resolve_every_s=0)
    batched = await _drain_batched(items, GSTART, 3, window=4, part_rows=5, resolve_every_s=0)
    assert _parts(batched) == published_parts(single)
    seqs = [p[2] for p in _parts(batched)]
    assert seqs == sorted(seqs)


async def test_a_reread_cuts_where_the_stored_messages_after_its_mark_were_cut() -> None:
    """Batches the reader's catching up ended (the clock's cut) are followed by a mark at once;
    a capture killed before that mark is stored re-reads from the mark before. Told how the
    messages stored after its mark were cut (``service.load_tail_cuts``), it cuts the same."""
    items = _backlog().items
    # Caught up after every 5 items: batches end wherever the reader's hand-overs fell.
    first = await _drain_batched(items, GSTART, 5, window=16, resolve_every_s=3600, caught_up_every=True)
    messages = _messages(first)
    assert len(first.marks) >= 5
    for i, ((mark, next_seq, _xa), at) in enumerate(zip(first.marks, first.sent_at_mark, strict=True)):
        # Killed before the mark after the next one was stored: two marks' worth of messages
        # stored after this mark.
        stored_to = first.sent_at_mark[min(i + 2, len(first.marks) - 1)]
        stored = first.sent[at:stored_to]
        cuts = {}
        for s in stored:
            first_id, _, count = s.msg_id.rpartition("+")
            cuts.update({first_id: int(count)} if first_id else {s.msg_id: 1})
        start = StartState(Position(mark.position.binlog_file, mark.position.binlog_pos), mark.ts, next_seq,
                           gtid=mark.position.gtid, ids_by_gtid=True)
        rest = [item for item in items if item.position.pos > mark.position.binlog_pos]
        again = await _drain_batched(rest, start, 9, window=16, resolve_every_s=3600, cuts=cuts)
        assert _messages(again)[:len(stored)] == messages[at:stored_to]
        # Without them the binlog's windows alone cut otherwise (what the tail cuts are for).
        if i == 0:
            plain = await _drain_batched(rest, start, 9, window=16, resolve_every_s=3600)
            assert _messages(plain)[:len(stored)] != messages[at:stored_to]


@pytest.mark.parametrize(("kinds", "version"), [(("int", "string"), 3), (("int", "geometry"), 4)])
def test_a_message_of_one_part_is_v3_unless_its_table_has_a_spatial_column(
        kinds: tuple[str, ...], version: int) -> None:
    """``geometry`` came with rows.changed v4: a one-part message of a spatial table is v4 by
    both encoders (the fast one and the registry's, which follows the event's class), any other
    stays v3 for readers older than batching."""
    from contracts.events.rows import ColumnV1, RowImageV2, SourcePositionV1, TableMetaV2
    from contracts.registry import REGISTRY
    from services.capture.pipeline import one_part

    point = "5hAAAAEBAAAAAAAAAAAA8D8AAAAAAAAAQA=="
    meta = TableMetaV2(columns=[ColumnV1(name=f"c{i}", kind=k, sql_type="point" if k == "geometry" else "int")
                                for i, k in enumerate(kinds)], primary_key=["c0"])
    after = {"c0": 1, "c1": point if "geometry" in kinds else "x"}
    # Built as capture builds it (no defaults filled in): what the publisher reads must be there.
    event = one_part(meta, {
        "source": "s", "database": "d", "table": "t", "ts": 5 << 18, "seq": 1, "part": 0, "last_part": True,
        "position": SourcePositionV1(binlog_file="binlog.000001", binlog_pos=4), "meta": meta,
        "rows": [RowImageV2(op="insert", after=after, ordinal=0)]})
    assert not getattr(event, "more", [])  # getattr: v3 has no such field
    if version == 4:
        assert event.more == [] and event.event_id is None  # type: ignore[attr-defined]
    fast = REGISTRY.decode(encode_rows(event, producer="capture/s", epoch=1, event_id="s:1"))
    slow = REGISTRY.decode(REGISTRY.encode(event, producer="capture/s", epoch=1, event_id="s:1"))
    assert fast.original_version == slow.original_version == version
    assert fast.event == slow.event and fast.event.rows[0].after == after  # type: ignore[attr-defined]
