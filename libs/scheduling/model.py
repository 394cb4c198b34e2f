"""Identifiers, member-reported table states and the errors of the scheduling domain.

Everything here is a plain value: no I/O, no clocks. The services turn these into contract
events and NATS messages; this module only fixes their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple
from urllib.parse import quote, unquote

MemberId = str
"""A sink-worker member id as the member service knows it (TiCDC's capture id)."""

ChangefeedId = str


class Span(NamedTuple):
    """The unit of scheduling: one upstream table of one source inside one changefeed.

    A NamedTuple rather than a dataclass on purpose: spans are dict keys on every hot path of
    the replication manager, and tuple hashing/equality/ordering run in C. With 10,000 spans a
    Python-level ``__hash__`` per lookup is a measurable share of scheduling time.
    """

    changefeed: ChangefeedId
    source: str
    database: str
    table: str

    @property
    def key(self) -> str:
        """Stable, reversible string form: ``changefeed/source/database/table``.

        Each part is percent-encoded so a ``/`` (or anything else) inside a name cannot make two
        different spans share a key.
        """
        return "/".join(quote(part, safe="") for part in self)

    @classmethod
    def parse(cls, key: str) -> Span:
        parts = key.split("/")
        if len(parts) != 4:
            raise ValueError(f"span key {key!r} must have 4 '/'-separated parts, found {len(parts)}")
        changefeed, source, database, table = (unquote(p) for p in parts)
        return cls(changefeed, source, database, table)

    def __str__(self) -> str:
        return self.key


class TableState(StrEnum):
    """What a member says about one span it holds (TiCDC's tablepb.TableState).

    Absent -> Preparing -> Prepared -> Replicating on the add path; anything active ->
    Stopping -> Stopped on the remove path. Only Replicating, and Stopping after Replicating,
    can write downstream.
    """

    ABSENT = "absent"
    PREPARING = "preparing"
    PREPARED = "prepared"
    REPLICATING = "replicating"
    STOPPING = "stopping"
    STOPPED = "stopped"


ACTIVE_TABLE_STATES = frozenset(
    {TableState.PREPARING, TableState.PREPARED, TableState.REPLICATING, TableState.STOPPING}
)
GONE_TABLE_STATES = frozenset({TableState.ABSENT, TableState.STOPPED})


@dataclass(frozen=True, slots=True)
class TableStatus:
    """One span as one member reports it, with that member's progress on it."""

    span: Span
    state: TableState
    checkpoint_ts: int = 0
    resolved_ts: int = 0


@dataclass(frozen=True, slots=True)
class MemberReport:
    """A member's answer to a heartbeat (``complete``: every span it holds) or to a dispatch
    (not complete: just the dispatched span).

    ``epoch`` is the newest leader epoch the member had seen when it wrote the report. The
    replication manager drops reports older than its own epoch: they describe the member before
    it learned about this leader and may predate dispatches of the previous one.
    ``seq`` orders the reports of one member, so a report overtaken on the wire (heartbeats and
    dispatch replies travel on different subjects) cannot roll the manager's view back.
    """

    member: MemberId
    epoch: int
    tables: tuple[TableStatus, ...] = ()
    complete: bool = True
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """A live member as the scheduler sees it."""

    member: MemberId
    draining: bool = False


class SchedulingError(Exception):
    """Base class of every error this package raises or records."""


class InconsistentSetError(SchedulingError):
    """A ReplicationSet broke one of its own invariants: a bug, never a member's fault."""


class MultiplePrimaryError(SchedulingError):
    """More than one member may be writing one span downstream.

    Never resolved by the manager on its own (promoting either side could keep the wrong one);
    the span stays blocked, the changefeed checkpoint stops, and an operator decides. Kept as a
    value on the ReplicationSet so the service can list it, and raisable for callers that want
    to fail fast.
    """

    def __init__(self, span: Span, members: tuple[MemberId, ...], detail: str) -> None:
        self.span = span
        self.members = members
        self.detail = detail
        super().__init__(f"span {span.key}: {detail} (members: {', '.join(members)})")


class InvalidTaskError(SchedulingError):
    """A schedule task or operator request that cannot be carried out; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)
