"""Transactions larger than a round: read in windows, written in one downstream transaction.

A round holds what its span's allowance lets the reader keep (``SLUICE_SINK_PULL_MAX_BYTES``,
the round's events). Before, a transaction in progress stretched that without bound: the cut
applies only complete transactions, so the reader kept every part of the open one, and the
apply job then carried all of it through Arrow, the JVM and the collapse at once (a 1M-change
UPDATE: 2.6 GB in the worker's Python process, then the Spark driver's heap ran out).

Now a span whose reader may stream (``SpanReader.stream_large``: a table span on a SQL sink
without table rules, cross-shard guard or skipped keys) keeps no more than its allowance of a
transaction either. When its *head* transaction (every change before it applied) is left
incomplete that way, and it is resolved (``large_head``), the round applies it here instead
of in the apply job:

- a second reader of the span (its own consumer) reads the transaction's messages from the
  checkpoint in windows of ``window_events`` messages / ``window_bytes`` bytes, joining chunked
  messages as the span's reader does;
- ``Parts`` takes its parts in order, once each (a re-published copy is skipped; a part
  missing before a later one fails the attempt);
- each window's row changes are collapsed to the last change per key (deletes before upserts)
  and written on ONE connection in ONE downstream transaction that first checks the span's
  write fence; it commits after the last part. Only then does the checkpoint move, to the
  transaction's ts and the stream position before the first later event, as for any batch.

Why a window's collapse is exact although it ends inside a source transaction: the source
checks a unique key row by row, so when a row takes a value the row holding it has given it up
at an earlier row change, which an earlier window wrote or this window's collapse holds; the
upsert's conflict delete (REPLACE semantics) removes only rows whose own later change this or a
later window writes again. Keys the downstream compares as equal meet in one window's dict only
if equal as values; the windows are applied in order, so a key change between such keys is a
delete then an upsert in order.

Crash anywhere before the commit: the downstream rolls the transaction back and the checkpoint
has not moved, so the next owner applies the whole transaction again. Crash after the commit,
before the checkpoint store: the transaction is applied again on its own result, which
converges (final images per key, as for every batch). ``split_rows`` (the changefeed's
``large_txn_split_rows``, unset by default) commits every that many row changes instead: memory and lock time
on the downstream are bounded too, but a reader downstream may see part of the transaction, and
after a crash the re-application starts again from its first part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from contracts.events.rows import RowsChangedV2
from libs.codec.decode import decode_row
from services.sink_worker import metrics as m
from services.sink_worker.round.pull import PulledEvent, PullResult, SpanReader
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.sinks.base import Change, Delete, TargetTable, Upsert
from services.sink_worker.sinks.sql_common import SqlSink, sort_key
from services.sink_worker.span.machine import SpanOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")


class LargeTxnError(Exception):
    """The transaction's messages are not as capture publishes them (a part missing)."""


@dataclass(frozen=True)
class LargeHead:
    """The span's head transaction, too large for the round: its ts and the stream sequence of
    the last of its messages the round's pull saw."""

    ts: int
    last_seq: int


def large_head(pulled: PullResult, checkpoint_ts: int, resolved: int | None) -> LargeHead | None:
    """The head transaction when it is resolved, read to its end (the rest as ghosts) and left
    incomplete in the buffer: the only way the round can apply it is ``apply_large``. None when
    the round's cut can apply it (or nothing: not resolved, a DDL at the head)."""
    if resolved is None or not pulled.reached:
        return None
    fresh = [e for e in pulled.events if e.ts > checkpoint_ts]
    if not fresh:
        return None
    ts = min(e.ts for e in fresh)
    later_ghosts = [g_ts for _, g_ts in pulled.ghosts if g_ts > checkpoint_ts]
    if ts > resolved or (later_ghosts and min(later_ghosts) < ts):
        return None  # something older is not read yet: the horizon is below it
    head = [e for e in fresh if e.ts == ts]
    if any(e.is_ddl for e in head) or complete(head):
        return None
    rest = [seq for seq, g_ts in pulled.ghosts if g_ts == ts]
    if not rest:
        return None  # not read to its end (cannot happen below a resolved mark read up to)
    return LargeHead(ts=ts, last_seq=max(max(e.stream_seq for e in head), max(rest)))


def complete(events: Iterable[PulledEvent]) -> bool:
    """Whether these parts (one transaction of one table, copies allowed) are all of it."""
    parts: set[int] = set()
    last = False
    for e in events:
        parts.add(e.part)
        last = last or e.last_part
    return last and len(parts) == max(parts) + 1


class Parts:
    """A transaction's parts in stream order: each applied once, in order, up to the last."""

    def __init__(self) -> None:
        self.next = 0
        self.done = False

    def take(self, part: int, last: bool) -> bool:
        """Whether to apply this part (False: a copy of one already applied)."""
        if part < self.next:
            return False
        if part > self.next:
            raise LargeTxnError(f"part {part} read before part {self.next}")
        if self.done:
            raise LargeTxnError(f"part {part} after the last part")
        self.next += 1
        self.done = last
        return True


@dataclass
class Window:
    """The row changes of a window collapsed to the last change per key, in key order."""

    deletes: list[tuple[Any, ...]]
    upserts: list[tuple[tuple[Any, ...], dict[str, Any]]]
    rows: int


