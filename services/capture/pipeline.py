"""From binlog items to ROWS messages: transactions, ts, seq, table metadata, rejections.

One ``SourcePipeline`` lives for one reading session. Everything it publishes is a pure
function of where it starts (the newest resolved mark: position, ts, next seq) and the binlog
after it, so a session that restarts from the same mark republishes identical messages: same
ids, ts and seq. The two things that read the outside world are kept out of that path:
information_schema (only for the metadata that travels with rows) and the wall clock (only for
the resolved marks of an idle source, which are published before anything after them).

Transactions are published per table: one part per (transaction, table), split into parts of
at most ``part_rows`` rows / ``part_bytes`` bytes; a part is sent as soon as it is full, the
last one at the commit, so a huge transaction never sits in memory whole. A transaction of one
part waits instead in its table's *batch* (``batch_transactions`` > 1), which goes out as one
``rows.changed`` v4 message carrying several consecutive transactions of the table, each with
its own id, ts, seq and position (a batch of one is the v3 message it always was). Where batches
end is a function of the binlog alone, so a re-read from a mark cuts them where the first
reading did (DESIGN.md, "Several transactions per message"): all of them end when a transaction
of another *window* begins (its MariaDB GTID's seq_no // ``batch_transactions``, the same on
every server of the topology; without one, its binlog position in windows of
``batch_transactions`` KiB), before anything else is published (a DDL, a rejection, an XA
commit's parts, a part of a larger transaction), and a table's when it would pass
``part_rows``/``part_bytes`` or its metadata changes. A resolved mark goes out only where no
batch is open; a reader that has caught up closes them (the one boundary that is the clock's,
and a mark follows it at once).

An XA transaction's parts wait instead (``xa.XaBook``, spilled to disk beyond a budget) for its
XA COMMIT, which publishes them as one transaction with the commit's ts and ids derived from the
commit group's position, or its XA ROLLBACK, which drops them. Resolved marks pass a prepared
group; each one records where the oldest undecided one starts and the XIDs waiting, and a
session starting from such a mark first re-reads the binlog from there in *recovery*: it only
rebuilds those prepared groups (publishes nothing, moves no ts or seq) up to the mark.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from tenacity import Retrying, stop_after_attempt

from contracts.events.rows import (
    CaptureRejectedV2,
    CaptureRejectKind,
    DdlExecutedV3,
    ForeignKeysChangedV1,
    ResolvedAdvancedV1,
    RowImageV2,
    RowOp,
    RowsChangedV3,
    RowsChangedV4,
    RowsPartV1,
    SourcePositionV1,
    TableMetaV1,
)
from libs.codec.encode import UnsupportedValue
from libs.codec.table_meta import BinlogColumn, TableInfo, agrees, describe, load_table_info
from libs.foreign_keys import ForeignKey, ddl_may_change_keys, load_foreign_keys, referenced_tables
from libs.gtid import Gtid, GtidError, GtidState
from libs.mysql_statements import classify
from libs.stream_origin import StreamOrigin
from libs.streams import ddl_subject, rejected_subject, rows_subject
from services.capture import metrics
from services.capture.binlog_reader import (
    Begin,
    Commit,
    Heartbeat,
    Item,
    Position,
    Query,
    ReaderFailed,
    Rows,
    XaPrepare,
)
from services.capture.ddl_lookahead import AheadDdl, DdlIndex, list_ddl
from services.capture.publisher import MessageTooLarge, Publisher
from services.capture.row_values import encode_row
from services.capture.rows_encode import has_geometry
from services.capture.source import current_position
from services.capture.ts_clock import TsClock, wall_ms
from services.capture.xa import PreparedXa, XaBook, XaResume, XaStatement, canonical_xid, parse_xa

log = logging.getLogger(__name__)

SYSTEM_SCHEMAS = frozenset({"mysql", "sys", "performance_schema", "information_schema"})
# Rejections that stop a table for good (until an operator clears them, see service.py).
STOPPING_KINDS = frozenset({"unsupported_type", "binlog_not_row"})

# Longest stretch of pipeline work between two event-loop turns. A reader batch holds up to
# 2,000 rows events (a large transaction: tens of thousands of rows to encode and publish);
# done in one go it starves the lease renewals (due every TTL/3, trusted for 0.8 TTL) for
# seconds on a loaded machine, and the capture loses its lease mid-transaction. A turn costs
# one socket write for the messages framed since the last one (``AckInbox``), so at 20 ms
# the throughput does not notice it.
YIELD_EVERY_S = 0.02

TableKey = tuple[str, str]
T = TypeVar("T")
RejectKind = CaptureRejectKind


class CaptureStopped(Exception):
    """The source as a whole cannot be captured any further (e.g. statement-based DML on an
    unknown table): a clear error beats a silent gap."""


@dataclass(frozen=True)
class StartState:
    position: Position
    ts: int
    next_seq: int
    xa: XaResume | None = None
    """XA transactions prepared before ``position`` and undecided there (from the mark)."""
    gtid: str | None = None
    """The source's MariaDB GTID position at ``position`` (``gtid_binlog_pos`` spelling); None
    where it has none (MySQL, or a MariaDB position capture could not place)."""
    server: str | None = None
    """The server ``position`` is a position of (its @@server_id; None: a mark of an older capture)."""
    origin: StreamOrigin | None = None
    """Where the source's stream begins (capture's first start), carried by every mark; None
    from a mark of an older capture that did not record it."""
    ids_by_gtid: bool = False
    """Messages are named by their transaction's GTID, not its binlog position (the mark said so,
    or the source is new): the same on every server of the topology (DESIGN.md, "Source failover
    by GTID")."""


@dataclass(frozen=True)
class CatalogRead:
    """information_schema's description of a table (None: no such table) and the binlog's end
    right after it was read: the read describes the table at any position from which no DDL
    naming it lies before ``end``."""

    info: TableInfo | None
    end: Position


class MetaStore:
    """information_schema's table descriptions, cached until a DDL names the table, with the
    binlog's DDL ahead of capture to tell whether one still holds at a row's position
    (``catalog_at``); and each database's foreign keys, read whole once, then again for each
    table a DDL names.

    ``connect`` returns a new pymysql connection; lookups run on a worker thread.
    """

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._conn: Any = None
        self._cache: dict[TableKey, CatalogRead] = {}
        self._ahead = DdlIndex()
        self._fks: dict[str, list[ForeignKey]] = {}
        self._stale_fks: dict[str, set[str]] = {}

    def _query(self, load: Callable[[Any], T]) -> T:
        # A kept connection may have gone stale: one more try on a new one.
        for attempt in Retrying(stop=stop_after_attempt(2), reraise=True):
            with attempt:
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    return load(self._conn)
                except Exception:
                    self.close()
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _load(self, key: TableKey) -> CatalogRead:
        def load(conn: Any) -> CatalogRead:
            info = load_table_info(conn, *key)
            # After the read: a DDL the read saw is in the binlog before this end.
            return CatalogRead(info, current_position(conn))
        return self._query(load)

    def _list_ddl(self, start: Position, until: Position) -> list[AheadDdl]:
        # A dump of its own connection each pass (list_ddl): one more try after a failure.
        for attempt in Retrying(stop=stop_after_attempt(2), reraise=True):
            with attempt:
                return list_ddl(self._connect, start, until)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def read(self, key: TableKey) -> CatalogRead:
        if key not in self._cache:
            self._cache[key] = await asyncio.to_thread(self._load, key)
        return self._cache[key]

    async def catalog_at(self, key: TableKey, position: Position) -> TableInfo | None:
        """information_schema's description of ``key`` if it is the table's shape at binlog
        ``position`` (no DDL naming it lies between ``position`` and the read); else None."""
        read = await self.read(key)
        if _before(read.end, position):
            # Read before the position: a DDL capture does not recognise may lie in between.
            read = self._cache[key] = await asyncio.to_thread(self._load, key)
        if read.info is None:
            return None
        gap = self._ahead.missing(position, read.end)
        if gap is not None:
            found = await asyncio.to_thread(self._list_ddl, *gap)
            self._ahead.add(*gap, found)
        if self._ahead.names_between(key, position, read.end):
            return None
        return read.info

    def cached(self, key: TableKey) -> TableInfo | None:
        """The last information_schema read of ``key`` (whatever position it holds at)."""
        read = self._cache.get(key)
        return read.info if read is not None else None

    def passed(self, position: Position) -> None:
        """Capture has read up to ``position``: the DDL listed before it is not needed again."""
        self._ahead.forget_before(position)

    async def foreign_keys(self, database: str) -> list[ForeignKey]:
        """The foreign keys of ``database``'s tables (as children), as information_schema shows
        them now."""
        if database not in self._fks:
            self._stale_fks.pop(database, None)
            self._fks[database] = await asyncio.to_thread(
                self._query, lambda conn: load_foreign_keys(conn, database))
        # After a DDL only its tables are read again: a database may hold thousands of keys.
        for table in sorted(self._stale_fks.get(database, ())):
            fresh = await asyncio.to_thread(
                self._query, lambda conn, table=table: load_foreign_keys(conn, database, table))
            self._fks[database] = sorted([fk for fk in self._fks[database] if fk.table != table] + fresh)
            self._stale_fks[database].discard(table)
        return self._fks[database]

    def forget(self, key: TableKey) -> None:
        self._cache.pop(key, None)
        if key[0] in self._fks:  # the DDL may have added or dropped a foreign key of the table
            self._stale_fks.setdefault(key[0], set()).add(key[1])

    def known_tables(self, database: str) -> list[TableKey]:
        return [k for k, v in self._cache.items() if k[0] == database and v.info is not None]

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # a broken connection may fail to close
                pass
            self._conn = None


class _RowTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} > {limit}")
        self.size = size
        self.limit = limit


