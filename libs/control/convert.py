"""Between the scheduling domain (``libs.scheduling``) and its contracts."""

from __future__ import annotations

from contracts.events.scheduling import (
    DispatchRequestV1,
    DispatchResponseV1,
    MemberHeartbeatV3,
    SpanRefV1,
    TableStatusV1,
)
from libs.scheduling import Dispatch, DispatchAction, MemberReport, Span, TableState, TableStatus

# A dict lookup instead of ``TableState(value)`` (the enum call is most of the cost of turning a
# 10,000-table heartbeat into a report); an unknown value still raises the enum's ValueError.
_TABLE_STATES = {s.value: s for s in TableState}


def span_ref(span: Span) -> SpanRefV1:
    return SpanRefV1(changefeed=span.changefeed, source=span.source, database=span.database,
                     table=span.table)


def span_of(ref: SpanRefV1) -> Span:
    return Span(ref.changefeed, ref.source, ref.database, ref.table)


def status_ref(status: TableStatus) -> TableStatusV1:
    # Built for every span of every heartbeat (five a second): from typed domain values, so
    # without validation; the receiver validates the heartbeat as it decodes it.
    span = status.span
    ref = SpanRefV1.model_construct(changefeed=span.changefeed, source=span.source,
                                    database=span.database, table=span.table)
    return TableStatusV1.model_construct(span=ref, state=status.state.value,
                                         checkpoint_ts=status.checkpoint_ts, resolved_ts=status.resolved_ts)


def status_of(ref: TableStatusV1) -> TableStatus:
    state = _TABLE_STATES.get(ref.state) or TableState(ref.state)
    return TableStatus(span_of(ref.span), state, ref.checkpoint_ts, ref.resolved_ts)


def heartbeat_report(hb: MemberHeartbeatV3) -> MemberReport:
    """A heartbeat is the member's complete report (every span it holds) or a partial one (the
    spans whose status changed since its last complete one)."""
    return MemberReport(hb.member_id, hb.epoch, tuple(status_of(t) for t in hb.tables),
                        complete=hb.complete, seq=hb.seq)


def answer_report(answer: DispatchResponseV1) -> MemberReport:
    """A dispatch answer reports the one dispatched span only."""
    return MemberReport(answer.member_id, answer.epoch, (status_of(answer.status),),
                        complete=False, seq=answer.seq)


def dispatch_request(d: Dispatch, incarnation: str) -> DispatchRequestV1:
    return DispatchRequestV1(member_id=d.member, incarnation=incarnation, span=span_ref(d.span),
                             action=d.action.value, checkpoint_ts=d.checkpoint_ts, epoch=d.epoch)


def dispatch_of(req: DispatchRequestV1) -> Dispatch:
    return Dispatch(req.member_id, span_of(req.span), DispatchAction(req.action), req.checkpoint_ts,
                    req.epoch)
