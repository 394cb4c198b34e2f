"""A span's state in this worker and the per-round records of its work.

``SpanConfig`` is what the changefeed says about a span, ``SpanRuntime`` what this worker
keeps about it between rounds; a round makes one ``SpanWork`` per span (what it pulled and its
plan) and gets one ``SpanOutcome`` back from the write; ``RoundReport`` sums the round up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from contracts.events.changefeeds import (
    ChangefeedSpec,
    InitialLoad,
    KeyPolicy,
    SchemaChangePolicy,
    current_spec,
)
from contracts.events.rows import SourcePositionV1, TableMetaV1
from libs.config import Settings
from libs.routing import Router, Target, router_for
from libs.scheduling.model import Span
from libs.streams import token
from services.sink_worker import metrics as m
from services.sink_worker.round.pull import SpanReader
from services.sink_worker.round.quiet import QuietSpan
from services.sink_worker.sinks.unique_guard import UniqueConflictPolicy
from services.sink_worker.span.checkpoints import Checkpoint
from services.sink_worker.span.machine import SpanMachine

if TYPE_CHECKING:
    pass



@dataclass(frozen=True)
class PipelineOptions:
    max_events_per_round: int = 20000
    """The most events a round pulls, all spans together (``round_size``)."""
    min_events_per_round: int = 100
    round_max_bytes: int = 32 * 1024 * 1024
    apply_partitions: int = 4
    stop_grace_s: float = 4.0
    checkpoint_interval_s: float = 1.0
    quiet_recheck_s: float = 5.0
    """A quiet span is visited in full this often (``round.quiet``; 0: every round)."""
    stream_replicas: int = 1
    """Replicas and duplicate window of a stream the NATS sink creates."""
    dedup_window_s: float = 120.0
    pull_max_bytes: int = 512 * 1024 * 1024
    """Event bytes a span's reader keeps in memory (large rows: see pull.py)."""
    large_value_bytes: int = 1024 * 1024
    """Values longer than this stay out of the Spark jobs (``large_values``)."""
    large_txn_stream: bool = True
    """A transaction larger than its span's round is applied streamed (``large_txn``)."""
    large_txn_window_events: int = 64
    large_txn_window_bytes: int = 32 * 1024 * 1024

    @classmethod
    def from_settings(cls, settings: Settings) -> PipelineOptions:
        return cls(
            max_events_per_round=settings.sink_max_events_per_round,
            min_events_per_round=settings.sink_min_events_per_round,
            round_max_bytes=settings.sink_round_max_bytes,
            apply_partitions=settings.sink_apply_partitions,
            checkpoint_interval_s=settings.sink_checkpoint_interval_s,
            quiet_recheck_s=settings.sink_quiet_recheck_s,
            stop_grace_s=settings.sink_stop_grace_s,
            stream_replicas=settings.stream_replicas,
            dedup_window_s=settings.dedup_window_s,
            pull_max_bytes=settings.sink_pull_max_bytes,
            large_value_bytes=settings.sink_large_value_bytes,
            large_txn_stream=settings.sink_large_txn_stream,
            large_txn_window_events=settings.sink_large_txn_window_events,
            large_txn_window_bytes=settings.sink_large_txn_window_bytes,
        )


