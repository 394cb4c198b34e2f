"""The per-round records of a span's work: ``SpanWork`` (what a round pulled for a span and its
plan), ``SpanOutcome`` (what its write did) and ``RoundReport`` (the round summed up)."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.events.rows import TableMetaV1
from libs.foreign_keys import ForeignKey
from libs.table_rules import TableRules
from services.sink_worker.fk.table_group import GroupCut
from services.sink_worker.incidents.poison import TableIncident
from services.sink_worker.incidents.table_errors import DdlFailure
from services.sink_worker.round.apply_job import TargetPlan
from services.sink_worker.round.pull import PulledEvent, PullResult
from services.sink_worker.round.routes import SpanRoutes
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.sinks.nats_stream import StreamMessage
from services.sink_worker.span.checkpoints import Checkpoint
from services.sink_worker.span.runtime import SpanRuntime


@dataclass
class SpanWork:
    """One span's part of a round."""

    rt: SpanRuntime
    start: Checkpoint
    pulled: PullResult
    horizon: int
    fresh: list[PulledEvent]
    routes: SpanRoutes
    """The span's routes this round (``round_plan``): every part of the round reads them there."""
    plan: TargetPlan | None = None
    refused: str | None = None
    origin: tuple[str, str] | None = None
    """The origin column's name and this span's value, when its rows carry one."""
    shard_wait: str | None = None
    """Stopped at a shard DDL, waiting for its operation: why (nothing moves)."""
    shard_cut: SpanCut | None = None
    """The DDL at the head of the span was carried out in the driver (a shard DDL, a rename
    away, a finished re-copy): its cut."""
    recopying: bool = False
    """A DDL at the head of the span re-copies its table (``ddl_plan``): nothing streams."""
    recopy_key: str | None = None
    """The finished re-copy's progress key, deleted once the checkpoint is past its DDL."""
    ddl_failure: DdlFailure | None = None
    """The DDL at the head of the span cannot be carried out downstream."""
    rules: TableRules | None = None
    """The table rules of the span's table (``libs.table_rules``), when it has any."""
    source_meta: TableMetaV1 | None = None
    """The table's metadata as its rows carry it (what the rules' expressions see)."""
    group: GroupCut | None = None
    """A table group's cut and batch (``table_group``), applied in the driver, not by Spark."""
    group_fks: list[ForeignKey] = field(default_factory=list)
    fk_wait: tuple[str, str] | None = None
    """(event id, why): the barrier that changes the span's foreign-key group (``fk_barrier``);
    the span stops before it."""


@dataclass
class SpanOutcome:
    written: bool = False
    rows: int = 0
    ddl_applied: bool = False
    blocked: str | None = None
    """Why the span stops at its DDL barrier: "blocked" (shard DDL) ..."""
    refused: str | None = None
    """... or "refused" (the DDL leaves the table without a usable key)."""
    error: str | None = None
    ddl_failure: DdlFailure | None = None
    incident: TableIncident | None = None
    """The downstream refused one of the batch's changes for good: the span stops."""
    publish: list[StreamMessage] | None = None
    """NATS sink: the batch's messages; written (and the DDL applied) once all are acked."""
    publish_ddl: bool = False
    ddl_ignored: bool = False
    """NATS sink: the batch's DDL is one the table rules leave out (nothing published for it)."""


@dataclass
class RoundReport:
    spans: int = 0
    events: int = 0
    batch_events: int = 0
    rows_written: int = 0
    ddl_applied: int = 0
    advanced: int = 0
    errors: list[str] = field(default_factory=list)
    abandoned: bool = False
    pull_s: float = 0.0
    duration_s: float = 0.0


class RoundAbandoned(Exception):
    """The worker is stopping and the round did not finish within the grace period."""
