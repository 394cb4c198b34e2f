"""Identifiers, member-reported table states and the errors of the scheduling domain.

Everything here is a plain value: no I/O, no clocks. The services turn these into contract
events and NATS messages; this module only fixes their meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple
from urllib.parse import quote, unquote

from libs.foreign_keys import group_members
from libs.streams import ddl_subject, rows_subject, token

MemberId = str
"""A sink-worker member id as the member service knows it (TiCDC's capture id)."""

ChangefeedId = str


class Span(NamedTuple):
    """The unit of scheduling and of apply: one upstream table (or one foreign-key table group)
    of one source inside one changefeed.

    ``source``/``database``/``table`` are the tokens of the span's ROWS-stream subjects
    (``libs.streams.token``), because that is how spans are discovered; the real database and
    table names, which can hold characters a subject token cannot, come from the events. A table
    group's ``table`` is its group token (``libs.foreign_keys.group_token``).

    A NamedTuple rather than a dataclass on purpose: spans are dict keys on every hot path of
    the replication manager and the sink pipeline, and tuple hashing/equality/ordering run in
    C. With 10,000 spans a Python-level ``__hash__`` per lookup is a measurable share of
    scheduling time.

    Two string keys, on purpose, each stored in existing streams and buckets so neither can
    change without a migration: ``key`` (percent-encoded, ``/``-separated, reversible with
    ``parse``) is what the scheduling domain's events and the control plane's messages carry;
    ``kv_key`` (``=XX``-escaped, ``.``-separated) is what the sink's KV buckets (checkpoints,
    validation status, prepare progress) are keyed by, because a KV key cannot hold ``%``.
    Both are injective.
    """

    changefeed: ChangefeedId
    source: str
    database: str
    table: str

    @classmethod
    def of(cls, changefeed: str, source: str, database: str, table: str) -> Span:
        """A span from real names (tokenised the way capture names the subjects)."""
        return cls(changefeed, token(source), token(database), token(table))

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

    @property
    def kv_key(self) -> str:
        """The span's key in the sink's KV buckets: injective, KV-safe (``[-/_=.A-Za-z0-9]``).

        ``token`` alone is not injective (``a.b`` and ``a_b`` both give ``a_b``) and a checkpoint
        must never be shared by two spans, so every other character is escaped as ``=XX``.
        """
        return ".".join(_kv_escape(part) for part in self)

    @property
    def name(self) -> str:
        """Human and label friendly: ``cf/source/db.table``."""
        return f"{self.changefeed}/{self.source}/{self.database}.{self.table}"

    @property
    def members(self) -> tuple[tuple[str, str], ...] | None:
        """A table group's tables (``(database token, table token)``), None for one table's span
        (``libs.foreign_keys.group_token``: the tables cascading foreign keys connect)."""
        return group_members(self.table)

    def tables(self) -> tuple[tuple[str, str], ...]:
        """The tables whose events the span reads: the group's, or its own."""
        return self.members or ((self.database, self.table),)

    def subjects(self) -> list[str]:
        """Rows and DDL subjects of every table of the span."""
        return [subject(self.source, d, t) for d, t in self.tables()
                for subject in (rows_subject, ddl_subject)]

    @property
    def rows_subject(self) -> str:
        return rows_subject(self.source, self.database, self.table)

    @property
    def ddl_subject(self) -> str:
        return ddl_subject(self.source, self.database, self.table)

    def __str__(self) -> str:
        return self.key


def kv_parts(kv_key: str) -> tuple[str, ...]:
    """The parts of a ``Span.kv_key``, unescaped (its inverse, part by part)."""
    return tuple(re.sub(rb"=([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), part.encode())
                 .decode() for part in kv_key.split("."))


def _kv_escape(value: str) -> str:
    out = []
    for ch in value:
        if ch.isascii() and (ch.isalnum() or ch in "-_"):
            out.append(ch)
        else:
            out.extend(f"={b:02X}" for b in ch.encode())
    return "".join(out) or "=00"


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
