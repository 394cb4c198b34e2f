"""The member side of the dispatch protocol: what a sink-worker's agent accepts and what its
tables go through. Pure state; the sink-worker starts and stops pipelines on the transitions.

    add-prepare:  Absent -> Preparing -> Prepared            (pipeline loads, writes nothing)
    add-commit:   Prepared -> Replicating                    (pipeline starts writing)
                  Absent/Preparing -> ... -> Replicating     (prepares first, then writes)
    remove:       Preparing/Prepared/Replicating -> Stopping -> Stopped -> (forgotten)

Fencing: a dispatch carries its leader's epoch, and the agent accepts only the newest epoch it
has seen (from dispatches and from heartbeats/announcements via ``observe_epoch``). A task of an
older epoch still in progress is void: it finishes what cannot be undone (stopping) but never
goes on to write (a prepared table does not auto-promote on a deposed leader's add-commit).
One task per span at a time: a different dispatch for a span that is busy is refused, and the
leader resends it after the next report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from libs.scheduling.model import MemberId, MemberReport, Span, TableState, TableStatus
from libs.scheduling.tasks import Dispatch, DispatchAction


class AgentVerdict(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    """The same task is already in progress or already done."""
    BUSY = "busy"
    """Another task for this span is in progress; refused, the leader will resend."""
    STALE_EPOCH = "stale-epoch"
    """From a leader older than the newest one seen; refused and counted."""
    WRONG_MEMBER = "wrong-member"
    IGNORED = "ignored"
    """Not applicable to the span's current state (e.g. add while Stopping)."""


@dataclass(frozen=True, slots=True)
class Transition:
    span: Span
    old: TableState
    new: TableState


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    verdict: AgentVerdict
    transitions: tuple[Transition, ...]
    status: TableStatus
    """The dispatch reply: the span's state after handling the dispatch."""


@dataclass(slots=True)
class AgentTable:
    span: Span
    state: TableState = TableState.ABSENT
    checkpoint_ts: int = 0
    resolved_ts: int = 0
    task: Dispatch | None = None
    wrote: bool = False
    """Reached Replicating in this life: a Stopping table that wrote may still be flushing."""

    @property
    def may_write(self) -> bool:
        return self.state is TableState.REPLICATING or (self.state is TableState.STOPPING and self.wrote)

    def status(self) -> TableStatus:
        return TableStatus(self.span, self.state, self.checkpoint_ts, self.resolved_ts)


