"""Changefeeds: recording their definitions in the changefeeds domain stream (the api's
command path uses this) and finding each running changefeed's spans in the ROWS stream
(``discover_spans``). The folded stream lives in ``libs.control.changefeeds_state`` (imported
here too, for the callers that record and read in one place). The scheduler decides where spans
run from the same view and discovery as a standalone sink-worker runs them."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from contracts.events.changefeeds import (
    ChangefeedCheckV1,
    ChangefeedCreated,
    ChangefeedSpec,
    ChangefeedSpecV2,
    ChangefeedStateChangedV1,
    ChangefeedUpdated,
    TableFilterV1,
    current_spec,
)
from contracts.events.table_incidents import TableActionRequestedV1, TableStoppedV2
from libs.config import Settings
from libs.control.changefeeds_state import ChangefeedView, TableKey, changefeeds_fold
from libs.eventstore import EventStore
from libs.foreign_keys import cascade_groups, group_token
from libs.routing import RoutingConfigError, TableFilter
from libs.source_tables import source_foreign_keys, source_tables
from libs.streams import (
    ROWS_STREAM,
    domain_events_subject,
    domain_stream,
    domain_subjects,
    table_incidents_subject,
    token,
)

DOMAIN = "changefeeds"
__all__ = ["DOMAIN", "ChangefeedView", "Discovered", "SpanKey", "TableKey", "changefeeds_fold",
           "discover_spans", "record_changefeed", "record_state", "record_table_event", "record_update",
           "table_selected"]
log = logging.getLogger(__name__)


async def _store(js: JetStreamContext, producer: str, settings: Settings | None = None) -> EventStore:
    store = EventStore(js, domain_stream(DOMAIN), producer=producer, settings=settings)
    await store.ensure(domain_subjects(DOMAIN))
    return store


async def record_changefeed(js: JetStreamContext, spec: ChangefeedSpecV2, requested_by: str, *,
                            expected_last_subject_seq: int | None = None,
                            failed_checks: list[ChangefeedCheckV1] | None = None,
                            settings: Settings | None = None) -> int:
    """Append ``changefeed.created``; with ``expected_last_subject_seq`` only if nobody appended
    to the changefeeds log since (else ``AppendConflict``). ``settings`` (default: the process'
    own) give the log's stream config if it has to be made: a writer outside the services (a
    test, a tool) passes the system's, so it does not reset the stream's replicas."""
    store = await _store(js, requested_by, settings)
    return await store.append(domain_events_subject(DOMAIN),
                              ChangefeedCreated(spec=current_spec(spec), requested_by=requested_by,
                                                  failed_checks=failed_checks or []),
                              expected_last_subject_seq=expected_last_subject_seq)


async def record_update(js: JetStreamContext, spec: ChangefeedSpecV2, requested_by: str, *,
                        expected_last_subject_seq: int | None = None,
                        failed_checks: list[ChangefeedCheckV1] | None = None) -> int:
    store = await _store(js, requested_by)
    return await store.append(domain_events_subject(DOMAIN),
                              ChangefeedUpdated(spec=current_spec(spec), requested_by=requested_by,
                                                  failed_checks=failed_checks or []),
                              expected_last_subject_seq=expected_last_subject_seq)


async def record_state(js: JetStreamContext, changefeed_id: str,
                       state: Literal["running", "paused", "deleted"], requested_by: str,
                       reason: str = "", *, expected_last_subject_seq: int | None = None) -> int:
    store = await _store(js, requested_by)
    event = ChangefeedStateChangedV1(id=changefeed_id, state=state,
                                     requested_by=requested_by, reason=reason)
    return await store.append(domain_events_subject(DOMAIN), event,
                              expected_last_subject_seq=expected_last_subject_seq)


async def record_table_event(js: JetStreamContext, event: TableStoppedV2 | TableActionRequestedV1,
                             producer: str, *, expected_last_subject_seq: int | None = None) -> int:
    """Append a stopped table's incident (on the incidents subject, where sink-workers record
    them) or an operator's action (a changefeed command, on the events subject)."""
    store = await _store(js, producer)
    subject = (table_incidents_subject(DOMAIN) if isinstance(event, TableStoppedV2)
               else domain_events_subject(DOMAIN))
    return await store.append(subject, event,
                              expected_last_subject_seq=expected_last_subject_seq)


