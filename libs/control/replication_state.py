"""The replication domain folded: every span's replication set as last recorded, every
changefeed's published checkpoint, and whether the current replication-manager leader has
finished its rebuild (and which members it has heard from).

The replication-manager keeps its live ``ReplicationSet`` objects in memory and records a
``replication.set_changed`` whenever a set's state, roles or conflict change; this fold is what
those records add up to. The scheduler schedules over it (``SetSummary`` is a ``SetLike``), and
a new replication-manager leader starts from it: the recorded checkpoints are its floors, the
live members' reports decide the roles.

Snapshots of this state can be large (one entry per span), so the dump is compact (one list
per set); the event store compresses and chunks a large one (``libs/eventstore/snapshot_chunks``).
Snapshots written before that carry ``{"zlib": <base64>}``: ``restore`` still reads them.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from contracts.events.leadership import LeaderElectedV1
from contracts.events.scheduling import (
    CheckpointAdvancedV1,
    MemberReadyV1,
    RebuiltV1,
    SetChangedV1,
)
from contracts.events.syncpoints import SyncpointEndedV1, SyncpointPlannedV1, SyncpointReachedV1
from libs.control.convert import span_of, span_ref
from libs.eventstore import StoredEvent
from libs.scheduling import (
    ChangefeedId,
    MemberId,
    MultiplePrimaryError,
    ReplicationSet,
    Role,
    SetIndex,
    SetState,
    Span,
)
from libs.syncpoints import ChangefeedSyncpoints

# Dict lookups instead of enum calls: a snapshot of 100,000 sets restores 300,000 of them.
# Unknown values still raise the enum's ValueError.
_SET_STATES = {s.value: s for s in SetState}
_ROLES = {r.value: r for r in Role}


def _set_state(value: str) -> SetState:
    return _SET_STATES.get(value) or SetState(value)


def _roles(members: Mapping[str, str]) -> dict[MemberId, Role]:
    return {m: _ROLES.get(r) or Role(r) for m, r in members.items()}


@dataclass(slots=True)
class SetSummary:
    """A replication set as recorded in the stream (satisfies ``SetLike``)."""

    span: Span
    state: SetState = SetState.ABSENT
    primary: MemberId | None = None
    secondary: MemberId | None = None
    members: dict[MemberId, Role] = field(default_factory=dict)
    error: MultiplePrimaryError | None = None
    removed: bool = False
    checkpoint_ts: int = 0
    resolved_ts: int = 0

    @property
    def owner(self) -> MemberId | None:
        # Same rule as ReplicationSet.owner: where the span runs once in-flight work settles.
        if self.removed or self.error is not None or self.state in (SetState.ABSENT, SetState.REMOVING):
            return None
        return self.secondary if self.secondary is not None else self.primary

    @property
    def shape(self) -> tuple[object, ...]:
        """What a set change is recorded for: not progress, which moves every second."""
        err = (self.error.detail, self.error.members) if self.error is not None else None
        return (self.state, self.primary, self.secondary, tuple(sorted(self.members.items())), err,
                self.removed)

    @classmethod
    def of(cls, rs: ReplicationSet) -> SetSummary:
        return cls(rs.span, rs.state, rs.primary, rs.secondary, dict(rs.members), rs.error, rs.removed,
                   rs.checkpoint_ts, rs.resolved_ts)

    @classmethod
    def removed_set(cls, span: Span, checkpoint_ts: int = 0, resolved_ts: int = 0) -> SetSummary:
        return cls(span, removed=True, checkpoint_ts=checkpoint_ts, resolved_ts=resolved_ts)

    def event(self) -> SetChangedV1:
        return SetChangedV1(
            span=span_ref(self.span), state=self.state.value, primary=self.primary,
            secondary=self.secondary, members={m: r.value for m, r in self.members.items()},
            error=self.error.detail if self.error is not None else None,
            error_members=list(self.error.members) if self.error is not None else [],
            removed=self.removed, checkpoint_ts=self.checkpoint_ts, resolved_ts=self.resolved_ts)

    @classmethod
    def from_event(cls, ev: SetChangedV1) -> SetSummary:
        span = span_of(ev.span)
        error = MultiplePrimaryError(span, tuple(ev.error_members), ev.error) if ev.error else None
        return cls(span, _set_state(ev.state), ev.primary, ev.secondary, _roles(ev.members), error,
                   ev.removed, ev.checkpoint_ts, ev.resolved_ts)


@dataclass
class ReplicationState:
    sets: dict[Span, SetSummary] = field(default_factory=dict)
    checkpoints: dict[ChangefeedId, tuple[int, int]] = field(default_factory=dict)
    """Published (checkpoint_ts, resolved_ts) per changefeed."""
    epoch: int = 0
    """Epoch of the newest replication-manager leader (its ``leader.elected``)."""
    ready: bool = False
    """That leader has rebuilt from its members' reports and schedules now."""
    ready_members: dict[MemberId, str] = field(default_factory=dict)
    """Members (-> incarnation) that leader has a complete report from: they may get work."""
    index: SetIndex = field(default_factory=SetIndex, repr=False)
    syncpoints: dict[ChangefeedId, ChangefeedSyncpoints] = field(default_factory=dict)
    """Each changefeed's syncpoints (``libs.syncpoints``): the pending one, the last released."""

    def apply(self, event: BaseModel) -> ReplicationState:
        if isinstance(event, SetChangedV1):
            summary = SetSummary.from_event(event)
            if summary.removed:
                self.sets.pop(summary.span, None)
                self.index.discard(summary.span)
            else:
                self.sets[summary.span] = summary
                self.index.update(summary)
        elif isinstance(event, CheckpointAdvancedV1):
            old = self.checkpoints.get(event.changefeed, (0, 0))
            # max(): the fold must never lower what was published, whatever the log holds.
            self.checkpoints[event.changefeed] = (max(old[0], event.checkpoint_ts),
                                                  max(old[1], event.resolved_ts))
        elif isinstance(event, LeaderElectedV1):
            self.epoch = event.epoch
            self.ready = False
            self.ready_members = {}
        elif isinstance(event, RebuiltV1):
            self.ready = True
            self.ready_members = dict(event.members)
        elif isinstance(event, MemberReadyV1):
            self.ready_members[event.member_id] = event.incarnation
        elif isinstance(event, SyncpointPlannedV1 | SyncpointReachedV1 | SyncpointEndedV1):
            self.syncpoints.setdefault(event.changefeed, ChangefeedSyncpoints()).apply(event)
        return self

    def known_spans(self) -> dict[Span, tuple[int, int]]:
        """Per span, a checkpoint floor for the next leader: the span's recorded checkpoint or
        its changefeed's published one, whichever is higher (both are true lower bounds)."""
        out: dict[Span, tuple[int, int]] = {}
        for span, s in self.sets.items():
            cf = self.checkpoints.get(span.changefeed, (0, 0))
            out[span] = (max(s.checkpoint_ts, cf[0]), max(s.resolved_ts, cf[1]))
        return out

    # -- snapshot -----------------------------------------------------------------------------

    def dump(self) -> dict[str, Any]:
        sets = [[*s.span, s.state.value, s.primary, s.secondary,
                 {m: r.value for m, r in s.members.items()},
                 s.error.detail if s.error is not None else None,
                 list(s.error.members) if s.error is not None else [],
                 s.checkpoint_ts, s.resolved_ts] for s in self.sets.values()]
        body: dict[str, Any] = {
            "sets": sets,
            "checkpoints": {cf: list(v) for cf, v in self.checkpoints.items()},
            "epoch": self.epoch, "ready": self.ready, "ready_members": dict(self.ready_members),
            "syncpoints": {cf: sp.dump() for cf, sp in self.syncpoints.items()},
        }
        return body

    @classmethod
    def restore(cls, data: dict[str, Any]) -> ReplicationState:
        if "zlib" in data:
            data = json.loads(zlib.decompress(base64.b64decode(data["zlib"])))
        state = cls(epoch=int(data.get("epoch") or 0), ready=bool(data.get("ready")),
                    ready_members={str(k): str(v) for k, v in (data.get("ready_members") or {}).items()},
                    checkpoints={cf: (int(v[0]), int(v[1]))
                                 for cf, v in (data.get("checkpoints") or {}).items()},
                    syncpoints={cf: ChangefeedSyncpoints.restore(v)
                                for cf, v in (data.get("syncpoints") or {}).items()})
        for row in data.get("sets") or []:
            span = Span(*row[:4])
            error = MultiplePrimaryError(span, tuple(row[9]), row[8]) if row[8] else None
            summary = SetSummary(span, _set_state(row[4]), row[5], row[6], _roles(row[7]), error, False,
                                 int(row[10]), int(row[11]))
            state.sets[span] = summary
            state.index.update(summary)
        return state


def replication_fold(state: ReplicationState, stored: StoredEvent) -> ReplicationState:
    return state.apply(stored.event)
