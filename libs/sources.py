"""The sources registry: each source's URL entered once (``sluice source add``), read by the
changefeeds that name the source by id and by a capture started with only its source id.

Its events (``source.registered``, ``source.removed``) are in the changefeeds log and folded by
``ChangefeedView`` (``view.sources``), so "remove a source no changefeed reads" and "create a
changefeed reading a registered source" are checked against one sequence. A changefeed records
the URL its sources had when it was created or updated: every reader of a changefeed (scheduler,
sink-worker, ddl-lock) keeps working from the changefeed alone. A source moves to another server
of its replication topology only by ``source.moved`` (``sluice source set-url``), which the api
accepts once the new server holds everything the stream has (by GTID) and which changes the
registry and every changefeed reading the source at one point of the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from nats.js import JetStreamContext

from contracts.events.changefeeds import SourceRefV1
from contracts.events.sources import SourceMovedV1, SourceRegisteredV1, SourceRemovedV1
from libs.changefeeds import DOMAIN, ChangefeedView
from libs.config import Settings
from libs.control.follow import DomainFollower
from libs.eventstore import EventStore, StoredEvent
from libs.streams import domain_events_subject, domain_stream, domain_subjects, token

log = logging.getLogger(__name__)


async def record_source(js: JetStreamContext, source_id: str, url: str, requested_by: str, *,
                        expected_last_subject_seq: int | None = None) -> int:
    store = EventStore(js, domain_stream(DOMAIN), producer=requested_by)
    await store.ensure(domain_subjects(DOMAIN))
    return await store.append(domain_events_subject(DOMAIN),
                              SourceRegisteredV1(id=source_id, url=url, requested_by=requested_by),
                              expected_last_subject_seq=expected_last_subject_seq)


async def record_source_moved(js: JetStreamContext, source_id: str, url: str, requested_by: str, *,
                              reason: str, expected_last_subject_seq: int | None = None) -> int:
    store = EventStore(js, domain_stream(DOMAIN), producer=requested_by)
    await store.ensure(domain_subjects(DOMAIN))
    return await store.append(domain_events_subject(DOMAIN),
                              SourceMovedV1(id=source_id, url=url, requested_by=requested_by, reason=reason),
                              expected_last_subject_seq=expected_last_subject_seq)


async def record_source_removed(js: JetStreamContext, source_id: str, requested_by: str, *,
                                expected_last_subject_seq: int | None = None) -> int:
    store = EventStore(js, domain_stream(DOMAIN), producer=requested_by)
    await store.ensure(domain_subjects(DOMAIN))
    return await store.append(domain_events_subject(DOMAIN),
                              SourceRemovedV1(id=source_id, requested_by=requested_by),
                              expected_last_subject_seq=expected_last_subject_seq)


def readers(view: ChangefeedView, source_id: str) -> dict[str, str]:
    """The changefeeds (paused ones too) that read ``source_id``, with the URL each recorded."""
    return {cf: src.url for cf, spec in sorted(view.specs.items())
            for src in spec.sources if src.id == source_id}


@dataclass(frozen=True)
class SourceProblem:
    index: int
    message: str


def resolve_sources(view: ChangefeedView, refs: list[tuple[str, str | None]]
                    ) -> tuple[list[SourceRefV1], list[SourceProblem]]:
    """A changefeed's ``(id, url or None)`` sources as the refs it records: a source given by id
    only takes its registered URL; one given with a URL keeps it (the SLUICE_SOURCE_URL-style
    setup without a registry) unless the id is registered with another URL (one home)."""
    out: list[SourceRefV1] = []
    problems: list[SourceProblem] = []
    for i, (source_id, url) in enumerate(refs):
        registered = view.sources.get(source_id)
        if url is None:
            if registered is None:
                problems.append(SourceProblem(i, f"source {source_id!r} is not registered and has no "
                                                 f"url: `sluice source add {source_id} <url>` first, "
                                                 "or give its url here"))
                continue
            url = registered
        elif registered is not None and url != registered:
            problems.append(SourceProblem(i, f"source {source_id!r} is registered with another URL: "
                                             "leave its url out to use the registered one"))
            continue
        out.append(SourceRefV1(id=source_id, url=url))
    return out, problems


def _fold(view: ChangefeedView, stored: StoredEvent) -> ChangefeedView:
    view.apply(stored.event)
    return view


class SourceUrlWatch:
    """Follows the registry for one source's URL for as long as its capture runs, so an operator's
    ``sluice source set-url`` reaches a running capture (it ends its session and reads the new
    server from the stream's last mark, DESIGN.md "Source failover by GTID")."""

    def __init__(self, js: JetStreamContext, source_id: str, *, settings: Settings | None = None) -> None:
        self.source_id = source_id
        self._follower = DomainFollower(js, DOMAIN, _fold, ChangefeedView,
                                        name=f"sources_{token(source_id)}", settings=settings)
        self._halt = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follower.run(self._halt), name=f"sources-{self.source_id}")

    @property
    def loaded(self) -> bool:
        return self._follower.loaded

    def url(self) -> str | None:
        return self._follower.state.sources.get(self.source_id) if self._follower.loaded else None

    async def wait_change(self, within: float) -> None:
        """Until the registry folds an event (or ``within`` seconds); cleared first, so one folded in
        between wakes it too."""
        self._follower.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._follower.changed.wait(), within)

    async def close(self) -> None:
        self._halt.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def registered_url(js: JetStreamContext, source_id: str, stopping: asyncio.Event, *,
                         settings: Settings | None = None, log_every_s: float = 10.0,
                         watch: SourceUrlWatch | None = None) -> str | None:
    """The registered URL of ``source_id``, waiting until it is registered (a capture may start
    before the operator adds its source); None when ``stopping`` is set first. With ``watch``
    (started by the caller, who keeps following with it) no follower of its own."""
    own = watch is None
    if watch is None:
        watch = SourceUrlWatch(js, source_id, settings=settings)
        watch.start()
    try:
        while not stopping.is_set():
            url = watch.url()
            if url:
                return url
            if watch.loaded:
                log.warning("source %r is not in the sources registry: waiting for "
                            "`sluice source add %s <url>` (or set SLUICE_SOURCE_URL)", source_id, source_id)
            changed = asyncio.create_task(watch.wait_change(log_every_s))
            stop = asyncio.create_task(stopping.wait())
            await asyncio.wait({changed, stop}, return_when=asyncio.FIRST_COMPLETED)
            for t in (changed, stop):
                t.cancel()
        return None
    finally:
        if own:
            await watch.close()
