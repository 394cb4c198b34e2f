"""Changefeed checkpoint and resolved ts: the minimum over the changefeed's covered spans.

The checkpoint is a promise about the spans it *covers*: every change up to it is downstream
for each of them. Covered are all wanted spans except those stopped by an incident (a table
that cannot be replicated, a change its downstream refused for good): the operator sees those
listed with their reason and their own checkpoint, and the others go on.

No Lost Table: a covered span without a set, Absent (nobody replicates it) or in conflict holds
the checkpoint. Published values never go backwards: a lower computed value (a span re-added
from an older checkpoint, a new span, a stopped span resumed behind the published value)
leaves them unchanged, so a resumed span holds the published checkpoint until its own passes
it, and only then counts as covered again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from libs.scheduling.model import ChangefeedId, Span
from libs.scheduling.replication_set import SetLike, SetState


@dataclass(frozen=True, slots=True)
class CheckpointComputation:
    """The raw minimum over spans, or why there is none."""

    checkpoint_ts: int | None
    resolved_ts: int | None
    blocked_by: Span | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class CheckpointUpdate:
    checkpoint_ts: int
    resolved_ts: int
    advanced: bool
    blocked_by: Span | None = None
    reason: str | None = None


def compute_checkpoint(spans: Iterable[Span], sets: Mapping[Span, SetLike],
                       stopped: Collection[tuple[str, str, str, str]] = ()) -> CheckpointComputation:
    """The minimum over ``spans`` that are not in ``stopped`` (spans stopped by an incident,
    as ``(changefeed, source, database, table)``, which a ``Span`` equals)."""
    checkpoint: int | None = None
    resolved: int | None = None
    excluded = 0
    for span in spans:
        if span in stopped:
            excluded += 1
            continue
        rs = sets.get(span)
        if rs is None:
            return CheckpointComputation(None, None, span, "span has no replication set")
        if rs.error is not None:
            return CheckpointComputation(None, None, span, f"span is in conflict: {rs.error.detail}")
        if rs.state is SetState.ABSENT and rs.primary is None:
            return CheckpointComputation(None, None, span, "span is absent: no member replicates it")
        if checkpoint is None or rs.checkpoint_ts < checkpoint:
            checkpoint = rs.checkpoint_ts
        if resolved is None or rs.resolved_ts < resolved:
            resolved = rs.resolved_ts
    if checkpoint is None or resolved is None:
        reason = ("every table of the changefeed is stopped by an incident" if excluded
                  else "changefeed has no spans")
        return CheckpointComputation(None, None, None, reason)
    return CheckpointComputation(checkpoint, resolved)


class ChangefeedCheckpoint:
    """The published checkpoint and resolved ts of one changefeed."""

    def __init__(self, changefeed: ChangefeedId, checkpoint_ts: int = 0, resolved_ts: int = 0) -> None:
        self.changefeed = changefeed
        self.checkpoint_ts = checkpoint_ts
        self.resolved_ts = max(resolved_ts, checkpoint_ts)

    def advance(self, spans: Iterable[Span], sets: Mapping[Span, SetLike],
                stopped: Collection[tuple[str, str, str, str]] = ()) -> CheckpointUpdate:
        computed = compute_checkpoint(spans, sets, stopped)
        if computed.checkpoint_ts is None or computed.resolved_ts is None:
            return CheckpointUpdate(self.checkpoint_ts, self.resolved_ts, False,
                                    computed.blocked_by, computed.reason)
        before = (self.checkpoint_ts, self.resolved_ts)
        self.checkpoint_ts = max(self.checkpoint_ts, computed.checkpoint_ts)
        self.resolved_ts = max(self.resolved_ts, computed.resolved_ts, self.checkpoint_ts)
        return CheckpointUpdate(self.checkpoint_ts, self.resolved_ts,
                                (self.checkpoint_ts, self.resolved_ts) != before)


class CheckpointTracker:
    """Published checkpoints of many changefeeds."""

    def __init__(self) -> None:
        self.changefeeds: dict[ChangefeedId, ChangefeedCheckpoint] = {}

    def get(
        self, changefeed: ChangefeedId, checkpoint_ts: int = 0, resolved_ts: int = 0,
    ) -> ChangefeedCheckpoint:
        cp = self.changefeeds.get(changefeed)
        if cp is None:
            cp = self.changefeeds[changefeed] = ChangefeedCheckpoint(changefeed, checkpoint_ts, resolved_ts)
        return cp

    def advance(
        self, spans_by_changefeed: Mapping[ChangefeedId, Iterable[Span]], sets: Mapping[Span, SetLike],
        stopped: Collection[tuple[str, str, str, str]] = (),
    ) -> dict[ChangefeedId, CheckpointUpdate]:
        return {cf: self.get(cf).advance(spans, sets, stopped) for cf, spans in spans_by_changefeed.items()}


def spans_by_changefeed(spans: Iterable[Span]) -> dict[ChangefeedId, list[Span]]:
    grouped: dict[ChangefeedId, list[Span]] = {}
    for span in spans:
        grouped.setdefault(span.changefeed, []).append(span)
    return grouped
