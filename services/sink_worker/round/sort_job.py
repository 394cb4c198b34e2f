"""The cut of a round, on the driver: from the events pulled for every span of the worker, the
batch each span may apply now. No Spark job: it is metadata the pull already decoded.

Per span:

1. drop events with ts <= the span's checkpoint ts (applied before; re-read after a restart or
   because they sit behind an event that was held back), then duplicates by event id (the
   producer is at-least-once; copies of one id are the same message);
2. summarise each transaction (one entry per ts: complete or not, DDL or not);
3. walk the summary in ts order up to the span's *horizon* (``PullResult.horizon``: the
   resolved ts, lowered to just below any event the pull has not buffered): the batch ends at
   the last complete transaction, and before the span's first DDL, which is a barrier applied
   alone after the batch; the span continues after it in the next round.

The order of changes, ``(ts, seq, part)`` and then row order inside a message, is applied where
it matters: the apply job's collapse keeps the last image per key by it, and the cut only ever
ends at a transaction boundary of that order. The batch holds the bodies as the pull received
them (or with large values as references, ``large_values``); the apply job hands them to
Spark as one Arrow table. A message of several transaction parts is one batch event: its
bytes once, with the indexes of the parts the batch takes from it (``picks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.sink_worker.round.large_values import LargeValues
from services.sink_worker.round.pull import PulledEvent

EventRecord = tuple[str, str, str, int, int, int, bool, int, bytes, int]
"""``(span, kind, id, ts, seq, part, last_part, stream_seq, body, index)``; kind: "rows" |
"ddl" | "dead" (a dead-lettered part); index: which part of ``body`` the event is (-1: the
body is the event alone; ``PulledEvent.index``)."""

BatchEvent = tuple[str, int, int, int, bytes, list[int]]
"""Rows of a batch, as the apply job reads them: ``(span, ts, seq, part, body, picks)``. With
``picks`` empty the body is one event, at ``(ts, seq, part)``; else the body is a message of
several parts and ``picks`` the indexes of those in the batch, each at the ``(ts, seq, part)``
the message gives it (the tuple's are its first pick's)."""


@dataclass(frozen=True)
class SpanInput:
    span: str
    checkpoint_ts: int
    horizon_ts: int


@dataclass(frozen=True)
class SpanCut:
    span: str
    limit_ts: int
    """Row changes with checkpoint ts < ts <= limit_ts form the batch."""
    batch_events: int
    batch_max_ts: int | None
    ddl_ts: int | None
    """The DDL barrier the batch stops at when it may be applied right after the batch."""
    ddl_id: str | None


@dataclass
class SortResult:
    cuts: dict[str, SpanCut]
    batches: dict[str, list[BatchEvent]] = field(default_factory=dict)
    """Per span, the rows events of its batch, deduplicated, in ``(ts, seq, part)`` order."""

    def batch(self, spans: Iterable[str]) -> list[BatchEvent]:
        """The batch events of ``spans``, span after span (the apply job keeps a span together)."""
        return [e for span in spans for e in self.batches.get(span, [])]


def event_records(span_key: str, events: Iterable[PulledEvent], large: LargeValues | None = None,
                  key: tuple[str, ...] = ()) -> list[EventRecord]:
    """The records of one span's events (the body is the message's bytes, not a copy), with
    ``large``: a body that may hold large values has them as references instead
    (``large_values``; raises ``LargeKeyError`` when one is in a ``key`` column)."""
    def record(e: PulledEvent) -> EventRecord:
        body, index = e.data, e.index
        if e.dead:
            body, index = b"", -1
        elif large is not None and large.needs_strip(e):
            body = large.strip(e, key)
            if body is not e.data:  # rewritten: the part alone
                index = -1
        return (span_key, "dead" if e.dead else "ddl" if e.is_ddl else "rows", e.event_id, e.ts, e.seq,
                e.part, e.last_part, e.stream_seq, body, index)

    return [record(e) for e in events]


@dataclass(frozen=True)
class TxnSummary:
    """One transaction (or DDL) of one span."""

    ts: int
    is_ddl: bool
    complete: bool
    events: int
    ddl_id: str | None


def cut_span(span: SpanInput, txns: list[TxnSummary]) -> SpanCut:
    """The batch of one span from its transactions in ts order (see the module docstring)."""
    limit = span.horizon_ts
    ddl: TxnSummary | None = None
    events = 0
    max_ts: int | None = None
    for txn in sorted(txns, key=lambda t: t.ts):
        if txn.ts > span.horizon_ts:
            break
        if txn.is_ddl:
            ddl = txn
            limit = txn.ts - 1
            break
        if not txn.complete:
            limit = txn.ts - 1
            break
        events += txn.events
        max_ts = txn.ts
    return SpanCut(span=span.span, limit_ts=limit, batch_events=events, batch_max_ts=max_ts,
                   ddl_ts=ddl.ts if ddl else None, ddl_id=ddl.ddl_id if ddl else None)


def summarise(records: Iterable[EventRecord]) -> list[TxnSummary]:
    """One span's deduplicated records, one summary per ts: a transaction's rows of one table
    may span several messages (parts 0..n, the last one flagged); it is complete when the
    flagged part and every part before it are present. A DDL is a transaction of its own."""
    groups: dict[int, tuple[set[int], list[bool], list[str]]] = {}
    rows: dict[int, int] = {}
    for _, kind, id_, ts, _, part, last_part, _, _, _ in records:
        parts, flags, ddl_ids = groups.setdefault(ts, (set(), [False, False], []))
        parts.add(part)
        if last_part:
            flags[0] = True
        if kind == "ddl":
            flags[1] = True
            ddl_ids.append(id_)
        elif kind == "rows":
            rows[ts] = rows.get(ts, 0) + 1
    out = []
    for ts, (parts, (has_last, is_ddl), ddl_ids) in groups.items():
        complete = is_ddl or (has_last and len(parts) == max(parts) + 1)
        out.append(TxnSummary(ts=ts, is_ddl=is_ddl, complete=complete, events=rows.get(ts, 0),
                              ddl_id=min(ddl_ids) if ddl_ids else None))
    return out


def run_sort(records: Iterable[EventRecord], spans: list[SpanInput]) -> SortResult:
    """``records``: ``event_records`` of every span in the round; the cut and the batch of each."""
    inputs = {s.span: s for s in spans}
    fresh: dict[str, dict[str, EventRecord]] = {s.span: {} for s in spans}
    for r in records:
        span = inputs.get(r[0])
        if span is None or r[3] <= span.checkpoint_ts:
            continue
        fresh[r[0]].setdefault(r[2], r)
    cuts: dict[str, SpanCut] = {}
    batches: dict[str, list[BatchEvent]] = {}
    for s in spans:
        events = fresh[s.span].values()
        cut = cuts[s.span] = cut_span(s, summarise(events))
        batch = sorted((r for r in events if r[1] == "rows" and r[3] <= cut.limit_ts),
                       key=lambda r: (r[3], r[4], r[5]))
        if batch:
            batches[s.span] = batch_events(batch)
    return SortResult(cuts=cuts, batches=batches)


def batch_events(records: list[EventRecord]) -> list[BatchEvent]:
    """Records in batch order as batch events: consecutive parts of one message as one event
    holding the message's bytes once."""
    out: list[BatchEvent] = []
    last: EventRecord | None = None
    for r in records:
        index = r[9]
        if index < 0:
            out.append((r[0], r[3], r[4], r[5], r[8], []))
            last = None
            continue
        if last is not None and last[7] == r[7] and last[8] is r[8]:
            out[-1][5].append(index)
        else:
            out.append((r[0], r[3], r[4], r[5], r[8], [index]))
        last = r
    return out