@dataclass
class _TableBuffer:
    info: TableInfo
    position: Position  # of the latest rows event buffered
    rows: list[RowImageV2] = field(default_factory=list)
    size: int = 0
    part: int = 0


@dataclass
class _Batch:
    """A table's whole transactions (one part each) waiting to go out in one message."""

    info: TableInfo
    parts: list[tuple[str, int, int, SourcePositionV1, list[RowImageV2]]] = field(default_factory=list)
    """(event id, ts, seq, position, rows) of each transaction, in stream order."""
    rows: int = 0
    size: int = 0
    cut: int = 0
    """Parts it ends with, when a stored message started with its first part (0: the binlog's
    rules alone)."""


@dataclass
class _Txn:
    begin: Position
    timestamp: int
    gtid: str | None
    ts: int | None = None
    tables: dict[TableKey, _TableBuffer] = field(default_factory=dict)
    had_rows: bool = False
    # Row images of the transaction read so far, of every table (wanted or not): the next
    # row's ordinal, so the ordinal depends on the binlog alone, not on filters or stops.
    rows_seen: int = 0
    # An XA transaction: its full parts go here, not to the stream, until its decision.
    xa: PreparedXa | None = None
    # Its messages are named by its GTID (``SourcePipeline.ids_by_gtid``), else by ``begin``.
    by_gtid: bool = False

    def id_base(self) -> str:
        return f"gtid:{self.gtid}" if self.by_gtid else f"{self.begin.file}:{self.begin.pos}"


