"""Stopped tables between the pipeline and the changefeeds log.

The pipeline stops a span whose downstream refused a change for good
(``writer.SqlWriter._stop_refused``); the worker records each such incident as
``table.stopped`` on the changefeeds' incidents subject (``streams.table_incidents_subject``:
the one changefeeds subject its NATS role may write), and carries out the ``table.action_requested``
decisions it folds from that log. A decision names its incident, so only the worker whose span
is stopped by exactly that incident acts on it (a late, repeated or misrouted one changes
nothing); a ``skip`` is also kept for the span wherever it runs later, since the log is folded
by every worker (a move or a restart keeps it).
"""

from __future__ import annotations

import json
import logging

from nats.js import JetStreamContext

from contracts.events.table_incidents import (
    TableActionRequestedV1,
    TableRefV1,
    TableStoppedV2,
    UniqueConflictOverwrittenV1,
)
from libs.changefeeds import ChangefeedView
from libs.eventstore import EventStore
from libs.scheduling.model import Span
from services.sink_worker.incidents.poison import TableIncident
from services.sink_worker.round.pipeline import Pipeline

log = logging.getLogger(__name__)


def table_ref(span: Span) -> TableRefV1:
    return TableRefV1(changefeed=span.changefeed, source=span.source, database=span.database,
                      table=span.table)


def span_of(ref: TableRefV1) -> Span:
    return Span(ref.changefeed, ref.source, ref.database, ref.table)


def stopped_event(span: Span, incident: TableIncident, worker: str) -> TableStoppedV2:
    f = incident.failure
    return TableStoppedV2(table=table_ref(span), incident=incident.id, target=incident.target,
                          kind=incident.kind, statement=f.statement, key=f.key,
                          key_columns=list(f.key_columns), error=f.error, code=f.code,
                          upto_ts=incident.upto_ts, worker=worker)


def overwritten_event(changefeed: str, report: str) -> UniqueConflictOverwrittenV1:
    raw = json.loads(report)
    return UniqueConflictOverwrittenV1(
        changefeed=changefeed, target=raw["target"], unique_key=raw["unique_key"], value=raw["value"],
        shard=raw["shard"], key=raw["key"], other_shard=raw["other_shard"], other_key=raw["other_key"])


async def record_incidents(js: JetStreamContext, stream: str, subject: str, pipeline: Pipeline,
                           worker: str) -> None:
    """Append every new incident and overwritten row of the pipeline to the changefeeds'
    incidents ``subject`` (kept for the next call when the log cannot be written)."""
    store = EventStore(js, stream, producer=f"sink-worker/{worker}")
    while pipeline.new_incidents:
        span, incident = pipeline.new_incidents[0]
        # The incident id as the message id: a retried append is stored once.
        await store.append(subject, stopped_event(span, incident, worker), msg_id=f"incident-{incident.id}")
        pipeline.new_incidents.pop(0)
    while pipeline.new_overwrites:
        changefeed, report = pipeline.new_overwrites[0]
        await store.append(subject, overwritten_event(changefeed, report))
        pipeline.new_overwrites.pop(0)


def carry_out(view: ChangefeedView, pipeline: Pipeline, action: TableActionRequestedV1) -> bool:
    """An operator's decision, once ``view`` folded it: act on the span if it runs here, and
    keep its skipped keys wherever it runs. True when this worker's span acted."""
    ref = action.table
    span = span_of(ref)
    skipped = view.skipped.get((ref.changefeed, ref.source, ref.database, ref.table))
    if skipped:
        pipeline.remember_skips(span, skipped)
    acted = pipeline.act(span, action.incident, action.action)
    if acted:
        log.info("operator decision carried out", extra={"span": span.name, "action": action.action,
                                                         "incident": action.incident})
    return acted
