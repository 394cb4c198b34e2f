"""What the SQL sinks share: identifier quoting, statement building, the apply algorithm, retries.

Rules every statement here follows:

- Identifiers are always quoted by ``quote_ident`` (backticks for MySQL, double quotes
  otherwise, the quote character doubled inside), so a table named ``select`` or a column named
  ``we"ird`` is just a name. Values are always driver parameters, never text in the SQL.
- pymysql and psycopg use ``%s`` placeholders and treat ``%`` as special *only when parameters
  are passed*. Statements with parameters therefore quote identifiers with ``%`` doubled
  (``pident``); statements without (DDL, SELECT *) run with no parameters at all (``ident``).

The apply algorithm (``SqlSink.apply_partition``), one transaction per call:

1. collapse the changes to the last one per key and sort them by key, so that partitions
   running in parallel take row locks in the same order (fewer deadlocks);
2. ``DELETE ... WHERE key IN (...)`` for the deletes, a chunk per statement;
3. for every unique key: delete rows holding an upserted row's unique values under another key
   (one statement per unique key per chunk; a unique key with a NULL value is skipped, because
   NULLs never conflict in SQL). This is what makes the TDSQL "lucy" case commute: whichever
   partition runs first, the row that holds ``lucy`` last is the one the batch says holds it;
4. multi-row insert-or-update by key (dialect specific).

The whole transaction is retried (bounded, exponential backoff with jitter) on deadlocks,
serialization failures, lock timeouts, SQLITE_BUSY and lost connections: the writes are
idempotent, so re-running a partition from the start is always safe.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import random
import re
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.codec.decode import normalize_fetched, sql_type_for
from libs.dburl import DatabaseUrl, parse_database_url
from libs.sql_ident import quote_ident
from libs.target_fit import TargetDefinition
from services.sink_worker.sinks.base import Change, Delete, PartitionResult, Sink, TargetTable, Upsert
from services.sink_worker.sinks.shape_ddl import not_null, unnamed_unique_keys
from services.sink_worker.sinks.unique_guard import ConflictGuard, UniqueConflict, UniqueConflictError
from services.sink_worker.sinks.write_fence import FENCE_TABLE, WriteFence, WriteFenceLost

log = logging.getLogger("sluice.sink")

_KEY_PREFIX = "sluice_key__"
_CREATE_TABLE = re.compile(r"\s*CREATE\s+TABLE\b", re.IGNORECASE)
MADE_TABLE = "sluice_made_targets"
"""Per downstream schema: the targets Sluice created (``SqlSink.made_by_sluice``)."""


@dataclass(frozen=True)
class _Guarded:
    guard: ConflictGuard
    shards: Mapping[tuple[Any, ...], int]
    """Upserted key -> the span index its change came from."""

T = TypeVar("T")

ByteEncoder = Callable[[bytes], bytes] | None
"""How one column's source bytes are spelled in a bulk-load text file (None: as they are)."""

_NULL = b"\\N"


def source_text_files(rows: Iterable[Sequence[bytes | None]], encoders: Sequence[ByteEncoder],
                      limit: int) -> Iterator[bytes]:
    """Rows of source bytes as the text format LOAD DATA and COPY share (tab-separated fields,
    ``\\N`` for NULL, a row a line; each encoder escapes what its dialect needs), in files of
    about ``limit`` bytes (a row is never split): a batch of wide rows is sent as several
    files, so the encoded copy in memory stays one file, not the batch."""
    lines: list[bytes] = []
    size = 0
    for row in rows:
        line = b"\t".join([_NULL if v is None else v if encode is None else encode(v)
                           for v, encode in zip(row, encoders, strict=True)])
        lines.append(line)
        size += len(line) + 1
        if size >= limit:
            lines.append(b"")
            yield b"\n".join(lines)
            lines, size = [], 0
    if lines:
        lines.append(b"")
        yield b"\n".join(lines)



def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    size = max(1, size)
    for start in range(0, len(items), size):
        yield items[start: start + size]


def _sort_token(value: Any) -> tuple[int, str, Any]:
    # Values of one key column share a type, except NULL; the type name keeps mixed types
    # (which should not happen) from raising TypeError instead of merely sorting oddly.
    if value is None:
        return (0, "", 0)
    return (1, type(value).__name__, value)


def sort_key(key: tuple[Any, ...]) -> tuple[tuple[int, str, Any], ...]:
    return tuple(_sort_token(v) for v in key)


def _key_order(keys: Sequence[tuple[Any, ...]]) -> Callable[[Change], Any]:
    """The sort key of changes by ``sort_key`` of their keys; the key itself when every column
    holds values of one type and no NULL (then both order alike, and sorting plain tuples
    costs no tuple per value)."""
    if keys and all(len(types) == 1 and type(None) not in types
                    for types in map(set, map(functools.partial(map, type), zip(*keys, strict=True)))):
        return operator.attrgetter("key")
    return lambda c: sort_key(c.key)