@dataclass(frozen=True)
class SpanConfig:
    """What the changefeed says about a span."""

    sink_url: str
    key_policy: KeyPolicy = "primary"
    start: Literal["earliest", "latest"] = "earliest"
    router: Router | None = None
    """The changefeed's routes, filter and origin column (None: every table to itself)."""
    initial_load: InitialLoad = "binlog-only"
    source_url: str = ""
    start_time: datetime | None = None
    start_position: SourcePositionV1 | None = None
    on_unique_conflict: UniqueConflictPolicy = "error"
    """A merged target's unique value held by another shard's row (``sinks.unique_guard``)."""
    validation: str = "off"
    """Continuous validation: off, fast or full (``services.sink_worker.validation.validator``)."""
    case_insensitive: bool = False
    """``text_comparison = case_insensitive``: *_ci source columns compare so on PostgreSQL/SQLite."""
    schema_change_policy: SchemaChangePolicy = "evolve"
    """What a DDL does downstream (``services.sink_worker.ddl.policy``)."""
    syncpoints: bool = False
    """``syncpoint_interval`` is set: each round reads the changefeed's cap (``libs.syncpoints``)."""
    large_txn_split_rows: int = 0
    """0: a large transaction is one downstream transaction; N: committed every N row changes
    (the changefeed's ``large_txn_split_rows``, ``round.large_txn``)."""

    @classmethod
    def of(cls, spec: ChangefeedSpec, source: str) -> SpanConfig:
        """The config of ``spec``'s spans on ``source`` (a subject token)."""
        spec = current_spec(spec)  # one built in code from an older version: upcast as if read
        ref = next((s for s in spec.sources if token(s.id) == source), None)
        return cls(sink_url=spec.sink_url, key_policy=spec.key_policy, start=spec.start,
                   router=router_for(spec), initial_load=spec.initial_load,
                   source_url=ref.url if ref is not None else "", start_time=spec.start_time,
                   start_position=spec.start_position.get(ref.id) if ref is not None else None,
                   on_unique_conflict=spec.on_unique_conflict, validation=spec.validation.mode,
                   case_insensitive=spec.text_comparison == "case_insensitive",
                   schema_change_policy=spec.schema_change_policy,
                   syncpoints=spec.syncpoint_interval is not None,
                   large_txn_split_rows=spec.large_txn_split_rows or 0)


@dataclass
class SpanRuntime(SpanMachine):
    """What this worker keeps about a span between rounds; its state is the ``SpanMachine``'s."""

    span: Span
    config: SpanConfig
    reader: SpanReader
    checkpoint: Checkpoint | None = None
    """The checkpoint the next round starts from; None until loaded."""
    stored: Checkpoint | None = None
    """What the bucket holds as far as we know (None: nothing yet): the compare-and-set base."""
    stored_at: float = 0.0
    checked_at: float = 0.0
    """Monotonic time this worker last read the stored checkpoint (``Pipeline._check_stored``)."""
    resolved_ts: int | None = None
    rows_written: int = 0
    dead_lettered: int = 0
    last_batch_events: int = 0
    shards: int = 1
    group_metas: dict[tuple[str, str], TableMetaV1] = field(default_factory=dict)
    """A table group's members (real names) -> their newest metadata seen (``table_group``)."""
    created_at: float = field(default_factory=time.monotonic)
    routed: tuple[Router | None, Target] | None = None
    """The span's target by its tokens under ``config.router`` (``round.plan.count_shards``)."""
    quiet: QuietSpan | None = None
    """Set by a full visit that found nothing to read or apply (``round.quiet``)."""

    def status(self) -> dict[str, Any]:
        cp = self.checkpoint
        out: dict[str, Any] = {
            "span": self.span.name, "changefeed": self.span.changefeed, "source": self.span.source,
            "database": self.span.database, "table": self.span.table, "state": self.state.value,
            "checkpoint_ts": cp.ts if cp else None, "stream_seq": cp.stream_seq if cp else None,
            "resolved_ts": self.resolved_ts,
            "lag_s": round(m.lag_seconds(cp.ts), 3) if cp and cp.ts else None,
            "behind_resolved_s": (round(m.ts_seconds(self.resolved_ts) - m.ts_seconds(cp.ts), 3)
                                  if cp and self.resolved_ts else None),
            "rows_written": self.rows_written, "dead_lettered": self.dead_lettered,
        }
        if self.error:
            out["error"] = self.error
        if self.ddl_error is not None:
            out["ddl_error"] = self.ddl_error.as_status()
        if self.incident is not None:
            out["incident"] = self.incident.status()
        return out


def copied_spans(span: Span) -> list[Span]:
    """The spans whose tables an initial load copies: a table group's tables one by one."""
    if span.members is None:
        return [span]
    return [Span(span.changefeed, span.source, database, table) for database, table in span.members]