def table_selected(flt: TableFilterV1, database: str, table: str) -> bool:
    """A table is in when ``database.table`` matches an include pattern and no exclude pattern:
    ``routing.TableFilter``'s patterns (a glob, or a regex after ``~``), the one implementation
    the api validates a filter with."""
    compiled = _compiled_filter(tuple(flt.include), tuple(flt.exclude))
    return compiled is not None and compiled.selected(database, table)


@functools.lru_cache(maxsize=256)
def _compiled_filter(include: tuple[str, ...], exclude: tuple[str, ...]) -> TableFilter | None:
    try:
        return TableFilter(include, exclude)
    except RoutingConfigError as exc:
        # The api refuses such a filter; one stored before that check selects nothing (loudly)
        # rather than stopping discovery for every other changefeed.
        log.error("table filter include=%s exclude=%s selects nothing: %s", include, exclude, exc)
        return None


SpanKey = tuple[str, str, str, str]
"""``(changefeed, source token, database token, table token)``."""


@dataclass
class Discovered:
    spans: dict[SpanKey, ChangefeedSpec]
    rows_stream_missing: bool = False


async def discover_spans(js: JetStreamContext, specs: list[ChangefeedSpec],
                         rows_stream: str = ROWS_STREAM) -> Discovered:
    """The spans of ``specs``: the tables that have row or DDL subjects in the ROWS stream for
    the changefeed's sources (``stream_info`` with a subject filter) and match its table filter
    (matched on the subject tokens, which equal the names unless a name holds characters a
    subject token cannot). A changefeed that copies tables first (``initial_load`` other than
    binlog-only) also gets every table its sources hold now, changed or not."""
    found = Discovered({})
    subjects_by_source: dict[str, list[str]] = {}
    for spec in specs:
        for source in spec.sources:
            src = token(source.id)
            if src not in subjects_by_source:
                try:
                    info = await js.stream_info(rows_stream, subjects_filter=f"sluice.*.{src}.>")
                except NotFoundError:
                    found.rows_stream_missing = True
                    subjects_by_source[src] = []
                else:
                    subjects_by_source[src] = sorted((info.state.subjects or {}).keys())
            for subject in subjects_by_source[src]:
                parts = subject.split(".")
                if len(parts) != 5 or parts[1] not in ("rows", "ddl"):
                    continue
                database, table = parts[3], parts[4]
                if table_selected(spec.filter, database, table):
                    found.spans[(spec.id, src, database, table)] = spec
            if spec.initial_load != "binlog-only":
                for database, table in await source_tables(source.url):
                    if table_selected(spec.filter, database, table):
                        found.spans[(spec.id, src, token(database), token(table))] = spec
            await _group_spans(found, spec, src, source.url)
    return found


async def _group_spans(found: Discovered, spec: ChangefeedSpec, src: str, url: str) -> None:
    """The tables of the source that cascading foreign keys connect become one span, a table
    group (``libs.foreign_keys.cascade_groups``), so one worker applies a parent change and
    its cascades in order with the children's own changes (DESIGN.md, "Foreign-key cascades")."""
    fks = [fk for fk in await source_foreign_keys(url) if fk.cascading]
    if not fks:
        return
    for members in cascade_groups(fks, functools.partial(table_selected, spec.filter)):
        keys = {(spec.id, src, token(d), token(t)) for d, t in members}
        if [found.spans.pop(key) for key in keys if key in found.spans]:
            database, table = group_token(members)
            found.spans[(spec.id, src, database, table)] = spec
