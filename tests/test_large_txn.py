"""Transactions larger than a round (``services.sink_worker.round.large_txn``): when the head
transaction is applied streamed, its parts taken once and in order, each window collapsed, and
windows written one after another into one transaction giving what the whole would; the span
reader's buffer bounded when it may stream. No server (SQLite)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from contracts.events.rows import (
    ColumnV1,
    DdlExecutedV1,
    RowImageV2,
    RowsChangedV2,
    SourcePositionV1,
    TableMetaV1,
)
from libs.scheduling.model import Span
from services.sink_worker.round.large_txn import (
    LargeHead,
    LargeTxnError,
    Parts,
    collapse,
    complete,
    large_head,
)
from services.sink_worker.round.pull import PulledEvent, PullResult, SpanReader
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.sql_common import SqlSink

_POS = SourcePositionV1(binlog_file="binlog.000001", binlog_pos=4)
META = TableMetaV1(columns=[ColumnV1(name="id", sql_type="int", kind="int", nullable=False),
                            ColumnV1(name="u", sql_type="int", kind="int"),
                            ColumnV1(name="v", sql_type="varchar(20)", kind="string")],
                   primary_key=["id"], unique_keys=[["u"]])
TABLE = TargetTable(None, "t", META, ("id",), unique_keys=(("u",),))
Image = tuple[str, dict[str, Any] | None, dict[str, Any] | None]


def _event(ts: int, stream_seq: int, part: int, last: bool, *images: Image) -> PulledEvent:
    event = RowsChangedV2(source="s", database="d", table="t", ts=ts, seq=ts, part=part, last_part=last,
                          position=_POS, meta=META,
                          rows=[RowImageV2(op=op, before=b, after=a) for op, b, a in images])
    return PulledEvent(stream_seq=stream_seq, subject="sluice.rows.s.d.t", event_id=f"s:{ts}:{part}",
                       event=event, data=b"x" * 100)


def _ddl(ts: int, stream_seq: int) -> PulledEvent:
    return PulledEvent(stream_seq=stream_seq, subject="sluice.ddl.s.d.t", event_id=f"ddl:{ts}", data=b"",
                       event=DdlExecutedV1(source="s", database="d", table="t", ts=ts, seq=ts,
                                           statement="ALTER TABLE t ADD w INT", position=_POS))


def _rows(e: PulledEvent) -> RowsChangedV2:
    assert isinstance(e.event, RowsChangedV2)
    return e.event


def _ins(i: int) -> Image:
    return ("insert", None, {"id": i, "u": i, "v": "a"})


def test_the_head_is_large_only_when_resolved_read_to_its_end_and_incomplete_in_the_buffer() -> None:
    head = [_event(20, 11, 0, False, _ins(1)), _event(20, 12, 1, False, _ins(2))]
    rest = [(13, 20), (14, 20), (15, 30)]  # the transaction's last parts, then a later one
    pulled = PullResult(events=head, ghosts=rest, read_upto=15, reached=True)
    assert large_head(pulled, 10, 40) == LargeHead(ts=20, last_seq=14)
    assert large_head(pulled, 10, 19) is None  # not resolved
    assert large_head(pulled, 10, None) is None
    assert large_head(PullResult(events=head, ghosts=rest, read_upto=15, reached=False), 10, 40) is None
    # Something older than the head not read yet: the horizon is below it.
    older = PullResult(events=head, ghosts=[(13, 20), (14, 15)], read_upto=14, reached=True)
    assert large_head(older, 10, 40) is None
    # Whole in the buffer: the round's cut applies it.
    whole = [*head, _event(20, 13, 2, True, _ins(3))]
    assert large_head(PullResult(events=whole, ghosts=[(15, 30)], read_upto=15, reached=True), 10, 40) is None
    # A complete transaction before it: the cut applies that first; it is the head next round.
    before = [_event(15, 10, 0, True, _ins(9)), *head]
    assert large_head(PullResult(events=before, ghosts=rest, read_upto=15, reached=True), 10, 40) is None
    ddl = PullResult(events=[_ddl(20, 11)], ghosts=[], read_upto=11, reached=True)
    assert large_head(ddl, 10, 40) is None
    # Events at or below the checkpoint are applied already; the head is the next ts.
    assert large_head(pulled, 5, 40) == LargeHead(ts=20, last_seq=14)


def test_complete_counts_copies_once() -> None:
    a, b = _event(20, 1, 0, False, _ins(1)), _event(20, 2, 1, True, _ins(2))
    assert complete([a, b]) and complete([a, a, b]) and not complete([b]) and not complete([a, a])


def test_parts_are_taken_once_in_order_up_to_the_last() -> None:
    parts = Parts()
    assert [parts.take(p, last) for p, last in [(0, False), (1, False), (0, False), (1, False), (2, True)]] \
        == [True, True, False, False, True]
    assert parts.done
    with pytest.raises(LargeTxnError):
        Parts().take(1, False)  # part 0 missing
    done = Parts()
    done.take(0, True)
    with pytest.raises(LargeTxnError):
        done.take(1, False)


def test_a_window_keeps_the_last_change_per_key_and_deletes_a_changed_key() -> None:
    events = [_rows(_event(20, 1, 0, False, _ins(1), _ins(2), ("update", {"id": 1, "u": 1, "v": "a"},
                                                                {"id": 1, "u": 1, "v": "b"}))),
              _rows(_event(20, 2, 1, True,
                           ("update", {"id": 2, "u": 2, "v": "a"}, {"id": 3, "u": 2, "v": "a"}),
                           ("delete", {"id": 1, "u": 1, "v": "b"}, None)))]
    w = collapse(events, TABLE)
    assert w.rows == 5
    assert w.deletes == [(1,), (2,)]
    assert w.upserts == [((3,), {"id": 3, "u": 2, "v": "a"})]
    with_origin = collapse(events[:1], TABLE, ("shard", "s1"))
    assert with_origin.upserts[0][1] == {"id": 1, "u": 1, "v": "b", "shard": "s1"}


def _sink(tmp_path: Path, name: str, rows: dict[int, tuple[int, str]]) -> SqlSink:
    sink = open_sink(f"sqlite:///{tmp_path / name}")
    assert isinstance(sink, SqlSink)
    sink.ensure_table(TABLE)
    if rows:
        colmap = {c.name: c for c in META.columns}
        sink._run(lambda cur: sink._apply(cur, TABLE, colmap, [], [((i,), {"id": i, "u": u, "v": v})
                                                                     for i, (u, v) in rows.items()]), "seed")
    return sink


def _state(sink: SqlSink) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in sink.fetch_rows(TABLE))


def _random_transaction(rng: random.Random, rows: dict[int, tuple[int, str]], changes: int) -> list[Image]:
    """Row changes as a source with a unique ``u`` could binlog them, applied to ``rows``: every
    image is valid at its place (row by row unique checks), keys and unique values move around."""
    images: list[Image] = []
    free_u = [u for u in range(60) if u not in {u for u, _ in rows.values()}]
    for _ in range(changes):
        op = rng.random()
        if rows and op < 0.5:  # update, sometimes of the key, sometimes taking a freed unique value
            i = rng.choice(list(rows))
            u, v = rows[i]
            new_i = rng.choice([i, i, rng.randrange(60)])
            if new_i != i and new_i in rows:
                new_i = i
            new_u = u
            if free_u and rng.random() < 0.5:
                new_u = free_u.pop(rng.randrange(len(free_u)))
                free_u.append(u)
            new_v = rng.choice("abc")
            images.append(("update", {"id": i, "u": u, "v": v}, {"id": new_i, "u": new_u, "v": new_v}))
            del rows[i]
            rows[new_i] = (new_u, new_v)
        elif rows and op < 0.7:
            i = rng.choice(list(rows))
            u, v = rows.pop(i)
            free_u.append(u)
            images.append(("delete", {"id": i, "u": u, "v": v}, None))
        elif free_u:
            i = rng.randrange(60)
            if i in rows:
                continue
            u = free_u.pop(rng.randrange(len(free_u)))
            rows[i] = (u, "n")
            images.append(("insert", None, {"id": i, "u": u, "v": "n"}))
    return images


@pytest.mark.parametrize("seed", range(25))
def test_windows_written_in_order_give_the_source_state_and_replay_alike(tmp_path: Path, seed: int) -> None:
    """A transaction cut into windows anywhere (mid-transaction, unique values and keys moving)
    written window after window in one downstream transaction ends where the source did, and
    applying it again on that result (a crash before the checkpoint) changes nothing."""
    rng = random.Random(seed)
    start = {i: (i, "s") for i in range(0, 40, 2)}
    rows = dict(start)
    images = _random_transaction(rng, rows, 60)
    per_part = rng.choice([1, 2, 5])
    events = [_rows(_event(20, n + 1, n, False, *images[i:i + per_part]))
              for n, i in enumerate(range(0, len(images), per_part))]
    sink = _sink(tmp_path, "down.db", start)
    colmap = {c.name: c for c in META.columns}
    window = rng.choice([1, 2, 3, 7])

    def apply_all(cur: Any) -> None:
        for i in range(0, len(events), window):
            w = collapse(events[i:i + window], TABLE)
            sink._apply(cur, TABLE, colmap, w.deletes, w.upserts)

    want = sorted((i, u, v) for i, (u, v) in rows.items())
    for _ in range(2):
        sink._run(apply_all, "apply a large transaction")
        assert _state(sink) == want


def _reader(stream_large: bool) -> SpanReader:
    reader = SpanReader(None, Span("cf", "s", "d", "t"), max_bytes=1000)  # type: ignore[arg-type]
    reader.stream_large = stream_large
    return reader


def test_a_reader_that_may_stream_keeps_no_more_of_an_open_transaction_than_its_allowance() -> None:
    for stream_large, wants in ((False, True), (True, False)):
        reader = _reader(stream_large)
        for n in range(3):
            reader._keep(_event(20, n + 1, n, False, _ins(n)))
        assert reader._wants_body(3, ghosts=False) is wants  # the limit is reached mid-transaction
    reader = _reader(True)
    for n in range(12):  # over the byte budget (100 bytes an event) the same way
        reader._keep(_event(20, n + 1, n, False, _ins(n)))
    assert not reader._wants_body(100, ghosts=False)


def test_an_open_transaction_keeps_at_most_a_window_of_bodies_when_it_may_stream() -> None:
    reader = _reader(True)
    reader.max_bytes = 10**9
    reader.open_max = (2, 10**9)
    reader._keep(_event(10, 1, 0, True, _ins(1)))  # a whole transaction first: it does not count
    reader._keep(_event(20, 2, 0, False, _ins(2)))
    assert reader._wants_body(1000, ghosts=False)
    reader._keep(_event(20, 3, 1, False, _ins(3)))
    assert not reader._wants_body(1000, ghosts=False)
    reader.buffer = reader.buffer[2:]  # as a pull cuts the front: the count follows the buffer
    reader._count_open()
    assert reader._open == (20, 1, 100) and reader._wants_body(1000, ghosts=False)
    reader.stream_large = False  # the others keep the whole transaction, as before
    reader._keep(_event(20, 4, 2, False, _ins(4)))
    assert reader._wants_body(1000, ghosts=False)


class _StreamReader:
    """The span's stream as ``apply_large`` reads it (``SpanReader.pull``'s contract: events
    after the checkpoint's stream seq, at most ``limit``), from a list, without a server."""

    def __init__(self, events: list[PulledEvent]) -> None:
        self.span = Span("cf", "s", "d", "t")
        self.events = events
        self.read_upto = 0
        self.closed = False

    async def pull(self, checkpoint: tuple[int, int], limit: int, until_seq: int | None) -> PullResult:
        seq, ts = checkpoint
        out = [e for e in self.events if e.stream_seq > seq and e.ts > ts][:limit]
        self.read_upto = max([self.read_upto, *(e.stream_seq for e in out)])
        return PullResult(events=out, ghosts=[], read_upto=self.read_upto, reached=True)

    async def close(self) -> None:
        self.closed = True


