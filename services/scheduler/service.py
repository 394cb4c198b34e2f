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
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.leadership import LeaderElectedV1
from contracts.events.scheduling import (
    ScheduleRequestAnsweredV1,
    ScheduleRequestV1,
    SetChangedV1,
    TaskResultV1,
)
from libs.changefeeds import ChangefeedView, discover_spans
from libs.control.follow import DomainFollower
from libs.control.members import MembersState, members_fold
from libs.control.replication_state import ReplicationState, replication_fold
from libs.control.schedule_state import ScheduleState, schedule_fold
from libs.control.snapshots import SnapshotPolicy
from libs.election import Leadership
from libs.eventstore import DomainLog, StoredEvent
from libs.scheduling import ChangefeedId, Span
from libs.service import ServiceRuntime
from libs.streams import command_subject
from libs.telemetry.tracing import tracer
from services.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)

DOMAIN = "schedule"

TASKS = Counter("sluice_scheduler_tasks", "Schedule tasks recorded by this leader.", ["type"])
REQUESTS = Counter("sluice_scheduler_requests", "Operator requests answered.", ["kind", "accepted"])
PENDING = Gauge("sluice_scheduler_tasks_in_flight", "Tasks recorded and not settled yet.")


def _changefeeds_fold(view: ChangefeedView, stored: StoredEvent) -> ChangefeedView:
    view.apply(stored.event)
    return view


@dataclass
class _Request:
    req: ScheduleRequestV1
    answer: asyncio.Future[ScheduleRequestAnsweredV1]


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
        settings = self.settings
        state = domain_log.state
        assert isinstance(state, ScheduleState)
        core = SchedulerCore(state, add_batch_size=settings.scheduler_add_batch_size,
                             max_task_concurrency=settings.scheduler_max_task_concurrency,
                             balance_interval_s=settings.scheduler_balance_interval_s,
                             task_timeout_s=settings.scheduler_task_timeout_s)
        wake = asyncio.Event()

        def on_replication(stored: StoredEvent) -> None:
            ev = stored.event
            if isinstance(ev, TaskResultV1):
                core.on_task_result(ev)
            elif isinstance(ev, SetChangedV1):
                core.on_set_changed(ev)
            elif isinstance(ev, LeaderElectedV1):
                core.on_replication_epoch(ev.epoch)
            wake.set()

        def on_other(_stored: StoredEvent) -> None:
            wake.set()

        members = DomainFollower(self.js, "members", members_fold, MembersState,
                                 restore=MembersState.restore, on_event=on_other, name="sched_members",
                                 settings=settings)
        replication = DomainFollower(self.js, "replication", replication_fold, ReplicationState,
                                     restore=ReplicationState.restore, on_event=on_replication,
                                     name="sched_replication", settings=settings)
        changefeeds_changed = asyncio.Event()

        def on_changefeed(_stored: StoredEvent) -> None:
            changefeeds_changed.set()
            wake.set()

        changefeeds = DomainFollower(self.js, "changefeeds", _changefeeds_fold, ChangefeedView,
                                     on_event=on_changefeed, name="sched_changefeeds", settings=settings)
        for follower in (members, replication, changefeeds):
            await follower.load()
        core.replication_epoch = replication.state.epoch
        policy = SnapshotPolicy(settings.control_snapshot_every)
        policy.opened(domain_log)
        requests: asyncio.Queue[_Request] = asyncio.Queue()

        async def on_request(msg: Msg) -> None:
            try:
                decoded = REGISTRY.decode(msg.data)
                if not isinstance(decoded.event, ScheduleRequestV1):
                    raise ContractError("unknown_type", f"{decoded.envelope.type} is not a schedule request")
            except ContractError as exc:
                await self._reply(msg, ScheduleRequestAnsweredV1(accepted=False, reason=str(exc)))
                return
            answer: asyncio.Future[ScheduleRequestAnsweredV1] = asyncio.get_running_loop().create_future()
            requests.put_nowait(_Request(decoded.event, answer))
            wake.set()
            await self._reply(msg, await answer)

        stop = asyncio.Event()
        tasks = [asyncio.create_task(f.run(stop), name=f"follow-{f.domain}")
                 for f in (members, replication, changefeeds)]
        sub = await self.runtime.nc.subscribe(command_subject(DOMAIN), cb=on_request)
        discovered: dict[ChangefeedId, list[Span]] | None = None
        last_discovery = -1e9
        changefeeds_changed.set()
        log.info("scheduler leading", extra={"epoch": leadership.epoch,
                                             "replication_epoch": replication.state.epoch})
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=settings.scheduler_interval_s)
                wake.clear()
                now = time.monotonic()
                events: list[BaseModel] = []
                while not requests.empty():
                    item = requests.get_nowait()
                    reason, event = core.request(item.req, members.state, replication.state)
                    if event is not None:
                        await domain_log.append(event)
                        policy.appended()
                    REQUESTS.labels(item.req.kind, str(reason is None).lower()).inc()
                    item.answer.set_result(ScheduleRequestAnsweredV1(
                        accepted=reason is None, reason=reason or "",
                        leader=self.settings.instance_id))
                due = now - last_discovery >= settings.scheduler_discovery_interval_s
                if changefeeds_changed.is_set() or due:
                    changefeeds_changed.clear()
                    last_discovery = now
                    found = await self._discover(changefeeds.state)
                    if found is not None:
                        discovered = found
                if discovered is not None:
                    events.extend(core.spans_changes(discovered))
                for event in events:  # wanted spans first: the manager needs them before tasks
                    await domain_log.append(event)
                    policy.appended()
                for event in core.round(members.state, replication.state, now):
                    # The root of the task's trace: the manager's dispatches and the worker's
                    # handling continue it (context in the NATS headers).
                    with tracer().start_as_current_span(f"schedule {REGISTRY.key_of(type(event))[0]}"):
                        await domain_log.append(event)
                    policy.appended()
                    TASKS.labels(REGISTRY.key_of(type(event))[0]).inc()
                    log.info("recorded %s", REGISTRY.key_of(type(event))[0],
                             extra={"epoch": leadership.epoch, **event.model_dump(mode="json")})
                await policy.maybe_snapshot(domain_log)
                PENDING.set(len(core.pending))
                self._publish_status(core, members.state, replication.state)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while not requests.empty():
                item = requests.get_nowait()
                if not item.answer.done():
                    item.answer.set_result(ScheduleRequestAnsweredV1(
                        accepted=False, reason="the scheduler leader stepped down; try again"))
            self.runtime.status.pop("scheduling", None)

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

    def _publish_status(self, core: SchedulerCore, members: MembersState,
                        replication: ReplicationState) -> None:
        loads: dict[str, int] = {m: replication.index.load(m) for m in members.members}
        self.runtime.status["scheduling"] = {
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
        }
