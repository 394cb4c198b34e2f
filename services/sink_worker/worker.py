"""The sink-worker: follows the changefeeds, runs the table pipelines of its spans.

- Changefeeds: the worker replays the changefeeds domain stream from its start (an ordered
  consumer: every event once, in order) and keeps following it; span configs (sink, key
  policy, start) come from there.
- Spans, with the control plane (the default): the worker is a member. Its agent
  (``services.sink_worker.agent``) heartbeats, answers dispatches of the replication-manager
  and runs exactly the spans dispatched to it: prepared (loaded, not written) as a
  secondary, written as the primary, stopped and handed over with its final checkpoint.
  Between two rounds the worker carries out what the dispatches asked for; a span is never
  stopped in the middle of a round that may be writing it.
- Spans, standalone (``SLUICE_SINK_STANDALONE=true``, one worker, no control plane): every
  span of every running changefeed. They are the tables that have row or DDL subjects in the
  ROWS stream for the changefeed's sources and match its table filter (``discover_spans``).
- Rounds: ``Pipeline.round`` back to back while there is work; after a round that found
  nothing to apply the loop waits for a new resolved mark of its spans' sources, a view change
  or the stop (``round_wakeup``), at most ``round_interval_s``. Spark starts on the first
  round with events.
- Stop (SIGTERM): with the control plane the worker first drains: it says so in its heartbeat,
  keeps replicating while the scheduler moves its spans elsewhere, and after
  ``sink_drain_timeout_s`` at most stops what is left and leaves with a last heartbeat. Then
  (also standalone) the current round finishes within the grace period or is abandoned
  without advancing any checkpoint for what it did not write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts.events.table_incidents import TableActionRequestedV1
from libs.changefeeds import ChangefeedView, discover_spans
from libs.concurrency import cancel_and_wait
from libs.config import Settings
from libs.control.follow import DomainFollower
from libs.eventstore import StoredEvent, ensure_deadletter_stream
from libs.scheduling.model import Span
from libs.streams import (
    CHECKPOINT_BUCKET,
    ROWS_STREAM,
    domain_stream,
    table_incidents_subject,
)
from services.sink_worker.agent import SinkAgent
from services.sink_worker.ddl.shard import ShardDdl
from services.sink_worker.fence import Fenced
from services.sink_worker.idle_trim import IdleTrim, release_memory
from services.sink_worker.incidents.log import carry_out, record_incidents
from services.sink_worker.prepare_progress import Phase, PrepareProgress
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.round.wakeup import RoundWakeup, pause_after
from services.sink_worker.round.warm_up import warm_up
from services.sink_worker.round.work import RoundReport
from services.sink_worker.snapshot.initial_load import InitialLoads, SnapshotOptions
from services.sink_worker.span.checkpoints import CheckpointStore
from services.sink_worker.span.runtime import PipelineOptions, SpanConfig
from services.sink_worker.validation.validator import ValidationOptions, Validator

log = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class WorkerOptions:
    round_interval_s: float = 0.5
    discovery_interval_s: float = 2.0

    @classmethod
    def from_settings(cls, settings: Settings) -> WorkerOptions:
        return cls(round_interval_s=settings.sink_round_interval_s,
                   discovery_interval_s=settings.sink_discovery_interval_s)


class SinkWorker:
    def __init__(self, js: JetStreamContext, settings: Settings, stopping: asyncio.Event,
                 spark: Callable[[], SparkSession], *, status: dict[str, Any] | None = None,
                 rows_stream: str = ROWS_STREAM, changefeeds_domain: str = "changefeeds",
                 checkpoint_bucket: str = CHECKPOINT_BUCKET, options: WorkerOptions | None = None,
                 pipeline_options: PipelineOptions | None = None, agent: SinkAgent | None = None,
                 shard_ddl: ShardDdl | None = None) -> None:
        self.js = js
        self.settings = settings
        self.stopping = stopping
        self.agent = agent
        # Rounds end on `halt`: at once standalone; with an agent only after the drain.
        self._halt = asyncio.Event() if agent is not None else stopping
        self._spark_factory = spark
        self.spark_started = False
        self.idle_trim = IdleTrim(settings.sink_idle_trim_s)
        self.status = status if status is not None else {}
        self.rows_stream = rows_stream
        self.changefeeds_stream = domain_stream(changefeeds_domain)
        self.incidents_subject = table_incidents_subject(changefeeds_domain)
        self.options = options or WorkerOptions.from_settings(settings)
        self.view = ChangefeedView()
        self.changefeeds_replayed = False
        # Folded from the changefeeds' events and their table incidents; this worker writes
        # only the latter (its NATS role may not publish changefeed events).
        self.changefeeds: DomainFollower[ChangefeedView] = DomainFollower(
            js, changefeeds_domain, self._fold_changefeeds, lambda: self.view, name="sink_cf",
            settings=settings)
        self._view_changed = asyncio.Event()
        self.wakeup = RoundWakeup(js._nc)
        """Set by a new resolved mark of the spans' sources: ends the wait after an idle round."""
        self.prepare_progress = PrepareProgress(js, agent.member_id if agent is not None else "",
                                                replicas=settings.stream_replicas)
        if agent is not None:
            agent.wake = self._view_changed
            agent.warm = self._warm_spark
            agent.report_prepare = self._report_prepare
            agent.status_sink = self.status
        self._spark_warming: asyncio.Task[SparkSession] | None = None
        self._spark_warmed = False
        self.checkpoints = CheckpointStore(js, checkpoint_bucket, replicas=settings.stream_replicas)
        # Spans of a changefeed in a snapshot mode copy their table before they stream.
        self.initial_loads = InitialLoads(js, self._spark, SnapshotOptions.from_settings(settings),
                                          rows_stream=rows_stream, worker_id=settings.instance_id,
                                          replicas=settings.stream_replicas)
        self.pipeline = Pipeline(js, self.checkpoints, self._spark,
                                 pipeline_options or PipelineOptions.from_settings(settings), rows_stream,
                                 initial_loads=self.initial_loads)
        if agent is not None:
            self.pipeline.fence = agent.fence
        self.validator = Validator(js, ValidationOptions.from_settings(settings),
                                   worker_id=settings.instance_id, rows_stream=rows_stream,
                                   replicas=settings.stream_replicas)
        self.pipeline.validation = self.validator
        self.shard_ddl = shard_ddl
        if shard_ddl is not None:
            shard_ddl.specs = self.view.running
            self.pipeline.attach_shard_ddl(shard_ddl)
        self._last_discovery = 0.0
        self._last_progress_log = time.monotonic()
        self._rows_since_log = 0
        self.rows_stream_missing = False

    def _spark(self) -> SparkSession:
        session = self._spark_factory()
        self.spark_started = True
        self.idle_trim.used()
        return session

    async def _release_memory(self) -> None:
        """Memory the last busy spell left in the JVM's heap and this process' allocators back
        to the system (``idle_trim``)."""
        self.idle_trim.done()
        try:
            done = await asyncio.to_thread(release_memory, self._spark_factory())
        except Exception:
            log.warning("giving memory back after a quiet spell failed", exc_info=True)
            return
        if "jvm_gc_s" not in done:
            self.idle_trim.used()  # a job still ran: try again after another quiet spell
        log.info("memory given back after a quiet spell", extra=done)

    def _warm_session(self) -> SparkSession:
        """The session, started and run once through a round's plans (``warm_up``)."""
        session = self._spark()
        if not self._spark_warmed:
            try:
                seconds = warm_up(session, self.pipeline.options.apply_partitions)
            except Exception:
                # Only the first round gets slower: nothing to refuse a span for.
                log.warning("Spark warm-up failed; the first round pays the cold start", exc_info=True)
            else:
                log.info("Spark warmed up", extra={"seconds": round(seconds, 3)})
            self._spark_warmed = True
        return session

    async def _report_prepare(self, span: Span, phase: Phase) -> None:
        if phase == "spark" and self._spark_warmed:
            return  # warm already: the span does not wait for it
        await self.prepare_progress.report(span, phase)

    @property
    def spark_warm(self) -> bool:
        """Spark started and ran a round's plans once (or tried to): spans taken now start at
        full speed. The member's readiness, so a rolling restart waits for it."""
        return self._spark_warmed

    async def _warm_spark(self) -> None:
        """Start and warm Spark (seconds of JVM start and first plans) while a span prepares
        rather than in its first round: the previous owner keeps writing meanwhile (two-phase
        scheduling's point)."""
        task = self._spark_warming
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._spark_warming = asyncio.ensure_future(asyncio.to_thread(self._warm_session))
        await asyncio.shield(task)

    # ------------------------------------------------------------------ main

    async def run(self) -> None:
        await ensure_deadletter_stream(self.js, self.settings)
        await self.checkpoints.open()
        follower = asyncio.create_task(self._follow_changefeeds(), name="changefeeds")
        if self.shard_ddl is not None:
            await self.shard_ddl.start()
        drain: asyncio.Task[None] | None = None
        join: asyncio.Task[None] | None = None
        watch: asyncio.Task[None] | None = None
        if self.agent is not None:
            self.agent.attach(self.pipeline, self.view)
            # A member is there to take spans over, often when another one dies: a cold JVM
            # would add its start-up to every failover onto this worker, so it starts now.
            self._spark_warming = asyncio.ensure_future(asyncio.to_thread(self._warm_session))
            self._spark_warming.add_done_callback(_log_warm_failure)
            join = asyncio.create_task(self._join_when_warm(), name="join")
            drain = asyncio.create_task(self._drain_on_stop(), name="drain")
            watch = asyncio.create_task(self._watch_fence(), name="fence")
        try:
            await self._rounds()
        finally:
            for task in (follower, join, drain, watch):
                if task is not None:
                    await cancel_and_wait(task)
            if self.agent is not None:
                # Stop what did not move: checkpoints stored, then the last heartbeat says the
                # member has left, so its spans are scheduled elsewhere without waiting a TTL.
                await self.agent.stop_all(self.pipeline)
                self.agent.leaving = True
            await self.pipeline.flush_checkpoints()
            await self.pipeline.close()
            if self.agent is not None:
                await self.agent.close()
            if self.shard_ddl is not None:
                await self.shard_ddl.close()
            await self.wakeup.close()
            self._publish_status()

    async def _join_when_warm(self) -> None:
        """Become a member (first heartbeat) only once Spark is warm: the scheduler chooses any
        member as a destination, and one still starting its JVM held moved spans in Preparing
        for as long as that took (a minute and more on a loaded machine) while it looked placed.
        A failed start joins anyway: a prepare starts Spark again (``_warm_spark``)."""
        assert self.agent is not None and self._spark_warming is not None
        with contextlib.suppress(Exception):
            await asyncio.shield(self._spark_warming)
        await self.agent.start()

    async def _watch_fence(self) -> None:
        """When the fence deadline passes while a round may be writing, cancel its Spark jobs:
        the check before each write stops the next one, this one stops the write in flight
        (interrupted tasks roll their transactions back). The rounds loop then starts over."""
        assert self.agent is not None and self.agent.fence is not None
        fence = self.agent.fence
        tripped = False
        while True:
            deadline = fence.deadline
            wait = 0.05 if deadline is None else max(0.01, min(0.25, deadline - time.monotonic()))
            await asyncio.sleep(wait)  # the fence deadline is a time, not an event
            if not self.agent.must_start_over():
                tripped = False
                continue
            if tripped:
                continue
            tripped = True
            self._view_changed.set()  # wake a paused rounds loop: it starts over
            if self.spark_started:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self._spark_factory().interruptAll)

    async def _start_over(self) -> None:
        assert self.agent is not None
        await self.pipeline.set_spans({})
        await self.agent.start_over(self.pipeline)

    async def _drain_on_stop(self) -> None:
        """On SIGTERM: drain (spans move elsewhere while still replicating here), bounded."""
        assert self.agent is not None
        await self.stopping.wait()
        self.agent.start_draining()
        deadline = time.monotonic() + self.settings.sink_drain_timeout_s
        while self.agent.holds_spans() and time.monotonic() < deadline:
            self.agent.span_stopped.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.agent.span_stopped.wait(), deadline - time.monotonic())
        if self.agent.holds_spans():
            log.warning("drain time is up; stopping the spans that did not move",
                        extra={"spans": sorted(s.key for s in self.agent.state.tables)})
        else:
            log.info("drained: every span runs elsewhere")
        self._halt.set()

    async def _pause(self, seconds: float, signal: asyncio.Event | None = None) -> None:
        """Wait ``seconds``, or less when the worker stops, the changefeeds change, a dispatch
        asks for something or ``signal`` is set."""
        waits = [asyncio.ensure_future(self._halt.wait()), asyncio.ensure_future(self._view_changed.wait())]
        if signal is not None:
            waits.append(asyncio.ensure_future(signal.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _rounds(self) -> None:
        failures = 0
        while not self._halt.is_set():
            now = time.monotonic()
            if self.spark_started and self.idle_trim.due(now):
                await self._release_memory()
            if self.agent is not None and self.agent.must_start_over():
                try:
                    await self._start_over()
                except Exception:
                    log.warning("starting over after the fence failed", exc_info=True)
            if self.agent is not None:
                self._view_changed.clear()
                try:
                    await self.pipeline.set_spans(await self.agent.between_rounds(self.pipeline, self.view))
                except Exception:
                    log.warning("carrying out dispatches failed", exc_info=True)
            elif (self._view_changed.is_set()
                  or now - self._last_discovery >= self.options.discovery_interval_s):
                self._view_changed.clear()
                try:
                    await self.discover()
                except Exception:
                    log.warning("span discovery failed", exc_info=True)
                self._last_discovery = now
            if not self.pipeline.spans:
                self._publish_status()
                await self._pause(self.options.round_interval_s)
                continue
            if self.agent is not None:
                try:
                    self.agent.started(await self.pipeline.load_checkpoints())
                except Exception:
                    log.warning("loading checkpoints failed", exc_info=True)
            before = {s: (rt.checkpoint.ts if rt.checkpoint else 0, rt.rows_written)
                      for s, rt in self.pipeline.spans.items()}
            await self.wakeup.follow({s.source for s in self.pipeline.spans})
            self.wakeup.clear()  # before the round reads the marks: later ones wake the next wait
            t0 = time.time()
            try:
                report = await self.pipeline.round(self._halt)
                failures = 0
            except Fenced as exc:
                # Nothing of this round advanced; the next loop starts over as a new incarnation.
                log.warning("round stopped by the fence", extra={"reason": str(exc)})
                report = RoundReport()
                self._view_changed.set()  # no pause before starting over
            except Exception as exc:
                failures += 1
                log.exception("round failed")
                self.status["last_error"] = repr(exc)
                report = RoundReport(errors=[repr(exc)])
            if self.agent is not None:
                self.agent.after_round(self.pipeline, before, t0, time.time())
            try:
                await self.validator.run(self.pipeline)
            except Exception:
                log.warning("validation failed; trying again after the next round", exc_info=True)
            if self.pipeline.new_incidents or self.pipeline.new_overwrites:
                try:
                    await record_incidents(self.js, self.changefeeds_stream, self.incidents_subject,
                                           self.pipeline, self.settings.instance_id)
                except Exception:
                    log.warning("recording a stopped table failed; retrying after the next round",
                                exc_info=True)
            self._publish_status()
            self._log_progress(report)
            if report.abandoned:
                break
            pause = pause_after(worked=bool(report.batch_events or report.ddl_applied),
                                errors=bool(report.errors), failures=failures,
                                interval_s=self.options.round_interval_s)
            if pause.seconds > 0:
                await self._pause(pause.seconds, self.wakeup.flag if pause.on_signal else None)

    # ------------------------------------------------------------------ changefeeds

    async def _follow_changefeeds(self) -> None:
        """Replay the changefeed events, say so (readiness), then fold each new one.

        ``changefeeds_replayed`` turns true once the replay reached the stream's end as it was
        when the replay started, exactly when the worker knows every changefeed created before."""
        while not self._halt.is_set():
            try:
                await self.changefeeds.load()
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("replaying the changefeeds failed; retrying", exc_info=True)
            await self._pause(1.0)
        if self._halt.is_set():
            return
        self.changefeeds_replayed = True
        self._view_changed.set()
        log.info("changefeeds replayed", extra={"running": len(self.view.running())})
        await self.changefeeds.run(self._halt)

    def _fold_changefeeds(self, view: ChangefeedView, stored: StoredEvent) -> ChangefeedView:
        # Folds into the one view the agent and the shard-DDL coordinator hold. A replay retried
        # after a partial one folds its prefix again: the view's fold is last-writer-wins per
        # changefeed and per table, so it ends as one replay would.
        if view.apply(stored.event):
            self._view_changed.set()
        if isinstance(stored.event, TableActionRequestedV1):
            carry_out(view, self.pipeline, stored.event)
        return view

    # ------------------------------------------------------------------ spans

    async def discover(self) -> dict[Span, SpanConfig]:
        """The spans of every running changefeed, from the ROWS stream's subjects."""
        found = await discover_spans(self.js, self.view.running(), self.rows_stream)
        self.rows_stream_missing = found.rows_stream_missing
        wanted = {Span(*key): SpanConfig.of(spec, key[1]) for key, spec in found.spans.items()}
        await self.pipeline.set_spans(wanted)
        return wanted

    # ------------------------------------------------------------------ status

    def _log_progress(self, report: RoundReport) -> None:
        """A line every ``_PROGRESS_EVERY_S``: enough to see from the log whether rounds move."""
        now = time.monotonic()
        self._rows_since_log += report.rows_written
        if now - self._last_progress_log < _PROGRESS_EVERY_S:
            return
        states: dict[str, int] = {}
        for rt in self.pipeline.spans.values():
            states[rt.state.value] = states.get(rt.state.value, 0) + 1
        log.info("sink progress", extra={
            "rounds": self.pipeline.rounds, "spans": states, "rows_written": self._rows_since_log,
            "last_round_s": round(report.duration_s, 3), "last_round_errors": report.errors[:3]})
        self._last_progress_log = now
        self._rows_since_log = 0

    def _publish_status(self) -> None:
        report = self.pipeline.last_report
        self.status["changefeeds"] = {cf: self.view.states.get(cf, "?") for cf in sorted(self.view.specs)}
        self.status["changefeeds_replayed"] = self.changefeeds_replayed
        self.status["rows_stream_missing"] = self.rows_stream_missing
        self.status["spark_started"] = self.spark_started
        self.status["rounds"] = self.pipeline.rounds
        self.status["spans"] = self.pipeline.status  # built when /healthz asks (libs.service)
        if report is not None:
            self.status["last_round"] = {
                "events": report.events, "batch_events": report.batch_events,
                "rows_written": report.rows_written, "ddl_applied": report.ddl_applied,
                "checkpoints_advanced": report.advanced, "errors": report.errors[:10],
                "abandoned": report.abandoned, "duration_s": round(report.duration_s, 3),
            }


def _log_warm_failure(task: asyncio.Future[SparkSession]) -> None:
    # Retrieving the exception also keeps asyncio from reporting it as never retrieved; the
    # next prepare starts Spark again (``_warm_spark``).
    if not task.cancelled() and task.exception() is not None:
        log.warning("starting Spark failed; retried when a span prepares", exc_info=task.exception())
