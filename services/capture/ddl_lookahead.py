"""Which DDL statements lie ahead of capture in the binlog: does information_schema, read now,
still describe a table at an earlier binlog position?

information_schema shows a table as of the moment it is read. That is its shape at binlog
position P exactly when no DDL naming the table lies between P and the binlog's end observed
right after the read (a DDL that the read saw is in the binlog by then: the server writes it
while it still holds the table's exclusive metadata lock, which the read waits for). The binlog
ahead is listed with ``SHOW BINLOG EVENTS`` (REPLICATION SLAVE / BINLOG MONITOR, which capture's
user has), keeping only the DDL; each stretch of binlog is listed once, so a capture that reads
far behind pays one pass over what lies ahead, not one per table or per DDL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


def list_ddl(conn: Any, start: Position, until: Position) -> list[AheadDdl]:
    """The DDL of the binlog from ``start`` (an event boundary) up to ``until`` (I/O)."""
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