def _updates(n_parts: int, per_part: int, start: int = 0) -> list[PulledEvent]:
    """A transaction (ts 20) updating ``v`` of rows 0.. in parts, from stream seq ``start`` + 1."""
    return [_event(20, start + p + 1, p, p == n_parts - 1,
                   *[("update", {"id": i, "u": i, "v": "s"}, {"id": i, "u": i, "v": "t"})
                     for i in range(p * per_part, (p + 1) * per_part)])
            for p in range(n_parts)]


async def test_apply_large_writes_one_transaction_skips_copies_and_rolls_back_a_broken_one(
        tmp_path: Path) -> None:
    from services.sink_worker.round.large_txn import LargeTxnOptions, apply_large

    start = {i: (i, "s") for i in range(12)}
    parts = _updates(4, 3)
    # A re-published copy of parts 0-1 after part 2, and a later transaction's event: skipped.
    stream = [_event(10, 1, 0, True, _ins(50)), *_updates(4, 3, start=1)[:3],
              *_updates(2, 3, start=1), _updates(4, 3, start=10)[3], _event(30, 20, 0, True, _ins(60))]
    sink = _sink(tmp_path, "a.db", start)
    reader = _StreamReader(stream)
    cut, outcome = await apply_large(reader, sink, TABLE, LargeHead(ts=20, last_seq=14), 1, None,  # type: ignore[arg-type]
                                     LargeTxnOptions(window_events=2))
    assert outcome.written and outcome.rows == 12 and reader.closed
    assert (cut.limit_ts, cut.batch_max_ts, cut.batch_events) == (20, 20, 4)
    assert _state(sink) == [(i, i, "t") for i in range(12)]

    # Part 2 missing (the stream goes from part 1 to part 3): nothing of it stays downstream.
    broken = [parts[0], parts[1], parts[3]]
    for split, kept in ((0, []), (3, list(range(6)))):
        sink = _sink(tmp_path, f"b{split}.db", start)
        with pytest.raises(LargeTxnError):
            await apply_large(_StreamReader(broken), sink, TABLE, LargeHead(ts=20, last_seq=4), 0,  # type: ignore[arg-type]
                              None, LargeTxnOptions(window_events=1, split_rows=split))
        # split_rows: the windows committed before the failure stay (not atomic, documented).
        assert _state(sink) == [(i, i, "t" if i in kept else "s") for i in range(12)]


