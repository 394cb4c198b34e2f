"""Table map events parsed once per distinct body, not once per transaction.

The binlog repeats a table's TABLE_MAP event before the rows events of every transaction that
touches the table. pymysqlreplication parses each one from scratch (columns, optional metadata,
column names, a ``Table`` object) and, under many small transactions, that is more than half
of its parsing time (BENCHMARKS.md, "Capture under many small transactions").

``CachedTableMapEvent`` keeps the parse of each distinct event body (table id, schema, table,
column types and metadata, null bitmap, optional metadata: everything the parse reads) and
reuses it when the same bytes come again. Equal bytes give an equal parse, so a cache hit is
exactly what the library would have built; a DDL or a server restart that reuses a table id
writes different bytes, which miss. The class takes the place of ``TableMapEvent`` in the
library's event map (``install``); the stream yields it where it yielded ``TableMapEvent``,
of which it is a subclass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from pymysqlreplication import constants
from pymysqlreplication.event import BinLogEvent
from pymysqlreplication.packet import BinLogPacketWrapper
from pymysqlreplication.row_event import TableMapEvent

MAX_ENTRIES = 4096
"""Distinct table maps kept (least recently used out): one per (table id, shape) seen."""

# What TableMapEvent.__init__ sets from the event body (the rest comes from BinLogEvent).
_PARSED = ("table_id", "flags", "schema_length", "schema", "table_length", "table", "column_count",
           "columns", "dbms", "null_bitmask", "table_obj", "optional_metadata")

_lock = threading.Lock()
_cache: OrderedDict[bytes, dict[str, Any]] = OrderedDict()


class CachedTableMapEvent(TableMapEvent):
    def __init__(self, from_packet: Any, event_size: int, table_map: dict[int, Any], ctl_connection: Any,
                 **kwargs: Any) -> None:
        raw = _body(from_packet, event_size)
        with _lock:
            parsed = _cache.get(raw) if raw is not None else None
            if parsed is not None:
                _cache.move_to_end(raw)  # type: ignore[arg-type]
        if parsed is None:
            super().__init__(from_packet, event_size, table_map, ctl_connection, **kwargs)
            processed = bool(getattr(self, "_processed", False))
            if raw is not None and processed and self.optional_metadata.column_name_list:
                # Only a parse that needed nothing but the bytes: without column names in the
                # binlog the library asks the server for them, and that answer may change.
                with _lock:
                    _cache[raw] = {name: getattr(self, name) for name in _PARSED if hasattr(self, name)}
                    while len(_cache) > MAX_ENTRIES:
                        _cache.popitem(last=False)
            return
        BinLogEvent.__init__(self, from_packet, event_size, table_map, ctl_connection, **kwargs)
        self.__dict__.update(parsed)
        if self.table_id in table_map and kwargs.get("freeze_schema"):
            self._processed = False
            return
        if _filtered(self, kwargs):
            self._processed = False
            return
        table_map[self.table_id] = self.table_obj


def lookup(raw: bytes) -> dict[str, Any] | None:
    """The cached parse of a table map's body (what ``CachedTableMapEvent`` sets from it), or
    None when these bytes have not been parsed yet. ``direct_events`` reads it without an event."""
    with _lock:
        parsed = _cache.get(raw)
        if parsed is not None:
            _cache.move_to_end(raw)
    return parsed


def _body(from_packet: Any, event_size: int) -> bytes | None:
    """The event's body (after the common header), or None when the packet is not laid out as
    pymysql's ``MysqlPacket`` (then the event is parsed as usual)."""
    packet = getattr(from_packet, "packet", None)
    data = getattr(packet, "_data", None)
    position = getattr(packet, "_position", None)
    if not isinstance(data, bytes | bytearray) or not isinstance(position, int):
        return None
    return bytes(data[position:position + event_size])


def _filtered(event: CachedTableMapEvent, kwargs: dict[str, Any]) -> bool:
    only_tables, ignored_tables = kwargs.get("only_tables"), kwargs.get("ignored_tables")
    only_schemas, ignored_schemas = kwargs.get("only_schemas"), kwargs.get("ignored_schemas")
    return bool((only_tables is not None and event.table not in only_tables)
                or (ignored_tables is not None and event.table in ignored_tables)
                or (only_schemas is not None and event.schema not in only_schemas)
                or (ignored_schemas is not None and event.schema in ignored_schemas))


def install() -> None:
    """Make the library build ``CachedTableMapEvent`` for TABLE_MAP events (idempotent)."""
    events = BinLogPacketWrapper._BinLogPacketWrapper__event_map
    events[constants.TABLE_MAP_EVENT] = CachedTableMapEvent


def uninstall() -> None:
    """The library's own ``TableMapEvent`` again (the parse-only benchmark measures it)."""
    events = BinLogPacketWrapper._BinLogPacketWrapper__event_map
    events[constants.TABLE_MAP_EVENT] = TableMapEvent
