"""Source failover by GTID without servers: GTID lists parsed and compared, the decision whether
another server can continue a stream (covers / lost / gap), and the pipeline's names for what it
publishes, which must not depend on the server read (DESIGN.md, "Source failover by GTID")."""

from __future__ import annotations

import pytest

from contracts.events.changefeeds import ChangefeedCreatedV4, ChangefeedSpecV4, SourceRefV1
from contracts.events.rows import RowsChangedV2
from contracts.events.sources import SourceMovedV1, SourceRegisteredV1
from libs.changefeeds import ChangefeedView
from libs.gtid import Gtid, GtidError, GtidState, judge_move, move_refusal, parse_list
from services.capture.binlog_reader import Begin, Commit, Position, RowImage, Rows
from services.capture.pipeline import SourcePipeline, StartState
from services.capture.service import placed_stops
from tests.helpers.capture_pipeline import COLUMNS, Recorder, Tables

# ------------------------------------------------------------------ arithmetic


def test_gtids_parse_and_spell_back() -> None:
    assert Gtid.parse(" 0-1-100 ") == Gtid(0, 1, 100)
    assert str(Gtid(3, 20, 7)) == "3-20-7"
    assert parse_list("0-1-100,1-2-5") == [Gtid(0, 1, 100), Gtid(1, 2, 5)]
    assert parse_list("") == [] and parse_list(None) == []
    for bad in ("0-1", "a-b-c", "3E11FA47-71CA-11E1-9E33-C80AA9429562:23", "0-1-2-3"):
        with pytest.raises(GtidError):
            Gtid.parse(bad)


def test_the_state_keeps_the_last_gtid_of_each_domain() -> None:
    state = GtidState.parse("1-2-5,0-1-100")
    state.advance(Gtid(0, 1, 101))
    state.advance(Gtid(2, 1, 1))
    assert state.text() == "0-1-101,1-2-5,2-1-1"
    assert GtidState.parse(state.text()) == state
    with pytest.raises(GtidError):
        GtidState.parse("0-1-5,0-2-6")
    assert not GtidState.parse("")


MARK = GtidState.parse("0-1-100")


def test_a_promoted_replica_with_everything_covers_the_mark() -> None:
    # It applied up to 0-1-100 and wrote its own transactions after the promotion.
    judged = judge_move(MARK, "0-2-105", "0-1-100,0-2-105")
    assert judged.ok and judged.verdict == "covers"
    assert judge_move(MARK, "0-1-100", "0-1-100").ok
    assert judge_move(GtidState.parse("0-1-100,1-1-7"), "0-1-120,1-1-9", "1-1-9,0-1-120").ok


def test_a_replica_that_lagged_lost_what_the_stream_holds() -> None:
    judged = judge_move(MARK, "0-1-97", "0-1-97")
    assert judged.verdict == "lost" and "0-1-100" in judged.reason and "0-1-97" in judged.reason
    # Promoted while behind, then written to: its seq numbers pass the mark's, but it never had
    # 0-1-98..100 (a diverged history), which a seq-only comparison would miss.
    judged = judge_move(MARK, "0-2-101", "0-1-97,0-2-101")
    assert judged.verdict == "lost" and "0-1-100" in judged.reason
    assert judge_move(MARK, "", "").verdict == "lost"
    assert judge_move(GtidState.parse("0-1-100,1-1-7"), "0-1-100", "0-1-100").verdict == "lost"


def test_a_domain_the_stream_never_saw_is_a_gap() -> None:
    judged = judge_move(MARK, "0-1-100,5-9-3", "0-1-100,5-9-3")
    assert judged.verdict == "gap" and "5-9-3" in judged.reason
    assert judge_move(GtidState(), "0-1-1", "0-1-1").verdict == "gap"


def test_move_refusals_name_their_reason() -> None:
    ok = {"xa_prepared": False, "mariadb": True, "server_pos": "0-2-101", "server_state": "0-1-100,0-2-101"}
    assert move_refusal("0-1-100", **ok) is None  # type: ignore[arg-type]
    assert "not MariaDB" in (move_refusal("0-1-100", **{**ok, "mariadb": False}) or "")  # type: ignore[arg-type]
    assert "no GTID position" in (move_refusal(None, **ok) or "")  # type: ignore[arg-type]
    assert "XA" in (move_refusal("0-1-100", **{**ok, "xa_prepared": True}) or "")  # type: ignore[arg-type]
    lagged = move_refusal("0-1-100", **{**ok, "server_pos": "0-1-90", "server_state": "0-1-90"})  # type: ignore[arg-type]
    assert lagged is not None and "lacks" in lagged


# ------------------------------------------------------------------ the pipeline's names

Item = Begin | Rows | Commit


def _binlog(file: str, first_pos: int, seqs: range, *, rotate_after: int | None = None) -> list[Item]:
    """The same transactions (GTID 0-1-n, same event times and rows) as one server's binlog
    holds them: ``file`` and positions are the server's own. ``rotate_after``: the next binlog
    file starts after that many transactions."""
    items: list[Item] = []
    where = [file, first_pos]

    def at() -> Position:
        where[1] = int(where[1]) + 37
        return Position(str(where[0]), int(where[1]))

    for n, seq in enumerate(seqs):
        if rotate_after is not None and n == rotate_after:
            where = [file[:-1] + str(int(file[-1]) + 1), 4]
        items.append(Begin(at(), 1_800_000_000 + seq, f"0-1-{seq}"))
        images = tuple(RowImage(None, {"id": seq * 10 + i, "v": f"v{seq}"}, {}, {})
                       for i in range(seq % 3 + 1))
        items.append(Rows(at(), 0, "d", "t", "insert", COLUMNS, images))
        items.append(Commit(at(), 0))
    return items


