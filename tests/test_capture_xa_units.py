"""XA bookkeeping of capture without servers: XID parsing, the book and its spill file, and the
pipeline's publishing of XA transactions, down to a restart from every resolved mark publishing
exactly what the first reading did after it (same ids, ts, seq and rows)."""

from __future__ import annotations

import pytest

from contracts.events.rows import RowImageV2
from services.capture.binlog_reader import Position, Query
from services.capture.pipeline import StartState
from services.capture.xa import XaBook, XaResume, canonical_xid, parse_xa
from tests.helpers.capture_pipeline import INFO, KEY, published_parts, read_items, xa_workload

# ------------------------------------------------------------------ XIDs

A1 = "X'6131',X'',1"


@pytest.mark.parametrize(("query", "verb", "xid", "one_phase"), [
    ("XA END X'6131',X'',1", "end", A1, False),
    ("XA COMMIT X'6131',X'',1", "commit", A1, False),
    ("xa commit 'a1'", "commit", A1, False),
    ("XA COMMIT 'a1', '', 1", "commit", A1, False),
    ("XA ROLLBACK X'6232',X'71',7", "rollback", "X'6232',X'71',7", False),
    ("XA ROLLBACK 'b2','q',7", "rollback", "X'6232',X'71',7", False),
    ("XA COMMIT 0xAB, 'Q''z', 7", "commit", "X'ab',X'51277a',7", False),
    ("XA COMMIT X'AB',X'51277A',7", "commit", "X'ab',X'51277a',7", False),
    ("XA COMMIT X'6333',X'',1 ONE PHASE", "commit", "X'6333',X'',1", True),
    ("XA START X'6131',X'',1", "start", A1, False),
    ("XA BEGIN 'a1'", "start", A1, False),
    ("XA END 'a1' SUSPEND FOR MIGRATE", "end", A1, False),
    ("XA PREPARE \"a1\"", "prepare", A1, False),
    ("XA COMMIT a1", "commit", None, False),  # not an XID the server writes: no guess
    ("XA COMMIT 'a1' TWICE", "commit", None, False),
    ("XA RECOVER", "other", None, False),
])
def test_xa_statements(query: str, verb: str, xid: str | None, one_phase: bool) -> None:
    parsed = parse_xa(query)
    assert parsed is not None
    assert (parsed.verb, parsed.xid, parsed.one_phase) == (verb, xid, one_phase)


@pytest.mark.parametrize("query", ["COMMIT", "BEGIN", "INSERT INTO xa VALUES (1)", "XAR COMMIT 'a'"])
def test_other_statements_are_not_xa(query: str) -> None:
    assert parse_xa(query) is None


def test_canonical_xid_is_what_the_server_writes() -> None:
    assert canonical_xid(b"a1") == A1
    assert canonical_xid(b"b2", b"q", 7) == "X'6232',X'71',7"


# ------------------------------------------------------------------ the book

def _rows(start: int, n: int) -> list[RowImageV2]:
    return [RowImageV2.model_construct(op="update", before={"id": i, "v": None},
                                       after={"id": i, "v": f"é{i}", "f": 0.1 * i}, ordinal=i)
            for i in range(start, start + n)]


def test_parts_past_the_budget_go_to_disk_and_come_back_identical() -> None:
    book = XaBook(memory_bytes=1000)
    txn = book.open(Position("b.1", 100))
    parts = [_rows(0, 3), _rows(3, 3), _rows(6, 3)]
    for part in parts:
        book.add(txn, KEY, INFO, Position("b.1", 200), part, 400)
    assert book.in_memory == 800 and book.spilled > 0  # the third went to the file
    assert book.prepare(A1, txn) is None
    back = [[r.model_dump() for r in p] for p in txn.parts(KEY)]
    assert back == [[r.model_dump() for r in p] for p in parts]
    taken = book.take(A1)
    assert taken is txn and A1 not in book
    book.release(txn)
    assert (book.in_memory, book.spilled) == (0, 0)


