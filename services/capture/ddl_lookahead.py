"""Which DDL statements lie ahead of capture in the binlog: does information_schema, read now,
still describe a table at an earlier binlog position?

information_schema shows a table as of the moment it is read. That is its shape at binlog
position P exactly when no DDL naming the table lies between P and the binlog's end observed
right after the read (a DDL that the read saw is in the binlog by then: the server writes it
while it still holds the table's exclusive metadata lock, which the read waits for). Each
stretch of binlog is listed once, so a capture that reads far behind pays one pass over what
lies ahead, not one per table or per DDL.

The pass (``list_ddl``) is a non-blocking binlog dump (``COM_BINLOG_DUMP`` with
``BINLOG_DUMP_NON_BLOCK`` and server id 0, as ``mysqlbinlog`` reads a remote binlog: the server
sends what it has and an EOF, and kills no replica's dump for it; REPLICATION SLAVE, which
capture's user has) whose packets are framed here and of which only the Query events are
parsed: every other event costs its 4-byte packet header and a look at its type byte. It used to
be ``SHOW BINLOG EVENTS`` (``list_ddl_shown``, kept as the reference the tests compare with),
whose result rows pymysql parses field by field for every event of the backlog: about a quarter
of capture's CPU in a drain (BENCHMARKS.md). Both list the same statements: an event of type
Query (2; not MariaDB's compressed Query, which ``SHOW BINLOG EVENTS`` names otherwise) with the
schema it was run in, at its start position (its end, ``log_pos``, less its size).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pymysql

from libs.mysql_statements import classify
from services.capture.binlog_reader import Position

TableKey = tuple[str, str]

_USE = re.compile(r"\s*use\s+`((?:[^`]|``)*)`\s*;\s*(.*)\Z", re.IGNORECASE | re.DOTALL)
_PAGE = 5000


@dataclass(frozen=True)
class AheadDdl:
    """A DDL statement starting at ``position``: the tables it names, or a dropped database."""

    position: Position
    tables: frozenset[TableKey] = frozenset()
    database: str | None = None

    def names(self, key: TableKey) -> bool:
        return key in self.tables or self.database == key[0]


def ddl_of(position: Position, info: str) -> AheadDdl | None:
    """The DDL of a Query event as ``SHOW BINLOG EVENTS`` spells it ("use `db`; statement")."""
    match = _USE.match(info)
    schema, query = (match.group(1).replace("``", "`"), match.group(2)) if match else ("", info)
    return _ahead(position, query, schema)


def _ahead(position: Position, query: str, schema: str) -> AheadDdl | None:
    stmt = classify(query, schema)
    if stmt.kind == "ddl":
        return AheadDdl(position, frozenset(stmt.tables))
    if stmt.kind == "drop_database":
        return AheadDdl(position, database=stmt.database)
    return None


def _key(p: Position) -> tuple[str, int]:
    return (p.file, p.pos)


class DdlIndex:
    """The DDL found in one listed stretch ``[start, end)`` of the binlog (pure bookkeeping)."""

    def __init__(self) -> None:
        self.start: Position | None = None
        self.end: Position | None = None
        self.found: list[AheadDdl] = []

    def missing(self, after: Position, until: Position) -> tuple[Position, Position] | None:
        """The stretch still to list so that ``[after, until)`` is covered; None if it is."""
        if _key(until) <= _key(after):
            return None
        if self.start is None or self.end is None or _key(after) < _key(self.start):
            return (after, until)
        if _key(until) <= _key(self.end):
            return None
        return (self.end, until)

    def add(self, start: Position, end: Position, found: Iterable[AheadDdl]) -> None:
        """Record a listed stretch: it continues the known one, or replaces it."""
        if self.start is not None and self.end is not None and _key(start) == _key(self.end):
            self.end = end
            self.found.extend(found)
        else:
            self.start, self.end, self.found = start, end, list(found)

    def names_between(self, key: TableKey, after: Position, until: Position) -> bool:
        """Whether a DDL naming ``key`` starts in ``[after, until)`` (the stretch is listed)."""
        return any(_key(after) <= _key(d.position) < _key(until) and d.names(key) for d in self.found)

    def forget_before(self, position: Position) -> None:
        """Capture has read past ``position``: what lies before it is never asked about again."""
        if self.start is not None and _key(self.start) < _key(position):
            self.found = [d for d in self.found if _key(d.position) >= _key(position)]
            if self.end is not None and _key(position) <= _key(self.end):
                self.start = position


def list_ddl_shown(conn: Any, start: Position, until: Position) -> list[AheadDdl]:
    """``list_ddl`` by ``SHOW BINLOG EVENTS`` on ``conn`` (the reference; a row per event)."""
    with conn.cursor() as cur:
        cur.execute("SHOW BINARY LOGS")
        files = [str(r[0]) for r in cur.fetchall()]
        out: list[AheadDdl] = []
        for name in files:
            if name < start.file or name > until.file:
                continue
            pos, more = (start.pos if name == start.file else 4), True
            while more:
                cur.execute(f"SHOW BINLOG EVENTS IN %s FROM {int(pos)} LIMIT {_PAGE}", (name,))
                rows = cur.fetchall()
                more = len(rows) == _PAGE
                for _log, event_pos, event_type, _server, end_pos, info in rows:
                    at = Position(name, int(event_pos))
                    if name == until.file and at.pos >= until.pos:
                        more = False
                        break
                    if str(event_type) == "Query":
                        ddl = ddl_of(at, str(info))
                        if ddl is not None:
                            out.append(ddl)
                    pos = int(end_pos)  # the next event's start
    return out


_COM_BINLOG_DUMP = 0x12
_BINLOG_DUMP_NON_BLOCK = 1
_QUERY_EVENT = 2
_ROTATE_EVENT = 4
_FORMAT_DESCRIPTION_EVENT = 15
_HEADER = struct.Struct("<IBIIIH")  # timestamp, type, server id, event size, log_pos, flags
_QUERY_POST = struct.Struct("<IIBHH")  # thread id, exec time, schema length, error, status length
_MAX_PACKET = 0xFFFFFF


class _Packets:
    """The dump's protocol packets read straight from pymysql's buffered socket file: a packet
    per event, joined when the server split it at 16 MiB (pymysql's ``_read_packet`` builds an
    object and checks it per packet, which is most of what a pass costs)."""

    def __init__(self, conn: Any) -> None:
        self._read = conn._rfile.read

    def next(self) -> bytes:
        parts: list[bytes] = []
        while True:
            header = self._read(4)
            if len(header) < 4:
                raise pymysql.err.OperationalError(2013, "lost connection during the binlog pass")
            length = header[0] | header[1] << 8 | header[2] << 16
            payload = self._read(length) if length else b""
            if len(payload) < length:
                raise pymysql.err.OperationalError(2013, "lost connection during the binlog pass")
            parts.append(payload)
            if length < _MAX_PACKET:
                return parts[0] if len(parts) == 1 else b"".join(parts)


def list_ddl(connect: Callable[[], Any], start: Position, until: Position) -> list[AheadDdl]:
    """The DDL of the binlog from ``start`` (an event boundary) up to ``until``, read by a
    non-blocking binlog dump on a connection of its own (``connect``; closed after: a dump
    ends the connection's use for commands). I/O."""
    conn = connect()
    try:
        with conn.cursor() as cur:
            # Events as the binlog holds them (with their checksums, read per file from its
            # format description), and MariaDB's GTID events as such, not rewritten for an old
            # replica.
            cur.execute("SELECT @@global.binlog_checksum")
            row = cur.fetchone()
            cur.execute("SET @master_binlog_checksum = @@global.binlog_checksum")
            cur.execute("SET @mariadb_slave_capability = 4")
        # Until the first format description: the artificial rotate is sent as the server's
        # setting says (as pymysqlreplication reads it).
        checksum = 0 if row is None or str(row[0]).upper() == "NONE" else 4
        name = start.file.encode()
        conn._write_bytes(struct.pack("<i", len(name) + 11) + bytes([_COM_BINLOG_DUMP])
                          + struct.pack("<IHI", start.pos, _BINLOG_DUMP_NON_BLOCK, 0) + name)
        return _scan(_Packets(conn), start, until, checksum)
    finally:
        try:
            conn.close()
        except Exception:  # a connection in the middle of a dump may fail to say goodbye
            pass


def _scan(packets: _Packets, start: Position, until: Position, checksum: int) -> list[AheadDdl]:
    out: list[AheadDdl] = []
    file = start.file
    end = (until.file, until.pos)
    unpack_header = _HEADER.unpack_from
    while True:
        data = packets.next()
        first = data[0] if data else 0xFE
        if first == 0xFE and len(data) < 9:
            return out  # EOF: the binlog's end (non-blocking dump)
        if first == 0xFF:
            pymysql.err.raise_mysql_exception(data)
        kind = data[5]
        if kind == _QUERY_EVENT:
            _timestamp, _kind, _server, size, log_pos, _flags = unpack_header(data, 1)
            at = log_pos - size
            if (file, at) >= end:
                return out
            ddl = _query_ddl(Position(file, at), data, checksum)
            if ddl is not None:
                out.append(ddl)
        elif kind == _ROTATE_EVENT:
            # The first one (artificial) names the start file; a real one the next file. Its
            # body: the next file's first position (8 bytes) and its name (to the checksum).
            name = data[1 + 19 + 8:len(data) - checksum].decode()
            if (name, 4) >= end:
                return out
            file = name
        elif kind == _FORMAT_DESCRIPTION_EVENT:
            # Its checksum algorithm (1 byte before its own 4-byte checksum): 1 is CRC32, 0
            # none; the file's events carry 4 bytes more when it is on.
            checksum = 4 if data[len(data) - 5] != 0 else 0
        else:
            # Any other event: only where it starts, to stop at ``until`` (an artificial one,
            # log_pos 0, is no place in the file).
            _timestamp, _kind, _server, size, log_pos, _flags = unpack_header(data, 1)
            if log_pos and (file, log_pos - size) >= end:
                return out


def _query_ddl(at: Position, data: bytes, checksum: int) -> AheadDdl | None:
    """The DDL of a Query event's packet (its schema and statement), as ``ddl_of`` reads it."""
    p = 1 + 19
    _thread, _exec, schema_length, _error, status_length = _QUERY_POST.unpack_from(data, p)
    p += _QUERY_POST.size + status_length
    schema = data[p:p + schema_length].decode("utf-8", "replace")
    query = data[p + schema_length + 1:len(data) - checksum].decode("utf-8", "replace")
    return _ahead(at, query, schema)
