"""The per-round records of a span's work: ``SpanWork`` (what a round pulled for a span and its
plan, with the verdict at its head) and ``RoundReport`` (the round summed up); what its write
did is a ``span.machine.SpanOutcome``."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.events.rows import TableMetaV1
from libs.foreign_keys import ForeignKey
from libs.table_rules import TableRules
from services.sink_worker.fk.table_group import GroupCut
from services.sink_worker.round.apply_job import TargetPlan
from services.sink_worker.round.large_txn import LargeHead
from services.sink_worker.round.pull import PulledEvent, PullResult, ResolvedMark
from services.sink_worker.round.routes import SpanRoutes
from services.sink_worker.span.checkpoints import Checkpoint
from services.sink_worker.span.machine import Head, Refused
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
    head: Head | None = None
    """What the driver found at the span's head before the write (``span.machine``): a refusal,
    a wait at a shard DDL, a re-copy, a DDL that cannot be carried out, or one carried out."""
    origin: tuple[str, str] | None = None
    """The origin column's name and this span's value, when its rows carry one."""
    rules: TableRules | None = None
    """The table rules of the span's table (``libs.table_rules``), when it has any."""
    source_meta: TableMetaV1 | None = None
    """The table's metadata as its rows carry it (what the rules' expressions see)."""
    group: GroupCut | None = None
    """A table group's cut and batch (``table_group``), applied in the driver, not by Spark."""
    group_fks: list[ForeignKey] = field(default_factory=list)
    large: LargeHead | None = None
    """The head transaction is larger than the round: applied streamed (``large_txn``)."""
    fk_wait: tuple[str, str] | None = None
    """(event id, why): the barrier that changes the span's foreign-key group (``fk_barrier``);
    the span stops before it."""
    mark: ResolvedMark | None = None
    """The source's newest resolved mark when the round read it (``round.quiet``)."""

    @property
    def refused(self) -> bool:
        """The span does not write this round."""
        return isinstance(self.head, Refused)


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
    """Pull and plan of every span (``Pipeline._pull_all``)."""
    write_s: float = 0.0
    """The worker thread: the cut, each sink's write and the DDL barriers."""
    advance_s: float = 0.0
    """The spans' checkpoint decisions and stores, side by side."""
    ahead_wait_s: float = 0.0
    """Waiting, after all that, for the read-ahead of the next round to finish."""
    duration_s: float = 0.0


class RoundAbandoned(Exception):
    """The worker is stopping and the round did not finish within the grace period."""