def test_resume_names_the_oldest_group_and_every_waiting_xid() -> None:
    book = XaBook(memory_bytes=0)
    assert book.resume() is None
    for xid, pos in ((A1, 500), ("X'62',X'',1", 300), ("X'63',X'',1", 900)):
        txn = book.open(Position("b.2", pos))
        book.add(txn, KEY, INFO, Position("b.2", pos + 10), _rows(0, 1), 10)
        book.prepare(xid, txn)
    older = book.open(Position("b.1", 999999))
    book.add(older, KEY, INFO, Position("b.1", 1000000), _rows(0, 1), 10)
    book.prepare("X'64',X'',1", older)
    resume = book.resume()
    assert resume == XaResume(Position("b.1", 999999), ("X'6131',X'',1", "X'62',X'',1", "X'63',X'',1",
                                                        "X'64',X'',1"))
    assert XaResume.from_header(resume.header()) == resume
    assert book.rollback("X'62',X'',1") and not book.rollback("X'62',X'',1")
    missing, dropped = book.retain((A1, "X'65',X'',1"))
    assert missing == ["X'65',X'',1"] and dropped == ["X'63',X'',1", "X'64',X'',1"]
    assert len(book) == 1 and book.spilled > 0
    book.close()
    assert book.spilled == 0


# ------------------------------------------------------------------ the pipeline

async def test_xa_transactions_are_published_at_their_commit() -> None:
    b = xa_workload()
    recorder = await read_items(StartState(Position("binlog.000001", 4), 1, 0), b.items, xa_memory_bytes=300)
    published = published_parts(recorder)
    ids = [row for *_, rows in published for row in rows]
    # In commit order; b rolled back, d not decided yet.
    assert ids == [1, 2, 3, *range(100, 123), 400, 4, 300]
    a_parts = [p for p in published if p[5][0] >= 100 and p[5][0] < 123]
    assert [len(p[5]) for p in a_parts] == [5, 5, 5, 5, 3] and [p[4] for p in a_parts] == [False] * 4 + [True]
    # One transaction: one ts, ids from the commit group's position, not the prepared group's.
    assert len({p[1] for p in a_parts}) == 1
    commit_a = next(i for i in b.items if isinstance(i, Query) and i.query.startswith("XA COMMIT X'61'"))
    begin_a = b.items[b.items.index(commit_a) - 1]
    assert a_parts[0][0] == f"src:{begin_a.position.file}:{begin_a.position.pos}:d.t:0"
    ts_3 = next(p[1] for p in published if p[5] == [3])
    assert a_parts[0][1] > ts_3  # the commit's ts, after what committed before it
    assert [p[2] for p in published] == list(range(len(published)))
    # Marks between a prepare and its decision say where the oldest waiting group starts.
    xa_marks = [xa for _, _, xa in recorder.marks]
    assert xa_marks[-1] is not None and xa_marks[-1].xids == ("X'64',X'',1",)
    assert any(xa is not None and set(xa.xids) == {"X'61',X'',1", "X'62',X'',1", "X'63',X'',1"}
               for xa in xa_marks)


async def test_a_restart_from_any_mark_publishes_what_the_first_reading_did() -> None:
    b = xa_workload()
    first = await read_items(StartState(Position("binlog.000001", 4), 1, 0), b.items, xa_memory_bytes=300)
    published = published_parts(first)
    restarts = 0
    for mark, next_seq, xa in first.marks:
        at = Position(mark.position.binlog_file, mark.position.binlog_pos)
        start = StartState(at, mark.ts, next_seq, xa)
        read_from = (xa.begin if xa else start.position).pos
        again = await read_items(start, [i for i in b.items if i.position.pos > read_from],
                            xa_memory_bytes=300 if restarts % 2 else 10**9)  # spilled or not
        assert published_parts(again) == [p for p in published if p[2] >= next_seq], (mark, xa)
        assert [m[0] for m in again.marks] == [m[0] for m in first.marks if
                                               m[0].position.binlog_pos > mark.position.binlog_pos]
        restarts += xa is not None
    assert restarts >= 5
