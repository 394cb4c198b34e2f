"""The envelope of a small ``rows.changed`` message as JSON bytes, without pydantic's round trip.

``REGISTRY.encode`` dumps the event to a dict, validates an ``Envelope`` around it and dumps
that to JSON: about 30 us a message on this machine, as much as everything else capture does
for a one-row transaction. Capture builds its events itself (``model_construct``, values
already in their JSON encoding, ``libs/codec/encode.py``), so nothing needs validating: this
writes the same envelope (same fields, same values; decoded by ``REGISTRY.decode`` into an
equal event) with orjson in a few microseconds, the table's metadata dumped once per table.

Anything orjson cannot write as the contract says (an integer beyond 64 bits, a value of
another type) raises ``TypeError``; the publisher then falls back to ``REGISTRY.encode``.
Messages that may go in chunks keep their deterministic encoding (``large_encode.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson

from contracts.events.rows import RowImageV2, RowsChangedV2, RowsChangedV3, RowsChangedV4, TableMetaV1
from contracts.registry import REGISTRY

_TYPE, _VERSION = REGISTRY.key_of(RowsChangedV3)
_BATCH_VERSION = REGISTRY.key_of(RowsChangedV4)[1]
_MAX_METAS = 1024

# id(meta) -> (meta, its JSON-ready dump); the meta is kept so its id cannot be reused.
_metas: dict[int, tuple[TableMetaV1, dict[str, Any], bool]] = {}


def _cached(meta: TableMetaV1) -> tuple[TableMetaV1, dict[str, Any], bool]:
    # Fields at their defaults are left out (a shape's empty comments, absent prefixes, ...):
    # they decode to the same values, and every consumer parses the metadata of every message.
    found = _metas.get(id(meta))
    if found is None or found[0] is not meta:
        if len(_metas) >= _MAX_METAS:
            _metas.clear()
        found = _metas[id(meta)] = (meta, meta.model_dump(mode="json", exclude_defaults=True),
                                    any(c.kind == "geometry" for c in meta.columns))
    return found


def has_geometry(meta: TableMetaV1) -> bool:
    """Whether the table has a spatial column (its messages need rows.changed v4), read once
    per table map like the metadata's dump."""
    return _cached(meta)[2]


def _rows(rows: list[RowImageV2]) -> list[dict[str, Any]]:
    return [{"op": r.op, "before": r.before, "after": r.after, "ordinal": r.ordinal} for r in rows]


def encode_rows(event: RowsChangedV2, *, producer: str, epoch: int, event_id: str) -> bytes:
    """A message of one transaction part as v3 (what a v4 message of one part is, so readers of
    v3 read it unchanged); a ``RowsChangedV4`` (with ``more``, or of a table with a spatial
    column) as v4."""
    pos = event.position
    data = {
        "source": event.source, "database": event.database, "table": event.table, "ts": event.ts,
        "seq": event.seq, "part": event.part, "last_part": event.last_part,
        "position": {"binlog_file": pos.binlog_file, "binlog_pos": pos.binlog_pos, "gtid": pos.gtid},
        "meta": _cached(event.meta)[1],
        "rows": _rows(event.rows),
    }
    version = _VERSION
    if (isinstance(event, RowsChangedV4) and event.more) or has_geometry(event.meta):
        version = _BATCH_VERSION  # several parts, or a spatial column (the kind came with v4)
    if isinstance(event, RowsChangedV4) and event.more:
        data["event_id"] = event.event_id
        data["more"] = [
            {"event_id": p.event_id, "ts": p.ts, "seq": p.seq, "part": p.part, "last_part": p.last_part,
             "position": {"binlog_file": p.position.binlog_file, "binlog_pos": p.position.binlog_pos,
                          "gtid": p.position.gtid},
             "rows": _rows(p.rows)} for p in event.more]
    return orjson.dumps({"type": _TYPE, "version": version, "id": event_id, "time": datetime.now(UTC),
                         "producer": producer, "epoch": epoch, "data": data})
