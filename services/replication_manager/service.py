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
3. Then one loop, one input at a time, in order: heartbeats (core NATS; of each member only the
   newest waiting, ``LatestHeartbeats``), dispatch answers,
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
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
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
    MemberHeartbeatV3,
    MoveTableV1,
    RemoveTableV1,
    ReplicationAnnounceV1,
    SpansChangedV1,
)
from libs.config import Settings
from libs.control.changefeeds_state import ChangefeedView, changefeeds_fold
from libs.control.convert import dispatch_request, span_of
from libs.control.heartbeat_parts import ReportParts, decode_heartbeat, joined
from libs.control.members import MembersState, members_fold
from libs.control.replication_state import ReplicationState, replication_fold
from libs.control.schedule_state import ScheduleState, schedule_fold
from libs.control.snapshots import SnapshotPolicy
from libs.election import Leadership
from libs.eventstore import DomainLog, Fenced, LeaderLog, LeaseView, StoredEvent
from libs.leader_service import Entry, LeaderLoop
from libs.scheduling import Dispatch, SetState
from libs.service import ServiceRuntime
from libs.streams import (
    HEARTBEAT_PART_HEADER,
    HEARTBEAT_PARTIAL_HEADER,
    HEARTBEAT_SUBJECTS,
    HEARTBEAT_UNCHANGED_HEADER,
    announce_subject,
    dispatch_subject,
)
from libs.telemetry.tracing import extract_context, publish_span, tracer
from libs.ts import lag_seconds, ts_seconds
from services.replication_manager.core import Output, ReplicationCore
from services.replication_manager.syncpoints import SyncpointDriver

log = logging.getLogger(__name__)
_INPUTS_PER_TURN = 256
"""Inputs a turn handles at most before its tick records them: bounds how long the loop runs
without yielding, and how long a dispatch waits for the burst it follows from."""
_EAGER_CHECKPOINT_S = 0.05
"""Until a term first publishes a checkpoint: the shortest time between two looks at it."""

DOMAIN = "replication"

HEARTBEATS_SUPERSEDED = Counter("sluice_replication_heartbeats_superseded",
                                "Member heartbeats not handled: a newer one of the same member "
                                "arrived while they waited.")
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
        # Inputs in batches: what their handling records is appended as one pipelined burst
        # at the turn's tick (``ReplicationHandlers.handle``).
        async with LeaderLoop[Input, None](self.runtime, status_key=DOMAIN, batch=True,
                                           max_batch=_INPUTS_PER_TURN) as loop:
            members = loop.follow("members", members_fold, MembersState, restore=MembersState.restore,
                                  name="rm_members")
            schedule = loop.follow("schedule", schedule_fold, ScheduleState,
                                   restore=ScheduleState.restore, name="rm_schedule")
            # Tables stopped by an incident are left out of their changefeed's checkpoint.
            changefeeds = loop.follow("changefeeds", changefeeds_fold, ChangefeedView,
                                      name="rm_changefeeds")
            await loop.load()
            sender = _Sender(self, leadership, loop)
            handlers = ReplicationHandlers(leadership, domain_log, self.settings, members.state,
                                           schedule.state, started=started, send=sender.send,
                                           publish_status=loop.publish_status,
                                           stopped=lambda: changefeeds.state.stopped)
            sender.core = handlers.core
            handlers.syncpoints = SyncpointDriver(
                self.js, domain_log, handlers.core, specs=lambda: changefeeds.state.specs,
                running=lambda cf: changefeeds.state.states.get(cf) == "running",
                stopped=lambda: changefeeds.state.stopped)
            members.on_event = handlers.on_member
            schedule.on_event = handlers.on_schedule
            handlers.put = loop.inbox.put
            handlers.trace_of = sender.trace_of

            async def on_heartbeat(msg: Msg) -> None:
                # Decoded when its turn comes, and only the newest of each member: see
                # ``LatestHeartbeats``.
                if handlers.heartbeats.offer_message(msg.subject, msg.data, msg.headers):
                    loop.inbox.put(HeartbeatWaiting(msg.subject))

            loop.spawn(self._announce(leadership), name="rm-announce")
            await loop.subscribe(HEARTBEAT_SUBJECTS, on_heartbeat)
            await handlers.start()
            await loop.run(handlers.handle, handlers.tick, handlers.wait_s)

    async def _announce(self, leadership: Leadership) -> None:
        payload = REGISTRY.encode(ReplicationAnnounceV1(epoch=leadership.epoch,
                                                        candidate=self.settings.instance_id),
                                  producer=self.runtime.producer, epoch=leadership.epoch)
        while leadership.valid():
            with contextlib.suppress(Exception):
                await self.nc.publish(announce_subject(DOMAIN), payload)
            await asyncio.sleep(self.settings.heartbeat_interval_s)


