"""The replication-manager leader's state and decisions, as a plain class.

``ReplicationCore`` wraps ``libs.scheduling.ReplicationManager`` (the sets, the two-phase
dispatch, the rebuild) with what the service needs around it:

- member processes: the manager knows member ids; the core also knows each live member's
  incarnation (from the members stream) and ignores heartbeats and dispatch answers of any
  other incarnation: a restarted worker is a new member, and what its previous life said or
  answered late must not move a set;
- what to record: after every input it compares the sets it touched with what the log last
  recorded for them and returns ``replication.set_changed`` events for the differences (not for
  progress alone); ``replication.rebuilt`` once the rebuild is done and ``member_ready`` for
  every member that reports afterwards, so the scheduler only plans for members the manager
  will accept; a ``replication.task_result`` for every schedule task;
- changefeed checkpoints: the minimum over *every wanted span* of the changefeed (the
  schedule stream's ``spans_changed``), never over the sets alone, so a span without a set
  holds the checkpoint (No Lost Table); the published values are seeded from the log and never
  go backwards. Spans stopped by an incident (the changefeeds log's open ``table.stopped``,
  ``stopped``) are left out: the checkpoint covers the other tables, and the api lists the
  stopped ones (``libs.scheduling.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel

from contracts.events.scheduling import (
    AddTableV1,
    CheckpointAdvancedV1,
    DispatchResponseV1,
    MemberHeartbeatV3,
    MemberReadyV1,
    MoveTableV1,
    RebuiltV1,
    RemoveTableV1,
    TaskResultV1,
)
from libs.control.convert import answer_report, heartbeat_report, span_of, span_ref
from libs.control.replication_state import SetSummary
from libs.scheduling import (
    AddTable,
    ChangefeedId,
    CheckpointTracker,
    Dispatch,
    MemberId,
    MemberReport,
    MoveTable,
    RemoveTable,
    ReplicationManager,
    ScheduleTask,
    Span,
    compute_checkpoint,
)

TaskEvent = AddTableV1 | MoveTableV1 | RemoveTableV1


@dataclass
class Output:
    dispatches: list[Dispatch] = field(default_factory=list)
    events: list[BaseModel] = field(default_factory=list)

    def extend(self, other: Output) -> None:
        self.dispatches.extend(other.dispatches)
        self.events.extend(other.events)


def task_of(ev: TaskEvent) -> ScheduleTask:
    span = span_of(ev.span)
    if isinstance(ev, AddTableV1):
        return AddTable(span, ev.member_id, ev.checkpoint_ts)
    if isinstance(ev, MoveTableV1):
        return MoveTable(span, ev.dest, ev.reason)
    return RemoveTable(span)


class ReplicationCore:
    def __init__(self, epoch: int, *, alive: Mapping[MemberId, str],
                 known_spans: Mapping[Span, tuple[int, int]] | None = None,
                 recorded: Mapping[Span, SetSummary] | None = None,
                 checkpoints: Mapping[ChangefeedId, tuple[int, int]] | None = None,
                 wanted: Mapping[ChangefeedId, Iterable[Span]] | None = None,
                 max_task_concurrency: int = 10, started_at: float = 0.0,
                 prepare_timeout_s: float | None = None,
                 stopped: Callable[[], Collection[tuple[str, str, str, str]]] = tuple) -> None:
        self.epoch = epoch
        self.stopped = stopped
        """The spans an open incident stops, now (the changefeeds log, as the api shows them)."""
        self.incarnations: dict[MemberId, str] = dict(alive)
        self.manager = ReplicationManager(epoch, live_members=self.incarnations, known_spans=known_spans,
                                          max_task_concurrency=max_task_concurrency,
                                          prepare_timeout_s=prepare_timeout_s)
        self._recorded: dict[Span, tuple[object, ...]] = {s: v.shape for s, v in (recorded or {}).items()}
        self.tracker = CheckpointTracker()
        for cf, (checkpoint_ts, resolved_ts) in (checkpoints or {}).items():
            self.tracker.get(cf, checkpoint_ts, resolved_ts)
        self.wanted: dict[ChangefeedId, list[Span]] = {cf: list(s) for cf, s in (wanted or {}).items()}
        self.started_at = started_at
        self.rebuilt_recorded = False
        self._ready_members: set[MemberId] = set()
        self.ignored_reports = 0
        self.pending_startup = self.manager.take_startup_dispatches()

    # -- helpers ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.manager.ready

    def _changes(self, spans: Iterable[Span]) -> list[BaseModel]:
        out: list[BaseModel] = []
        sets = self.manager.sets
        for span in spans:
            rs = sets.get(span)
            if rs is None:
                if span in self._recorded:
                    del self._recorded[span]
                    out.append(SetSummary.removed_set(span).event())
                continue
            summary = SetSummary.of(rs)
            shape = summary.shape
            if self._recorded.get(span) != shape:
                self._recorded[span] = shape
                out.append(summary.event())
        return out

    def _after(self, touched: Iterable[Span], dispatches: list[Dispatch], now: float) -> Output:
        out = Output(dispatches=list(dispatches))
        if not self.ready:
            return out
        if not self.rebuilt_recorded:
            # The rebuild just finished: record every set as rebuilt (and forget recorded sets
            # nobody holds any more), then say so.
            # Each span once (nearly every span is in both): the second look was a no-op that
            # cost a summary per span, 100,000 of them at scale.
            out.events.extend(self._changes(dict.fromkeys([*self.manager.sets, *self._recorded])))
            self._ready_members = set(self.manager.reported)
            out.events.append(RebuiltV1(
                members={m: self.incarnations.get(m, "") for m in sorted(self._ready_members)},
                sets=len(self.manager.sets), waited_s=round(max(0.0, now - self.started_at), 3)))
            self.rebuilt_recorded = True
            if self.pending_startup:
                out.dispatches.extend(self.pending_startup)
                self.pending_startup = []
            return out
        spans = dict.fromkeys(touched)
        for d in dispatches:
            spans[d.span] = None
        out.events.extend(self._changes(spans))
        for m in sorted(self.manager.reported - self._ready_members):
            self._ready_members.add(m)
            out.events.append(MemberReadyV1(member_id=m, incarnation=self.incarnations.get(m, "")))
        return out

    def start(self, now: float) -> Output:
        """What to record and send right after taking over: everything at once when no member
        was alive to wait for (the rebuild finished in the constructor), else nothing yet."""
        return self._after((), [], now)

    def _report(self, report: MemberReport, now: float) -> Output:
        touched: list[Span] = [s.span for s in report.tables]
        if report.complete and self.ready:
            touched.extend(self.manager.index.holders.get(report.member, ()))
        dispatches = self.manager.handle_report(report)
        return self._after(touched, dispatches, now)

    # -- inputs -------------------------------------------------------------------------------

    def on_heartbeat(self, hb: MemberHeartbeatV3, now: float) -> Output:
        if self.incarnations.get(hb.member_id) != hb.incarnation:
            self.ignored_reports += 1  # not the process the member service vouches for
            return Output()
        return self._report(heartbeat_report(hb), now)

    def on_answer(self, answer: DispatchResponseV1, now: float) -> Output:
        if self.incarnations.get(answer.member_id) != answer.incarnation:
            self.ignored_reports += 1
            return Output()
        return self._report(answer_report(answer), now)

    def on_member_joined(self, member: MemberId, incarnation: str, now: float) -> Output:
        out = Output()
        old = self.incarnations.get(member)
        if old == incarnation:
            return out
        if old is not None:
            # The left of the old process was not seen (yet): it is gone all the same.
            out.extend(self.on_member_left(member, old, now))
        self.incarnations[member] = incarnation
        self.manager.handle_member_joined(member)
        return out

    def on_member_left(self, member: MemberId, incarnation: str, now: float) -> Output:
        if self.incarnations.get(member) != incarnation:
            return Output()
        del self.incarnations[member]
        self._ready_members.discard(member)
        held = list(self.manager.index.holders.get(member, ()))
        dispatches = self.manager.handle_member_shutdown(member)
        return self._after(held, dispatches, now)

    def on_spans_changed(self, changefeed: ChangefeedId, spans: Iterable[Span]) -> None:
        wanted = sorted(spans)
        if wanted:
            self.wanted[changefeed] = wanted
        else:
            self.wanted.pop(changefeed, None)

    def on_task(self, ev: TaskEvent, now: float) -> Output:
        task = task_of(ev)
        outcome = self.manager.handle_tasks([task])
        accepted = bool(outcome.accepted)
        reason = outcome.rejected[0].reason if outcome.rejected else ""
        out = self._after([task.span], outcome.dispatches, now)
        out.events.insert(0, TaskResultV1(task_id=ev.task_id, span=span_ref(task.span), accepted=accepted,
                                          reason=reason))
        return out

    def tick(self, now: float) -> Output:
        index = self.manager.index
        touched = [*index.unstable, *index.lingering]
        return self._after(touched, self.manager.tick(now), now)

    def checkpoint_events(self) -> list[CheckpointAdvancedV1]:
        """Advances of changefeed checkpoints since the last call (none while rebuilding)."""
        if not self.ready:
            return []
        out: list[CheckpointAdvancedV1] = []
        sets = self.manager.sets
        stopped = self.stopped()
        for cf, spans in sorted(self.wanted.items()):
            update = self.tracker.get(cf).advance(spans, sets, stopped)
            if update.advanced:
                out.append(CheckpointAdvancedV1(changefeed=cf, checkpoint_ts=update.checkpoint_ts,
                                                resolved_ts=update.resolved_ts))
        return out

    def blocked(self) -> dict[ChangefeedId, str]:
        """Why each changefeed's checkpoint cannot move right now (for operators)."""
        out: dict[ChangefeedId, str] = {}
        stopped = self.stopped()
        for cf, spans in self.wanted.items():
            computed = compute_checkpoint(spans, self.manager.sets, stopped)
            if computed.reason is not None:
                where = f" ({computed.blocked_by.key})" if computed.blocked_by is not None else ""
                out[cf] = computed.reason + where
        return out
