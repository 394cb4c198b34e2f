"""The sink-worker's agent: the member side of two-phase scheduling (TiCDC's Agent).

It wraps ``libs.scheduling.MemberAgentState`` (what a member accepts and what its tables go
through) and connects it to NATS and to the worker's pipeline:

- heartbeats: every ``heartbeat_interval_s`` (and at once after any table transition, a round
  that moved a checkpoint or a new leader's announce) a ``member.heartbeat`` on
  ``heartbeat_subject(member)`` with the member id, this process' incarnation (a fresh uuid
  per start), its address, whether it drains or leaves, the newest replication-manager epoch
  it has seen, a sequence number and every span's state, checkpoint and resolved ts. The
  member service reads it as liveness, the replication-manager as the member's complete report.
- dispatches: request/reply on ``dispatch_subject(member)``. A dispatch for another
  incarnation (meant for this member id's previous process) or from an epoch older than the
  newest seen is refused and counted (``sluice_sink_dispatches_total{verdict}``,
  ``sluice_sink_stale_epoch_rejections_total``). The answer carries the span's state right
  after the dispatch; whatever happens later (prepared, stopped) goes out with the next
  heartbeat, which is sent at once.
- announces: ``replication.announce`` tells the agent about a new leader's epoch before its
  first dispatch, so the old leader is fenced from then on and the new one gets a report of
  its epoch (its rebuild waits for one from every member).

The pipeline side, driven by the worker between rounds (``between_rounds``):

- Preparing: ``Pipeline.prepare`` in a task of its own, concurrently with rounds (it only
  reads); then Prepared, or Replicating at once when the add-commit came meanwhile.
- Replicating: the span is in the pipeline's spans and written every round.
- Stopping: removed from the pipeline between rounds (never while a round may be writing it),
  its final checkpoint stored, then Stopped with that checkpoint: the next primary starts
  exactly there.

Draining (SIGTERM): the heartbeat says ``draining``; the scheduler moves the spans away while
the worker keeps replicating them; the worker stops the rest when the drain time is up and
sends a last heartbeat with ``leaving`` so the member service records it as gone at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from contracts import REGISTRY, ContractError
from contracts.events.scheduling import (
    DispatchRequestV1,
    DispatchResponseV1,
    MemberHeartbeatV3,
    ReplicationAnnounceV1,
    TableStatusV1,
)
from libs.changefeeds import ChangefeedView
from libs.concurrency import cancel_and_wait
from libs.control.convert import dispatch_of, status_ref
from libs.control.heartbeat_parts import heartbeat_messages
from libs.nats_client import flush_within
from libs.scheduling import AgentOutcome, AgentVerdict, MemberAgentState, TableState, TableStatus
from libs.scheduling.model import Span
from libs.scheduling.report_delta import ReportDelta
from libs.streams import (
    LEADER_BUCKET,
    announce_subject,
    dispatch_subject,
    heartbeat_subject,
    member_probe_subject,
)
from libs.telemetry.tracing import inject_headers, process_span
from services.sink_worker.fence import SelfFence
from services.sink_worker.prepare_progress import Phase
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.span.runtime import SpanConfig

log = logging.getLogger(__name__)

REPLICATION = "replication"
# The replication-manager's lease key in the leader bucket (its service name).
_RM_LEASE_KEY = "replication-manager"

DISPATCHES = Counter("sluice_sink_dispatches", "Dispatches this member answered, by action and verdict.",
                     ["action", "verdict"])
STALE_REJECTIONS = Counter("sluice_sink_stale_epoch_rejections",
                           "Dispatches and announces refused because a newer leader epoch was seen.")
AGENT_TABLES = Gauge("sluice_sink_agent_tables", "Spans this member holds, by agent state.", ["state"])
SEEN_EPOCH = Gauge("sluice_sink_seen_epoch", "Newest replication-manager epoch this member has seen.")
FENCED = Counter("sluice_sink_fenced", "Times this worker fenced itself (heartbeats not confirmed in time) "
                 "and started over as a new incarnation.")


def config_of(view: ChangefeedView, changefeed: str, source: str = "") -> SpanConfig | None:
    spec = view.specs.get(changefeed)
    if spec is None:
        return None
    return SpanConfig.of(spec, source)


async def current_epoch(js: JetStreamContext, key: str = _RM_LEASE_KEY) -> int:
    """The replication-manager leader's epoch from its lease, or 0. A restarted member starts
    from it, so a deposed leader cannot get a dispatch accepted before the member hears from
    the current one."""
    try:
        kv = await js.key_value(LEADER_BUCKET)
        entry = await kv.get(key)
        body = json.loads(entry.value or b"{}")
        return int(body.get("epoch") or 0) or int(entry.revision or 0)
    except Exception:
        return 0


class WriterLog:
    """JSON lines, one per span and round that wrote downstream: who wrote which ts range when.
    An audit trail (and how the tests prove that no two members write one span at once)."""

    def __init__(self, path: str | None, member: str, incarnation: str) -> None:
        self.path = Path(path) if path else None
        self.member = member
        self.incarnation = incarnation

    def _line(self, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"member": self.member, "incarnation": self.incarnation, **fields})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def wrote(self, span: Span, from_ts: int, to_ts: int, rows: int, t0: float, t1: float) -> None:
        """A round that started at ``t0`` and ended at ``t1`` wrote ``span`` from ``from_ts``."""
        self._line(event="wrote", span=span.key, from_ts=from_ts, to_ts=to_ts, rows=rows, t0=t0, t1=t1)

    def started(self, span: Span, checkpoint_ts: int) -> None:
        """This member runs ``span`` from ``checkpoint_ts`` (before its first round)."""
        self._line(event="started", span=span.key, checkpoint_ts=checkpoint_ts, t=time.time())

    def stopped(self, span: Span, checkpoint_ts: int | None) -> None:
        """This member stopped ``span`` and will write nothing more: the hand-over point."""
        self._line(event="stopped", span=span.key, checkpoint_ts=checkpoint_ts, t=time.time())


class SinkAgent:
    def __init__(self, nc: Client, *, member_id: str, address: str, heartbeat_interval_s: float,
                 wake: asyncio.Event | None = None, writer_log: str | None = None,
                 producer: str = "", fence_s: float | None = None, heartbeat_complete_s: float = 1.0,
                 heartbeat_nc: Client | None = None) -> None:
        self.nc = nc
        self.hb_nc = heartbeat_nc or nc
        """The connection heartbeats go on and the fence counts confirmations and reconnects of:
        the worker's own by default; the service gives it one of its own, so that the server's
        answer to a heartbeat's flush never waits behind a round's thousands of requests and
        replies on the data connection (a worker writing to 3,000 tables fenced itself so)."""
        self.member_id = member_id
        self.incarnation = uuid4().hex
        self.address = address
        self.heartbeat_interval_s = heartbeat_interval_s
        self.wake = wake or asyncio.Event()
        """Set when the worker should run ``between_rounds`` soon (the worker replaces it)."""
        self.producer = producer or f"sink-worker/{member_id}"
        # Wall-clock nanoseconds: a process restarting under the same id starts above its
        # previous life's sequence numbers.
        self.state = MemberAgentState(member_id, seq_start=time.time_ns())
        self.draining = False
        self.leaving = False
        self.writer_log = WriterLog(writer_log, member_id, self.incarnation)
        self._beat_now = asyncio.Event()
        self.delta = ReportDelta(heartbeat_complete_s)
        self.table_counts: dict[str, int] = {}
        """Spans held by state, as of the last heartbeat (its report may be partial)."""
        self._refs: dict[Span, tuple[tuple[object, ...], TableStatusV1]] = {}
        """Each span's last heartbeat entry and the status it was made of (``_status_refs``)."""
        self.followed: Collection[Span] = frozenset()
        """Spans that only followed their source's resolved ts in the last round (``round.quiet``)."""
        self._subs: list[Subscription] = []
        self._heartbeat: asyncio.Task[None] | None = None
        self._preparing: dict[Span, asyncio.Task[None]] = {}
        self.warm: Callable[[], Awaitable[None]] | None = None
        """Awaited before a span is declared Prepared: whatever the first write needs that is
        slow to start (the worker starts Spark there), so a committed span writes at once."""
        self.report_prepare: Callable[[Span, Phase], Awaitable[None]] | None = None
        """Records what a preparing span waits for (the worker writes the prepare bucket)."""
        self.status_sink: dict[str, Any] | None = None
        """Where ``status()`` is published with every heartbeat (the service's /healthz dict):
        a round can take seconds, the agent's state should not look that old."""
        self.span_stopped = asyncio.Event()
        """Set whenever a span stops here (the drain waits on it)."""
        self._pipeline: Pipeline | None = None
        self._view: ChangefeedView | None = None
        self.heartbeats_sent = 0
        self.fence = SelfFence(fence_s) if fence_s is not None else None
        """Writes are allowed only while heartbeats are confirmed (None: no fence, tests)."""
        self._reconnects = 0
        self._probe_sub: Subscription | None = None
        self.started_at: float | None = None
        """Monotonic time of ``start``: the member exists for the control plane from then on."""

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        self.state.newest_epoch = max(self.state.newest_epoch, await current_epoch(self.nc.jetstream()))
        SEEN_EPOCH.set(self.state.newest_epoch)
        self._subs.append(await self.nc.subscribe(dispatch_subject(self.member_id), cb=self._on_dispatch))
        self._subs.append(await self.nc.subscribe(announce_subject(REPLICATION), cb=self._on_announce))
        self._reconnects = self.hb_nc.stats.get("reconnects", 0)
        await self._subscribe_probe()
        self._heartbeat = asyncio.create_task(self._heartbeats(), name="heartbeats")
        self.started_at = time.monotonic()
        log.info("member agent started", extra={"member": self.member_id, "incarnation": self.incarnation,
                                                "epoch": self.state.newest_epoch})

    async def close(self) -> None:
        """Last heartbeat (``leaving`` when the worker has stopped every span), then quiet."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._probe_sub is not None:
            with contextlib.suppress(Exception):
                await self._probe_sub.unsubscribe()
            self._probe_sub = None
        for task in self._preparing.values():
            task.cancel()
        if self._heartbeat is not None:
            await cancel_and_wait(self._heartbeat)
        if self.started_at is None:
            return  # never joined: nobody to tell that it leaves
        with contextlib.suppress(Exception):
            await self._send_heartbeat()
            await self.hb_nc.flush(timeout=2)

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("draining: asking for my spans to move elsewhere", extra={"member": self.member_id})
            self._beat_now.set()

    def holds_spans(self) -> bool:
        return any(t.state is not TableState.STOPPED for t in self.state.tables.values())

    # ------------------------------------------------------------------ heartbeats

    def heartbeat(self, now: float | None = None) -> MemberHeartbeatV3:
        """The next heartbeat: the complete report, or what changed since the last complete one
        (``libs.scheduling.report_delta``), or liveness only when that is what the last one
        said; a draining or leaving member always sends it whole."""
        report = self.state.collect_report()
        counts: dict[str, int] = {}
        for t in report.tables:
            counts[t.state.value] = counts.get(t.state.value, 0) + 1
        self.table_counts = counts
        complete, tables = self.delta.cut(report.tables, report.epoch,
                                          time.monotonic() if now is None else now,
                                          force=self.draining or self.leaving, quiet=self.followed)
        refs = [] if tables is None else self._status_refs(tables, every_span=complete)
        return MemberHeartbeatV3(member_id=self.member_id, incarnation=self.incarnation, address=self.address,
                                 draining=self.draining, leaving=self.leaving, epoch=report.epoch,
                                 seq=report.seq or 0, complete=complete, unchanged=tables is None,
                                 tables=refs)

    def _status_refs(self, tables: Iterable[TableStatus], every_span: bool = True) -> list[TableStatusV1]:
        """Each span's heartbeat entry, kept from the last heartbeat while its status is the
        same: five heartbeats a second of every span, most of them unchanged since the last.
        ``every_span``: ``tables`` are all the spans held, and the kept entries of the others go."""
        fresh: dict[Span, tuple[tuple[object, ...], TableStatusV1]] = {} if every_span else self._refs
        out: list[TableStatusV1] = []
        for t in tables:
            key = (t.state, t.checkpoint_ts, t.resolved_ts)
            kept = self._refs.get(t.span)
            if kept is None or kept[0] != key:
                kept = (key, status_ref(t))
            fresh[t.span] = kept
            out.append(kept[1])
        self._refs = fresh
        return out

    async def _send_heartbeat(self) -> None:
        hb = self.heartbeat()
        messages = heartbeat_messages(hb, max_payload=self.hb_nc.max_payload, producer=self.producer)
        sent_at = time.monotonic()
        # Several messages when the report is larger than the server takes (thousands of spans).
        for data, headers in messages:
            await self.hb_nc.publish(heartbeat_subject(self.member_id), data, headers=headers)
        if self.fence is not None:
            # Confirmed once the server answered the flush's PING: it has the heartbeat. Only on
            # the connection this incarnation started with (see services/sink_worker/fence.py).
            await flush_within(self.hb_nc, max(0.05, self.fence.bound_s))
            if self.hb_nc.stats.get("reconnects", 0) != self._reconnects:
                self.fence.connection_lost()
            self.fence.confirm(sent_at)
        self.heartbeats_sent += 1
        self.publish_status()
        for state in TableState:
            AGENT_TABLES.labels(state.value).set(self.table_counts.get(state.value, 0))

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._send_heartbeat()
            except Exception:
                log.warning("heartbeat failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.heartbeat_interval_s)
            self._beat_now.clear()

    async def _subscribe_probe(self) -> None:
        async def answer(msg: Msg) -> None:
            if msg.reply:
                await self.nc.publish(msg.reply, b"alive")

        if self._probe_sub is not None:
            with contextlib.suppress(Exception):
                await self._probe_sub.unsubscribe()
        self._probe_sub = await self.nc.subscribe(member_probe_subject(self.member_id, self.incarnation),
                                                  cb=answer)

    def must_start_over(self) -> bool:
        """Fenced while holding spans, or the connection was lost: this incarnation may no
        longer write (the member leader may have found it gone meanwhile)."""
        if self.fence is None or self.started_at is None:
            return False
        return self.fence.broken or (self.holds_spans() and not self.fence.may_write())

    async def start_over(self, pipeline: Pipeline) -> None:
        """After the fence: forget every span (the control plane moves or has moved them) and
        go on as a new incarnation, which the member service records as left + joined."""
        assert self.fence is not None
        for task in list(self._preparing.values()):
            await cancel_and_wait(task)
        self._preparing.clear()
        for span in list(self.state.tables):
            await pipeline.drop_prepared(span)
            self.writer_log.stopped(span, None)
        old = self.incarnation
        self.incarnation = uuid4().hex
        self.state = MemberAgentState(self.member_id, min_epoch=self.state.newest_epoch,
                                      seq_start=max(time.time_ns(), self.state.seq + 1))
        self.writer_log.incarnation = self.incarnation
        self.fence.fenced += 1
        self.fence.reset()
        self._reconnects = self.hb_nc.stats.get("reconnects", 0)
        FENCED.inc()
        await self._subscribe_probe()
        self.span_stopped.set()
        self.publish_status()
        self._beat_now.set()
        log.warning("fenced: heartbeats not confirmed in time; every span dropped, starting over",
                    extra={"member": self.member_id, "old_incarnation": old, "incarnation": self.incarnation})

    def publish_status(self) -> None:
        if self.status_sink is not None:
            self.status_sink["agent"] = self.status  # built when /healthz asks (libs.service)

    # ------------------------------------------------------------------ NATS handlers

    async def _on_announce(self, msg: Msg) -> None:
        try:
            decoded = REGISTRY.decode(msg.data)
        except ContractError:
            return
        ev = decoded.event
        if not isinstance(ev, ReplicationAnnounceV1):
            return
        before = self.state.newest_epoch
        if not self.state.observe_epoch(ev.epoch):
            STALE_REJECTIONS.inc()
            return
        if ev.epoch > before:
            SEEN_EPOCH.set(ev.epoch)
            log.info("new replication-manager leader", extra={"epoch": ev.epoch, "leader": ev.candidate})
            self._beat_now.set()  # its rebuild waits for a report of its epoch

    async def _on_dispatch(self, msg: Msg) -> None:
        with process_span(msg.subject, msg.headers):
            try:
                decoded = REGISTRY.decode(msg.data)
                req = decoded.event
                if not isinstance(req, DispatchRequestV1):
                    raise ContractError("unknown_type", f"{decoded.envelope.type} is not a dispatch")
            except ContractError as exc:
                log.warning("undecodable dispatch", extra={"reason": str(exc)})
                return
            d = dispatch_of(req)
            if req.incarnation != self.incarnation:
                # Meant for this member id's previous process: nothing here may act on it.
                refused = AgentOutcome(AgentVerdict.WRONG_MEMBER, (), self.state.status(d.span))
                verdict, status = refused.verdict, refused.status
                seq = self.state.reply(refused).seq or 0
            else:
                outcome = self.state.handle_dispatch(d)
                verdict, status = outcome.verdict, outcome.status
                seq = self.state.reply(outcome).seq or 0
                if outcome.transitions:
                    # Only the dispatched span can have started preparing: looking at every span
                    # held for each dispatch made a start of 3,000 spans quadratic.
                    self._start_preparing([t.span for t in outcome.transitions])
                    self.wake.set()
            DISPATCHES.labels(req.action, verdict.value).inc()
            if verdict is AgentVerdict.STALE_EPOCH:
                STALE_REJECTIONS.inc()
                log.warning("refused a dispatch of a deposed leader", extra={
                    "span": d.span.key, "action": req.action, "epoch": req.epoch,
                    "newest_epoch": self.state.newest_epoch})
            else:
                SEEN_EPOCH.set(self.state.newest_epoch)
                log.info("dispatch", extra={"span": d.span.key, "action": req.action, "epoch": req.epoch,
                                            "verdict": verdict.value, "state": status.state.value})
            answer = DispatchResponseV1(member_id=self.member_id, incarnation=self.incarnation,
                                        verdict=verdict.value, epoch=self.state.newest_epoch, seq=seq,
                                        status=status_ref(status))
            self.publish_status()
            if msg.reply:
                # The answer carries the trace context too, so the manager's side can continue it.
                await self.nc.publish(msg.reply, REGISTRY.encode(answer, producer=self.producer),
                                      headers=inject_headers())

    # ------------------------------------------------------------------ pipeline side

    async def between_rounds(self, pipeline: Pipeline, view: ChangefeedView) -> dict[Span, SpanConfig]:
        """Carry out what dispatches asked for since the last round; returns the spans the next
        round writes (those Replicating) with their config."""
        self.attach(pipeline, view)
        changed = False
        for span, table in list(self.state.tables.items()):
            if table.state is TableState.STOPPING:
                await self._stop(pipeline, span)
                changed = True
        self._start_preparing()
        if changed:
            self._beat_now.set()
        wanted: dict[Span, SpanConfig] = {}
        configs: dict[tuple[str, str], SpanConfig | None] = {}  # one per changefeed and source
        for span, table in self.state.tables.items():
            if table.state is not TableState.REPLICATING:
                continue
            running = pipeline.spans.get(span)
            of = (span.changefeed, span.source)
            if of not in configs:
                configs[of] = config_of(view, span.changefeed, span.source)
            config = configs[of] or (running.config if running is not None else None)
            if config is not None:
                wanted[span] = config
        return wanted

    def attach(self, pipeline: Pipeline, view: ChangefeedView) -> None:
        """The pipeline and changefeeds the agent prepares spans with (set by the worker)."""
        self._pipeline = pipeline
        self._view = view

    def _start_preparing(self, spans: Iterable[Span] | None = None) -> None:
        """Start preparing every Preparing span (of ``spans``; None: of all held) at once, not
        after the round in progress (which can take seconds): preparing only reads, so it runs
        beside the round."""
        if self._pipeline is None or self._view is None:
            return
        tables = self.state.tables
        held = tables.items() if spans is None else [(s, tables[s]) for s in spans if s in tables]
        for span, table in held:
            if table.state is TableState.PREPARING and span not in self._preparing:
                config = config_of(self._view, span.changefeed, span.source)
                if config is None:
                    continue  # the changefeed is not folded yet; tried again between rounds
                self._preparing[span] = asyncio.create_task(self._prepare(self._pipeline, span, config),
                                                            name=f"prepare {span.key}")

    async def _report(self, span: Span, phase: Phase) -> None:
        if self.report_prepare is not None:
            await self.report_prepare(span, phase)

    async def _prepare(self, pipeline: Pipeline, span: Span, config: SpanConfig) -> None:
        try:
            await self._report(span, "start")
            start = await pipeline.prepare(span, config)
            if self.warm is not None:
                await self._report(span, "spark")
                await self.warm()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("preparing a span failed; giving it up", extra={"span": span.key})
            self.state.abandon(span)
        else:
            self.state.prepared(span)
            await self._report(span, "prepared")
            log.info("span prepared", extra={"span": span.key, "checkpoint_ts": start.ts,
                                             "stream_seq": start.stream_seq,
                                             "state": self.state.state_of(span).value})
        finally:
            self._preparing.pop(span, None)
        self.publish_status()
        self.wake.set()
        self._beat_now.set()

    async def _stop(self, pipeline: Pipeline, span: Span) -> None:
        task = self._preparing.pop(span, None)
        if task is not None:
            await cancel_and_wait(task)
        await pipeline.drop_prepared(span)
        final = await pipeline.stop_span(span)
        self.state.stopped(span, final.ts if final is not None else None)
        self.writer_log.stopped(span, final.ts if final is not None else None)
        self.publish_status()
        self.span_stopped.set()
        log.info("span stopped", extra={"span": span.key,
                                        "checkpoint_ts": final.ts if final is not None else None})

    async def stop_all(self, pipeline: Pipeline) -> None:
        """The worker is leaving: every span stops (a clean exit tells the leader so at once)."""
        for span, table in list(self.state.tables.items()):
            if table.state in (TableState.PREPARING, TableState.PREPARED, TableState.REPLICATING):
                self.state.abandon(span)
            if self.state.state_of(span) is TableState.STOPPING:
                await self._stop(pipeline, span)

    def started(self, loaded: Mapping[Span, Any]) -> None:
        """Spans that start running here now, with the checkpoint they start from."""
        for s, checkpoint in loaded.items():
            self.writer_log.started(s, int(checkpoint.ts))

    def after_round(self, pipeline: Pipeline, before: Mapping[Span, tuple[int, int]], t0: float,
                    t1: float) -> None:
        """Progress of the spans that ran: reported in the next heartbeat, and written rounds
        go to the writer log. ``before``: each span's (checkpoint ts, rows written) before."""
        moved = False
        followed = self.followed = pipeline.followed
        for span, rt in pipeline.spans.items():
            if rt.checkpoint is not None:
                # A span that only followed its source's resolved ts is reported with the next
                # complete report (``report_delta``), not at once.
                moved = moved or (rt.checkpoint.ts != before.get(span, (0, 0))[0] and span not in followed)
                self.state.update_progress(span, rt.checkpoint.ts, rt.resolved_ts)
            prev_ts, prev_rows = before.get(span, (0, rt.rows_written))
            if rt.rows_written > prev_rows and rt.checkpoint is not None:
                self.writer_log.wrote(span, prev_ts, rt.checkpoint.ts, rt.rows_written - prev_rows, t0, t1)
        if moved:
            # Report progress now rather than up to a heartbeat interval later: the changefeed
            # checkpoint (and a new replication-manager's first one) waits for it.
            self._beat_now.set()

    def status(self) -> dict[str, Any]:
        return {
            "member_id": self.member_id, "incarnation": self.incarnation,
            "epoch": self.state.newest_epoch, "draining": self.draining,
            "fence_remaining_s": self.fence.remaining_s() if self.fence is not None else None,
            "fenced": self.fence.fenced if self.fence is not None else 0,
            "rejected_stale": self.state.rejected_stale,
            "tables": {span.key: _table(t) for span, t in sorted(self.state.tables.items())},
        }


def _table(t: Any) -> dict[str, Any]:
    status: TableStatus = t.status()
    return {"state": status.state.value, "checkpoint_ts": status.checkpoint_ts,
            "resolved_ts": status.resolved_ts}
