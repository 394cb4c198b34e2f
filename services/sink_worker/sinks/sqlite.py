"""SQLite sink (sqlite3), the embedded default.

Parallel partitions are serialised by SQLite itself: WAL (readers never block the writer), a
busy timeout, and ``BEGIN IMMEDIATE`` so a transaction takes the write lock before its first
statement. A deferred transaction would take it at the first write instead, and two of those
upgrading at once fail with SQLITE_BUSY immediately (the busy handler cannot resolve that).

SQLite has no exact wide number types, so some values are stored as canonical text, one
spelling per value so that key lookups by equality still match (see ``values._sqlite_type``):
decimals with exactly the column's scale, bigint unsigned / bit(64) as decimal digits, datetimes
with the column's fractional digits, TIME as ``[-]HH:MM:SS[.f]``. A geometry is a BLOB of
EWKB (``libs.codec.geometry``): plain WKB for SRID 0, the SRID in the header otherwise.

``TargetTable.schema`` is ignored: one SQLite file is one namespace.

The initial load's bulk path (``load_rows``) is one ``executemany`` of ``INSERT OR REPLACE`` in
one transaction: REPLACE removes the rows colliding on the key or any unique key, which is the
apply path's conflict delete plus upsert in one statement.
"""

from __future__ import annotations

import functools
import re
import sqlite3
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import date, datetime, timedelta
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

from contracts.events.rows import ColumnV1
from libs.codec.decode import (
    SqlTypeError,
    format_datetime,
    format_time,
    parse_sql_type,
    parse_time,
    sql_type_for,
)
from libs.codec.geometry import internal_to_ewkb
from libs.target_definitions import sqlite_definition_of
from libs.target_fit import TargetDefinition
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.shape_ddl import (
    column_shapes,
    folds_case,
    missing_derived,
    not_null,
    owned_index_drops,
    sqlite_default,
    sqlite_index_statement,
    table_shape,
    target_indexes,
)
from services.sink_worker.sinks.sql_common import _KEY_PREFIX, SqlSink
from services.sink_worker.sinks.write_fence import FENCE_TABLE

_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _identity(value: Any) -> Any:
    return value


@functools.lru_cache(maxsize=1024)
def _adapter(kind: str, sql_type: str) -> Callable[[Any], Any]:
    """How to bind a value of this column (cached: it runs for every value of every row)."""
    column = ColumnV1(name="x", kind=kind, sql_type=sql_type)
    try:
        args = parse_sql_type(sql_type).args
    except SqlTypeError:
        args = ()
    if kind == "geometry":
        return internal_to_ewkb  # EWKB: the WKB with its SRID (libs.codec.geometry)
    if kind in ("int", "bit"):
        if sql_type_for("sqlite", column) == "TEXT":
            return lambda v: str(int(v))
        return int
    if kind == "decimal":
        if not args:
            # Scale unknown (capture's binlog fallback): one spelling per number still.
            def decimal_plain(v: Any) -> str:
                d = Decimal(str(v))
                return "0" if d == 0 else format(d.normalize(), "f")

            return decimal_plain
        scale = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        quantum = Decimal(1).scaleb(-scale)

        def decimal_text(v: Any) -> str:
            with localcontext() as ctx:
                ctx.prec = 200
                return format(Decimal(str(v)).quantize(quantum), "f")

        return decimal_text
    fsp = min(args[0], 6) if args and isinstance(args[0], int) else 0
    if kind in ("datetime", "timestamp"):
        def datetime_text(v: Any) -> str:
            value = v if isinstance(v, datetime) else datetime.fromisoformat(str(v))
            return format_datetime(value, fsp)

        return datetime_text
    if kind == "date":
        return lambda v: v.isoformat() if isinstance(v, date) else date.fromisoformat(str(v)).isoformat()
    if kind == "time":
        return lambda v: format_time(v if isinstance(v, timedelta) else parse_time(str(v)), fsp)
    if kind == "float":
        return float
    return _identity