async def _read(start: StartState, items: list[Item], server: str) -> Recorder:
    recorder = Recorder()
    pipeline = SourcePipeline("src", recorder, Tables(), start, part_rows=2, server=server)  # type: ignore[arg-type]
    for item in items:
        await pipeline.handle(item)
        await pipeline.publish_resolved()
    pipeline.xa.close()
    return recorder


def _messages(recorder: Recorder) -> list[tuple[str, int, int, int, bool, object]]:
    out = []
    for sent in recorder.sent:
        event = sent.event
        assert isinstance(event, RowsChangedV2)
        out.append((sent.msg_id, event.ts, event.seq, event.part, event.last_part,
                    [r.model_dump() for r in event.rows]))
    return out


async def test_a_failover_continues_with_the_same_messages_from_any_mark() -> None:
    old = _binlog("old-bin.000007", 900, range(1, 13))
    first = await _read(StartState(Position("old-bin.000007", 900), 1, 0, gtid="0-1-0",
                                   ids_by_gtid=True, server="1"), old, "1")
    published = _messages(first)
    assert published and all(":gtid:0-1-" in m[0] for m in published)
    marks = [mark for mark, _, _ in first.marks]
    assert marks[-1].position.gtid == "0-1-12"
    for mark, next_seq, _ in first.marks:
        assert mark.position.gtid is not None
        done = Gtid.parse(mark.position.gtid).seq
        # The promoted replica holds the same transactions in files and positions of its own,
        # and the binlog dump sends those after the mark's GTID.
        new = _binlog("replica-bin.000002", 4, range(done + 1, 13))
        start = StartState(Position(mark.position.binlog_file, mark.position.binlog_pos), mark.ts, next_seq,
                           gtid=mark.position.gtid, ids_by_gtid=True, server="1")
        again = await _read(start, new, "2")
        assert _messages(again) == [m for m in published if m[2] >= next_seq], mark


async def test_ids_by_position_turn_to_gtid_at_the_next_binlog_file_whatever_the_restart() -> None:
    """A mark of an older capture (names by position, no GTID position): the names change at the
    first transaction of the next binlog file, so a re-read from any such mark names alike."""
    items = _binlog("bin.000001", 4, range(1, 9), rotate_after=4)
    first = await _read(StartState(Position("bin.000001", 4), 1, 0, gtid="0-1-0", server="1"), items, "1")
    published = _messages(first)
    by_position = [m for m in published if ":gtid:" not in m[0]]
    assert by_position and all(m[0].startswith("src:bin.000001:") for m in by_position)
    assert all(":gtid:" in m[0] for m in published[len(by_position):])
    legacy = [(mark, seq) for mark, seq, _ in first.marks if mark.position.gtid is None]
    assert legacy and first.marks[-1][0].position.gtid == "0-1-8"
    for mark, next_seq in legacy:
        at = Position(mark.position.binlog_file, mark.position.binlog_pos)
        rest = [i for i in items if (i.position.file, i.position.pos) > (at.file, at.pos)]
        # The restarting capture asks the server for the GTID position at the mark.
        seen = [i for i in items
                if isinstance(i, Begin) and (i.position.file, i.position.pos) < (at.file, at.pos)]
        start = StartState(at, mark.ts, next_seq, gtid=seen[-1].gtid if seen else "0-1-0", server="1")
        again = await _read(start, rest, "1")
        assert _messages(again) == [m for m in published if m[2] >= next_seq], mark


# ------------------------------------------------------------------ source.moved


def test_a_move_changes_the_registry_and_every_changefeed_reading_the_source() -> None:
    old, new = "mysql://repl:secret:pw@db-a:3306/", "mysql://repl:secret:pw@db-b:3306/"
    other = "mysql://repl:secret:pw@db-c:3306/"
    view = ChangefeedView()
    view.apply(SourceRegisteredV1(id="shop", url=old))
    view.apply(ChangefeedCreatedV4(spec=ChangefeedSpecV4(
        id="cf", sources=[SourceRefV1(id="shop", url=old), SourceRefV1(id="more", url=other)],
        sink_url="sqlite:///x.db")))
    view.apply(ChangefeedCreatedV4(spec=ChangefeedSpecV4(
        id="elsewhere", sources=[SourceRefV1(id="more", url=other)], sink_url="sqlite:///y.db")))
    untouched = view.specs["elsewhere"]
    assert view.apply(SourceMovedV1(id="shop", url=new, reason="covers")) is True  # workers act on it
    assert view.sources["shop"] == new
    assert [(s.id, s.url) for s in view.specs["cf"].sources] == [("shop", new), ("more", other)]
    assert view.specs["elsewhere"] is untouched
    assert view.apply(SourceMovedV1(id="shop", url=new)) is False  # folded again: nothing changes


def test_after_a_move_tables_stopped_before_the_mark_stay_stopped_and_later_ones_are_read_again() -> None:
    mark = Position("old-bin.000007", 5000)
    stopped = {("d", "before"): Position("old-bin.000007", 100), ("d", "anywhere"): None,
               ("d", "after"): Position("old-bin.000007", 9000), ("d", "at"): mark}
    # The new server's positions are not the old one's: a kept stop holds from anywhere.
    assert placed_stops(stopped, mark) == {("d", "before"): None, ("d", "anywhere"): None, ("d", "at"): None}
