"""Recording changefeed definitions in their domain stream (the api's command path uses this)."""

from __future__ import annotations

from typing import Literal

from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedCreatedV1, ChangefeedSpecV1, ChangefeedStateChangedV1
from libs.eventstore import EventStore
from libs.streams import domain_events_subject, domain_stream, domain_subjects

DOMAIN = "changefeeds"


async def _store(js: JetStreamContext, producer: str) -> EventStore:
    store = EventStore(js, domain_stream(DOMAIN), producer=producer)
    await store.ensure(domain_subjects(DOMAIN))
    return store


async def record_changefeed(js: JetStreamContext, spec: ChangefeedSpecV1, requested_by: str) -> int:
    store = await _store(js, requested_by)
    return await store.append(domain_events_subject(DOMAIN),
                              ChangefeedCreatedV1(spec=spec, requested_by=requested_by))


async def record_state(js: JetStreamContext, changefeed_id: str,
                       state: Literal["running", "paused", "deleted"], requested_by: str,
                       reason: str = "") -> int:
    store = await _store(js, requested_by)
    event = ChangefeedStateChangedV1(id=changefeed_id, state=state,
                                     requested_by=requested_by, reason=reason)
    return await store.append(domain_events_subject(DOMAIN), event)
