"""The sink-worker: follows the changefeeds, finds their spans, runs the table pipelines.

- Changefeeds: the worker replays the changefeeds domain stream from its start (an ordered
  consumer: every event once, in order) and keeps following it. Only ``running`` changefeeds
  get pipelines; a paused or deleted one stops at its checkpoints, which stay in the bucket.
- Spans: until the scheduler dispatches spans to members (a later issue), every worker runs
  every span of every running changefeed. They are the tables that have row or DDL subjects in
  the ROWS stream for the changefeed's sources (``stream_info`` with a subject filter) and match
  its table filter (matched on the subject tokens, which equal the names unless a name holds
  characters a subject token cannot).
- Rounds: ``Pipeline.round`` back to back while there is work, pausing ``round_interval_s``
  when a round found nothing to apply. Spark starts on the first round with events.
- Stop: the current round finishes within the grace period or is abandoned without advancing
  any checkpoint for what it did not write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError
from pyspark.sql import SparkSession

from contracts import REGISTRY, ContractError
from libs.changefeeds import ChangefeedView, discover_spans
from libs.config import Settings
from libs.eventstore import dead_letter, ensure_deadletter_stream
from libs.streams import CHECKPOINT_BUCKET, ROWS_STREAM, domain_events_subject, domain_stream
from services.sink_worker.checkpoints import CheckpointStore
from services.sink_worker.pipeline import Pipeline, PipelineOptions, RoundReport, SpanConfig
from services.sink_worker.span import Span

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
                 pipeline_options: PipelineOptions | None = None) -> None:
        self.js = js
        self.settings = settings
        self.stopping = stopping
        self._spark_factory = spark
        self.spark_started = False
        self.status = status if status is not None else {}
        self.rows_stream = rows_stream
        self.changefeeds_stream = domain_stream(changefeeds_domain)
        self.changefeeds_subject = domain_events_subject(changefeeds_domain)
        self.options = options or WorkerOptions.from_settings(settings)
        self.view = ChangefeedView()
        self.changefeeds_replayed = False
        self._folded_seq = 0
        self._view_changed = asyncio.Event()
        self.checkpoints = CheckpointStore(js, checkpoint_bucket, replicas=settings.stream_replicas)
        self.pipeline = Pipeline(js, self.checkpoints, self._spark,
                                 pipeline_options or PipelineOptions.from_settings(settings), rows_stream)
        self._last_discovery = 0.0
        self._last_progress_log = time.monotonic()
        self._rows_since_log = 0
        self.rows_stream_missing = False

    def _spark(self) -> SparkSession:
        session = self._spark_factory()
        self.spark_started = True
        return session

    # ------------------------------------------------------------------ main

    async def run(self) -> None:
        await ensure_deadletter_stream(self.js, self.settings)
        await self.checkpoints.open()
        follower = asyncio.create_task(self._follow_changefeeds(), name="changefeeds")
        try:
            await self._rounds()
        finally:
            follower.cancel()
            with contextlib.suppress(BaseException):
                await follower
            await self.pipeline.flush_checkpoints()
            await self.pipeline.close()
            self._publish_status()

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less when the worker stops or the changefeeds change."""
        stop = asyncio.ensure_future(self.stopping.wait())
        change = asyncio.ensure_future(self._view_changed.wait())
        try:
            await asyncio.wait({stop, change}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            change.cancel()

    async def _rounds(self) -> None:
        failures = 0
        while not self.stopping.is_set():
            now = time.monotonic()
            if self._view_changed.is_set() or now - self._last_discovery >= self.options.discovery_interval_s:
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
            try:
                report = await self.pipeline.round(self.stopping)
                failures = 0
            except Exception as exc:
                failures += 1
                log.exception("round failed")
                self.status["last_error"] = repr(exc)
                report = RoundReport(errors=[repr(exc)])
            self._publish_status()
            self._log_progress(report)
            if report.abandoned:
                break
            if report.errors:
                await self._pause(min(30.0, self.options.round_interval_s * 2 ** min(failures + 1, 6)))
            elif not (report.batch_events or report.ddl_applied):
                await self._pause(self.options.round_interval_s)

    # ------------------------------------------------------------------ changefeeds

    async def _follow_changefeeds(self) -> None:
        while not self.stopping.is_set():
            try:
                await self._follow_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("following the changefeeds failed; retrying", exc_info=True)
            await self._pause(1.0)

    async def _follow_once(self) -> None:
        """Read the changefeed events after the last one folded, until stopped or an error.

        A pull consumer without acks, re-created after the last folded sequence on any error:
        every event is folded once and in order, whatever happens to the consumer meanwhile."""
        try:
            last = await self.js.get_last_msg(self.changefeeds_stream, self.changefeeds_subject)
            replay_end = int(last.seq or 0)
        except NotFoundError:
            # No stream or no changefeed yet: nothing to replay; created ones will arrive.
            replay_end = 0
            try:
                await self.js.stream_info(self.changefeeds_stream)
            except NotFoundError:
                self.changefeeds_replayed = True
                return
        if replay_end <= self._folded_seq:
            self.changefeeds_replayed = True
        name = f"sink_cf_{uuid4().hex}"
        await self.js.add_consumer(self.changefeeds_stream, api.ConsumerConfig(
            name=name, ack_policy=api.AckPolicy.NONE, filter_subject=self.changefeeds_subject,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._folded_seq + 1,
            inactive_threshold=60.0, mem_storage=True, num_replicas=1))
        log.info("following the changefeeds", extra={"stream": self.changefeeds_stream,
                                                     "from_seq": self._folded_seq + 1,
                                                     "replay_end": replay_end})
        sub = await self.js.pull_subscribe_bind(name, stream=self.changefeeds_stream)
        try:
            while not self.stopping.is_set():
                try:
                    msgs = await sub.fetch(64, timeout=1.0)
                except (TimeoutError, NatsTimeoutError):
                    continue
                for msg in msgs:
                    await self._fold(msg, replay_end)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.changefeeds_stream, name)

    async def _fold(self, msg: Msg, replay_end: int) -> None:
        seq = int(msg.metadata.sequence.stream)
        if seq <= self._folded_seq:
            return
        try:
            decoded = REGISTRY.decode(msg.data)
        except ContractError as exc:
            await dead_letter(self.js, msg, exc.reason, exc.kind, self.changefeeds_stream, seq=seq,
                              ack=False)
        else:
            if self.view.apply(decoded.event):
                self._view_changed.set()
        self._folded_seq = seq
        if seq >= replay_end and not self.changefeeds_replayed:
            self.changefeeds_replayed = True
            self._view_changed.set()
            log.info("changefeeds replayed", extra={"running": len(self.view.running())})

    # ------------------------------------------------------------------ spans

    async def discover(self) -> dict[Span, SpanConfig]:
        """The spans of every running changefeed, from the ROWS stream's subjects."""
        found = await discover_spans(self.js, self.view.running(), self.rows_stream)
        self.rows_stream_missing = found.rows_stream_missing
        wanted = {Span(*key): SpanConfig(sink_url=spec.sink_url, key_policy=spec.key_policy, start=spec.start)
                  for key, spec in found.spans.items()}
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
            states[rt.state] = states.get(rt.state, 0) + 1
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
        self.status["spans"] = self.pipeline.status()
        if report is not None:
            self.status["last_round"] = {
                "events": report.events, "batch_events": report.batch_events,
                "rows_written": report.rows_written, "ddl_applied": report.ddl_applied,
                "checkpoints_advanced": report.advanced, "errors": report.errors[:10],
                "abandoned": report.abandoned, "duration_s": round(report.duration_s, 3),
            }
