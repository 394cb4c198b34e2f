"""Capture's pipeline without servers: a recorder standing in for the NATS publisher, one fixed
table standing in for information_schema, and binlog items built by hand (``Binlog``), for the
unit tests of XA, batching, GTIDs and the publisher's framing."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from contracts.events.rows import ResolvedAdvancedV1, RowsChangedV2
from libs.codec.table_meta import BinlogColumn, ColumnSpec, TableInfo
from libs.foreign_keys import ForeignKey
from services.capture.binlog_reader import Begin, Commit, Position, Query, RowImage, Rows, XaPrepare
from services.capture.pipeline import MetaStore, SourcePipeline, StartState, TableKey
from services.capture.xa import XaResume

# The image of test_capture_rows' row of every type, as capture publishes it, and its all-NULL row.
FULL_IMAGE: dict[str, Any] = {
    "id": 18446744073709551615, "i": -2147483648, "si": 65535, "d": "-123456789.125", "f": 1.5,
    "dbl": 2.25, "s": "héllo 😀", "tx": "long text ✓", "b": base64.b64encode(b"\x00\xff\x10").decode(),
    "vb": base64.b64encode(b"\xde\xad\xbe\xef").decode(), "dt": "2024-02-29",
    "dtt": "2024-02-29T23:59:58.123456", "ts": "2024-03-01T01:02:03.456000", "tm": "-12:34:56.780000",
    "j": '{"k": [1, "ü"]}', "e": "large", "st": "a,c", "bt": 513, "yr": 2024,
}
NULL_IMAGE = {**dict.fromkeys(FULL_IMAGE, None), "id": 2, "st": ""}

INFO = TableInfo("d", "t", (ColumnSpec("id", "int", "int", False), ColumnSpec("v", "string", "text")),
                 primary_key=("id",), declared_primary_key=True)
KEY: TableKey = ("d", "t")


@dataclass
class Sent:
    subject: str
    msg_id: str
    event: BaseModel


class Recorder:
    """Stands in for the NATS publisher: what the pipeline publishes, in order."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.marks: list[tuple[ResolvedAdvancedV1, int, XaResume | None]] = []

    async def send(self, subject: str, event: BaseModel, msg_id: str, *, rows: int = 0,
                   size_bound: int | None = None) -> None:
        self.sent.append(Sent(subject, msg_id, event))

    async def resolved(self, event: ResolvedAdvancedV1, msg_id: str, next_seq: int, *,
                       xa: XaResume | None = None, server: str | None = None) -> None:
        self.marks.append((event, next_seq, xa))


class Tables(MetaStore):
    """information_schema as one fixed table."""

    def __init__(self) -> None:
        super().__init__(lambda: None)

    async def catalog_at(self, key: TableKey, position: Position) -> TableInfo | None:
        return INFO if key == KEY else None

    def cached(self, key: TableKey) -> TableInfo | None:
        return INFO if key == KEY else None

    async def foreign_keys(self, database: str) -> list[ForeignKey]:
        return []


COLUMNS = (BinlogColumn("id", 3, is_primary=True), BinlogColumn("v", 252, "utf8mb4"))


Event = Begin | Rows | Commit | XaPrepare | Query


class Binlog:
    """Builds binlog items with increasing positions (each an event's end, as the reader gives)."""

    def __init__(self) -> None:
        self.items: list[Event] = []
        self.pos = 4
        self.seqno = 0

    def _at(self) -> Position:
        self.pos += 100
        return Position("binlog.000001", self.pos)

    def begin(self, xa: bool = False) -> None:
        self.seqno += 1
        self.items.append(Begin(self._at(), 1_800_000_000 + self.seqno, f"0-1-{self.seqno}", xa=xa))

    def insert(self, *ids: int) -> None:
        images = tuple(RowImage(None, {"id": i, "v": f"v{i}"}, {}, {}) for i in ids)
        self.items.append(Rows(self._at(), 0, "d", "t", "insert", COLUMNS, images))

    def query(self, sql: str) -> None:
        self.items.append(Query(self._at(), 0, "d", sql))

    def commit(self) -> None:
        self.items.append(Commit(self._at(), 0))

    def prepare(self, gtrid: bytes) -> None:
        self.items.append(XaPrepare(self._at(), 0, gtrid, b"", 1, False))

    def txn(self, *ids: int) -> None:
        self.begin()
        self.insert(*ids)
        self.commit()

    def xa(self, gtrid: bytes, *ids: int) -> None:
        """A MariaDB prepared group: GTID with FL_PREPARED_XA, rows, XA END, XA_PREPARE."""
        self.begin(xa=True)
        for i in range(0, len(ids), 7):
            self.insert(*ids[i:i + 7])
        self.query(f"XA END X'{gtrid.hex()}',X'',1")
        self.prepare(gtrid)

    def decide(self, verb: str, gtrid: bytes) -> None:
        self.begin()
        self.query(f"XA {verb} X'{gtrid.hex()}',X'',1")


async def read_items(start: StartState, items: list[Event], **kwargs: Any) -> Recorder:
    recorder = Recorder()
    pipeline = SourcePipeline("src", recorder, Tables(), start, part_rows=5,  # type: ignore[arg-type]
                              **kwargs)
    try:
        for item in items:
            await pipeline.handle(item)
            await pipeline.publish_resolved()  # a mark after every item: every restart point
    finally:
        pipeline.xa.close()
    return recorder


def published_parts(recorder: Recorder) -> list[tuple[str, int, int, int, bool, list[int]]]:
    out = []
    for s in recorder.sent:
        event = s.event
        assert isinstance(event, RowsChangedV2)
        out.append((s.msg_id, event.ts, event.seq, event.part, event.last_part,
                    [(r.after or {})["id"] for r in event.rows]))
    return out


def xa_workload() -> Binlog:
    b = Binlog()
    b.txn(1)
    b.xa(b"a", *range(100, 123))  # 23 rows: parts of 5, spilled past the tiny budget
    b.txn(2)
    b.xa(b"b", 200, 201)
    b.xa(b"c", 300)
    b.txn(3)
    b.decide("ROLLBACK", b"b")
    b.decide("COMMIT", b"a")
    b.begin()  # XA COMMIT ... ONE PHASE on MariaDB: an ordinary group
    b.insert(400)
    b.commit()
    b.txn(4)
    b.decide("COMMIT", b"c")
    b.decide("COMMIT", b"zz")  # never seen prepared: nothing to publish, no failure
    b.xa(b"d", 500)  # still undecided at the end
    return b
