"""The binlog reader: pymysqlreplication's blocking stream on a thread, as plain items (in capture,
that thread runs in a child process by default: ``reader_process``).

pymysqlreplication is synchronous, so it runs on its own thread and hands over immutable
items through a bounded queue; the asyncio side takes them in batches (one executor hop per
batch, not per event). The bound is the back-pressure: a slow NATS slows the binlog read.
Items go into the queue a group at a time (an event group's items, ``_GROUP_ITEMS`` at most):
a put and a get per item, each taking the queue's lock and condition, were a tenth of the
reader thread's time on transactions of a few rows.
The thread checks its stop flag after every event, and the server's heartbeats (every
``heartbeat_s`` while idle) bound how long that can take.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import pymysql
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.constants import FIELD_TYPE
from pymysqlreplication.event import GtidEvent as MysqlGtidEvent
from pymysqlreplication.event import (
    HeartbeatLogEvent,
    MariadbGtidEvent,
    QueryEvent,
    RotateEvent,
    XAPrepareEvent,
    XidEvent,
)
from pymysqlreplication.row_event import DeleteRowsEvent, TableMapEvent, UpdateRowsEvent, WriteRowsEvent

from contracts.events.rows import RowOp
from libs.codec import charsets
from libs.codec.table_meta import BinlogColumn
from services.capture import table_map_cache, value_repairs
from services.capture.direct_events import (
    DirectBegin,
    DirectCommit,
    DirectQuery,
    DirectRows,
    DirectStream,
    DirectTableMap,
    PushBackConnection,
)
from services.capture.rows_decode import RowsDecoder, compile_decoder

log = logging.getLogger(__name__)


class _QuietWhenStopped(logging.Filter):
    """Stopping a reader cuts its socket; pymysqlreplication then logs a scary "re-request the
    connection" warning before our factory refuses to reconnect. Drop it for stopped readers."""

    stopped_threads: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread not in self.stopped_threads


_quiet = _QuietWhenStopped()
logging.getLogger("pymysqlreplication").addFilter(_quiet)


class ReaderStopped(Exception):
    pass


# The items of every transaction (Position, Begin, Rows, RowImage, Commit) are named tuples that
# pickle as ``tuple.__new__(cls, values)``: the reader child sends them in pickled batches, and
# capture unpickles them on its event loop's process. As frozen dataclasses each one was a
# NEWOBJ plus a state dict set into its __dict__: unpickling a sysbench row change's items took
# 20 us, as tuples 5 (BENCHMARKS.md, "Capture under many small transactions", fourth round).
# Immutable as before; two items of different classes never hold the same number of fields
# where they could meet (a Begin's four are a Begin's).
_NEW_TUPLE = tuple.__new__


def _reduce_as_tuple(self: tuple[Any, ...]) -> tuple[Any, ...]:
    return _NEW_TUPLE, (type(self), tuple(self))


class _PositionFields(NamedTuple):
    file: str
    pos: int


class Position(_PositionFields):
    __slots__ = ()
    __reduce__ = _reduce_as_tuple

    def __str__(self) -> str:
        return f"{self.file}:{self.pos}"


class _BeginFields(NamedTuple):
    position: Position
    timestamp: int
    gtid: str | None
    xa: bool = False
    """MariaDB's GTID flag FL_PREPARED_XA: the group is an XA transaction that ends at its
    XA PREPARE (MySQL says so with an ``XA START`` query instead)."""


class Begin(_BeginFields):
    """A transaction starts (GTID event, or a BEGIN query without GTIDs)."""

    __slots__ = ()
    __reduce__ = _reduce_as_tuple


@dataclass(frozen=True)
class XaPrepare:
    """XA PREPARE (XA_PREPARE_LOG_EVENT): the open group is prepared under the XID of these
    parts (``xa.canonical_xid`` spells it); its XA COMMIT or XA ROLLBACK comes in a later group."""

    position: Position
    timestamp: int
    gtrid: bytes
    bqual: bytes
    format_id: int
    one_phase: bool


class _RowImageFields(NamedTuple):
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    before_none: dict[str, str]
    after_none: dict[str, str]


class RowImage(_RowImageFields):
    __slots__ = ()
    __reduce__ = _reduce_as_tuple


class _RowsFields(NamedTuple):
    position: Position
    timestamp: int
    database: str
    table: str
    op: RowOp
    columns: tuple[BinlogColumn, ...]
    images: tuple[RowImage, ...]
    event_size: int | None = None
    """Bytes of the rows event in the binlog (None: not known): bounds its decoded values."""