def _size_of(value: Any) -> int:
    # Upper bounds of the value's size in pymysql's statement text: UTF-8 takes up to 4 bytes a
    # character, escaping doubles at most a byte of binary.
    if isinstance(value, str):
        return len(value) * 4 + 8
    if isinstance(value, bytes | bytearray):
        return len(value) * 2 + 16
    return 24


@dataclass(frozen=True)
class LiteralUpsert:
    """An upsert spelled with literal values: ``prefix`` + the rows' ``render`` texts joined by
    ", " + ``suffix``."""

    prefix: str
    suffix: str
    render: Callable[[Sequence[Any]], str]


class SqlSink(Sink):
    """The apply algorithm for any DB-API driver; subclasses supply the dialect details."""

    dialect: str = ""
    placeholder: str = "%s"
    # Bind parameters one statement may carry (SQLite's compile-time default is 999 in old
    # builds; PostgreSQL's protocol limit is 65535; pymysql interpolates client side).
    max_params: int = 60_000
    # SQLite has no TRUNCATE; an unqualified DELETE is its truncate.
    truncate_verb: str = "TRUNCATE TABLE"
    # Keep a multi-row statement under every default max_allowed_packet (MySQL 5.7: 4 MiB;
    # MariaDB: 16 MiB; MySQL 8: 64 MiB). A single larger row still goes, alone.
    max_statement_bytes: int = 2 * 1024 * 1024

    def __init__(self, url: str, *, max_attempts: int = 8, backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0, chunk_rows: int = 500) -> None:
        self.url = url
        self.db: DatabaseUrl = parse_database_url(url)
        if self.db.dialect != self.dialect:
            raise ValueError(f"{type(self).__name__} needs a {self.dialect} URL, got {self.db.redacted()}")
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.chunk_rows = chunk_rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.db.redacted()!r})"

    # ------------------------------------------------------------------ dialect hooks

    @abstractmethod
    def _connect(self) -> Any:
        """A new DB-API connection, not in autocommit mode."""

    @abstractmethod
    def _begin(self, conn: Any) -> None:
        """Start the partition's transaction."""

    @abstractmethod
    def _retryable(self, exc: BaseException) -> bool:
        """True for errors after which re-running the whole transaction may succeed."""

    @abstractmethod
    def _upsert_sql(self, table: TargetTable, columns: Sequence[str], nrows: int) -> str:
        """A multi-row insert-or-update by ``table.key`` of ``nrows`` rows of ``columns``."""

    def drop_table(self, table: TargetTable) -> None:
        sql = f"DROP TABLE IF EXISTS {self._table_ref(table)}"

        def work(cur: Any) -> None:
            cur.execute(sql)
            self._unmark(cur, table)

        self._run(work, f"drop {table.name!r}")

    def truncate_table(self, table: TargetTable) -> None:
        sql = f"{self.truncate_verb} {self._table_ref(table)}"
        self._run(lambda cur: cur.execute(sql), f"truncate {table.name!r}")

    def target_columns(self, table: TargetTable) -> list[str] | None:
        """The target's column names as the downstream has them (None: no such table)."""
        found: list[str] | None = self._run(lambda cur: self._current(cur, table),
                                            f"columns of {table.name!r}")
        return found

    def fill_renamed(self, table: TargetTable, renamed: Sequence[tuple[str, str]]) -> None:
        """Each renamed column's new column takes the old one's values in every row (a column
        rename under ``schema_change_policy = lenient``, which keeps the old one beside it)."""
        def work(cur: Any) -> None:
            # An old column the target lacks (the table was copied again from the source since,
            # or never had it): its new column came filled with the rows. SQLite would read a
            # missing column's quoted name as a string, so it is never named.
            have = {c.casefold() for c in self._current(cur, table) or []}
            sets = ", ".join(f"{self.ident(new)} = {self.ident(old)}" for old, new in renamed
                             if old.casefold() in have and new.casefold() in have)
            if sets:
                cur.execute(f"UPDATE {self._table_ref(table)} SET {sets}")

        self._run(work, f"fill renamed columns of {table.name!r}")

    # ------------------------------------------------------------------ targets Sluice made

    def _made_table(self, table: TargetTable) -> TargetTable:
        return TargetTable(schema=table.schema, name=MADE_TABLE,
                           meta=TableMetaV1(columns=[], primary_key=[]), key=())

    def _create_marked(self, cur: Any, table: TargetTable, statements: Sequence[str]) -> list[str]:
        """Run ``statements`` (the CREATE ... IF NOT EXISTS of ``table``) and, when they make
        the table, record it in ``sluice_made_targets``: a target without that record existed
        before (an operator's own) and is used as it is (``made_by_sluice``).

        The record is written first. MySQL commits before every DDL statement, so the CREATE
        commits the record ahead of itself: a worker killed at any point leaves either no table
        (a record of a missing table is harmless: the next CREATE writes it again) or a table
        with its record. The other order left, after a kill between the two, a Sluice table that
        counted as an operator's, and a re-copy keeps an operator's columns the source no
        longer has. PostgreSQL and SQLite run it all in one transaction."""
        new = not self._current(cur, table)
        # The schema's statements (CREATE DATABASE / SCHEMA) go first: the record lives there.
        at = next((i for i, sql in enumerate(statements) if _CREATE_TABLE.match(sql)), len(statements))
        for sql in statements[:at]:
            cur.execute(sql)
        if new:
            made = self._made_table(table)
            cur.execute(f"CREATE TABLE IF NOT EXISTS {self._table_ref(made)}"
                        " (table_name VARCHAR(255) NOT NULL PRIMARY KEY)")
            # One statement, no DELETE first: a DELETE of an absent key locks its gap, and
            # creates of many tables at once (an initial load of thousands) then deadlocked.
            ref = self._table_ref(made, for_params=True)
            cur.execute(self.insert_absent_sql(ref, ("table_name",), ("table_name",)), (table.name,))
        for sql in statements[at:]:
            cur.execute(sql)
        return list(statements)

    def insert_absent_sql(self, ref: str, columns: Sequence[str], key: Sequence[str]) -> str:
        """An INSERT of one row (``columns``' placeholders) that does nothing when a row with
        the same ``key`` is there, in this dialect."""
        names = ", ".join(self.ident(c) for c in columns)
        values = ", ".join([self.placeholder] * len(columns))
        if self.dialect == "mysql":
            return f"INSERT IGNORE INTO {ref} ({names}) VALUES ({values})"
        if self.dialect == "postgresql":
            keys = ", ".join(self.ident(c) for c in key)
            return f"INSERT INTO {ref} ({names}) VALUES ({values}) ON CONFLICT ({keys}) DO NOTHING"
        return f"INSERT OR IGNORE INTO {ref} ({names}) VALUES ({values})"

    def _unmark(self, cur: Any, table: TargetTable) -> None:
        if self._current(cur, self._made_table(table)):
            ref = self._table_ref(self._made_table(table), for_params=True)
            cur.execute(f"DELETE FROM {ref} WHERE table_name = {self.placeholder}", (table.name,))

    def made_by_sluice(self, table: TargetTable) -> bool:
        """Whether Sluice created the target (its ``sluice_made_targets`` record), rather than
        finding it there (an operator's table, or one of a Sluice from before the record)."""
        def work(cur: Any) -> bool:
            if not self._current(cur, self._made_table(table)):
                return False
            ref = self._table_ref(self._made_table(table), for_params=True)
            cur.execute(f"SELECT 1 FROM {ref} WHERE table_name = {self.placeholder}", (table.name,))
            return cur.fetchone() is not None

        return self._run(work, f"who made {table.name!r}")

    # ------------------------------------------------------------------ a target kept as it is

    def _kept_table(self, table: TargetTable) -> TargetTable:
        name = f"sluice_kept__{table.name}"
        if len(name) > 60:  # MySQL names stop at 64 characters
            name = name[:51] + "_" + hashlib.sha256(table.name.encode()).hexdigest()[:8]
        return TargetTable(schema=table.schema, name=name, meta=TableMetaV1(columns=[], primary_key=[]),
                           key=())

    def save_columns(self, table: TargetTable, key: Sequence[str], names: Sequence[str]) -> None:
        """Copy ``key`` (as ``sluice_key__<column>``) and ``names`` of every row into a side
        table, for ``restore_columns`` once a re-copy has emptied and filled the target again.
        A side table already there is the save of an earlier run of the same re-copy (the target
        may be half copied since): kept as it is."""
        kept = self._kept_table(table)

        def work(cur: Any) -> None:
            if self._current(cur, kept):
                return
            cols = ", ".join([*(f"{self.ident(k)} AS {self.ident(_KEY_PREFIX + k)}" for k in key),
                              *(self.ident(c) for c in names)])
            cur.execute(f"CREATE TABLE {self._table_ref(kept)} AS SELECT {cols}"
                        f" FROM {self._table_ref(table)}")

        self._run(work, f"save columns of {table.name!r}")

    def restore_columns(self, table: TargetTable) -> int:
        """Put the saved columns (``save_columns``) back into the rows of the same key, then drop
        the side table; idempotent, and nothing to do without one. Returns the rows restored."""
        kept = self._kept_table(table)

        def work(cur: Any) -> int:
            saved = self._current(cur, kept)
            if not saved:
                return 0
            have = {c.casefold() for c in self._current(cur, table) or []}
            key = [c[len(_KEY_PREFIX):] for c in saved if c.startswith(_KEY_PREFIX)]
            cols = [c for c in saved if not c.startswith(_KEY_PREFIX) and c.casefold() in have]
            restored = 0
            if key and cols and all(k.casefold() in have for k in key):
                cur.execute(self._restore_sql(table, kept, key, cols))
                restored = max(int(cur.rowcount or 0), 0)
            else:
                log.warning("re-copy: saved columns %s of %r not restored (the key or the columns "
                            "are gone from the target)", cols, table.name)
            cur.execute(f"DROP TABLE IF EXISTS {self._table_ref(kept)}")
            return restored

        return self._run(work, f"restore columns of {table.name!r}")

    def _restore_sql(self, table: TargetTable, kept: TargetTable, key: Sequence[str],
                     cols: Sequence[str]) -> str:
        """PostgreSQL: UPDATE ... FROM."""
        on = " AND ".join(f"d.{self.ident(k)} = s.{self.ident(_KEY_PREFIX + k)}" for k in key)
        sets = ", ".join(f"{self.ident(c)} = s.{self.ident(c)}" for c in cols)
        return f"UPDATE {self._table_ref(table)} AS d SET {sets} FROM {self._table_ref(kept)} AS s WHERE {on}"

    def definition(self, table: TargetTable) -> TargetDefinition | None:
        """The target as the downstream's catalog has it (``libs.target_definitions``), read
        on the sink's own connection (its TLS and options)."""
        return self._run(lambda cur: self._definition(cur, table), f"definition of {table.name!r}")

    @abstractmethod
    def _definition(self, cur: Any, table: TargetTable) -> TargetDefinition | None: ...

    @abstractmethod
    def widen_in_place(self, table: TargetTable, types: Mapping[str, str]) -> list[str]:
        """Bring an existing, emptied target to hold ``table``'s rows without re-creating it:
        each column whose type (``types``, as the catalog spells it) cannot hold the source's
        values takes the sink's own type for it, and a NOT NULL column the source lets be NULL
        becomes nullable. Everything else of the target stays (extra columns, wider types,
        partitioning, its own indexes). Returns the SQL run."""

    @abstractmethod
    def _current(self, cur: Any, table: TargetTable) -> list[str] | None:
        """The target's column names (None: no such table)."""

    @abstractmethod
    def _table_ref(self, table: TargetTable, *, for_params: bool = False) -> str:
        """The quoted, qualified table name."""

    def _check_row_fits(self, cur: Any, estimate: int, sql: str, params: Sequence[Any] | None) -> None:
        """Raise the dialect's permanent error when a one-row statement (``estimate``: an upper
        bound of its bytes) is larger than the downstream takes (no limit unless a dialect says)."""

    def _adapt(self, column: ColumnV1 | None, value: Any) -> Any:
        """A decoded value as this driver should bind it (identity unless a dialect says otherwise)."""
        return value

    def _adapter(self, column: ColumnV1) -> Callable[[Any], Any] | None:
        """``_adapt`` for the values of one column, or None when it keeps them as they are: the
        upsert binds every column of every row, and a call per value adds up."""
        if type(self)._adapt is SqlSink._adapt:
            return None
        return functools.partial(self._adapt, column)

    def _literal_upsert(self, cur: Any, table: TargetTable,
                        columns: Sequence[str]) -> LiteralUpsert | None:
        """How this dialect spells an upsert with its rows' values as literal text, exactly as
        the driver would bind them, or None when it binds parameters. A driver that
        interpolates client side (pymysql) spends most of a multi-row upsert escaping value by
        value through its generic dispatch."""
        return None

    # ------------------------------------------------------------------ helpers

    def ident(self, name: str) -> str:
        return quote_ident(self.dialect, name)

    def pident(self, name: str) -> str:
        return quote_ident(self.dialect, name, for_params=True)

    def column_type(self, table: TargetTable, column: ColumnV1) -> str:
        return sql_type_for(self.dialect, column)

    @staticmethod
    def _columns(table: TargetTable) -> dict[str, ColumnV1]:
        return {c.name: c for c in table.meta.columns}

    _kept: Any = None
    """The connection ``_run(keep=True)`` left open for the next bulk load (``close``)."""

    def close(self) -> None:
        """Close the connection kept between bulk loads or writes, if any (the sink stays usable)."""
        conn, self._kept = self._kept, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                log.debug("close failed")

    def _run(self, work: Callable[[Any], T], what: str,
             retryable: Callable[[BaseException], bool] | None = None,
             connect: Callable[[], Any] | None = None, *, keep: bool = False,
             fence: WriteFence | None = None) -> T:
        """Run ``work(cursor)`` in one transaction on a fresh connection (``connect``, default
        ``_connect``), retrying the whole of it. ``keep``: the connection stays open after a
        commit for the next ``keep`` run (a copy's batches: a PostgreSQL connection is a new
        server process), until ``close``; one that failed is closed and the retry opens another.
        ``fence``: the transaction first checks the spans' write tokens (``write_fence``)."""
        retryable = retryable or self._retryable
        connect = connect or self._connect

        def once() -> T:
            conn = None
            try:
                if keep and self._kept is not None:
                    conn, self._kept = self._kept, None
                else:
                    conn = connect()
                self._begin(conn)
                cur = conn.cursor()
                try:
                    if fence is not None:
                        self._check_write_fence(cur, fence)
                    result = work(cur)
                finally:
                    cur.close()
                conn.commit()
                if keep:
                    self._kept, conn = conn, None
                return result
            except Exception as exc:
                if conn is not None:
                    try:
                        conn.rollback()
                    except Exception:  # the connection may be gone: the server rolls back anyway
                        log.debug("rollback failed after %s", type(exc).__name__)
                raise
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        log.debug("close failed")

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning("%s on %s: retrying (attempt %d/%d) in %.2fs after %s: %s", what,
                        self.db.redacted(), state.attempt_number + 1, self.max_attempts, delay,
                        type(exc).__name__, exc)

        retrying = Retrying(stop=stop_after_attempt(self.max_attempts), retry=retry_if_exception(retryable),
                            wait=self._backoff, before_sleep=log_retry, sleep=time.sleep, reraise=True)
        return retrying(once)

    def _backoff(self, state: RetryCallState) -> float:
        """Exponential from ``backoff_s`` up to ``max_backoff_s``, then 0.5-1.5x jitter so two
        victims of one deadlock do not collide again (tenacity's own jitter only adds)."""
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (state.attempt_number - 1))
        return float(delay * (0.5 + random.random()))

    # ------------------------------------------------------------------ statement building

    def _match(self, columns: Sequence[str], values: Sequence[Any], colmap: Mapping[str, ColumnV1],
               params: list[Any]) -> str:
        """``a = %s AND b IS NULL``: NULL-safe and still index-friendly on every dialect."""
        parts: list[str] = []
        for name, value in zip(columns, values, strict=True):
            if value is None:
                parts.append(f"{self.pident(name)} IS NULL")
            else:
                parts.append(f"{self.pident(name)} = {self.placeholder}")
                params.append(self._adapt(colmap.get(name), value))
        return " AND ".join(parts)

    def _where_keys(self, key: Sequence[str], keys: Sequence[tuple[Any, ...]],
                    colmap: Mapping[str, ColumnV1]) -> tuple[str, list[Any]]:
        params: list[Any] = []
        if len(key) == 1:
            col = colmap.get(key[0])
            present = [k[0] for k in keys if k[0] is not None]
            conds = []
            if present:
                marks = ", ".join([self.placeholder] * len(present))
                conds.append(f"{self.pident(key[0])} IN ({marks})")
                params.extend(self._adapt(col, v) for v in present)
            if len(present) < len(keys):
                conds.append(f"{self.pident(key[0])} IS NULL")
            return " OR ".join(conds), params
        conds = [f"({self._match(key, k, colmap, params)})" for k in keys]
        return " OR ".join(conds), params

    def _rows_per_statement(self, params_per_row: int) -> int:
        return max(1, min(self.chunk_rows, self.max_params // max(1, params_per_row)))

    def _size_chunks(self, rows: Sequence[T], per_row: int,
                     size: Callable[[T], int]) -> Iterator[Sequence[T]]:
        """Chunks bounded by row count, bind parameters and approximate statement bytes."""
        limit = self._rows_per_statement(per_row)
        start = 0
        while start < len(rows):
            end, total = start, 0
            while end < len(rows) and end - start < limit:
                total += size(rows[end])
                if end > start and total > self.max_statement_bytes:
                    break
                end += 1
            yield rows[start:end]
            start = end

    # ------------------------------------------------------------------ apply

    def apply_partition(self, table: TargetTable, changes: Iterable[Change],
                        guard: ConflictGuard | None = None, *, keep: bool = False) -> PartitionResult:
        if not table.key:
            raise ValueError(f"table {table.name!r} has no key: the apply path needs one")
        colmap = self._columns(table)
        missing = [c for c in table.key if c not in colmap]
        if missing:
            raise ValueError(f"key columns {missing} of {table.name!r} are not in its metadata")
        # The last change per key (their order is the sort's below).
        last: dict[tuple[Any, ...], Change] = {change.key: change for change in changes}
        if set(map(len, last)) - {len(table.key)}:
            bad = next(k for k in last if len(k) != len(table.key))
            raise ValueError(f"key {bad!r} does not match key columns {table.key}")
        ordered = sorted(last.values(), key=_key_order(list(last)))
        deletes = [c.key for c in ordered if isinstance(c, Delete)]
        upserts: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        shards: dict[tuple[Any, ...], int] = {}
        names = colmap.keys()
        key_names = set(table.key)
        for c in ordered:
            if isinstance(c, Upsert):
                if not names >= c.row.keys():
                    unknown = [name for name in c.row if name not in colmap]
                    if not table.leave_out_columns:
                        raise ValueError(f"row of {table.name!r} has columns not in its metadata: {unknown}")
                    c = Upsert(c.key, {k: v for k, v in c.row.items() if k in colmap}, c.shard)
                if type(c.row) is dict and key_names <= c.row.keys():
                    row = c.row  # only read from here on: no copy needed
                else:
                    row = dict(c.row)
                    for name, value in zip(table.key, c.key, strict=True):
                        row.setdefault(name, value)
                upserts.append((c.key, row))
                shards[c.key] = c.shard
        if not deletes and not upserts:
            return PartitionResult()

        def work(cur: Any) -> PartitionResult:
            if guard is not None:
                return self._apply(cur, table, colmap, deletes, upserts, _Guarded(guard, shards))
            return self._apply(cur, table, colmap, deletes, upserts)

        return self._run(work, f"apply partition of {table.name!r}", keep=keep, fence=table.fence)

    def _apply(self, cur: Any, table: TargetTable, colmap: Mapping[str, ColumnV1],
               deletes: Sequence[tuple[Any, ...]],
               upserts: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
               guarded: _Guarded | None = None) -> PartitionResult:
        result = PartitionResult()
        ref = self._table_ref(table, for_params=True)
        key = table.key
        for key_chunk in chunks(deletes, self._rows_per_statement(len(key))):
            cond, key_params = self._where_keys(key, key_chunk, colmap)
            cur.execute(f"DELETE FROM {ref} WHERE {cond}", key_params)
            result.deleted += max(cur.rowcount, 0)

        if guarded is not None:
            upserts = self._same_partition_conflicts(table, colmap, upserts, guarded, result)
        for unique in table.unique_keys:
            if not unique or set(unique) == set(key):
                continue  # the key itself: the upsert handles it
            holders = [(k, row) for k, row in upserts
                       if all(row.get(c) is not None for c in unique)]
            per_row = len(unique) + len(key)
            for holder_chunk in chunks(holders, self._rows_per_statement(per_row)):
                params: list[Any] = []
                conds = []
                for k, row in holder_chunk:
                    same_unique = self._match(unique, [row[c] for c in unique], colmap, params)
                    same_key = self._match(key, k, colmap, params)
                    conds.append(f"({same_unique} AND NOT ({same_key}))")
                if guarded is not None:
                    self._check_holders(cur, table, colmap, unique, holder_chunk, " OR ".join(conds),
                                        params, guarded, result)
                cur.execute(f"DELETE FROM {ref} WHERE {' OR '.join(conds)}", params)
                result.conflicts_removed += max(cur.rowcount, 0)

        # Rows normally all carry every column; group anyway so one statement has one shape.
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        order = list(colmap)
        every = tuple(order)
        for _, row in upserts:
            # A row's columns are among the table's (checked above): as many means all of them.
            cols = every if len(row) == len(every) else tuple(c for c in order if c in row)
            groups.setdefault(cols, []).append(row)
        for cols, rows in groups.items():
            column_list = [colmap[c] for c in cols]

            def row_size(row: dict[str, Any], cols: tuple[str, ...] = cols) -> int:
                return sum(_size_of(row[c]) for c in cols)

            adapters = [self._adapter(col) for col in column_list]
            plain = not any(adapters)
            values = operator.itemgetter(*cols)
            literal = self._literal_upsert(cur, table, cols) if guarded is None else None
            if literal is not None:
                result.upserted += self._upsert_rendered(cur, cols, rows, values, adapters, literal)
                continue
            for row_chunk in self._size_chunks(rows, len(cols), row_size):
                row_params: list[Any] = []
                for row in row_chunk:
                    if plain:
                        row_params.extend(values(row) if len(cols) > 1 else (row[cols[0]],))
                    else:
                        row_params.extend(v if adapt is None else adapt(v)
                                          for v, adapt in zip((row[c] for c in cols), adapters, strict=True))
                if guarded is not None:
                    sql = self._insert_after_delete(cur, table, colmap, cols, row_chunk)
                else:
                    sql = self._upsert_sql(table, cols, len(row_chunk))
                if len(row_chunk) == 1:  # multi-row statements stay under max_statement_bytes
                    self._check_row_fits(cur, row_size(row_chunk[0]), sql, row_params)
                cur.execute(sql, row_params)
                result.upserted += len(row_chunk)
        return result

    def _upsert_rendered(self, cur: Any, cols: tuple[str, ...],
                         rows: Sequence[dict[str, Any]], values: Callable[[dict[str, Any]], Any],
                         adapters: Sequence[Callable[[Any], Any] | None], literal: LiteralUpsert) -> int:
        """The upsert of ``rows`` as statements of rendered literals (``_literal_upsert``),
        each at most ``chunk_rows`` rows and ``max_statement_bytes`` (exact, not estimated)."""
        prefix, suffix, render = literal.prefix, literal.suffix, literal.render
        fixed = len(prefix) + len(suffix)
        texts: list[str] = []
        adapt_any = any(adapters)
        for row in rows:
            vals = values(row) if len(cols) > 1 else (row[cols[0]],)
            if adapt_any:
                vals = [v if adapt is None or v is None else adapt(v)
                        for v, adapt in zip(vals, adapters, strict=True)]
            texts.append(render(vals))
        limit = max(1, self.chunk_rows)
        start = 0
        while start < len(texts):
            end, total = start, fixed
            while end < len(texts) and end - start < limit:
                text = texts[end]
                # Bytes on the wire: the statement goes as UTF-8 (surrogates: raw bytes).
                total += (len(text) if text.isascii() else len(text.encode("utf8", "surrogateescape"))) + 1
                if end > start and total > self.max_statement_bytes:
                    break
                end += 1
            sql = prefix + ",".join(texts[start:end]) + suffix
            if end - start == 1:
                self._check_row_fits(cur, total, sql, None)
            cur.execute(sql)
            start = end
        return len(texts)

    def _insert_after_delete(self, cur: Any, table: TargetTable, colmap: Mapping[str, ColumnV1],
                             cols: tuple[str, ...], rows: Sequence[dict[str, Any]]) -> str:
        """A guarded target's upsert: delete by key, then a plain INSERT. MySQL's ON DUPLICATE
        KEY UPDATE would otherwise update *another* row that holds the unique value (a shard's
        row written concurrently by another partition); a plain INSERT fails instead, and the
        refusal path finds the conflict. Returns the INSERT to run with the rows' parameters."""
        keys = [tuple(row[c] for c in table.key) for row in rows]
        cond, params = self._where_keys(table.key, keys, colmap)
        cur.execute(f"DELETE FROM {self._table_ref(table, for_params=True)} WHERE {cond}", params)
        marks = "(" + ", ".join([self.placeholder] * len(cols)) + ")"
        return (f"INSERT INTO {self._table_ref(table, for_params=True)} "
                f"({', '.join(self.pident(c) for c in cols)}) VALUES {', '.join([marks] * len(rows))}")

    @staticmethod
    def _same_partition_conflicts(table: TargetTable, colmap: Mapping[str, ColumnV1],
                                  upserts: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
                                  guarded: _Guarded, result: PartitionResult
                                  ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Upserts of one partition that share a unique value: from different shards that is a
        cross-shard conflict (policy ``error``: raised; ``overwrite``: the last one in key order
        stays, the others are reported and left out)."""
        dropped: set[tuple[Any, ...]] = set()
        for unique in table.unique_keys:
            if not unique or set(unique) == set(table.key):
                continue
            by_value: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
            for k, row in upserts:
                value = tuple(row.get(c) for c in unique)
                if None not in value and k not in dropped:
                    by_value.setdefault(value, []).append(k)
            for value, keys in by_value.items():
                if len({guarded.shards.get(k, -1) for k in keys}) < 2:
                    continue
                keeper = keys[-1]
                guard = guarded.guard
                for other in keys[:-1]:
                    conflict = UniqueConflict(
                        target=guard.target, unique_key=tuple(unique), value=value,
                        shard=guard.shard_name(guarded.shards.get(keeper)), key=keeper,
                        other_shard=guard.shard_name(guarded.shards.get(other)), other_key=other,
                        action="refused" if guard.policy == "error" else "overwritten")
                    if guard.policy == "error":
                        raise UniqueConflictError(conflict)
                    result.overwritten.append(conflict.to_json())
                    dropped.add(other)
        return [(k, row) for k, row in upserts if k not in dropped]

    def _check_holders(self, cur: Any, table: TargetTable, colmap: Mapping[str, ColumnV1],
                       unique: Sequence[str], holders: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
                       cond: str, params: list[Any], guarded: _Guarded, result: PartitionResult) -> None:
        """Before the conflict delete: every row it would remove that another shard wrote is
        refused (policy ``error``: raises) or reported (``overwrite``)."""
        key = table.key
        wanted = list(dict.fromkeys([*key, *unique]))
        cols = ", ".join(self.pident(c) for c in wanted)
        cur.execute(f"SELECT {cols} FROM {self._table_ref(table, for_params=True)} WHERE {cond}", params)
        for raw in cur.fetchall():
            found = {c: normalize_fetched(colmap[c], v, self.dialect)
                     for c, v in zip(wanted, raw, strict=True)}
            holder_key = tuple(found[c] for c in key)
            value = tuple(found[c] for c in unique)
            # The upserted row that wants the value (compared as the downstream returned it).
            taker = next(((k, row) for k, row in holders
                          if tuple(normalize_fetched(colmap[c], row[c]) for c in unique) == value),
                         holders[0])
            shard = guarded.shards.get(taker[0], -1)
            guard = guarded.guard
            if guard.removable(shard, holder_key):
                continue
            conflict = UniqueConflict(
                target=guard.target, unique_key=tuple(unique), value=value, shard=guard.shard_name(shard),
                key=taker[0], other_shard=guard.shard_name(guard.owners.get(holder_key)),
                other_key=holder_key, action="refused" if guard.policy == "error" else "overwritten")
            if guard.policy == "error":
                raise UniqueConflictError(conflict)
            result.overwritten.append(conflict.to_json())

    # ------------------------------------------------------------------ reading

    # ------------------------------------------------------------------ write fence

    # Appended to the fence row's read: a shared lock held to the commit, so a new owner's bump
    # waits for this transaction (SQLite: BEGIN IMMEDIATE already holds the database's lock).
    fence_lock_clause: str = ""
    fence_text_type: str = "TEXT"

    def _fence_ref(self, schema: str | None, *, for_params: bool = False) -> str:
        q = self.pident if for_params else self.ident
        return f"{q(schema)}.{q(FENCE_TABLE)}" if schema else q(FENCE_TABLE)

    def _fence_bump_sql(self, ref: str) -> str:
        p = self.placeholder
        return (f"INSERT INTO {ref} AS f (span, token, owner) VALUES ({p}, 1, {p}) "
                "ON CONFLICT (span) DO UPDATE SET token = f.token + 1, owner = excluded.owner")

    def take_write_fences(self, schema: str | None, spans: Sequence[str],
                          owner: str) -> dict[str, int] | None:
        text = self.fence_text_type
        create = (f"CREATE TABLE IF NOT EXISTS {self._fence_ref(schema)} (span {text} NOT NULL PRIMARY KEY,"
                  f" token BIGINT NOT NULL, owner {text} NOT NULL)")
        ref = self._fence_ref(schema, for_params=True)

        # One transaction for the table and every span's bump: a writer stopped inside one
        # (SIGSTOP) holds SQLite's database lock, so the fewer the shorter that window.
        def bump(cur: Any) -> dict[str, int]:
            cur.execute(create)
            taken: dict[str, int] = {}
            for span in spans:
                cur.execute(self._fence_bump_sql(ref), (span, owner))
                cur.execute(f"SELECT token FROM {ref} WHERE span = {self.placeholder}", (span,))
                taken[span] = int(cur.fetchone()[0])
            return taken

        what = f"take the write fence of {len(spans)} span(s)"
        try:
            taken = self._run(bump, what)
        except Exception:
            # Two workers creating the table at once (PostgreSQL's catalog race): it exists now.
            taken = self._run(bump, what)
        log.info("write fence taken", extra={"schema": schema, "fence": taken})
        return taken

    def _check_write_fence(self, cur: Any, fence: WriteFence) -> None:
        ref = self._fence_ref(fence.schema, for_params=True)
        spans = [span for span, _ in fence.tokens]
        marks = ", ".join([self.placeholder] * len(spans))
        cur.execute(f"SELECT span, token FROM {ref} WHERE span IN ({marks}){self.fence_lock_clause}", spans)
        found = {str(span): int(token) for span, token in cur.fetchall()}
        for span, held in fence.tokens:
            if found.get(span) != held:
                raise WriteFenceLost(span, held, found.get(span))

    def _select_sql(self, table: TargetTable) -> str:
        cols = ", ".join(self.ident(c.name) for c in table.meta.columns)
        return f"SELECT {cols} FROM {self._table_ref(table)}"

    def fetch_rows(self, table: TargetTable) -> list[dict[str, Any]]:
        """Every row, decoded by ``libs.codec.decode.normalize_fetched`` and sorted by key."""
        columns = table.meta.columns
        sql = self._select_sql(table)

        def work(cur: Any) -> list[dict[str, Any]]:
            cur.execute(sql)
            return [{c.name: normalize_fetched(c, v, self.dialect) for c, v in zip(columns, raw, strict=True)}
                    for raw in cur.fetchall()]

        rows = self._run(work, f"fetch {table.name!r}")
        # Sorted here, on the decoded values: SQLite's TEXT-stored numbers would sort as text.
        rows.sort(key=lambda r: sort_key(tuple(r.get(k) for k in table.key)))
        return rows

    # ------------------------------------------------------------------ DDL helpers

    def _column_defs(self, table: TargetTable, types: Mapping[str, str] | None = None) -> list[str]:
        defs = []
        for column in table.meta.columns:
            sql_type = (types or {}).get(column.name) or self.column_type(table, column)
            # Key columns are NOT NULL, and the others as the source declares them when its
            # shape is known (``shape_ddl.not_null``).
            null = " NOT NULL" if not_null(table, column) else (" NULL" if self.dialect == "mysql" else "")
            before, after = self._column_clauses(table, column, sql_type)
            defs.append(f"{self.ident(column.name)} {sql_type}{before}{null}{after}")
        return defs

    def _column_clauses(self, table: TargetTable, column: ColumnV1, sql_type: str) -> tuple[str, str]:
        """(clauses before NULL/NOT NULL, clauses after it) the dialect gives the column from
        the source's shape (charset, collation, default, ...)."""
        return "", ""

    def _constraints(self, table: TargetTable) -> list[str]:
        out = [f"PRIMARY KEY ({', '.join(self.ident(k) for k in table.key)})"]
        out += [f"UNIQUE ({', '.join(self.ident(c) for c in unique)})"
                for unique in unnamed_unique_keys(table)]
        return out

    def index_statements(self, table: TargetTable) -> list[str]:
        """CREATE INDEX statements of the source's secondary indexes (dialects that cannot put
        them in CREATE TABLE)."""
        return []

    @staticmethod
    def _validate(table: TargetTable) -> None:
        if not table.key:
            raise ValueError(f"table {table.name!r} has no key: the apply path needs one")
        names = {c.name for c in table.meta.columns}
        missing = [k for k in table.key if k not in names]
        if missing:
            raise ValueError(f"key columns {missing} of {table.name!r} are not in its metadata")
