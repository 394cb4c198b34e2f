"""The replication-manager leader: owns every span's ReplicationSet and drives two-phase
scheduling on the members.

A term:

1. The domain log replays the replication stream (newest snapshot + the events after it):
   recorded sets, published checkpoints. The members and schedule streams are replayed the
   same way: who is alive (with incarnation), which spans each changefeed wants.
2. It announces its epoch on ``announce_subject("replication")`` (every heartbeat interval);
   members fence older epochs from then on and answer with a heartbeat of this epoch. Nothing
   is dispatched until every member alive at takeover has sent one (or has left): the sets are
   then rebuilt from the members' own reports, with the replayed checkpoints as floors.
3. Then one loop, one input at a time, in order: heartbeats (core NATS), dispatch answers,
   member joined/left (members stream), wanted spans and tasks (schedule stream, read from
   where the replay ended), ticks. Each input returns dispatches, sent as request/reply on
   ``dispatch_subject(member)`` carrying this epoch and the member's incarnation, and events
   appended (fenced) to the replication stream. Checkpoint advances are recorded at most every
   ``replication_checkpoint_interval_s``, except the term's first, looked for after every input
   once the sets are rebuilt (a failover should not also wait an interval).

The lease is checked before every dispatch: a leader that was stopped past its lease never
sends one after it resumes, and a member that has seen a newer epoch refuses one that was
already on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Counter, Gauge, Histogram

from contracts import REGISTRY, ContractError
from contracts.events.members import MemberJoinedV2, MemberLeftV1
from contracts.events.scheduling import (
    AddTableV1,
    DispatchResponseV1,
    MemberHeartbeatV1,
    MoveTableV1,
    RemoveTableV1,
    ReplicationAnnounceV1,
    SpansChangedV1,
)
from libs.control.convert import dispatch_request, span_of
from libs.control.follow import DomainFollower
from libs.control.members import MembersState, members_fold
from libs.control.replication_state import ReplicationState, replication_fold
from libs.control.schedule_state import ScheduleState, schedule_fold
from libs.control.snapshots import SnapshotPolicy
from libs.election import Leadership
from libs.eventstore import DomainLog, Fenced, StoredEvent
from libs.scheduling import Dispatch, SetState
from libs.service import ServiceRuntime
from libs.streams import HEARTBEAT_SUBJECTS, announce_subject, dispatch_subject
from libs.telemetry.tracing import extract_context, publish_span, tracer
from libs.ts import lag_seconds, ts_seconds
from services.replication_manager.core import Output, ReplicationCore

log = logging.getLogger(__name__)

DOMAIN = "replication"

DISPATCHES = Counter("sluice_replication_dispatches", "Dispatches sent, by action and outcome.",
                     ["action", "outcome"])
REBUILD_SECONDS = Histogram("sluice_replication_rebuild_seconds",
                            "From winning the lease to the rebuilt sets (replay + waiting for reports).",
                            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
SETS = Gauge("sluice_replication_sets", "Replication sets by state.", ["state"])
CHECKPOINT_TIME = Gauge("sluice_replication_checkpoint_timestamp_seconds",
                        "Commit time (Unix seconds) of the published changefeed checkpoint ts.",
                        ["changefeed"])
CONFLICTS = Gauge("sluice_replication_conflicts", "Spans more than one member may be writing.")
CHECKPOINT_LAG = Gauge("sluice_changefeed_checkpoint_lag_seconds",
                       "Wall clock minus the commit time of the changefeed's published checkpoint.",
                       ["changefeed"])
MEMBER_SPANS = Gauge("sluice_replication_member_spans", "Spans whose primary is this member.", ["member"])


class ReplicationService:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.nc = runtime.nc
        self.js = runtime.nc.jetstream()

    def make_log(self) -> DomainLog[ReplicationState]:
        return DomainLog(self.js, DOMAIN, producer=self.runtime.producer, fold=replication_fold,
                         initial=ReplicationState(), restore=ReplicationState.restore,
                         dump=ReplicationState.dump, settings=self.settings)

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None:
        started = time.monotonic()
        settings = self.settings
        recorded = domain_log.state
        assert isinstance(recorded, ReplicationState)
        inputs: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def on_member(stored: StoredEvent) -> None:
            if isinstance(stored.event, MemberJoinedV2 | MemberLeftV1):
                inputs.put_nowait(("member", stored.event))

        def on_schedule(stored: StoredEvent) -> None:
            if isinstance(stored.event, AddTableV1 | MoveTableV1 | RemoveTableV1):
                # Every dispatch for this span joins the trace of the task that asked for it.
                sender.trace_of[span_of(stored.event.span)] = extract_context(stored.headers)
            if isinstance(stored.event, SpansChangedV1 | AddTableV1 | MoveTableV1 | RemoveTableV1):
                inputs.put_nowait(("schedule", stored.event))

        sender = _Sender(self, leadership)
        members = DomainFollower(self.js, "members", members_fold, MembersState, restore=MembersState.restore,
                                 on_event=on_member, name="rm_members", settings=settings)
        schedule = DomainFollower(self.js, "schedule", schedule_fold, ScheduleState,
                                  restore=ScheduleState.restore, on_event=on_schedule, name="rm_schedule",
                                  settings=settings)
        await members.load()
        await schedule.load()
        alive = {m: rec.incarnation for m, rec in members.state.members.items()}
        core = ReplicationCore(leadership.epoch, alive=alive, known_spans=recorded.known_spans(),
                               recorded=recorded.sets, checkpoints=recorded.checkpoints,
                               wanted=schedule.state.wanted,
                               max_task_concurrency=settings.scheduler_max_task_concurrency,
                               started_at=started,
                               prepare_timeout_s=settings.replication_prepare_timeout_s)
        sender.core = core
        log.info("replication-manager leading; waiting for the live members' reports", extra={
            "epoch": leadership.epoch, "awaiting": sorted(core.manager.awaiting),
            "known_spans": len(recorded.sets), "replay_s": round(time.monotonic() - started, 3)})
        policy = SnapshotPolicy(settings.control_snapshot_every)
        policy.opened(domain_log)

        async def on_heartbeat(msg: Msg) -> None:
            try:
                decoded = REGISTRY.decode(msg.data)
            except ContractError:
                return  # the member service dead-letters bad heartbeats; one place is enough
            if isinstance(decoded.event, MemberHeartbeatV1):
                inputs.put_nowait(("heartbeat", decoded.event))

        stop = asyncio.Event()
        background = [
            asyncio.create_task(members.run(stop), name="rm-follow-members"),
            asyncio.create_task(schedule.run(stop), name="rm-follow-schedule"),
            asyncio.create_task(self._announce(leadership), name="rm-announce"),
        ]
        sub = await self.nc.subscribe(HEARTBEAT_SUBJECTS, cb=on_heartbeat)
        sender.inputs = inputs
        last_tick = last_checkpoint = time.monotonic()
        advanced = False

        async def record(out: Output) -> None:
            for event in out.events:
                await domain_log.append(event)
                policy.appended()
            for d in out.dispatches:
                sender.send(d)

        try:
            await record(core.start(time.monotonic()))
            while True:
                timeout = max(0.01, min(last_tick + settings.replication_tick_s,
                                        last_checkpoint + settings.replication_checkpoint_interval_s)
                              - time.monotonic())
                try:
                    kind, item = await asyncio.wait_for(inputs.get(), timeout=timeout)
                except TimeoutError:
                    kind, item = "idle", None
                now = time.monotonic()
                was_ready = core.ready
                out = self._handle(core, kind, item, now)
                if core.manager.deposed:
                    raise Fenced(domain_log.stream, domain_log.events_subject, domain_log.last_seq,
                                 "a member has seen a newer replication-manager epoch")
                await record(out)
                if core.ready and not was_ready:
                    REBUILD_SECONDS.observe(now - started)
                    log.info("rebuilt from the members' reports", extra={
                        "epoch": leadership.epoch, "sets": len(core.manager.sets),
                        "waited_s": round(now - started, 3)})
                if now - last_tick >= settings.replication_tick_s:
                    last_tick = now
                    await record(core.tick(now))
                # Until this term has published a checkpoint, look after every input (the first
                # report that moves the slowest span); from then on at most every interval.
                due = now - last_checkpoint >= settings.replication_checkpoint_interval_s
                if due or (core.ready and not advanced):
                    events = core.checkpoint_events()
                    for event in events:
                        await domain_log.append(event)
                        policy.appended()
                        CHECKPOINT_TIME.labels(event.changefeed).set(ts_seconds(event.checkpoint_ts))
                    if events:
                        advanced = True
                        last_checkpoint = now
                    if due:
                        last_checkpoint = now
                        await policy.maybe_snapshot(domain_log)
                        self._publish_status(core, leadership)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            for t in background:
                t.cancel()
            await sender.close()
            await asyncio.gather(*background, return_exceptions=True)
            self.runtime.status.pop("replication", None)

    def _handle(self, core: ReplicationCore, kind: str, item: Any, now: float) -> Output:
        if kind == "heartbeat":
            return core.on_heartbeat(item, now)
        if kind == "answer":
            return core.on_answer(item, now)
        if kind == "member":
            if isinstance(item, MemberJoinedV2):
                return core.on_member_joined(item.member_id, item.incarnation, now)
            return core.on_member_left(item.member_id, item.incarnation, now)
        if kind == "schedule":
            if isinstance(item, SpansChangedV1):
                core.on_spans_changed(item.changefeed, [span_of(s) for s in item.spans])
                return Output()
            return core.on_task(item, now)
        return Output()

    async def _announce(self, leadership: Leadership) -> None:
        payload = REGISTRY.encode(ReplicationAnnounceV1(epoch=leadership.epoch,
                                                        candidate=self.settings.instance_id),
                                  producer=self.runtime.producer, epoch=leadership.epoch)
        while leadership.valid():
            with contextlib.suppress(Exception):
                await self.nc.publish(announce_subject(DOMAIN), payload)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def _publish_status(self, core: ReplicationCore, leadership: Leadership) -> None:
        by_state: dict[str, int] = {s.value: 0 for s in SetState}
        placement: dict[str, str | None] = {}
        for span, rs in core.manager.sets.items():
            by_state[rs.state.value] += 1
            placement[span.key] = rs.primary
        for state, n in by_state.items():
            SETS.labels(state).set(n)
        per_member: dict[str, int] = dict.fromkeys(core.incarnations, 0)
        for primary in placement.values():
            if primary is not None:
                per_member[primary] = per_member.get(primary, 0) + 1
        MEMBER_SPANS.clear()  # members that left drop out
        for member, n in per_member.items():
            MEMBER_SPANS.labels(member).set(n)
        for cf, cp in core.tracker.changefeeds.items():
            CHECKPOINT_LAG.labels(cf).set(lag_seconds(cp.checkpoint_ts))
        errors = core.manager.errors
        CONFLICTS.set(len(errors))
        self.runtime.status["replication"] = {
            "epoch": leadership.epoch, "ready": core.ready,
            "awaiting_reports_from": sorted(core.manager.awaiting),
            "members": dict(sorted(core.incarnations.items())),
            "sets": by_state, "placement": placement,
            "checkpoints": {cf: {"checkpoint_ts": cp.checkpoint_ts, "resolved_ts": cp.resolved_ts}
                            for cf, cp in core.tracker.changefeeds.items()},
            "checkpoint_blocked": core.blocked(),
            "conflicts": [str(e) for e in errors],
            "ignored_reports": core.ignored_reports,
            "stale_reports": core.manager.stale_reports,
            "prepare_timeouts": core.manager.prepare_timeouts,
            "preparing": {span.key: {"member": member, "seconds_left": left} for span, (member, left)
                          in sorted(core.manager.prepare_deadlines(time.monotonic()).items())},
        }


class _Sender:
    """Sends dispatches as request/reply, each in its own task; answers go back to the loop.

    An identical dispatch already on its way is not sent twice (ticks resend what is still
    missing; the member treats duplicates as no-ops anyway, this only saves traffic)."""

    def __init__(self, service: ReplicationService, leadership: Leadership) -> None:
        self.service = service
        self.leadership = leadership
        self.core: ReplicationCore | None = None
        self.trace_of: dict[Any, Any] = {}
        """span -> trace context of the newest schedule task for it (one entry per span)."""
        self.inputs: asyncio.Queue[tuple[str, Any]] | None = None
        self._inflight: set[tuple[str, object, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, d: Dispatch) -> None:
        key = (d.member, d.span, d.action.value)
        if key in self._inflight or self.core is None:
            return
        incarnation = self.core.incarnations.get(d.member)
        if incarnation is None:
            return  # left meanwhile; the set already knows
        self._inflight.add(key)
        task = asyncio.create_task(self._request(d, incarnation, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request(self, d: Dispatch, incarnation: str, key: tuple[str, object, str]) -> None:
        service = self.service
        try:
            if not self.leadership.valid():
                DISPATCHES.labels(d.action.value, "not-leader").inc()
                return
            payload = REGISTRY.encode(dispatch_request(d, incarnation), producer=service.runtime.producer,
                                      epoch=d.epoch)
            subject = dispatch_subject(d.member)
            with tracer().start_as_current_span(
                    f"dispatch {d.action.value}", context=self.trace_of.get(d.span),
                    attributes={"sluice.span": d.span.key, "sluice.member": d.member,
                                "sluice.epoch": d.epoch}), \
                    publish_span(subject, {}) as (_span, headers):
                try:
                    msg = await service.nc.request(subject, payload, headers=headers,
                                                   timeout=service.settings.dispatch_timeout_s)
                except (TimeoutError, NatsTimeoutError):
                    DISPATCHES.labels(d.action.value, "timeout").inc()
                    return
                except NoRespondersError:
                    DISPATCHES.labels(d.action.value, "no-responders").inc()
                    return
            try:
                decoded = REGISTRY.decode(msg.data)
            except ContractError as exc:
                log.warning("undecodable dispatch answer", extra={"member": d.member, "reason": str(exc)})
                DISPATCHES.labels(d.action.value, "bad-answer").inc()
                return
            answer = decoded.event
            if not isinstance(answer, DispatchResponseV1):
                DISPATCHES.labels(d.action.value, "bad-answer").inc()
                return
            DISPATCHES.labels(d.action.value, answer.verdict).inc()
            log.info("dispatch answered", extra={
                "member": d.member, "span": d.span.key, "action": d.action.value, "epoch": d.epoch,
                "verdict": answer.verdict, "state": answer.status.state})
            if self.inputs is not None:
                self.inputs.put_nowait(("answer", answer))
        except Exception:
            log.warning("dispatch failed", exc_info=True, extra={"member": d.member, "span": d.span.key})
        finally:
            self._inflight.discard(key)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
