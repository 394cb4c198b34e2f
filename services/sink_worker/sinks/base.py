"""The sink interface the apply job writes through.

The apply job hands a sink the *final* image per key of one consistent batch, already split
into partitions by a hash of (table, key). Each partition is written by one call of
``apply_partition`` on a fresh connection, possibly in parallel with other partitions. The
writes must be idempotent: re-applying the same or an older batch converges to the same state.

- ``Delete(table, key)``: delete the row with this primary-key value (no error when absent).
- ``Upsert(table, key, row)``: first delete rows that hold any of the row's unique-key values
  under another primary key, then insert-or-replace the row by primary key (MySQL REPLACE /
  ON DUPLICATE KEY semantics; PostgreSQL ON CONFLICT; SQLite INSERT OR REPLACE).

Values in ``key`` and ``row`` are already decoded to Python values (int, float, Decimal, str,
bytes, date, datetime, time as timedelta or str, JSON as str, None) by ``values.decode_row``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from contracts.events.rows import TableMetaV1
from services.sink_worker.sinks.unique_guard import ConflictGuard
from services.sink_worker.sinks.write_fence import WriteFence


@dataclass(frozen=True)
class TargetTable:
    """A downstream table: its name, its columns and the key the apply path uses."""

    schema: str | None  # database (MySQL) or schema (PostgreSQL); None for SQLite / the default
    name: str
    meta: TableMetaV1
    key: tuple[str, ...]  # primary key, or the unique key / all columns the changefeed chose
    unique_keys: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    case_insensitive: bool = False
    """Text columns with a case-insensitive source collation compare so on PostgreSQL (a
    nondeterministic ICU collation) and SQLite (NOCASE): the changefeed's ``text_comparison``."""
    keep_columns: bool = False
    """``schema_change_policy = lenient``: reconciling keeps the target's columns ``meta`` lacks
    (made nullable) instead of dropping them."""
    leave_out_columns: bool = False
    """``schema_change_policy = ignore``: a row's columns ``meta`` lacks are left out of its write
    (``meta`` is the target's columns) instead of refused."""
    fence: WriteFence | None = None
    """The spans' write tokens every write transaction into the table checks first
    (``write_fence``); None: unfenced (reads, DDL, tests of the sink alone)."""


@dataclass(frozen=True)
class Delete:
    key: tuple[Any, ...]


@dataclass(frozen=True)
class Upsert:
    key: tuple[Any, ...]
    row: Mapping[str, Any]
    shard: int = -1
    """Index of the span the change came from (``unique_guard``; -1: not tracked)."""


Change = Delete | Upsert


@dataclass
class PartitionResult:
    deleted: int = 0
    upserted: int = 0
    conflicts_removed: int = 0
    overwritten: list[str] = field(default_factory=list)
    """Cross-shard conflicts removed under ``on_unique_conflict = overwrite`` (JSON reports)."""


class StatementTarget(Protocol):
    """A downstream that runs the source's DDL text itself (MySQL/MariaDB): shard DDL runs the
    statement rewritten to the target, so what table metadata does not show (indexes, defaults,
    comments) reaches it too, and checks a failed statement against the target's shape."""

    def execute_ddl(self, sql: str) -> None: ...

    def table_shape(self, table: TargetTable) -> tuple[list[tuple[str, str, bool]], dict[str, list[str]]]: ...