class Rows(_RowsFields):
    __slots__ = ()
    __reduce__ = _reduce_as_tuple


class _CommitFields(NamedTuple):
    position: Position
    timestamp: int


class Commit(_CommitFields):
    __slots__ = ()
    __reduce__ = _reduce_as_tuple


@dataclass(frozen=True)
class Query:
    """A statement outside row events: DDL, BEGIN/COMMIT without Xid, or anything else."""

    position: Position
    timestamp: int
    schema: str
    query: str


@dataclass(frozen=True)
class Heartbeat:
    """The server has nothing more to send: everything up to ``position`` has been read."""

    position: Position


@dataclass(frozen=True)
class ReaderFailed:
    error: BaseException


Item = Begin | Rows | Commit | XaPrepare | Query | Heartbeat | ReaderFailed

_EVENTS = [WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent, QueryEvent, XidEvent, RotateEvent,
           HeartbeatLogEvent, MariadbGtidEvent, MysqlGtidEvent, TableMapEvent,
           table_map_cache.CachedTableMapEvent, XAPrepareEvent]
_FL_PREPARED_XA = 0x40
# Items held back on the reader thread before they are queued: only inside an event group, whose
# events the server sends together, so holding them adds no latency; a long group goes in pieces.
_GROUP_ITEMS = 64


class _ItemQueue(queue.Queue[list[Item]]):
    """A queue of item groups whose bound and size count items, not groups (so ``max_items``
    bounds memory as before, and ``qsize`` says how many items are waiting)."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self.items = 0

    def _qsize(self) -> int:
        return self.items

    def _put(self, group: list[Item]) -> None:
        self.queue.append(group)
        self.items += len(group)

    def _get(self) -> list[Item]:
        group: list[Item] = self.queue.popleft()
        self.items -= len(group)
        return group


@dataclass(frozen=True)
class TableMapExtras:
    """What the table map carries that pymysqlreplication leaves off its columns: the primary
    key in key order, including a key over a column prefix (``PRIMARY_KEY_WITH_PREFIX``, which
    it never marks ``is_primary``), and each column's nullability (the null bitmap)."""

    key_parts: tuple[int, ...]
    nullable: tuple[bool, ...]


