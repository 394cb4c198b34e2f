"""How a span's checkpoint advances after a round: the I/O of the span state machine's
``written`` decision (``span.machine``), which holds the rules below.

- Only for batches written in full: a span whose write failed, stopped at a DDL barrier it
  could not pass or hit a downstream's permanent refusal keeps its checkpoint, and its events
  are read again next round (re-applying is idempotent).
- A written batch's checkpoint is stored at once; a span without pending events follows its
  source's resolved ts, stored at most every ``checkpoint_interval_s``.
- The store is a compare-and-set on what this worker last stored: a checkpoint moved by
  somebody else (an operator's rewind, another owner) makes the span reload it instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

from libs.scheduling.model import Span
from services.sink_worker import metrics as m
from services.sink_worker.incidents.poison import TableIncident
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.round.work import RoundReport, SpanWork
from services.sink_worker.sinks.unique_guard import UniqueConflictError
from services.sink_worker.snapshot.initial_load import InitialLoads
from services.sink_worker.span.checkpoints import (
    Checkpoint,
    CheckpointMoved,
    CheckpointRegression,
    CheckpointStore,
)
from services.sink_worker.span.machine import RoundFacts, SpanOutcome
from services.sink_worker.span.runtime import PipelineOptions, SpanRuntime
from services.sink_worker.validation.validator import Validator

log = logging.getLogger(__name__)


class CheckpointAdvance:
    def __init__(self, checkpoints: CheckpointStore, options: PipelineOptions,
                 initial_loads: InitialLoads | None, incidents: list[tuple[Span, TableIncident]]) -> None:
        self.checkpoints = checkpoints
        self.options = options
        self.initial_loads = initial_loads
        self.incidents = incidents
        """Spans stopped since the worker last recorded them in the changefeeds log."""

    async def finish(self, w: SpanWork, cut: SpanCut | None, outcome: SpanOutcome | None,
                     report: RoundReport, validation: Validator | None) -> None:
        """Carry out what the span's state machine decides at the round's end (``written``)."""
        rt = w.rt
        decided = rt.written(RoundFacts(start=w.start, horizon=w.horizon, pulled=w.pulled, head=w.head,
                                        cut=cut, outcome=outcome, grouped=w.group is not None))
        if decided.error is not None:
            report.errors.append(f"{rt.span.name}: {decided.error}")
        if decided.incident is not None:
            self.stopped(rt, decided.incident)
        proposed = decided.checkpoint
        if proposed is None:
            return
        if decided.batch_events is not None:
            report.batch_events += decided.batch_events
            rt.last_batch_events = decided.batch_events
        report.ddl_applied += decided.ddl_applied
        report.rows_written += decided.rows
        if decided.moved:
            rt.checkpoint = proposed
            report.advanced += 1
        if validation is not None and decided.validate_upto is not None:
            validation.note_batch(w, decided.validate_upto)
        # Written batches are recorded at once; an idle span following the resolved ts only
        # every checkpoint_interval_s (a restart then re-reads a little, which is harmless).
        due = decided.store_now or time.monotonic() - rt.stored_at >= self.options.checkpoint_interval_s
        if proposed != rt.stored and due and not await self.store(rt, proposed):
            return
        if decided.recopy_key is not None and rt.stored == proposed and self.initial_loads is not None:
            with contextlib.suppress(Exception):  # a leftover record is only clutter
                await self.initial_loads.store.delete(rt.span, decided.recopy_key)
        cf, name = rt.span.changefeed, rt.span.name
        m.CHECKPOINT_TIME.labels(cf, name).set(m.ts_seconds(proposed.ts))
        m.CHECKPOINT_LAG.labels(cf, name).set(m.lag_seconds(proposed.ts))
        if rt.resolved_ts:
            m.RESOLVED_LAG.labels(cf, name).set(
                max(0.0, m.ts_seconds(rt.resolved_ts) - m.ts_seconds(proposed.ts)))

    def stopped(self, rt: SpanRuntime, incident: TableIncident) -> None:
        """Record (in the next ``record_incidents``), count and log a new incident, once."""
        self.incidents.append((rt.span, incident))
        m.TABLE_INCIDENTS.labels(rt.span.changefeed).inc()
        if incident.failure.error.startswith(UniqueConflictError.__name__):
            m.CROSS_SHARD_CONFLICTS.labels(rt.span.changefeed, "refused").inc()
        m.TABLE_STOPPED.labels(rt.span.changefeed, rt.span.name).set(1)
        if incident.kind == "unreplicable":
            m.KEYLESS_REFUSED.labels(rt.span.changefeed).inc()
        # Once per incident: a stopped span runs no round until an operator acts.
        log.error("span stopped: %s", incident.failure.describe(),
                  extra={"span": rt.span.name, **incident.status()})

    async def store(self, rt: SpanRuntime, checkpoint: Checkpoint) -> bool:
        """Write ``checkpoint`` over the one this worker last stored; False when it may not."""
        try:
            await self.checkpoints.advance(rt.span, checkpoint, expected=rt.stored)
        except CheckpointMoved as exc:
            # Somebody rewound (or moved) it on purpose: start over from what they wrote.
            log.warning("checkpoint moved under us; reloading", extra={"span": rt.span.name,
                                                                       "found": str(exc.found)})
            rt.checkpoint = None
            return False
        except CheckpointRegression:
            log.exception("refused to move a checkpoint backwards", extra={"span": rt.span.name})
            rt.checkpoint = None
            return False
        rt.stored = checkpoint
        rt.stored_at = time.monotonic()
        return True

    async def store_final(self, rt: SpanRuntime) -> Checkpoint | None:
        """Store the span's latest checkpoint as it stops here; the one the next owner starts from
        (a checkpoint that cannot be stored is not returned: the next owner re-applies from the
        stored one, which is idempotent)."""
        final = rt.stored
        if rt.checkpoint is not None and rt.checkpoint != rt.stored:
            try:
                if await self.store(rt, rt.checkpoint):
                    final = rt.checkpoint
            except Exception:
                log.warning("could not store the final checkpoint", exc_info=True,
                            extra={"span": rt.span.name})
        return final

    async def flush_checkpoints(self, spans: Iterable[SpanRuntime]) -> None:
        """Store every span's latest checkpoint (on a clean stop); each covers written batches only."""
        for rt in spans:
            if rt.checkpoint is not None and rt.checkpoint != rt.stored:
                with contextlib.suppress(Exception):
                    await self.store(rt, rt.checkpoint)

    @staticmethod
    def forget_gauges(span: Span) -> None:
        for gauge in (m.CHECKPOINT_LAG, m.RESOLVED_LAG, m.CHECKPOINT_TIME, m.TABLE_STOPPED):
            with contextlib.suppress(KeyError):
                gauge.remove(span.changefeed, span.name)