class SourcePipeline:
    def __init__(self, source: str, publisher: Publisher, meta: MetaStore, start: StartState, *,
                 databases: frozenset[str] | None = None,
                 stopped: dict[TableKey, Position | None] | None = None,
                 part_rows: int = 500, part_bytes: int = 256 * 1024,
                 resolve_every_s: float = 0.2, xa_memory_bytes: int = 64 * 1024 * 1024,
                 server: str | None = None, batch_transactions: int = 1,
                 cuts: dict[str, int] | None = None) -> None:
        self.source = source
        # The server read (its @@server_id), recorded with each mark: a later session on another
        # server knows the mark's file and position are not its own.
        self.server = server
        # The GTID position after each group, tracked from the binlog's GTID events (not asked of
        # the server later, when it has moved on); None: the source has none capture can follow.
        self.gtid = GtidState.parse(start.gtid) if start.gtid is not None else None
        self.ids_by_gtid = start.ids_by_gtid and self.gtid is not None
        self._start_file = start.position.file
        self.committed_gtid = start.gtid if self.ids_by_gtid else None
        # ``gtid.text()`` once its state has one domain (a single-primary source): the last
        # GTID read, spelled when read, not a sort and a join per transaction.
        self._gtid_text: str | None = None
        self.publisher = publisher
        self.meta = meta
        self.databases = databases
        self.clock = TsClock(start.ts)
        self.next_seq = start.next_seq
        # State at the end of the last complete event group: what a resolved mark records. The
        # clock and seq may run ahead of it while a transaction's parts are being published.
        self.committed = start.position
        self.committed_ts = start.ts
        self.committed_seq = start.next_seq
        self.resolved_ts = start.ts
        self.resolved_position = start.position
        self.xa = XaBook(xa_memory_bytes)
        self.committed_xa = start.xa
        # Recovery: from the oldest undecided prepared group up to the mark (see the module doc).
        self._recover: XaResume | None = None
        if start.xa is not None and _before(start.xa.begin, start.position):
            self._recover = start.xa
            self.committed = start.xa.begin
        self._xa_empty: set[str] = set()  # prepared XIDs without captured rows, this session
        # Table -> the position from which it is stopped (None: from anywhere).
        self.stopped: dict[TableKey, Position | None] = dict(stopped or {})
        self._warned_no_key: set[TableKey] = set()
        self.cascading: set[ForeignKey] = set()
        """Cascading foreign keys of the captured databases seen so far (``follow_foreign_keys``)."""
        self._fk_databases: set[str] = set()
        # Each table's last binlog description and the metadata made of it.
        self._infos: dict[TableKey, tuple[tuple[BinlogColumn, ...], TableInfo]] = {}
        self._txn: _Txn | None = None
        self._part_rows = part_rows
        self._part_bytes = part_bytes
        self._resolve_every_s = resolve_every_s
        self._last_resolve = time.monotonic()
        self._subjects: dict[TableKey, str] = {}  # rows_subject per table: a regex per call
        self._batch_transactions = max(1, batch_transactions)
        self._batches: dict[TableKey, _Batch] = {}
        self._window: tuple[str, int] | None = None  # the window of the open batches' transactions
        # How the messages stored after the start mark were cut (first part id -> parts;
        # service.load_tail_cuts): a batch starting with one of them ends exactly there.
        self._cuts: dict[str, int] = dict(cuts or {})
        self._xa_prepared = metrics.XA_PREPARED.labels(source)
        self._xa_prepared_shown = -1  # the gauge's value: set when it changes, not per group
        self.position = start.position  # newest position read, for /healthz
        self._turn = time.monotonic()  # when the event loop last had a turn (``_yield_due``)

    # ------------------------------------------------------------------ items

    async def handle_batch(self, items: Sequence[Item], *, caught_up: bool = True) -> None:
        """Handle ``items``; ``caught_up``: the reader had nothing more queued after them.

        A resolved mark waits for the ack of everything before it, so it stops the pipeline
        for a round trip: while a backlog drains (not ``caught_up``) one goes out every
        ``resolve_every_s``, at the first place where no batch of transactions is open (a
        window's end), and the row messages between marks are acked in a pipelined window;
        once caught up, the open batches go out and a mark closes each batch of items, so an
        idle source's last commit resolves at once.
        """
        try:
            for item in items:
                await self._yield_due()
                await self.handle(item)
                if time.monotonic() - self._last_resolve >= self._resolve_every_s and not self._batches:
                    # Only where no batch is open (at a window's end while a backlog drains):
                    # a batch must not end where the clock says (DESIGN.md).
                    await self.publish_resolved()
            if caught_up:
                await self.publish_resolved()
        finally:
            self.publisher.end_spans()

    async def _yield_due(self) -> None:
        """Give the event loop a turn (lease renewals, acks) once ``YIELD_EVERY_S`` of work
        has passed without one. Only the timing changes: what is published, and the lease
        check before each publish, stay as they are."""
        now = time.monotonic()
        if now - self._turn >= YIELD_EVERY_S:
            await asyncio.sleep(0)
            self._turn = time.monotonic()

    @property
    def recovering(self) -> bool:
        return self._recover is not None

    async def handle(self, item: Item) -> None:
        if isinstance(item, ReaderFailed):
            raise item.error
        if self._recover is not None:
            until = self.resolved_position
            if isinstance(item, Heartbeat) and not _before(item.position, until):
                self._end_recovery()
            elif isinstance(item, Heartbeat):
                return
            elif _before(until, item.position):
                self._end_recovery()
        if isinstance(item, Heartbeat):
            await self._heartbeat(item)
            return
        self.position = item.position
        if isinstance(item, Begin):
            if self._txn is not None and (self._txn.had_rows or self._txn.xa is not None):
                # A crash-truncated binlog may end a transaction without its commit (the server
                # rolled it back on recovery): its rows are not published (parts already sent
                # carry no last part). Say so loudly.
                self._drop_open("transaction without commit dropped (crash-truncated binlog)")
            self._follow_gtid(item)
            self._txn = _Txn(item.position, item.timestamp, item.gtid,
                             by_gtid=self.ids_by_gtid and item.gtid is not None)
            await self._enter_window(self._txn)
            if item.xa:
                self._txn.xa = self.xa.open(self.committed)
        elif isinstance(item, Rows):
            await self._rows(item)
        elif isinstance(item, Commit):
            await self._commit(item.position)
        elif isinstance(item, XaPrepare):
            if item.one_phase:  # MySQL: XA COMMIT ... ONE PHASE written as an XA_PREPARE event
                await self._commit(item.position)
            else:
                await self._xa_prepare(item.position, canonical_xid(item.gtrid, item.bqual, item.format_id))
        elif isinstance(item, Query):
            await self._query(item)
        if self._recover is not None and item.position == self.resolved_position:
            self._end_recovery()

    def _follow_gtid(self, item: Begin) -> None:
        if self.gtid is None or self.recovering or item.gtid is None:
            return  # recovery re-reads groups before the mark: the state there is the mark's
        try:
            gtid = Gtid.parse(item.gtid)
        except GtidError:
            return  # not a MariaDB GTID (MySQL's): not followed
        self.gtid.advance(gtid)
        self._gtid_text = str(gtid) if len(self.gtid.last) == 1 else None
        if not self.ids_by_gtid and item.position.file != self._start_file:
            # Started from a mark of an older capture (ids by position, no GTID position): the
            # names change at the first group of the next binlog file, a point every re-read
            # from such a mark meets at the same group, so a re-read names everything as before.
            self.ids_by_gtid = True

    def _drop_open(self, message: str) -> None:
        txn, self._txn = self._txn, None
        if txn is None:
            return
        if txn.xa is not None:
            self.xa.release(txn.xa)
        if txn.had_rows and not self.recovering:
            log.error(message, extra={"source": self.source, "begin": str(txn.begin), "gtid": txn.gtid})

    def _end_recovery(self) -> None:
        """The mark's position is reached: the XA transactions it names are rebuilt; from here
        on everything is published as usual."""
        assert self._recover is not None
        expected, self._recover = self._recover, None
        self._drop_open("transaction open at the resolved mark dropped")
        missing, extra = self.xa.retain(expected.xids)
        if missing:
            # Their prepared groups are not where the mark says (binlog purged past them): their
            # rows cannot be published at their XA COMMIT.
            metrics.XA_LOST.labels(self.source).inc(len(missing))
            log.error("prepared XA transactions not found in the binlog: their rows are lost to "
                      "capture", extra={"source": self.source, "xids": missing,
                                        "from": str(expected.begin)})
        if extra:
            log.warning("XA transactions found prepared but not in the resolved mark; dropped",
                        extra={"source": self.source, "xids": extra})
        self.committed = self.resolved_position
        self.committed_xa = self.xa.resume()
        self._xa_prepared_shown = len(self.xa)
        self._xa_prepared.set(self._xa_prepared_shown)
        log.info("XA recovery done", extra={"source": self.source, "prepared": len(self.xa),
                                            "position": str(self.committed)})

    def _wanted(self, database: str) -> bool:
        if database in SYSTEM_SCHEMAS:
            return False
        return self.databases is None or database in self.databases

    async def _rows(self, item: Rows) -> None:
        key = (item.database, item.table)
        first = 0
        if self._txn is not None:
            first = self._txn.rows_seen
            self._txn.rows_seen += len(item.images)
        if self.recovering and (self._txn is None or self._txn.xa is None):
            return  # published before the mark: only prepared XA groups are rebuilt
        if not self._wanted(item.database) or self._is_stopped(key, item.position):
            return
        txn = self._txn
        if txn is None:  # no GTID/BEGIN seen (resumed inside a group): the rows event opens it
            txn = self._txn = _Txn(item.position, item.timestamp, None, rows_seen=len(item.images))
        txn.had_rows = True
        buffer = txn.tables.get(key)
        if buffer is None:
            info = await self._table_info(key, item.columns, item.position)
            if info is None:
                return
            buffer = txn.tables[key] = _TableBuffer(info, item.position)
        buffer.position = item.position
        try:
            if _may_be_large(item) and _raw_size(item.images) > _LARGE_RAW:
                # base64 of tens of MB takes seconds on a busy machine: not on the event loop,
                # where it would hold up the lease renewals.
                images = await asyncio.to_thread(self._images, item, buffer.info, first)
            else:
                images = self._images(item, buffer.info, first)
        except UnsupportedValue as exc:
            del txn.tables[key]
            await self.reject("unsupported_type", key, f"{exc}; capture stopped for this table",
                              item.position)
            return
        for image, size in images:
            buffer.rows.append(image)
            buffer.size += size
            # Keep one row back: the commit must always have a row left for the last part.
            if len(buffer.rows) > 1 and (len(buffer.rows) > self._part_rows
                                         or buffer.size > self._part_bytes):
                await self._yield_due()  # a source whose rows events hold thousands of rows
                try:
                    await self._send_part(txn, key, buffer, last=False, keep=1)
                except _RowTooLarge as exc:
                    await self._too_large(txn, key, buffer, exc)
                    return

    def _images(self, item: Rows, info: TableInfo, first: int) -> list[tuple[RowImageV2, int]]:
        """Each row image with its ``_approx_size``."""
        return [self._image(item.op, info, item.columns, image, first + i)
                for i, image in enumerate(item.images)]

    def _image(self, op: RowOp, info: TableInfo, columns: tuple[BinlogColumn, ...], image: Any,
               ordinal: int) -> tuple[RowImageV2, int]:
        size = 32
        before = after = None
        if image.before is not None:
            before, more = encode_row(info, columns, image.before, image.before_none)
            size += more
        if image.after is not None:
            after, more = encode_row(info, columns, image.after, image.after_none)
            size += more
        return _construct(RowImageV2, {"op": op, "before": before, "after": after, "ordinal": ordinal}), size

    async def _table_info(self, key: TableKey, columns: tuple[BinlogColumn, ...],
                          position: Position) -> TableInfo | None:
        known = self._infos.get(key)
        # The reader's batches share one columns tuple per table map: identity first, the
        # field by field comparison only across batches (each batch from the reader's process
        # is a new tuple), after which the batch's tuple is the one compared by identity.
        if known is not None:
            if known[0] is columns:
                return known[1]
            if known[0] == columns:
                self._infos[key] = (columns, known[1])
                return known[1]
        self.meta.passed(position)
        catalog = await self.meta.catalog_at(key, position)
        if key[0] not in self._fk_databases:
            await self.follow_foreign_keys(key[0])
        info = describe(key[0], key[1], columns, catalog, self.meta.cached(key))
        if info.from_binlog:
            # Capture reads behind a DDL of the table (or the table is gone): the rows are
            # what the binlog says they are; information_schema adds nothing to them.
            log.info("table metadata from the binlog alone", extra={
                "source": self.source, "table": ".".join(key), "position": str(position),
                "information_schema": "differs" if catalog is not None and not agrees(catalog, columns)
                else "not the table at this position"})
        self._infos[key] = (columns, info)
        bad = info.unsupported()
        if bad:
            detail = ", ".join(f"{c.name} {c.sql_type}" for c in bad)
            await self.reject("unsupported_type", key,
                              f"unsupported column type(s): {detail}; capture stopped for this table",
                              position)
            return None
        if not info.primary_key and key not in self._warned_no_key:
            self._warned_no_key.add(key)
            await self.reject("no_primary_key", key,
                              "table has no primary key and no unique key over NOT NULL columns; its "
                              "rows are published with primary_key [] and the sink decides",
                              position)
        return info

    async def _send_part(self, txn: _Txn, key: TableKey, buffer: _TableBuffer, *, last: bool,
                         keep: int = 0) -> None:
        if txn.xa is not None:
            # Cut exactly as a published part would be, so the XA COMMIT publishes the same
            # parts whatever the session that read the prepared group.
            rows = buffer.rows[:len(buffer.rows) - keep] if keep else buffer.rows
            self.xa.add(txn.xa, key, buffer.info, buffer.position, rows,
                        sum(_approx_size(r) for r in rows))
            buffer.rows = buffer.rows[len(rows):]
            buffer.size = sum(_approx_size(r) for r in buffer.rows)
            return
        if txn.ts is None:
            txn.ts = self.clock.commit(txn.timestamp * 1000)
        rows = buffer.rows[:len(buffer.rows) - keep] if keep else buffer.rows
        # buffer.size bounds the part's size: the part is the buffer, or all of it but a row.
        await self._publish_rows(txn, key, buffer, rows, last, size_bound=buffer.size)
        buffer.rows = buffer.rows[len(rows):]
        buffer.size = sum(_approx_size(r) for r in buffer.rows)

    async def _publish_rows(self, txn: _Txn, key: TableKey, buffer: _TableBuffer,
                            rows: list[RowImageV2], last: bool, *, size_bound: int | None = None) -> None:
        assert txn.ts is not None
        if (self._batch_transactions > 1 and last and buffer.part == 0 and txn.xa is None
                and size_bound is not None and size_bound <= self._part_bytes):
            await self._batch(txn, key, buffer, rows, size_bound)
            return
        # Anything else goes out as it is, after every open batch (a table's stream order stays seq order).
        await self.flush_batches()
        meta = buffer.info.meta()
        event = one_part(meta, {
            "source": self.source, "database": key[0], "table": key[1], "ts": txn.ts, "seq": self.next_seq,
            "part": buffer.part, "last_part": last,
            "position": _construct(SourcePositionV1, {"binlog_file": txn.begin.file,
                                                      "binlog_pos": txn.begin.pos, "gtid": txn.gtid}),
            "meta": meta, "rows": rows})
        msg_id = f"{self.source}:{txn.id_base()}:{key[0]}.{key[1]}:{buffer.part}"
        subject = self._subjects.get(key)
        if subject is None:
            subject = self._subjects[key] = rows_subject(self.source, *key)
        try:
            await self.publisher.send(subject, event, msg_id, rows=len(rows), size_bound=size_bound)
        except MessageTooLarge as exc:
            # Over the message limit (a message over max_payload goes in chunks, up to it): halve
            # the part. Same input, same split, so a re-read still publishes the same ids.
            if len(rows) == 1:
                raise _RowTooLarge(exc.size, exc.limit) from None
            mid = len(rows) // 2
            await self._publish_rows(txn, key, buffer, rows[:mid], last=False)
            await self._publish_rows(txn, key, buffer, rows[mid:], last=last)
            return
        self.next_seq += 1
        buffer.part += 1

    # ---------------------------------------------------------------- batches

    def _window_of(self, txn: _Txn) -> tuple[str, int]:
        """The window a transaction belongs to: from its MariaDB GTID (domain, seq_no // n),
        the same on every server of the topology; else from its binlog position."""
        n = self._batch_transactions
        if txn.gtid is not None:
            domain, _, rest = txn.gtid.partition("-")
            _server, _, seq_no = rest.partition("-")
            if seq_no.isdigit():
                return (f"gtid:{domain}", int(seq_no) // n)
        return (txn.begin.file, txn.begin.pos // (n * 1024))

    async def _enter_window(self, txn: _Txn) -> None:
        """A transaction begins: the open batches end if it lies in another window."""
        if self._batch_transactions <= 1:
            return
        window = self._window_of(txn)
        if window != self._window:
            await self.flush_batches()
            self._window = window

    async def _batch(self, txn: _Txn, key: TableKey, buffer: _TableBuffer, rows: list[RowImageV2],
                     size: int) -> None:
        """A whole transaction's rows of ``key`` into the table's batch (its seq taken now, as a
        message of its own would take it)."""
        batch = self._batches.get(key)
        if batch is not None and (batch.info is not buffer.info or batch.rows + len(rows) > self._part_rows
                                  or batch.size + size > self._part_bytes):
            await self._flush_batch(key)
            batch = None
        part_id = f"{self.source}:{txn.id_base()}:{key[0]}.{key[1]}:0"
        if batch is None:
            cut = self._cuts.pop(part_id, 0) if self._cuts else 0
            batch = self._batches[key] = _Batch(buffer.info, cut=cut)
        position = _construct(SourcePositionV1, {"binlog_file": txn.begin.file, "binlog_pos": txn.begin.pos,
                                                 "gtid": txn.gtid})
        batch.parts.append((part_id, txn.ts or 0, self.next_seq, position, rows))
        batch.rows += len(rows)
        batch.size += size
        self.next_seq += 1
        buffer.part += 1
        if batch.cut and len(batch.parts) >= batch.cut:
            await self._flush_batch(key)  # where the stored message ended

    async def flush_batches(self) -> None:
        """Publish every open batch (in the order they were opened)."""
        for key in list(self._batches):
            await self._yield_due()
            await self._flush_batch(key)

    async def _flush_batch(self, key: TableKey) -> None:
        batch = self._batches.pop(key)
        subject = self._subjects.get(key)
        if subject is None:
            subject = self._subjects[key] = rows_subject(self.source, *key)
        meta = batch.info.meta()
        if len(batch.parts) > 1:
            first_id, ts, seq, position, rows = batch.parts[0]
            more = [_construct(RowsPartV1, {"event_id": i, "ts": t, "seq": q, "part": 0, "last_part": True,
                                            "position": p, "rows": r})
                    for i, t, q, p, r in batch.parts[1:]]
            event = _construct(RowsChangedV4, {
                "source": self.source, "database": key[0], "table": key[1], "ts": ts, "seq": seq,
                "part": 0, "last_part": True, "position": position, "meta": meta, "rows": rows,
                "event_id": first_id, "more": more})
            try:
                # Named by its first part and its count: the same parts on every re-read.
                await self.publisher.send(subject, event, f"{first_id}+{len(batch.parts)}",
                                          rows=batch.rows, size_bound=batch.size)
                return
            except MessageTooLarge:
                pass  # over a NATS message: the parts one by one (same input, same choice)
        for event_id, ts, seq, position, rows in batch.parts:
            alone = one_part(meta, {
                "source": self.source, "database": key[0], "table": key[1], "ts": ts, "seq": seq,
                "part": 0, "last_part": True, "position": position, "meta": meta, "rows": rows})
            await self.publisher.send(subject, alone, event_id, rows=len(rows),
                                      size_bound=sum(_approx_size(r) for r in rows))

    async def _too_large(self, txn: _Txn, key: TableKey, buffer: _TableBuffer, exc: _RowTooLarge) -> None:
        txn.tables.pop(key, None)
        await self.reject("unsupported_type", key,
                          f"a row change encodes to {exc.size} bytes, over the limit of {exc.limit} "
                          f"bytes (SLUICE_CAPTURE_MAX_MESSAGE_BYTES); capture stopped for this table",
                          buffer.position)

    def _is_stopped(self, key: TableKey, position: Position) -> bool:
        if key not in self.stopped:
            return False
        since = self.stopped[key]
        return since is None or (position.file, position.pos) >= (since.file, since.pos)

    def _group_end(self, position: Position) -> None:
        self.committed = position
        if self.recovering:
            return
        self.committed_ts = self.clock.last
        self.committed_seq = self.next_seq
        self.committed_xa = self.xa.resume()
        if self.ids_by_gtid and self.gtid is not None:
            self.committed_gtid = self._gtid_text if self._gtid_text is not None else self.gtid.text()
        prepared = len(self.xa)
        if prepared != self._xa_prepared_shown:
            self._xa_prepared.set(prepared)
            self._xa_prepared_shown = prepared

    async def _commit(self, position: Position) -> None:
        txn, self._txn = self._txn, None
        if txn is not None and txn.xa is not None:
            # XA COMMIT ... ONE PHASE of a group that said it was XA (MySQL's XA START).
            await self._publish_prepared(txn, self._stash(txn), position)
        elif txn is not None:
            for key, buffer in list(txn.tables.items()):
                if buffer.rows:
                    try:
                        await self._send_part(txn, key, buffer, last=True)
                    except _RowTooLarge as exc:
                        await self._too_large(txn, key, buffer, exc)
        self._group_end(position)

    # --------------------------------------------------------------------- XA

    def _stash(self, txn: _Txn) -> PreparedXa:
        """The open XA group's rows, all in parts: what is left of each table is its last."""
        if txn.xa is None:
            # No XA START and no XA flag seen (reading began inside the group): nothing of it
            # was published yet unless a part was full, which the commit then completes.
            txn.xa = self.xa.open(txn.begin)
        for key, buffer in txn.tables.items():
            if buffer.rows:
                self.xa.add(txn.xa, key, buffer.info, buffer.position, buffer.rows, buffer.size)
                buffer.rows, buffer.size = [], 0
        return txn.xa

    async def _xa_prepare(self, position: Position, xid: str) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            prepared = self._stash(txn)
            if prepared.rows:
                replaced = self.xa.prepare(xid, prepared)
                if replaced is not None:
                    log.error("XA transaction prepared again before its decision; the earlier "
                              "one dropped", extra={"source": self.source, "xid": xid})
            else:
                self.xa.release(prepared)
                self._xa_empty.add(xid)
        self._group_end(position)

    async def _xa_query(self, item: Query, stmt: XaStatement) -> None:
        if stmt.verb == "start":
            if self._txn is None:
                self._txn = _Txn(item.position, item.timestamp, None)
            if self._txn.xa is None:
                self._txn.xa = self.xa.open(self.committed)
            return
        if stmt.verb in ("end", "other"):
            return  # inside the group (XA END before the prepare) or not written as data
        if stmt.verb == "prepare":
            # Servers write an XA_PREPARE event; a statement is taken the same way.
            if stmt.xid is not None:
                await self._xa_prepare(item.position, stmt.xid)
            return
        txn = self._txn
        if txn is not None and (txn.had_rows or txn.xa is not None) and (
                stmt.one_phase or stmt.xid is None or stmt.xid not in self.xa):
            # ONE PHASE: the group holding the rows ends here.
            if stmt.verb == "commit":
                await self._commit(item.position)
            else:
                self._drop_open("XA transaction rolled back")
                self._group_end(item.position)
            return
        self._txn = None
        if stmt.xid is None:
            log.error("XA statement with an XID capture cannot read; nothing published for it",
                      extra={"source": self.source, "statement": item.query[:200]})
        elif stmt.verb == "commit":
            prepared = self.xa.take(stmt.xid)
            if prepared is not None:
                commit = txn if txn is not None else _Txn(item.position, item.timestamp, None)
                await self._publish_prepared(commit, prepared, item.position)
            elif not self._known_empty(stmt.xid) and not self.recovering:
                metrics.XA_LOST.labels(self.source).inc()
                log.warning("XA COMMIT of a transaction capture did not see prepared (prepared "
                            "before capture's start position, or without rows of captured "
                            "tables)", extra={"source": self.source, "xid": stmt.xid})
        elif not self.xa.rollback(stmt.xid):
            self._known_empty(stmt.xid)
        self._group_end(item.position)

    def _known_empty(self, xid: str) -> bool:
        known = xid in self._xa_empty
        self._xa_empty.discard(xid)
        return known

    async def _publish_prepared(self, commit: _Txn, prepared: PreparedXa, position: Position) -> None:
        """Publish an XA transaction's parts as one transaction of the commit group ``commit``:
        its ts and ids come from the commit, so a re-read publishes the same messages."""
        try:
            if self.recovering:
                return
            for key, table in prepared.tables.items():
                if self._is_stopped(key, position):
                    continue
                buffer = _TableBuffer(table.info, table.position)
                for rows, last in _with_last(prepared.parts(key)):
                    await self._yield_due()  # a large XA transaction's parts, all at its commit
                    if commit.ts is None:
                        commit.ts = self.clock.commit(commit.timestamp * 1000)
                    try:
                        await self._publish_rows(commit, key, buffer, rows, last)
                    except _RowTooLarge as exc:
                        await self._too_large(commit, key, buffer, exc)
                        break
        finally:
            self.xa.release(prepared)

    async def _query(self, item: Query) -> None:
        xa = parse_xa(item.query)
        if xa is not None:
            await self._xa_query(item, xa)
            return
        stmt = classify(item.query, item.schema)
        if stmt.kind == "begin":
            if self._txn is None:
                self._txn = _Txn(item.position, item.timestamp, None)
                await self._enter_window(self._txn)
            return
        if stmt.kind == "commit":
            await self._commit(item.position)
            return
        if stmt.kind == "dml":
            if not self.recovering:  # reported when first read
                await self._statement_dml(item, stmt.tables)
            if self._txn is None or not self._txn.had_rows:
                self._txn = None
                self._group_end(item.position)
            return
        if stmt.kind in ("ddl", "drop_database"):
            tables = list(stmt.tables) if stmt.kind == "ddl" else self.meta.known_tables(stmt.database)
            await self._ddl(item, [t for t in tables if self._wanted(t[0])])
            return
        # Anything else (CREATE USER, GRANT, CREATE DATABASE, SAVEPOINT ...): a group of its own
        # unless it sits inside a transaction that already has rows.
        if self._txn is None or not (self._txn.had_rows or self._txn.xa is not None):
            self._txn = None
            self._group_end(item.position)

    async def _statement_dml(self, item: Query, tables: tuple[TableKey, ...]) -> None:
        message = (f"a DML statement was written to the binlog as a statement, not as rows "
                   f"(session binlog_format is not ROW): {item.query[:200]!r}")
        if not tables:
            await self.reject("binlog_not_row", ("", ""), message + "; capture stopped", item.position)
            raise CaptureStopped(message)
        for key in tables:
            if self._wanted(key[0]) and not self._is_stopped(key, item.position):
                await self.reject("binlog_not_row", key, message + "; capture stopped for this table",
                                  item.position)

    async def _ddl(self, item: Query, tables: list[TableKey]) -> None:
        if self.recovering:  # published when first read; the tables' descriptions are stale now
            self._drop_open("transaction open at a DDL dropped")
            for key in tables:
                self.meta.forget(key)
                self._infos.pop(key, None)
            self._group_end(item.position)
            return
        txn, self._txn = self._txn, None
        if txn is not None and txn.had_rows:
            log.warning("DDL inside an open transaction; its rows are published first",
                        extra={"source": self.source, "statement": item.query[:200]})
            await self._commit(item.position)
        await self.flush_batches()  # the DDL after every row before it, in stream order too
        ts: int | None = None
        for key in tables:
            self.meta.forget(key)
            self._infos.pop(key, None)
            self._warned_no_key.discard(key)
            # The table's shape right after the DDL, if information_schema still shows it
            # (no later DDL of the table between here and the binlog's end); else None: the
            # rows that follow carry their own shape from the binlog.
            info = await self.meta.catalog_at(key, item.position)
            if ts is None:
                ts = self.clock.commit((txn.timestamp if txn else item.timestamp) * 1000)
            event = DdlExecutedV3(
                source=self.source, database=key[0], table=key[1], ts=ts, seq=self.next_seq,
                statement=item.query,
                position=SourcePositionV1(binlog_file=item.position.file, binlog_pos=item.position.pos,
                                          gtid=txn.gtid if txn else None),
                meta_after=info.meta() if info is not None else None)
            where = _id_base(txn, item.position)
            msg_id = f"{self.source}:{where}:{key[0]}.{key[1]}:ddl"
            await self.publisher.send(ddl_subject(self.source, *key), event, msg_id)
            self.next_seq += 1
        if ts is not None and ddl_may_change_keys(item.query):
            await self._announce_parents(item, tables, ts, txn)
        for database in sorted({key[0] for key in tables}):
            await self.follow_foreign_keys(database)
        self._group_end(item.position)

    async def _announce_parents(self, item: Query, tables: list[TableKey], ts: int, txn: _Txn | None) -> None:
        """``foreign_keys.changed`` on the DDL subject of each table the statement names after
        REFERENCES: the spans reading a parent meet the key change in stream order, at its ts,
        and stop there until their foreign-key group is formed again (DESIGN.md, "Foreign-key
        cascades"). From the statement's text, so the messages are the binlog's alone."""
        child = tables[0]
        gtid = txn.gtid if txn else None
        where = _id_base(txn, item.position)
        for parent in referenced_tables(item.query, child[0]):
            if parent in tables or not self._wanted(parent[0]):
                continue
            event = ForeignKeysChangedV1(
                source=self.source, database=parent[0], table=parent[1], ts=ts, seq=self.next_seq,
                statement=item.query,
                position=SourcePositionV1(binlog_file=item.position.file, binlog_pos=item.position.pos,
                                          gtid=gtid),
                by_database=child[0], by_table=child[1])
            msg_id = f"{self.source}:{where}:{parent[0]}.{parent[1]}:fk"
            await self.publisher.send(ddl_subject(self.source, *parent), event, msg_id)
            self.next_seq += 1

    async def follow_foreign_keys(self, database: str) -> None:
        """Name each cascading foreign key of ``database`` once (log, metric, ``/healthz``).

        InnoDB applies them below the binlog, so the rows they change reach no changefeed
        (DESIGN.md, "Foreign-key cascades"). Read when a database's first table is met and, for
        the tables a DDL names, again after it, so a key added or dropped later is followed.
        Only a warning: the metadata is information_schema's *now*, and what is published never
        depends on it.
        """
        self._fk_databases.add(database)
        try:
            found = {fk for fk in await self.meta.foreign_keys(database) if fk.cascading}
        except Exception as exc:  # a failed lookup must not stop capture: rows do not need it
            log.warning("reading foreign keys failed", extra={
                "source": self.source, "database": database, "error": f"{type(exc).__name__}: {exc}"})
            self._fk_databases.discard(database)
            return
        known = {fk for fk in self.cascading if fk.database == database}
        for fk in sorted(found - known):
            log.warning("cascading foreign key: the child rows it deletes or changes never reach the "
                        "binlog, so changefeeds do not see them", extra={
                            "source": self.source, "foreign_key": fk.describe()})
        self.cascading = (self.cascading - known) | found
        metrics.CASCADING_FOREIGN_KEYS.labels(self.source).set(len(self.cascading))

    async def _heartbeat(self, item: Heartbeat) -> None:
        if self._txn is not None or self.recovering:
            return
        # Nothing is open and the server has sent everything: the heartbeat's position is a
        # group boundary, and the wall clock may move the resolved ts.
        self.position = item.position
        self.clock.resolve(wall_ms())
        self._group_end(item.position)
        await self.publish_resolved()

    # --------------------------------------------------------------- resolved

    async def publish_resolved(self) -> None:
        """Publish the resolved mark for everything up to ``committed``, if it moved; the open
        batches go out first (callers: caught up, or at a window's end where none is open).
        Not while a batch re-read after a crash waits for the rest of the stored message it
        repeats: the binlog holds that rest, so the mark comes once it is read."""
        self._last_resolve = time.monotonic()
        if self.recovering:
            return
        if any(b.cut for b in self._batches.values()):
            return
        await self.flush_batches()
        ts, position = self.committed_ts, self.committed
        if ts == self.resolved_ts and position == self.resolved_position:
            return
        # The mark's gtid is the source's GTID position there (a list, one GTID per domain).
        event = ResolvedAdvancedV1(source=self.source, ts=ts, position=SourcePositionV1(
            binlog_file=position.file, binlog_pos=position.pos, gtid=self.committed_gtid))
        msg_id = f"{self.source}:resolved:{position.file}:{position.pos}:{ts}"
        await self.publisher.resolved(event, msg_id, self.committed_seq, xa=self.committed_xa,
                                      server=self.server)
        self.resolved_ts = ts
        self.resolved_position = position

    # -------------------------------------------------------------- rejections

    async def reject(self, kind: RejectKind, key: TableKey, message: str, position: Position | None) -> None:
        if kind in STOPPING_KINDS and key != ("", ""):
            self.stopped.setdefault(key, position)
        if self.recovering:
            return  # published when first read
        await self.flush_batches()
        await publish_rejection(self.publisher, self.source, kind, key, message, position)


async def publish_rejection(publisher: Publisher, source: str, kind: RejectKind, key: TableKey, message: str,
                            position: Position | None) -> None:
    log.error("capture rejected %s.%s: %s", key[0] or "-", key[1] or "-", message,
              extra={"source": source, "kind": kind, "database": key[0], "table": key[1],
                     "position": str(position) if position else None})
    metrics.REJECTIONS.labels(source, kind).inc()
    event = CaptureRejectedV2(
        source=source, kind=kind,
        database=key[0], table=key[1], message=message,
        position=SourcePositionV1(binlog_file=position.file, binlog_pos=position.pos) if position else None)
    where = f"{position.file}:{position.pos}" if position is not None and (
        kind in STOPPING_KINDS or kind == "binlog_purged") else ""
    msg_id = f"{source}:rejected:{kind}:{key[0]}.{key[1]}:{where}"
    await publisher.send(rejected_subject(source), event, msg_id)


M = TypeVar("M", bound=BaseModel)


def one_part_version(meta: TableMetaV1) -> type[RowsChangedV3]:
    """The version of a message of one transaction part: v3, which readers older than batching
    read, unless the table has a spatial column (the ``geometry`` kind came with v4)."""
    return RowsChangedV4 if has_geometry(meta) else RowsChangedV3


def one_part(meta: TableMetaV1, values: dict[str, Any]) -> RowsChangedV3:
    """A message of one transaction part, in ``one_part_version``: a v4 one (a spatial table)
    gets v4's own fields too, unset, since ``_construct`` sets no defaults (the publisher and the
    encoder read ``more``; without it every such message failed capture's session)."""
    version = one_part_version(meta)
    if version is RowsChangedV4:
        values = {**values, "event_id": None, "more": []}
    return _construct(version, values)


def _construct(model: type[M], values: dict[str, Any]) -> M:
    """``model.model_construct(**values)`` for ``values`` that name every field: what it sets,
    without its per-call bookkeeping (defaults, the fields-set scan), which was a fifth of the
    pipeline's time for one-row messages. The values are capture's own, already valid."""
    obj = model.__new__(model)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(values))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


def _id_base(txn: _Txn | None, position: Position) -> str:
    """What names a statement's messages: its group's GTID, or its own binlog position."""
    return txn.id_base() if txn is not None and txn.by_gtid else f"{position.file}:{position.pos}"


def _before(a: Position, b: Position) -> bool:
    return (a.file, a.pos) < (b.file, b.pos)


_LARGE_RAW = 1024 * 1024


def _with_last(parts: Iterator[list[RowImageV2]]) -> Iterator[tuple[list[RowImageV2], bool]]:
    """Each part with whether it is the last one (one part read ahead, not all of them)."""
    previous: list[RowImageV2] | None = None
    for part in parts:
        if previous is not None:
            yield previous, False
        previous = part
    if previous is not None:
        yield previous, True



# A decoded value is at most this many times its bytes in the rows event: an ENUM's one byte
# becomes its label (up to 255 characters), an empty BINARY(255) is padded to 255 bytes.
_MAX_EXPANSION = 256


def _may_be_large(item: Rows) -> bool:
    """Whether the rows event's values may add up to ``_LARGE_RAW``: not for an event small
    enough that even at ``_MAX_EXPANSION`` they cannot (most events), without a look at them."""
    return item.event_size is None or item.event_size * _MAX_EXPANSION > _LARGE_RAW


def _raw_size(images: Any) -> int:
    """Bytes of the binlog images' string and binary values (``len`` only: cheap)."""
    size = 0
    for image in images:
        for values in (image.before, image.after):
            if values:
                size += sum(len(v) for v in values.values() if isinstance(v, str | bytes | bytearray))
    return size


def _approx_size(image: RowImageV2) -> int:
    size = 32
    for row in (image.before, image.after):
        if row:
            for name, value in row.items():
                size += len(name) + 6 + (len(value) if isinstance(value, str) else 8)
    return size
