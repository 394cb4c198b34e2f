"""The replication manager's state: every span's ReplicationSet, the tasks in flight, and the
leader-change rebuild. Plain logic; the replication-manager service feeds it reports, member
events and schedule tasks, and sends the dispatches it returns.

Rebuild (TiCDC's Announce/Sync): a new leader builds nothing and dispatches nothing until every
member that was alive when it took over has sent a complete report *of this epoch* (or died).
A report of this epoch was written after the member learned about this leader, so it already
reflects every dispatch the previous leader got through, and the member rejects whatever the
previous leader sends later. Spans are then rebuilt from those reports, never from the old
leader's view alone: a member's own report is the only proof of what it is doing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from libs.scheduling.model import (
    ACTIVE_TABLE_STATES,
    InvalidTaskError,
    MemberId,
    MemberInfo,
    MemberReport,
    MultiplePrimaryError,
    Span,
    TableState,
    TableStatus,
)
from libs.scheduling.replication_set import ReplicationSet, SetIndex, SetState
from libs.scheduling.schedulers import DEFAULT_MAX_TASK_CONCURRENCY, SchedulingView
from libs.scheduling.tasks import AddTable, Dispatch, MoveTable, ScheduleTask


@dataclass(frozen=True, slots=True)
class TaskRejection:
    task: ScheduleTask
    reason: str


@dataclass(slots=True)
class TaskOutcome:
    accepted: list[ScheduleTask] = field(default_factory=list)
    rejected: list[TaskRejection] = field(default_factory=list)
    dispatches: list[Dispatch] = field(default_factory=list)


class ReplicationManager:
    """All ReplicationSets of one leader term.

    ``live_members``: members alive when this leader took over; it waits for a complete report
    from each. ``known_spans``: span -> (checkpoint_ts, resolved_ts) replayed from the domain
    log, so spans nobody reports keep their checkpoint (as Absent sets, to be re-added).
    """

    def __init__(
        self,
        epoch: int,
        *,
        live_members: Iterable[MemberId] = (),
        known_spans: Mapping[Span, tuple[int, int]] | None = None,
        max_task_concurrency: int = DEFAULT_MAX_TASK_CONCURRENCY,
        prepare_timeout_s: float | None = None,
    ) -> None:
        self.epoch = epoch
        self.max_task_concurrency = max_task_concurrency
        self.prepare_timeout_s = prepare_timeout_s
        # (span, secondary) -> when a tick first saw that secondary preparing the span.
        self._preparing_since: dict[tuple[Span, MemberId], float] = {}
        self.prepare_timeouts = 0
        self.sets: dict[Span, ReplicationSet] = {}
        self.index = SetIndex()
        self.running: dict[Span, ScheduleTask] = {}
        self.alive: set[MemberId] = set(live_members)
        self.reported: set[MemberId] = set()
        self.deposed = False
        self.stale_reports = 0
        self.unknown_member_reports = 0
        self._moves_in_flight = 0
        self._last_seq: dict[MemberId, int] = {}
        self._known_spans = dict(known_spans or {})
        self._awaiting: set[MemberId] = set(self.alive)
        self._pending: dict[MemberId, MemberReport] = {}
        self._ready = False
        self._startup: list[Dispatch] = []
        if not self._awaiting:
            self._startup = self._build()

    # -- readiness ----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def awaiting(self) -> frozenset[MemberId]:
        """Members whose first complete report this leader still waits for."""
        return frozenset(self._awaiting)

    def take_startup_dispatches(self) -> list[Dispatch]:
        """Dispatches produced when the rebuild finished inside the constructor."""
        out, self._startup = self._startup, []
        return out

    def _build(self) -> list[Dispatch]:
        by_span: dict[Span, dict[MemberId, TableStatus]] = {}
        for member, report in self._pending.items():
            for status in report.tables:
                if status.state in ACTIVE_TABLE_STATES:
                    by_span.setdefault(status.span, {})[member] = status
        out: list[Dispatch] = []
        for span in [*self._known_spans, *(s for s in by_span if s not in self._known_spans)]:
            checkpoint_ts, resolved_ts = self._known_spans.get(span, (0, 0))
            rs = ReplicationSet.from_reports(span, by_span.get(span, {}), epoch=self.epoch,
                                             checkpoint_ts=checkpoint_ts, resolved_ts=resolved_ts)
            self.sets[span] = rs
            out.extend(rs.tick())
            self._after(rs)
        self.reported.update(m for m, r in self._pending.items() if r.complete and m in self.alive)
        self._pending.clear()
        self._known_spans.clear()
        self._ready = True
        return out

    # -- member events ------------------------------------------------------------------------

    def handle_member_joined(self, member: MemberId) -> None:
        """The member service saw a new member; it gets work once it has reported."""
        self.alive.add(member)

    def handle_member_shutdown(self, member: MemberId) -> list[Dispatch]:
        self.alive.discard(member)
        self.reported.discard(member)
        self._last_seq.pop(member, None)
        if not self._ready:
            self._pending.pop(member, None)
            self._awaiting.discard(member)
            return self._build() if not self._awaiting else []
        out: list[Dispatch] = []
        for span in list(self.index.holders.get(member, ())):
            rs = self.sets[span]
            out.extend(rs.handle_member_shutdown(member))
            self._after(rs)
        return out

    def handle_report(self, report: MemberReport) -> list[Dispatch]:
        member = report.member
        if report.epoch > self.epoch:
            # A member has seen a newer leader: this one is deposed and must stop acting.
            self.deposed = True
            return []
        if report.epoch < self.epoch:
            self.stale_reports += 1
            return []
        if member not in self.alive:
            # Liveness is the member service's call; a report cannot resurrect a member it
            # declared dead (and it would have stopped writing when it lost its lease).
            self.unknown_member_reports += 1
            return []
        if report.seq is not None:
            last = self._last_seq.get(member)
            if last is not None and report.seq <= last:
                self.stale_reports += 1
                return []
            self._last_seq[member] = report.seq
        if not self._ready:
            self._buffer(report)
            if report.complete:
                self._awaiting.discard(member)
                if not self._awaiting:
                    return self._build()
            return []
        if report.complete:
            self.reported.add(member)
        out: list[Dispatch] = []
        seen: set[Span] | None = set() if report.complete else None
        for status in report.tables:
            if seen is not None:
                seen.add(status.span)
            rs = self.sets.get(status.span)
            if rs is None:
                if status.state not in ACTIVE_TABLE_STATES:
                    continue
                # A span we hold no set for (removed, or dispatched by a previous leader and
                # never replayed): track it so it gets adopted or stopped, never ignored.
                rs = self.sets[status.span] = ReplicationSet(status.span, epoch=self.epoch)
            out.extend(rs.handle_member_status(member, status.state, status.checkpoint_ts,
                                               status.resolved_ts))
            self._after(rs)
        if seen is not None:
            # A complete report that leaves out a span the member holds says it is Absent there.
            for span in [s for s in self.index.holders.get(member, ()) if s not in seen]:
                rs = self.sets[span]
                out.extend(rs.handle_member_status(member, TableState.ABSENT))
                self._after(rs)
        return out

    def _buffer(self, report: MemberReport) -> None:
        previous = self._pending.get(report.member)
        if report.complete or previous is None:
            self._pending[report.member] = report
            return
        merged = {s.span: s for s in previous.tables}
        merged.update((s.span, s) for s in report.tables)
        self._pending[report.member] = MemberReport(
            report.member, report.epoch, tuple(merged.values()), previous.complete, report.seq)

    # -- schedule tasks -----------------------------------------------------------------------

    def handle_tasks(self, tasks: Iterable[ScheduleTask]) -> TaskOutcome:
        outcome = TaskOutcome()
        for task in tasks:
            reason = self._reject_reason(task)
            if reason is not None:
                outcome.rejected.append(TaskRejection(task, reason))
                continue
            span = task.span
            rs = self.sets.get(span)
            if isinstance(task, AddTable):
                if rs is None:
                    rs = self.sets[span] = ReplicationSet(span, epoch=self.epoch,
                                                          checkpoint_ts=task.checkpoint_ts)
                msgs = rs.handle_add_table(task.member, task.checkpoint_ts)
            elif isinstance(task, MoveTable):
                assert rs is not None
                msgs = rs.handle_move_table(task.dest)
                self._moves_in_flight += 1
            else:
                assert rs is not None
                msgs = rs.handle_remove_table()
            self.running[span] = task
            outcome.accepted.append(task)
            outcome.dispatches.extend(msgs)
            self._after(rs)
        return outcome

    def _reject_reason(self, task: ScheduleTask) -> str | None:
        if not self._ready:
            waiting = ", ".join(sorted(self._awaiting))
            return f"rebuilding after a leader change: waiting for reports from {waiting}"
        span = task.span
        running = self.running.get(span)
        if running is not None:
            return f"span {span.key} already has a task in flight: {running}"
        rs = self.sets.get(span)
        if isinstance(task, AddTable):
            member_problem = self._member_problem(task.member)
            if member_problem is not None:
                return member_problem
            return rs.why_not_add(task.member) if rs is not None else None
        if rs is None:
            return f"span {span.key} is unknown"
        if isinstance(task, MoveTable):
            if self._moves_in_flight >= self.max_task_concurrency:
                return f"{self._moves_in_flight} moves already in flight (max {self.max_task_concurrency})"
            return self._member_problem(task.dest) or rs.why_not_move(task.dest)
        if rs.error is not None:
            return f"span {span.key} is blocked by a conflict: {rs.error.detail}"
        return None

    def _member_problem(self, member: MemberId) -> str | None:
        if member not in self.alive:
            return f"member {member} is not alive"
        if member not in self.reported:
            return f"member {member} has not reported its tables yet"
        return None

    def _after(self, rs: ReplicationSet) -> None:
        """Book-keeping after any input to ``rs``: indexes, finished tasks, removed sets."""
        span = rs.span
        if rs.removed:
            del self.sets[span]
            self.index.discard(span)
            self._finish(span)
            return
        self.index.update(rs)
        if span in self.running and (
                rs.error is not None or rs.state in (SetState.REPLICATING, SetState.ABSENT)):
            self._finish(span)

    def _finish(self, span: Span) -> None:
        task = self.running.pop(span, None)
        if isinstance(task, MoveTable):
            self._moves_in_flight -= 1

    # -- periodic and operator ----------------------------------------------------------------

    def tick(self, now: float | None = None) -> list[Dispatch]:
        """Resend what in-flight sets wait for; call every few seconds, not per message.

        With ``now`` (a monotonic clock) and ``prepare_timeout_s``, a secondary that is still
        not Prepared ``prepare_timeout_s`` after a tick first saw it preparing is given up
        (``ReplicationSet.abandon_prepare``): the set returns to Replicating or Absent, the
        task finishes, and the scheduler plans the span again. The deadline is measured from
        the first tick that saw the prepare, so it fires at most one tick period late."""
        if not self._ready:
            return []
        out: list[Dispatch] = []
        if now is not None and self.prepare_timeout_s is not None:
            out.extend(self._expire_prepares(now, self.prepare_timeout_s))
        given_up = {d.span for d in out}
        for span in [*self.index.unstable, *self.index.lingering]:
            rs = self.sets.get(span)
            if rs is None or span in given_up:
                continue
            out.extend(rs.tick())
            self._after(rs)
        return out

    def _expire_prepares(self, now: float, timeout_s: float) -> list[Dispatch]:
        out: list[Dispatch] = []
        seen: dict[tuple[Span, MemberId], float] = {}
        for span in self.index.unstable:
            rs = self.sets.get(span)
            if rs is None or rs.error is not None or rs.state is not SetState.PREPARE or rs.secondary is None:
                continue
            key = (span, rs.secondary)
            seen[key] = self._preparing_since.get(key, now)
        self._preparing_since = seen
        for (span, _member), since in list(seen.items()):
            if now - since < timeout_s:
                continue
            rs = self.sets[span]
            out.extend(rs.abandon_prepare())
            self.prepare_timeouts += 1
            del self._preparing_since[(span, _member)]
            self._after(rs)
        return out

    def prepare_deadlines(self, now: float) -> dict[Span, tuple[MemberId, float]]:
        """Spans whose secondary is preparing, with it and the seconds left before it is given
        up (for operators: a destination that does not finish its prepare is visible)."""
        if self.prepare_timeout_s is None:
            return {}
        return {span: (member, round(self.prepare_timeout_s - (now - since), 3))
                for (span, member), since in self._preparing_since.items()}

    def resolve_conflict(self, span: Span, keep: MemberId) -> list[Dispatch]:
        rs = self.sets.get(span)
        if rs is None:
            raise InvalidTaskError(f"span {span.key} is unknown")
        out = rs.resolve_conflict(keep)
        self._after(rs)
        return out

    def span_checkpoints(self) -> dict[Span, tuple[int, int]]:
        """Best known (checkpoint_ts, resolved_ts) per span: what to persist, and what the next
        leader passes as ``known_spans``. While still rebuilding it is what was replayed, so a
        leader deposed mid-rebuild hands on everything it was given."""
        if self._ready:
            return {span: (rs.checkpoint_ts, rs.resolved_ts) for span, rs in self.sets.items()}
        return dict(self._known_spans)

    @property
    def errors(self) -> list[MultiplePrimaryError]:
        """Spans in conflict, for operators: several members may be writing them."""
        return [rs.error for span in self.index.unstable
                if (rs := self.sets.get(span)) is not None and rs.error is not None]

    def view(self, members: Mapping[MemberId, MemberInfo], wanted: Mapping[Span, int]) -> SchedulingView:
        """A scheduling view over this manager's live indexes (no copy of the sets)."""
        usable = {m: info for m, info in members.items() if m in self.alive and m in self.reported}
        return SchedulingView(usable, wanted, self.sets, running=self.running,
                              index=self.index, ready=self._ready)