class Sink(ABC):
    """One downstream database. Instances are cheap and picklable (they hold a URL, not a socket)."""

    dialect: str

    @abstractmethod
    def ensure_table(self, table: TargetTable) -> None:
        """Create the target table from the source metadata when missing (idempotent)."""

    @abstractmethod
    def reconcile_schema(self, table: TargetTable, drop: Collection[str] = ()) -> list[str]:
        """Bring the target's columns to ``table.meta`` (creating the table when it is missing,
        as ``ensure_table``): add the missing ones, drop those of ``drop`` (the columns a DDL
        dropped) it no longer has; return the SQL run. Other
        columns the target has beyond the metadata are its own (an operator's extra columns)
        and stay.

        This is how a single-shard DDL reaches the target: idempotent, so a crash between
        executing it and recording it re-runs it harmlessly.
        """

    def settled_schemas(self, tables: Sequence[TargetTable]) -> set[tuple[str | None, str]]:
        """``(schema, name)`` of those of ``tables`` on which ``reconcile_schema`` (with nothing
        to drop) would change nothing now, found in bulk: a round that meets thousands of
        targets for the first time checks them in a few reads instead of a connection each.
        None of them by default: each is reconciled on its own."""
        return set()

    @abstractmethod
    def drop_table(self, table: TargetTable) -> None: ...

    @abstractmethod
    def truncate_table(self, table: TargetTable) -> None: ...

    @abstractmethod
    def apply_partition(self, table: TargetTable, changes: Iterable[Change],
                        guard: ConflictGuard | None = None, *, keep: bool = False) -> PartitionResult:
        """Write one partition's final images idempotently, in one transaction, retrying deadlocks.
        With ``guard``, a unique conflict with another shard's row follows its policy. ``keep``:
        the connection stays open for the next ``keep`` write, until ``close`` (a partition of
        many small targets: a connection each was a sixth of the apply job's time)."""

    def load_rows(self, table: TargetTable, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  *, keys_unique: bool = True) -> int:
        """Bulk write of rows the initial load copied (``columns`` name each row's values, all
        of them decoded as for ``apply_partition``): insert-or-replace by key, rows holding an
        incoming row's unique values under another key removed first, in one transaction, so a
        re-copied chunk converges. ``keys_unique``: no two rows share a key (a copy keyed by the
        source's primary key). Returns the rows written.

        This default goes through ``apply_partition``; SQL sinks override it with their
        dialect's bulk path (LOAD DATA, COPY, executemany)."""
        index = [list(columns).index(k) for k in table.key]
        self.apply_partition(table, [Upsert(key=tuple(r[i] for i in index),
                                            row=dict(zip(columns, r, strict=True))) for r in rows])
        return len(rows)

    def take_write_fences(self, schema: str | None, spans: Sequence[str],
                          owner: str) -> dict[str, int] | None:
        """Bump each span's write token in ``schema`` and return them (``write_fence``); None
        for a sink without fencing (a stream sink: its consumers deduplicate by message id)."""
        return None

    def statement_target(self) -> StatementTarget | None:
        """Itself when it runs the source's DDL text (MySQL/MariaDB), else None."""
        return None

    def close(self) -> None:  # noqa: B027 (a hook: most sinks keep nothing open)
        """Release what the sink keeps open between bulk loads (nothing by default)."""

    def takes_source_bytes(self, table: TargetTable, columns: Sequence[str]) -> bool:
        """Whether ``load_source_bytes`` can write these columns of ``table`` (asked once per
        copied chunk)."""
        return False

    def load_source_bytes(self, table: TargetTable, columns: Sequence[str],
                          rows: Sequence[Sequence[bytes | None]], *, keys_unique: bool = True) -> int:
        """``load_rows`` of rows as the bytes a MySQL/MariaDB source's text protocol sent them
        (utf8mb4; NULL as None), undecoded: the copy's fast path, for a sink whose bulk format
        reads the source's spelling of these columns' values as they are. Only called when
        ``takes_source_bytes`` said yes."""
        raise TypeError(f"{type(self).__name__} does not load source bytes")

    @abstractmethod
    def fetch_rows(self, table: TargetTable) -> list[dict[str, Any]]:
        """Every row of the table, normalised like decoded source rows and sorted by key.

        Not on the apply path: ``verify`` (the demo's final check), the benchmarks' checksums and
        the tests read targets through it, so a target is read by the same code that writes it."""