class MemberAgentState:
    """One member's tables and the newest epoch it has seen.

    ``min_epoch``: the current leader epoch read from the election bucket at startup. Without it
    a restarted member would accept a deposed leader's dispatches until it hears from the new
    one. ``seq_start``: where report sequence numbers start; a member restarting under the same
    id must start above its previous life (wall-clock nanoseconds do), or the manager drops its
    reports as overtaken ones.
    """

    def __init__(self, member: MemberId, *, min_epoch: int = 0, seq_start: int = 0) -> None:
        self.member = member
        self.newest_epoch = min_epoch
        self.rejected_stale = 0
        self.rejected_busy = 0
        self._tables: dict[Span, AgentTable] = {}
        self._seq = seq_start

    @property
    def seq(self) -> int:
        """Sequence number of the last report produced."""
        return self._seq

    @property
    def tables(self) -> Mapping[Span, AgentTable]:
        return self._tables

    def state_of(self, span: Span) -> TableState:
        table = self._tables.get(span)
        return table.state if table is not None else TableState.ABSENT

    def status(self, span: Span) -> TableStatus:
        table = self._tables.get(span)
        return table.status() if table is not None else TableStatus(span, TableState.ABSENT)

    def observe_epoch(self, epoch: int) -> bool:
        """A heartbeat or announcement from a leader. False if that leader is stale."""
        if epoch < self.newest_epoch:
            self.rejected_stale += 1
            return False
        self.newest_epoch = epoch
        return True

    def _live_task(self, table: AgentTable) -> Dispatch | None:
        task = table.task
        if task is not None and task.epoch < self.newest_epoch:
            return None
        return task

    def _move(self, table: AgentTable, new: TableState, out: list[Transition]) -> None:
        out.append(Transition(table.span, table.state, new))
        table.state = new
        if new is TableState.REPLICATING:
            table.wrote = True

    def handle_dispatch(self, dispatch: Dispatch) -> AgentOutcome:
        if dispatch.member != self.member:
            return AgentOutcome(AgentVerdict.WRONG_MEMBER, (), self.status(dispatch.span))
        if dispatch.epoch < self.newest_epoch:
            self.rejected_stale += 1
            return AgentOutcome(AgentVerdict.STALE_EPOCH, (), self.status(dispatch.span))
        self.newest_epoch = dispatch.epoch
        span = dispatch.span
        table = self._tables.get(span)
        if table is None:
            table = AgentTable(span)
        task = self._live_task(table)
        preempts = (dispatch.action is DispatchAction.REMOVE
                    and table.state in (TableState.PREPARING, TableState.PREPARED))
        if task is not None and preempts and task.action is not dispatch.action:
            # A span that only prepares writes nothing, so a remove may cut its add short: it
            # is how the leader gives up a destination that never finishes preparing.
            task = None
        if task is not None:
            verdict = AgentVerdict.DUPLICATE if task.action is dispatch.action else AgentVerdict.BUSY
            if verdict is AgentVerdict.BUSY:
                self.rejected_busy += 1
            return AgentOutcome(verdict, (), table.status())
        table.task = None
        out: list[Transition] = []
        verdict = self._apply(table, dispatch, out)
        if table.state is not TableState.ABSENT:
            self._tables[span] = table
        return AgentOutcome(verdict, tuple(out), table.status())

    def _apply(self, table: AgentTable, d: Dispatch, out: list[Transition]) -> AgentVerdict:
        state = table.state
        if d.action is DispatchAction.REMOVE:
            if state in (TableState.PREPARING, TableState.PREPARED, TableState.REPLICATING):
                self._move(table, TableState.STOPPING, out)
                table.task = d
                return AgentVerdict.ACCEPTED
            if state is TableState.STOPPING:
                table.task = d
                return AgentVerdict.DUPLICATE
            return AgentVerdict.DUPLICATE  # Absent/Stopped: already done
        if state is TableState.STOPPING:
            return AgentVerdict.IGNORED
        commit = d.action is DispatchAction.ADD_COMMIT
        if state in (TableState.ABSENT, TableState.STOPPED):
            # A Stopped table has released everything; starting afresh is safe.
            table.wrote = False
            table.checkpoint_ts = d.checkpoint_ts
            table.resolved_ts = max(table.resolved_ts, d.checkpoint_ts)
            self._move(table, TableState.PREPARING, out)
            table.task = d
            return AgentVerdict.ACCEPTED
        if state is TableState.PREPARING:
            table.task = d
            return AgentVerdict.ACCEPTED
        if state is TableState.PREPARED:
            if not commit:
                return AgentVerdict.DUPLICATE
            self._start_writing(table, d, out)
            return AgentVerdict.ACCEPTED
        return AgentVerdict.DUPLICATE  # Replicating: nothing left to do

    def _start_writing(self, table: AgentTable, d: Dispatch, out: list[Transition]) -> None:
        # The leader's checkpoint may be ahead of where we prepared from (the old primary
        # kept writing meanwhile); either is a true checkpoint, so resume from the later one.
        table.checkpoint_ts = max(table.checkpoint_ts, d.checkpoint_ts)
        table.resolved_ts = max(table.resolved_ts, table.checkpoint_ts)
        self._move(table, TableState.REPLICATING, out)
        table.task = None

    def prepared(self, span: Span) -> list[Transition]:
        """The pipeline finished preparing ``span`` (sorted data ready from its checkpoint)."""
        table = self._tables.get(span)
        if table is None or table.state is not TableState.PREPARING:
            return []
        out: list[Transition] = []
        self._move(table, TableState.PREPARED, out)
        task = self._live_task(table)
        if task is not None and task.action is DispatchAction.ADD_COMMIT:
            self._start_writing(table, task, out)
        else:
            table.task = None
        return out

    def stopped(self, span: Span, checkpoint_ts: int | None = None) -> list[Transition]:
        """The pipeline of ``span`` has stopped and will write nothing more."""
        table = self._tables.get(span)
        if table is None or table.state is not TableState.STOPPING:
            return []
        if checkpoint_ts is not None:
            table.checkpoint_ts = max(table.checkpoint_ts, checkpoint_ts)
        out: list[Transition] = []
        self._move(table, TableState.STOPPED, out)
        table.task = None
        table.wrote = False
        return out

    def abandon(self, span: Span) -> list[Transition]:
        """The pipeline failed on its own (downstream error, bad event): stop the span without
        being told. The leader sees Stopping, then Stopped, and schedules the span again."""
        table = self._tables.get(span)
        if table is None or table.state not in (
                TableState.PREPARING, TableState.PREPARED, TableState.REPLICATING):
            return []
        out: list[Transition] = []
        self._move(table, TableState.STOPPING, out)
        table.task = None
        return out

    def update_progress(self, span: Span, checkpoint_ts: int, resolved_ts: int | None = None) -> None:
        """The pipeline applied everything up to ``checkpoint_ts`` downstream."""
        table = self._tables.get(span)
        if table is None or not table.may_write:
            return
        table.checkpoint_ts = max(table.checkpoint_ts, checkpoint_ts)
        resolved = checkpoint_ts if resolved_ts is None else resolved_ts
        table.resolved_ts = max(table.resolved_ts, resolved, table.checkpoint_ts)

    def reply(self, outcome: AgentOutcome) -> MemberReport:
        """The dispatch reply as a (partial) report."""
        self._seq += 1
        return MemberReport(self.member, self.newest_epoch, (outcome.status,), complete=False, seq=self._seq)

    def collect_report(self) -> MemberReport:
        """Heartbeat reply listing every span held. Stopped spans are reported once and then
        forgotten (the leader treats Stopped and Absent alike), so the table map only holds
        live pipelines."""
        self._seq += 1
        statuses = tuple(t.status() for t in self._tables.values())
        for span in [s for s, t in self._tables.items() if t.state is TableState.STOPPED]:
            del self._tables[span]
        return MemberReport(self.member, self.newest_epoch, statuses, complete=True, seq=self._seq)
