"""The hot binlog events read straight from the packet's bytes, the rest by pymysqlreplication.

Under many small transactions, most of the reader's CPU was the library's work per event, not
per value: a ``BinLogPacketWrapper`` per packet (a header unpack, a dozen attributes), an event
object per event (``BinLogEvent.__init__`` asks the control connection for its DBMS every time,
a rows event builds its table's ``data`` dict for the primary key), and reads through the
wrapper's buffer (BENCHMARKS.md, "Capture under many small transactions", fifth round). A
sysbench transaction is a GTID, then per table a TABLE_MAP (the same bytes every time) and a
rows event, then an XID: four to six events for four row changes.

``DirectStream`` is the library's ``BinLogStreamReader`` whose ``fetchone`` looks at each packet
first. These it reads itself, from the packet's bytes, without a wrapper or an event object:

- MariaDB's GTID event (``DirectBegin``), XID (``DirectCommit``), a QUERY whose statement is
  exactly ``BEGIN`` or ``COMMIT`` (``DirectQuery``);
- a TABLE_MAP whose body the table-map cache has parsed before (``DirectTableMap``: the cached
  parse, which is what the library's path gives for those bytes, and the stream's table map
  updated as the library updates it);
- WRITE/UPDATE/DELETE_ROWS v1 and v2 of a known table (``DirectRows``: the bytes of the row
  images, for capture's compiled decoder).

Every other packet, and any of these laid out otherwise than read here (a post-header length
other than the one the library knows, v2 extra data, more than 250 columns, a table map not
cached yet, checksums verified, a start or end bound by timestamp or position), goes back to
the library untouched: the connection (``PushBackConnection``) hands the same packet to the
library's own ``fetchone``, which then does everything it does today, its connection handling,
rotation, heartbeats, reconnects and errors included. ``DirectStream.by_library`` does the same
for a rows event the compiled decoder then refuses. The stream's own state that the library
keeps per event (``log_pos`` for a reconnect, ``table_map``) is kept the same way here.

Equality with the library's path, item for item: ``tests/test_capture_direct_events.py``.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import pymysql
from pymysql.protocol import MysqlPacket
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.constants import BINLOG
from pymysqlreplication.event import MariadbGtidEvent, QueryEvent, XidEvent
from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

from contracts.events.rows import RowOp
from services.capture import table_map_cache


class PushBackConnection(pymysql.connections.Connection):
    """pymysql's connection with one packet (or the error reading it raised) handed back: the
    next ``_read_packet`` returns (raises) it instead of reading the socket."""

    _pushed: Any = None

    def push_back(self, packet_or_error: Any) -> None:
        self._pushed = packet_or_error

    def _read_packet(self, packet_type: Any = MysqlPacket) -> Any:
        pushed = self._pushed
        if pushed is not None and packet_type is MysqlPacket:
            self._pushed = None
            if isinstance(pushed, BaseException):
                raise pushed
            return pushed
        return super()._read_packet(packet_type)


class DirectBegin(NamedTuple):
    log_pos: int
    timestamp: int
    gtid: str
    flags: int


class DirectCommit(NamedTuple):
    log_pos: int
    timestamp: int


class DirectQuery(NamedTuple):
    log_pos: int
    timestamp: int
    schema: bytes
    query: str


class DirectTableMap(NamedTuple):
    """The attributes of a cached table map that capture's reader reads."""

    table_id: int
    optional_metadata: Any
    null_bitmask: bytes
    column_count: int


class DirectRows(NamedTuple):
    log_pos: int
    timestamp: int
    op: RowOp
    table_id: int
    schema: str
    table: str
    columns: list[Any]
    """The library's columns of the table's map (the same list its rows events carry)."""
    number_of_columns: int
    bitmaps: tuple[bytes, ...]
    data: bytes
    start: int
    end: int
    """The row images are ``data[start:end]``."""
    event_size: int
    """The event's body without header and checksum (the library's ``event_size``)."""
    packet: Any


DirectEvent = DirectBegin | DirectCommit | DirectQuery | DirectTableMap | DirectRows

_HEADER = struct.Struct("<xIBIIIH")  # OK byte, timestamp, type, server id, size, next position, flags
_GTID = struct.Struct("<QIB")
_QUERY = struct.Struct("<IIBHH")