def test_the_split_is_a_changefeed_setting_and_older_changefeeds_stay_atomic() -> None:
    from datetime import datetime

    from contracts import REGISTRY, Envelope
    from contracts.events.changefeeds import (
        ChangefeedCreatedV8,
        ChangefeedCreatedV9,
        ChangefeedSpecV8,
        ChangefeedSpecV9,
        SourceRefV1,
    )
    from services.sink_worker.span.runtime import SpanConfig

    spec = ChangefeedSpecV8(id="cf", sources=[SourceRefV1(id="s1", url="mysql://u@h/")], sink_url="sqlite:///x")
    old = Envelope(type="changefeed.created", version=8, id="e1", producer="test", epoch=0,
                   time=datetime(2026, 11, 27), data=ChangefeedCreatedV8(spec=spec).model_dump(mode="json"))
    event = REGISTRY.decode(old.model_dump_json().encode()).event
    assert isinstance(event, ChangefeedCreatedV9) and event.spec.large_txn_split_rows is None
    assert SpanConfig.of(event.spec, "s1").large_txn_split_rows == 0  # one downstream transaction
    split = ChangefeedSpecV9.model_validate({**spec.model_dump(), "large_txn_split_rows": 50_000})
    assert SpanConfig.of(split, "s1").large_txn_split_rows == 50_000
    with pytest.raises(ValueError, match="large_txn_split_rows"):
        ChangefeedSpecV9.model_validate({**spec.model_dump(), "large_txn_split_rows": 10})


