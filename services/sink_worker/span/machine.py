"""A span's state in this worker, as a state machine: one handler per event, each returning what
the I/O around it is to do (write nothing, log a refusal once, record an incident, advance the
checkpoint to X and store it now or when due).

Events: ``started`` (where the span's first round starts: copying, done, streaming), ``pull_failed``,
``source_failed`` (a group's foreign keys cannot be read), ``written`` (the round's end for the
span: the verdict at its head, its cut and what its write did; the DDL barrier's outcome is part
of it) and ``operator_action``. The pipeline, ``CheckpointAdvance`` and ``DdlBarrier`` only carry
out what a handler decides.

Invariants, checked after every step (in production, as ``ReplicationSet``'s are):

- a span is ``error`` or ``blocked`` exactly when it has an error to show;
- a span stopped by an incident (a downstream's permanent refusal, or a table that cannot be
  replicated as the changefeed says) is ``error`` with ``stopped: ...`` and runs no round until
  an operator acts;
- a DDL the downstream cannot take (``ddl_error``) is shown only while the span stops
  (``error`` or ``blocked``);
- a decided checkpoint is never below the round's start, in ts and in stream sequence, and
  only a batch written in full (or nothing fresh, below the horizon) moves it.

Deviations from the behaviour before this module: entering ``replicating``, ``snapshot`` or
``done`` clears ``ddl_error`` (before, a refused span planned again, or a span started again,
kept showing the old DDL failure next to ``replicating`` until its round ended), and ``started``
keeps a span stopped by an incident stopped. A table that cannot be replicated (no usable key,
rules that do not fit, a DDL that leaves it keyless) was a ``refused`` state that lifted itself
when a plan or a config allowed the table again; it is now an incident (``Unreplicable``) like a
downstream's refusal: recorded and logged once, shown as stopped by the api, left out of the
changefeed's checkpoint, and lifted by the operator's ``resume`` after the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Concatenate, Literal, ParamSpec, Protocol, TypeVar
from uuid import uuid4

from services.sink_worker.ddl.policy import POLICY_STOP_PREFIX
from services.sink_worker.incidents.poison import IncidentAction, TableIncident, Unreplicable
from services.sink_worker.incidents.table_errors import DdlFailure
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.sinks.nats_stream import StreamMessage
from services.sink_worker.span.checkpoints import Checkpoint


class SpanState(StrEnum):
    STARTING = "starting"
    SNAPSHOT = "snapshot"
    """Its initial load (or a re-copy after a DDL) is copying."""
    REPLICATING = "replicating"
    DONE = "done"
    """A snapshot-only span whose copy is done."""
    BLOCKED = "blocked"
    """Waits at a DDL for shard DDL coordination or a foreign-key group to be formed again."""
    ERROR = "error"


_SHOWS_ERROR = frozenset({SpanState.ERROR, SpanState.BLOCKED})
STOPPED_PREFIX = "stopped: "


class SpanInvariantError(RuntimeError):
    """A step left the span in a state no handler is written for."""


# -- what the driver found at the span's head, before the round's write --------------------------

@dataclass(frozen=True)
class Refused:
    """The span does not write this round: it cannot be replicated as the changefeed says
    (``unreplicable``: no usable key, rules that do not fit; it stops with an incident), or
    the source cannot tell what it needs this round (a group's foreign keys unreadable)."""

    reason: str
    unreplicable: bool = False


@dataclass(frozen=True)
class WaitsAtHead:
    """Stopped at a shard DDL, waiting for its operation (nothing moves)."""

    reason: str


@dataclass(frozen=True)
class Recopying:
    """A DDL at the head re-copies the table: nothing streams until the copy is done."""


@dataclass(frozen=True)
class HeadFailed:
    """The DDL at the head cannot be carried out downstream."""

    failure: DdlFailure


@dataclass(frozen=True)
class CarriedOut:
    """The DDL at the head was carried out in the driver (a shard DDL, a rename away, a finished
    re-copy): the span moves past it."""

    cut: SpanCut
    recopy_key: str | None = None
    """The finished re-copy's progress record, deleted once the checkpoint is stored past it."""


Head = Refused | WaitsAtHead | Recopying | HeadFailed | CarriedOut


@dataclass
class SpanOutcome:
    """What a span's write did this round (filled in by the writers, in the round's thread)."""

    written: bool = False
    rows: int = 0
    ddl_applied: bool = False
    blocked: str | None = None
    """Why the span stops at its DDL barrier: "blocked" (shard DDL) ..."""
    refused: str | None = None
    """... or the DDL leaves the table without a usable key: it stops with an incident."""
    error: str | None = None
    ddl_failure: DdlFailure | None = None
    incident: TableIncident | None = None
    """The downstream refused one of the batch's changes for good: the span stops."""
    publish: list[StreamMessage] | None = None
    """NATS sink: the batch's messages; written (and the DDL applied) once all are acked."""
    publish_ddl: bool = False
    ddl_ignored: bool = False
    """NATS sink: the batch's DDL is one the table rules leave out (nothing published for it)."""


class PulledPositions(Protocol):
    """What the checkpoint arithmetic reads of a pull."""

    @property
    def read_upto(self) -> int: ...

    def first_seq_after(self, ts: int) -> int | None: ...


@dataclass(frozen=True)
class RoundFacts:
    """The ``written`` event: everything the round learnt about the span."""

    start: Checkpoint
    """The checkpoint the round started from."""
    horizon: int
    """Up to where the span is complete (its source's resolved ts, bounded by what was read)."""
    pulled: PulledPositions
    head: Head | None
    cut: SpanCut | None
    outcome: SpanOutcome | None
    grouped: bool = False
    """A table group's work (applied in the driver; validation does not follow it)."""


@dataclass
class Advance:
    """What ``written`` decided: the I/O around it reports, records and stores accordingly."""

    checkpoint: Checkpoint | None = None
    """The span's checkpoint after the round (None: nothing to decide, the span keeps its own)."""
    moved: bool = False
    """``checkpoint`` is past the round's start."""
    store_now: bool = False
    """A batch (or DDL) was written: store at once; else only when the store is due."""
    batch_events: int | None = None
    """The batch's events (None: no batch was cut)."""
    rows: int = 0
    ddl_applied: bool = False
    validate_upto: int | None = None
    """Tell validation the batch's keys, applied up to this ts."""
    recopy_key: str | None = None
    incident: TableIncident | None = None
    """A new incident stopped the span: record it (and log it, once)."""
    error: str | None = None
    """The round's error line for the span."""


@dataclass(frozen=True)
class OperatorDecision:
    skip: tuple[str, int] | None = None
    """(key JSON, ts): that key's changes up to ts are left out from now on."""
    incident: TableIncident | None = None
    """The incident the decision ended."""


_P = ParamSpec("_P")
_R = TypeVar("_R")
_Step = Callable[Concatenate["SpanMachine", _P], _R]


def _step(handler: _Step[_P, _R]) -> _Step[_P, _R]:
    @functools.wraps(handler)
    def step(machine: SpanMachine, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        out = handler(machine, *args, **kwargs)
        machine.check_invariants()
        return out

    return step


@dataclass(kw_only=True)
class SpanMachine:
    """A span's state; every change of it is a handler below."""

    state: SpanState = SpanState.STARTING
    error: str | None = None
    ddl_error: DdlFailure | None = None
    """The DDL the span stopped at because its downstream cannot take it (``table_errors``)."""
    incident: TableIncident | None = None
    """Stopped by a downstream's permanent refusal (``poison``): no round runs the span until
    an operator skips, retries or resumes it."""
    skips: dict[str, int] = field(default_factory=dict)
    """Key JSON -> ts: that key's changes up to ts are left out (skipped by an operator)."""
    skip_reasons: dict[str, TableIncident] = field(default_factory=dict)
    """Skipped keys whose events are not dead-lettered yet, with the incident they ended."""
    released_after_ts: int | None = None
    """``schema_change_policy = stop``: an operator resumed the table stopped below a DDL at
    this ts; the first DDL after it is applied (``ddl_released``)."""
    released_ddl_seq: int | None = None
    """The stream sequence of the DDL that resume released (rounds may meet it again)."""

    def __post_init__(self) -> None:
        self.state = SpanState(self.state)  # one built from its name (a status read back)
        self.check_invariants()

    # -- invariants ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        problems: list[str] = []
        if (self.state in _SHOWS_ERROR) != (self.error is not None):
            problems.append(f"error {self.error!r} does not fit the state")
        if self.incident is not None and (self.state is not SpanState.ERROR or self.error is None
                                          or not self.error.startswith(STOPPED_PREFIX)):
            problems.append(f"incident {self.incident.id} but not stopped")
        if self.ddl_error is not None and self.state not in _SHOWS_ERROR:
            problems.append("a DDL failure shown on a span that does not stop")
        if problems:
            raise SpanInvariantError(f"span state {self.state}: " + "; ".join(problems))

    def _enter(self, state: SpanState, error: str | None = None) -> None:
        self.state, self.error = state, error
        if state not in _SHOWS_ERROR:
            self.ddl_error = None

    # -- events ----------------------------------------------------------------------------------

    @_step
    def started(self, decision: Literal["copying", "done", "stream"]) -> None:
        """Where the span's first round starts (``span.start``)."""
        if self.incident is not None:
            return  # stopped until an operator acts, wherever its checkpoint is
        self._enter({"copying": SpanState.SNAPSHOT, "done": SpanState.DONE,
                     "stream": SpanState.REPLICATING}[decision])

    @_step
    def refused_before_start(self, reason: str) -> TableIncident | None:
        """The span cannot start as its changefeed says: its initial load cannot copy the table
        (no usable key, a column type capture does not carry), or its start position or time
        lies before the source's stream begins. Stopped with an incident before any checkpoint
        (ts 0)."""
        if self.incident is not None:
            return None
        return self._stop(unreplicable(reason, 0)).incident

    @_step
    def pull_failed(self, reason: str) -> None:
        if self.incident is None:  # a stopped span shows its incident, not what came after
            self._enter(SpanState.ERROR, reason)

    @_step
    def source_failed(self, reason: str) -> None:
        """The source cannot say what the span needs to plan (a group's foreign keys)."""
        if self.incident is None:
            self._enter(SpanState.ERROR, reason)

    @_step
    def written(self, facts: RoundFacts) -> Advance:
        """The round's end for the span: its state, and the checkpoint it may move to (only
        past batches written in full; a span with nothing fresh follows its horizon). A span
        stopped by an incident runs no round; one that ran anyway decides nothing."""
        if self.incident is not None:
            return Advance()
        head, cut, outcome = facts.head, facts.cut, facts.outcome
        if isinstance(head, Refused):
            if head.unreplicable:
                return self._stop(unreplicable(head.reason, facts.start.ts))
            return Advance()
        if isinstance(head, WaitsAtHead):
            self.state, self.error = SpanState.BLOCKED, head.reason
            return Advance()
        if isinstance(head, HeadFailed):
            self.state, self.error, self.ddl_error = SpanState.ERROR, head.failure.message(), head.failure
            return Advance(error=self.error)
        if isinstance(head, Recopying):
            self._enter(SpanState.SNAPSHOT)
            return Advance()
        if isinstance(head, CarriedOut):
            cut, outcome = head.cut, SpanOutcome(written=True, ddl_applied=True)
        if outcome is not None and outcome.incident is not None:
            return self._stop(outcome.incident)
        if outcome is not None and outcome.error:
            self.state, self.error, self.ddl_error = SpanState.ERROR, outcome.error, outcome.ddl_failure
            return Advance(error=outcome.error)
        self.ddl_error = None
        decision = Advance()
        if cut is None:
            handled = facts.horizon  # nothing fresh: everything up to the horizon is applied
        else:
            written = outcome is not None and outcome.written
            if not written and (cut.batch_events or cut.ddl_id):
                return decision  # not written: nothing to checkpoint
            ddl_applied = outcome is not None and outcome.ddl_applied
            handled = cut.ddl_ts if ddl_applied and cut.ddl_ts is not None else cut.limit_ts
            decision.batch_events = cut.batch_events
            decision.ddl_applied = ddl_applied
            decision.store_now = cut.batch_events > 0 or ddl_applied
            if cut.batch_events and not facts.grouped:
                decision.validate_upto = handled
        start = facts.start
        new_ts = max(start.ts, handled)
        first_pending = facts.pulled.first_seq_after(new_ts)
        new_seq = max(start.stream_seq,
                      first_pending - 1 if first_pending is not None else facts.pulled.read_upto)
        decision.checkpoint = Checkpoint(stream_seq=new_seq, ts=new_ts)
        decision.moved = decision.checkpoint != start
        if outcome is not None:
            decision.rows = outcome.rows
        if outcome is not None and outcome.refused:
            # Written up to the DDL, which leaves the table without a usable key: stopped there.
            stopped = self._stop(unreplicable(outcome.refused, decision.checkpoint.ts))
            decision.incident, decision.error = stopped.incident, stopped.error
        elif outcome is not None and outcome.blocked:
            self.state, self.error = SpanState.BLOCKED, outcome.blocked
        else:
            self._enter(SpanState.REPLICATING)
        if isinstance(head, CarriedOut):
            decision.recopy_key = head.recopy_key
        if decision.checkpoint.ts < start.ts or decision.checkpoint.stream_seq < start.stream_seq:
            raise SpanInvariantError(f"checkpoint {decision.checkpoint} below the round's start {start}")
        return decision

    def _stop(self, incident: TableIncident) -> Advance:
        self.incident = incident
        self._enter(SpanState.ERROR, f"{STOPPED_PREFIX}{incident.failure.describe()}")
        return Advance(incident=incident, error=self.error)

    @_step
    def operator_action(self, incident: str, action: IncidentAction) -> OperatorDecision | None:
        """An operator's decision on the span's incident; None (and nothing changes) when the
        span is not stopped by that incident, or a ``skip`` has no single row to skip."""
        stopped = self.incident
        if stopped is None or stopped.id != incident:
            return None
        skip: tuple[str, int] | None = None
        if action == "skip":
            if stopped.failure.key is None:
                return None  # no single row to skip: the batch only fails as a whole
            skip = (stopped.failure.key, max(stopped.upto_ts, self.skips.get(stopped.failure.key, 0)))
            self.skips[skip[0]] = skip[1]
            self.skip_reasons[skip[0]] = stopped
        if (action != "skip" and isinstance(stopped.failure, Unreplicable)
                and stopped.failure.error.startswith(POLICY_STOP_PREFIX)):
            self.released_after_ts, self.released_ddl_seq = stopped.upto_ts, None
        self.incident = None
        self._enter(SpanState.REPLICATING)
        return OperatorDecision(skip=skip, incident=stopped)

    def ddl_released(self, ts: int, stream_seq: int) -> bool:
        """Whether the DDL at ``ts`` is the one an operator released by resuming the table's
        ``stop`` incident (the first DDL after where it stopped); it stays released for the
        rounds that meet it again until it is carried out."""
        if self.released_ddl_seq == stream_seq:
            return True
        if self.released_after_ts is not None and ts > self.released_after_ts:
            self.released_after_ts, self.released_ddl_seq = None, stream_seq
            return True
        return False


def unreplicable(reason: str, at_ts: int) -> TableIncident:
    """The incident of a table that cannot be replicated as the changefeed says, stopped at
    ``at_ts`` (its checkpoint: everything up to it is downstream). A fresh id each time: after a
    resume that did not fix it, the table stops again as a new incident."""
    return TableIncident(id=uuid4().hex, target="", failure=Unreplicable(reason), upto_ts=at_ts)