_ROWS_OPS: dict[int, RowOp] = {
    BINLOG.WRITE_ROWS_EVENT_V1: "insert", BINLOG.UPDATE_ROWS_EVENT_V1: "update",
    BINLOG.DELETE_ROWS_EVENT_V1: "delete", BINLOG.WRITE_ROWS_EVENT_V2: "insert",
    BINLOG.UPDATE_ROWS_EVENT_V2: "update", BINLOG.DELETE_ROWS_EVENT_V2: "delete",
}
_ROWS_CLASSES = {"insert": WriteRowsEvent, "update": UpdateRowsEvent, "delete": DeleteRowsEvent}
_V2 = frozenset((BINLOG.WRITE_ROWS_EVENT_V2, BINLOG.UPDATE_ROWS_EVENT_V2, BINLOG.DELETE_ROWS_EVENT_V2))
_BEGIN_OR_COMMIT = frozenset((b"BEGIN", b"COMMIT"))


# The library's private state read here (mysql-replication 1.0.x); without any of it the
# stream is the library's alone.
_PRIVATE = ("allowed_events", "freeze_schema", "verify_checksum", "only_tables", "ignored_tables",
            "only_schemas", "ignored_schemas", "connected_stream", "connected_ctl", "use_checksum",
            "post_header_lengths")


class _Library(Exception):
    """This packet is the library's to read."""


_LIBRARY = _Library()
_SKIP = object()  # the library would skip the event too (a table filtered out)


