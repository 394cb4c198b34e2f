"""Chunk planning of the initial load, the progress record and binlog-only start points: pure
logic, no servers."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta, timezone

import pytest

from contracts.events.rows import SourcePositionV1
from libs.stream_origin import StreamOrigin, uncovered
from libs.ts import ts_threshold
from services.sink_worker.snapshot.plan import (
    Chunk,
    SnapshotProgress,
    chunks_from_boundaries,
    even_int_boundaries,
    evenly_spread,
    range_condition,
)
from services.sink_worker.span.start_point import position_key


def _in(chunk: Chunk, key: tuple[int, ...]) -> bool:
    return (chunk.lower is None or key > chunk.lower) and (chunk.upper is None or key <= chunk.upper)


def test_chunks_cover_every_key_exactly_once_including_keys_beyond_the_plan() -> None:
    chunks = chunks_from_boundaries([(10,), (20,), (35,)])
    assert [c.id for c in chunks] == [0, 1, 2, 3]
    assert chunks[0].lower is None and chunks[-1].upper is None
    for key in range(-5, 60):
        assert sum(_in(c, (key,)) for c in chunks) == 1, key


def test_no_boundaries_is_one_chunk_for_the_whole_table() -> None:
    assert chunks_from_boundaries([]) == [Chunk(0, None, None)]


@pytest.mark.parametrize(("low", "high", "rows", "chunk_rows"), [
    (1, 100_000, 100_000, 7_000), (1, 10, 10, 3), (-50, 49, 100, 10), (5, 5, 1, 1),
    (1, 2_000_000, 2_000_000, 50_000),
])
def test_even_split_of_a_dense_integer_key(low: int, high: int, rows: int, chunk_rows: int) -> None:
    boundaries = even_int_boundaries(low, high, rows, chunk_rows)
    chunks = chunks_from_boundaries(boundaries)
    sizes = [sum(_in(c, (k,)) for k in range(low, high + 1)) for c in chunks] if high - low < 200_000 else []
    if sizes:
        assert sum(sizes) == high - low + 1
        assert max(sizes) <= chunk_rows + 1
        assert sizes[-1] > 0  # no empty tail chunk
    assert len(chunks) <= max(1, -(-rows // chunk_rows))
    if rows > 2 * chunk_rows:
        assert len(chunks) >= rows // chunk_rows


def test_a_small_table_is_not_split() -> None:
    assert even_int_boundaries(1, 100, 100, 1000) == []
    assert even_int_boundaries(10, 1, 0, 10) == []


def test_sparse_keys_are_not_split_evenly() -> None:
    assert evenly_spread(1, 1000, 1000)
    assert evenly_spread(1, 1500, 1000)
    assert not evenly_spread(1, 10**9, 1000)  # hashes, big gaps
    assert not evenly_spread(1, 1, 0)


def _quote(name: str) -> str:
    return "`" + name + "`"


def test_range_condition_of_a_composite_key_is_a_tuple_comparison() -> None:
    chunk = Chunk(3, ("eu", 5), ("us", 2))
    sql, params = range_condition(["region", "n"], chunk, _quote)
    assert sql == ("((`region` > %s) OR (`region` = %s AND `n` > %s)) AND "
                   "NOT ((`region` > %s) OR (`region` = %s AND `n` > %s))")
    assert params == ["eu", "eu", 5, "us", "us", 2]
    # Evaluated in Python with the same meaning, it selects exactly lower < key <= upper.
    keys = list(itertools.product(["apac", "eu", "us", "zz"], range(0, 8)))

    def matches(key: tuple[str, int], bound: tuple[str, int]) -> bool:
        return key[0] > bound[0] or (key[0] == bound[0] and key[1] > bound[1])

    for key in keys:
        selected = matches(key, ("eu", 5)) and not matches(key, ("us", 2))
        assert selected == (("eu", 5) < key <= ("us", 2)), key


def test_range_condition_of_the_open_ends() -> None:
    assert range_condition(["id"], Chunk(0, None, None), _quote) == ("1=1", [])
    assert range_condition(["id"], Chunk(0, None, (9,)), _quote) == ("NOT ((`id` > %s))", [9])
    assert range_condition(["id"], Chunk(1, (9,), None), _quote) == ("((`id` > %s))", [9])


def test_progress_round_trips_and_resumes_with_the_pending_chunks() -> None:
    progress = SnapshotProgress(changefeed="cf", source="s1", database="db", table="t")
    chunks = chunks_from_boundaries([(10,), (20,)])
    progress.set_plan(["id"], chunks, lambda values: [str(v) for v in values])
    progress.finish_chunk(1, 10)
    progress.finish_chunk(1, 10)  # a chunk reported twice counts once
    progress.low_watermark_ts, progress.low_watermark_seq = 123, 45
    again = SnapshotProgress.from_json(progress.to_json())
    assert again == progress and again.planned
    assert again.chunks_done == 1 and again.rows_copied == 10 and again.chunks_total == 3
    pending = again.pending(lambda values: tuple(int(v) for v in values))
    assert [c.id for c in pending] == [0, 2]
    assert pending[0] == Chunk(0, None, (10,)) and pending[1] == Chunk(2, (20,), None)


def test_progress_json_has_the_fields_the_api_reads() -> None:
    import json

    body = json.loads(SnapshotProgress(changefeed="cf", source="s", database="d", table="t").to_json())
    for name in ("changefeed", "source", "database", "table", "state", "rows_copied", "rows_estimate",
                 "chunks_done", "chunks_total", "low_watermark_ts", "high_watermark_ts", "started_at",
                 "finished_at", "error", "rows_per_s", "eta_s"):
        assert name in body
    assert body["state"] == "pending"
    # Unknown fields from a newer writer are ignored, not an error.
    assert SnapshotProgress.from_json(json.dumps({**body, "later": 1}).encode()).table == "t"


def test_start_time_threshold_keeps_everything_from_the_start_second_on() -> None:
    start = datetime(2026, 11, 22, 10, 0, 5, 600_000, tzinfo=UTC)
    threshold = ts_threshold(start)
    second_ms = int(datetime(2026, 11, 22, 10, 0, 5, tzinfo=UTC).timestamp()) * 1000
    assert threshold == (second_ms << 18) - 1
    assert ts_threshold(start.replace(tzinfo=None)) == threshold  # naive means UTC
    assert ts_threshold(start.astimezone(timezone(timedelta(hours=2)))) == threshold


def test_binlog_positions_order_by_file_number_then_offset() -> None:
    a = SourcePositionV1(binlog_file="mysql-bin.000009", binlog_pos=900)
    b = SourcePositionV1(binlog_file="mysql-bin.000010", binlog_pos=4)
    c = SourcePositionV1(binlog_file="mysql-bin.000010", binlog_pos=120)
    assert position_key(a) < position_key(b) < position_key(c)


def test_speed_and_time_left_of_a_run() -> None:
    p = SnapshotProgress(changefeed="cf", source="s", database="d", table="t", state="copying",
                         rows_estimate=1000, chunks_total=10)
    p.measure(run_started_at=100.0, rows_at_run_start=0, now=100.0)
    assert p.rows_per_s == 0.0 and p.eta_s is None  # nothing copied yet: no guess
    # A resumed run: 200 rows were copied before it, 300 by it in 3 s.
    p.rows_copied, p.chunks_done = 500, 5
    p.measure(run_started_at=100.0, rows_at_run_start=200, now=103.0)
    assert p.rows_per_s == 100.0 and p.eta_s == 5.0
    # The estimate was low: the chunks left at the average chunk size say more.
    p.rows_estimate = 600
    p.measure(run_started_at=100.0, rows_at_run_start=200, now=103.0)
    assert p.eta_s == 5.0
    p.rows_estimate, p.chunks_total = 600, 20
    p.measure(run_started_at=100.0, rows_at_run_start=200, now=103.0)
    assert p.eta_s == 15.0
    p.state = "done"
    p.measure(run_started_at=100.0, rows_at_run_start=200, now=104.0)
    assert p.eta_s == 0.0 and p.rows_per_s == 75.0


def test_a_start_point_before_the_source_stream_begins_is_refused_with_the_reason() -> None:
    began = datetime(2026, 11, 22, 10, 0, 5, 300_000, tzinfo=UTC)
    origin = StreamOrigin("mysql-bin.000010", 120, int(began.timestamp() * 1000) << 18)
    assert StreamOrigin.parse(origin.header()) == origin
    for bad in ("", "{}", "[1]", '{"binlog_file":"","binlog_pos":1,"ts":1}',
                '{"binlog_file":"f","binlog_pos":-1,"ts":1}', "not json"):
        with pytest.raises(ValueError, match="Sluice-Stream-Origin"):
            StreamOrigin.parse(bad)
    pos = [SourcePositionV1(binlog_file=f, binlog_pos=p) for f, p in
           (("mysql-bin.000009", 9000), ("mysql-bin.000010", 4), ("mysql-bin.000010", 119),
            ("mysql-bin.000010", 120), ("mysql-bin.000010", 121), ("mysql-bin.000011", 4))]
    refused = [uncovered(origin, position=p) is not None for p in pos]
    assert refused == [True, True, True, False, False, False]
    reason = uncovered(origin, position=pos[0])
    assert reason is not None and "mysql-bin.000010:120" in reason and "initial_load" in reason
    # A start time: every transaction committed from the start of its second on must be in
    # the stream, so the second must begin at or after capture began.
    times = [began - timedelta(days=1), began.replace(microsecond=0), began,
             began.replace(microsecond=0) + timedelta(seconds=1)]
    assert [uncovered(origin, start_time=t) is not None for t in times] == [True, True, True, False]
    # Nothing recorded (no mark yet, or a mark of an older capture): nothing to refuse by.
    assert uncovered(None, position=pos[0], start_time=times[0]) is None
