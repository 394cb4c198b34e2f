"""The scheduler leader's decisions, as a plain class: the service feeds it the folded members,
replication, changefeed and schedule streams and the discovered spans, and appends the events
it returns to the schedule stream.

What it adds to ``libs.scheduling.Coordinator``:

- the wanted spans: every discovered span of every running changefeed, recorded per changefeed
  (``schedule.spans_changed``) before any task for them, because the replication-manager
  holds a changefeed's checkpoint until every wanted span has a set;
- the members the schedulers may use: alive (member stream) *and* reported to the current
  replication-manager leader (its ``rebuilt`` / ``member_ready`` records), draining when the
  member said so (SIGTERM) or an operator asked;
- tasks in flight: a task counts as running from the moment it is recorded until the
  replication-manager rejects it, or accepted it and its set settled (Replicating, Absent,
  removed or in conflict). A task nobody answered within ``task_timeout_s`` (the manager was
  down, or a new manager leader never read it) is dropped and planned again; a duplicate the
  manager then sees is rejected, never executed twice;
- operator requests: moves and rebalance recorded in the schedule stream until carried out or
  found impossible (``schedule.request_done``), so a new scheduler leader carries them on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from uuid import uuid4

from pydantic import BaseModel

from contracts.events.scheduling import (
    AddTableV1,
    DrainRequestedV1,
    MoveRequestedV1,
    MoveTableV1,
    RebalanceRequestedV1,
    RemoveTableV1,
    RequestDoneV1,
    ScheduleRequestV1,
    SetChangedV1,
    SpansChangedV1,
    TaskResultV1,
)
from libs.control.convert import span_of, span_ref
from libs.control.members import MembersState
from libs.control.replication_state import ReplicationState
from libs.control.schedule_state import ScheduleState
from libs.scheduling import (
    DEFAULT_MAX_ADDS_PER_MEMBER,
    DEFAULT_OPERATOR_PIN_S,
    AddTable,
    ChangefeedId,
    Coordinator,
    MemberId,
    MemberInfo,
    MoveTable,
    RemoveTable,
    ScheduleTask,
    SchedulingView,
    SetState,
    Span,
    WantedSpans,
    validate_move,
)


@dataclass
class Pending:
    task: ScheduleTask
    task_id: str
    emitted_at: float
    accepted: bool = False


class SchedulerCore:
    def __init__(self, state: ScheduleState, *, add_batch_size: int = 50, max_task_concurrency: int = 10,
                 balance_interval_s: float = 60.0, task_timeout_s: float = 30.0,
                 rng: random.Random | None = None,
                 max_adds_per_member: int = DEFAULT_MAX_ADDS_PER_MEMBER,
                 operator_pin_s: float = DEFAULT_OPERATOR_PIN_S) -> None:
        self.state = state
        self.coordinator = Coordinator(add_batch_size=add_batch_size,
                                       max_task_concurrency=max_task_concurrency,
                                       balance_interval_s=balance_interval_s, rng=rng,
                                       max_adds_per_member=max_adds_per_member,
                                       operator_pin_s=operator_pin_s)
        self.task_timeout_s = task_timeout_s
        self.pending: dict[Span, Pending] = {}
        self._by_id: dict[str, Span] = {}
        self.replication_epoch = 0
        self.tasks_emitted = 0
        self.tasks_timed_out = 0
        # What the last round's view was built from (see ``view``), and per changefeed the
        # discovered and recorded span lists last found equal (see ``spans_changes``).
        self._wanted_of: tuple[tuple[list[Span], ...], ReplicationState, WantedSpans] | None = None
        self._same: dict[ChangefeedId, tuple[Iterable[Span], list[Span]]] = {}

    # -- inputs from the replication stream ---------------------------------------------------

    def on_replication_epoch(self, epoch: int) -> None:
        """A new replication-manager leader: it reads the schedule stream from where its replay
        ended, so tasks recorded before may never be answered. Plan them again."""
        if epoch != self.replication_epoch:
            self.replication_epoch = epoch
            self.pending.clear()
            self._by_id.clear()

    def on_task_result(self, result: TaskResultV1) -> None:
        span = self._by_id.get(result.task_id)
        if span is None:
            return
        p = self.pending.get(span)
        if p is None or p.task_id != result.task_id:
            return
        if result.accepted:
            p.accepted = True
        else:
            self._drop(span)

    def on_set_changed(self, ev: SetChangedV1) -> None:
        span = span_of(ev.span)
        p = self.pending.get(span)
        if p is None or not p.accepted:
            return
        settled = ev.removed or ev.error is not None or ev.state in (SetState.REPLICATING, SetState.ABSENT)
        if settled:
            self._drop(span)

    def _drop(self, span: Span) -> None:
        p = self.pending.pop(span, None)
        if p is not None:
            self._by_id.pop(p.task_id, None)

    # -- the view -----------------------------------------------------------------------------

    @staticmethod
    def usable_members(members: MembersState, replication: ReplicationState,
                       state: ScheduleState) -> dict[MemberId, MemberInfo]:
        out: dict[MemberId, MemberInfo] = {}
        for m, rec in members.members.items():
            if replication.ready_members.get(m) != rec.incarnation:
                continue  # the replication-manager would refuse it work until it reported
            draining = rec.draining or state.drains.get(m) == rec.incarnation
            out[m] = MemberInfo(m, draining)
        return out

    def wanted(self, replication: ReplicationState) -> WantedSpans:
        """The wanted spans as one ``WantedSpans`` for as long as the recorded spans are the same
        lists (each ``spans_changed`` replaces its changefeed's): the basic scheduler then keeps
        its spans to add across rounds instead of comparing every wanted span with the sets each
        round, and no round builds a mapping of every span. Floors are read when an add asks."""
        lists = tuple(self.state.wanted.values())
        cached = self._wanted_of
        if (cached is None or cached[1] is not replication or len(cached[0]) != len(lists)
                or any(a is not b for a, b in zip(cached[0], lists, strict=True))):
            sets = replication.sets

            def floor(span: Span) -> int:
                found = sets.get(span)
                return found.checkpoint_ts if found is not None else 0

            spans = WantedSpans(dict.fromkeys(self.state.wanted_spans(), 0), floor=floor)
            cached = self._wanted_of = (lists, replication, spans)
        return cached[2]

    def view(self, members: MembersState, replication: ReplicationState) -> SchedulingView:
        wanted = self.wanted(replication)
        running: dict[Span, ScheduleTask] = {s: p.task for s, p in self.pending.items()}
        view = _PendingAwareView(self.usable_members(members, replication, self.state), wanted,
                                 replication.sets, running=running, index=replication.index,
                                 ready=replication.ready)
        view.expect(self.pending.values())
        return view

    # -- a round ------------------------------------------------------------------------------

    def spans_changes(self, discovered: Mapping[ChangefeedId, Iterable[Span]]) -> list[BaseModel]:
        """``spans_changed`` for every changefeed whose wanted spans differ from the record.
        ``discovered`` holds every running changefeed (empty lists included); a recorded
        changefeed missing from it is not running any more and wants nothing."""
        out: list[BaseModel] = []
        for cf in sorted(set(discovered) | set(self.state.wanted)):
            found, recorded = discovered.get(cf, ()), self.state.wanted.get(cf, [])
            same = self._same.get(cf)
            if same is not None and same[0] is found and same[1] is recorded:
                # Compared already: sorting thousands of spans each round was most of the
                # scheduler's CPU while a changefeed started.
                continue
            now = sorted(set(found))
            if now != recorded:
                self._same.pop(cf, None)
                out.append(SpansChangedV1(changefeed=cf, spans=[span_ref(s) for s in now]))
            else:
                self._same[cf] = (found, recorded)
        for cf in set(self._same) - set(discovered) - set(self.state.wanted):
            del self._same[cf]
        return out

    def round(self, members: MembersState, replication: ReplicationState, now: float,
              wall: float | None = None) -> list[BaseModel]:
        """One scheduling round over the current view; returns the events to record. ``now``
        is monotonic, ``wall`` the Unix time (the stream's event times are in it)."""
        for span, p in list(self.pending.items()):
            if now - p.emitted_at > self.task_timeout_s:
                self.tasks_timed_out += 1
                self._drop(span)
        coordinator = self.coordinator
        # Operator requests live in the stream; the coordinator's queues mirror them.
        coordinator.operator.pending = {span: MoveTable(span, dest, "operator")
                                        for span, dest in self.state.moves.items()}
        coordinator.rebalance.requested = self.state.rebalance
        coordinator.operator.failed.clear()  # reported as request_done events instead
        # Pins of operator moves handed out by an earlier leader too (in this leader's clock).
        # A pin that has run out is forgotten: what the state keeps (and every snapshot of it
        # carries) is the operator moves of the last pin's length, not every one ever made.
        wall = time.time() if wall is None else wall
        for span, at in list(self.state.operator_moved.items()):
            since = max(0.0, wall - at)
            if since < coordinator.operator.pin_s:
                coordinator.operator.moved_at.setdefault(span, now - since)
            else:
                del self.state.operator_moved[span]
        view = self.view(members, replication)
        tasks = coordinator.schedule(view, now)
        out: list[BaseModel] = []
        for task, reason in coordinator.last_rejected:
            if isinstance(task, MoveTable) and task.reason == "operator":
                out.append(RequestDoneV1(kind="move", span=span_ref(task.span), ok=False, reason=reason))
        if self.state.rebalance and not coordinator.rebalance.requested:
            out.append(RequestDoneV1(kind="rebalance", ok=True, reason="members are balanced"))
        for task in tasks:
            out.append(self._record(task, now))
        return out

    def _record(self, task: ScheduleTask, now: float) -> BaseModel:
        task_id = uuid4().hex
        self.pending[task.span] = Pending(task, task_id, now)
        self._by_id[task_id] = task.span
        self.tasks_emitted += 1
        if isinstance(task, AddTable):
            return AddTableV1(task_id=task_id, span=span_ref(task.span), member_id=task.member,
                              checkpoint_ts=task.checkpoint_ts, requested_by="scheduler/basic")
        if isinstance(task, MoveTable):
            return MoveTableV1(task_id=task_id, span=span_ref(task.span), dest=task.dest, reason=task.reason,
                               requested_by=f"scheduler/{task.reason or 'balance'}")
        assert isinstance(task, RemoveTable)
        return RemoveTableV1(task_id=task_id, span=span_ref(task.span), requested_by="scheduler/basic")

    # -- operator requests --------------------------------------------------------------------

    def request(self, req: ScheduleRequestV1, members: MembersState,
                replication: ReplicationState) -> tuple[str | None, BaseModel | None]:
        """Validate an operator request: (reason it is refused, None) or (None, event to record)."""
        if req.kind == "move":
            if req.span is None or not req.dest:
                return "a move needs a span and a destination member", None
            span = span_of(req.span)
            if not replication.ready:
                return "the replication-manager is rebuilding after a leader change; try again", None
            if span in self.state.moves:
                return f"a move of span {span.key} is already requested", None
            reason = validate_move(self.view(members, replication), span, req.dest)
            if reason is not None:
                return reason, None
            return None, MoveRequestedV1(span=req.span, dest=req.dest, requested_by=req.requested_by)
        if req.kind == "rebalance":
            return None, RebalanceRequestedV1(requested_by=req.requested_by)
        member = req.member_id or ""
        rec = members.members.get(member)
        if rec is None:
            return f"member {member!r} is not alive", None
        return None, DrainRequestedV1(member_id=member, incarnation=rec.incarnation,
                                      requested_by=req.requested_by)


class _PendingAwareView(SchedulingView):
    """Loads as they will be once the tasks in flight took effect.

    The sets come from the replication stream, a moment behind the tasks this scheduler has
    just recorded: without this, the next round sees the old loads and balances the same
    excess again (moving every span of an overloaded member instead of the excess)."""

    _delta: Mapping[MemberId, int] = {}

    def expect(self, pending: Iterable[Pending]) -> None:
        delta: dict[MemberId, int] = {}
        self._delta = delta
        pending = list(pending)
        tasked = {p.task.span for p in pending}
        for span in self.index.unstable:
            if span in tasked:
                continue
            # A secondary still preparing with no task of ours behind it (the task timed out,
            # or a previous scheduler leader recorded it): the span is not placed there, it
            # runs on its primary (or nowhere) until the prepare completes or is given up.
            rs = self.sets.get(span)
            if rs is None or rs.state is not SetState.PREPARE or rs.secondary is None:
                continue
            if rs.owner == rs.secondary:
                delta[rs.secondary] = delta.get(rs.secondary, 0) - 1
                if rs.primary is not None:
                    delta[rs.primary] = delta.get(rs.primary, 0) + 1
        for p in pending:
            task = p.task
            rs = self.sets.get(task.span)
            owner = rs.owner if rs is not None else None
            if isinstance(task, AddTable | MoveTable):
                dest = task.member if isinstance(task, AddTable) else task.dest
                if owner != dest:  # not visible in the sets yet
                    delta[dest] = delta.get(dest, 0) + 1
                    if owner is not None:
                        delta[owner] = delta.get(owner, 0) - 1

    def load(self, member: MemberId) -> int:
        return self.index.load(member) + self._delta.get(member, 0)
