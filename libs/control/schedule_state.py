"""The schedule domain folded: the spans each changefeed wants and the operator requests still
to carry out. The scheduler leader writes it; the replication-manager reads the wanted spans
from it (a changefeed's checkpoint must cover every one of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from contracts.events.leadership import LeaderElectedV1
from contracts.events.scheduling import (
    DrainRequestedV1,
    MoveRequestedV1,
    MoveTableV1,
    RebalanceRequestedV1,
    RequestDoneV1,
    SpansChangedV1,
)
from libs.control.convert import span_of
from libs.eventstore import StoredEvent
from libs.scheduling import ChangefeedId, MemberId, Span


@dataclass
class ScheduleState:
    wanted: dict[ChangefeedId, list[Span]] = field(default_factory=dict)
    moves: dict[Span, MemberId] = field(default_factory=dict)
    """Accepted operator moves not carried out yet: span -> destination."""
    rebalance: bool = False
    drains: dict[MemberId, str] = field(default_factory=dict)
    """Operator drains: member id -> the incarnation to drain."""
    epoch: int = 0
    operator_moved: dict[Span, float] = field(default_factory=dict)
    """When each span's latest operator move was handed out (Unix seconds, its event's time): the
    automatic balance leaves it where the operator put it for a while (``pinned``), and a new
    scheduler leader knows that from the stream, not only the leader that handed it out. The
    leader's round forgets a move once its pin has run out (``SchedulerCore.round``)."""

    def apply(self, event: BaseModel, at: float | None = None) -> ScheduleState:
        """Fold ``event``; ``at`` is when it was recorded (Unix seconds), if known."""
        if isinstance(event, SpansChangedV1):
            if event.spans:
                self.wanted[event.changefeed] = sorted(span_of(s) for s in event.spans)
            else:
                self.wanted.pop(event.changefeed, None)
        elif isinstance(event, MoveRequestedV1):
            self.moves[span_of(event.span)] = event.dest
        elif isinstance(event, MoveTableV1):
            if event.reason == "operator":
                self.moves.pop(span_of(event.span), None)
                if at is not None:
                    self.operator_moved[span_of(event.span)] = at
        elif isinstance(event, RequestDoneV1):
            if event.kind == "move" and event.span is not None:
                self.moves.pop(span_of(event.span), None)
            elif event.kind == "rebalance":
                self.rebalance = False
        elif isinstance(event, RebalanceRequestedV1):
            self.rebalance = True
        elif isinstance(event, DrainRequestedV1):
            self.drains[event.member_id] = event.incarnation
        elif isinstance(event, LeaderElectedV1):
            self.epoch = event.epoch
        return self

    def wanted_spans(self) -> dict[Span, None]:
        return {s: None for spans in self.wanted.values() for s in spans}

    def dump(self) -> dict[str, Any]:
        return {
            "wanted": {cf: [list(s) for s in spans] for cf, spans in sorted(self.wanted.items())},
            "moves": [[*span, dest] for span, dest in self.moves.items()],
            "rebalance": self.rebalance,
            "drains": dict(self.drains),
            "epoch": self.epoch,
            "operator_moved": [[*span, at] for span, at in self.operator_moved.items()],
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> ScheduleState:
        wanted = {cf: [Span(*s) for s in spans] for cf, spans in (data.get("wanted") or {}).items()}
        moves = {Span(*m[:4]): str(m[4]) for m in data.get("moves") or []}
        moved = {Span(*m[:4]): float(m[4]) for m in data.get("operator_moved") or []}
        return cls(wanted, moves, bool(data.get("rebalance")),
                   {str(k): str(v) for k, v in (data.get("drains") or {}).items()},
                   int(data.get("epoch") or 0), moved)


def schedule_fold(state: ScheduleState, stored: StoredEvent) -> ScheduleState:
    return state.apply(stored.event, at=stored.envelope.time.timestamp())