def test_the_api_takes_a_split_for_a_sql_downstream_and_refuses_it_for_a_stream() -> None:
    from services.api.source_refs import ChangefeedSpecIn
    from services.api.validation import spec_problems

    body = {"id": "cf", "sources": [{"id": "s", "url": "mysql://u@h/"}], "sink_url": "sqlite:///x.db",
            "large_txn_split_rows": 100_000}
    sql = ChangefeedSpecIn.model_validate(body)
    assert not [p for p in spec_problems(sql) if "large_txn_split_rows" in p["loc"]]
    stream = sql.model_copy(update={"sink_url": "nats://127.0.0.1:4222/OUT?subject=out"})
    [problem] = [p for p in spec_problems(stream) if "large_txn_split_rows" in p["loc"]]
    assert "SQL downstreams" in problem["msg"]


def test_changefeed_get_says_how_large_transactions_are_committed(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import render

    render.changefeed({"id": "cf", "state": "running", "tables": 1,
                       "spec": {"id": "cf", "large_txn_split_rows": 250000}})
    assert "large transactions: committed every 250,000 row changes (not atomic" in capsys.readouterr().out
    render.changefeed({"id": "cf", "state": "running", "tables": 1, "spec": {"id": "cf"}})
    assert "large transactions: one downstream transaction each" in capsys.readouterr().out