@dataclass(frozen=True)
class HeartbeatWaiting:
    """The newest heartbeat on ``subject`` waits in ``LatestHeartbeats``."""

    subject: str


class LatestHeartbeats:
    """The newest heartbeats of each member not handled yet, as they arrived (bytes).

    A complete heartbeat is its member's whole report, and a partial one is cumulative since
    the member's last complete one (``libs.scheduling.report_delta``), so a newer complete one
    makes everything of the member waiting in the inbox worthless, and a newer partial one an
    older partial one: at most one of each waits per member, decoded and handled (complete
    first) at the place of the first one in the inbox. A partial one never replaces a waiting
    complete one: a rebuild takes only complete reports, and the complete one says which spans
    the member no longer holds. Which one a heartbeat is, its header says
    (``HEARTBEAT_PARTIAL_HEADER``), so nothing is decoded to decide. Heartbeats travel on core
    NATS (at most once), so the replication-manager never relied on seeing every one; what
    this changes is that a leader with a backlog (thousands of spans, five heartbeats a second
    per member, a busy machine) works through at most two reports per member instead of all of
    them, and its loop gets back to its lease."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[list[bytes] | None, list[bytes] | None]] = {}
        self.parts = ReportParts()
        """Reports cut into several messages (``libs.control.heartbeat_parts``): one waits here
        as a whole once all of its parts arrived."""

    def offer_message(self, subject: str, data: bytes, headers: Mapping[str, str] | None) -> bool:
        """``offer`` of a heartbeat message as it arrived; an unchanged one (liveness only, the
        member's last partial report again) is not a report and is left out."""
        headers = headers or {}
        if headers.get(HEARTBEAT_UNCHANGED_HEADER):
            return False
        return self.offer(subject, data, bool(headers.get(HEARTBEAT_PARTIAL_HEADER)),
                          headers.get(HEARTBEAT_PART_HEADER))

    def offer(self, subject: str, data: bytes, partial: bool = False, part: str | None = None) -> bool:
        """Keep ``data`` as the newest complete or partial heartbeat of ``subject``; True when
        nothing of it was waiting (the caller then queues one ``HeartbeatWaiting``). ``part``:
        its ``HEARTBEAT_PART_HEADER``, a part of a report that waits only once it is whole."""
        if part is None:
            self.parts.single(subject)
            report = [data]
        else:
            whole = self.parts.add(subject, data, partial, part)
            if whole is None:
                return False
            report = whole
        waiting = self._waiting.get(subject)
        if waiting is None:
            self._waiting[subject] = (None, report) if partial else (report, None)
            return True
        complete, older = waiting
        if partial:
            if older is not None:
                HEARTBEATS_SUPERSEDED.inc()
            self._waiting[subject] = (complete, report)
        else:
            HEARTBEATS_SUPERSEDED.inc((complete is not None) + (older is not None))
            self._waiting[subject] = (report, None)
        return False

    def take(self, subject: str) -> list[MemberHeartbeatV3]:
        """What waits of ``subject``, decoded, complete first; the undecodable left out (a report
        in parts as one heartbeat, left out whole if any part is)."""
        out = []
        for report in self._waiting.pop(subject, (None, None)):
            if report is None:
                continue
            events = []
            for data in report:
                try:
                    events.append(decode_heartbeat(data))
                except ContractError:
                    break  # the member service dead-letters bad heartbeats; one place is enough
            else:
                hb = joined(events)
                if hb is not None and not hb.unchanged:
                    out.append(hb)
        return out

    def __len__(self) -> int:
        return len(self._waiting)


Input = (MemberHeartbeatV3 | HeartbeatWaiting | DispatchResponseV1 | MemberJoinedV2 | MemberLeftV1
         | SpansChangedV1 | AddTableV1 | MoveTableV1 | RemoveTableV1)
"""What the manager's loop takes, one at a time and in order: heartbeats (core NATS; the newest
of each member, ``LatestHeartbeats``), dispatch answers, member joined/left (members stream),
wanted spans and tasks (schedule stream)."""


class ReplicationHandlers:
    """One term's handlers: each input and tick goes to the ``ReplicationCore``; its events are
    appended (fenced), then its dispatches sent."""

    def __init__(self, leadership: LeaseView, domain_log: LeaderLog, settings: Settings,
                 members: MembersState, schedule: ScheduleState, *, started: float,
                 send: Callable[[Dispatch], None],
                 publish_status: Callable[[dict[str, Any] | Callable[[], dict[str, Any]]], None],
                 stopped: Callable[[], Collection[tuple[str, str, str, str]]] = tuple) -> None:
        recorded = domain_log.state
        assert isinstance(recorded, ReplicationState)
        self.epoch = leadership.epoch
        self.domain_log = domain_log
        self.settings = settings
        self.started = started
        self.send = send
        self.publish_status = publish_status
        self.put: Callable[[Input], None] = lambda _item: None
        self.trace_of: dict[Any, Any] = {}
        self.heartbeats = LatestHeartbeats()
        alive = {m: rec.incarnation for m, rec in members.members.items()}
        self.core = ReplicationCore(leadership.epoch, alive=alive, known_spans=recorded.known_spans(),
                                    recorded=recorded.sets, checkpoints=recorded.checkpoints,
                                    wanted=schedule.wanted,
                                    max_task_concurrency=settings.scheduler_max_task_concurrency,
                                    started_at=started,
                                    prepare_timeout_s=settings.replication_prepare_timeout_s,
                                    stopped=stopped)
        log.info("replication-manager leading; waiting for the live members' reports", extra={
            "epoch": leadership.epoch, "awaiting": sorted(self.core.manager.awaiting),
            "known_spans": len(recorded.sets), "replay_s": round(time.monotonic() - started, 3)})
        self.policy = SnapshotPolicy(settings.control_snapshot_every)
        self.policy.opened(domain_log)
        self.last_tick = self.last_checkpoint = self.last_syncpoint = time.monotonic()
        self.advanced = False
        self.last_eager = 0.0
        self.pending = Output()
        """What the turn's inputs produced, recorded at its tick (``flush``)."""
        self.syncpoints: SyncpointDriver | None = None
        """Consistent points across each changefeed's tables (``syncpoint_interval``)."""

    def on_member(self, stored: StoredEvent) -> None:
        if isinstance(stored.event, MemberJoinedV2 | MemberLeftV1):
            self.put(stored.event)

    def on_schedule(self, stored: StoredEvent) -> None:
        if isinstance(stored.event, AddTableV1 | MoveTableV1 | RemoveTableV1):
            # Every dispatch for this span joins the trace of the task that asked for it.
            self.trace_of[span_of(stored.event.span)] = extract_context(stored.headers)
        if isinstance(stored.event, SpansChangedV1 | AddTableV1 | MoveTableV1 | RemoveTableV1):
            self.put(stored.event)

    async def record(self, out: Output) -> None:
        """Append ``out``'s events (pipelined), then send its dispatches: an action is sent only
        once what it follows from is in the log."""
        await self.domain_log.append_many(out.events)
        for _ in out.events:
            self.policy.appended()
        for d in out.dispatches:
            self.send(d)

    async def flush(self) -> None:
        """Record what the turn's inputs produced (``handle`` keeps it until here)."""
        pending, self.pending = self.pending, Output()
        await self.record(pending)

    async def start(self) -> None:
        await self.record(self.core.start(time.monotonic()))

    def wait_s(self) -> float:
        settings = self.settings
        return max(0.01, min(self.last_tick + settings.replication_tick_s,
                             self.last_checkpoint + settings.replication_checkpoint_interval_s,
                             self.last_syncpoint + settings.replication_syncpoint_tick_s)
                   - time.monotonic())

    async def handle(self, entry: Entry[Input, None]) -> None:
        core, domain_log = self.core, self.domain_log
        now = time.monotonic()
        was_ready = core.ready
        out = self._handle(entry.item, now)
        if core.manager.deposed:
            raise Fenced(domain_log.stream, domain_log.events_subject, domain_log.last_seq,
                         "a member has seen a newer replication-manager epoch")
        # Recorded at the turn's tick with the other inputs' events, in one pipelined burst:
        # appended one by one, each waiting for its ack, a changefeed's start of thousands of
        # spans was paced by the round trips. A dispatch still goes out only after its events.
        self.pending.extend(out)
        if core.ready and not was_ready:
            REBUILD_SECONDS.observe(now - self.started)
            log.info("rebuilt from the members' reports", extra={
                "epoch": self.epoch, "sets": len(core.manager.sets),
                "waited_s": round(now - self.started, 3)})

    def _handle(self, item: Input, now: float) -> Output:
        core = self.core
        if isinstance(item, HeartbeatWaiting):
            out = Output()
            for heartbeat in self.heartbeats.take(item.subject):
                out.extend(core.on_heartbeat(heartbeat, now))
            return out
        if isinstance(item, MemberHeartbeatV3):
            return core.on_heartbeat(item, now)
        if isinstance(item, DispatchResponseV1):
            return core.on_answer(item, now)
        if isinstance(item, MemberJoinedV2):
            return core.on_member_joined(item.member_id, item.incarnation, now)
        if isinstance(item, MemberLeftV1):
            return core.on_member_left(item.member_id, item.incarnation, now)
        if isinstance(item, SpansChangedV1):
            core.on_spans_changed(item.changefeed, [span_of(s) for s in item.spans])
            return Output()
        return core.on_task(item, now)

    async def tick(self) -> None:
        await self.flush()  # before anything below appends or snapshots
        core, settings = self.core, self.settings
        now = time.monotonic()
        if now - self.last_tick >= settings.replication_tick_s:
            self.last_tick = now
            await self.record(core.tick(now))
        if self.syncpoints is not None and now - self.last_syncpoint >= settings.replication_syncpoint_tick_s:
            self.last_syncpoint = now
            await self.syncpoints.tick()
        # Until this term has published a checkpoint, look soon after each input (the first
        # report that moves the slowest span); from then on at most every interval. "Soon" is
        # bounded too: the minimum runs over every span, and a changefeed's start (thousands of
        # spans added, none checkpointed yet) sends an input every few milliseconds.
        due = now - self.last_checkpoint >= settings.replication_checkpoint_interval_s
        eager = core.ready and not self.advanced and now - self.last_eager >= _EAGER_CHECKPOINT_S
        if due or eager:
            self.last_eager = now
            events = core.checkpoint_events()
            for event in events:
                await self.domain_log.append(event)
                self.policy.appended()
                CHECKPOINT_TIME.labels(event.changefeed).set(ts_seconds(event.checkpoint_ts))
            if events:
                self.advanced = True
                self.last_checkpoint = now
            if due:
                self.last_checkpoint = now
                await self.policy.maybe_snapshot(self.domain_log)
                self._publish_status()

    def _publish_status(self) -> None:
        core = self.core
        by_state: dict[str, int] = {s.value: 0 for s in SetState}
        per_member: dict[str, int] = dict.fromkeys(core.incarnations, 0)
        for rs in core.manager.sets.values():
            by_state[rs.state.value] += 1
            if rs.primary is not None:
                per_member[rs.primary] = per_member.get(rs.primary, 0) + 1
        for state, n in by_state.items():
            SETS.labels(state).set(n)
        MEMBER_SPANS.clear()  # members that left drop out
        for member, n in per_member.items():
            MEMBER_SPANS.labels(member).set(n)
        for cf, cp in core.tracker.changefeeds.items():
            CHECKPOINT_LAG.labels(cf).set(lag_seconds(cp.checkpoint_ts))
        CONFLICTS.set(len(core.manager.errors))
        # Every span's placement: built when /healthz asks (libs.service), not every interval.
        self.publish_status(self._status)

    def _status(self) -> dict[str, Any]:
        core = self.core
        by_state: dict[str, int] = {s.value: 0 for s in SetState}
        placement: dict[str, str | None] = {}
        for span, rs in core.manager.sets.items():
            by_state[rs.state.value] += 1
            placement[span.key] = rs.primary
        return {
            "epoch": self.epoch, "ready": core.ready,
            "awaiting_reports_from": sorted(core.manager.awaiting),
            "members": dict(sorted(core.incarnations.items())),
            "sets": by_state, "placement": placement,
            "checkpoints": {cf: {"checkpoint_ts": cp.checkpoint_ts, "resolved_ts": cp.resolved_ts}
                            for cf, cp in core.tracker.changefeeds.items()},
            "checkpoint_blocked": core.blocked(),
            "syncpoints": self.syncpoints.status() if self.syncpoints is not None else {},
            "conflicts": [str(e) for e in core.manager.errors],
            "ignored_reports": core.ignored_reports,
            "stale_reports": core.manager.stale_reports,
            "prepare_timeouts": core.manager.prepare_timeouts,
            "preparing": {span.key: {"member": member, "seconds_left": left} for span, (member, left)
                          in sorted(core.manager.prepare_deadlines(time.monotonic()).items())},
        }


class ResendGate:
    """Which dispatches go out: never one identical to a dispatch still on its way, and for
    ``resend_s`` not one identical to a dispatch its member accepted (or already had).

    Ticks resend the step every unstable set waits for; a member that accepted a step works on
    it (a prepare may take minutes: the initial load) and its heartbeats carry the outcome, so
    sending it again each tick only repeats the same answer. With thousands of spans preparing
    at once that repetition was thousands of requests a tick, which kept the leader's loop too
    busy to renew its lease (BENCHMARKS.md, "10,000 tables"). A dispatch unanswered, timed out
    or refused is resent at the next tick as before; keys carry the member's incarnation, so a
    restarted member gets the step at once. Keys are tuples whose last item is the action: an
    accepted action forgets the accepted others of the same key prefix (member, incarnation,
    span), so a step taken again after another one (prepare, then remove, then prepare again:
    a span moved back to the member it was leaving) goes out at once instead of waiting out
    ``resend_s`` behind the first prepare's accept (a worker killed mid-move had a span wait
    8.7 s for its new owner so)."""

    ACCEPTED = frozenset({"accepted", "duplicate"})

    def __init__(self, resend_s: float) -> None:
        self.resend_s = resend_s
        self.inflight: set[Hashable] = set()
        self._accepted: dict[Hashable, float] = {}
        self._steps: dict[Hashable, set[Hashable]] = {}
        """Key prefix (all but the action) -> its accepted key (one at a time; a set as the
        clean-up rebuilds it)."""
        self._clean_above = 1024
        self.cleanups = 0

    def take(self, key: Hashable, now: float) -> bool:
        """Whether to send ``key`` now (then it is in flight until ``done``)."""
        if key in self.inflight:
            return False
        at = self._accepted.get(key)
        if at is not None and now - at < self.resend_s:
            return False
        self.inflight.add(key)
        return True

    def done(self, key: Hashable, now: float, verdict: str | None) -> None:
        """``key``'s request ended with ``verdict`` (None: no answer)."""
        self.inflight.discard(key)
        if verdict in self.ACCEPTED:
            if isinstance(key, tuple) and len(key) > 1:
                for other in self._steps.get(key[:-1], set()) - {key}:
                    self._accepted.pop(other, None)
                self._steps[key[:-1]] = {key}
            self._accepted[key] = now
            if len(self._accepted) > self._clean_above:
                # Entries past resend_s gate nothing any more. The next clean-up waits until the
                # map has doubled: cleaning whenever it was large re-read all of it for every
                # accept while 10,000 spans prepared at once (fresh entries stay), which stalled
                # the leader's loop for seconds and cost it its lease.
                self._accepted = {k: t for k, t in self._accepted.items() if now - t < self.resend_s}
                self._steps = {}
                for k in self._accepted:
                    if isinstance(k, tuple) and len(k) > 1:
                        self._steps.setdefault(k[:-1], set()).add(k)
                self._clean_above = max(1024, 2 * len(self._accepted))
                self.cleanups += 1
        else:
            self._accepted.pop(key, None)

    def __len__(self) -> int:
        return len(self._accepted)


class _Sender:
    """Sends dispatches as request/reply, each in its own task; answers go back to the loop.

    ``ResendGate`` says which: an identical dispatch on its way, or accepted a moment ago, is
    not sent again (the member treats duplicates as no-ops anyway: this saves the traffic and
    the leader's time)."""

    def __init__(self, service: ReplicationService, leadership: Leadership,
                 loop: LeaderLoop[Input, None]) -> None:
        self.service = service
        self.leadership = leadership
        self.loop = loop
        self.core: ReplicationCore | None = None
        self.trace_of: dict[Any, Any] = {}
        """span -> trace context of the newest schedule task for it (one entry per span)."""
        self.gate = ResendGate(service.settings.dispatch_resend_s)

    def send(self, d: Dispatch) -> None:
        if self.core is None:
            return
        incarnation = self.core.incarnations.get(d.member)
        if incarnation is None:
            return  # left meanwhile; the set already knows
        key = (d.member, incarnation, d.span, d.action.value)
        if not self.gate.take(key, time.monotonic()):
            return
        self.loop.spawn(self._request(d, incarnation, key))

    async def _request(self, d: Dispatch, incarnation: str, key: Hashable) -> None:
        service = self.service
        verdict: str | None = None
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
            verdict = answer.verdict
            # One line per step taken; repeats ("duplicate") only at debug: with thousands of
            # spans they were most of the leader's log.
            log.log(logging.DEBUG if verdict == "duplicate" else logging.INFO, "dispatch answered", extra={
                "member": d.member, "span": d.span.key, "action": d.action.value, "epoch": d.epoch,
                "verdict": verdict, "state": answer.status.state})
            self.loop.inbox.put(answer)
        except Exception:
            log.warning("dispatch failed", exc_info=True, extra={"member": d.member, "span": d.span.key})
        finally:
            self.gate.done(key, time.monotonic(), verdict)