def table_map_extras(event: Any) -> TableMapExtras:
    meta = event.optional_metadata
    parts = tuple(int(i) for i in meta.simple_primary_key_list) or tuple(
        int(i) for i in meta.primary_keys_with_prefix)
    bits = bytes(event.null_bitmask)
    nullable = tuple(bool(bits[i // 8] >> (i % 8) & 1) for i in range(int(event.column_count)))
    return TableMapExtras(parts, nullable)


class BinlogReader:
    def __init__(self, connection: dict[str, Any], server_id: int, start: Position, *,
                 heartbeat_s: float = 1.0, max_items: int = 2000,
                 only_schemas: list[str] | None = None, fast_rows: bool = True,
                 start_gtid: str | None = None, direct: bool = True) -> None:
        self._connection = dict(connection)
        # A dead server must surface as an error, not a read that blocks forever.
        self._connection.setdefault("read_timeout", max(10.0, heartbeat_s * 4))
        self._connection.setdefault("charset", "utf8mb4")
        self._server_id = server_id
        self._start = start
        # Read from a MariaDB GTID position instead of ``start`` (a source moved to another
        # server of its topology): the server sends the groups after it, in its own files.
        self._start_gtid = start_gtid
        self._heartbeat_s = heartbeat_s
        self._only_schemas = only_schemas
        self._fast_rows = fast_rows
        # The hot events read from the packets' bytes (``direct_events``); rows events so only
        # with the compiled decoder, which is what reads their images.
        self._direct = direct
        self.decoded = DecodeCounts()
        self._queue = _ItemQueue(maxsize=max_items)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: list[Any] = []
        self._conns_lock = threading.Lock()
        self.position = start

    def start(self) -> None:
        table_map_cache.install()
        self._thread = threading.Thread(target=self._run, name=f"binlog-{self._start}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop now: the thread's blocking read is cut by shutting its socket down."""
        self._stop.set()
        if self._thread is not None and self._thread.ident is not None:
            _quiet.stopped_threads.add(self._thread.ident)
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            sock = getattr(conn, "_sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _connect(self, **kwargs: Any) -> Any:
        """pymysqlreplication's connection factory: refuses once stopped, so the library's own
        reconnect-on-lost-connection cannot revive a reader that was told to stop."""
        if self._stop.is_set():
            raise ReaderStopped("binlog reader stopped")
        if "db" in kwargs:  # pymysqlreplication still passes pymysql's deprecated spelling
            kwargs["database"] = kwargs.pop("db")
        conn = PushBackConnection(**kwargs) if self._direct else pymysql.connect(**kwargs)
        with self._conns_lock:
            self._conns = [c for c in self._conns if c.open] + [conn]
        return conn

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def take(self, max_items: int = 2000, wait: float = 0.5, linger: float = 0.002) -> list[Item]:
        """A batch of items (``take_batch``; runs off-loop)."""
        return take_batch(self._queue, max_items, wait, linger)

    def pending(self) -> int:
        """Items read and not taken yet (a backlog is being drained when > 0)."""
        return self._queue.qsize()

    def _put(self, item: Item) -> bool:
        return self._put_group([item])

    def _put_group(self, group: list[Item]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(group, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        stream: BinLogStreamReader | None = None
        held: list[Item] = []  # items of the open event group, not queued yet
        try:
            by_gtid = self._start_gtid is not None
            where: dict[str, Any] = ({"is_mariadb": True, "auto_position": self._start_gtid} if by_gtid
                                     else {"log_file": self._start.file, "log_pos": self._start.pos})
            if self._direct:
                where["direct_rows"] = self._fast_rows
            stream = (DirectStream if self._direct else BinLogStreamReader)(
                connection_settings=self._connection, server_id=self._server_id,
                resume_stream=True, blocking=True, only_events=_EVENTS, slave_heartbeat=self._heartbeat_s,
                only_schemas=self._only_schemas, enable_logging=False, pymysql_wrapper=self._connect,
                **where)
            current_file = "" if by_gtid else self._start.file
            maps: dict[int, TableMapExtras] = {}
            shapes: dict[int, _Shape] = {}
            extras_of: dict[int, tuple[Any, TableMapExtras]] = {}
            for event in stream:
                if self._stop.is_set():
                    break
                kind = type(event)
                if kind in _DIRECT:
                    self.decoded.direct += 1
                if kind is DirectTableMap or isinstance(event, TableMapEvent):
                    # Table ids are reused only after a table leaves the server's cache; the
                    # newest map of an id is the one its rows events refer to.
                    # The same parse (table-map cache) gives the same extras: not read again.
                    seen = extras_of.get(event.table_id)
                    if seen is None or seen[0] is not event.optional_metadata:
                        seen = extras_of[event.table_id] = (event.optional_metadata, table_map_extras(event))
                    maps[event.table_id] = seen[1]
                    continue
                if kind in _DIRECT:
                    item = _direct_item(event, current_file, maps, shapes, self._fast_rows, self.decoded)
                    if item is None:  # a rows event the compiled decoder does not take
                        self.decoded.direct -= 1
                        event = stream.by_library(event)
                        if not isinstance(event, WriteRowsEvent | UpdateRowsEvent | DeleteRowsEvent):
                            raise RuntimeError(f"the binlog library read {event!r} for a rows event")
                        item = _convert(event, current_file, maps, shapes, self._fast_rows, self.decoded)
                elif isinstance(event, RotateEvent):
                    current_file = event.next_binlog
                    continue
                else:
                    item = _convert(event, current_file, maps, shapes, self._fast_rows, self.decoded)
                if by_gtid and isinstance(item, Begin | Heartbeat):
                    # The library reconnects by itself after a lost connection, from its
                    # auto_position when it has one: that would read the groups since the start
                    # again. From here on it knows the file and position, so it resumes there.
                    stream.auto_position = None
                    stream.is_mariadb = False
                    by_gtid = False
                if item is not None:
                    if not isinstance(item, Heartbeat):
                        self.position = _position_of(item)
                    held.append(item)
                    if isinstance(item, Begin | Rows) and len(held) < _GROUP_ITEMS:
                        continue  # the group's next events are on their way
                    group, held = held, []
                    if not self._put_group(group):
                        break
        except BaseException as exc:  # handed to the asyncio side, which decides
            if not self._stop.is_set():
                self._put_group([*held, ReaderFailed(exc)])
        finally:
            if stream is not None:
                try:
                    stream.close()
                except Exception:  # closing a broken connection may fail too
                    log.debug("closing the binlog stream failed", exc_info=True)
            _quiet.stopped_threads.discard(threading.get_ident())


def take_batch(items_queue: queue.Queue[list[Item]], max_items: int, wait: float,
               linger: float) -> list[Item]:
    """Block up to ``wait`` for the first group of items, then take what comes within ``linger``
    more, until ``max_items`` (a group is not split: a batch may pass it by less than a group).
    Each batch costs the event loop a fixed amount (an executor hop, the publish spans, a status
    update): while a backlog drains, batches of a few items would spend more on that than on the
    items; ``linger`` bounds what it adds to latency."""
    try:
        items = list(items_queue.get(timeout=wait))
    except queue.Empty:
        return []
    until = time.monotonic() + linger
    while len(items) < max_items:
        try:
            items.extend(items_queue.get_nowait())
        except queue.Empty:
            left = until - time.monotonic()
            if left <= 0:
                break
            try:
                items.extend(items_queue.get(timeout=left))
            except queue.Empty:
                break
    return items


def _position_of(item: Item) -> Position:
    assert not isinstance(item, ReaderFailed)
    return item.position


# The library's path and the compiled decoder share these (``value_repairs``); the old names stay.
_fix_negative_time2 = value_repairs.fix_negative_time2
_fix_year = value_repairs.fix_year
_binary_padder = value_repairs.binary_padder


Repairs = tuple[tuple[str, Any], ...]


def _repairs(event: Any) -> Repairs:
    """Per column, the fix for a value pymysqlreplication decodes wrongly (see the _fix_*)."""
    out: list[tuple[str, Any]] = []
    for c in event.columns:
        if c.type == FIELD_TYPE.TIME2:
            out.append((str(c.name), _fix_negative_time2))
        elif c.type == FIELD_TYPE.YEAR:
            out.append((str(c.name), _fix_year))
        elif (c.type == FIELD_TYPE.STRING and charsets.original_charset(c) == "binary"
              and int(getattr(c, "max_length", 0) or 0) > 0):
            out.append((str(c.name), _binary_padder(int(c.max_length))))
    return tuple(out)


def _fix_row(values: dict[str, Any] | None, repairs: Repairs) -> dict[str, Any] | None:
    if values is None or not repairs:
        return values
    for name, fix in repairs:
        if name in values:
            values[name] = fix(values[name])
    return values


def _columns(event: Any, extras: TableMapExtras | None) -> tuple[BinlogColumn, ...]:
    parts = {index: place for place, index in enumerate(extras.key_parts)} if extras else {}
    out = []
    for i, c in enumerate(event.columns):
        key_part = parts.get(i) if extras is not None else (i if c.is_primary else None)
        out.append(BinlogColumn(
            name=str(c.name), type_code=int(c.type), charset=charsets.original_charset(c),
            unsigned=bool(c.unsigned), is_primary=key_part is not None,
            set_values=tuple(c.set_values) if c.set_values is not None else None,
            enum_values=tuple(c.enum_values) if c.enum_values is not None else None,
            nullable=extras.nullable[i] if extras is not None and i < len(extras.nullable) else True,
            key_part=key_part))
    return tuple(out)


@dataclass
class DecodeCounts:
    """Rows events decoded by the compiled decoder and by the library (per reader), and events
    read from the packets' bytes without the library's event objects (``direct_events``)."""

    compiled: int = 0
    library: int = 0
    direct: int = 0


_Shape = tuple[Any, TableMapExtras | None, tuple[BinlogColumn, ...], Repairs, RowsDecoder | None]


def _shape(event: Any, maps: dict[int, TableMapExtras], shapes: dict[int, _Shape],
           fast_rows: bool = False) -> _Shape:
    """The rows event's columns, repairs and compiled decoder, made once per table map: the
    library hands every rows event of a table the same column list until a new map of the table
    (the table-map cache returns the same one for identical maps), so identity says whether it
    still holds."""
    extras = maps.get(event.table_id)
    known = shapes.get(event.table_id)
    if known is not None and known[0] is event.columns and known[1] is extras:
        return known
    # Both decode paths read the charsets and members fixed here (libs.codec.charsets).
    charsets.fix_library_columns(event.columns)
    decoder = compile_decoder(event.columns) if fast_rows else None
    shape = (event.columns, extras, _columns(event, extras), _repairs(event), decoder)
    shapes[event.table_id] = shape
    return shape


def _compiled_images(event: Any, decoder: RowsDecoder, op: RowOp) -> tuple[RowImage, ...] | None:
    """The event's images by the compiled decoder; None: the library must decode it (an
    event not laid out as the decoder reads it, or one it cannot decode: the library then
    decodes it, or raises what it raises)."""
    body = decoder.body(event)
    if body is None:
        return None
    return _decoded_images(decoder, op, *body)


_DIRECT = frozenset((DirectBegin, DirectCommit, DirectQuery, DirectTableMap, DirectRows))


def _direct_item(event: Any, current_file: str, maps: dict[int, TableMapExtras],
                 shapes: dict[int, _Shape], fast_rows: bool, counts: DecodeCounts) -> Item | None:
    """The item ``_convert`` makes of the library's event for the same packet (None: a rows
    event the compiled decoder does not take, which the library must read)."""
    kind = type(event)
    position = Position(current_file, event.log_pos)
    if kind is DirectRows:
        shape = _shape(event, maps, shapes, fast_rows)
        decoder = shape[4]
        if decoder is None or event.number_of_columns != len(decoder.columns):
            return None
        present = (1 << event.number_of_columns) - 1
        for bitmap in event.bitmaps:
            if int.from_bytes(bitmap, "little") & present != present:
                return None  # not a FULL row image: the library's none sources
        images = _decoded_images(decoder, event.op, event.data, event.start, event.end)
        if images is None:
            return None
        counts.compiled += 1
        return Rows(position, event.timestamp, event.schema, event.table, event.op,
                    shape[2], images, event.event_size)
    if kind is DirectBegin:
        return Begin(position, event.timestamp, event.gtid, xa=bool(event.flags & _FL_PREPARED_XA))
    if kind is DirectCommit:
        return Commit(position, event.timestamp)
    schema = event.schema.decode("utf-8", "replace")
    return Query(position, event.timestamp, schema, event.query)


def _decoded_images(decoder: RowsDecoder, op: RowOp, data: bytes, start: int,
                    end: int) -> tuple[RowImage, ...] | None:
    try:
        rows = decoder.decode(op, data, start, end)
    except Exception:
        return None
    if op == "update":
        return tuple(RowImage(b, a, bn, an) for b, bn, a, an in rows)
    if op == "insert":
        return tuple(RowImage(None, v, {}, n) for v, n in rows)
    return tuple(RowImage(v, None, n, {}) for v, n in rows)


def _convert(event: Any, current_file: str, maps: dict[int, TableMapExtras],
             shapes: dict[int, _Shape] | None = None, fast_rows: bool = False,
             counts: DecodeCounts | None = None) -> Item | None:
    position = Position(current_file, int(event.packet.log_pos))
    timestamp = int(event.timestamp)
    if isinstance(event, WriteRowsEvent | UpdateRowsEvent | DeleteRowsEvent):
        _, _, columns, repairs, decoder = _shape(event, maps, {} if shapes is None else shapes,
                                                 fast_rows)
        op: RowOp = ("update" if isinstance(event, UpdateRowsEvent)
                     else "insert" if isinstance(event, WriteRowsEvent) else "delete")
        fast = _compiled_images(event, decoder, op) if decoder is not None else None
        if counts is not None:
            if fast is not None:
                counts.compiled += 1
            else:
                counts.library += 1
        if fast is not None:
            return Rows(position, timestamp, str(event.schema), str(event.table), op, columns, fast,
                        int(event.event_size))
        if isinstance(event, UpdateRowsEvent):
            images = tuple(RowImage(_fix_row(r["before_values"], repairs),
                                    _fix_row(r["after_values"], repairs),
                                    r.get("before_none_sources", {}), r.get("after_none_sources", {}))
                           for r in event.rows)
        elif isinstance(event, WriteRowsEvent):
            images = tuple(RowImage(None, _fix_row(r["values"], repairs), {}, r.get("none_sources", {}))
                           for r in event.rows)
        else:
            images = tuple(RowImage(_fix_row(r["values"], repairs), None, r.get("none_sources", {}), {})
                           for r in event.rows)
        return Rows(position, timestamp, str(event.schema), str(event.table), op, columns, images,
                    int(event.event_size))
    if isinstance(event, XidEvent):
        return Commit(position, timestamp)
    if isinstance(event, MariadbGtidEvent):
        return Begin(position, timestamp, str(event.gtid), xa=bool(event.flags & _FL_PREPARED_XA))
    if isinstance(event, MysqlGtidEvent):
        return Begin(position, timestamp, str(event.gtid))
    if isinstance(event, XAPrepareEvent):
        return XaPrepare(position, timestamp, bytes(event.xid_gtrid), bytes(event.xid_bqual),
                         int(event.xid_format_id), bool(event.one_phase))
    if isinstance(event, QueryEvent):
        schema = event.schema.decode("utf-8", "replace") if isinstance(event.schema, bytes) \
            else str(event.schema)
        return Query(position, timestamp, schema, event.query)
    if isinstance(event, HeartbeatLogEvent):
        name = event.ident.rstrip("\x00") or current_file
        return Heartbeat(Position(name, int(event.packet.log_pos)))
    return None

