"""The scheduler leader: decides what runs where and records it as schedule tasks.

While leader it follows three streams it does not own, each replayed from its newest snapshot
and then followed (``DomainFollower``): members (who is alive, who drains), replication (the
sets as the replication-manager recorded them, whether it is ready, task results) and
changefeeds (which changefeeds run). It finds every running changefeed's spans in the ROWS
stream (``discover_spans``), and runs a ``SchedulerCore`` round whenever any of that changed,
and at least every ``scheduler_interval_s``.

Operator requests (move, rebalance, drain) are request/reply on ``command_subject("schedule")``
with ``schedule.request``; only the leader listens, so "no responders" means there is no leader
right now. They are validated against the leader's view and answered at once; an accepted one
is recorded in the schedule stream before the answer is sent, so it survives a leader change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.context import Context
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.leadership import LeaderElectedV1
from contracts.events.scheduling import (
    AddTableV1,
    ScheduleRequestAnsweredV1,
    ScheduleRequestV1,
    SetChangedV1,
    SpansChangedV1,
    TaskResultV1,
)
from libs.changefeeds import ChangefeedView, changefeeds_fold, discover_spans
from libs.config import Settings
from libs.control.members import MembersState, members_fold
from libs.control.replication_state import ReplicationState, replication_fold
from libs.control.schedule_state import ScheduleState, schedule_fold
from libs.control.snapshots import SnapshotPolicy
from libs.election import Leadership
from libs.eventstore import DomainLog, LeaderLog, LeaseView, StoredEvent
from libs.leader_service import Entry, Followed, LeaderLoop
from libs.scheduling import ChangefeedId, Span
from libs.service import ServiceRuntime
from libs.streams import command_subject
from libs.telemetry.tracing import extract_context, tracer
from services.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)

DOMAIN = "schedule"

TASKS = Counter("sluice_scheduler_tasks", "Schedule tasks recorded by this leader.", ["type"])
REQUESTS = Counter("sluice_scheduler_requests", "Operator requests answered.", ["kind", "accepted"])
PENDING = Gauge("sluice_scheduler_tasks_in_flight", "Tasks recorded and not settled yet.")


def changefeed_of(event: BaseModel) -> str | None:
    """The changefeed a changefeeds-log event is about (None: a source registry event)."""
    spec = getattr(event, "spec", None)
    if spec is not None:
        return str(spec.id)
    if hasattr(event, "state") and hasattr(event, "id"):
        return str(event.id)
    return None


class SchedulerService:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.js = runtime.nc.jetstream()

    def make_log(self) -> DomainLog[ScheduleState]:
        return DomainLog(self.js, DOMAIN, producer=self.runtime.producer, fold=schedule_fold,
                         initial=ScheduleState(), restore=ScheduleState.restore, dump=ScheduleState.dump,
                         settings=self.settings)

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None:
        async with LeaderLoop[ScheduleRequestV1, ScheduleRequestAnsweredV1](
                self.runtime, status_key="scheduling", refuse=_stepped_down, batch=True) as loop:
            members = loop.follow("members", members_fold, MembersState, restore=MembersState.restore,
                                  name="sched_members")
            replication = loop.follow("replication", replication_fold, ReplicationState,
                                      restore=ReplicationState.restore, name="sched_replication")
            changefeeds = loop.follow("changefeeds", changefeeds_fold, ChangefeedView,
                                      name="sched_changefeeds")
            await loop.load()
            handlers = SchedulerHandlers(leadership, domain_log, self.settings, members, replication,
                                         changefeeds, discover=self._discover, wake=loop.inbox.wake,
                                         publish_status=loop.publish_status, spawn=loop.spawn)
            members.on_event = handlers.on_other
            replication.on_event = handlers.on_replication
            changefeeds.on_event = handlers.on_changefeed

            async def on_request(msg: Msg) -> None:
                try:
                    decoded = REGISTRY.decode(msg.data)
                    if not isinstance(decoded.event, ScheduleRequestV1):
                        raise ContractError("unknown_type",
                                            f"{decoded.envelope.type} is not a schedule request")
                except ContractError as exc:
                    await self._reply(msg, ScheduleRequestAnsweredV1(accepted=False, reason=str(exc)))
                    return
                await self._reply(msg, await loop.inbox.ask(decoded.event))

            await loop.subscribe(command_subject(DOMAIN), on_request)
            log.info("scheduler leading", extra={"epoch": leadership.epoch,
                                                 "replication_epoch": replication.state.epoch})
            await loop.run(handlers.handle, handlers.tick, lambda: self.settings.scheduler_interval_s)

    async def _discover(self, view: ChangefeedView) -> dict[ChangefeedId, list[Span]] | None:
        """Every running changefeed's spans; None when the ROWS stream cannot tell (missing or
        unreachable): then nothing is added or removed on a guess."""
        running = view.running()
        try:
            found = await discover_spans(self.js, running)
        except Exception:
            log.warning("span discovery failed", exc_info=True)
            return None
        if found.rows_stream_missing:
            return None
        out: dict[ChangefeedId, list[Span]] = {spec.id: [] for spec in running}
        for key in found.spans:
            out[key[0]].append(Span(*key))
        return out

    async def _reply(self, msg: Msg, answer: ScheduleRequestAnsweredV1) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(REGISTRY.encode(answer, producer=self.runtime.producer))


def _stepped_down(_req: ScheduleRequestV1) -> ScheduleRequestAnsweredV1:
    return ScheduleRequestAnsweredV1(accepted=False, reason="the scheduler leader stepped down; try again")


Discover = Callable[[ChangefeedView], Awaitable[dict[ChangefeedId, list[Span]] | None]]


class SchedulerHandlers:
    """One term's handlers: operator requests, and per turn a ``SchedulerCore`` round over the
    followed members, replication and changefeeds state."""

    def __init__(self, leadership: LeaseView, domain_log: LeaderLog, settings: Settings,
                 members: Followed[MembersState], replication: Followed[ReplicationState],
                 changefeeds: Followed[ChangefeedView], *, discover: Discover,
                 wake: Callable[[], None], publish_status: Callable[[dict[str, Any]], None],
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]] = asyncio.create_task,
                 ) -> None:
        state = domain_log.state
        assert isinstance(state, ScheduleState)
        self.epoch = leadership.epoch
        self.domain_log = domain_log
        self.settings = settings
        self.members, self.replication, self.changefeeds = members, replication, changefeeds
        self.discover = discover
        self.wake = wake
        self.publish_status = publish_status
        self.core = SchedulerCore(state, add_batch_size=settings.scheduler_add_batch_size,
                                  max_task_concurrency=settings.scheduler_max_task_concurrency,
                                  max_adds_per_member=settings.scheduler_max_adds_per_member,
                                  balance_interval_s=settings.scheduler_balance_interval_s,
                                  operator_pin_s=settings.scheduler_operator_pin_s,
                                  task_timeout_s=settings.scheduler_task_timeout_s)
        self.core.replication_epoch = replication.state.epoch
        self.policy = SnapshotPolicy(settings.control_snapshot_every)
        self.policy.opened(domain_log)
        self.changefeeds_changed = True
        self.discovered: dict[ChangefeedId, list[Span]] | None = None
        self.last_discovery = -1e9
        self.spawn = spawn
        self._discovery: asyncio.Task[Any] | None = None
        self.trace_of: dict[str, Context] = {}
        """The trace context of each changefeed's newest event (its api request)."""

    def _parent(self, event: BaseModel) -> Context | None:
        """The trace a scheduling event continues: its changefeed's request for a table's first
        placement and the spans it wants; a new trace (None) for moves and the rest."""
        if isinstance(event, AddTableV1):
            return self.trace_of.get(event.span.changefeed)
        if isinstance(event, SpansChangedV1):
            return self.trace_of.get(event.changefeed)
        return None

    def on_replication(self, stored: StoredEvent) -> None:
        ev = stored.event
        if isinstance(ev, TaskResultV1):
            self.core.on_task_result(ev)
        elif isinstance(ev, SetChangedV1):
            self.core.on_set_changed(ev)
        elif isinstance(ev, LeaderElectedV1):
            self.core.on_replication_epoch(ev.epoch)
        self.wake()

    def on_changefeed(self, stored: StoredEvent) -> None:
        changefeed = changefeed_of(stored.event)
        if changefeed is not None:
            # Placing its tables continues the trace of the request that created (updated,
            # resumed) the changefeed: the api's span is in the event's headers.
            self.trace_of[changefeed] = extract_context(stored.headers)
        self.changefeeds_changed = True
        self.wake()

    def on_other(self, _stored: StoredEvent) -> None:
        self.wake()

    async def handle(self, entry: Entry[ScheduleRequestV1, ScheduleRequestAnsweredV1]) -> None:
        req = entry.item
        reason, event = self.core.request(req, self.members.state, self.replication.state)
        if event is not None:
            await self.domain_log.append(event)
            self.policy.appended()
        REQUESTS.labels(req.kind, str(reason is None).lower()).inc()
        entry.reply(ScheduleRequestAnsweredV1(accepted=reason is None, reason=reason or "",
                                              leader=self.settings.instance_id))

    async def tick(self) -> None:
        core, domain_log, policy = self.core, self.domain_log, self.policy
        now = time.monotonic()
        events: list[BaseModel] = []
        due = now - self.last_discovery >= self.settings.scheduler_discovery_interval_s
        if (self.changefeeds_changed or due) and (self._discovery is None or self._discovery.done()):
            self.changefeeds_changed = False
            self.last_discovery = now
            if self.discovered is None:
                await self._discover_now()  # nothing to schedule from before the first one
            else:
                # In the background: listing a source's tables and foreign keys took seconds at
                # 10,000 tables, and rounds waited for it every discovery interval (adds in
                # bursts of one batch between discoveries).
                self._discovery = self.spawn(self._discover_now())
        if self.discovered is not None:
            events.extend(core.spans_changes(self.discovered))
        for event in events:  # wanted spans first: the manager needs them before tasks
            with tracer().start_as_current_span(f"schedule {REGISTRY.key_of(type(event))[0]}",
                                                context=self._parent(event)):
                await domain_log.append(event)
            policy.appended()
        for event in core.round(self.members.state, self.replication.state, now):
            # The task's trace: a first placement continues its changefeed request's trace; the
            # manager's dispatches and the worker's handling continue it (NATS headers).
            with tracer().start_as_current_span(f"schedule {REGISTRY.key_of(type(event))[0]}",
                                                context=self._parent(event)):
                await domain_log.append(event)
            policy.appended()
            TASKS.labels(REGISTRY.key_of(type(event))[0]).inc()
            log.info("recorded %s", REGISTRY.key_of(type(event))[0],
                     extra={"epoch": self.epoch, **event.model_dump(mode="json")})
        await policy.maybe_snapshot(domain_log)
        PENDING.set(len(core.pending))
        self._publish_status()

    async def _discover_now(self) -> None:
        found = await self.discover(self.changefeeds.state)
        if found is not None:
            self.discovered = found
            self.wake()

    def _publish_status(self) -> None:
        core, members, replication = self.core, self.members.state, self.replication.state
        loads: dict[str, int] = {m: replication.index.load(m) for m in members.members}
        self.publish_status({
            "replication_ready": replication.ready,
            "replication_epoch": replication.epoch,
            "usable_members": sorted(core.usable_members(members, replication, core.state)),
            "loads": loads,
            "wanted_spans": sum(len(v) for v in core.state.wanted.values()),
            "sets": len(replication.sets),
            "tasks_in_flight": len(core.pending),
            "tasks_emitted": core.tasks_emitted,
            "tasks_timed_out": core.tasks_timed_out,
            "operator_moves": [f"{s.key} -> {d}" for s, d in core.state.moves.items()],
        })