class SQLiteSink(SqlSink):
    dialect = "sqlite"
    placeholder = "?"
    max_params = 999  # SQLITE_MAX_VARIABLE_NUMBER of older builds
    truncate_verb = "DELETE FROM"

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.busy_timeout_s = busy_timeout_s

    def _connect(self) -> Any:
        path = Path(self.db.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves (see the module docstring).
        conn = sqlite3.connect(str(path), timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError:
            conn.close()
            raise
        return conn

    def _begin(self, conn: Any) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def _retryable(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and (code & 0xFF) in _BUSY:
            return True
        return "locked" in str(exc) or "busy" in str(exc)

    def _table_ref(self, table: TargetTable, *, for_params: bool = False) -> str:
        return self.ident(table.name)

    def _fence_ref(self, schema: str | None, *, for_params: bool = False) -> str:
        return self.ident(FENCE_TABLE)  # one database: the schema is not a namespace here

    def _adapt(self, column: ColumnV1 | None, value: Any) -> Any:
        if value is None or column is None:
            return value
        return _adapter(column.kind, column.sql_type)(value)

    # ------------------------------------------------------------------ DDL

    def _column_clauses(self, table: TargetTable, column: ColumnV1, sql_type: str) -> tuple[str, str]:
        shape = column_shapes(table).get(column.name)
        default = sqlite_default(column, shape) if shape is not None else None
        after = f" DEFAULT {default}" if default is not None else ""
        return "", after + (" COLLATE NOCASE" if folds_case(table, column) else "")

    def create_statements(self, table: TargetTable, name: str | None = None) -> list[str]:
        """The table and its indexes; under another ``name`` (a rebuild's copy) the table alone:
        index names are the target's, created once the copy has its name."""
        self._validate(table)
        body = ",\n  ".join([*self._column_defs(table), *self._constraints(table)])
        ref = self.ident(name) if name else self._table_ref(table)
        create = f"CREATE TABLE IF NOT EXISTS {ref} (\n  {body}\n)"
        return [create] if name else [create, *self.index_statements(table)]

    def index_statements(self, table: TargetTable) -> list[str]:
        found = (sqlite_index_statement(self.ident, table, i) for i in target_indexes(table))
        return [sql for sql in found if sql is not None]

    def ensure_table(self, table: TargetTable) -> None:
        statements = self.create_statements(table)
        self._run(lambda cur: self._create_marked(cur, table, statements), f"create {table.name!r}")

    def _current(self, cur: Any, table: TargetTable) -> list[str] | None:
        cur.execute("SELECT name FROM pragma_table_info(?)", (table.name,))
        names = [str(r[0]) for r in cur.fetchall()]
        return names or None

    def reconcile_schema(self, table: TargetTable, drop: Collection[str] = ()) -> list[str]:
        self._validate(table)
        named = {c.casefold() for c in drop}

        def work(cur: Any) -> list[str]:
            current = self._current(cur, table)
            if current is None:
                return self._create_marked(cur, table, self.create_statements(table))
            # SQLite column names are case-insensitive, like MySQL's.
            have = {c.casefold() for c in current}
            want = {c.name.casefold() for c in table.meta.columns}
            keep = {k.casefold() for k in table.key}
            drop = [c for c in current
                    if c.casefold() in named and c.casefold() not in want and c.casefold() not in keep]
            loosened: list[str] = []
            if drop and table.keep_columns:
                loosened = self._loosen(cur, table, drop)  # lenient: kept, nullable (run already)
            elif drop:
                return self._rebuild(cur, table, current, drop)
            statements = [f"ALTER TABLE {self._table_ref(table)} ADD COLUMN {self.ident(c.name)} "
                          f"{sql_type}{''.join(self._column_clauses(table, c, sql_type))}"
                          for c in table.meta.columns if c.name.casefold() not in have
                          for sql_type in (self.column_type(table, c),)]
            statements += self._index_sync(cur, table)
            for sql in statements:
                cur.execute(sql)
            return loosened + statements

        return self._run(work, f"reconcile {table.name!r}")

    def _definition(self, cur: Any, table: TargetTable) -> TargetDefinition | None:
        return sqlite_definition_of(cur, table.name)

    def widen_in_place(self, table: TargetTable, types: Mapping[str, str]) -> list[str]:
        """SQLite columns take any value of any type: only a NOT NULL the source does not have
        goes (``_loosen``: the table rebuilt from its own definition)."""
        self._validate(table)
        loose = [c.name for c in table.meta.columns if c.name.casefold() in {n.casefold() for n in types}
                 and not not_null(table, c)]
        return self._run(lambda cur: self._loosen(cur, table, loose) if loose else [],
                         f"widen {table.name!r}")

    def _restore_sql(self, table: TargetTable, kept: TargetTable, key: Sequence[str],
                     cols: Sequence[str]) -> str:
        # SQLite's UPDATE ... FROM names the updated table by its own name, not an alias.
        ref = self._table_ref(table)
        on = " AND ".join(f"{ref}.{self.ident(k)} = s.{self.ident(_KEY_PREFIX + k)}" for k in key)
        sets = ", ".join(f"{self.ident(c)} = s.{self.ident(c)}" for c in cols)
        return f"UPDATE {ref} SET {sets} FROM {self._table_ref(kept)} AS s WHERE {on}"

    def _index_sync(self, cur: Any, table: TargetTable) -> list[str]:
        """Statements bringing the target's secondary indexes to the source's (when the
        metadata carries its shape), as the PostgreSQL sink does."""
        if table_shape(table) is None:
            return []
        cur.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (table.name,))
        found = [str(r[0]) for r in cur.fetchall()]
        drops = [f"DROP INDEX IF EXISTS {self.ident(n)}" for n in owned_index_drops(table, found)]
        creates = (sqlite_index_statement(self.ident, table, i) for i in missing_derived(table, found))
        return drops + [sql for sql in creates if sql is not None]

    def _loosen(self, cur: Any, table: TargetTable, names: Sequence[str]) -> list[str]:
        """Make the NOT NULL ones of ``names`` nullable: SQLite cannot alter a column, so the
        table is rebuilt from its own stored definition with those NOT NULLs taken out (the
        rest of it, collations, defaults, constraints and indexes, as it was)."""
        cur.execute("SELECT name FROM pragma_table_info(?) WHERE \"notnull\" = 1", (table.name,))
        strict = {str(r[0]).casefold() for r in cur.fetchall()} & {n.casefold() for n in names}
        if not strict:
            return []
        cur.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table.name,))
        create = str(cur.fetchone()[0])
        open_at, close_at = create.index("("), create.rindex(")")
        parts = _top_level_split(create[open_at + 1:close_at])
        for i, part in enumerate(parts):
            first = part.strip().split(None, 1)[0] if part.strip() else ""
            if first.strip('"`[]').casefold() in strict:
                parts[i] = re.sub(r"\s+NOT\s+NULL\b", "", part, flags=re.IGNORECASE)
        temp = f"{table.name}__sluice_rebuild"
        cur.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL",
                    (table.name,))
        indexes = [str(r[0]) for r in cur.fetchall()]
        statements = [
            f"DROP TABLE IF EXISTS {self.ident(temp)}",
            f"CREATE TABLE {self.ident(temp)} (" + ",".join(parts) + create[close_at:],
            f"INSERT INTO {self.ident(temp)} SELECT * FROM {self._table_ref(table)}",
            f"DROP TABLE {self._table_ref(table)}",
            f"ALTER TABLE {self.ident(temp)} RENAME TO {self._table_ref(table)}",
            *indexes,
        ]
        for sql in statements:
            cur.execute(sql)
        return statements

    def _rebuild(self, cur: Any, table: TargetTable, current: Sequence[str],
                 drop: Sequence[str]) -> list[str]:
        """Drop columns by copying into a new table: SQLite's DROP COLUMN refuses columns that an
        index or UNIQUE constraint uses, and rewrites the whole table anyway. The target's own
        columns (neither the source's nor dropped) come along with their type and default."""
        temp = f"{table.name}__sluice_rebuild"
        have = {c.casefold() for c in current}
        want = {c.name.casefold() for c in table.meta.columns}
        gone = {c.casefold() for c in drop}
        cur.execute("SELECT name, type, \"notnull\", dflt_value FROM pragma_table_info(?)", (table.name,))
        extra = [(str(n), str(t or ""), bool(nn), d) for n, t, nn, d in cur.fetchall()
                 if str(n).casefold() not in want and str(n).casefold() not in gone]
        # ADD COLUMN takes NOT NULL only with a default.
        add = [f"ALTER TABLE {self.ident(temp)} ADD COLUMN {self.ident(n)} {t}"
               + (f" DEFAULT {d}" if d is not None else "") + (" NOT NULL" if nn and d is not None else "")
               for n, t, nn, d in extra]
        common = ", ".join([*(self.ident(c.name) for c in table.meta.columns if c.name.casefold() in have),
                            *(self.ident(n) for n, _, _, _ in extra)])
        statements = [
            f"DROP TABLE IF EXISTS {self.ident(temp)}",
            *self.create_statements(table, name=temp),
            *add,
            f"INSERT INTO {self.ident(temp)} ({common}) SELECT {common} FROM {self._table_ref(table)}",
            f"DROP TABLE {self._table_ref(table)}",
            f"ALTER TABLE {self.ident(temp)} RENAME TO {self._table_ref(table)}",
            *self.index_statements(table),
        ]
        for sql in statements:
            cur.execute(sql)
        return statements

    # ------------------------------------------------------------------ DML

    def _connect_load(self) -> Any:
        conn = self._connect()
        # A bigger page cache (64 MiB) for the index pages a large load touches, and sorting in
        # memory. `synchronous` stays as it is: a copied chunk is recorded as done once its
        # commit returns, so the commit must be durable.
        conn.execute("PRAGMA cache_size = -65536")
        conn.execute("PRAGMA temp_store = MEMORY")
        return conn

    def load_rows(self, table: TargetTable, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  *, keys_unique: bool = True) -> int:
        if not rows:
            return 0
        self._validate(table)
        colmap = self._columns(table)
        adapters = [_adapter(colmap[c].kind, colmap[c].sql_type) for c in columns]
        bound: Sequence[Sequence[Any]] = rows
        if any(a is not _identity for a in adapters):
            bound = [tuple(None if v is None else adapt(v) for v, adapt in zip(row, adapters, strict=True))
                     for row in rows]
        marks = ", ".join(["?"] * len(columns))
        sql = (f"INSERT OR REPLACE INTO {self._table_ref(table)}"
               f" ({', '.join(self.ident(c) for c in columns)}) VALUES ({marks})")
        self._run(lambda cur: cur.executemany(sql, bound), f"load into {table.name!r}",
                  connect=self._connect_load, keep=True, fence=table.fence)
        return len(rows)

    def _upsert_sql(self, table: TargetTable, columns: Sequence[str], nrows: int) -> str:
        cols = ", ".join(self.ident(c) for c in columns)
        row = "(" + ", ".join(["?"] * len(columns)) + ")"
        values = ", ".join([row] * nrows)
        key = set(table.key)
        conflict = ", ".join(self.ident(k) for k in table.key)
        updates = [f"{self.ident(c)} = excluded.{self.ident(c)}" for c in columns if c not in key]
        action = f"DO UPDATE SET {', '.join(updates)}" if updates else "DO NOTHING"
        return (f"INSERT INTO {self._table_ref(table)} ({cols}) VALUES {values}"
                f" ON CONFLICT ({conflict}) {action}")


def _top_level_split(body: str) -> list[str]:
    """``body`` split at the commas outside parentheses and quotes."""
    parts: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for ch in body:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"`[":
            quote = "]" if ch == "[" else ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts
