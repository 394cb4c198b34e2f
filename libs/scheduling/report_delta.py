"""Which heartbeat a member sends: its complete report, or only what changed since the last one.

A heartbeat listed every span the member holds, five times a second: at a few hundred idle
spans that was half of an idle sink-worker's CPU to build and encode and all of an idle
replication-manager leader's to decode and handle (BENCHMARKS.md, "Quiet spans"), while a span's
status changes about once a round (a second when idle). So a member sends its complete report
about once a ``complete_every_s`` and, in between, a partial one: the spans whose status differs
from the last complete report, and every span an earlier partial one named since. Partial
reports are cumulative since that complete one, so the newest supersedes the older ones, and a
complete one supersedes everything before it (the replication-manager keeps one of each per
member waiting, ``LatestHeartbeats``).

A complete report is due, besides the interval, on the first heartbeat, when the epoch the
member has seen changed (a new leader rebuilds from complete reports only), when a span of the
last complete report, or one a partial report named since, is gone (a stopped span is reported
once and then forgotten; a partial report cannot say "absent"), and when the caller forces one
(draining, leaving). A lost partial or complete heartbeat (core NATS) delays what it said by at
most the interval.

A partial report equal to the last one sent (nothing changed since: most heartbeats of an idle
member, whose quiet spans move once a round) is not sent again: ``cut`` gives ``None`` for the
tables and the heartbeat is liveness only (``HEARTBEAT_UNCHANGED_HEADER``), which the
replication-manager does not handle as a report. What it last handled already says all of it;
had that one been lost, the next complete report says it, as for any lost heartbeat.

Progress of a quiet span (``quiet``: one that only followed its source's resolved ts this
round, with nothing to apply; ``services/sink_worker/round/quiet.py``) waits for the next
complete report: at idle every span moves so once a round, and naming each one in the partial
reports after every round was most of what an idle worker with thousands of spans sent and the
replication-manager decoded. A changefeed's checkpoint over idle tables then moves with the
complete reports, about once a ``complete_every_s``; a change of state, and the progress of a
span that applied something, still goes out in the next heartbeat.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from libs.scheduling.model import Span, TableState, TableStatus

_Key = tuple[TableState, int, int]


@dataclass
class ReportDelta:
    complete_every_s: float = 1.0
    _base: dict[Span, _Key] | None = field(default=None, init=False)
    _base_epoch: int = field(default=-1, init=False)
    _base_at: float = field(default=0.0, init=False)
    _last_partial: dict[Span, _Key] = field(default_factory=dict, init=False)
    """What the last partial report sent said (empty after a complete one: a partial report
    naming nothing says nothing new either)."""
    _named: set[Span] = field(default_factory=set, init=False)
    """Spans a partial report named since the last complete one: named in every later partial
    one too, so the newest partial one overrides whatever an older one said (a status that
    changed and changed back)."""

    def cut(self, tables: Sequence[TableStatus], epoch: int, now: float,
            force: bool = False, quiet: Collection[Span] = ()) -> tuple[bool, list[TableStatus] | None]:
        """``(complete, the statuses to send)`` for a heartbeat of ``tables`` (every span held);
        ``(False, None)``: the partial report would be the last one sent again."""
        current = {t.span: (t.state, t.checkpoint_ts, t.resolved_ts) for t in tables}
        base = self._base
        if (force or base is None or epoch != self._base_epoch or self.complete_every_s <= 0
                or now - self._base_at >= self.complete_every_s
                or any(s not in current for s in base) or any(s not in current for s in self._named)):
            self._base, self._base_epoch, self._base_at = current, epoch, now
            self._named = set()
            self._last_partial = {}
            return True, list(tables)
        changed = [t for t in tables if t.span in self._named or _moved(base.get(t.span), current[t.span],
                                                                          t.span in quiet)]
        said = {t.span: current[t.span] for t in changed}
        if said == self._last_partial:
            return False, None
        self._named.update(said)
        self._last_partial = said
        return False, changed


def _moved(was: _Key | None, now: _Key, quiet: bool) -> bool:
    """Whether a partial report names the span: its status changed since the complete report,
    beyond a quiet span's progress (which waits for the next complete one)."""
    if was == now:
        return False
    return not (quiet and was is not None and was[0] == now[0])