class DirectStream(BinLogStreamReader):
    """``BinLogStreamReader`` that reads the hot events itself (see the module's words); its
    connection must be a ``PushBackConnection`` (``pymysql_wrapper``), else it is the library's
    stream as it is."""

    def __init__(self, *args: Any, direct_rows: bool = True, **kwargs: Any) -> None:
        """``direct_rows``: rows events too (their images are only read by capture's compiled
        decoder: without it they are the library's)."""
        super().__init__(*args, **kwargs)
        self.direct = 0
        """Events read here (the rest went to the library)."""
        self._handlers: dict[int, Any] = {}
        self._enabled = all(hasattr(self, f"_BinLogStreamReader__{name}") for name in _PRIVATE)
        if not self._enabled:  # another version of the library: all of it is the library's
            return
        allowed = self._BinLogStreamReader__allowed_events
        handlers: dict[int, Any] = {}
        if MariadbGtidEvent in allowed:
            handlers[BINLOG.MARIADB_GTID_EVENT] = self._gtid
        if XidEvent in allowed:
            handlers[BINLOG.XID_EVENT] = self._xid
        if QueryEvent in allowed:
            handlers[BINLOG.QUERY_EVENT] = self._query
        # The cache's parses are ``CachedTableMapEvent``s (the library builds them once
        # ``table_map_cache.install`` has run): the stream yields them when that class is wanted.
        if table_map_cache.CachedTableMapEvent in allowed and not self._BinLogStreamReader__freeze_schema:
            handlers[BINLOG.TABLE_MAP_EVENT] = self._table_map
        for kind, op in _ROWS_OPS.items():
            if direct_rows and _ROWS_CLASSES[op] in allowed:
                handlers[kind] = self._rows
        # A verified checksum, an end position or a skip to a timestamp: the library's alone.
        self._enabled = not (self._BinLogStreamReader__verify_checksum or self.end_log_pos
                             or self.skip_to_timestamp)
        self._handlers = handlers
        self._only_tables = self._BinLogStreamReader__only_tables
        self._ignored_tables = self._BinLogStreamReader__ignored_tables
        self._only_schemas = self._BinLogStreamReader__only_schemas
        self._ignored_schemas = self._BinLogStreamReader__ignored_schemas

    def fetchone(self) -> Any:
        while True:
            conn = self._connection()
            if conn is None:
                return super().fetchone()
            try:
                pkt = conn._read_packet()
            except BaseException as exc:  # the library's own read raises it and handles it
                conn.push_back(exc)
                return super().fetchone()
            data = pkt._data
            handler = self._handlers.get(data[5]) if len(data) >= 20 and data[0] == 0 else None
            if handler is None:
                conn.push_back(pkt)
                return super().fetchone()
            timestamp, kind, server_id, size, log_pos, _ = _HEADER.unpack_from(data)
            body = size - (23 if self._BinLogStreamReader__use_checksum else 19)
            try:
                if body < 0 or 20 + body > len(data):
                    raise _LIBRARY
                event = handler(pkt, data, kind, timestamp, server_id, log_pos, body)
            except (_Library, IndexError, struct.error):  # short or odd bytes: the library's to judge
                conn.push_back(pkt)
                return super().fetchone()
            if log_pos:  # as the library does: a reconnect resumes from here
                self.log_pos = log_pos
            self.direct += 1
            if event is _SKIP:
                continue
            return event

    def by_library(self, event: DirectRows) -> Any:
        """The library's event for a rows event read here that capture cannot take as read."""
        conn = self._connection()
        if conn is None:  # pragma: no cover - a direct event came from this connection
            raise RuntimeError("the binlog connection is gone")
        conn.push_back(event.packet)
        self.direct -= 1
        return super().fetchone()

    def _connection(self) -> PushBackConnection | None:
        if not (self._enabled and self._BinLogStreamReader__connected_stream
                and self._BinLogStreamReader__connected_ctl):
            return None
        conn = getattr(self, "_stream_connection", None)
        return conn if isinstance(conn, PushBackConnection) else None

    def _post_header(self, kind: int, known: int) -> None:
        """The library's ``_advance_to_payload``: a post-header declared longer than the one it
        reads is skipped there, shorter refused; both are left to it."""
        lengths = self._BinLogStreamReader__post_header_lengths
        if lengths and 0 <= kind - 1 < len(lengths) and lengths[kind - 1] != known:
            raise _LIBRARY

    def _filtered(self, schema: str, table: str) -> bool:
        return bool((self._only_tables is not None and table not in self._only_tables)
                    or (self._ignored_tables is not None and table in self._ignored_tables)
                    or (self._only_schemas is not None and schema not in self._only_schemas)
                    or (self._ignored_schemas is not None and schema in self._ignored_schemas))

    # ------------------------------------------------------------------ the hot events

    def _gtid(self, pkt: Any, data: bytes, kind: int, timestamp: int, server_id: int, log_pos: int,
              body: int) -> DirectBegin:
        if body < _GTID.size:
            raise _LIBRARY
        seq, domain, flags = _GTID.unpack_from(data, 20)
        return DirectBegin(log_pos, timestamp, f"{domain}-{server_id}-{seq}", flags)

    def _xid(self, pkt: Any, data: bytes, kind: int, timestamp: int, server_id: int, log_pos: int,
             body: int) -> DirectCommit:
        if body < 8:
            raise _LIBRARY
        return DirectCommit(log_pos, timestamp)

    def _query(self, pkt: Any, data: bytes, kind: int, timestamp: int, server_id: int, log_pos: int,
               body: int) -> DirectQuery:
        """BEGIN and COMMIT only (a transaction of a non-transactional engine, or without GTIDs):
        their status variables carry nothing capture reads; any other statement is the library's."""
        if body < _QUERY.size:
            raise _LIBRARY
        self._post_header(kind, _QUERY.size)
        _, _, schema_length, _, status_length = _QUERY.unpack_from(data, 20)
        p = 20 + _QUERY.size + status_length
        query_length = body - _QUERY.size - status_length - schema_length - 1
        if query_length not in (5, 6):
            raise _LIBRARY
        q = p + schema_length + 1
        query = data[q:q + query_length]
        if query not in _BEGIN_OR_COMMIT:
            raise _LIBRARY
        return DirectQuery(log_pos, timestamp, data[p:p + schema_length], query.decode())

    def _table_map(self, pkt: Any, data: bytes, kind: int, timestamp: int, server_id: int,
                   log_pos: int, body: int) -> Any:
        parsed = table_map_cache.lookup(data[20:20 + body])
        if parsed is None:
            raise _LIBRARY  # parsed (and cached) by the library
        if self._filtered(parsed["schema"], parsed["table"]):
            return _SKIP
        self.table_map[parsed["table_id"]] = parsed["table_obj"]
        return DirectTableMap(parsed["table_id"], parsed["optional_metadata"], parsed["null_bitmask"],
                              parsed["column_count"])

    def _rows(self, pkt: Any, data: bytes, kind: int, timestamp: int, server_id: int, log_pos: int,
              body: int) -> Any:
        table_id = int.from_bytes(data[20:26], "little")
        table = self.table_map.get(table_id)
        if table is None:
            return _SKIP  # its table map was filtered out: the library skips it too
        if self._filtered(table.schema, table.table):
            return _SKIP
        if kind in _V2:
            if data[28] | data[29] << 8 > 2:  # extra data (NDB, partitions): the library's
                raise _LIBRARY
            self._post_header(kind, 10)
            p = 30
        else:
            self._post_header(kind, 8)
            p = 28
        columns = data[p]
        if columns >= 251:
            raise _LIBRARY
        p += 1
        width = (columns + 7) // 8
        op = _ROWS_OPS[kind]
        if op == "update":
            bitmaps: tuple[bytes, ...] = (data[p:p + width], data[p + width:p + 2 * width])
            p += 2 * width
        else:
            bitmaps = (data[p:p + width],)
            p += width
        end = 20 + body
        if p > end:
            raise _LIBRARY
        return DirectRows(log_pos, timestamp, op, table_id, str(table.schema), str(table.table),
                          table.columns, columns, bitmaps, data, p, end, body, pkt)