def collapse(events: Iterable[RowsChangedV2], table: TargetTable,
             origin: tuple[str, str] | None = None) -> Window:
    """A window's changes in order: the last per key; an update that changes the key deletes
    the old key (``sinks.base``: a delete and an upsert of one key never both stay)."""
    pending: dict[tuple[Any, ...], Change] = {}
    rows = 0
    key_cols = table.key
    for ev in events:
        for image in ev.rows:
            rows += 1
            before = _row(ev, image.before, origin)
            after = _row(ev, image.after, origin)
            if before is not None:
                old = tuple(before[c] for c in key_cols)
                if after is None or old != tuple(after[c] for c in key_cols):
                    pending.pop(old, None)
                    pending[old] = Delete(old)
            if after is not None:
                new = tuple(after[c] for c in key_cols)
                pending.pop(new, None)
                pending[new] = Upsert(new, after)
    ordered = sorted(pending.values(), key=lambda c: sort_key(c.key))
    return Window(deletes=[c.key for c in ordered if isinstance(c, Delete)],
                  upserts=[(c.key, dict(c.row)) for c in ordered if isinstance(c, Upsert)], rows=rows)


def _row(ev: RowsChangedV2, image: Mapping[str, Any] | None,
         origin: tuple[str, str] | None) -> dict[str, Any] | None:
    if image is None:
        return None
    row = decode_row(ev.meta, image)
    if origin is not None:
        row[origin[0]] = origin[1]
    return row


@dataclass(frozen=True)
class LargeTxnOptions:
    window_events: int = 64
    """Messages a window reads (capture's parts are 500 rows / 256 KiB)."""
    window_bytes: int = 32 * 1024 * 1024
    split_rows: int = 0
    """0: one downstream transaction; else commit every this many row changes (not atomic)."""


async def apply_large(reader: SpanReader, sink: SqlSink, table: TargetTable, head: LargeHead,
                      start_seq: int, origin: tuple[str, str] | None,
                      options: LargeTxnOptions) -> tuple[SpanCut, SpanOutcome]:
    """Apply the transaction ``head`` of ``reader``'s span, read from ``start_seq`` (the
    round's checkpoint), through ``sink`` in one transaction (see the module docstring).
    ``table.fence`` is checked in that transaction. The reader is closed afterwards."""
    cut = SpanCut(span=reader.span.kv_key, limit_ts=head.ts, batch_events=0, batch_max_ts=None,
                  ddl_ts=None, ddl_id=None)
    outcome = SpanOutcome()
    colmap = {c.name: c for c in table.meta.columns}
    parts = Parts()
    messages = 0
    t0 = time.monotonic()
    log.info("applying a large transaction", extra={"span": reader.span.name, "ts": head.ts})
    # One thread for the transaction's connection: a SQLite connection works only in the
    # thread that opened it, and no two statements of one connection may overlap anyway.
    db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-txn")
    loop = asyncio.get_running_loop()

    async def run(fn: Callable[..., T], *args: Any) -> T:
        return await loop.run_in_executor(db, fn, *args)

    conn = None
    try:
        conn = await run(sink._connect)
        cur = await run(_begin, sink, conn, table)
        pos = start_seq
        since_commit = 0
        while not parts.done:
            pulled = await reader.pull((pos, head.ts - 1), options.window_events, head.last_seq)
            window: list[RowsChangedV2] = []
            for e in pulled.events:
                pos = max(pos, e.stream_seq)
                if e.ts != head.ts or parts.done or not parts.take(e.part, e.last_part):
                    continue  # a later transaction (read on the way), or a copy
                messages += 1
                if not e.dead and isinstance(e.event, RowsChangedV2):
                    window.append(e.event)
            if not pulled.events:
                raise LargeTxnError(f"the stream ends at {reader.read_upto} before the transaction's "
                                    f"last part (part {parts.next} expected)")
            if window:
                w = collapse(window, table, origin)
                del window
                result = await run(sink._apply, cur, table, colmap, w.deletes, w.upserts)
                outcome.rows += w.rows
                since_commit += w.rows
                m.ROWS_APPLIED.labels(reader.span.changefeed, "upsert").inc(result.upserted)
                m.ROWS_APPLIED.labels(reader.span.changefeed, "delete").inc(result.deleted)
            if options.split_rows and since_commit >= options.split_rows and not parts.done:
                await run(conn.commit)
                cur = await run(_begin, sink, conn, table)
                since_commit = 0
        await run(conn.commit)
    except BaseException:
        if conn is not None:
            try:
                await run(conn.rollback)
            except Exception:  # the connection may be gone: the server rolls back anyway
                log.debug("rollback failed")
        raise
    finally:
        if conn is not None:
            try:
                await run(conn.close)
            except Exception:
                log.debug("close failed")
        db.shutdown(wait=False)
        await reader.close()
    outcome.written = True
    m.APPLY_SECONDS.observe(time.monotonic() - t0)
    log.info("large transaction applied", extra={
        "span": reader.span.name, "ts": head.ts, "messages": messages, "rows": outcome.rows,
        "seconds": round(time.monotonic() - t0, 2), "split_rows": options.split_rows or None})
    return (SpanCut(span=cut.span, limit_ts=head.ts, batch_events=messages, batch_max_ts=head.ts,
                    ddl_ts=None, ddl_id=None), outcome)


def _begin(sink: SqlSink, conn: Any, table: TargetTable) -> Any:
    sink._begin(conn)
    cur = conn.cursor()
    if table.fence is not None:
        sink._check_write_fence(cur, table.fence)
    return cur
