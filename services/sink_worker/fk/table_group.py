"""A table group's batch: the tables cascading foreign keys connect, applied as one span.

MariaDB never binlogs the child rows its ``CASCADE``/``SET NULL`` actions change
(``libs.foreign_keys``), so ``cascades.run_cascade`` carries them out downstream. That is exact
only when the group's downstream tables hold the source's state just before the parent change,
which per-table spans (each applying final images per key, at its own pace) cannot give. A group
span reads every member's subjects with one consumer (one stream: capture's publish order) and
its batch is applied here, in the driver, in ONE downstream transaction, each source transaction
in binlog order: capture publishes one message per (transaction, table), and the rows of one
transaction are merged by their ordinal (``RowImageV2.ordinal``) across its messages. A
transaction with a row of unknown ordinal (upcast from ``rows.changed`` v1) keeps publish order,
``(seq, part)`` then row order, as before ordinals existed. Along that order:

- runs of changes that trigger nothing are collapsed to the last image per key and written
  together (as the Spark apply does), per table;
- at a change that triggers a cascade (``CascadeGraph.triggers``) the pending runs are written
  first, then the parent's own change, then ``run_cascade``; then the batch goes on.

The checkpoint moves only after the whole transaction committed, so a replay from an older
checkpoint replays the same sequence against a state at least as new (DESIGN.md, "Foreign-key
cascades", on why that converges).

The cut follows ``sort_job.cut_span``, with a transaction complete only when every table's
parts are (parts are numbered per transaction and table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Literal

from contracts.events.rows import RowImageV2, RowsChangedV2, TableMetaV1
from libs.codec.decode import decode_row
from libs.codec.table_meta import load_table_info
from libs.source_tables import connect_source
from services.sink_worker.fk.cascades import CascadeGraph, CascadeResult, CascadeTable, run_cascade
from services.sink_worker.round.pull import PulledEvent
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.sinks.base import Change, Delete, TargetTable, Upsert
from services.sink_worker.sinks.sql_common import SqlSink, sort_key


@dataclass
class GroupCut:
    cut: SpanCut
    batch: list[PulledEvent]
    """The rows events to apply, deduplicated, in ``(ts, seq, part)`` order (dead parts left out)."""
    ddl: PulledEvent | None = None
    """The barrier the cut stops at: a member's DDL, or a parent's ``foreign_keys.changed``."""


def cut_group(span_key: str, checkpoint_ts: int, horizon_ts: int, events: Sequence[PulledEvent]) -> GroupCut:
    fresh: dict[str, PulledEvent] = {}
    for e in events:
        if e.ts > checkpoint_ts:
            fresh.setdefault(e.event_id, e)
    # ts -> table -> (parts, has last part); plus the DDLs at that ts
    txns: dict[int, dict[tuple[str, ...], tuple[set[int], list[bool]]]] = {}
    ddls: dict[int, list[PulledEvent]] = {}
    for e in fresh.values():
        if e.is_ddl:
            ddls.setdefault(e.ts, []).append(e)
            txns.setdefault(e.ts, {})
            continue
        table = tuple(e.subject.split(".")[3:])  # the reader keeps only the group's own subjects
        parts, last = txns.setdefault(e.ts, {}).setdefault(table, (set(), [False]))
        parts.add(e.part)
        if e.last_part:
            last[0] = True
    limit, ddl = horizon_ts, None
    count, max_ts = 0, None
    for ts in sorted(txns):
        if ts > horizon_ts:
            break
        if ts in ddls:
            ddl = min(ddls[ts], key=lambda e: e.event_id)
            limit = ts - 1
            break
        if not all(last[0] and len(parts) == max(parts) + 1 for parts, last in txns[ts].values()):
            limit = ts - 1
            break
        count += sum(len(parts) for parts, _ in txns[ts].values())
        max_ts = ts
    batch = sorted((e for e in fresh.values() if not e.is_ddl and not e.dead and e.ts <= limit),
                   key=lambda e: (e.ts, e.seq, e.part))
    cut = SpanCut(span=span_key, limit_ts=limit, batch_events=count, batch_max_ts=max_ts,
                  ddl_ts=ddl.ts if ddl is not None else None,
                  ddl_id=ddl.event_id if ddl is not None else None)
    return GroupCut(cut, batch, ddl)


@dataclass
class GroupResult:
    rows: int = 0
    cascades: CascadeResult = field(default_factory=CascadeResult)
    triggers: int = 0


Op = Literal["insert", "update", "delete"]


def source_order(batch: Sequence[PulledEvent]) -> Iterator[tuple[RowsChangedV2, RowImageV2]]:
    """The rows of ``batch`` (in ``(ts, seq, part)`` order) one by one, each transaction's rows
    merged across its tables by ordinal: the order the source wrote them to the binlog."""
    for _, group in groupby(batch, key=lambda e: e.ts):
        rows: list[tuple[RowsChangedV2, RowImageV2]] = []
        for e in group:
            ev = e.event
            assert isinstance(ev, RowsChangedV2)
            rows.extend((ev, image) for image in ev.rows)
        if all(image.ordinal is not None for _, image in rows):
            rows.sort(key=lambda r: r[1].ordinal or 0)
        yield from rows


def apply_group_batch(sink: SqlSink, graph: CascadeGraph, batch: Sequence[PulledEvent],
                      table_of: Callable[[RowsChangedV2], CascadeTable]) -> GroupResult:
    """Apply ``batch`` (``cut_group``'s) on ``sink`` in one transaction, cascades at their place.

    ``table_of``: the member's downstream table (and origin) for an event; ``graph.tables`` must
    hold every member a cascade can reach (``run_cascade`` skips a child it does not hold)."""

    def work(cur: Any) -> GroupResult:
        result = GroupResult()
        pending: dict[tuple[str | None, str], tuple[TargetTable, dict[tuple[Any, ...], Change]]] = {}

        def flush() -> None:
            for table, changes in pending.values():
                colmap = {c.name: c for c in table.meta.columns}
                ordered = sorted(changes.values(), key=lambda c: sort_key(c.key))
                deletes = [c.key for c in ordered if isinstance(c, Delete)]
                upserts = [(c.key, dict(c.row)) for c in ordered if isinstance(c, Upsert)]
                sink._apply(cur, table, colmap, deletes, upserts)
            pending.clear()

        for ev, image in source_order(batch):
            member = table_of(ev)
            target = member.target
            before = _row(ev, image.before, member)
            after = _row(ev, image.after, member)
            changes: list[Change] = []
            if before is not None and (after is None or _key(target, before) != _key(target, after)):
                changes.append(Delete(_key(target, before)))
            if after is not None:
                changes.append(Upsert(_key(target, after), after))
            result.rows += 1
            op: Op = "insert" if before is None else "delete" if after is None else "update"
            if graph.triggers(ev.database, ev.table, op, before, after):
                assert before is not None
                flush()
                pending[(target.schema, target.name)] = (target, {c.key: c for c in changes})
                flush()
                run_cascade(sink, cur, graph, ev.database, ev.table, before, after, result.cascades)
                result.triggers += 1
                continue
            _, queued = pending.setdefault((target.schema, target.name), (target, {}))
            for change in changes:
                queued.pop(change.key, None)
                queued[change.key] = change
        flush()
        return result

    return sink._run(work, "apply a foreign-key group's batch")


def _row(ev: RowsChangedV2, image: Mapping[str, Any] | None, member: CascadeTable) -> dict[str, Any] | None:
    if image is None:
        return None
    row = decode_row(ev.meta, image)
    if member.origin is not None:
        row[member.origin[0]] = member.origin[1]
    return row


def _key(table: TargetTable, row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row[c] for c in table.key)


def source_metas(url: str, tables: Sequence[tuple[str, str]]) -> dict[tuple[str, str], TableMetaV1]:
    """The metadata of ``tables`` as the source shows it now (a member with no event yet: a
    cascade may still reach its rows, e.g. the ones its initial load copied). A table that
    does not exist is left out (a cascade cannot reach it)."""
    conn = connect_source(url)
    try:
        out: dict[tuple[str, str], TableMetaV1] = {}
        for database, table in tables:
            info = load_table_info(conn, database, table)
            if info is not None:
                out[(database, table)] = info.meta()
        return out
    finally:
        conn.close()
