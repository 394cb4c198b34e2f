"""One ReplicationSet per span: the two-phase scheduling state machine of the replication manager.

Follows TiCDC scheduler v3 (``cdc/scheduler/internal/v3/replication/replication_set.go``):

    AddTable                         MoveTable
    Absent ──> Prepare ──> Commit ──> Replicating ──> Prepare (dest prepares, primary keeps writing)
                                          │
                                          └─ RemoveTable ──> Removing ──> (removed)

Every input returns the dispatches to send and changes nothing but the set itself. The safety
rule behind every branch: a member is told to write (add-commit) only when no other member may
be writing the span, i.e. there is no primary left and no *undetermined* member (one that is
Stopping, or that holds the span without a role we gave it). Where we deviate from TiCDC it is
to keep that rule:

- a primary that reports Stopping is demoted to undetermined instead of being forgotten (TiCDC
  clears it, and could then promote the secondary while the old primary still flushes);
- promotion after the old primary stopped also waits for undetermined members (TiCDC only
  checks them on the secondary's Prepared report);
- a member we gave no role that reports holding the span becomes undetermined and is asked to
  remove it (TiCDC ignores it);
- a Replicating report from a member that is not the primary, while another member may be
  writing, puts the set in conflict (``error``) instead of being logged and ignored. Nothing is
  promoted or removed until an operator resolves it or the members' own reports clear it;
- remove is accepted in every state (TiCDC: only Replicating), since removing never promotes.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Concatenate, NamedTuple, ParamSpec, Protocol, TypeVar

from libs.scheduling.model import (
    ACTIVE_TABLE_STATES,
    GONE_TABLE_STATES,
    InconsistentSetError,
    InvalidTaskError,
    MemberId,
    MultiplePrimaryError,
    Span,
    TableState,
    TableStatus,
)
from libs.scheduling.tasks import Dispatch, DispatchAction


class SetState(StrEnum):
    ABSENT = "absent"
    PREPARE = "prepare"
    COMMIT = "commit"
    REPLICATING = "replicating"
    REMOVING = "removing"


class Role(StrEnum):
    PRIMARY = "primary"
    """Writes the span downstream (or did until it reports Stopped/Absent)."""
    SECONDARY = "secondary"
    """Prepares the span to take it over; writes nothing until promoted."""
    UNDETERMINED = "undetermined"
    """Holds the span in a way we cannot vouch for (Stopping, or never given a role): it may
    still write, so nobody is promoted until it reports Stopped/Absent or dies."""


_TRANSITIONAL = frozenset({SetState.PREPARE, SetState.COMMIT, SetState.REMOVING})

# What a member's role implies it may be doing when we have no report from it. Used when the
# set enters conflict and every member must be judged by what it could be doing.
_ASSUMED_STATE = {
    Role.PRIMARY: TableState.REPLICATING,
    Role.SECONDARY: TableState.PREPARING,
    Role.UNDETERMINED: TableState.STOPPING,
}


_P = ParamSpec("_P")
_R = TypeVar("_R")


_Handler = Callable[Concatenate["ReplicationSet", _P], _R]


def _checked(handler: _Handler[_P, _R]) -> _Handler[_P, _R]:
    """Check the set's invariants after every step, in production as in the tests (TiCDC checks
    them on every poll): a set that broke one raises ``InconsistentSetError`` at the step that
    broke it, instead of dispatching from a state no handler was written for."""

    @functools.wraps(handler)
    def step(rs: ReplicationSet, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        out = handler(rs, *args, **kwargs)
        rs.check_invariants()
        return out

    return step


class ReplicationSet:
    """The replication state of one span across members.

    Invariants (``check_invariants``, after every handler and rebuild): at most one primary and
    it is ``primary``; at most one secondary and it is ``secondary``; Absent has neither;
    Replicating has a primary and no secondary; Prepare has a secondary; Commit has a secondary
    or a (promoted) primary; a set in conflict trusts nobody: every member is undetermined.
    """

    __slots__ = (
        "_resolve_keep",
        "checkpoint_ts",
        "epoch",
        "error",
        "members",
        "primary",
        "removed",
        "reported",
        "resolved_ts",
        "secondary",
        "span",
        "state",
    )

    def __init__(self, span: Span, *, epoch: int, checkpoint_ts: int = 0, resolved_ts: int = 0) -> None:
        self.span = span
        self.epoch = epoch
        self.state = SetState.ABSENT
        self.primary: MemberId | None = None
        self.secondary: MemberId | None = None
        self.members: dict[MemberId, Role] = {}
        # Last state each member with a role reported. Lets a promotion happen as soon as the
        # last undetermined member clears, and lets tick() resend only what is still missing.
        self.reported: dict[MemberId, TableState] = {}
        self.checkpoint_ts = checkpoint_ts
        self.resolved_ts = max(resolved_ts, checkpoint_ts)
        self.removed = False
        self.error: MultiplePrimaryError | None = None
        self._resolve_keep: MemberId | None = None

    # -- construction after a leader change ---------------------------------------------------

    @classmethod
    def from_reports(
        cls,
        span: Span,
        statuses: Mapping[MemberId, TableStatus],
        *,
        epoch: int,
        checkpoint_ts: int = 0,
        resolved_ts: int = 0,
    ) -> ReplicationSet:
        """Rebuild the set from what live members report (the new leader's Sync phase).

        Replicating -> primary; Prepared/Preparing -> secondary (a Prepared one is preferred;
        any extra one becomes undetermined and is asked to remove); Stopping -> undetermined;
        Absent/Stopped -> not a holder. Two members Replicating -> the set is in conflict.
        ``checkpoint_ts`` is the floor the caller knows from its replayed log.
        """
        rs = cls(span, epoch=epoch, checkpoint_ts=checkpoint_ts, resolved_ts=resolved_ts)
        for status in statuses.values():
            if status.state in ACTIVE_TABLE_STATES:
                # Every holder's checkpoint was true when reported (a secondary's is the start
                # point a previous leader gave it), so the max is a safe floor.
                rs._advance(status.checkpoint_ts, status.resolved_ts)
        rs._assign_roles({m: s.state for m, s in statuses.items()})
        rs.check_invariants()
        return rs

    def _assign_roles(self, states: Mapping[MemberId, TableState]) -> None:
        self.primary = self.secondary = None
        self._resolve_keep = None
        if len(states) == 1:
            # The common case of a rebuild (one member replicating the span), without the
            # general path's sorting and filtering: 100,000 spans take it once each.
            ((member, state),) = states.items()
            if state is TableState.REPLICATING:
                self.error = None
                self.reported = {member: state}
                self.members = {member: Role.PRIMARY}
                self.primary = member
                self.state = SetState.REPLICATING
                return
        self.members = {}
        self.reported = {}
        active = {m: s for m, s in sorted(states.items()) if s in ACTIVE_TABLE_STATES}
        writers = [m for m, s in active.items() if s is TableState.REPLICATING]
        if len(writers) > 1:
            self.error = MultiplePrimaryError(
                self.span, tuple(writers), "more than one member reports Replicating")
            self.reported = active
            self.members = dict.fromkeys(active, Role.UNDETERMINED)
            self.state = SetState.ABSENT
            return
        self.error = None
        self.reported = active
        if writers:
            self.primary = writers[0]
            self.members[self.primary] = Role.PRIMARY
        prepared = [m for m, s in active.items() if s is TableState.PREPARED]
        preparing = [m for m, s in active.items() if s is TableState.PREPARING]
        for m in prepared + preparing:
            if self.secondary is None:
                self.secondary = m
                self.members[m] = Role.SECONDARY
            else:
                self.members[m] = Role.UNDETERMINED
        for m, s in active.items():
            if s is TableState.STOPPING:
                self.members[m] = Role.UNDETERMINED
        if self.secondary is not None:
            prepared_secondary = active[self.secondary] is TableState.PREPARED
            self.state = SetState.COMMIT if prepared_secondary else SetState.PREPARE
        elif self.primary is not None:
            self.state = SetState.REPLICATING
        else:
            self.state = SetState.ABSENT

    # -- helpers ------------------------------------------------------------------------------

    def _send(self, member: MemberId, action: DispatchAction) -> Dispatch:
        return Dispatch(member, self.span, action, self.checkpoint_ts, self.epoch)

    def _advance(self, checkpoint_ts: int | None, resolved_ts: int | None) -> None:
        # max(): a stale or reordered report must never move a checkpoint backwards.
        if checkpoint_ts is None:
            return
        if checkpoint_ts > self.checkpoint_ts:
            self.checkpoint_ts = checkpoint_ts
        resolved = checkpoint_ts if resolved_ts is None else resolved_ts
        if resolved > self.resolved_ts:
            self.resolved_ts = resolved
        if self.resolved_ts < self.checkpoint_ts:
            self.resolved_ts = self.checkpoint_ts

    def _drop(self, member: MemberId) -> None:
        self.members.pop(member, None)
        self.reported.pop(member, None)
        if self.primary == member:
            self.primary = None
        if self.secondary == member:
            self.secondary = None

    def _demote(self, member: MemberId) -> None:
        self.members[member] = Role.UNDETERMINED
        if self.primary == member:
            self.primary = None
        if self.secondary == member:
            self.secondary = None

    def _has_undetermined(self) -> bool:
        return Role.UNDETERMINED in self.members.values()

    @property
    def owner(self) -> MemberId | None:
        """Where the span will run once in-flight work settles (for load accounting)."""
        if self.removed or self.error is not None or self.state in (SetState.ABSENT, SetState.REMOVING):
            return None
        return self.secondary if self.secondary is not None else self.primary

    def why_not_add(self, member: MemberId) -> str | None:
        if self.removed:
            return f"span {self.span.key} has been removed"
        if self.error is not None:
            return f"span {self.span.key} is blocked by a conflict: {self.error.detail}"
        if self.state is not SetState.ABSENT:
            return f"span {self.span.key} is {self.state}, only an Absent span can be added"
        if member in self.members:
            return f"member {member} still holds span {self.span.key} (undetermined)"
        return None

    def why_not_move(self, dest: MemberId) -> str | None:
        if self.removed:
            return f"span {self.span.key} has been removed"
        if self.error is not None:
            return f"span {self.span.key} is blocked by a conflict: {self.error.detail}"
        if self.state is not SetState.REPLICATING:
            return f"span {self.span.key} is {self.state}, only a Replicating span can be moved"
        if dest == self.primary:
            return f"span {self.span.key} already replicates on {dest}"
        if dest in self.members:
            return f"member {dest} still holds span {self.span.key} (undetermined)"
        return None

    def check_invariants(self) -> None:
        # Runs after every step: one pass over the set's few members, and the message is only
        # put together when something is wrong.
        primary = secondary = None
        primaries = secondaries = 0
        for m, r in self.members.items():
            if r is Role.PRIMARY:
                primary = m
                primaries += 1
            elif r is Role.SECONDARY:
                secondary = m
                secondaries += 1
        state = self.state
        if (primaries > 1 or secondaries > 1 or primary != self.primary or secondary != self.secondary
                or (self.error is not None and bool(self.primary or self.secondary))
                or (self.error is None and (
                    (state is SetState.ABSENT and bool(self.primary or self.secondary))
                    or (state is SetState.REPLICATING and (self.primary is None or bool(self.secondary)))
                    or (state is SetState.PREPARE and self.secondary is None)
                    or (state is SetState.COMMIT and self.secondary is None and self.primary is None)))
                or (self.removed and bool(self.members)) or self.resolved_ts < self.checkpoint_ts):
            raise InconsistentSetError(f"span {self.span.key} ({self.state}): " + "; ".join(self._problems()))

    def _problems(self) -> list[str]:
        primaries = [m for m, r in self.members.items() if r is Role.PRIMARY]
        secondaries = [m for m, r in self.members.items() if r is Role.SECONDARY]
        problems: list[str] = []
        if len(primaries) > 1:
            problems.append(f"several primaries {primaries}")
        if (primaries[0] if primaries else None) != self.primary:
            problems.append(f"primary {self.primary} but roles say {primaries}")
        if len(secondaries) > 1:
            problems.append(f"several secondaries {secondaries}")
        if (secondaries[0] if secondaries else None) != self.secondary:
            problems.append(f"secondary {self.secondary} but roles say {secondaries}")
        if self.error is not None:
            if self.primary or self.secondary:
                problems.append("a set in conflict must not trust a primary or secondary")
        elif self.state is SetState.ABSENT and (self.primary or self.secondary):
            problems.append("absent with a primary or secondary")
        elif self.state is SetState.REPLICATING and (self.primary is None or self.secondary):
            problems.append("replicating needs exactly a primary")
        elif self.state is SetState.PREPARE and self.secondary is None:
            problems.append("prepare without a secondary")
        elif self.state is SetState.COMMIT and self.secondary is None and self.primary is None:
            problems.append("commit with neither secondary nor primary")
        if self.removed and self.members:
            problems.append("removed but members remain")
        if self.resolved_ts < self.checkpoint_ts:
            problems.append("resolved ts below checkpoint ts")
        return problems

    # -- scheduler inputs ---------------------------------------------------------------------

    @_checked
    def handle_add_table(self, member: MemberId, checkpoint_ts: int) -> list[Dispatch]:
        """Absent -> Prepare: ``member`` prepares as secondary. Ignored in any other state."""
        if self.why_not_add(member) is not None:
            return []
        self._advance(checkpoint_ts, checkpoint_ts)
        self.members[member] = Role.SECONDARY
        self.secondary = member
        self.reported.pop(member, None)
        self.state = SetState.PREPARE
        return [self._send(member, DispatchAction.ADD_PREPARE)]

    @_checked
    def handle_move_table(self, dest: MemberId) -> list[Dispatch]:
        """Replicating -> Prepare: ``dest`` prepares while the primary keeps writing."""
        if self.why_not_move(dest) is not None:
            return []
        self.members[dest] = Role.SECONDARY
        self.secondary = dest
        self.reported.pop(dest, None)
        self.state = SetState.PREPARE
        return [self._send(dest, DispatchAction.ADD_PREPARE)]

    @_checked
    def handle_remove_table(self) -> list[Dispatch]:
        """Any state -> Removing (or removed at once when nobody holds the span)."""
        if self.removed or self.error is not None:
            return []
        if not self.members:
            self.removed = True
            self.state = SetState.ABSENT
            return []
        self.state = SetState.REMOVING
        return [self._send(m, DispatchAction.REMOVE) for m in self.members
                if self.reported.get(m) is not TableState.STOPPING]

    @_checked
    def abandon_prepare(self) -> list[Dispatch]:
        """The secondary did not become Prepared in time (a destination that never finishes
        its prepare): give the move or add up instead of waiting for ever.

        The secondary is asked to remove the span and stays undetermined until it reports
        Stopped/Absent (it wrote nothing, but a late Prepared must not be promoted); the set
        goes back to Replicating on its primary (a move) or to Absent (an add), both states a
        later scheduling round acts on. Only Prepare is given up: in Commit the secondary is
        Prepared and the step waits for the old primary to stop, which must not be cut short.
        """
        if self.removed or self.error is not None or self.state is not SetState.PREPARE:
            return []
        member = self.secondary
        if member is None:
            return []
        self._demote(member)
        # So tick() resends the remove until the member answers (or dies).
        self.reported.setdefault(member, TableState.PREPARING)
        self.state = SetState.REPLICATING if self.primary is not None else SetState.ABSENT
        return [self._send(member, DispatchAction.REMOVE)]

    # -- member inputs ------------------------------------------------------------------------

    @_checked
    def handle_member_status(
        self,
        member: MemberId,
        state: TableState,
        checkpoint_ts: int | None = None,
        resolved_ts: int | None = None,
    ) -> list[Dispatch]:
        """A member's report about this span (heartbeat or dispatch reply)."""
        if self.removed:
            return []
        if self.error is not None:
            return self._status_in_conflict(member, state)
        role = self.members.get(member)
        if state is TableState.REPLICATING and role is not Role.PRIMARY:
            return self._unexpected_writer(member, role, checkpoint_ts, resolved_ts)
        if role is None:
            return self._stranger(member, state)
        self.reported[member] = state
        if role is Role.PRIMARY:
            # Only the primary writes, so only its progress is the span's progress.
            self._advance(checkpoint_ts, resolved_ts)
        if role is Role.UNDETERMINED:
            return self._undetermined(member, state)
        if self.state is SetState.PREPARE:
            return self._on_prepare(member, role, state)
        if self.state is SetState.COMMIT:
            return self._on_commit(member, role, state)
        if self.state is SetState.REPLICATING:
            return self._on_replicating(member, role, state)
        if self.state is SetState.REMOVING:
            return self._on_removing(member, state)
        return []  # Absent has no primary or secondary; unreachable while invariants hold

    @_checked
    def handle_member_shutdown(self, member: MemberId) -> list[Dispatch]:
        """The member service declared ``member`` dead: its tables stopped with it.

        Relies on the protocol's assumption (seed 002) that a member stops writing as soon as
        it loses its lease, before the member service can declare it dead.
        """
        if member not in self.members:
            return []
        return self.handle_member_status(member, TableState.STOPPED)

    @_checked
    def tick(self) -> list[Dispatch]:
        """Resend whatever the current step is waiting for (dispatches are request/reply on
        core NATS and can be lost). Members treat duplicates as no-ops."""
        if self.removed:
            return []
        if self.error is not None:
            return self._conflict_resends()
        out: list[Dispatch] = []
        if self.state is SetState.COMMIT:
            out.extend(self._commit_step())
        for m, role in self.members.items():
            last = self.reported.get(m)
            if role is Role.UNDETERMINED or self.state is SetState.REMOVING:
                if last in (TableState.PREPARING, TableState.PREPARED, TableState.REPLICATING) or (
                        self.state is SetState.REMOVING and last is None):
                    out.append(self._send(m, DispatchAction.REMOVE))
            elif self.state is SetState.PREPARE and role is Role.SECONDARY:
                if last is None or last is TableState.ABSENT:
                    out.append(self._send(m, DispatchAction.ADD_PREPARE))
        return out

    # -- per-state transitions ----------------------------------------------------------------

    def _on_prepare(self, member: MemberId, role: Role, state: TableState) -> list[Dispatch]:
        if role is Role.SECONDARY:
            if state is TableState.ABSENT:
                # It never got (or lost) the add-prepare: ask again.
                return [self._send(member, DispatchAction.ADD_PREPARE)]
            if state is TableState.PREPARING:
                return []
            if state is TableState.PREPARED:
                self.state = SetState.COMMIT
                return self._commit_step()
            # The secondary gave up: back to the primary if there is one.
            if state is TableState.STOPPING:
                self._demote(member)
            else:
                self._drop(member)
            self.state = SetState.REPLICATING if self.primary is not None else SetState.ABSENT
            return []
        # The primary, while a move prepares its successor.
        if state is TableState.STOPPING:
            self._demote(member)
        elif state in GONE_TABLE_STATES:
            self._drop(member)
        # Preparing/Prepared from a primary means it writes nothing; the move goes on.
        return []

    def _commit_step(self) -> list[Dispatch]:
        """Drive Commit one step: stop the old primary, then promote, then confirm."""
        if self.secondary is not None:
            if self.primary is not None:
                # Old primary must stop before the secondary may write (No Double Write).
                return [self._send(self.primary, DispatchAction.REMOVE)]
            if self._has_undetermined():
                return []
            promoted = self.secondary
            self.members[promoted] = Role.PRIMARY
            self.primary, self.secondary = promoted, None
            return [self._send(promoted, DispatchAction.ADD_COMMIT)]
        if self.primary is not None:
            last = self.reported.get(self.primary)
            if last is TableState.REPLICATING:
                # Either the promoted secondary now writes, or the secondary went away and the
                # old primary never got (or has not yet acted on) its remove.
                self.state = SetState.REPLICATING
                return []
            if last is TableState.STOPPING:
                return []
            return [self._send(self.primary, DispatchAction.ADD_COMMIT)]
        self.state = SetState.ABSENT
        return []

    def _on_commit(self, member: MemberId, role: Role, state: TableState) -> list[Dispatch]:
        if role is Role.SECONDARY:
            if state is TableState.PREPARED:
                return self._commit_step()
            if state is TableState.PREPARING:
                return []
            if state is TableState.STOPPING:
                self._demote(member)
            else:
                self._drop(member)
            return self._commit_step()
        # Primary: the old one being stopped, or the promoted one being committed.
        if state is TableState.REPLICATING:
            if self.secondary is not None:
                return [self._send(member, DispatchAction.REMOVE)]
            self.state = SetState.REPLICATING
            return []
        if state in (TableState.PREPARING, TableState.PREPARED):
            if self.secondary is None:
                return [self._send(member, DispatchAction.ADD_COMMIT)]
            return []
        if state is TableState.STOPPING:
            return []
        self._drop(member)
        return self._commit_step()

    def _on_replicating(self, member: MemberId, role: Role, state: TableState) -> list[Dispatch]:
        if role is Role.PRIMARY and state in GONE_TABLE_STATES:
            # The scheduler re-adds it from the checkpoint we keep.
            self._drop(member)
            self.state = SetState.ABSENT
        # Stopping: wait for Stopped (it may still flush). Preparing/Prepared: writes nothing.
        return []

    def _on_removing(self, member: MemberId, state: TableState) -> list[Dispatch]:
        if state in (TableState.PREPARING, TableState.PREPARED, TableState.REPLICATING):
            return [self._send(member, DispatchAction.REMOVE)]
        if state is TableState.STOPPING:
            return []
        self._drop(member)
        if not self.members:
            self.removed = True
            self.state = SetState.ABSENT
        return []

    def _undetermined(self, member: MemberId, state: TableState) -> list[Dispatch]:
        if state in GONE_TABLE_STATES:
            self._drop(member)
            if self.state is SetState.REMOVING and not self.members:
                self.removed = True
                self.state = SetState.ABSENT
                return []
            if self.state is SetState.COMMIT:
                # It may have been the last thing blocking the promotion.
                return self._commit_step()
            return []
        if state is TableState.STOPPING:
            return []
        # Preparing/Prepared without a role we gave it: ask it to let the span go.
        return [self._send(member, DispatchAction.REMOVE)]

    def _stranger(self, member: MemberId, state: TableState) -> list[Dispatch]:
        if state in GONE_TABLE_STATES:
            return []
        # It holds the span and we never gave it a role (a late report, a previous leader's
        # dispatch): treat it as possibly writing until it reports Stopped/Absent.
        self.members[member] = Role.UNDETERMINED
        self.reported[member] = state
        if state is TableState.STOPPING:
            return []
        return [self._send(member, DispatchAction.REMOVE)]

    def _unexpected_writer(
        self, member: MemberId, role: Role | None, checkpoint_ts: int | None, resolved_ts: int | None,
    ) -> list[Dispatch]:
        others = [m for m, r in self.members.items()
                  if m != member and r in (Role.PRIMARY, Role.UNDETERMINED)]
        if others:
            self._enter_conflict(member, others)
            return []
        if self.state is SetState.REMOVING:
            self.members[member] = role or Role.UNDETERMINED
            self.reported[member] = TableState.REPLICATING
            return [self._send(member, DispatchAction.REMOVE)]
        # Nobody else can be writing, so this member is the span's only writer: adopting it is
        # exactly what a rebuild from reports would conclude, and demoting it would not stop
        # it any sooner.
        if role is Role.SECONDARY:
            self.secondary = None
        self.members[member] = Role.PRIMARY
        self.primary = member
        self.reported[member] = TableState.REPLICATING
        self._advance(checkpoint_ts, resolved_ts)
        if self.secondary is None:
            self.state = SetState.REPLICATING
            return []
        # Another member is preparing: the set is now a move from the adopted writer.
        if self.state is SetState.COMMIT:
            return self._commit_step()
        self.state = SetState.PREPARE
        return []

    # -- conflict (several possible writers) --------------------------------------------------

    def _enter_conflict(self, member: MemberId, others: list[MemberId]) -> None:
        states = {m: self.reported.get(m, _ASSUMED_STATE[r]) for m, r in self.members.items()}
        states[member] = TableState.REPLICATING
        self.error = MultiplePrimaryError(
            self.span, tuple(sorted({member, *others})),
            f"{member} reports Replicating while {', '.join(sorted(others))} may be writing")
        self.reported = {m: s for m, s in sorted(states.items()) if s in ACTIVE_TABLE_STATES}
        self.members = dict.fromkeys(self.reported, Role.UNDETERMINED)
        self.primary = self.secondary = None
        self._resolve_keep = None

    def _status_in_conflict(self, member: MemberId, state: TableState) -> list[Dispatch]:
        if state in GONE_TABLE_STATES:
            self.reported.pop(member, None)
            self.members.pop(member, None)
        else:
            self.reported[member] = state
            self.members[member] = Role.UNDETERMINED
        out: list[Dispatch] = []
        keep = self._resolve_keep
        if keep is not None and member != keep and state is TableState.REPLICATING:
            out.append(self._send(member, DispatchAction.REMOVE))
        return out + self._try_resolve()

    def _try_resolve(self) -> list[Dispatch]:
        writers = [m for m, s in self.reported.items() if s is TableState.REPLICATING]
        if len(writers) > 1:
            return []
        # The members' own reports show at most one writer now (an operator stopped the
        # others, or they died): rebuild the roles exactly as a new leader would.
        self._assign_roles(dict(self.reported))
        return self.tick()

    def _conflict_resends(self) -> list[Dispatch]:
        keep = self._resolve_keep
        if keep is None:
            return []
        return [self._send(m, DispatchAction.REMOVE) for m, s in self.reported.items()
                if m != keep and s is TableState.REPLICATING]

    @_checked
    def resolve_conflict(self, keep: MemberId) -> list[Dispatch]:
        """Operator decision: ``keep`` goes on writing, every other writer is told to remove.

        The set leaves conflict only when the members' reports show a single writer.
        """
        if self.error is None:
            raise InvalidTaskError(f"span {self.span.key} is not in conflict")
        writers = [m for m, s in self.reported.items() if s is TableState.REPLICATING]
        if keep not in writers:
            raise InvalidTaskError(
                f"member {keep} is not one of the writers of span {self.span.key}: {', '.join(writers)}")
        self._resolve_keep = keep
        return self._conflict_resends()

    def __repr__(self) -> str:
        roles = ", ".join(f"{m}={r}" for m, r in self.members.items())
        err = f", error={self.error}" if self.error else ""
        return (f"ReplicationSet({self.span.key}, {self.state}, [{roles}], "
                f"checkpoint={self.checkpoint_ts}{err})")


class SetLike(Protocol):
    """What schedulers and checkpoints read from a set; the scheduler service can feed them
    summaries rebuilt from the replication stream instead of live ReplicationSets."""

    @property
    def span(self) -> Span: ...
    @property
    def state(self) -> SetState: ...
    @property
    def primary(self) -> MemberId | None: ...
    @property
    def secondary(self) -> MemberId | None: ...
    @property
    def members(self) -> Mapping[MemberId, Role]: ...
    @property
    def error(self) -> MultiplePrimaryError | None: ...
    @property
    def removed(self) -> bool: ...
    @property
    def checkpoint_ts(self) -> int: ...
    @property
    def resolved_ts(self) -> int: ...
    @property
    def owner(self) -> MemberId | None: ...


class _Snap(NamedTuple):
    holders: tuple[MemberId, ...]
    owner: MemberId | None
    absent: bool
    unstable: bool
    lingering: bool
    replicating: bool


_GONE_SNAP = _Snap((), None, False, False, False, False)


def _flip(bucket: dict[Span, None], span: Span, now: bool) -> None:
    if now:
        bucket[span] = None
    else:
        del bucket[span]


class SetIndex:
    """Incremental indexes over the sets, so no scheduling step scans every span.

    ``holders``: member -> spans it has any role in (member death, complete heartbeats).
    ``assigned``: member -> spans it owns or is taking over (load for balancing).
    ``absent``: sets in Absent (to be added). ``unstable``: sets mid-task or in conflict (no new
    task may start on them). ``lingering``: sets with an undetermined member (tick them).
    Dicts rather than sets: insertion order keeps seeded scheduling reproducible.

    ``membership``: how many times a set appeared in or left the index; with
    ``membership_since`` a reader that keeps something derived from *which spans have a set*
    (the basic scheduler's spans to add) learns what changed instead of scanning every span.
    """

    JOURNAL = 4096
    """Membership changes kept for ``membership_since``; a reader further behind rescans."""

    def __init__(self) -> None:
        self.holders: dict[MemberId, dict[Span, None]] = {}
        self.assigned: dict[MemberId, dict[Span, None]] = {}
        self.absent: dict[Span, None] = {}
        self.unstable: dict[Span, None] = {}
        self.lingering: dict[Span, None] = {}
        self.replicating = 0
        self.membership = 0
        self._journal: deque[Span] = deque(maxlen=self.JOURNAL)
        self._snaps: dict[Span, _Snap] = {}

    @classmethod
    def build(cls, sets: Iterable[SetLike]) -> SetIndex:
        index = cls()
        for rs in sets:
            index.update(rs)
        return index

    def update(self, rs: SetLike) -> None:
        span = rs.span
        if rs.removed:
            self.discard(span)
            return
        state = rs.state
        conflict = rs.error is not None
        new = _Snap(
            tuple(rs.members),
            rs.owner,
            state is SetState.ABSENT and not conflict,
            conflict or state in _TRANSITIONAL,
            Role.UNDETERMINED in rs.members.values(),
            state is SetState.REPLICATING and not conflict,
        )
        old = self._snaps.get(span)
        if old is None:
            self._joined_or_left(span)
            old = _GONE_SNAP
        elif old == new:
            return
        self._apply(span, old, new)
        self._snaps[span] = new

    def discard(self, span: Span) -> None:
        old = self._snaps.pop(span, None)
        if old is not None:
            self._joined_or_left(span)
            self._apply(span, old, _GONE_SNAP)

    def _joined_or_left(self, span: Span) -> None:
        self.membership += 1
        self._journal.append(span)

    def membership_since(self, mark: int) -> list[Span] | None:
        """Spans whose set appeared or left since ``membership`` was ``mark`` (newest first, a
        span may repeat), or None when the journal no longer reaches back that far."""
        behind = self.membership - mark
        if behind < 0 or behind > len(self._journal):
            return None
        return list(itertools.islice(reversed(self._journal), behind))

    def _apply(self, span: Span, old: _Snap, new: _Snap) -> None:
        if old.holders != new.holders:
            for m in old.holders:
                if m not in new.holders:
                    held = self.holders[m]
                    del held[span]
                    if not held:
                        del self.holders[m]
            for m in new.holders:
                if m not in old.holders:
                    self.holders.setdefault(m, {})[span] = None
        if old.owner != new.owner:
            if old.owner is not None:
                owned = self.assigned[old.owner]
                del owned[span]
                if not owned:
                    del self.assigned[old.owner]
            if new.owner is not None:
                self.assigned.setdefault(new.owner, {})[span] = None
        # Spelled out rather than looped over by name: this runs after every step of every set.
        if old.absent != new.absent:
            _flip(self.absent, span, new.absent)
        if old.unstable != new.unstable:
            _flip(self.unstable, span, new.unstable)
        if old.lingering != new.lingering:
            _flip(self.lingering, span, new.lingering)
        if old.replicating != new.replicating:
            self.replicating += 1 if new.replicating else -1

    def load(self, member: MemberId) -> int:
        return len(self.assigned.get(member, ()))
